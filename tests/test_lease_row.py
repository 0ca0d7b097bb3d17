"""The turn's lease as the database holds it, on SQLite and PostgreSQL.

DESIGN "The turn: one lease, one write": a turn takes its session's lease
with one statement, which the engine's events see like every other, and
gives it back by the statement that writes the turn. Once ``async with
ctx.lock`` returned, the session row holds no lease, so another store (a
process) takes it at once; a store closed right after a turn leaves no
lease and no connection behind.
"""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import Callable
from typing import Any, cast

import pytest
import sqlalchemy as sa
from chatflow_agent import Agent, Message, Role
from sqlalchemy import Table, event, select

from chatflow_sqlalchemy import SQLAlchemySessionStore
from chatflow_sqlalchemy.models import ChatflowSession

from . import pg_util

Opener = Callable[[], SQLAlchemySessionStore]

BOT = Agent(name="Bot", instructions="")

_SESSIONS = cast(Table, ChatflowSession.__table__)


def lease_row(store: SQLAlchemySessionStore, session_id: str) -> tuple[Any, ...]:
    """``(lease_owner, lease_expires_at, lease_fence)`` of the session, as committed."""
    query = select(
        _SESSIONS.c.lease_owner, _SESSIONS.c.lease_expires_at, _SESSIONS.c.lease_fence
    ).where(_SESSIONS.c.session_id == session_id)
    with store.engine.connect() as conn:
        return tuple(conn.execute(query).one())


def _one_line(statement: str) -> str:
    return " ".join(statement.split())


def test_a_turn_takes_its_lease_in_one_statement_and_gives_it_back_in_its_write(
    store_opener: Opener,
) -> None:
    """Entering the turn sends one statement, the lease's ``UPDATE ... RETURNING``;
    the release is in the write's transaction (on PostgreSQL its one statement);
    ``before_cursor_execute`` and ``after_cursor_execute`` see each of them."""
    store = store_opener()
    ctx = store.get_or_create("s", BOT)
    before: list[str] = []
    after: list[str] = []
    entered: list[int] = []
    for engine in store.engines:
        event.listen(engine, "before_cursor_execute", lambda *a: before.append(_one_line(a[2])))
        event.listen(engine, "after_cursor_execute", lambda *a: after.append(_one_line(a[2])))

    async def turn() -> None:
        async with ctx.lock:
            entered.append(len(before))
            ctx.add_message(Message(role=Role.USER, content="q"))

    asyncio.run(turn())
    assert before == after, "a statement was seen before its execution but not after"
    take = before[: entered[0]]
    assert len(take) == 1, take
    assert take[0].startswith("UPDATE chatflow_sessions SET lease_owner="), take
    assert "RETURNING" in take[0], "the take reads the version in the same statement"
    write = before[entered[0]:]
    released = [i for i, sql in enumerate(write) if "lease_owner=NULL" in sql]
    inserted = [i for i, sql in enumerate(write) if "INSERT INTO chatflow_messages" in sql]
    assert len(released) == 1 and inserted, write
    between = write[released[0]:inserted[-1]]
    assert not any(sql.startswith("BEGIN") for sql in between), "one transaction: " + repr(write)
    if store.engine.dialect.name == "postgresql":
        assert len(write) == 1, f"the write and the release are one statement: {write}"
    assert lease_row(store, "s")[:2] == (None, None)


def test_a_turn_gives_its_lease_back_before_it_returns(store_opener: Opener) -> None:
    """After each turn the row holds no lease and a fence one higher; another store
    then takes the session's lease at once, every time."""
    store, other = store_opener(), store_opener()
    ctx = store.get_or_create("s", BOT)

    async def turns() -> list[tuple[Any, ...]]:
        rows = []
        for turn in range(3):
            async with ctx.lock:
                ctx.add_message(Message(role=Role.USER, content=f"q{turn}"))
            rows.append(lease_row(other, "s"))
        return rows

    rows = asyncio.run(turns())
    assert [row[:2] for row in rows] == [(None, None)] * 3, "a turn left its lease held"
    fences = [row[2] for row in rows]
    assert fences == sorted(set(fences)), f"every take bumps the fence: {fences}"
    assert [m.content for m in store_opener().get_or_create("s", BOT).history] == [
        "q0", "q1", "q2"
    ]
    leases = other.turns.leases
    for _ in range(5):
        lease = leases.take("s")
        assert lease is not None, "the lease a turn gave back was not free"
        leases.release(lease)
    assert lease_row(other, "s")[:2] == (None, None)


_BACKENDS = "SELECT count(*) FROM pg_stat_activity WHERE application_name = :name"


def _backends_of(url: str, schema: str) -> int:
    """Server connections opened by ``schema``'s stores (their ``application_name``)."""
    admin = sa.create_engine(url)
    try:
        with admin.connect() as conn:
            return int(conn.execute(sa.text(_BACKENDS), {"name": schema}).scalar_one())
    finally:
        admin.dispose()


@pytest.mark.postgres
def test_a_store_closed_right_after_a_turn_leaves_nothing_held(
    pg_url: str, pg_schema: str
) -> None:
    """``aclose`` right after a turn: no lease in the row, no connection left on the
    server, and none closed by the garbage collector with a warning."""
    store = pg_util.schema_store(pg_url, pg_schema)
    ctx = store.get_or_create("s", BOT)

    async def turn_then_close() -> None:
        async with ctx.lock:
            ctx.add_message(Message(role=Role.USER, content="q"))
        await store.aclose()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(turn_then_close())
        gc.collect()
    assert [str(w.message) for w in caught if "connection" in str(w.message)] == []
    assert _backends_of(pg_url, pg_schema) == 0
    with pg_util.schema_store(pg_url, pg_schema) as fresh:
        assert lease_row(fresh, "s")[:2] == (None, None)
        assert [m.content for m in fresh.get_or_create("s", BOT).history] == ["q"]
