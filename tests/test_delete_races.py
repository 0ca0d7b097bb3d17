"""``store.delete`` racing the work in flight for its session, on real databases.

Delete removes a session with its claims and inbox messages in one
transaction. These tests hold it (or a turn) at a chosen point with a row
lock taken on a connection of their own, so the interleaving is the same on
every run: a delete of an id whose session row appears while it runs, and a
turn or inbox batch whose session is deleted under it.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from chatflow_agent import Agent, Runner
from sqlalchemy import Connection, create_engine, event, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from chatflow_sqlalchemy.exceptions import ChatflowStoreError
from chatflow_sqlalchemy.inbox import InboxBatch, InboxReply
from chatflow_sqlalchemy.testing.engines import ScriptedEngine

from .stores import Opener

AGENT = Agent(name="a", instructions="")

HANG_GUARD = 60.0
"""Bound of every wait (a hung race fails instead of hanging the suite)."""

SERVER_KINDS = [
    pytest.param("postgresql", marks=pytest.mark.postgres),
    pytest.param("mariadb", marks=pytest.mark.mariadb),
]


def _locked(probe: Connection, table: str, column: str, value: str) -> bool:
    """Whether another transaction holds a row lock on ``table``'s row of ``value``."""
    try:
        with probe.begin():
            probe.execute(
                text(f"SELECT {column} FROM {table} WHERE {column} = :v FOR UPDATE NOWAIT"),
                {"v": value},
            )
    except DBAPIError:
        return True
    return False


def _until(condition: Callable[[], bool], *, steady: int = 1) -> None:
    """Wait until ``condition`` holds ``steady`` polls in a row (bounded by HANG_GUARD)."""
    deadline, seen = time.monotonic() + HANG_GUARD, 0
    while seen < steady:
        assert time.monotonic() < deadline, "the race never reached its point"
        seen = seen + 1 if condition() else 0
        time.sleep(0.05)


@pytest.mark.parametrize("sql_store", SERVER_KINDS, indirect=True)
def test_delete_of_an_id_whose_session_appears_meanwhile_does_not_deadlock_a_claimed_turn(
    sql_store: Opener,
) -> None:
    """An id claimed before its first turn, deleted as that turn writes: no deadlock.

    The session row does not exist when the delete starts (a webhook claim
    comes before the session's first turn), so the delete locks the id's
    claim first; the turn then makes the session and its write locks the row
    and waits for the claim. The delete must not then wait for the row the
    turn holds: one of the two would die of a deadlock, a raw driver error.
    The turn finds its claim gone (``ClaimLostError``) and writes nothing.
    """
    store = sql_store(turn_lease_seconds=HANG_GUARD)
    sid, mid = f"new-{uuid.uuid4().hex[:8]}", f"wamid-{uuid.uuid4().hex[:8]}"
    store.inbox.put(f"in-{mid}", session_id=sid, text="held")  # a row to hold the delete at
    runner = Runner(starting_agent=AGENT, session_store=store, engine=ScriptedEngine())
    claimed, go = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def webhook() -> None:
        try:
            with store.claim(mid, session_id=sid) as claim:
                assert claim.acquired
                claimed.set()
                assert go.wait(HANG_GUARD)
                claim.response = asyncio.run(runner.run_async(sid, "hello")).content
            outcome["turn"] = "written"
        except BaseException as exc:
            outcome["turn"] = exc

    def delete() -> None:
        try:
            outcome["delete"] = store.delete(sid)
        except BaseException as exc:
            outcome["delete"] = exc

    turn, deleting = threading.Thread(target=webhook), threading.Thread(target=delete)
    with store.engine.connect() as holder, store.engine.connect() as probe:
        holder.begin()
        holder.execute(text("SELECT id FROM chatflow_inbox WHERE session_id = :sid FOR UPDATE"),
                       {"sid": sid})
        turn.start()
        assert claimed.wait(HANG_GUARD)
        deleting.start()
        # The delete has the claim and waits for the inbox row held here.
        _until(lambda: _locked(probe, "chatflow_processed_messages", "message_id", mid))
        go.set()
        # The turn's write has the session row it made and waits for the claim.
        _until(lambda: _locked(probe, "chatflow_sessions", "session_id", sid), steady=5)
        holder.rollback()
        deleting.join(HANG_GUARD)
        turn.join(HANG_GUARD)
    assert not deleting.is_alive() and not turn.is_alive()
    assert outcome["delete"] is False, outcome["delete"]  # no session row when it began
    assert isinstance(outcome["turn"], ChatflowStoreError), outcome["turn"]
    assert not store.is_message_processed(mid)
    assert store.get(sid) is None and sid not in store.list_sessions()


def _gone(store: Any, sid: str) -> None:
    """Nothing of the session is shown: no empty session was left in its place."""
    assert store.get(sid) is None, "an empty session was left where the deleted one was"
    assert sid not in store.list_sessions()


@pytest.mark.parametrize("deleter", ["this store", "another store"])
def test_a_batch_whose_session_is_deleted_under_it_leaves_no_empty_session(
    any_store: Opener, deleter: str
) -> None:
    """Deleted while ``handle`` runs: the batch's turn fails and leaves nothing behind.

    The turn's ``get_or_create`` makes the session anew (the delete took its
    row), and its write fails (the batch's lease went with the row). The
    session it made for the turn must be unborn again, as after any failed
    first turn; it stayed, empty, in ``get`` and ``list_sessions``.
    """
    store = any_store()
    other = store if deleter == "this store" else any_store()
    if other is store and deleter == "another store":
        pytest.skip("the in-memory store has no second store on its data")
    sid = f"gone-{uuid.uuid4().hex[:8]}"
    store.inbox.put(f"in-{sid}", session_id=sid, text="delete me")
    runner = Runner(starting_agent=AGENT, session_store=store, engine=ScriptedEngine())
    failures: list[BaseException] = []
    sent: list[InboxReply] = []

    async def handle(batch: InboxBatch) -> str:
        await asyncio.to_thread(other.delete, sid)
        try:
            return str((await runner.run_async(sid, batch.text)).content)
        except Exception as exc:
            failures.append(exc)
            raise

    async def send(reply: InboxReply) -> None:
        sent.append(reply)

    async def serve() -> None:
        serving = asyncio.ensure_future(store.inbox.serve(handle, send=send, coalesce_seconds=0))
        try:
            deadline = time.monotonic() + HANG_GUARD
            while not failures:
                assert time.monotonic() < deadline, "the batch never ran"
                await asyncio.sleep(0.02)
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)

    asyncio.run(serve())
    (failure,) = failures
    assert isinstance(failure, ChatflowStoreError), failure
    assert sent == []
    _gone(store, sid)
    _gone(other, sid)


def test_a_claimed_turn_whose_session_another_store_deleted_leaves_no_empty_session(
    sql_store: Opener,
) -> None:
    """Deleted by another store (process, ``sessions delete``) between claim and turn.

    On PostgreSQL the claim took the session's lease with it, and this store
    offered it to the claim's turn; ``forget_offered`` only hears of deletes
    made through this store. The turn makes the session anew, and its write
    fails on the lease of the deleted row: the session it made must not stay.
    """
    store, other = sql_store(), sql_store()
    sid, mid = f"gone-{uuid.uuid4().hex[:8]}", f"wamid-{uuid.uuid4().hex[:8]}"
    other_runner = Runner(starting_agent=AGENT, session_store=other, engine=ScriptedEngine())
    asyncio.run(other_runner.run_async(sid, "first"))  # no context of it here
    runner = Runner(starting_agent=AGENT, session_store=store, engine=ScriptedEngine())
    with pytest.raises(ChatflowStoreError), store.claim(mid, session_id=sid) as claim:
        assert claim.acquired
        assert other.delete(sid) is True
        claim.response = asyncio.run(runner.run_async(sid, "hello")).content
    _gone(store, sid)
    _gone(other, sid)
    assert not store.is_message_processed(mid)


@pytest.mark.parametrize("sql_store", SERVER_KINDS[:1], indirect=True)
def test_get_or_create_whose_insert_loses_to_a_session_deleted_at_once_creates_it(
    sql_store: Opener,
) -> None:
    """Another writer's session row, deleted between this insert and its read: made anew.

    ``get_or_create`` inserts the row unless it exists, then reads it in the
    same transaction. On PostgreSQL the insert that finds another writer's
    committed row does nothing and locks nothing, so a delete can commit
    before the read, which then finds no row: ``assert stored is not None``
    failed (an ``AssertionError`` out of ``get_or_create``, or a turn).
    The other writer and the delete run on connections of their own, at
    that point of the store's transaction. (PostgreSQL only: MariaDB's
    insert locks the row it finds, SQLite's transaction the database.)
    """
    store = sql_store()
    sid = f"raced-{uuid.uuid4().hex[:8]}"
    other = sql_store()
    other_runner = Runner(starting_agent=AGENT, session_store=other, engine=ScriptedEngine())
    raced: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("INSERT INTO chatflow_sessions") and not raced:
            raced.append("inserted")
            asyncio.run(other_runner.run_async(sid, "first"))  # the other writer's row

    def after(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("INSERT INTO chatflow_sessions") and raced == ["inserted"]:
            raced.append("deleted")
            assert other.delete(sid) is True

    event.listen(store.engine, "before_cursor_execute", before)
    event.listen(store.engine, "after_cursor_execute", after)
    try:
        ctx = store.get_or_create(sid, AGENT, user_id="u")
    finally:
        event.remove(store.engine, "before_cursor_execute", before)
        event.remove(store.engine, "after_cursor_execute", after)
    assert raced == ["inserted", "deleted"]
    assert ctx.history == []
    stored = other.get(sid)
    assert stored is not None and stored.history == []


def _a_lock_is_awaited(probe: Connection) -> bool:
    """Whether some transaction of the PostgreSQL server waits for a lock (its own view)."""
    query = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
    with probe.begin():
        return bool(probe.execute(text(query)).scalar_one())


@pytest.mark.parametrize(
    "sql_store", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True
)
def test_users_erase_does_not_deadlock_a_turn_holding_the_session_row(sql_store: Opener) -> None:
    """The CLI's erase takes the user's session rows first, as a turn's write does.

    A turn's write holds its session row and then updates the session's claim
    (shown on PostgreSQL, whose own view says when the erase waits).
    An erase that deleted the claims first and the session rows last held the
    claim and waited for the row: one of the two died of a deadlock, a raw
    driver error. Taking the rows first, the erase waits and then erases.
    """
    from chatflow_sqlalchemy.sql_lifecycle import erase_user_rows

    store = sql_store()
    user, sid, mid = f"u-{uuid.uuid4().hex[:8]}", f"s-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    store.get_or_create(sid, AGENT, user_id=user)
    with store.claim(mid, session_id=sid) as claim:
        claim.response = "stored"
    outcome: dict[str, Any] = {}

    def erase() -> None:
        try:
            with store.engine.begin() as conn:
                outcome["erased"] = erase_user_rows(conn, user)
        except BaseException as exc:
            outcome["erased"] = exc

    erasing = threading.Thread(target=erase)
    watcher = create_engine(store.engine.url, poolclass=NullPool)  # server views only
    with store.engine.connect() as turn, watcher.connect() as probe:
        turn.begin()  # as a turn's write: the session row first ...
        turn.execute(text("SELECT version FROM chatflow_sessions WHERE session_id = :sid "
                          "FOR UPDATE"), {"sid": sid})
        erasing.start()
        _until(lambda: _a_lock_is_awaited(probe), steady=3)
        # ... then its claim, which an erase that began with the claims holds.
        turn.execute(text("UPDATE chatflow_processed_messages SET response = 'written' "
                          "WHERE message_id = :mid"), {"mid": mid})
        turn.commit()
        erasing.join(HANG_GUARD)
    watcher.dispose()
    assert not erasing.is_alive()
    assert outcome["erased"] == 1, outcome["erased"]
    assert store.list_sessions(user_id=user) == [] and not store.is_message_processed(mid)
