"""One write algorithm: every session write goes through ``DialectSupport.execute_write``.

On PostgreSQL that hook sends every kind of write as one statement: an
archiving prune, a summary, a turn of an inbox batch (which keeps its lease),
a clear, a seq deleted and written again. A write that does not stand
changes nothing; one read tells why, and the same hook runs again (no
step-by-step write to fall back on). Statements are counted with SQLAlchemy's
``before_cursor_execute`` event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Role, Runner
from sqlalchemy import Engine, event, text

from chatflow_sqlalchemy.backends.postgresql_dialect import PostgresDialectSupport
from chatflow_sqlalchemy.dialect import SessionWrite
from chatflow_sqlalchemy.inbox import InboxBatch
from chatflow_sqlalchemy.testing.claim_workers import ReplyModel

from . import pg_util

pytestmark = pytest.mark.postgres

BOT = Agent(name="Bot", instructions="")
_HANG_GUARD = 60.0
_STEP_BY_STEP = (
    "BEGIN",
    "INSERT INTO chatflow_messages",
    "DELETE FROM chatflow_messages",
    "INSERT INTO chatflow_message_archive",
    "UPDATE chatflow_message_archive",
    "DELETE FROM chatflow_message_archive",
    "UPDATE chatflow_inbox SET answered_at",
    "UPDATE chatflow_processed_messages SET state",
)
"""How a statement of the step-by-step write begins (none is sent on PostgreSQL)."""


@pytest.fixture
def open_store(pg_url: str, pg_schema: str) -> Iterator[Callable[..., Any]]:
    """Opens PostgreSQL stores on one fresh schema (think: one process each)."""
    opened: list[Any] = []

    def open_one(**options: Any) -> Any:
        opened.append(pg_util.schema_store(pg_url, pg_schema, **options))
        return opened[-1]

    yield open_one
    for store in opened:
        store.close()


@contextmanager
def _sent() -> Iterator[list[str]]:
    """Every statement any engine sends meanwhile, whitespace collapsed."""
    sent: list[str] = []

    def record(*args: Any) -> None:  # (conn, cursor, statement, ...)
        sent.append(" ".join(args[2].split()))

    event.listen(Engine, "before_cursor_execute", record)
    try:
        yield sent
    finally:
        event.remove(Engine, "before_cursor_execute", record)


def _writes(sent: list[str]) -> list[str]:
    """The session writes among ``sent`` (their version swaps), each checked to be one statement.

    Not the inbox's adoption of the session it created (``get_or_create``).
    """
    writes = [sql for sql in sent if pg_util.writes_session(sql) and "new_version" in sql]
    assert writes, sent
    assert all(sql.startswith("WITH ") for sql in writes), writes
    assert not [sql for sql in sent if sql.startswith(_STEP_BY_STEP)], sent
    return writes


def _turn(ctx: Any, name: str) -> None:
    """One turn of ``ctx``: its two messages written by one write."""

    async def run() -> None:
        async with ctx.lock:
            ctx.add_message(Message(role=Role.USER, content=f"u{name}"))
            ctx.add_message(Message(role=Role.MODEL, content=f"m{name}"))

    asyncio.run(run())


def _rows(store: Any, sql: str) -> list[Any]:
    with store.engine.connect() as conn:
        return list(conn.execute(text(sql)).all())


def test_an_archiving_prune_is_one_statement(open_store: Callable[..., Any]) -> None:
    store = open_store(archive_pruned=True)
    ctx = store.get_or_create("s", BOT)
    ctx.max_turns = 1
    _turn(ctx, "0")
    with _sent() as sent:
        _turn(ctx, "1")  # prunes turn 0 into the archive
    assert len(_writes(sent)) == 1
    assert "chatflow_message_archive" in _writes(sent)[0]
    archived = _rows(store, "SELECT seq, content, pending_summary FROM chatflow_message_archive"
                            " ORDER BY seq")
    assert [tuple(row) for row in archived] == [(1, "u0", False), (2, "m0", False)]
    assert [m.content for m in store.get("s").history] == ["u1", "m1"]


def test_a_summary_is_written_by_one_statement(open_store: Callable[..., Any]) -> None:
    async def summarize(previous: str | None, dropped: list[Message]) -> str:
        return ",".join([*([previous] if previous else []), *(str(m.content) for m in dropped)])

    store = open_store(default_max_turns=1, summarizer=summarize)
    ctx = store.get_or_create("s", BOT)
    _turn(ctx, "0")
    with _sent() as sent:
        _turn(ctx, "1")  # prunes turn 0, which waits for its summary
        assert store.wait_for_summaries(_HANG_GUARD)
    writes = _writes(sent)
    assert len(writes) == 2 and "summary=" in writes[1], writes
    assert store.get("s").summary == "u0,m0"
    assert _rows(store, "SELECT seq FROM chatflow_message_archive") == []


def test_an_inbox_batch_turn_keeps_its_lease_in_one_statement(
    open_store: Callable[..., Any],
) -> None:
    store = open_store()
    runner = Runner(starting_agent=BOT, session_store=store, engine=ReplyModel())
    store.inbox.put("m1", session_id="alice", text="hello")

    async def handle(batch: InboxBatch) -> str:
        result = await runner.run_async(session_id=batch.session_id, user_message=batch.text)
        return str(result.content)

    async def serve() -> None:
        serving = asyncio.ensure_future(
            store.inbox.serve(handle, coalesce_seconds=0.0, retry_seconds=0.0)
        )
        try:
            for _ in range(3000):  # a 60 s hang guard
                entries = await store.inbox.aentries(limit=None)
                if [e.state for e in entries] == ["done"]:
                    return
                await asyncio.sleep(0.02)
            raise AssertionError("the batch was not answered")
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)

    with _sent() as sent:
        asyncio.run(serve())
    writes = _writes(sent)
    assert len(writes) == 1 and "chatflow_inbox" in writes[0], writes
    assert "lease_owner=NULL" not in writes[0]  # the batch keeps the lease for its reply
    assert store.get("alice").history[0].content == "hello"


def test_a_clear_is_one_statement(open_store: Callable[..., Any]) -> None:
    store = open_store()
    ctx = store.get_or_create("s", BOT)
    _turn(ctx, "0")
    with _sent() as sent:
        ctx.clear_history()
    assert len(_writes(sent)) == 1
    assert store.get("s").history == []


def test_a_missed_swap_is_explained_by_one_read_then_written_the_same_way(
    open_store: Callable[..., Any],
) -> None:
    """Another store writes inside our turn: our write misses, one locked read sees the
    session moved, the context rebases, and the same one-statement write runs again."""
    mine, theirs = open_store(), open_store()
    ctx = mine.get_or_create("s", BOT)
    _turn(ctx, "0")
    recording = _sent()

    async def turn() -> list[str]:
        async with ctx.lock:
            theirs.get_or_create("s", BOT).add_message(Message(role=Role.USER, content="x"))
            sent = recording.__enter__()
            ctx.add_message(Message(role=Role.USER, content="u1"))
            ctx.add_message(Message(role=Role.MODEL, content="m1"))
        return sent

    try:
        sent = asyncio.run(turn())
    finally:
        recording.__exit__(None, None, None)
    assert len(_writes(sent)) == 2, sent  # the one that missed, the one that stood
    assert [sql for sql in sent if sql.startswith("SELECT") and "FOR NO KEY UPDATE" in sql]
    assert [m.content for m in mine.get("s").history] == ["u0", "m0", "x", "u1", "m1"]


def _session_with(store: Any, contents: list[str]) -> int:
    """A session ``s`` holding ``contents`` at seqs 1, 2, ...; its version."""
    ctx = store.get_or_create("s", BOT)
    for n, content in enumerate(contents):
        role = Role.USER if n % 2 == 0 else Role.MODEL
        ctx.add_message(Message(role=role, content=content))
    return int(_rows(store, "SELECT version FROM chatflow_sessions")[0][0])


def _write(version: int, gone: list[int], rows: dict[int, str]) -> SessionWrite:
    now = datetime.now(timezone.utc)
    return SessionWrite(
        swap={"sid": "s", "expected": version, "new_version": version + 1,
              "agent_name": BOT.name, "now": now},
        gone=gone,
        rows=[
            {"session_id": "s", "seq": seq, "role": "model", "content": content,
             "message_json": Message(role=Role.MODEL, content=content).model_dump_json(),
             "created_at": now}
            for seq, content in rows.items()
        ],
        fence=None,
    )


def test_a_seq_deleted_and_written_again_goes_in_the_same_statement(
    open_store: Callable[..., Any],
) -> None:
    store = open_store()
    version = _session_with(store, ["u0", "m0"])
    support = PostgresDialectSupport()
    with _sent() as sent, store.engine.connect() as conn:
        assert support.execute_write(conn, _write(version, [2], {2: "again", 3: "new"}))
        conn.commit()
    assert len(_writes(sent)) == 1
    rows = _rows(store, "SELECT seq, content FROM chatflow_messages ORDER BY seq")
    assert [tuple(row) for row in rows] == [(1, "u0"), (2, "again"), (3, "new")]


def test_a_write_whose_swap_misses_changes_nothing(open_store: Callable[..., Any]) -> None:
    store = open_store()
    version = _session_with(store, ["u0", "m0"])
    support = PostgresDialectSupport()
    with store.engine.connect() as conn:
        assert not support.execute_write(conn, _write(version - 1, [1, 2], {3: "lost"}))
        conn.commit()
    rows = _rows(store, "SELECT seq, content FROM chatflow_messages ORDER BY seq")
    assert [tuple(row) for row in rows] == [(1, "u0"), (2, "m0")]
