"""Command line of the durable inbox: ``inbox list``, ``inbox retry``, ``inbox stats``,
``inbox purge``, on a real SQLite file and (when configured) PostgreSQL.

The states are reached for real: messages are put with ``store.inbox.put`` and a worker
of ``store.inbox.serve`` answers them (``sent``, ``done``) or fails them until they are
``dead``; a batch held open by its handler is ``in_flight``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote

import pytest
from chatflow_agent import Agent
from sqlalchemy import Engine, Table, event, update

from chatflow_sqlalchemy import open_store
from chatflow_sqlalchemy.cli import main
from chatflow_sqlalchemy.inbox import INBOX_STATES, InboxBatch, InboxReply
from chatflow_sqlalchemy.models import ChatflowInboxItem, utcnow

from . import pg_util

HANG_GUARD_SECONDS = 60.0
"""How long a worker may take to reach a state before the test fails (a hang guard)."""

SEEDED = {"sent-1": "sent", "bad-1": "dead", "bad-2": "dead", "done-1": "done",
          "wait-1": "pending"}
"""What :func:`_seed` leaves: message id -> state."""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHATFLOW_DATABASE_URL", raising=False)
    monkeypatch.delenv("CHATFLOW_AUTO_MIGRATE", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'inbox.db'}"
        return
    base = pg_util.postgres_url()
    with pg_util.fresh_schema(base) as schema:  # never the shared schema of other tests
        yield f"{base}?options={quote(f'-csearch_path={schema}')}"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def read_json(capsys: pytest.CaptureFixture[str], url: str, *argv: str) -> Any:
    code, out, err = run(capsys, "--url", url, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def one_error_line(code: int, out: str, err: str, want_code: int) -> str:
    assert code == want_code, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in out + err
    return lines[0]


# --------------------------------------------------------------------------- driving states


async def _answer(batch: InboxBatch) -> str:
    return f"answered {batch.text}"


async def _fail_bad(batch: InboxBatch) -> str:
    if batch.session_id == "s-bad":
        raise RuntimeError("model down")
    return await _answer(batch)


async def _serve_until(
    store: Any,
    handle: Callable[[InboxBatch], Awaitable[str | None]],
    want: dict[str, str],
    *,
    send: Callable[[InboxReply], Awaitable[None]] | None = None,
) -> None:
    """Run a worker until every message of ``want`` is in its state, then cancel it."""
    worker = asyncio.ensure_future(store.inbox.serve(
        handle, send=send, max_attempts=1, retry_seconds=0, coalesce_seconds=0
    ))

    async def reached() -> None:
        while True:
            states = {e.message_id: e.state for e in await store.inbox.aentries(limit=None)}
            if all(states.get(mid) == state for mid, state in want.items()):
                return
            if worker.done():
                worker.result()  # the worker stopped: show why
                raise AssertionError(f"the worker stopped at {states}")
            await asyncio.sleep(0.01)

    try:
        await asyncio.wait_for(reached(), HANG_GUARD_SECONDS)
    finally:
        await _stop(worker)


async def _stop(worker: asyncio.Future[None]) -> None:
    """Cancel the worker until it stops (within the hang guard).

    One cancel should do; on Python 3.10 and 3.11 the worker's idle
    ``asyncio.wait_for(wake.wait(), idle)`` returns normally when the cancel
    lands just as its wake-up completes (the cancel is lost), so it is sent
    again until the worker is done.
    """

    async def stopped() -> None:
        while not worker.done():
            worker.cancel()
            await asyncio.wait({worker}, timeout=1)

    await asyncio.wait_for(stopped(), HANG_GUARD_SECONDS)
    if not worker.cancelled():
        worker.result()  # a worker that failed: show why


async def _noop_send(reply: InboxReply) -> None:
    assert reply.text.startswith("answered")


def _seed(url: str) -> None:
    """Leave the messages of :data:`SEEDED` in their states, each reached by a real worker."""

    async def drive() -> None:
        with open_store(url) as store:
            store.inbox.put("sent-1", session_id="s-ok", text="hello")
            store.inbox.put("bad-1", session_id="s-bad", text="one")
            store.inbox.put("bad-2", session_id="s-bad", text="two")
            await _serve_until(store, _fail_bad, {"sent-1": "sent", "bad-1": "dead",
                                                  "bad-2": "dead"}, send=_noop_send)
            store.inbox.put("done-1", session_id="s-quiet", text="no reply sent")
            await _serve_until(store, _answer, {"done-1": "done"})
            store.inbox.put("wait-1", session_id="s-wait", text="later")

    asyncio.run(drive())


def _states(document: Any) -> dict[str, str]:
    return {m["message_id"]: m["state"] for m in document["messages"]}


# --------------------------------------------------------------------------- list and stats


def test_list_shows_every_state_reached_by_a_worker(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _seed(url)
    listed = read_json(capsys, url, "inbox", "list")
    assert _states(listed) == SEEDED
    assert [m["message_id"] for m in listed["messages"]] == list(SEEDED)  # arrival order
    assert listed["state"] is None and listed["total"] == len(SEEDED)
    assert set(listed["messages"][0]) == {
        "message_id", "session_id", "state", "attempts", "received_at", "updated_at",
        "sent_at", "error",
    }

    dead = read_json(capsys, url, "inbox", "list", "--state", "dead")
    assert dead["state"] == "dead" and dead["total"] == 2
    assert [(m["message_id"], m["session_id"], m["attempts"]) for m in dead["messages"]] == [
        ("bad-1", "s-bad", 1), ("bad-2", "s-bad", 1)
    ]
    assert all("RuntimeError: model down" in m["error"] for m in dead["messages"])

    page = read_json(capsys, url, "inbox", "list", "--limit", "2")
    assert [m["message_id"] for m in page["messages"]] == ["sent-1", "bad-1"]
    assert page["total"] == len(SEEDED)

    code, out, err = run(capsys, "--url", url, "inbox", "list")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0].split() == [
        "MESSAGE", "ID", "SESSION", "STATE", "ATTEMPTS", "RECEIVED", "UPDATED", "ERROR"
    ]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert rows.keys() == SEEDED.keys()
    assert rows["bad-1"].split()[1:4] == ["s-bad", "dead", "1"]
    assert "RuntimeError: model down" in rows["bad-1"]
    assert rows["wait-1"].split()[1:4] == ["s-wait", "pending", "0"]
    assert "chatflow-sqlalchemy inbox retry MESSAGE_ID" in err  # a dead message is shown

    code, out, err = run(capsys, "--url", url, "inbox", "list", "--limit", "1")
    assert code == 0 and "showing 1 of 5; use --limit to see more" in out
    assert "inbox retry" not in err  # no dead message among those shown
    code, out, _ = run(capsys, "--url", url, "inbox", "list", "--state", "in_flight")
    assert code == 0 and out.strip() == "no in_flight messages in the inbox"


def test_stats_counts_each_state(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--url", url, "db", "upgrade")
    assert code == 0
    empty = read_json(capsys, url, "inbox", "stats")
    assert empty == {"counts": dict.fromkeys(INBOX_STATES, 0), "oldest_pending_seconds": None,
                     "dead_last_hour": 0}
    code, out, _ = run(capsys, "--url", url, "inbox", "list")
    assert code == 0 and out.strip() == "no messages in the inbox"

    _seed(url)
    stats = read_json(capsys, url, "inbox", "stats")
    assert stats["counts"] == {"pending": 1, "in_flight": 0, "done": 1, "sent": 1, "dead": 2}
    assert stats["oldest_pending_seconds"] is not None and stats["oldest_pending_seconds"] >= 0
    assert stats["dead_last_hour"] == 2

    code, out, err = run(capsys, "--url", url, "inbox", "stats")
    assert code == 0, err
    table = [line.split() for line in out.strip().splitlines()]
    assert table[0] == ["STATE", "MESSAGES"]
    assert dict(row for row in table[1:6]) == {
        "pending": "1", "in_flight": "0", "done": "1", "sent": "1", "dead": "2"
    }
    assert "oldest pending message: waiting " in out
    assert "dead in the last hour: 2" in out
    assert "inbox list --state dead" in err


def test_an_in_flight_batch_is_listed_and_not_retried(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    async def scenario() -> None:
        held, release = asyncio.Event(), asyncio.Event()

        async def slow(batch: InboxBatch) -> str:
            held.set()
            await release.wait()
            return "done at last"

        with open_store(url) as store:
            store.inbox.put("slow-1", session_id="s-slow", text="take your time")
            worker = asyncio.ensure_future(_serve_until(store, slow, {"slow-1": "done"}))
            await asyncio.wait_for(held.wait(), HANG_GUARD_SECONDS)
            argv = ["--url", url, "inbox", "list", "--state", "in_flight", "--json"]
            assert await asyncio.to_thread(main, argv) == 0
            listed = json.loads(capsys.readouterr().out)
            assert _states(listed) == {"slow-1": "in_flight"}
            code = await asyncio.to_thread(main, ["--url", url, "inbox", "retry", "slow-1"])
            captured = capsys.readouterr()
            line = one_error_line(code, captured.out, captured.err, 1)
            assert "'slow-1' is in_flight, not dead (a worker is answering it)" in line
            release.set()
            await worker

    asyncio.run(scenario())
    assert _states(read_json(capsys, url, "inbox", "list")) == {"slow-1": "done"}


# --------------------------------------------------------------------------- retry


def test_retry_moves_a_dead_batch_back_to_pending(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _seed(url)
    assert read_json(capsys, url, "inbox", "retry", "bad-2") == {
        "message_id": "bad-2", "retried": True
    }
    assert read_json(capsys, url, "inbox", "list", "--state", "dead")["messages"] == []
    pending = read_json(capsys, url, "inbox", "list", "--state", "pending")["messages"]
    assert [(m["message_id"], m["attempts"]) for m in pending] == [
        ("bad-1", 0), ("bad-2", 0), ("wait-1", 0)  # the whole dead batch, attempts reset
    ]

    async def answer_them() -> None:  # a worker answers them now: the retry was real
        with open_store(url) as store:
            await _serve_until(store, _answer, {"bad-1": "done", "bad-2": "done"})

    asyncio.run(answer_them())

    code, out, err = run(capsys, "--url", url, "inbox", "retry", "bad-1")
    line = one_error_line(code, out, err, 1)
    assert "message 'bad-1' is done, not dead (it was answered)" in line
    assert "see them with: chatflow-sqlalchemy inbox list --state dead" in line
    code, out, err = run(capsys, "--url", url, "inbox", "retry", "sent-1", "--json")
    assert "is sent, not dead" in one_error_line(code, out, err, 1)
    assert out == ""  # stdout stays empty for scripts: the error is on stderr


def test_sessions_list_skips_sessions_before_their_first_turn(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The inbox leases a session row before its first turn; like ``list_sessions()``,
    ``sessions list`` shows it only once a turn gave it its agent."""
    _seed(url)  # every batch answered without a turn: no session is born
    with open_store(url) as store:
        store.get_or_create("born", Agent(name="Bot", instructions=""))
    listed = read_json(capsys, url, "sessions", "list")["sessions"]
    assert [entry["session_id"] for entry in listed] == ["born"]


def test_retry_in_human_words(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    _seed(url)
    code, out, err = run(capsys, "--url", url, "inbox", "retry", "bad-1")
    assert code == 0, err
    assert out.strip() == (
        "retried 'bad-1': it is pending again with the rest of its batch; "
        "the next worker of inbox.serve answers it"
    )


@pytest.mark.parametrize(
    ("argv", "code", "needle"),
    [
        (["inbox", "retry", "nope"], 1, "no message 'nope' in the inbox of"),
        (["inbox", "retry"], 2, "Missing argument 'MESSAGE_ID'"),
        (["inbox", "retry", "x" * 300], 2, "message_id is longer than"),
        (["inbox", "retry", ""], 2, "message_id must be a non-empty str"),
        (["inbox", "list", "--state", "lost"], 2, "'lost' is not one of 'pending'"),
        (["inbox", "list", "--limit", "0"], 2, "--limit"),
        (["inbox", "purge", "--ttl-hours", "-1", "--yes"], 2, "--ttl-hours must be a positive"),
        (["inbox", "purge", "--ttl-hours", "5000000", "--yes"], 2, "--ttl-hours: "),
        (["inbox", "nosuch"], 2, "No such command 'nosuch'"),
    ],
)
def test_bad_input_is_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], code: int, needle: str
) -> None:
    url = f"sqlite:///{tmp_path / 'bad.db'}"
    open_store(url).close()
    got, out, err = run(capsys, "--url", url, *argv)
    line = one_error_line(got, out, err, code)
    assert needle in line
    if code == 2 and "Missing" in needle:
        assert "(see: chatflow-sqlalchemy inbox retry --help)" in line
    if needle.startswith("no message"):
        assert "see: chatflow-sqlalchemy inbox list" in line


def test_unknown_state_names_every_state(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "inbox", "list", "--state", "lost")
    line = one_error_line(code, out, err, 2)
    for state in INBOX_STATES:
        assert f"'{state}'" in line


# --------------------------------------------------------------------------- purge


def _age_answered(url: str, days: float) -> None:
    """Move the answered messages' last change ``days`` back (as if answered long ago)."""
    table = cast(Table, ChatflowInboxItem.__table__)
    with open_store(url) as store, store.engine.begin() as conn:
        conn.execute(
            update(table)
            .where(table.c.state.in_(["done", "sent"]))
            .values(updated_at=utcnow() - timedelta(days=days))
        )


def test_purge_removes_answered_messages_past_the_window(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _seed(url)
    _age_answered(url, days=1)
    assert read_json(capsys, url, "inbox", "purge") == {"ttl_hours": 192.0, "removed": 0}

    code, out, err = run(capsys, "--url", url, "inbox", "purge", "--ttl-hours", "1")
    line = one_error_line(code, out, err, 2)  # inside the default window: asks, no terminal
    assert "2 answered message(s) still inside the default 192 h dedup window" in line
    assert "pass --yes" in line
    assert _states(read_json(capsys, url, "inbox", "list")) == SEEDED

    code, out, err = run(capsys, "--url", url, "inbox", "purge", "--ttl-hours", "1", "--yes")
    assert code == 0, err
    assert out.strip() == "removed 2 answered inbox message(s) older than 1 h"
    left = _states(read_json(capsys, url, "inbox", "list"))
    assert left == {"bad-1": "dead", "bad-2": "dead", "wait-1": "pending"}

    _age_answered(url, days=30)  # nothing answered is left: dead and pending stay
    assert read_json(capsys, url, "inbox", "purge")["removed"] == 0
    assert _states(read_json(capsys, url, "inbox", "list")) == left


# --------------------------------------------------------------------------- read-only, safety


def test_list_and_stats_leave_the_file_byte_for_byte(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "inbox.db"
    url = f"sqlite:///{path}"
    _seed(url)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    for argv in (["inbox", "list"], ["inbox", "stats"], ["inbox", "list", "--json"],
                 ["inbox", "stats", "--json"], ["inbox", "list", "--state", "dead"]):
        code, _, err = run(capsys, "--url", url, *argv)
        assert code == 0, (argv, err)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inbox.db"]


def test_stats_on_sqlite_read_one_snapshot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A message that dies while ``inbox stats`` reads is counted once, as it was.

    Another store marks the only pending message dead right after the counts are
    read: the oldest pending age and the dead of the last hour are read from the
    same snapshot as the counts, so they agree with them (SQLite; a server database
    reads each statement at its own time, as the store's ``stats`` does).
    """
    url = f"sqlite:///{tmp_path / 'inbox.db'}"
    moved: list[str] = []
    with open_store(url) as store:
        store.inbox.put("m-1", session_id="s-1", text="hello")

        def dies_meanwhile(*args: Any) -> None:  # (conn, cursor, statement, ...)
            if "GROUP BY" in args[2] and not moved:
                moved.append(args[2])
                with store.engine.begin() as conn:
                    conn.execute(update(cast(Table, ChatflowInboxItem.__table__)).values(
                        state="dead", error="died meanwhile", updated_at=utcnow()
                    ))

        event.listen(Engine, "after_cursor_execute", dies_meanwhile)
        try:
            stats = read_json(capsys, url, "inbox", "stats")
        finally:
            event.remove(Engine, "after_cursor_execute", dies_meanwhile)
    assert moved, "the message died while the stats were read"
    assert stats["counts"]["pending"] == 1 and stats["counts"]["dead"] == 0
    assert stats["oldest_pending_seconds"] is not None and stats["dead_last_hour"] == 0
    after = read_json(capsys, url, "inbox", "stats")
    assert after["counts"]["dead"] == 1 and after["oldest_pending_seconds"] is None


def test_read_commands_refuse_an_old_schema_and_change_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "old.db"
    url = f"sqlite:///{path}"
    assert run(capsys, "--url", url, "db", "upgrade", "0008")[0] == 0  # before the inbox
    for argv in (["inbox", "list"], ["inbox", "stats"], ["inbox", "retry", "m"],
                 ["inbox", "purge", "--yes"]):
        code, out, err = run(capsys, "--url", url, *argv)
        line = one_error_line(code, out, err, 2)
        assert "0008" in line and "chatflow-sqlalchemy db upgrade" in line, argv
    code, out, _ = run(capsys, "--url", url, "db", "current", "--json")
    assert json.loads(out)["chains"][0]["current"] == "0008"

    missing = tmp_path / "none" / "x.db"
    code, out, err = run(capsys, "--url", f"sqlite:///{missing}", "inbox", "stats")
    assert "nothing was created" in one_error_line(code, out, err, 2)
    assert not missing.parent.exists()


def test_stored_text_cannot_drive_the_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'evil.db'}"
    with open_store(url) as store:
        store.inbox.put("evil\x1b[31m-id", session_id="s\x1b]0;owned\x07", text="x")
    code, out, err = run(capsys, "--url", url, "inbox", "list")
    assert code == 0, err
    assert "\x1b" not in out and "\x07" not in out
    assert "evil\\x1b[31m-id" in out


def test_the_cli_states_are_the_inbox_states() -> None:
    from chatflow_sqlalchemy import cli

    assert cli.INBOX_STATES == INBOX_STATES


def test_inbox_help_imports_nothing_heavy() -> None:
    code = (
        "import sys\n"
        "from chatflow_sqlalchemy.cli import main\n"
        "for argv in (['inbox'], ['inbox', '--help'], ['inbox', 'list', '--help'],\n"
        "             ['inbox', 'retry', '--help'], ['inbox', 'stats', '--help'],\n"
        "             ['inbox', 'purge', '--help']):\n"
        "    assert main(argv) == 0, argv\n"
        "heavy = ('sqlalchemy', 'alembic', 'chatflow_agent', 'rich', 'pydantic')\n"
        "mine = ('chatflow_sqlalchemy.inbox', 'chatflow_sqlalchemy.store')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy or m in mine))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
