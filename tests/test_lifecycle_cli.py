"""Command line of "Lifecycle and data governance": ``sessions list`` filters and pages,
``users export`` and ``users erase``, on a real SQLite file and (when configured) PostgreSQL.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from chatflow_agent import Agent, Message, Role

from chatflow_sqlalchemy import open_store
from chatflow_sqlalchemy.cli import main

from . import pg_util


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHATFLOW_DATABASE_URL", raising=False)
    monkeypatch.delenv("CHATFLOW_AUTO_MIGRATE", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'cli.db'}"
        return
    base = pg_util.postgres_url()
    with pg_util.fresh_schema(base) as schema:  # never the shared schema of other tests
        yield f"{base}?options={quote(f'-csearch_path={schema}')}"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _agent() -> Agent:
    return Agent(name="support", instructions="", model="gemini-2.5-flash")


def _seed(url: str) -> None:
    with open_store(url) as store:
        for n in range(6):
            meta: dict[str, Any] = {"tier": "gold" if n % 2 else "basic", "n": n}
            ctx = store.get_or_create(
                f"s{n}", _agent(), meta, user_id="alice" if n < 4 else "bob"
            )
            ctx.add_message(Message(role=Role.USER, content=f"hello {n}"))
        with store.claim("wamid-1", session_id="s0") as claim:
            claim.response = "hi alice"


def _ids(out: str) -> list[str]:
    return [s["session_id"] for s in json.loads(out)["sessions"]]


def test_sessions_list_filters_and_pages(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    _seed(url)
    code, out, _ = run(capsys, "sessions", "list", "--url", url, "--user", "bob", "--json")
    assert code == 0
    assert _ids(out) == ["s5", "s4"]
    code, out, _ = run(
        capsys, "sessions", "list", "--url", url, "--meta", "tier=gold", "--meta", "n=3", "--json"
    )
    assert _ids(out) == ["s3"]
    code, out, _ = run(capsys, "sessions", "list", "--url", url, "--meta", 'n="3"', "--json")
    assert _ids(out) == [], "a quoted JSON value is a string, and n holds numbers"
    pages, after = [], None
    while True:
        extra = ["--after", after] if after else []
        code, out, _ = run(
            capsys, "sessions", "list", "--url", url, "--limit", "4", "--json", *extra
        )
        document = json.loads(out)
        pages.append(_ids(out))
        after = document["next_after"]
        if after is None:
            break
    assert pages == [["s0", "s1", "s2", "s3"], ["s4", "s5"]]
    code, out, err = run(capsys, "sessions", "list", "--url", url, "--limit", "2")
    assert code == 0 and "next page: --after 's1'" in err
    code, out, _ = run(
        capsys, "sessions", "list", "--url", url, "--updated-after", "2999-01-01", "--json"
    )
    assert _ids(out) == []


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--meta", "novalue"], "--meta takes KEY=VALUE"),
        (["--updated-after", "yesterday"], "ISO 8601"),
        (["--user", "x" * 300], "user_id is 300 characters"),
    ],
)
def test_sessions_list_bad_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    url = f"sqlite:///{tmp_path / 'bad.db'}"
    open_store(url).close()
    code, _, err = run(capsys, "sessions", "list", "--url", url, *args)
    assert code == 2
    assert needle in err and "Traceback" not in err


def test_users_export_then_erase_round_trip(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _seed(url)
    target = tmp_path / "alice.json"
    code, out, _ = run(capsys, "users", "export", "alice", "--url", url, "--output", str(target))
    assert code == 0 and "exported 4 session(s)" in out
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    document = json.loads(target.read_text())
    with open_store(url) as store:
        assert document["sessions"] == store.export_user("alice")["sessions"]
    assert [s["session_id"] for s in document["sessions"]] == ["s0", "s1", "s2", "s3"]
    assert document["sessions"][0]["webhook_claims"][0]["response"] == "hi alice"
    assert document["sessions"][0]["messages"][0]["content"] == "hello 0"

    code, out, err = run(capsys, "users", "erase", "alice", "--url", url)
    assert code == 2 and "pass --yes" in err, "no terminal, no --yes: refused"
    code, out, _ = run(capsys, "users", "erase", "alice", "--url", url, "--yes", "--json")
    assert code == 0 and json.loads(out) == {"user_id": "alice", "erased": 4}
    with open_store(url) as store:
        assert store.list_sessions(user_id="alice") == []
        assert store.list_sessions(user_id="bob") == ["s5", "s4"]
        assert not store.is_message_processed("wamid-1")
    code, out, _ = run(capsys, "users", "export", "alice", "--url", url)
    assert code == 0 and json.loads(out)["sessions"] == []


def test_sessions_sweep_dry_run_then_sweep(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    from datetime import timedelta

    from sqlalchemy import update

    from chatflow_sqlalchemy.models import ChatflowSession, utcnow

    _seed(url)
    table = ChatflowSession.__table__
    with open_store(url) as store, store.engine.begin() as conn:
        conn.execute(
            update(table)
            .where(table.c.session_id.in_(["s1", "s2", "s3"]))
            .values(updated_at=utcnow() - timedelta(hours=48))
        )
    code, out, _ = run(capsys, "sessions", "sweep", "--url", url, "--ttl-hours", "24", "--dry-run")
    assert code == 0 and "3 expired session(s) would be removed" in out
    assert out.split()[-3:] == ["s1", "s2", "s3"]
    code, out, err = run(capsys, "sessions", "sweep", "--url", url, "--ttl-hours", "24")
    assert code == 2 and "pass --yes" in err
    with open_store(url) as store:
        assert len(store.list_sessions()) == 6, "the refused sweep removed nothing"
    code, out, _ = run(
        capsys, "sessions", "sweep", "--url", url, "--ttl-hours", "24", "--yes", "--json"
    )
    assert code == 0 and json.loads(out) == {"dry_run": False, "removed": 3}
    with open_store(url) as store:
        assert sorted(store.list_sessions()) == ["s0", "s4", "s5"]
    code, out, err = run(capsys, "sessions", "sweep", "--url", url, "--ttl-hours", "0")
    assert code == 2 and "--ttl-hours" in err


def test_show_all_and_export_include_the_archive(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with open_store(url, archive_pruned=True, default_max_turns=1) as store:
        ctx = store.get_or_create("t", _agent())
        for n in range(3):
            ctx.add_message(Message(role=Role.USER, content=f"q{n}"))
            ctx.add_message(Message(role=Role.MODEL, content=f"a{n}"))
    code, out, _ = run(capsys, "sessions", "show", "t", "--url", url, "--json")
    assert [m["message"]["content"] for m in json.loads(out)["messages"]] == ["q2", "a2"]
    code, out, _ = run(capsys, "sessions", "show", "t", "--all", "--url", url, "--json")
    assert code == 0
    assert [m["message"]["content"] for m in json.loads(out)["messages"]] == [
        "q0", "a0", "q1", "a1", "q2", "a2"
    ]
    code, out, _ = run(capsys, "sessions", "show", "t", "--all", "--url", url)
    assert code == 0 and "q0" in out and "a2" in out
    code, out, _ = run(capsys, "sessions", "export", "--url", url)
    line = json.loads(out.splitlines()[0])
    assert [m["content"] for m in line["archived_messages"]] == ["q0", "a0", "q1", "a1"]
    assert [m["content"] for m in line["messages"]] == ["q2", "a2"]


def _archive_with_a_corrupt_row(url: str) -> int:
    """Session "t" (user "alice") with pruned turns archived, one archived row made unreadable,
    and session "ok" that is fine; returns the corrupt archive row's id."""
    from sqlalchemy import text

    with open_store(url, archive_pruned=True, default_max_turns=1) as store:
        ctx = store.get_or_create("t", _agent(), user_id="alice")
        for n in range(3):
            ctx.add_message(Message(role=Role.USER, content=f"q{n}"))
            ctx.add_message(Message(role=Role.MODEL, content=f"a{n}"))
        store.get_or_create("ok", _agent()).add_message(Message(role=Role.USER, content="fine"))
        with store.engine.begin() as conn:
            row_id = conn.execute(
                text("SELECT MAX(id) FROM chatflow_message_archive WHERE session_id = 't'")
            ).scalar_one()
            conn.execute(
                text("UPDATE chatflow_message_archive SET message_json = '{oops' WHERE id = :i"),
                {"i": row_id},
            )
    return int(row_id)


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_export_stops_at_a_corrupt_archived_row(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    row_id = _archive_with_a_corrupt_row(url)
    code, out, err = run(capsys, "sessions", "export", "--url", url)
    assert code == 1
    assert "t" not in [json.loads(text)["session_id"] for text in out.splitlines()]
    line = _one_error_line(err)
    assert f"'t': chatflow_message_archive row id {row_id} is corrupt" in line
    assert "--skip-corrupt" in line
    # Into a file: the file is left as it was, with no partial file beside it.
    target = tmp_path / "kept.jsonl"
    target.write_text("previous export\n")
    code, _, err = run(capsys, "sessions", "export", "--url", url, "-o", str(target))
    assert code == 1
    assert f"chatflow_message_archive row id {row_id}" in _one_error_line(err)
    assert target.read_text() == "previous export\n"
    assert not list(tmp_path.glob(".*.partial"))
    # users export (what store.export_user returns) stops too, naming the archive row.
    code, _, err = run(capsys, "users", "export", "alice", "--url", url)
    assert code == 1
    line = _one_error_line(err)
    assert "chatflow_message_archive" in line and f"id {row_id}" in line


def test_export_skip_corrupt_reports_an_archived_row_and_exports_the_rest(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    row_id = _archive_with_a_corrupt_row(url)
    code, out, err = run(capsys, "sessions", "export", "--skip-corrupt", "--url", url)
    assert code == 0, err
    assert [json.loads(line)["session_id"] for line in out.splitlines()] == ["ok"]
    (line,) = err.strip().splitlines()
    assert line.startswith(
        f"skipped: session 't': chatflow_message_archive row id {row_id} is corrupt ("
    ), err
    target = tmp_path / "out.jsonl"
    code, out, err = run(
        capsys, "sessions", "export", "--skip-corrupt", "--url", url, "-o", str(target), "--json"
    )
    assert code == 0, err
    summary = json.loads(out)
    assert summary["exported"] == 1
    assert [f"chatflow_message_archive row id {row_id}" in s for s in summary["skipped"]] == [True]
    assert [json.loads(line)["session_id"] for line in target.read_text().splitlines()] == ["ok"]


def test_show_all_names_a_corrupt_archived_row(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    row_id = _archive_with_a_corrupt_row(url)
    code, out, err = run(capsys, "sessions", "show", "t", "--url", url)
    assert code == 0, "the window alone is readable"
    code, out, err = run(capsys, "sessions", "show", "t", "--all", "--url", url)
    assert code == 1
    assert f"CORRUPT ROW id {row_id} in chatflow_message_archive" in out
    assert "q2" in out, "the readable rows are still shown"
    line = _one_error_line(err)
    assert f"session 't': chatflow_message_archive row id {row_id} is corrupt" in line
    code, out, err = run(capsys, "sessions", "show", "t", "--all", "--json", "--url", url)
    assert code == 1
    messages = json.loads(out)["messages"]
    bad = [m for m in messages if m["corrupt"] is not None]
    assert [(m["table"], m["id"]) for m in bad] == [("chatflow_message_archive", row_id)]
    assert {m["table"] for m in messages} == {"chatflow_message_archive", "chatflow_messages"}


def test_keys_rotate_reseals_with_the_primary(
    url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import base64
    import os

    from chatflow_sqlalchemy.crypto import AESGCMCipher

    k1, k2 = os.urandom(32), os.urandom(32)
    with open_store(url, cipher=AESGCMCipher({"k1": k1}, "k1")) as store:
        ctx = store.get_or_create("e", _agent(), {"secret": "x"})
        ctx.add_message(Message(role=Role.USER, content="hi"))
    monkeypatch.delenv("CHATFLOW_KEYS", raising=False)
    code, _, err = run(capsys, "keys", "rotate", "--url", url)
    assert code == 2 and "CHATFLOW_KEYS" in err
    encoded = {k: base64.b64encode(v).decode() for k, v in (("k1", k1), ("k2", k2))}
    monkeypatch.setenv("CHATFLOW_KEYS", f"k2:{encoded['k2']},k1:{encoded['k1']}")
    code, out, _ = run(capsys, "keys", "rotate", "--url", url, "--json")
    assert code == 0 and json.loads(out) == {"primary": "k2", "rewritten": 2}
    with open_store(url, cipher=AESGCMCipher({"k2": k2}, "k2"), require_encryption=True) as s:
        assert [m.content for m in s.get("e").history] == ["hi"]
    code, out, _ = run(capsys, "keys", "rotate", "--url", url)
    assert code == 0 and "re-encrypted 0 row(s)" in out
    with open_store(url, cipher=AESGCMCipher({"k2": k2}, "k2")) as store:
        store.get_or_create("owned", _agent(), {"secret": "y"}, user_id="eve").add_message(
            Message(role=Role.USER, content="private")
        )
    code, out, _ = run(capsys, "users", "export", "eve", "--url", url)
    document = json.loads(out)["sessions"][0]
    assert document["metadata"] == {"secret": "y"}
    assert document["messages"][0]["content"] == "private"
    code, out, _ = run(capsys, "sessions", "show", "owned", "--url", url, "--json")
    shown = json.loads(out)
    assert code == 0 and shown["metadata"] == {"secret": "y"}
    assert shown["messages"][0]["message"]["content"] == "private"
    monkeypatch.delenv("CHATFLOW_KEYS")
    code, out, _ = run(capsys, "sessions", "show", "owned", "--url", url, "--json")
    assert code == 1 and "private" not in out, "without keys: shown as unreadable, never clear"


def test_export_points_at_the_show_command_that_shows_a_corrupt_archived_row(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # `sessions show t` reads the window only (exit 0 here): the hint must say --all.
    row_id = _archive_with_a_corrupt_row(url)
    code, _, err = run(capsys, "sessions", "export", "--url", url)
    assert code == 1
    line = _one_error_line(err)
    hint = line.rsplit("or see: ", 1)[1]
    assert hint.endswith("sessions show 't' --all"), line
    code, out, _ = run(capsys, "sessions", "show", "t", "--all", "--url", url)
    assert code == 1 and f"CORRUPT ROW id {row_id} in chatflow_message_archive" in out


def test_users_erase_erases_the_users_inbox_messages_as_erase_user_does(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI's erase leaves no inbox message of the user's sessions (the user's own words)."""
    _seed(url)
    with open_store(url) as store:
        store.inbox.put("in-alice", session_id="s0", text="my card is 4111")
        store.inbox.put("in-bob", session_id="s5", text="hello from bob")
    code, out, _ = run(capsys, "users", "erase", "alice", "--url", url, "--yes", "--json")
    assert code == 0 and json.loads(out) == {"user_id": "alice", "erased": 4}
    with open_store(url) as store:
        left = [(e.message_id, e.session_id) for e in store.inbox.entries(limit=None)]
    assert left == [("in-bob", "s5")], "users erase left the user's inbox messages behind"


def test_users_export_holds_the_inbox_messages_users_erase_removes(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI's export is the store's: the user's inbox messages too, none of another's."""
    _seed(url)
    with open_store(url) as store:
        store.inbox.put("in-alice", session_id="s0", text="my card is 4111", payload={"n": 1})
        store.inbox.put("in-bob", session_id="s5", text="hello from bob")
        expected = store.export_user("alice")
    code, out, _ = run(capsys, "users", "export", "alice", "--url", url)
    assert code == 0
    document = json.loads(out)
    assert [(m["message_id"], m["text"], m["payload"]) for m in document["inbox"]] == [
        ("in-alice", "my card is 4111", {"n": 1})
    ], "users export left out the inbox messages users erase deletes"
    del document["exported_at"], expected["exported_at"]
    assert document == expected
