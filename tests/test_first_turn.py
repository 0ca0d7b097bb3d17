"""A failed first turn leaves no session behind (issue 28).

A Runner's ``get_or_create`` runs on its event loop, so the session is
created by the turn's start (off the loop); if that first turn fails
before anything is written, the session is deleted again, and the next
message starts it as if nothing had happened. A session that anyone wrote
to, or that ``get_or_create`` created at once (off a loop), stays.
"""

from __future__ import annotations

import asyncio

import pytest
from chatflow_agent import Agent, Runner

from .fakes import FailsFirst
from .stores import SQL_KINDS, Opener

pytestmark = pytest.mark.parametrize("sql_store", SQL_KINDS, indirect=True)

AGENT = Agent(name="support", instructions="help")


def _runner(store: object, engine: FailsFirst) -> Runner:
    return Runner(starting_agent=AGENT, engine=engine, session_store=store)  # type: ignore[arg-type]


def test_a_failed_first_turn_leaves_no_session(sql_store: Opener) -> None:
    store = sql_store()
    runner = _runner(store, FailsFirst(1))
    with pytest.raises(RuntimeError, match="model is down"):
        asyncio.run(runner.run_async("wa:1", "hi", metadata={"channel": "wa"}))
    assert store.list_sessions() == []
    assert store.get("wa:1") is None
    assert sql_store().get("wa:1") is None  # another store sees nothing either

    reply = asyncio.run(runner.run_async("wa:1", "hello again", metadata={"channel": "wa"}))
    assert reply.content
    fresh = sql_store().get("wa:1")
    assert fresh is not None
    contents = [m.content for m in fresh.history]
    assert contents[0] == "hello again"
    assert "hi" not in contents
    assert fresh.metadata == {"channel": "wa"}


def test_a_failed_later_turn_keeps_the_session(sql_store: Opener) -> None:
    store = sql_store()
    engine = FailsFirst(0)
    runner = _runner(store, engine)
    asyncio.run(runner.run_async("wa:2", "first"))
    engine.failures = 1
    with pytest.raises(RuntimeError):
        asyncio.run(runner.run_async("wa:2", "second"))
    stored = sql_store().get("wa:2")
    assert stored is not None
    assert stored.history[0].content == "first"
    assert len(stored.history) == 2


def test_a_session_created_off_the_loop_stays(sql_store: Opener) -> None:
    """``get_or_create`` off a loop stores the session at once; a failed turn keeps it."""
    store = sql_store()
    store.get_or_create("wa:3", AGENT)
    with pytest.raises(RuntimeError):
        asyncio.run(_runner(store, FailsFirst(1)).run_async("wa:3", "hi"))
    assert store.list_sessions() == ["wa:3"]
    assert sql_store().get("wa:3") is not None


def test_a_message_waiting_behind_a_failed_first_turn_is_answered(sql_store: Opener) -> None:
    """Two messages of a new session at once: the first fails, the second creates it anew."""
    store = sql_store()
    runner = _runner(store, FailsFirst(1, delay=0.2))

    async def both() -> list[object]:
        first = asyncio.ensure_future(runner.run_async("wa:4", "one"))
        await asyncio.sleep(0.05)  # the first holds the turn; the second waits behind it
        second = asyncio.ensure_future(runner.run_async("wa:4", "two"))
        return list(await asyncio.gather(first, second, return_exceptions=True))

    first, second = asyncio.run(both())
    assert isinstance(first, RuntimeError)
    assert not isinstance(second, BaseException)
    stored = sql_store().get("wa:4")
    assert stored is not None
    contents = [m.content for m in stored.history]
    assert contents[0] == "two"
    assert "one" not in contents


def test_another_store_waiting_behind_a_failed_first_turn_is_answered(
    sql_store: Opener,
) -> None:
    """As above, with the second message served by another store (another worker)."""
    first_store, second_store = sql_store(), sql_store()
    failing = _runner(first_store, FailsFirst(1, delay=0.3))
    answering = _runner(second_store, FailsFirst(0))

    async def both() -> list[object]:
        first = asyncio.ensure_future(failing.run_async("wa:5", "one"))
        while first_store.list_sessions() != ["wa:5"]:  # the first turn created it
            await asyncio.sleep(0.01)
        second = asyncio.ensure_future(answering.run_async("wa:5", "two"))
        return list(await asyncio.gather(first, second, return_exceptions=True))

    first, second = asyncio.run(both())
    assert isinstance(first, RuntimeError)
    assert not isinstance(second, BaseException), second
    stored = sql_store().get("wa:5")
    assert stored is not None
    contents = [m.content for m in stored.history]
    assert contents[0] == "two"
    assert "one" not in contents
