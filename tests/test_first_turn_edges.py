"""A failed first turn leaves no session (issue 28): what ``get_or_create`` does next.

The session does not exist after its failed first turn, so the next
``get_or_create`` makes it as if new: with that call's agent and metadata
(and owner), on every store alike, and a failed first turn unmakes it again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from chatflow_agent import Agent, Runner

from chatflow_sqlalchemy import SessionStore
from chatflow_sqlalchemy.testing import ScriptedEngine

from .stores import Opener

AGENT = Agent(name="support", instructions="help")
OTHER = Agent(name="sales", instructions="sell")


def _runner(store: Any) -> Runner:
    return Runner(starting_agent=AGENT, engine=ScriptedEngine(), session_store=store)


def _fail(store: Any, session_id: str, **kwargs: Any) -> None:
    with pytest.raises(RuntimeError, match="scripted engine failure"):
        asyncio.run(_runner(store).run_async(session_id, "fail", **kwargs))


def test_get_or_create_makes_it_with_its_own_agent_and_metadata(any_store: Opener) -> None:
    store = any_store()
    _fail(store, "s1", metadata={"channel": "web"})
    ctx = store.get_or_create("s1", OTHER, {"channel": "sms"})
    assert ctx.active_agent.name == "sales"
    assert ctx.metadata == {"channel": "sms"}
    fresh = any_store().get("s1")
    assert fresh.active_agent.name == "sales" and fresh.metadata == {"channel": "sms"}


def test_aget_or_create_makes_it_with_its_own_agent(any_store: Opener) -> None:
    store = any_store()
    _fail(store, "a1")

    async def adopt() -> Any:
        return await store.aget_or_create("a1", OTHER, {"x": 1})

    ctx = asyncio.run(adopt())
    assert ctx.active_agent.name == "sales" and ctx.metadata == {"x": 1}
    assert store.get("a1") is ctx and "a1" in store.list_sessions()


def test_a_session_made_again_is_unmade_again_by_a_failed_first_turn(any_store: Opener) -> None:
    store = any_store()
    _fail(store, "u1")
    store.get_or_create("u1", OTHER, {"x": 1})
    assert store.get("u1") is not None
    _fail(store, "u1")
    assert store.get("u1") is None and "u1" not in store.list_sessions()
    asyncio.run(_runner(store).run_async("u1", "hi"))
    assert store.get("u1") is not None and "u1" in any_store().list_sessions()


def test_another_user_may_make_a_session_whose_first_turn_failed(any_store: Opener) -> None:
    """No store shows the session to its former owner; it keeps no other user out either."""
    store = any_store()
    store.get_or_create("s2", AGENT, user_id="alice")
    _fail(store, "s2")
    assert store.get("s2") is None and store.list_sessions(user_id="alice") == []
    ctx = store.get_or_create("s2", AGENT, user_id="bob")
    assert store.get("s2") is ctx
    assert store.list_sessions(user_id="bob") == ["s2"]
    assert store.erase_user("alice") == 0 and store.get("s2") is ctx


def test_a_session_remade_without_a_user_has_no_owner(any_store: Opener) -> None:
    """As if new: the failed turn's user does not own what another caller made."""
    store = any_store()
    store.get_or_create("s3", AGENT, user_id="alice")
    _fail(store, "s3")
    store.get_or_create("s3", AGENT)
    assert store.list_sessions(user_id="alice") == [] and store.erase_user("alice") == 0
    assert store.get("s3") is not None


def test_a_fresh_store_lets_another_user_make_it(any_store: Opener) -> None:
    """The same in a process that never saw the failed turn."""
    store = any_store()
    if isinstance(store, SessionStore):
        pytest.skip("the in-memory store has no other process")
    store.get_or_create("s4", AGENT, user_id="alice")
    _fail(store, "s4")
    fresh = any_store()
    fresh.get_or_create("s4", AGENT, user_id="bob")
    assert fresh.list_sessions(user_id="bob") == ["s4"] and fresh.erase_user("alice") == 0


def test_the_next_runner_turn_makes_it_with_its_own_agent_and_metadata(
    any_store: Opener,
) -> None:
    """As in a process that never saw the failed turn: the session is new to this turn.

    ``Runner.run_async`` calls ``get_or_create`` on its running loop, where the
    store defers the catch-up of a cached context to the turn's start.
    """
    store = any_store()
    _fail(store, "r2", metadata={"a": 1})
    runner = Runner(starting_agent=OTHER, engine=ScriptedEngine(), session_store=store)
    reply = asyncio.run(runner.run_async("r2", "hi", metadata={"b": 2}))
    ctx = any_store().get("r2")
    assert (reply.content, ctx.active_agent.name, ctx.metadata) == (
        "sales re: hi", "sales", {"b": 2}
    )


def check_order_status(order_id: str) -> Any:
    """An order's status, nested deeper than JSON can be written."""
    value: Any = order_id
    for _ in range(600):
        value = {"a": value}
    return value


def test_a_first_turn_whose_write_is_refused_leaves_no_session(sql_store: Opener) -> None:
    """The turn failed (its tool result cannot be stored): nothing was ever written."""
    store = sql_store()
    agent = Agent(name="support", instructions="help", tools=[check_order_status])
    runner = Runner(starting_agent=agent, engine=ScriptedEngine(), session_store=store)
    with pytest.raises(ValueError, match="cannot be stored"):
        asyncio.run(runner.run_async("deep", "order 42"))
    assert store.get("deep") is None and store.list_sessions() == []
    assert sql_store().get("deep") is None
