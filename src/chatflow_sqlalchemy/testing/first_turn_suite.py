"""Conformance tests of a failed first turn: it leaves no session behind.

``Runner.run_async`` makes the session (its ``get_or_create``) before its turn
runs. When that turn fails before anything was written to the session, the
session is unborn again: ``get`` and ``list_sessions`` no longer show it, on
this store or (with :attr:`~chatflow_sqlalchemy.testing.harness.Capability.PERSISTENT`)
any other on the same database. A turn that waited for it meanwhile still
runs, and its write makes the session, with its agent. A session something
was written to stays.

:class:`FailedFirstTurnTests` is a mixin without fixtures;
:mod:`chatflow_sqlalchemy.testing.suite` combines it with its ``StoreTestBase``
as ``TestFailedFirstTurn``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Runner
from chatflow_agent.core.engines import EngineTurnResult

from chatflow_sqlalchemy.testing.engines import ScriptedEngine
from chatflow_sqlalchemy.testing.harness import Capability, StoreHarness, requires

__all__ = ["FailedFirstTurnTests"]

_HANG_GUARD = 60.0
"""Seconds after which a scenario that should take milliseconds fails instead of hanging."""

_FAILURE = "scripted engine failure"


def _agent() -> Agent:
    return Agent(name="support", instructions="help", model="gemini-2.5-flash")


def _uid() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


class _Gated(ScriptedEngine):
    """:class:`ScriptedEngine` that awaits ``before(text)`` at each model call of a turn.

    A test holds a turn there (it holds the session), or looks at the store
    from inside it.
    """

    def __init__(self, before: Callable[[str], Awaitable[None]]) -> None:
        super().__init__()
        self._before = before

    async def generate_turn_async(self, agent: Agent, history: list[Message]) -> EngineTurnResult:
        await self._before(history[-1].content or "")
        return await super().generate_turn_async(agent, history)


def _runner(store: Any, engine: ScriptedEngine | None = None) -> Runner:
    return Runner(starting_agent=_agent(), session_store=store, engine=engine or ScriptedEngine())


def _fail(store: Any, session_id: str, **kwargs: Any) -> None:
    with pytest.raises(RuntimeError, match=_FAILURE):
        asyncio.run(_runner(store).run_async(session_id, "fail", **kwargs))


def _contents(ctx: Any) -> list[str | None]:
    return [m.content for m in ctx.history]


class FailedFirstTurnTests:
    """A failed first turn leaves no empty session; waiting turns and others are unharmed."""

    def test_a_failed_first_turn_leaves_no_session(
        self, harness: StoreHarness, store: Any
    ) -> None:
        sid = _uid()
        _fail(store, sid, metadata={"channel": "web"})
        assert store.get(sid) is None
        assert sid not in store.list_sessions()
        if harness.has(Capability.PERSISTENT):
            other: Any = harness.open()
            try:
                assert other.get(sid) is None
                assert sid not in other.list_sessions()
            finally:
                other.close()

        reply = asyncio.run(_runner(store).run_async(sid, "hello", metadata={"channel": "web"}))
        assert reply.content == "support re: hello"
        ctx = store.get(sid)
        assert ctx is not None and sid in store.list_sessions()
        assert _contents(ctx) == ["hello", "support re: hello"]
        assert ctx.active_agent.name == "support"
        assert ctx.metadata == {"channel": "web"}

    def test_a_failed_turn_keeps_a_session_that_was_written_or_not_failed(
        self, store: Any
    ) -> None:
        untouched, answered, tagged, failed = _uid(), _uid(), _uid(), _uid()
        store.get_or_create(untouched, _agent())  # no turn at all
        asyncio.run(_runner(store).run_async(answered, "hi"))
        _fail(store, answered)  # a failed turn of a conversation
        store.get_or_create(tagged, _agent()).metadata["vip"] = True  # written before
        _fail(store, tagged)
        _fail(store, failed)  # nothing but a failed turn
        listed = store.list_sessions()
        assert {untouched, answered, tagged} <= set(listed)
        assert failed not in listed and store.get(failed) is None
        assert _contents(store.get(answered)) == ["hi", "support re: hi"]
        assert store.get(tagged).metadata == {"vip": True}
        assert store.get(untouched).history == []

    def test_get_or_create_makes_a_session_whose_first_turn_failed(self, store: Any) -> None:
        """Its context may still be live: the session is made again, ``get`` finds it."""
        sid = _uid()
        _fail(store, sid)
        assert store.get(sid) is None
        ctx = store.get_or_create(sid, _agent(), {"plan": "pro"})
        assert store.get(sid) is ctx and sid in store.list_sessions()
        assert ctx.history == []

    def test_a_session_made_by_get_or_create_is_unmade_by_its_failed_first_turn(
        self, store: Any
    ) -> None:
        """Made before the turn, but never written: as if the turn had made it."""
        sid = _uid()
        store.get_or_create(sid, _agent(), {"channel": "web"})
        _fail(store, sid)
        assert store.get(sid) is None and sid not in store.list_sessions()

    def test_a_turn_waiting_behind_a_failed_first_turn_runs_and_makes_the_session(
        self, store: Any
    ) -> None:
        """The waiter holds the session's context already; the failure does not harm it."""
        sid = _uid()
        seen: list[tuple[bool, bool]] = []

        async def both() -> list[Any]:
            entered, go = asyncio.Event(), asyncio.Event()

            async def before(text: str) -> None:
                if text == "fail":
                    entered.set()
                    await go.wait()
                elif text == "two":  # the first failed; until this turn writes, no session
                    seen.append((store.get(sid) is None, sid in store.list_sessions()))

            runner = _runner(store, _Gated(before))
            first = asyncio.ensure_future(runner.run_async(sid, "fail"))
            await entered.wait()  # the first turn made the session and holds it
            second = asyncio.ensure_future(runner.run_async(sid, "two"))
            await asyncio.sleep(0)  # the second gets the session's context, and waits
            go.set()
            return list(await asyncio.gather(first, second, return_exceptions=True))

        first, second = asyncio.run(asyncio.wait_for(both(), _HANG_GUARD))
        assert isinstance(first, RuntimeError) and _FAILURE in str(first)
        assert not isinstance(second, BaseException), second
        assert seen == [(True, False)]
        ctx = store.get(sid)
        assert ctx is not None and sid in store.list_sessions()
        assert _contents(ctx) == ["two", "support re: two"]
        assert ctx.active_agent.name == "support"

    @requires(Capability.PERSISTENT)
    def test_a_turn_of_another_store_waiting_for_the_lease_runs(
        self, harness: StoreHarness
    ) -> None:
        """The other store read the session before the first turn failed; it writes all the same."""
        sid = _uid()
        first_store: Any = harness.open()
        second_store: Any = harness.open()
        seen: list[bool] = []

        async def scenario() -> list[Any]:
            entered, go = asyncio.Event(), asyncio.Event()

            async def before(text: str) -> None:
                if text == "fail":
                    entered.set()
                    await go.wait()
                elif text == "two":
                    seen.append(first_store.get(sid) is None)

            engine = _Gated(before)
            first = asyncio.ensure_future(_runner(first_store, engine).run_async(sid, "fail"))
            await entered.wait()  # the first turn made the session and holds it
            waiting = second_store.get_or_create(sid, _agent())
            assert waiting.active_agent.name == "support"  # read before the failure
            second = asyncio.ensure_future(_runner(second_store, engine).run_async(sid, "two"))
            await asyncio.sleep(0)
            go.set()
            return list(await asyncio.gather(first, second, return_exceptions=True))

        try:
            first, second = asyncio.run(asyncio.wait_for(scenario(), _HANG_GUARD))
            assert isinstance(first, RuntimeError) and _FAILURE in str(first)
            assert not isinstance(second, BaseException), second
            assert seen == [True]
            fresh: Any = harness.open()
            try:
                ctx = fresh.get(sid)
                assert ctx is not None and sid in fresh.list_sessions()
                assert _contents(ctx) == ["two", "support re: two"]
                assert ctx.active_agent.name == "support"
            finally:
                fresh.close()
        finally:
            first_store.close()
            second_store.close()
