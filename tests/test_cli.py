"""The ``chatflow-sqlalchemy`` console script (Click + Rich) and the offline demo."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from chatflow_agent import Message, Role, Runner
from sqlalchemy import Table, insert

from chatflow_sqlalchemy import migrate
from chatflow_sqlalchemy.backends.sqlite import SQLiteSessionStore
from chatflow_sqlalchemy.cli import UPSTREAM_LABEL, main
from chatflow_sqlalchemy.demo import build_agents, engine_summarizer, run_demo
from chatflow_sqlalchemy.exceptions import ClaimLostError
from chatflow_sqlalchemy.models import ChatflowProcessedMessage
from chatflow_sqlalchemy.testing import ScriptedEngine

HEAD = migrate.head_revision()
SESSION = "wa:+15550001"
OTHER = "tg:42"
PG_URL_WITH_PASSWORD = "postgresql+psycopg://u:sekret@127.0.0.1:1/db"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHATFLOW_DATABASE_URL", raising=False)
    monkeypatch.delenv("CHATFLOW_AUTO_MIGRATE", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)


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
        await runner.run_async(SESSION, "I want a refund: transfer to billing then refund 49")
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


# --------------------------------------------------------------------------- helpers


def empty_file(path: Path) -> Path:
    """An existing, empty SQLite file (a zero-byte file is a valid empty database)."""
    path.touch()
    return path


def upgraded(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    url = url_of(path)
    code, _, err = run(capsys, "--url", url, "db", "upgrade")
    assert code == 0, err
    return url


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def core_revision(path: Path) -> str | None:
    with sqlite3.connect(path) as conn:
        row = conn.execute("SELECT version_num FROM chatflow_alembic_version").fetchone()
    return None if row is None else str(row[0])


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


READ_COMMANDS: list[list[str]] = [
    ["sessions", "list"],
    ["sessions", "show", SESSION],
    ["sessions", "export"],
    ["db", "current"],
    ["db", "check"],
    ["dedup", "list"],
    ["dedup", "count"],
    ["inbox", "list"],
    ["inbox", "stats"],
]
"""Every read command that looks at a database (``db history`` reads none)."""


# --------------------------------------------------------------------------- db


def test_db_current_on_empty_file_says_none_then_head_after_upgrade(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = url_of(empty_file(tmp_path / "empty.db"))
    code, out, _ = run(capsys, "--url", url, "db", "current")
    assert code == 0
    assert "none (empty database)" in out
    assert "chatflow-sqlalchemy db upgrade" in out

    code, out, _ = run(capsys, "--url", url, "db", "upgrade")
    assert code == 0
    assert f"upgraded from none (empty database) to {HEAD} (head)" in out

    code, out, _ = run(capsys, "--url", url, "db", "current")
    assert code == 0
    assert f"{HEAD} (head)" in out
    assert "none" not in out

    code, out, _ = run(capsys, "--url", url, "db", "upgrade")
    assert code == 0
    assert "already at" in out


def _upstream_file(path: Path) -> Path:
    import chatflow_agent

    upstream = chatflow_agent.SQLiteSessionStore(str(path))
    agent = chatflow_agent.Agent(name="Legacy", instructions="")
    session = upstream.get_or_create("old", agent, {"k": 1})
    session.add_message(Message(role=Role.USER, content="hi from 0.3.4"))
    session.add_message(Message(role=Role.MODEL, content="hello"))
    assert upstream.record_processed_message("wamid.legacy")
    return path


def test_db_upgrade_adopts_a_chatflow_agent_database(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _upstream_file(tmp_path / "upstream.db")
    code, out, _ = run(capsys, "--url", url_of(path), "db", "current")
    assert code == 0
    assert f"revision: {UPSTREAM_LABEL}; head is {HEAD}" in out
    code, out, _ = run(capsys, "--url", url_of(path), "db", "upgrade")
    assert code == 0
    assert f"upgraded from {UPSTREAM_LABEL} to {HEAD} (head)" in out
    assert "empty database" not in out
    assert run(capsys, "--url", url_of(path), "db", "check")[0] == 0
    code, out, _ = run(capsys, "--url", url_of(path), "sessions", "show", "old")
    assert code == 0
    assert "active agent: Legacy" in out
    assert "[user] hi from 0.3.4" in out
    assert "[model] hello" in out
    with SQLiteSessionStore(str(path)) as store:
        assert store.is_message_processed("wamid.legacy")


def test_upstream_tables_are_described_as_such_everywhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _upstream_file(tmp_path / "upstream.db")
    url = url_of(path)
    code, out, _ = run(capsys, "--url", url, "db", "check")
    assert code == 1
    assert UPSTREAM_LABEL in out
    code, out, _ = run(capsys, "--url", url, "db", "current", "--json")
    assert json.loads(out)["chains"][0]["description"] == UPSTREAM_LABEL
    code, out, err = run(capsys, "--url", url, "sessions", "list")
    assert code == 2
    line = assert_one_error_line(err, out)
    assert UPSTREAM_LABEL in line
    assert "chatflow-sqlalchemy db upgrade" in line


def test_db_check_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = url_of(empty_file(tmp_path / "check.db"))
    code, out, _ = run(capsys, "--url", url, "db", "check")
    assert code == 1
    assert "chatflow-sqlalchemy db upgrade" in out

    assert run(capsys, "--url", url, "db", "upgrade")[0] == 0
    code, out, _ = run(capsys, "--url", url, "db", "check")
    assert code == 0, out
    assert "ok" in out

    code, out, _ = run(capsys, "--url", url, "db", "downgrade", "0001", "--yes")
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
    code, out, _ = run(capsys, "--url", url, "db", "check", "--json")
    assert code == 1
    report = json.loads(out)
    assert report["ok"] is False
    assert any("seq" in diff for diff in report["drift"])


def test_db_downgrade_to_base_and_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "base.db"
    url = upgraded(path, capsys)
    code, out, _ = run(capsys, "--url", url, "db", "downgrade", "base", "-y")
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
    url = upgraded(tmp_path / "stamp.db", capsys)
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
    path = tmp_path / "rev.db"
    url = upgraded(path, capsys)
    code, out, err = run(capsys, "--url", url, *argv)
    assert code == 2
    assert "nosuchrev" in assert_one_error_line(err, out)
    assert core_revision(path) == HEAD


def test_url_from_environment_and_after_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    env_db = tmp_path / "env.db"
    monkeypatch.setenv("CHATFLOW_DATABASE_URL", url_of(env_db))
    assert run(capsys, "db", "upgrade")[0] == 0
    _, out, _ = run(capsys, "db", "current")
    assert str(env_db) in out
    assert f"{HEAD} (head)" in out

    flag_db = empty_file(tmp_path / "flag.db")
    _, out, _ = run(capsys, "db", "current", "--url", url_of(flag_db))
    assert str(flag_db) in out
    assert "none" in out


def test_default_url_is_chatflow_db_in_cwd(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert run(capsys, "db", "upgrade")[0] == 0
    assert (tmp_path / "chatflow.db").exists()


def test_db_upgrade_creates_a_private_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = os.umask(0o022)
    try:
        path = tmp_path / "new" / "private.db"
        upgraded(path, capsys)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


# --------------------------------------------------------------------------- read-only


def test_read_commands_never_create_a_database(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "no_such_dir" / "x.db"
    for argv in READ_COMMANDS:
        code, out, err = run(capsys, "--url", url_of(missing), *argv)
        assert code == 2, argv
        line = assert_one_error_line(err, out)
        assert str(missing) in line, argv
        assert "nothing was created" in line
    assert run(capsys, "--url", url_of(missing), "db", "history")[0] == 0
    assert tree(tmp_path) == []

    monkeypatch.chdir(tmp_path)  # the default URL: ./chatflow.db
    for argv in READ_COMMANDS:
        code, out, err = run(capsys, *argv)
        assert code == 2, argv
        assert "chatflow.db" in assert_one_error_line(err, out)
    assert tree(tmp_path) == []


def test_read_commands_never_migrate_after_downgrade(
    db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = url_of(db)
    assert run(capsys, "--url", url, "db", "downgrade", "0001", "--yes")[0] == 0
    assert core_revision(db) == "0001"
    expected = {("db", "current"): 0, ("db", "check"): 1}
    for argv in READ_COMMANDS:
        code, out, err = run(capsys, "--url", url, *argv)
        want = expected.get((argv[0], argv[1]), 2)
        assert code == want, (argv, out, err)
        if want == 2:
            line = assert_one_error_line(err, out)
            assert "0001" in line
            assert "chatflow-sqlalchemy db upgrade" in line
        assert core_revision(db) == "0001", argv
    # Writers refuse too: only `db upgrade` moves the schema.
    for argv in (["sessions", "delete", OTHER, "--yes"], ["dedup", "purge", "--yes"]):
        code, out, err = run(capsys, "--url", url, *argv)
        assert code == 2, argv
        assert "chatflow-sqlalchemy db upgrade" in assert_one_error_line(err, out)
        assert core_revision(db) == "0001", argv


def test_read_commands_leave_the_file_byte_for_byte(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # An upstream 0.3.4 file (rollback journal, no revision): no read may convert,
    # migrate or touch it.
    path = _upstream_file(tmp_path / "upstream.db")
    before = digest(path)
    for argv in READ_COMMANDS:
        run(capsys, "--url", url_of(path), *[a if a != SESSION else "old" for a in argv])
    assert digest(path) == before
    assert tree(tmp_path) == ["upstream.db"]


# --------------------------------------------------------------------------- errors


def test_bad_url_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["db", "current"], ["sessions", "list"], ["db", "check"]):
        code, out, err = run(capsys, "--url", "nosuchdialect://x", *argv)
        assert code == 2
        assert "nosuchdialect" in assert_one_error_line(err, out)
    code, out, err = run(capsys, "--url", "this is not a url", "db", "current")
    assert code == 2
    assert_one_error_line(err, out)


def test_bad_port_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    url = "postgresql+psycopg://u:sekret@127.0.0.1:abc/db"
    for argv in (["db", "current"], ["db", "upgrade"], ["sessions", "list"], ["dedup", "purge"]):
        code, out, err = run(capsys, "--url", url, *argv)
        assert code == 2, argv
        line = assert_one_error_line(err, out)
        assert "port" in line
        assert "sekret" not in out + err


@pytest.mark.parametrize("argv", [["db", "current"], ["db", "upgrade"], ["sessions", "list"]])
def test_unreachable_database_hides_the_password(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, out, err = run(capsys, "--url", PG_URL_WITH_PASSWORD, *argv)
    assert code == 2
    line = assert_one_error_line(err, out)
    assert "sekret" not in out + err
    assert "127.0.0.1" in line


@pytest.mark.parametrize(
    "argv", [["db", "current"], ["db", "upgrade"], ["db", "check"], ["sessions", "list"]]
)
@pytest.mark.parametrize("driver", ["+psycopg:", "+psycopg2:"])
def test_missing_driver_names_the_extra_like_python_does(
    tmp_path: Path, argv: list[str], driver: str
) -> None:
    """Without psycopg, any PostgreSQL URL names the missing extra, as a store does.

    For a ``postgresql+psycopg2://`` URL, naming the driver to write in the URL
    instead would send the user to one that is not installed either.
    """
    url = PG_URL_WITH_PASSWORD.replace("+psycopg:", driver)
    code = (
        "import sys; sys.modules['psycopg'] = None\n"
        "from chatflow_sqlalchemy.cli import main\n"
        f"sys.exit(main(['--url', {url!r}, *{argv!r}]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 2, result.stderr
    line = assert_one_error_line(result.stderr, result.stdout)
    assert "pip install 'chatflow-sqlalchemy[postgres]'" in line, line
    assert "sekret" not in result.stderr


def test_schema_ahead_names_found_and_expected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ahead.db"
    upgraded(path, capsys)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE chatflow_alembic_version SET version_num='9999'")
    for argv in (
        ["db", "current"],
        ["db", "check"],
        ["db", "upgrade"],
        ["sessions", "list"],
        ["dedup", "purge"],
        ["dedup", "count"],
    ):
        code, out, err = run(capsys, "--url", url_of(path), *argv)
        assert code == 2, argv
        line = assert_one_error_line(err, out)
        assert "9999" in line
        assert HEAD in line


def test_not_a_database_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "junk.db"
    path.write_bytes(b"this is not an SQLite database, just some text " * 40)
    for argv in (["db", "current"], ["sessions", "list"], ["db", "upgrade"]):
        code, out, err = run(capsys, "--url", url_of(path), *argv)
        assert code == 2
        assert "junk.db" in assert_one_error_line(err, out)


def test_redact_masks_the_password_in_any_message() -> None:
    from chatflow_sqlalchemy.cli import _redact

    urls = ["postgresql://u:p%40ss-word@h/db"]
    message = "boom postgresql://u:p%40ss-word@h/db and p@ss-word"
    assert "ss-word" not in _redact(message, urls)
    assert _redact("x://u:ab@h about ab", ["postgresql://u:ab@h/db"]) == "x://u:***@h about ab"
    # A URL SQLAlchemy cannot parse (bad port) still has its password masked.
    assert "sekret" not in _redact("x sekret y", ["postgresql://u:sekret@h:abc/db"])


def test_bad_usage_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["nosuchcommand"], ["sessions", "show"], ["db", "check", "--bad"]):
        assert main(argv) == 2, argv
        assert "--help" in assert_one_error_line(capsys.readouterr().err)
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "sessions" in out
    assert "Exit codes" in out


def test_help_imports_nothing_heavy() -> None:
    code = (
        "import sys\n"
        "from chatflow_sqlalchemy.cli import main\n"
        "for argv in (['--help'], ['sessions', 'show', '--help'], ['db', '--help']):\n"
        "    assert main(argv) == 0\n"
        "heavy = ('sqlalchemy', 'alembic', 'chatflow_agent', 'rich', 'pydantic')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


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
    url = upgraded(tmp_path / "none.db", capsys)
    code, out, _ = run(capsys, "--url", url, "sessions", "list")
    assert code == 0
    assert "no sessions" in out
    code, out, _ = run(capsys, "--url", url, "sessions", "list", "--json")
    assert json.loads(out) == {"sessions": []}


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
    assert "tool call refund" in second_turn


def test_sessions_show_has_timestamps(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with sqlite3.connect(db) as conn:
        created, updated = conn.execute(
            "SELECT created_at, updated_at FROM chatflow_sessions WHERE session_id = ?",
            (SESSION,),
        ).fetchone()
        first_message = conn.execute(
            "SELECT created_at FROM chatflow_messages WHERE session_id = ? AND role = 'user' "
            "ORDER BY seq LIMIT 1",
            (SESSION,),
        ).fetchone()[0]
    code, out, _ = run(capsys, "--url", url_of(db), "sessions", "show", SESSION)
    assert code == 0
    assert f"created: {created[:19]} UTC" in out
    assert f"updated: {updated[:19]} UTC" in out
    assert f"{first_message[:19]} UTC  [user] Where is my order 404?" in out

    code, out, _ = run(capsys, "--url", url_of(db), "sessions", "show", SESSION, "--json")
    assert code == 0
    shown = json.loads(out)
    assert shown["created_at"].startswith(created[:19].replace(" ", "T"))
    assert shown["updated_at"].startswith(updated[:19].replace(" ", "T"))
    first_user = next(m for m in shown["messages"] if m["role"] == "user")
    assert first_user["created_at"].startswith(first_message[:19].replace(" ", "T"))


def test_json_output_of_every_read_command(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = url_of(db)
    history = stored_history(db, SESSION)

    def read(*argv: str) -> Any:
        code, out, err = run(capsys, "--url", url, *argv, "--json")
        assert code == 0, err
        return json.loads(out)

    listed = read("sessions", "list")["sessions"]
    assert [s["session_id"] for s in listed] == [SESSION, OTHER]
    assert set(listed[0]) == {
        "session_id", "active_agent_name", "messages", "created_at", "updated_at"
    }
    assert listed[0]["messages"] == len(history)

    shown = read("sessions", "show", SESSION)
    assert shown["active_agent_name"] == "Billing"
    assert shown["metadata"] == {"channel": "wa"}
    assert shown["metadata_corrupt"] is None
    assert shown["turns"] == 2
    assert [Message.model_validate(m["message"]) for m in shown["messages"]] == history
    assert all(m["corrupt"] is None for m in shown["messages"])

    current = read("db", "current")
    assert current["at_head"] is True
    assert current["chains"][0] == {
        "chain": "core", "distribution": current["chains"][0]["distribution"],
        "current": HEAD, "head": HEAD, "at_head": True, "description": HEAD,
    }
    assert read("db", "check")["ok"] is True
    revisions = read("db", "history")["chains"][0]["revisions"]
    assert revisions[0]["revision"] == HEAD
    assert revisions[0]["is_head"] is True
    assert read("dedup", "count") == {"ttl_hours": 192.0, "total": 0, "expired": 0, "live": 0}
    assert read("dedup", "list") == {"ttl_hours": 192.0, "total": 0, "ids": []}
    backends = {b["name"]: b for b in read("backends")["backends"]}
    assert backends["sqlite"]["available"] is True


def test_sessions_show_unknown_session_exits_1(
    db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "--url", url_of(db), "sessions", "show", "nobody")
    assert code == 1
    assert "nobody" in assert_one_error_line(err, out)


def _corrupt_last_row(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        row_id = conn.execute(
            "SELECT max(id) FROM chatflow_messages WHERE session_id = ?", (SESSION,)
        ).fetchone()[0]
        conn.execute("UPDATE chatflow_messages SET message_json = '{oops' WHERE id = ?", (row_id,))
    return int(row_id)


def test_sessions_show_points_at_corrupt_rows(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    row_id = _corrupt_last_row(db)
    code, out, err = run(capsys, "--url", url_of(db), "sessions", "show", SESSION)
    assert code == 1
    assert f"CORRUPT ROW id {row_id}" in out
    assert "Turn 2" in out  # the readable rows are still shown
    assert str(row_id) in assert_one_error_line(err, out)
    # Without --skip-corrupt the export stops, naming session and row.
    code, out, err = run(capsys, "--url", url_of(db), "sessions", "export")
    assert code == 1
    line = assert_one_error_line(err)
    assert SESSION in line
    assert str(row_id) in line
    assert "--skip-corrupt" in line
    # Into a file: the file is left as it was, with no partial file beside it.
    target = db.parent / "kept.jsonl"
    target.write_text("previous export\n")
    code, out, err = run(capsys, "--url", url_of(db), "sessions", "export", "-o", str(target))
    assert code == 1
    assert str(row_id) in assert_one_error_line(err)
    assert target.read_text() == "previous export\n"
    assert not list(db.parent.glob(".*.partial"))


def test_export_skip_corrupt_reports_bad_rows_and_exports_the_rest(
    db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    row_id = _corrupt_last_row(db)
    code, out, err = run(capsys, "--url", url_of(db), "sessions", "export", "--skip-corrupt")
    assert code == 0, err
    assert [json.loads(line)["session_id"] for line in out.splitlines()] == [OTHER]
    assert SESSION in err
    assert f"row id {row_id}" in err
    assert "Traceback" not in err

    target = tmp_path / "out.jsonl"
    code, out, err = run(
        capsys, "--url", url_of(db), "sessions", "export", "--skip-corrupt", "-o", str(target)
    )
    assert code == 0, err
    assert "exported 1 session(s)" in out
    assert f"row id {row_id}" in err
    assert [json.loads(line)["session_id"] for line in target.read_text().splitlines()] == [OTHER]


@pytest.mark.parametrize("bad", ["{oops", "[1, 2]", '"text"'])
def test_corrupt_metadata_does_not_crash_show_or_export(
    db: Path, capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute(
            "UPDATE chatflow_sessions SET metadata_json = ? WHERE session_id = ?", (bad, SESSION)
        )
    code, out, err = run(capsys, "--url", url_of(db), "sessions", "show", SESSION)
    assert code == 1
    line = assert_one_error_line(err, out)
    assert SESSION in line
    assert "metadata_json" in line
    assert "CORRUPT" in out
    assert "[user] Where is my order 404?" in out  # the history is still shown
    code, out, err = run(capsys, "--url", url_of(db), "sessions", "show", SESSION, "--json")
    assert code == 1
    assert json.loads(out)["metadata_corrupt"]["raw"] == bad

    code, out, err = run(capsys, "--url", url_of(db), "sessions", "export")
    assert code == 1
    assert "metadata_json" in assert_one_error_line(err)
    code, out, err = run(capsys, "--url", url_of(db), "sessions", "export", "--skip-corrupt")
    assert code == 0
    assert [json.loads(line)["session_id"] for line in out.splitlines()] == [OTHER]
    assert SESSION in err
    assert "Traceback" not in err


def test_sessions_delete(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--url", url_of(db), "sessions", "delete", OTHER, "--yes")
    assert code == 0
    assert OTHER in out
    _, out, _ = run(capsys, "--url", url_of(db), "sessions", "list")
    assert OTHER not in out
    assert SESSION in out

    code, out, err = run(capsys, "--url", url_of(db), "sessions", "delete", OTHER, "--yes")
    assert code == 1
    assert OTHER in assert_one_error_line(err, out)
    with sqlite3.connect(db) as conn:
        orphans = conn.execute(
            "SELECT count(*) FROM chatflow_messages WHERE session_id = ?", (OTHER,)
        ).fetchone()[0]
    assert orphans == 0


def test_sessions_delete_takes_the_sessions_claims_and_inbox_messages(
    db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with SQLiteSessionStore(str(db)) as store:
        with store.claim("wamid.other", session_id=OTHER) as claim:
            claim.response = "a reply to OTHER"
        with store.claim("wamid.kept", session_id=SESSION) as claim:
            claim.response = "kept"
        store.inbox.put("in.other", session_id=OTHER, text="my address is 1 Main St")
        store.inbox.put("in.kept", session_id=SESSION, text="kept")
    url = url_of(db)
    code, _, err = run(capsys, "--url", url, "sessions", "delete", OTHER, "--yes")
    assert code == 0, err
    code, out, _ = run(capsys, "--url", url, "dedup", "list", "--json")
    assert code == 0
    assert {row["message_id"] for row in json.loads(out)["ids"]} == {"wamid.kept"}
    code, out, _ = run(capsys, "--url", url, "inbox", "list", "--json")
    assert code == 0
    assert {row["message_id"] for row in json.loads(out)["messages"]} == {"in.kept"}


def test_destructive_commands_refuse_without_yes_and_without_a_terminal(
    db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _claim_at(db, "wamid.2h", hours_ago=2)
    url = url_of(db)
    for argv in (
        ["db", "downgrade", "0001"],
        ["db", "downgrade", "base"],
        ["sessions", "delete", OTHER],
        ["dedup", "purge", "--ttl-hours", "1"],
    ):
        before = digest(db)
        code, out, err = run(capsys, "--url", url, *argv)
        assert code == 2, argv
        assert "--yes" in assert_one_error_line(err, out)
        assert digest(db) == before, argv
    assert core_revision(db) == HEAD
    with SQLiteSessionStore(str(db)) as store:
        assert store.get(OTHER) is not None
        assert store.is_message_processed("wamid.2h")


def _run_on_a_terminal(argv: list[str], answer: str) -> subprocess.CompletedProcess[str]:
    """Run the console script with a pseudo-terminal on stdin, answering ``answer``."""
    import pty

    primary, secondary = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "chatflow_sqlalchemy.cli", *argv],
            stdin=secondary,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        os.write(primary, answer.encode() + b"\n")
        out, err = proc.communicate(timeout=120)
    finally:
        os.close(secondary)
        os.close(primary)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_destructive_commands_ask_on_a_terminal(db: Path) -> None:
    argv = ["--url", url_of(db), "sessions", "delete", OTHER]
    result = _run_on_a_terminal(argv, "n")
    assert result.returncode == 1, result.stderr
    assert "Delete session" in result.stderr
    assert "nothing was changed" in result.stderr
    with SQLiteSessionStore(str(db)) as store:
        assert store.get(OTHER) is not None

    result = _run_on_a_terminal(argv, "y")
    assert result.returncode == 0, result.stderr
    assert f"deleted session {OTHER!r}" in result.stdout
    with SQLiteSessionStore(str(db)) as store:
        assert store.get(OTHER) is None


def _check_export(lines: list[str], db: Path) -> None:
    records = [json.loads(line) for line in lines]
    assert [r["session_id"] for r in records] == [SESSION, OTHER]
    for record in records:
        assert set(record) == {"session_id", "active_agent_name", "metadata", "summary",
                               "forked_from", "forked_at_turn", "messages"}
        assert (record["summary"], record["forked_from"], record["forked_at_turn"]) == (
            None, None, None,
        ), "no summary was made and no session is a fork"
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
    assert not list(tmp_path.glob("*.partial")) and not list(tmp_path.glob(".*.partial"))


def test_export_file_is_private(
    db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fresh = tmp_path / "fresh.jsonl"
    existing = tmp_path / "existing.jsonl"
    old = os.umask(0o022)
    try:
        existing.write_text("old\n")
        existing.chmod(0o644)
        for target in (fresh, existing):
            code, _, err = run(capsys, "--url", url_of(db), "sessions", "export", "-o", str(target))
            assert code == 0, err
    finally:
        os.umask(old)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o600
    assert stat.S_IMODE(existing.stat().st_mode) == 0o600
    _check_export(existing.read_text(encoding="utf-8").splitlines(), db)


# --------------------------------------------------------------------------- terminal safety


EVIL = (
    "hi\x1b]0;pwned title\x07 \x1b[2J\x1b[H clear \x1b]52;c;ZXZpbA==\x07 clip"
    "\rSPOOF \x9b31m c1 \u202egnp.exe [bold red]markup[/bold red]\nsecond line"
)
EVIL_ID = "evil\x1b[31m\rid"


def _evil_db(tmp_path: Path) -> Path:
    path = tmp_path / "evil.db"
    with SQLiteSessionStore(str(path)) as store:
        agent = build_agents()["Support"]
        session = store.get_or_create(EVIL_ID, agent, {"note": "\x1b]0;meta\x07"})
        session.add_message(Message(role=Role.USER, content=EVIL))
        session.add_message(Message(role=Role.MODEL, content="[link=file:///etc]x[/link]"))
    return path


RAW_CONTROLS = ("\x1b]", "\x07", "\r", "\x9b", "\u202e", "\x1b[2J", "\x1b[31m")


def test_terminal_escapes_are_neutralised(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = url_of(_evil_db(tmp_path))
    for force_color in ("", "1"):  # plain output, then Rich output
        monkeypatch.setenv("FORCE_COLOR", force_color)
        for argv in (
            ["sessions", "list"],
            ["sessions", "show", EVIL_ID],
            ["sessions", "show", EVIL_ID, "--json"],
            ["sessions", "list", "--json"],
            ["sessions", "export"],
        ):
            code, out, err = run(capsys, "--url", url, *argv)
            assert code == 0, (argv, err)
            for control in RAW_CONTROLS:
                assert control not in out + err, (force_color, argv, control)
        code, out, _ = run(capsys, "--url", url, "sessions", "show", EVIL_ID)
        assert "\\x1b]0;pwned title\\x07" in out
        assert "\\r" in out
        assert "[bold red]markup[/bold red]" in out  # printed literally, not as style
        assert "[link=file:///etc]x[/link]" in out
        assert "second line" in out
    # Escaped JSON still decodes to the stored text.
    monkeypatch.delenv("FORCE_COLOR")
    _, out, _ = run(capsys, "--url", url, "sessions", "export")
    record = json.loads(out)
    assert record["session_id"] == EVIL_ID
    assert record["messages"][0]["content"] == EVIL


def test_rich_output_on_a_terminal_has_colour(
    db: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORCE_COLOR", "1")
    code, out, _ = run(capsys, "--url", url_of(db), "sessions", "show", SESSION)
    assert code == 0
    assert "\x1b[" in out  # styled
    assert "[user]" in out
    assert "Where is my order 404?" in out
    code, out, _ = run(capsys, "--url", url_of(db), "sessions", "list")
    assert code == 0
    assert "\x1b[" in out
    assert "SESSION" in out
    assert SESSION in out


# --------------------------------------------------------------------------- dedup, backends


def _claim_at(db: Path, message_id: str, *, hours_ago: float) -> None:
    table: Any = ChatflowProcessedMessage.__table__
    assert isinstance(table, Table)
    with SQLiteSessionStore(str(db)) as store, store.engine.begin() as conn:
        conn.execute(
            insert(table),
            [
                {
                    "message_id": message_id,
                    "processed_at": datetime.now(timezone.utc) - timedelta(hours=hours_ago),
                }
            ],
        )


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


def test_dedup_list_and_count(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _claim_at(db, "wamid.new", hours_ago=1)
    _claim_at(db, "wamid.mid", hours_ago=50)
    _claim_at(db, "wamid.old", hours_ago=500)
    url = url_of(db)
    code, out, _ = run(capsys, "--url", url, "dedup", "list")
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0].split() == [
        "MESSAGE", "ID", "STATE", "SESSION", "CLAIMED", "AT", "EXPIRES", "AT", "EXPIRED"
    ]
    assert [line.split()[0] for line in lines[1:]] == ["wamid.new", "wamid.mid", "wamid.old"]
    assert [line.split()[1] for line in lines[1:]] == ["done", "done", "done"]
    assert [line.split()[-1] for line in lines[1:]] == ["no", "no", "yes"]

    code, out, _ = run(capsys, "--url", url, "dedup", "list", "--limit", "1", "--json")
    listed = json.loads(out)
    assert listed["total"] == 3
    [item] = listed["ids"]
    assert item["message_id"] == "wamid.new"
    claimed = datetime.fromisoformat(item["processed_at"])
    assert datetime.fromisoformat(item["expires_at"]) - claimed == timedelta(hours=192)
    assert item["expired"] is False
    assert item["state"] == "done" and item["session_id"] is None

    code, out, _ = run(capsys, "--url", url, "dedup", "count")
    assert code == 0
    assert "3 processed id(s): 2 live, 1 expired" in out
    code, out, _ = run(capsys, "--url", url, "dedup", "count", "--ttl-hours", "24", "--json")
    assert json.loads(out) == {"ttl_hours": 24.0, "total": 3, "expired": 2, "live": 1}


def test_dedup_list_shows_a_held_claim_and_release_frees_it(
    db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = url_of(db)
    with SQLiteSessionStore(str(db)) as store:
        # The stuck holder learns it lost the id when its block ends.
        with pytest.raises(ClaimLostError), store.claim("wamid.stuck", session_id=SESSION) as claim:
            assert claim.acquired
            code, out, _ = run(capsys, "--url", url, "dedup", "list", "--json")
            assert code == 0
            [item] = json.loads(out)["ids"]
            assert (item["message_id"], item["state"], item["session_id"]) == (
                "wamid.stuck", "in_flight", SESSION
            )
            assert item["lease_left"] > 0 and item["lease_age"] >= 0
            code, out, _ = run(capsys, "--url", url, "dedup", "list")
            assert "in_flight (lease renewed" in out

            code, _, err = run(capsys, "--url", url, "dedup", "release", "wamid.stuck")
            assert code == 2 and "--yes" in assert_one_error_line(err)
            code, out, _ = run(capsys, "--url", url, "dedup", "release", "wamid.stuck", "--yes")
            assert code == 0 and "released wamid.stuck" in out
            with store.claim("wamid.stuck", session_id=SESSION) as again:
                assert again.acquired, "a released id is acquired by the next delivery"
        code, _, err = run(capsys, "--url", url, "dedup", "release", "wamid.stuck", "--yes")
        assert code == 1 and "not held" in assert_one_error_line(err)


def test_dedup_purge_ttl_override_confirms_unexpired_ids(
    db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _claim_at(db, "wamid.new", hours_ago=1)
    _claim_at(db, "wamid.mid", hours_ago=50)
    _claim_at(db, "wamid.old", hours_ago=500)
    url = url_of(db)
    # Longer than the default window: nothing unexpired goes, no question asked.
    code, out, _ = run(capsys, "--url", url, "dedup", "purge", "--ttl-hours", "400")
    assert code == 0
    assert "removed 1 expired" in out
    # Shorter: wamid.mid is still inside the default window.
    code, out, err = run(capsys, "--url", url, "dedup", "purge", "--ttl-hours", "24")
    assert code == 2
    assert "--yes" in assert_one_error_line(err, out)
    code, out, _ = run(capsys, "--url", url, "dedup", "purge", "--ttl-hours", "24", "--yes")
    assert code == 0
    assert "removed 1 expired" in out
    with SQLiteSessionStore(str(db)) as store:
        assert store.is_message_processed("wamid.new")
        assert not store.is_message_processed("wamid.mid")
    code, out, err = run(capsys, "--url", url, "dedup", "purge", "--ttl-hours", "-1")
    assert code == 2
    assert "--ttl-hours" in assert_one_error_line(err, out)


def test_backends(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "backends")
    assert code == 0
    assert "chatflow_sqlalchemy.backends.sqlite.SQLiteSessionStore" in out
    assert "postgresql" in out


# --------------------------------------------------------------------------- PostgreSQL


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A private, throw-away database on the shared server (never the shared ``test`` db)."""
    base = os.environ.get("CHATFLOW_TEST_POSTGRES_URL")
    if not base:
        pytest.skip("CHATFLOW_TEST_POSTGRES_URL is not set")
    from sqlalchemy import create_engine, make_url, text
    from sqlalchemy.exc import OperationalError

    name = f"cli_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # the server is down: skip like the other PostgreSQL tests
        admin.dispose()
        pytest.skip(f"PostgreSQL unavailable: {exc}")
    try:
        yield make_url(base).set(database=name).render_as_string(hide_password=False)
    finally:
        try:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        except OperationalError:  # the shared server is restarting: leave the scratch db
            pass
        admin.dispose()


def test_postgresql_read_commands_and_corrupt_metadata(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from sqlalchemy import text

    from chatflow_sqlalchemy.backends.postgresql import PostgresSessionStore

    assert run(capsys, "--url", pg_url, "db", "upgrade")[0] == 0
    with PostgresSessionStore(pg_url) as store:
        session = store.get_or_create(SESSION, build_agents()["Support"], {"n": 1.5})
        session.add_message(Message(role=Role.USER, content="hello \x1b[2J pg"))
        other = store.get_or_create(OTHER, build_agents()["Support"])
        other.add_message(Message(role=Role.USER, content="fine"))
    code, out, _ = run(capsys, "--url", pg_url, "sessions", "show", SESSION, "--json")
    assert code == 0
    shown = json.loads(out)
    assert shown["metadata"] == {"n": 1.5}
    assert shown["messages"][0]["message"]["content"] == "hello \x1b[2J pg"
    with PostgresSessionStore(pg_url) as store, store.engine.begin() as conn:
        conn.execute(
            text("UPDATE chatflow_sessions SET metadata_json = '[1]'::jsonb WHERE session_id = :s"),
            {"s": SESSION},
        )
    code, out, err = run(capsys, "--url", pg_url, "sessions", "show", SESSION)
    assert code == 1
    assert "metadata_json" in assert_one_error_line(err, out)
    code, out, err = run(capsys, "--url", pg_url, "sessions", "export", "--skip-corrupt")
    assert code == 0
    assert [json.loads(line)["session_id"] for line in out.splitlines()] == [OTHER]

    assert run(capsys, "--url", pg_url, "db", "downgrade", "0001", "--yes")[0] == 0
    code, out, err = run(capsys, "--url", pg_url, "sessions", "list")
    assert code == 2
    assert "chatflow-sqlalchemy db upgrade" in assert_one_error_line(err, out)
    code, out, _ = run(capsys, "--url", pg_url, "db", "current", "--json")
    assert json.loads(out)["chains"][0]["current"] == "0001"


# --------------------------------------------------------------------------- demo


DEMO_WORDS = ("handoff", "restart", "pruning", "duplicate", "rollback", "summar")


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


def test_demo_summary_is_written_by_its_engine_and_kept_in_the_database(tmp_path: Path) -> None:
    """Step 9: the summary the demo prints is what the engine wrote, and the file keeps it."""
    path = tmp_path / "d.db"
    lines: list[str] = []
    run_demo(str(path), lines.append)
    printed = next(line for line in lines if line.strip().startswith("summary: "))
    with SQLiteSessionStore(str(path)) as store:
        session = store.get("whatsapp:+15550133")
        assert session is not None
        summary = session.summary
        assert summary is not None and "order 408" in summary
        assert summary.startswith("Summarizer re: ")  # the scripted engine's answer
        assert printed.strip() == f"summary: {summary}"
        first = session.history[0]
        assert first.role == Role.SYSTEM and first.content is not None
        assert first.content.endswith(summary)
        users = [m.content for m in session.history if m.role == Role.USER]
        assert "I am Ada; my parcel for order 408 arrived broken" not in users  # pruned


def test_engine_summarizer_folds_the_previous_summary_and_what_the_user_said() -> None:
    engine = ScriptedEngine()
    summarize = engine_summarizer(engine)
    dropped = [
        Message(role=Role.USER, content="order 7 is late"),
        Message(role=Role.MODEL, content="Sorry to hear that"),
        Message(role=Role.USER, content="my name is Bo"),
    ]
    summary = asyncio.run(summarize("Summarizer re: earlier", dropped))
    assert engine.calls == 1
    assert summary == (
        "Summarizer re: Summary so far: Summarizer re: earlier\n"
        "The user said: order 7 is late; my name is Bo"
    )


def test_scripted_engine_fail_step_raises_and_runner_rolls_back(tmp_path: Path) -> None:
    agents = build_agents()
    with SQLiteSessionStore(str(tmp_path / "x.db")) as store:
        runner = Runner(
            starting_agent=agents["Support"], session_store=store, engine=ScriptedEngine()
        )
        runner.run("s", "Where is order 7?")
        with pytest.raises(RuntimeError, match="scripted engine failure"):
            runner.run("s", "fail")
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


def test_the_console_script_is_run_and_passes_on_mains_exit_code(tmp_path: Path) -> None:
    """The script runs ``cli.run`` (the collector tuned for a short process), not ``main``."""
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="chatflow-sqlalchemy")
    assert script.value == "chatflow_sqlalchemy.cli:run"
    env = {k: v for k, v in os.environ.items() if k != "CHATFLOW_DATABASE_URL"}
    missing = url_of(tmp_path / "missing.db")
    for args, code in ((["--version"], 0), (["--url", missing, "sessions", "list"], 2)):
        result = subprocess.run([sys.executable, "-m", "chatflow_sqlalchemy.cli", *args],
                                capture_output=True, text=True, env=env, timeout=60)
        assert result.returncode == code, result.stderr
    assert not (tmp_path / "missing.db").exists()


def test_sessions_delete_of_an_id_with_no_session_row_takes_its_claims_and_inbox_messages(
    db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As ``store.delete``: a message no worker has taken yet leaves nothing behind either."""
    with SQLiteSessionStore(str(db)) as store:
        store.inbox.put("in.new", session_id="whatsapp:+1555", text="my address is 1 Main St")
        store.inbox.put("in.kept", session_id=SESSION, text="kept")
    url = url_of(db)
    code, out, err = run(capsys, "--url", url, "sessions", "delete", "whatsapp:+1555", "--yes",
                         "--json")
    assert code == 0, err
    assert json.loads(out) == {"session_id": "whatsapp:+1555", "deleted": True,
                               "session_existed": False}
    code, out, _ = run(capsys, "--url", url, "inbox", "list", "--json")
    assert {row["message_id"] for row in json.loads(out)["messages"]} == {"in.kept"}
    code, out, err = run(capsys, "--url", url, "sessions", "delete", "whatsapp:+1555", "--yes")
    assert code == 1
    assert "whatsapp:+1555" in assert_one_error_line(err, out)
