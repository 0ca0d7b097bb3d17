"""PostgreSQL's turn locks on their own engine: what SQLAlchemy sees, what they leave behind."""

from __future__ import annotations

import asyncio
import gc
import warnings
from typing import Any

import pytest
import sqlalchemy as sa
from chatflow_agent import Agent, Message, Role, Runner
from sqlalchemy import event

from chatflow_sqlalchemy.backends.postgresql import PostgresSessionStore
from chatflow_sqlalchemy.testing import ScriptedEngine

from . import pg_util

pytestmark = pytest.mark.postgres

BOT = Agent(name="Bot", instructions="Answer.")


_BACKENDS = "SELECT count(*) FROM pg_stat_activity WHERE application_name = :name"
_ADVISORY_LOCKS = (
    "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
    "WHERE l.locktype = 'advisory' AND a.application_name = :name"
)


def _count_of(url: str, schema: str, query: str) -> int:
    """``query``'s count for ``schema``'s stores (their ``application_name``), read now."""
    admin = sa.create_engine(url)
    try:
        with admin.connect() as conn:
            return int(conn.execute(sa.text(query), {"name": schema}).scalar_one())
    finally:
        admin.dispose()


def test_each_turn_lock_is_one_statement_seen_by_the_lock_engine(
    pg_url: str, pg_schema: str
) -> None:
    """Taking the lock and reading the version is one statement; giving it back is another,
    both before/after events and the statement's own transaction control included."""
    store = pg_util.schema_store(pg_url, pg_schema)
    (lock_engine,) = store.turn_locks.engines
    before: list[str] = []
    after: list[str] = []
    event.listen(lock_engine, "before_cursor_execute", lambda *a: before.append(a[2]))
    event.listen(lock_engine, "after_cursor_execute", lambda *a: after.append(a[2]))
    try:
        ctx = store.get_or_create("s", BOT)

        async def turn() -> None:
            async with ctx.lock:
                ctx.add_message(Message(role=Role.USER, content="q"))

        asyncio.run(turn())
    finally:
        store.close()
    assert before == after
    assert len(before) == 2, before
    take, give_back = before
    assert "chatflow_turn_lock(" in take and take.rstrip().endswith("BEGIN")
    assert give_back == "ROLLBACK"


def test_a_turn_gives_its_lock_back_before_it_returns(pg_url: str, pg_schema: str) -> None:
    """The lock's ``ROLLBACK`` is answered before the turn returns: nothing is held then,
    on the server either, and the session's next try in this process takes it at once."""
    store = pg_util.schema_store(pg_url, pg_schema)
    locks = store.turn_locks
    try:
        ctx = store.get_or_create("s", BOT)

        async def turns() -> list[list[str]]:
            seen = []
            for turn in range(3):
                async with ctx.lock:
                    ctx.add_message(Message(role=Role.USER, content=f"q{turn}"))
                seen.append(locks.held())
            return seen

        assert asyncio.run(turns()) == [[], [], []], "each turn gave its lock back"
        assert _count_of(pg_url, pg_schema, _ADVISORY_LOCKS) == 0
        assert [m.content for m in store.get_or_create("s", BOT).history] == ["q0", "q1", "q2"]

        async def take_right_after_release() -> list[bool]:
            taken = []
            for _ in range(5):
                taken.append((await locks.try_acquire("t"))[0])
                await locks.release("t")
            return taken

        assert asyncio.run(take_right_after_release()) == [True] * 5
    finally:
        store.close()


def test_a_release_pending_when_the_store_closes_ends_cleanly(
    pg_url: str, pg_schema: str
) -> None:
    """``aclose`` right after a turn: no lock is left, and the connection is closed
    without a warning."""
    store = pg_util.schema_store(pg_url, pg_schema)
    ctx = store.get_or_create("s", BOT)

    async def turn_then_close() -> None:
        async with ctx.lock:
            ctx.add_message(Message(role=Role.USER, content="q"))
        assert store.turn_locks.held() == []
        await store.aclose()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(turn_then_close())
        gc.collect()
    assert [str(w.message) for w in caught if "connection" in str(w.message)] == []
    assert store.turn_locks.held() == []
    assert _count_of(pg_url, pg_schema, _BACKENDS) == 0


def test_turn_locks_refuse_an_isolation_level_that_reads_the_version_too_early(
    pg_url: str, pg_schema: str
) -> None:
    """Under REPEATABLE READ the version would be read in a snapshot older than the lock:
    the turn fails with the fix named, and no lock is left behind."""
    options = f"-csearch_path={pg_schema} -c default_transaction_isolation=repeatable\\ read"
    store = PostgresSessionStore(
        pg_url, connect_args={"options": options, "application_name": pg_schema}
    )
    try:
        ctx = store.get_or_create("s", BOT)

        async def turn() -> None:
            async with ctx.lock:
                ctx.add_message(Message(role=Role.USER, content="q"))

        with pytest.raises(sa.exc.DBAPIError) as caught:
            asyncio.run(turn())
        assert "need READ COMMITTED, not repeatable read" in str(caught.value)
        assert "default_transaction_isolation" in str(caught.value)
        assert store.turn_locks.held() == []
    finally:
        store.close()


def test_lock_connections_of_finished_loops_are_closed_without_warnings(
    pg_url: str, pg_schema: str
) -> None:
    """``asyncio.run`` per request: each run's lock connection is closed once its loop is
    gone (its socket cut, SQLAlchemy's connection let go), never left for the collector."""
    store = pg_util.schema_store(pg_url, pg_schema)
    runner = Runner(starting_agent=BOT, session_store=store, engine=ScriptedEngine())
    opened: list[Any] = []
    (lock_engine,) = store.turn_locks.engines
    event.listen(lock_engine, "connect", lambda *_: opened.append(1))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for turn in range(6):
                asyncio.run(runner.run_async("s", f"q{turn}"))
            asyncio.run(asyncio.sleep(0))  # a loop after the last: it lets the last one go
            gc.collect()
        # Each loop opens its own lock connection; the engine's very first one is made
        # once, on a loop of the locks' own (it initialises SQLAlchemy's dialect).
        assert len(opened) == 6 + 1
        assert _count_of(pg_url, pg_schema, _BACKENDS) <= 3, "old loops' lock connections stay open"
        assert [str(w.message) for w in caught if "connection" in str(w.message)] == []
    finally:
        store.close()
    assert _count_of(pg_url, pg_schema, _BACKENDS) == 0


def test_a_loop_closed_while_holding_a_lock_leaves_nothing_held_after_close(
    pg_url: str, pg_schema: str
) -> None:
    """A hand-run loop closed with a turn lock held (its heartbeat still waiting): the
    store still closes, cutting the lock's socket, so the server frees the lock at once."""
    store = pg_util.schema_store(pg_url, pg_schema)
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(store.turn_locks.try_acquire("x"))[0]
    finally:
        loop.close()
    assert _count_of(pg_url, pg_schema, _ADVISORY_LOCKS) == 1
    store.close()
    assert store.turn_locks.held() == []
    freed = asyncio.run(_until_zero(pg_url, pg_schema))
    assert freed, "the closed loop's lock outlived store.close()"


async def _until_zero(url: str, schema: str) -> bool:
    for _ in range(300):  # a hang guard: the server ends a cut connection's backend at once
        if _count_of(url, schema, _ADVISORY_LOCKS) == 0:
            return True
        await asyncio.sleep(0.1)
    return False


def test_a_loop_closed_during_the_first_connection_does_not_stall_other_loops(
    pg_url: str, pg_schema: str
) -> None:
    """The lock engine's first connection is made by one loop at a time; one whose loop
    was closed half-way is taken over, so the next loop's turn lock is taken."""
    store = pg_util.schema_store(pg_url, pg_schema)
    try:
        loop = asyncio.new_event_loop()
        try:
            with pytest.raises(asyncio.TimeoutError):
                loop.run_until_complete(
                    asyncio.wait_for(store.turn_locks.try_acquire("x"), 0.001)
                )
        finally:
            loop.close()

        async def other_loop() -> tuple[bool, bool, int | None]:
            return await asyncio.wait_for(store.turn_locks.try_acquire("y"), 30)

        assert asyncio.run(other_loop())[0]
    finally:
        store.close()
