"""The ``chatflow-sqlalchemy`` console script and the offline demo."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from chatflow_agent import Message, Role, Runner
from sqlalchemy import Table, insert

from chatflow_sqlalchemy import migrate
from chatflow_sqlalchemy.backends.sqlite import SQLiteSessionStore
from chatflow_sqlalchemy.cli import main
from chatflow_sqlalchemy.demo import ScriptedEngine, build_agents, run_demo
from chatflow_sqlalchemy.models import ChatflowProcessedMessage

HEAD = migrate.head_revision()
SESSION = "wa:+15550001"
OTHER = "tg:42"
PG_URL_WITH_PASSWORD = "postgresql+psycopg://u:sekret@127.0.0.1:1/db"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHATFLOW_DATABASE_URL", raising=False)
    monkeypatch.delenv("CHATFLOW_AUTO_MIGRATE", raising=False)


def url_of(path: Path) -> str:
    return f"sqlite:///{path}"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_error_line(err: str, out: str = "") -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    assert "Traceback" not in err + out
    return lines[0]


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """A database with two conversations written by the real Runner."""
    path = tmp_path / "chat.db"
    store = SQLiteSessionStore(str(path), default_max_turns=10)
    agents = build_agents()
    runner = Runner(starting_agent=agents["Support"], session_store=store, engine=ScriptedEngine())

    async def converse() -> None:
        await runner.run_async(SESSION, "Where is my order 404?", metadata={"channel": "wa"})
        await runner.run_async(SESSION, "I want a refund for order 404")
        await runner.run_async(OTHER, "hello there")

    try:
        asyncio.run(converse())
        session = store.get(SESSION)
        assert session is not None
        session.add_message(Message(role=Role.SYSTEM, content="Be brief."))
    finally:
        store.close()
    return path


def stored_history(path: Path, session_id: str) -> list[Message]:
    with SQLiteSessionStore(str(path)) as store:
        session = store.get(session_id)
        assert session is not None
        return list(session.history)


# --------------------------------------------------------------------------- db


def test_db_current_on_empty_file_says_none_then_head_after_upgrade(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = url_of(tmp_path / "empty.db")
    code, out, _ = run(capsys, "--url", url, "db", "current")
    assert code == 0
    assert "none" in out
    assert "chatflow-sqlalchemy db upgrade" in out

    code, out, _ = run(capsys, "--url", url, "db", "upgrade")
    assert code == 0
    assert f"to {HEAD} (head)" in out

    code, out, _ = run(capsys, "--url", url, "db", "current")
    assert code == 0
    assert f"{HEAD} (head)" in out
    assert "none" not in out

    code, out, _ = run(capsys, "--url", url, "db", "upgrade")
    assert code == 0
    assert "already at" in out


def test_db_upgrade_adopts_a_chatflow_agent_database(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import chatflow_agent

    path = tmp_path / "upstream.db"
    upstream = chatflow_agent.SQLiteSessionStore(str(path))
    agent = chatflow_agent.Agent(name="Legacy", instructions="")
    session = upstream.get_or_create("old", agent, {"k": 1})
    session.add_message(Message(role=Role.USER, content="hi from 0.3.4"))
    session.add_message(Message(role=Role.MODEL, content="hello"))
    assert upstream.record_processed_message("wamid.legacy")

    code, out, _ = run(capsys, "--url", url_of(path), "db", "current")
    assert code == 0
    assert "unversioned chatflow tables" in out
    assert run(capsys, "--url", url_of(path), "db", "upgrade")[0] == 0
    assert run(capsys, "--url", url_of(path), "db", "check")[0] == 0
    code, out, _ = run(capsys, "--url", url_of(path), "sessions", "show", "old")
    assert code == 0
    assert "active agent: Legacy" in out
    assert "[user] hi from 0.3.4" in out
    assert "[model] hello" in out
    with SQLiteSessionStore(str(path)) as store:
        assert store.is_message_processed("wamid.legacy")


def test_db_commands_do_not_migrate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "untouched.db"
    for argv in (["db", "current"], ["db", "check"]):
        run(capsys, "--url", url_of(path), *argv)
    with sqlite3.connect(path) as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    assert "chatflow_sessions" not in tables


def test_db_check_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = url_of(tmp_path / "check.db")
    code, out, _ = run(capsys, "--url", url, "db", "check")
    assert code == 1
    assert "chatflow-sqlalchemy db upgrade" in out

    assert run(capsys, "--url", url, "db", "upgrade")[0] == 0
    code, out, _ = run(capsys, "--url", url, "db", "check")
    assert code == 0, out
    assert "ok" in out

    code, out, _ = run(capsys, "--url", url, "db", "downgrade", "0001")
    assert code == 0
    assert f"from {HEAD} to 0001" in out
    code, out, _ = run(capsys, "--url", url, "db", "check")
    assert code == 1
    assert "0001" in out
    assert "chatflow-sqlalchemy db upgrade" in out


def test_db_check_reports_drift(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = url_of(tmp_path / "drift.db")
    assert run(capsys, "--url", url, "db", "upgrade", "0001")[0] == 0
    # Claim head without running 0002: the tables still have the old shape.
    assert run(capsys, "--url", url, "db", "stamp", HEAD)[0] == 0
    code, out, _ = run(capsys, "--url", url, "db", "check")
    assert code == 1
    assert "drift" in out
    assert "seq" in out  # the column 0002 adds


def test_db_downgrade_to_base_and_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "base.db"
    url = url_of(path)
    assert run(capsys, "--url", url, "db", "upgrade")[0] == 0
    code, out, _ = run(capsys, "--url", url, "db", "downgrade", "base")
    assert code == 0
    assert "none" in out
    with sqlite3.connect(path) as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    assert "chatflow_sessions" not in tables
    assert run(capsys, "--url", url, "db", "upgrade")[0] == 0
    assert run(capsys, "--url", url, "db", "check")[0] == 0


def test_db_history_lists_the_chain(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "db", "history")
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) == len(migrate.history())
    assert f"-> {HEAD} (head)" in lines[0]
    assert "0001" in out
    assert "<base>" in out


def test_db_stamp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = url_of(tmp_path / "stamp.db")
    assert run(capsys, "--url", url, "db", "upgrade")[0] == 0
    code, out, _ = run(capsys, "--url", url, "db", "stamp", "0001")
    assert code == 0
    assert "stamped revision 0001" in out
    assert f"was {HEAD}" in out
    _, out, _ = run(capsys, "--url", url, "db", "current")
    assert "0001" in out
    assert run(capsys, "--url", url, "db", "stamp", "head")[0] == 0
    _, out, _ = run(capsys, "--url", url, "db", "current")
    assert f"{HEAD} (head)" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["db", "upgrade", "nosuchrev"],
        ["db", "downgrade", "nosuchrev"],
        ["db", "stamp", "nosuchrev"],
    ],
)
def test_unknown_revision_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    url = url_of(tmp_path / "rev.db")
    assert run(capsys, "--url", url, "db", "upgrade")[0] == 0
    code, out, err = run(capsys, "--url", url, *argv)
    assert code == 2
    assert "nosuchrev" in assert_one_error_line(err, out)


def test_url_from_environment_and_after_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    env_db = tmp_path / "env.db"
    monkeypatch.setenv("CHATFLOW_DATABASE_URL", url_of(env_db))
    assert run(capsys, "db", "upgrade")[0] == 0
    _, out, _ = run(capsys, "db", "current")
    assert str(env_db) in out
    assert f"{HEAD} (head)" in out

    flag_db = tmp_path / "flag.db"
    _, out, _ = run(capsys, "db", "current", "--url", url_of(flag_db))
    assert str(flag_db) in out
    assert "none" in out


def test_default_url_is_chatflow_db_in_cwd(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert run(capsys, "db", "upgrade")[0] == 0
    assert (tmp_path / "chatflow.db").exists()


# --------------------------------------------------------------------------- errors


def test_bad_url_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["db", "current"], ["sessions", "list"], ["db", "check"]):
        code, out, err = run(capsys, "--url", "nosuchdialect://x", *argv)
        assert code == 2
        assert "nosuchdialect" in assert_one_error_line(err, out)
    code, out, err = run(capsys, "--url", "this is not a url", "db", "current")
    assert code == 2
    assert_one_error_line(err, out)


@pytest.mark.parametrize("argv", [["db", "current"], ["db", "upgrade"], ["sessions", "list"]])
def test_unreachable_database_hides_the_password(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, out, err = run(capsys, "--url", PG_URL_WITH_PASSWORD, *argv)
    assert code == 2
    line = assert_one_error_line(err, out)
    assert "sekret" not in out + err
    assert "127.0.0.1" in line


def test_schema_ahead_names_found_and_expected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ahead.db"
    assert run(capsys, "--url", url_of(path), "db", "upgrade")[0] == 0
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE chatflow_alembic_version SET version_num='9999'")
    for argv in (
        ["db", "current"],
        ["db", "check"],
        ["db", "upgrade"],
        ["sessions", "list"],
        ["dedup", "purge"],
    ):
        code, out, err = run(capsys, "--url", url_of(path), *argv)
        assert code == 2, argv
        line = assert_one_error_line(err, out)
        assert "9999" in line
        assert HEAD in line


def test_not_a_database_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "junk.db"
    path.write_bytes(b"this is not an SQLite database, just some text " * 40)
    for argv in (["db", "current"], ["sessions", "list"]):
        code, out, err = run(capsys, "--url", url_of(path), *argv)
        assert code == 2
        assert "junk.db" in assert_one_error_line(err, out)


def test_redact_masks_the_password_in_any_message() -> None:
    from argparse import Namespace

    from chatflow_sqlalchemy.cli import _redact

    args = Namespace(url="postgresql://u:p%40ss-word@h/db")
    message = "boom postgresql://u:p%40ss-word@h/db and p@ss-word"
    assert "ss-word" not in _redact(message, args)
    short = Namespace(url="postgresql://u:ab@h/db")
    assert _redact("x://u:ab@h about ab", short) == "x://u:***@h about ab"


def test_missing_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["db"]) == 2
    assert main(["--help"]) == 0
    assert "sessions" in capsys.readouterr().out


# --------------------------------------------------------------------------- sessions


def test_sessions_list(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--url", url_of(db), "sessions", "list")
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0].split() == ["SESSION", "ACTIVE", "AGENT", "MESSAGES", "UPDATED"]
    # SESSION got a system message last, so it was updated most recently.
    assert lines[1].split()[:3] == [SESSION, "Billing", str(len(stored_history(db, SESSION)))]
    assert lines[2].split()[:3] == [OTHER, "Support", "2"]


def test_sessions_list_empty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--url", url_of(tmp_path / "none.db"), "sessions", "list")
    assert code == 0
    assert "no sessions" in out


def test_sessions_show_groups_by_turn(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--url", url_of(db), "sessions", "show", SESSION)
    assert code == 0, out
    assert "active agent: Billing" in out
    assert '"channel": "wa"' in out
    lines = out.splitlines()
    system, turn1, turn2 = lines.index("System"), lines.index("Turn 1"), lines.index("Turn 2")
    assert system < turn1 < turn2
    assert "Turn 3" not in lines
    assert "Be brief." in lines[system + 1]
    first_turn = "\n".join(lines[turn1:turn2])
    assert "[user] Where is my order 404?" in first_turn
    assert 'tool call check_order_status {"order_id": "404"}' in first_turn
    assert "tool result check_order_status is_error=False" in first_turn
    assert '"status"' in first_turn
    second_turn = "\n".join(lines[turn2:])
    assert "tool call transfer_to_billing" in second_turn
    assert "HANDOFF_SUCCESS" in second_turn
    assert "tool call issue_refund" in second_turn


def test_sessions_show_unknown_session_exits_1(
    db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "--url", url_of(db), "sessions", "show", "nobody")
    assert code == 1
    assert "nobody" in assert_one_error_line(err, out)


def test_sessions_show_points_at_corrupt_rows(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with sqlite3.connect(db) as conn:
        row_id = conn.execute(
            "SELECT max(id) FROM chatflow_messages WHERE session_id = ?", (SESSION,)
        ).fetchone()[0]
        conn.execute("UPDATE chatflow_messages SET message_json = '{oops' WHERE id = ?", (row_id,))
    code, out, err = run(capsys, "--url", url_of(db), "sessions", "show", SESSION)
    assert code == 1
    assert f"CORRUPT ROW id {row_id}" in out
    assert "Turn 2" in out  # the readable rows are still shown
    assert str(row_id) in assert_one_error_line(err, out)
    # Loading it through the store fails with one line naming session and row.
    code, out, err = run(capsys, "--url", url_of(db), "sessions", "export")
    assert code == 2
    line = assert_one_error_line(err)
    assert SESSION in line
    assert str(row_id) in line


def test_sessions_delete(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--url", url_of(db), "sessions", "delete", OTHER)
    assert code == 0
    assert OTHER in out
    _, out, _ = run(capsys, "--url", url_of(db), "sessions", "list")
    assert OTHER not in out
    assert SESSION in out

    code, out, err = run(capsys, "--url", url_of(db), "sessions", "delete", OTHER)
    assert code == 1
    assert OTHER in assert_one_error_line(err, out)
    with sqlite3.connect(db) as conn:
        orphans = conn.execute(
            "SELECT count(*) FROM chatflow_messages WHERE session_id = ?", (OTHER,)
        ).fetchone()[0]
    assert orphans == 0


def _check_export(lines: list[str], db: Path) -> None:
    records = [json.loads(line) for line in lines]
    assert [r["session_id"] for r in records] == [SESSION, OTHER]
    for record in records:
        assert set(record) == {"session_id", "active_agent_name", "metadata", "messages"}
        history = stored_history(db, record["session_id"])
        assert [Message.model_validate(m) for m in record["messages"]] == history
        assert record["messages"] == [m.model_dump(mode="json") for m in history]
    assert records[0]["active_agent_name"] == "Billing"
    assert records[0]["metadata"] == {"channel": "wa"}
    assert records[1]["metadata"] == {}


def test_sessions_export_to_stdout(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--url", url_of(db), "sessions", "export")
    assert code == 0
    _check_export(out.splitlines(), db)


def test_sessions_export_to_file(
    db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "export.jsonl"
    code, out, _ = run(capsys, "--url", url_of(db), "sessions", "export", "--output", str(target))
    assert code == 0
    assert "exported 2 session(s)" in out
    _check_export(target.read_text(encoding="utf-8").splitlines(), db)
    assert not list(tmp_path.glob("*.partial"))


# --------------------------------------------------------------------------- dedup, backends


def test_dedup_purge(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with SQLiteSessionStore(str(db)) as store:
        assert store.record_processed_message("wamid.fresh")
        table: Any = ChatflowProcessedMessage.__table__
        assert isinstance(table, Table)
        with store.engine.begin() as conn:
            conn.execute(
                insert(table),
                [
                    {
                        "message_id": f"wamid.old{i}",
                        "processed_at": datetime(2000, 1, 1, tzinfo=timezone.utc),
                    }
                    for i in range(3)
                ],
            )
    code, out, _ = run(capsys, "--url", url_of(db), "dedup", "purge")
    assert code == 0
    assert "removed 3 expired" in out
    with SQLiteSessionStore(str(db)) as store:
        assert store.is_message_processed("wamid.fresh")
        assert not store.is_message_processed("wamid.old0")
    _, out, _ = run(capsys, "--url", url_of(db), "dedup", "purge")
    assert "removed 0 expired" in out


def test_backends(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "backends")
    assert code == 0
    assert "chatflow_sqlalchemy.backends.sqlite.SQLiteSessionStore" in out
    assert "postgresql" in out


# --------------------------------------------------------------------------- demo


DEMO_WORDS = ("handoff", "restart", "pruning", "duplicate", "rollback")


def test_demo_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "demo.db"
    code, out, err = run(capsys, "demo", "--db", str(path))
    assert code == 0, err
    lowered = out.lower()
    for word in DEMO_WORDS:
        assert word in lowered, word
    assert path.exists()
    # The demo's database is a normal one the other commands can read.
    code, out, _ = run(capsys, "--url", url_of(path), "db", "check")
    assert code == 0
    code, out, _ = run(capsys, "--url", url_of(path), "sessions", "list")
    assert "Support" in out

    # It never reuses an existing file.
    code, out, err = run(capsys, "demo", "--db", str(path))
    assert code == 2
    assert "exists" in assert_one_error_line(err, out)


def test_demo_default_path_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "demo")
    assert code == 0
    printed = next(line for line in out.splitlines() if line.startswith("database: "))
    path = Path(printed.removeprefix("database: ").split(" (SQLite)")[0])
    try:
        assert path.exists()
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)


def test_run_demo_with_custom_output(tmp_path: Path) -> None:
    lines: list[str] = []
    run_demo(str(tmp_path / "d.db"), lines.append)
    assert lines[-2] == "All steps behaved as described."


def test_scripted_engine_failure_word_raises_and_runner_rolls_back(tmp_path: Path) -> None:
    agents = build_agents()
    with SQLiteSessionStore(str(tmp_path / "x.db")) as store:
        runner = Runner(
            starting_agent=agents["Support"], session_store=store, engine=ScriptedEngine()
        )
        runner.run("s", "Where is order 7?")
        with pytest.raises(RuntimeError, match="outage"):
            runner.run("s", "please crash")
        session = store.get("s")
        assert session is not None
        assert [m.role for m in session.history] == [Role.USER, Role.MODEL, Role.TOOL, Role.MODEL]
        ids = [c.id for m in session.history for c in m.tool_calls or []]
        assert len(ids) == len(set(ids)) == 1


# --------------------------------------------------------------------------- console script


def _console_script() -> str:
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    script = shutil.which("chatflow-sqlalchemy", path=search)
    assert script, "the chatflow-sqlalchemy console script is not installed (pip install -e .)"
    return script


def test_console_script_end_to_end(tmp_path: Path) -> None:
    script = _console_script()
    env = {k: v for k, v in os.environ.items() if k != "CHATFLOW_DATABASE_URL"}
    path = tmp_path / "demo.db"

    result = subprocess.run(
        [script, "demo", "--db", str(path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    for word in DEMO_WORDS:
        assert word in result.stdout.lower()

    result = subprocess.run(
        [script, "--url", url_of(path), "db", "current"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert f"{HEAD} (head)" in result.stdout

    env["CHATFLOW_DATABASE_URL"] = PG_URL_WITH_PASSWORD
    result = subprocess.run(
        [script, "sessions", "list"], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 2
    assert_one_error_line(result.stderr, result.stdout)
    assert "sekret" not in result.stdout + result.stderr
