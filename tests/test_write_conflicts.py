"""A write that loses to other writers every time gives up, with nothing of it written.

Another store on the same database (think: another process) moves the
session's version just before each of the write's attempts, so every
compare-and-swap misses; without a bound the writer would rebase and try
again for as long as that goes on. Each test stops moving it after
:data:`_GIVE_UP_AFTER` moves, so a writer without a bound ends (and the test
fails) instead of hanging.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from chatflow_agent import Agent, Message, Role

from chatflow_sqlalchemy import LeaseLostError, WriteConflictError
from chatflow_sqlalchemy.writer import MAX_WRITE_ATTEMPTS

from .pg_util import writes_session

BOT = Agent(name="Bot", instructions="")
_GIVE_UP_AFTER = 4 * MAX_WRITE_ATTEMPTS


@contextmanager
def _moved_before_every_write(store: Any, other: Any, session_id: str) -> Iterator[list[int]]:
    """``other`` bumps the session's version before each write ``store`` sends; yields the count.

    PostgreSQL writes in one autocommitted statement: the bump commits just
    before it. SQLite takes its write lock with ``BEGIN IMMEDIATE``: the
    bump commits just before each write transaction (the write's and the
    read that explains its miss), as another process's write would.
    """
    moved: list[int] = []
    sqlite = store.engine.dialect.name == "sqlite"

    def bump(*args: Any) -> None:  # (conn, cursor, statement, ...)
        statement = args[2]
        due = statement == "BEGIN IMMEDIATE" if sqlite else writes_session(statement)
        if due and len(moved) < _GIVE_UP_AFTER:
            moved.append(1)
            with other.engine.begin() as conn:
                conn.execute(
                    sa.text(
                        "UPDATE chatflow_sessions SET version = version + 1 "
                        "WHERE session_id = :sid"
                    ),
                    {"sid": session_id},
                )

    for engine in store.engines:
        sa.event.listen(engine, "before_cursor_execute", bump)
    try:
        yield moved
    finally:
        for engine in store.engines:
            sa.event.remove(engine, "before_cursor_execute", bump)


def _stored(store: Any, session_id: str) -> tuple[list[str], dict[str, Any]]:
    ctx = store.get(session_id)
    return [m.content for m in ctx.history], dict(ctx.metadata)


def test_a_write_outside_a_turn_gives_up_on_a_session_that_keeps_moving(
    store_opener: Any,
) -> None:
    store, other = store_opener(), store_opener()
    ctx = store.get_or_create("s", BOT)
    ctx.add_message(Message(role=Role.USER, content="before"))
    with _moved_before_every_write(store, other, "s"), pytest.raises(WriteConflictError) as info:
        ctx.metadata = {"topic": "never stored"}
    assert isinstance(info.value, LeaseLostError), "caught where a turn that was not written is"
    assert info.value.attempts == MAX_WRITE_ATTEMPTS and info.value.session_id == "s"
    assert "'s'" in str(info.value) and "chatflow_sessions" in str(info.value)
    assert _stored(other, "s") == (["before"], {})
    assert ctx.metadata == {}, "memory does not keep what the database refused"


def test_a_turn_gives_up_on_a_session_that_keeps_moving_and_gives_its_lease_back(
    store_opener: Any,
) -> None:
    store, other = store_opener(), store_opener()
    ctx = store.get_or_create("s", BOT)
    ctx.add_message(Message(role=Role.USER, content="before"))

    async def turn() -> None:
        async with ctx.lock:
            ctx.add_message(Message(role=Role.USER, content="hello"))
            ctx.add_message(Message(role=Role.MODEL, content="answer"))

    with _moved_before_every_write(store, other, "s"), pytest.raises(WriteConflictError):
        asyncio.run(turn())
    assert _stored(other, "s") == (["before"], {}), "none of the turn's messages was stored"
    with other.engine.connect() as conn:
        owner = conn.execute(
            sa.text("SELECT lease_owner FROM chatflow_sessions WHERE session_id = 's'")
        ).scalar()
    assert owner is None, "the lease was given back"
    asyncio.run(turn())  # nothing moves the session now: the turn is written
    assert _stored(other, "s") == (["before", "hello", "answer"], {})
