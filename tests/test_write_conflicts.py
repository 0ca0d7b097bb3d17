"""A write that loses to other writers rebases and stands, however many there are.

Before each of the write's attempts another store on the same database
(think: another process, a new one each time) adds a message to the
session, so the write's compare-and-swap misses; each miss means another
writer's write stood, so the write must rebase and stand in the end. A
bound on attempts (tried, and reverted) failed such writes under ordinary
contention.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from chatflow_agent import Agent, Message, Role

from .pg_util import writes_session

BOT = Agent(name="Bot", instructions="")
_OTHERS = 16


def _stored(store: Any, session_id: str) -> list[str]:
    ctx = store.get(session_id)
    return [m.content for m in ctx.history]


def test_a_write_that_lost_to_other_processes_each_writing_once_still_stands(
    store_opener: Any,
) -> None:
    """Each miss is another writer's one write: the write rebases and stands after them."""
    store = store_opener()
    others = [store_opener() for _ in range(_OTHERS)]
    ctx = store.get_or_create("s", BOT)
    ctx.add_message(Message(role=Role.USER, content="before"))
    sqlite = store.engine.dialect.name == "sqlite"
    waiting = list(others)

    def another_process_writes(*args: Any) -> None:  # (conn, cursor, statement, ...)
        statement = args[2]
        due = statement == "BEGIN IMMEDIATE" if sqlite else writes_session(statement)
        if due and waiting:
            other = waiting.pop(0)
            other.get_or_create("s", BOT).add_message(
                Message(role=Role.USER, content=f"other {len(others) - len(waiting)}")
            )

    for engine in store.engines:
        sa.event.listen(engine, "before_cursor_execute", another_process_writes)
    try:
        ctx.add_message(Message(role=Role.USER, content="mine"))
    finally:
        for engine in store.engines:
            sa.event.remove(engine, "before_cursor_execute", another_process_writes)
    stored = _stored(others[0], "s")
    assert not waiting, "every other writer wrote before the write stood"
    assert "mine" in stored and len(stored) == 2 + len(others)
    assert stored[:1] == ["before"] and ctx.history[-1].content == "mine"
