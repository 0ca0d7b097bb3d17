"""The chatflow-sqlalchemy conformance suite: the public contract as pytest classes.

Collect it from a test module of your own::

    from chatflow_sqlalchemy.testing.suite import *  # noqa: F403

and override the ``store_factory`` fixture (see
:mod:`chatflow_sqlalchemy.testing.harness`) to return a ``StoreHarness`` for
your backend. Every class uses two fixtures of :class:`StoreTestBase`:
``harness`` (the ``store_factory`` harness) and ``store`` (one store opened
from it, closed after the test). Tests that need something a backend may not
have declare it with ``@requires(Capability.X)`` and are skipped, with the
missing capability named, where it is absent; no test looks at backend names.

The suite does not depend on pytest-asyncio: async scenarios run in
``asyncio.run`` inside plain tests, as a sync web handler would drive them.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import random
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import pytest
from chatflow_agent import (
    Agent,
    BaseEngine,
    BaseSessionStore,
    Message,
    Role,
    Runner,
    Tool,
    ToolCall,
    ToolResult,
    tool,
)
from chatflow_agent import SessionContext as UpstreamSessionContext
from chatflow_agent.core.engines import EngineTurnResult

from chatflow_sqlalchemy import (
    DEFAULT_DEDUP_TTL_HOURS,
    ChatflowStoreError,
    ClaimLostError,
    LeaseLostError,
    SessionContext,
    SessionDeletedError,
)
from chatflow_sqlalchemy.claims import list_claims, release_claim
from chatflow_sqlalchemy.context import dump_message
from chatflow_sqlalchemy.testing.claim_workers import ReplyModel, reply_to, start_worker
from chatflow_sqlalchemy.testing.engines import ScriptedEngine
from chatflow_sqlalchemy.testing.first_turn_suite import FailedFirstTurnTests
from chatflow_sqlalchemy.testing.forks_suite import ForkTests
from chatflow_sqlalchemy.testing.harness import (
    CRASH_EXIT_CODE,
    Capability,
    StoreHarness,
    claim_worker,
    crash_worker,
    requires,
    run_process,
    run_workers,
    turns_worker,
)
from chatflow_sqlalchemy.testing.history_suite import (
    RewindTests,
    SummariesAcrossProcessesTests,
    SummaryTests,
)
from chatflow_sqlalchemy.testing.inbox_suite import InboxAcrossProcessesTests, InboxTests
from chatflow_sqlalchemy.testing.lifecycle_suite import (
    ArchiveTests,
    EncryptionTests,
    ErasureAndExportTests,
    RetentionTests,
    UserScopeTests,
)
from chatflow_sqlalchemy.testing.plugin import MARKER

__all__ = [
    "ScriptedEngine",
    "StoreTestBase",
    "TestAgentResolver",
    "TestArchive",
    "TestAsyncTwins",
    "TestClear",
    "TestCorruptRows",
    "TestCorruptSessionRows",
    "TestCrossProcess",
    "TestDedup",
    "TestDeletion",
    "TestEncryption",
    "TestErasureAndExport",
    "TestExactRoundTrip",
    "TestFailedFirstTurn",
    "TestForks",
    "TestInbox",
    "TestInboxAcrossProcesses",
    "TestListSessions",
    "TestMetadata",
    "TestOneContextPerSession",
    "TestPruning",
    "TestRetention",
    "TestRollback",
    "TestRunnerEndToEnd",
    "TestSeedDocumentExamples",
    "TestTurnFaults",
    "TestUserScope",
    "TestValidation",
    "TestWebhookClaims",
    "TestWebhookClaimsAcrossProcesses",
]

_T = TypeVar("_T")

STORE_ASYNC_TWINS = (
    "aget_or_create",
    "aget",
    "adelete",
    "alist_sessions",
    "aclear",
    "ais_message_processed",
    "amark_message_processed",
    "arecord_processed_message",
    "apurge_processed_messages",
    "aclose",
)
CONTEXT_ASYNC_TWINS = (
    "aadd_message", "aset_active_agent", "aclear_history", "arollback_to", "arewind"
)


# =============================================================== helpers


def run(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run a coroutine on a new event loop (as ``Runner.run`` does)."""
    return asyncio.run(coro)


def new_id(prefix: str = "s") -> str:
    """A unique session / message id."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def user(text: str) -> Message:
    """A USER message."""
    return Message(role=Role.USER, content=text)


def model(text: str | None = None, calls: list[ToolCall] | None = None) -> Message:
    """A MODEL message, optionally with tool calls."""
    return Message(role=Role.MODEL, content=text, tool_calls=calls)


def system(text: str) -> Message:
    """A SYSTEM message."""
    return Message(role=Role.SYSTEM, content=text)


def tool_result(call: ToolCall, content: Any) -> Message:
    """A TOOL message answering ``call``."""
    return Message(
        role=Role.TOOL,
        tool_results=[ToolResult(tool_call_id=call.id, name=call.name, content=content)],
    )


def call(name: str, **args: Any) -> ToolCall:
    """A tool call with a unique id."""
    return ToolCall(id=new_id("call"), name=name, args=args)


def dump(history: Sequence[Message]) -> list[dict[str, Any]]:
    """A comparable, JSON-shaped copy of a history."""
    return [m.model_dump(mode="json") for m in history]


def outline(history: Sequence[Message]) -> list[str]:
    """A short readable form of a history: role, content, ``+calls`` for tool calls."""
    return [f"{m.role.value}:{m.content}{'+calls' if m.tool_calls else ''}" for m in history]


def contents(history: Sequence[Message]) -> list[str | None]:
    """The ``content`` of each message."""
    return [m.content for m in history]


def assert_turn_shaped(history: Sequence[Message]) -> None:
    """SYSTEM messages only at the front, then turns: the first non-SYSTEM is a USER."""
    roles = [m.role for m in history]
    n_system = 0
    while n_system < len(roles) and roles[n_system] == Role.SYSTEM:
        n_system += 1
    assert Role.SYSTEM not in roles[n_system:], f"SYSTEM message after the front: {roles}"
    if n_system < len(roles):
        assert roles[n_system] == Role.USER, f"history starts with {roles[n_system]}: {roles}"


def assert_well_formed(history: Sequence[Message]) -> None:
    """Turn-shaped, and every MODEL tool call is answered by the next (TOOL) message."""
    assert_turn_shaped(history)
    roles = [m.role for m in history]
    for index, message in enumerate(history):
        if message.role == Role.MODEL and message.tool_calls:
            assert index + 1 < len(history), f"dangling tool call at the end: {roles}"
            answer = history[index + 1]
            assert answer.role == Role.TOOL, f"tool call at {index} not followed by TOOL: {roles}"
            answered = {r.tool_call_id for r in answer.tool_results or []}
            assert {c.id for c in message.tool_calls} <= answered, "tool call without result"


@dataclass(frozen=True)
class ExecutedSQL:
    """One statement seen by :func:`record_sql`."""

    statement: str
    thread: str
    is_async: bool


@contextmanager
def record_sql() -> Iterator[list[ExecutedSQL]]:
    """Record every SQL statement any SQLAlchemy engine of this process executes."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    executed: list[ExecutedSQL] = []

    def on_execute(conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        executed.append(
            ExecutedSQL(
                " ".join(statement.split())[:60],
                threading.current_thread().name,
                bool(conn.dialect.is_async),
            )
        )

    event.listen(Engine, "before_cursor_execute", on_execute)
    try:
        yield executed
    finally:
        event.remove(Engine, "before_cursor_execute", on_execute)


def count_records(caplog: pytest.LogCaptureFixture, needle: str, level: int) -> int:
    """How many captured records at ``level`` or above mention ``needle``."""
    return sum(1 for r in caplog.records if r.levelno >= level and needle in r.getMessage())


def random_messages(rng: random.Random, n: int) -> list[Message]:
    """A random role sequence, often starting with non-USER messages, with a few SYSTEMs."""
    roles = [Role.USER, Role.MODEL, Role.TOOL, Role.SYSTEM]
    weights = [0.3, 0.38, 0.25, 0.07]
    messages = []
    for i in range(n):
        role = rng.choices(roles, weights)[0]
        if role == Role.MODEL and rng.random() < 0.4:
            messages.append(model(f"m{i}", [call("lookup", i=i)]))
        elif role == Role.TOOL:
            result = ToolResult(tool_call_id=f"c{i}", name="lookup", content={"i": i})
            messages.append(Message(role=Role.TOOL, tool_results=[result]))
        else:
            messages.append(Message(role=role, content=f"{role.value}{i}"))
    return messages


def as_reloaded(history: Sequence[Message]) -> list[Message]:
    """What a fresh store shows of ``history``: a trailing unanswered tool call is hidden.

    A reload never ends on a tool call without its result (DESIGN.md behaviour
    4): the writer may have died before the result.
    """
    end = len(history)
    while end > 0 and history[end - 1].role == Role.MODEL and history[end - 1].tool_calls:
        end -= 1
    return list(history[:end])


def reload(
    harness: StoreHarness,
    session_id: str,
    resolver: Callable[[str], Agent | None] | None = None,
    **store_kwargs: Any,
) -> SessionContext:
    """The session as a fresh store instance (a restarted process) loads it."""
    fresh: Any = harness.open(**store_kwargs)
    if resolver is not None:
        fresh.set_agent_resolver(resolver)
    ctx = fresh.get(session_id)
    assert ctx is not None, f"a fresh store does not find session {session_id!r}"
    return ctx  # type: ignore[no-any-return]


def assert_reloads_identically(harness: StoreHarness, ctx: Any, **store_kwargs: Any) -> None:
    """With PERSISTENT, a fresh store reloads exactly ``ctx``'s history and agent name."""
    if not harness.has(Capability.PERSISTENT):
        return
    again = reload(harness, ctx.session_id, **store_kwargs)
    assert dump(again.history) == dump(as_reloaded(ctx.history)), (
        f"a fresh store reloads {outline(again.history)}, memory holds {outline(ctx.history)}"
    )
    assert again.active_agent.name == ctx.active_agent.name


# ------------------------------------------------------------------- tools


def _check_order_status(order_id: str) -> dict[str, str]:
    """Check shipment tracking for an order ID."""
    return {"order_id": order_id, "status": "IN_TRANSIT", "eta": "Tomorrow"}


def _refund(amount: str) -> dict[str, str]:
    """Refund an amount to the customer."""
    return {"refunded": amount, "status": "OK"}


check_order_status = Tool(_check_order_status, name="check_order_status")
refund = Tool(_refund, name="refund")


def make_agents() -> tuple[Agent, Agent]:
    """New ``Support`` (order tool, hands off to Billing) and ``Billing`` agents."""
    billing = Agent(name="Billing", instructions="Billing specialist", tools=[refund])
    support = Agent(
        name="Support", instructions="Support", tools=[check_order_status], handoffs=[billing]
    )
    billing.add_handoff(support)
    return support, billing


# ============================================================ base class


IO_THREADS = "chatflow-io"
"""Name prefix of the threads a store runs its blocking I/O on (``ASYNC_THREADPOOL``)."""


def _io_threads_started_since(before: set[threading.Thread]) -> list[threading.Thread]:
    """I/O threads started after ``before`` was taken and still alive."""
    return [
        t for t in set(threading.enumerate()) - before
        if t.name.startswith(IO_THREADS) and t.is_alive()
    ]


class StoreTestBase:
    """Fixtures of every suite class; subclass it to write backend tests of your own.

    ``harness`` is the ``store_factory`` harness; ``store`` is one store
    opened from it and closed after the test. ``@requires(...)`` markers are
    checked before any store is opened.
    """

    @pytest.fixture(autouse=True)
    def _chatflow_capability_gate(
        self, request: pytest.FixtureRequest, store_factory: StoreHarness
    ) -> None:
        needed = [str(c) for marker in request.node.iter_markers(MARKER) for c in marker.args]
        store_factory.require(*needed)

    @pytest.fixture
    def harness(self, store_factory: StoreHarness) -> StoreHarness:
        """The backend under test."""
        return store_factory

    @pytest.fixture
    def store(self, harness: StoreHarness) -> Iterator[Any]:
        """A store opened from the harness, closed after the test."""
        opened: Any = harness.open()
        try:
            yield opened
        finally:
            opened.close()


# ================================================================ pruning


class TestPruning(StoreTestBase):
    """Behaviour 1: turn-safe pruning, identical to upstream's algorithm, persisted as is."""

    def test_system_messages_stay_in_front_forever(self, harness: StoreHarness) -> None:
        store: Any = harness.open(default_max_turns=2)
        agent = Agent(name="Bot", instructions="")
        ctx = store.get_or_create(new_id(), agent)
        s1, s2 = system("rules"), system("more rules")
        for m in [s1, user("u1"), model("m1"), s2, user("u2"), model("m2"), user("u3")]:
            ctx.add_message(m)
        ctx.add_message(model("m3"))
        assert contents(ctx.history) == ["rules", "more rules", "u2", "m2", "u3", "m3"]
        assert_well_formed(ctx.history)
        assert_reloads_identically(harness, ctx, default_max_turns=2)

    def test_turn_holds_every_model_and_tool_message(self, harness: StoreHarness) -> None:
        store: Any = harness.open(default_max_turns=1)
        ctx = store.get_or_create(new_id(), Agent(name="Bot", instructions=""))
        c = call("lookup", q="x")
        turn = [user("u1"), model(None, [c]), tool_result(c, {"ok": True}), model("done")]
        for m in turn:
            ctx.add_message(m)
        assert dump(ctx.history) == dump(turn)
        ctx.add_message(user("u2"))
        assert contents(ctx.history) == ["u2"]
        assert_reloads_identically(harness, ctx, default_max_turns=1)

    def test_only_newest_max_turns_turns_are_kept(self, harness: StoreHarness) -> None:
        store: Any = harness.open(default_max_turns=3)
        ctx = store.get_or_create(new_id(), Agent(name="Bot", instructions=""))
        assert ctx.max_turns == 3
        for k in range(6):
            ctx.add_message(user(f"u{k}"))
            ctx.add_message(model(f"m{k}"))
        assert contents(ctx.history) == ["u3", "m3", "u4", "m4", "u5", "m5"]
        assert_reloads_identically(harness, ctx, default_max_turns=3)

    def test_leading_non_user_messages_are_dropped(self, harness: StoreHarness) -> None:
        store: Any = harness.open(default_max_turns=2)
        ctx = store.get_or_create(new_id(), Agent(name="Bot", instructions=""))
        c = call("lookup")
        ctx.add_message(model("orphan"))
        ctx.add_message(tool_result(c, "orphan"))
        assert ctx.history == []
        ctx.add_message(system("sys"))
        ctx.add_message(model("still orphan"))
        assert contents(ctx.history) == ["sys"]
        ctx.add_message(user("u1"))
        ctx.add_message(model("m1"))
        assert contents(ctx.history) == ["sys", "u1", "m1"]
        assert_reloads_identically(harness, ctx, default_max_turns=2)

    def test_matches_upstream_on_random_sequences(self, harness: StoreHarness) -> None:
        for seed, max_turns in [(1, 1), (2, 2), (3, 3), (4, 5), (5, 2), (6, 4)]:
            rng = random.Random(seed)
            messages = random_messages(rng, 45)
            store: Any = harness.open(default_max_turns=max_turns)
            agent = Agent(name="Bot", instructions="")
            ours = store.get_or_create(new_id(f"seed{seed}"), agent)
            upstream = UpstreamSessionContext("upstream", agent, max_turns=max_turns)
            for index, message in enumerate(messages):
                ours.add_message(message)
                upstream.add_message(message)
                assert ours.history == upstream.history, (
                    f"seed {seed}, max_turns {max_turns}: differs from upstream after "
                    f"message {index} ({message.role.value})"
                )
            assert_turn_shaped(ours.history)
            assert_reloads_identically(harness, ours, default_max_turns=max_turns)

    def test_matches_upstream_inside_turn_lock(self, harness: StoreHarness) -> None:
        async def scenario(seed: int, max_turns: int) -> None:
            messages = random_messages(random.Random(seed), 40)
            store: Any = harness.open(default_max_turns=max_turns)
            agent = Agent(name="Bot", instructions="")
            ours = store.get_or_create(new_id(f"lock{seed}"), agent)
            upstream = UpstreamSessionContext("upstream", agent, max_turns=max_turns)
            for start in range(0, len(messages), 7):
                async with ours.lock:
                    for message in messages[start : start + 7]:
                        ours.add_message(message)
                        upstream.add_message(message)
                        assert ours.history == upstream.history
                assert ours.history == upstream.history
            assert_reloads_identically(harness, ours, default_max_turns=max_turns)

        for seed, max_turns in [(11, 1), (12, 2), (13, 3)]:
            run(scenario(seed, max_turns))

    @requires(Capability.PERSISTENT)
    def test_fresh_store_reloads_identical_history_after_pruning(
        self, harness: StoreHarness
    ) -> None:
        store: Any = harness.open(default_max_turns=2)
        ctx = store.get_or_create(new_id(), Agent(name="Bot", instructions=""))
        ctx.add_message(system("sys"))
        for k in range(5):
            c = call("lookup", k=k)
            for m in [user(f"u{k}"), model(None, [c]), tool_result(c, {"k": k}), model(f"m{k}")]:
                ctx.add_message(m)
        assert [m.content for m in ctx.history if m.role == Role.USER] == ["u3", "u4"]
        again = reload(harness, ctx.session_id, default_max_turns=2)
        assert dump(again.history) == dump(ctx.history)
        assert len(again.history) == 9
        # and the reloaded context keeps pruning from where it is
        again.add_message(user("u5"))
        assert [m.content for m in again.history if m.role == Role.USER] == ["u4", "u5"]
        third = reload(harness, ctx.session_id, default_max_turns=2)
        assert dump(third.history) == dump(again.history)

    @requires(Capability.PERSISTENT)
    def test_fresh_store_hides_a_pending_tool_call(self, harness: StoreHarness) -> None:
        # Written outside a lock, message by message: the writer still shows its
        # tool call (its result comes next), a fresh store never ends on it.
        store: Any = harness.open()
        ctx = store.get_or_create(new_id(), Agent(name="Bot", instructions=""))
        pending = call("lookup", q="slow")
        ctx.add_message(user("u1"))
        ctx.add_message(model(None, [pending]))
        assert [m.role for m in ctx.history] == [Role.USER, Role.MODEL]
        again = reload(harness, ctx.session_id)
        assert contents(again.history) == ["u1"]
        ctx.add_message(tool_result(pending, {"ok": True}))
        final = reload(harness, ctx.session_id)
        assert [m.role for m in final.history] == [Role.USER, Role.MODEL, Role.TOOL]
        assert_well_formed(final.history)

    @requires(Capability.PERSISTENT)
    def test_other_writer_never_drops_a_pending_tool_call(self, harness: StoreHarness) -> None:
        # Worker A is running a tool; worker B loads the session and writes to it.
        # When A stores the tool result, the call it answers must still be there.
        bot = Agent(name="Bot", instructions="")
        writer: Any = harness.open()
        ctx = writer.get_or_create(new_id(), bot)
        pending = call("lookup", q="slow")
        ctx.add_message(user("u1"))
        ctx.add_message(model(None, [pending]))
        other: Any = harness.open()
        other.get(ctx.session_id).metadata["seen_by"] = "worker-b"
        ctx.add_message(tool_result(pending, {"ok": True}))
        final = reload(harness, ctx.session_id)
        assert_well_formed(final.history)
        assert [m.role for m in final.history] == [Role.USER, Role.MODEL, Role.TOOL]
        assert final.metadata == {"seen_by": "worker-b"}

    def test_prune_history_regroups_a_hand_set_history(self, harness: StoreHarness) -> None:
        messages = random_messages(random.Random(99), 30)
        store: Any = harness.open(default_max_turns=3)
        agent = Agent(name="Bot", instructions="")
        ctx = store.get_or_create(new_id(), agent)
        upstream = UpstreamSessionContext("upstream", agent, max_turns=3)
        ctx.history = list(messages)
        upstream.history = list(messages)
        ctx._prune_history()
        upstream._prune_history()
        assert ctx.history == upstream.history
        ctx._prune_history()
        assert ctx.history == upstream.history
        assert_reloads_identically(harness, ctx, default_max_turns=3)


# =============================================================== rollback


class TestRollback(StoreTestBase):
    """Behaviour 2: rollback restores the exact pre-turn history and active agent."""

    @staticmethod
    def _two_full_turns(store: Any, agent: Agent) -> Any:
        ctx = store.get_or_create(new_id(), agent)
        for m in [system("sys"), user("u1"), model("m1"), user("u2"), model("m2")]:
            ctx.add_message(m)
        return ctx

    def test_rollback_inside_lock_restores_pruned_turns_and_agent(
        self, harness: StoreHarness
    ) -> None:
        store: Any = harness.open(default_max_turns=2)
        support, billing = make_agents()
        ctx = self._two_full_turns(store, support)
        before = dump(ctx.history)

        async def turn() -> None:
            async with ctx.lock:
                checkpoint = len(ctx.history)
                ctx.add_message(user("u3"))
                assert "u1" not in contents(ctx.history), "the new turn must prune u1"
                ctx.set_active_agent(billing)
                c = call("refund", amount="5")
                ctx.add_message(model(None, [c]))
                ctx.add_message(tool_result(c, {"status": "OK"}))
                ctx.rollback_to(checkpoint)
                assert dump(ctx.history) == before
                assert ctx.active_agent is support

        run(turn())
        assert dump(ctx.history) == before
        assert ctx.active_agent is support
        assert_reloads_identically(harness, ctx, default_max_turns=2)
        # the session keeps working normally after the rollback
        ctx.add_message(user("u4"))
        ctx.add_message(model("m4"))
        assert contents(ctx.history) == ["sys", "u2", "m2", "u4", "m4"]
        assert_reloads_identically(harness, ctx, default_max_turns=2)

    def test_runner_style_rollback_on_exception(self, harness: StoreHarness) -> None:
        store: Any = harness.open(default_max_turns=2)
        support, billing = make_agents()
        ctx = self._two_full_turns(store, support)
        before = dump(ctx.history)

        async def failing_turn() -> None:
            async with ctx.lock:
                checkpoint = len(ctx.history)
                try:
                    ctx.add_message(user("u3"))
                    ctx.set_active_agent(billing)
                    ctx.add_message(model("m3"))
                    ctx.add_message(user("u4"))
                    raise RuntimeError("engine down")
                except Exception:
                    ctx.rollback_to(checkpoint)
                    raise

        with pytest.raises(RuntimeError, match="engine down"):
            run(failing_turn())
        assert dump(ctx.history) == before
        assert ctx.active_agent is support
        assert_reloads_identically(harness, ctx, default_max_turns=2)

    def test_plain_rollback_outside_lock(self, harness: StoreHarness) -> None:
        store: Any = harness.open()
        ctx = store.get_or_create(new_id(), Agent(name="Bot", instructions=""))
        ctx.add_message(user("u1"))
        ctx.add_message(model("m1"))
        checkpoint = len(ctx.history)
        ctx.add_message(user("u2"))
        ctx.add_message(model("m2"))
        ctx.rollback_to(checkpoint)
        assert contents(ctx.history) == ["u1", "m1"]
        assert_reloads_identically(harness, ctx)
        ctx.rollback_to(len(ctx.history))  # rolling back to "now" changes nothing
        assert contents(ctx.history) == ["u1", "m1"]
        ctx.add_message(user("u3"))
        assert contents(ctx.history) == ["u1", "m1", "u3"]
        assert_reloads_identically(harness, ctx)

    def test_rollback_outside_lock_restores_pruned_turn_and_agent(
        self, harness: StoreHarness
    ) -> None:
        store: Any = harness.open(default_max_turns=1)
        support, billing = make_agents()
        ctx = store.get_or_create(new_id(), support)
        ctx.add_message(user("u1"))
        ctx.add_message(model("m1"))
        before = dump(ctx.history)
        checkpoint = len(ctx.history)
        ctx.add_message(user("u2"))
        ctx.set_active_agent(billing)
        ctx.add_message(model("m2"))
        assert contents(ctx.history) == ["u2", "m2"]
        ctx.rollback_to(checkpoint)
        assert dump(ctx.history) == before
        assert ctx.active_agent is support
        assert_reloads_identically(harness, ctx, default_max_turns=1)


# ========================================================= context identity


class TestOneContextPerSession(StoreTestBase):
    """Behaviour 3: one context object per session per store, so its lock serialises turns."""

    def test_same_object_for_a_session(self, store: Any) -> None:
        agent = Agent(name="Bot", instructions="")
        sid = new_id()
        first = store.get_or_create(sid, agent)
        assert store.get_or_create(sid, agent) is first
        assert store.get(sid) is first
        assert run(store.aget_or_create(sid, agent)) is first
        assert run(store.aget(sid)) is first
        assert store.get_or_create(new_id(), agent) is not first

    def test_contexts_and_stores_are_upstream_types(self, store: Any) -> None:
        ctx = store.get_or_create(new_id(), Agent(name="Bot", instructions=""))
        assert isinstance(store, BaseSessionStore)
        assert isinstance(ctx, UpstreamSessionContext)
        assert isinstance(ctx, SessionContext)

    def test_lock_serialises_concurrent_runner_turns(
        self, harness: StoreHarness, store: Any
    ) -> None:
        support, _ = make_agents()
        runner = Runner(starting_agent=support, session_store=store, engine=ScriptedEngine(0.005))
        sid = new_id()
        orders = ["A1", "B2", "C3"]

        async def concurrently() -> None:
            await asyncio.gather(*(runner.run_async(sid, f"order {o}") for o in orders))

        run(concurrently())
        ctx = store.get(sid)
        history = ctx.history
        assert len(history) == 4 * len(orders), [m.role.value for m in history]
        seen = []
        for start in range(0, len(history), 4):
            u, m, t, final = history[start : start + 4]
            assert [u.role, m.role, t.role, final.role] == [
                Role.USER,
                Role.MODEL,
                Role.TOOL,
                Role.MODEL,
            ], "turns interleaved"
            order = (u.content or "").split()[-1]
            assert m.tool_calls and m.tool_calls[0].args == {"order_id": order}
            assert t.tool_results and t.tool_results[0].tool_call_id == m.tool_calls[0].id
            assert t.tool_results[0].content["order_id"] == order
            assert order in (final.content or "")
            seen.append(order)
        assert sorted(seen) == orders
        assert_reloads_identically(harness, ctx)


# ========================================================= agent resolver


class TestAgentResolver(StoreTestBase):
    """Behaviour 5: stored agent names are mapped back through the resolver, else a fallback."""

    @requires(Capability.PERSISTENT)
    def test_resolver_maps_stored_name_to_agent(self, harness: StoreHarness, store: Any) -> None:
        support, billing = make_agents()
        sid = new_id()
        store.get_or_create(sid, support).set_active_agent(billing)
        new_support, new_billing = make_agents()
        agents = {a.name: a for a in (new_support, new_billing)}
        again = reload(harness, sid, resolver=agents.get)
        assert again.active_agent is new_billing
        # the resolver also wins over get_or_create's default agent
        fresh: Any = harness.open()
        fresh.set_agent_resolver(agents.get)
        assert fresh.get_or_create(sid, new_support).active_agent is new_billing

    @requires(Capability.PERSISTENT)
    def test_runner_registers_its_resolver(self, harness: StoreHarness, store: Any) -> None:
        support, billing = make_agents()
        sid = new_id()
        store.get_or_create(sid, support).set_active_agent(billing)
        fresh: Any = harness.open()
        new_support, _ = make_agents()
        runner = Runner(starting_agent=new_support, session_store=fresh, engine=ScriptedEngine())
        ctx = fresh.get(sid)
        assert ctx.active_agent is new_support.handoffs[0]
        assert {t.name for t in ctx.active_agent.get_all_tools()} >= {"refund"}
        response = run(runner.run_async(sid, "refund 12"))
        assert response.tool_calls_executed == ["refund"]

    @requires(Capability.PERSISTENT)
    def test_without_resolver_fallback_agent_and_one_warning_per_name(
        self, harness: StoreHarness, store: Any, caplog: pytest.LogCaptureFixture
    ) -> None:
        ghost_name, phantom_name = new_id("Ghost"), new_id("Phantom")
        ghost = Agent(name=ghost_name, instructions="x", tools=[check_order_status])
        phantom = Agent(name=phantom_name, instructions="y", tools=[refund])
        sessions = [new_id() for _ in range(3)]
        store.get_or_create(sessions[0], ghost)
        store.get_or_create(sessions[1], ghost)
        store.get_or_create(sessions[2], phantom)
        fresh: Any = harness.open()
        caplog.set_level(logging.WARNING)
        caplog.clear()
        loaded = [fresh.get(sid) for sid in sessions]
        for ctx, expected in zip(loaded, [ghost_name, ghost_name, phantom_name], strict=True):
            assert ctx.active_agent.name == expected
            assert ctx.active_agent not in (ghost, phantom)
            assert ctx.active_agent.get_all_tools() == []
        assert count_records(caplog, ghost_name, logging.WARNING) == 1
        assert count_records(caplog, phantom_name, logging.WARNING) == 1
        # get_or_create on an existing session also keeps the stored name
        other: Any = harness.open()
        support, _ = make_agents()
        ctx = other.get_or_create(sessions[0], support)
        assert ctx.active_agent.name == ghost_name
        assert ctx.active_agent.get_all_tools() == []

    @requires(Capability.PERSISTENT)
    def test_resolver_returning_none_falls_back(
        self, harness: StoreHarness, store: Any, caplog: pytest.LogCaptureFixture
    ) -> None:
        name = new_id("Retired")
        sid = new_id()
        store.get_or_create(sid, Agent(name=name, instructions="", tools=[refund]))
        fresh: Any = harness.open()
        fresh.set_agent_resolver(lambda _name: None)
        caplog.set_level(logging.WARNING)
        caplog.clear()
        ctx = fresh.get(sid)
        assert ctx.active_agent.name == name
        assert ctx.active_agent.get_all_tools() == []
        assert count_records(caplog, name, logging.WARNING) == 1


# =============================================================== metadata


class TestMetadata(StoreTestBase):
    """Session metadata: stored at creation, changes persisted, bad values rejected."""

    def test_stored_at_creation_only(self, harness: StoreHarness, store: Any) -> None:
        agent = Agent(name="Bot", instructions="")
        sid = new_id()
        meta = {"user_id": "cust_882", "channel": "whatsapp", "tags": [1, 2], "n": {"a": None}}
        ctx = store.get_or_create(sid, agent, metadata=meta)
        assert ctx.metadata == meta
        assert store.get_or_create(sid, agent, metadata={"channel": "telegram"}).metadata == meta
        assert store.get_or_create(new_id(), agent).metadata == {}
        if harness.has(Capability.PERSISTENT):
            assert reload(harness, sid).metadata == meta

    @requires(Capability.PERSISTENT)
    def test_mutations_persist_to_a_fresh_store(self, harness: StoreHarness, store: Any) -> None:
        sid = new_id()
        ctx = store.get_or_create(sid, Agent(name="Bot", instructions=""), metadata={"a": 1})
        ctx.metadata["b"] = {"nested": [1, 2]}
        assert reload(harness, sid).metadata == {"a": 1, "b": {"nested": [1, 2]}}
        ctx.metadata.update({"c": "x"})
        del ctx.metadata["a"]
        assert reload(harness, sid).metadata == {"b": {"nested": [1, 2]}, "c": "x"}
        ctx.metadata = {"replaced": True}
        assert reload(harness, sid).metadata == {"replaced": True}

    @requires(Capability.PERSISTENT)
    def test_mutations_inside_turn_persist_at_lock_exit(
        self, harness: StoreHarness, store: Any
    ) -> None:
        sid = new_id()
        ctx = store.get_or_create(sid, Agent(name="Bot", instructions=""))

        async def turn() -> None:
            async with ctx.lock:
                ctx.metadata["step"] = 1
                ctx.add_message(user("u1"))

        run(turn())
        again = reload(harness, sid)
        assert again.metadata == {"step": 1}
        assert contents(again.history) == ["u1"]

    def test_non_json_metadata_rejected_and_nothing_persisted(
        self, harness: StoreHarness, store: Any
    ) -> None:
        agent = Agent(name="Bot", instructions="")
        sid = new_id()
        with pytest.raises(ValueError):
            store.get_or_create(sid, agent, metadata={"bad": object()})
        assert sid not in store.list_sessions()
        assert store.get(sid) is None
        ctx = store.get_or_create(sid, agent, metadata={"ok": 1})
        with pytest.raises(ValueError):
            ctx.metadata["bad"] = {1, 2}
        with pytest.raises(ValueError):
            ctx.metadata.update({"bad": object()})
        with pytest.raises(ValueError):
            ctx.metadata = {"bad": b"bytes"}
        assert ctx.metadata == {"ok": 1}
        ctx.add_message(user("still works"))
        if harness.has(Capability.PERSISTENT):
            again = reload(harness, sid)
            assert again.metadata == {"ok": 1}
            assert contents(again.history) == ["still works"]

    def test_non_finite_numbers_are_not_json(self, harness: StoreHarness, store: Any) -> None:
        # NaN/Infinity are not JSON (RFC 8259; PostgreSQL's json types refuse them):
        # every backend must reject them up front, like any non-JSON value.
        agent = Agent(name="Bot", instructions="")
        sid = new_id()
        with pytest.raises(ValueError):
            store.get_or_create(sid, agent, metadata={"score": float("nan")})
        assert sid not in store.list_sessions()
        ctx = store.get_or_create(sid, agent, metadata={"ok": 1})
        with pytest.raises(ValueError):
            ctx.metadata["score"] = float("inf")
        assert ctx.metadata == {"ok": 1}
        if harness.has(Capability.PERSISTENT):
            assert reload(harness, sid).metadata == {"ok": 1}


# =============================================================== deletion


class TestDeletion(StoreTestBase):
    """Deletion: bool result, SessionDeletedError on live contexts, no leftovers."""

    def test_delete_returns_whether_it_existed(self, store: Any) -> None:
        sid = new_id()
        assert store.delete(sid) is False
        store.get_or_create(sid, Agent(name="Bot", instructions=""))
        assert store.delete(sid) is True
        assert store.delete(sid) is False

    def test_live_context_raises_after_delete(self, store: Any) -> None:
        assert issubclass(SessionDeletedError, ChatflowStoreError)
        support, billing = make_agents()
        sid = new_id()
        ctx = store.get_or_create(sid, support, metadata={"a": 1})
        ctx.add_message(user("u1"))
        assert store.delete(sid) is True
        with pytest.raises(SessionDeletedError):
            _ = ctx.history
        with pytest.raises(SessionDeletedError):
            _ = ctx.metadata
        with pytest.raises(SessionDeletedError):
            ctx.add_message(user("u2"))
        with pytest.raises(SessionDeletedError):
            ctx.set_active_agent(billing)
        with pytest.raises(SessionDeletedError):
            ctx.clear_history()
        with pytest.raises(SessionDeletedError):
            ctx.rollback_to(0)

        async def turn() -> None:
            async with ctx.lock:
                pass

        with pytest.raises(SessionDeletedError):
            run(turn())

    def test_deleted_session_is_gone_and_can_start_over(self, store: Any) -> None:
        agent = Agent(name="Bot", instructions="")
        sid, keep = new_id(), new_id()
        old = store.get_or_create(sid, agent, metadata={"v": 1})
        old.add_message(user("u1"))
        store.get_or_create(keep, agent)
        store.delete(sid)
        assert sid not in store.list_sessions()
        assert keep in store.list_sessions()
        assert store.get(sid) is None
        new = store.get_or_create(sid, agent, metadata={"v": 2})
        assert new is not old
        assert new.history == []
        assert new.metadata == {"v": 2}
        new.add_message(user("again"))
        assert contents(new.history) == ["again"]
        assert store.get(sid) is new
        with pytest.raises(SessionDeletedError):
            _ = old.history

    def test_runner_starts_over_after_delete(self, store: Any) -> None:
        support, billing = make_agents()
        runner = Runner(starting_agent=support, session_store=store, engine=ScriptedEngine())
        sid = new_id()
        run(runner.run_async(sid, "transfer billing", metadata={"v": 1}))
        old = store.get(sid)
        assert old.active_agent is billing
        assert store.delete(sid) is True
        response = run(runner.run_async(sid, "hello", metadata={"v": 2}))
        assert response.active_agent_name == "Support"
        new = store.get(sid)
        assert new is not old
        assert contents(new.history) == ["hello", "Support re: hello"]
        assert new.metadata == {"v": 2}

    @requires(Capability.SQL)
    def test_delete_leaves_no_orphan_rows(self, store: Any) -> None:
        from sqlalchemy import text

        sid = new_id()
        ctx = store.get_or_create(sid, Agent(name="Bot", instructions=""))
        for m in [system("s"), user("u1"), model("m1")]:
            ctx.add_message(m)
        count = text("SELECT COUNT(*) FROM chatflow_messages WHERE session_id = :sid")
        with store.engine.connect() as conn:
            assert conn.execute(count, {"sid": sid}).scalar() == 3
        store.delete(sid)
        with store.engine.connect() as conn:
            assert conn.execute(count, {"sid": sid}).scalar() == 0
            orphans = conn.execute(
                text(
                    "SELECT COUNT(*) FROM chatflow_messages m WHERE NOT EXISTS "
                    "(SELECT 1 FROM chatflow_sessions s WHERE s.session_id = m.session_id)"
                )
            ).scalar()
            assert orphans == 0

    @requires(Capability.SQL)
    def test_foreign_key_cascade_is_enforced(self, store: Any) -> None:
        from sqlalchemy import text

        sid = new_id()
        ctx = store.get_or_create(sid, Agent(name="Bot", instructions=""))
        ctx.add_message(user("u1"))
        with store.engine.begin() as conn:
            conn.execute(
                text("DELETE FROM chatflow_sessions WHERE session_id = :sid"), {"sid": sid}
            )
        with store.engine.connect() as conn:
            left = conn.execute(
                text("SELECT COUNT(*) FROM chatflow_messages WHERE session_id = :sid"), {"sid": sid}
            ).scalar()
        assert left == 0, "chatflow_messages rows survived their session (no ON DELETE CASCADE)"

    @requires(Capability.PERSISTENT)
    def test_recreated_session_is_not_taken_for_the_deleted_one(
        self, harness: StoreHarness
    ) -> None:
        """Delete + re-create elsewhere must not look unchanged to a cached context (ABA)."""
        first: Any = harness.open()
        second: Any = harness.open()
        agent = Agent(name="Bot", instructions="")
        sid = new_id()
        first.get_or_create(sid, agent).add_message(user("old"))
        assert second.delete(sid) is True
        second.get_or_create(sid, agent).add_message(user("new"))
        again = first.get_or_create(sid, agent)
        assert [m.content for m in again.history] == ["new"]
        again.add_message(Message(role=Role.MODEL, content="reply"))
        reread = harness.open().get(sid)
        assert reread is not None
        assert [m.content for m in reread.history] == ["new", "reply"]

    @requires(Capability.PERSISTENT)
    def test_delete_through_another_store_instance(self, harness: StoreHarness) -> None:
        first: Any = harness.open()
        agent = Agent(name="Bot", instructions="")
        writer, turner = new_id(), new_id()
        ctx = first.get_or_create(writer, agent)
        ctx.add_message(user("u1"))
        other_ctx = first.get_or_create(turner, agent)
        second: Any = harness.open()
        assert second.delete(writer) is True
        assert second.delete(turner) is True
        with pytest.raises(SessionDeletedError):
            ctx.add_message(user("u2"))
        with pytest.raises(SessionDeletedError):
            _ = ctx.history

        async def turn() -> None:
            async with other_ctx.lock:
                other_ctx.add_message(user("lost"))

        with pytest.raises(SessionDeletedError):
            run(turn())
        assert first.get(writer) is None
        assert first.get(turner) is None
        assert writer not in first.list_sessions()


# ================================================================== clear


class TestClear(StoreTestBase):
    """``clear()`` deletes every session."""

    def test_clear_removes_every_session(self, harness: StoreHarness, store: Any) -> None:
        agent = Agent(name="Bot", instructions="")
        ids = [new_id() for _ in range(3)]
        contexts = [store.get_or_create(sid, agent) for sid in ids]
        for ctx in contexts:
            ctx.add_message(user("hello"))
        store.clear()
        assert store.list_sessions() == []
        assert all(store.get(sid) is None for sid in ids)
        for ctx in contexts:
            with pytest.raises(SessionDeletedError):
                ctx.add_message(user("after clear"))
        assert store.get_or_create(ids[0], agent).history == []
        if harness.has(Capability.PERSISTENT):
            fresh: Any = harness.open()
            assert fresh.list_sessions() == [ids[0]]

    @requires(Capability.SQL)
    def test_clear_leaves_no_rows(self, store: Any) -> None:
        from sqlalchemy import text

        ctx = store.get_or_create(new_id(), Agent(name="Bot", instructions=""))
        ctx.add_message(user("hello"))
        store.clear()
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT COUNT(*) FROM chatflow_sessions")).scalar() == 0
            assert conn.execute(text("SELECT COUNT(*) FROM chatflow_messages")).scalar() == 0


# ========================================================== list sessions


class TestListSessions(StoreTestBase):
    """``list_sessions()``: every session id, most recently updated first."""

    def test_most_recently_updated_first(self, harness: StoreHarness, store: Any) -> None:
        support, billing = make_agents()
        a, b, c = (new_id(x) for x in "abc")
        contexts = {}
        for sid in (a, b, c):
            contexts[sid] = store.get_or_create(sid, support)
            time.sleep(0.02)
        assert store.list_sessions() == [c, b, a]
        contexts[a].add_message(user("news"))
        time.sleep(0.02)
        assert store.list_sessions() == [a, c, b], "a new message must make a session newest"
        contexts[b].set_active_agent(billing)
        time.sleep(0.02)
        assert store.list_sessions() == [b, a, c], "a handoff must make a session newest"
        contexts[c].metadata["x"] = 1
        assert store.list_sessions() == [c, b, a], "a metadata change must make a session newest"
        if harness.has(Capability.PERSISTENT):
            fresh: Any = harness.open()
            assert fresh.list_sessions() == [c, b, a]

    def test_runner_turn_moves_session_first(self, store: Any) -> None:
        support, _ = make_agents()
        runner = Runner(starting_agent=support, session_store=store, engine=ScriptedEngine())
        first, second = new_id(), new_id()
        run(runner.run_async(first, "hello"))
        time.sleep(0.02)
        run(runner.run_async(second, "hello"))
        time.sleep(0.02)
        assert store.list_sessions() == [second, first]
        run(runner.run_async(first, "order 5"))
        assert store.list_sessions() == [first, second]


# ================================================================== dedup


class TestDedup(StoreTestBase):
    """Behaviour 6: webhook dedup with a TTL; the claim is atomic across threads and processes."""

    def test_default_ttl_is_192_hours(self, store: Any) -> None:
        assert DEFAULT_DEDUP_TTL_HOURS == 192
        assert store.dedup_ttl_hours == 192

    def test_claim_semantics(self, store: Any) -> None:
        first, second = new_id("wamid"), new_id("wamid")
        assert store.is_message_processed(first) is False
        assert store.record_processed_message(first) is True
        assert store.is_message_processed(first) is True
        assert store.record_processed_message(first) is False
        assert store.is_message_processed(second) is False
        store.mark_message_processed(second)
        assert store.is_message_processed(second) is True
        assert store.record_processed_message(second) is False
        store.mark_message_processed(second)  # marking twice is fine
        assert store.is_message_processed(second) is True

    @requires(Capability.PERSISTENT)
    def test_claims_visible_to_a_fresh_store(self, harness: StoreHarness, store: Any) -> None:
        claimed, marked = new_id("wamid"), new_id("wamid")
        assert store.record_processed_message(claimed) is True
        store.mark_message_processed(marked)
        fresh: Any = harness.open()
        assert fresh.is_message_processed(claimed) is True
        assert fresh.is_message_processed(marked) is True
        assert fresh.record_processed_message(claimed) is False
        assert fresh.record_processed_message(marked) is False

    def test_expired_claim_can_be_claimed_again(self, harness: StoreHarness) -> None:
        store: Any = harness.open(dedup_ttl_hours=1e-6)  # 3.6 ms
        mid = new_id("wamid")
        assert store.record_processed_message(mid) is True
        time.sleep(0.05)
        assert store.is_message_processed(mid) is False
        assert store.record_processed_message(mid) is True
        marked = new_id("wamid")
        store.mark_message_processed(marked)
        time.sleep(0.05)
        assert store.is_message_processed(marked) is False
        assert store.record_processed_message(marked) is True

    def test_purge_returns_number_of_expired_ids(self, harness: StoreHarness) -> None:
        store: Any = harness.open(dedup_ttl_hours=1e-6)
        ids = [new_id("wamid") for _ in range(5)]
        for mid in ids[:3]:
            assert store.record_processed_message(mid) is True
        for mid in ids[3:]:
            store.mark_message_processed(mid)
        time.sleep(0.05)
        assert store.purge_processed_messages() == 5
        assert store.purge_processed_messages() == 0
        assert store.record_processed_message(ids[0]) is True

    def test_purge_keeps_live_ids(self, store: Any) -> None:
        ids = [new_id("wamid") for _ in range(3)]
        for mid in ids:
            store.record_processed_message(mid)
        assert store.purge_processed_messages() == 0
        assert all(store.is_message_processed(mid) for mid in ids)

    def test_invalid_message_ids_rejected(self, store: Any) -> None:
        for bad in ["", None, 123, b"wamid"]:
            for method in (
                store.is_message_processed,
                store.mark_message_processed,
                store.record_processed_message,
            ):
                with pytest.raises(ValueError):
                    method(bad)
        long_id = "w" * 255
        assert store.record_processed_message(long_id) is True
        assert store.is_message_processed(long_id) is True

    def test_thread_race_claims_each_id_once(self, store: Any) -> None:
        ids = [new_id("race") for _ in range(50)]
        n_threads = 8
        barrier = threading.Barrier(n_threads)
        claimed: list[list[str]] = [[] for _ in range(n_threads)]
        errors: list[BaseException] = []

        def worker(n: int) -> None:
            try:
                barrier.wait(30)
                claimed[n].extend(m for m in ids if store.record_processed_message(m))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(n_threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        assert not any(thread.is_alive() for thread in threads), "claim threads hung"
        counts = Counter(m for got in claimed for m in got)
        assert counts == Counter(ids), {m: counts[m] for m in ids if counts[m] != 1}

    def test_async_race_claims_once(self, store: Any) -> None:
        mid = new_id("race")

        async def race() -> list[bool]:
            claims = [store.arecord_processed_message(mid) for _ in range(12)]
            return list(await asyncio.gather(*claims))

        assert sorted(run(race())) == [False] * 11 + [True]

    @requires(Capability.CROSS_PROCESS)
    def test_process_race_claims_each_id_once(self, harness: StoreHarness, store: Any) -> None:
        ids = [new_id("proc") for _ in range(200)]
        results = run_workers(claim_worker, [(harness.spec(), ids)] * 4, timeout=90)
        assert len(results) == 4
        counts = Counter(m for _pid, got in results for m in got)
        assert counts == Counter(ids), {m: counts[m] for m in ids if counts[m] != 1}
        assert all(store.is_message_processed(m) for m in ids)


# ============================================================= validation


class TestValidation(StoreTestBase):
    """Behaviour 7/8: invalid parameters raise ValueError and change nothing."""

    BAD_SESSION_IDS: tuple[Any, ...] = ("", "x" * 256, 123, None, b"bytes")

    def test_context_max_turns_must_be_positive(self, store: Any) -> None:
        agent = Agent(name="Bot", instructions="")
        ctx = store.get_or_create(new_id(), agent)
        for cls in {type(ctx), SessionContext}:
            for bad in (0, -1):
                with pytest.raises(ValueError):
                    cls("sid", agent, max_turns=bad)
        for bad in (0, -3):
            with pytest.raises(ValueError):
                ctx.max_turns = bad
        assert ctx.max_turns == store.default_max_turns

    def test_store_parameters_validated(self, harness: StoreHarness) -> None:
        for kwargs in (
            {"default_max_turns": 0},
            {"default_max_turns": -1},
            {"dedup_ttl_hours": 0},
            {"dedup_ttl_hours": -5},
        ):
            with pytest.raises(ValueError):
                harness.open(**kwargs)
        ok: Any = harness.open(default_max_turns=7, dedup_ttl_hours=1)
        assert ok.default_max_turns == 7
        assert ok.get_or_create(new_id(), Agent(name="Bot", instructions="")).max_turns == 7

    def test_bad_session_ids_rejected(self, store: Any) -> None:
        agent = Agent(name="Bot", instructions="")
        for bad in self.BAD_SESSION_IDS:
            with pytest.raises(ValueError):
                store.get_or_create(bad, agent)
            with pytest.raises(ValueError):
                store.get(bad)
            with pytest.raises(ValueError):
                store.delete(bad)
            with pytest.raises(ValueError):
                run(store.aget_or_create(bad, agent))
            with pytest.raises(ValueError):
                SessionContext(bad, agent)
        assert store.list_sessions() == []

    def test_longest_session_id_round_trips(self, harness: StoreHarness, store: Any) -> None:
        sid = "s" * 255
        ctx = store.get_or_create(sid, Agent(name="Bot", instructions=""))
        ctx.add_message(user("hi"))
        assert store.list_sessions() == [sid]
        assert_reloads_identically(harness, ctx)


# ============================================================= async twins


class TestAsyncTwins(StoreTestBase):
    """Every ``a*`` method works like its sync twin; blocking work stays off the loop."""

    def test_every_twin_exists_and_is_a_coroutine_function(self, store: Any) -> None:
        ctx = store.get_or_create(new_id(), Agent(name="Bot", instructions=""))
        for name in STORE_ASYNC_TWINS:
            assert inspect.iscoroutinefunction(getattr(store, name)), f"store.{name}"
        for name in CONTEXT_ASYNC_TWINS:
            assert inspect.iscoroutinefunction(getattr(ctx, name)), f"context.{name}"

    def test_store_twins_match_sync_methods(self, store: Any) -> None:
        agent = Agent(name="Bot", instructions="")
        a, b = new_id("a"), new_id("b")

        async def scenario() -> None:
            ctx = await store.aget_or_create(a, agent, {"k": 1})
            assert ctx is store.get_or_create(a, agent)
            assert ctx.metadata == {"k": 1}
            assert await store.aget(a) is ctx
            assert await store.aget(new_id()) is None
            await asyncio.sleep(0.02)
            await store.aget_or_create(b, agent)
            assert await store.alist_sessions() == store.list_sessions() == [b, a]
            mid, marked = new_id("wamid"), new_id("wamid")
            assert await store.ais_message_processed(mid) is False
            assert await store.arecord_processed_message(mid) is True
            assert await store.arecord_processed_message(mid) is False
            assert await store.ais_message_processed(mid) is True
            await store.amark_message_processed(marked)
            assert store.is_message_processed(marked) is True
            assert await store.apurge_processed_messages() == 0
            assert await store.adelete(a) is True
            assert await store.adelete(a) is False
            assert store.get(a) is None
            await store.aclear()
            assert store.list_sessions() == []

        run(scenario())

    def test_context_twins_match_sync_methods(self, harness: StoreHarness) -> None:
        store: Any = harness.open(default_max_turns=2)
        support, billing = make_agents()
        sync_ctx = store.get_or_create(new_id("sync"), support)
        async_ctx = store.get_or_create(new_id("async"), support)
        script = [system("s"), user("u1"), model("m1"), user("u2"), model("m2")]

        async def scenario() -> None:
            for m in script:
                sync_ctx.add_message(m)
                await async_ctx.aadd_message(m)
            assert dump(async_ctx.history) == dump(sync_ctx.history)
            checkpoint = len(sync_ctx.history)
            extra = user("u3")  # prunes u1
            sync_ctx.add_message(extra)
            await async_ctx.aadd_message(extra)
            sync_ctx.set_active_agent(billing)
            await async_ctx.aset_active_agent(billing)
            assert async_ctx.active_agent is billing
            assert dump(async_ctx.history) == dump(sync_ctx.history)
            sync_ctx.rollback_to(checkpoint)
            await async_ctx.arollback_to(checkpoint)
            assert dump(async_ctx.history) == dump(sync_ctx.history) == dump(script)
            assert async_ctx.active_agent is sync_ctx.active_agent is support
            for ctx in (sync_ctx, async_ctx):
                assert_reloads_identically(harness, ctx, default_max_turns=2)
            async with async_ctx.lock:
                await async_ctx.aadd_message(user("in lock"))
                await async_ctx.aset_active_agent(billing)
            assert contents(async_ctx.history)[-1] == "in lock"
            assert_reloads_identically(harness, async_ctx, default_max_turns=2)
            sync_ctx.clear_history()
            await async_ctx.aclear_history()
            assert sync_ctx.history == async_ctx.history == []
            for ctx in (sync_ctx, async_ctx):
                assert_reloads_identically(harness, ctx, default_max_turns=2)

        run(scenario())

    @staticmethod
    async def _exercise_async_api(store: Any) -> str:
        """Call every async method once (with a turn); return the loop thread's name."""
        agent = Agent(name="Bot", instructions="")
        ctx = await store.aget_or_create(new_id(), agent)
        await ctx.aadd_message(user("u1"))
        await ctx.aset_active_agent(Agent(name="Other", instructions=""))
        async with ctx.lock:
            ctx.add_message(user("u2"))
        await ctx.arollback_to(1)
        await ctx.aclear_history()
        await store.aget(ctx.session_id)
        await store.alist_sessions()
        await asyncio.gather(*(store.arecord_processed_message(new_id()) for _ in range(16)))
        await store.ais_message_processed("x")
        await store.amark_message_processed("y")
        await store.apurge_processed_messages()
        await store.adelete(ctx.session_id)
        await store.aclear()
        return threading.current_thread().name

    @requires(Capability.SQL)
    def test_async_api_never_blocks_the_loop_on_database_io(
        self, harness: StoreHarness, store: Any
    ) -> None:
        with record_sql() as executed:
            loop_thread = run(self._exercise_async_api(store))
        assert executed, "the async API executed no SQL"
        if harness.has(Capability.EPHEMERAL):
            return  # in-memory: no I/O to wait for, runs on the loop by design
        blocking = [e for e in executed if e.thread == loop_thread and not e.is_async]
        assert not blocking, f"blocking driver calls on the event loop: {blocking[:5]}"

    @requires(Capability.ASYNC_THREADPOOL)
    def test_blocking_work_runs_on_the_private_pool(self, harness: StoreHarness) -> None:
        before = set(threading.enumerate())
        store: Any = harness.open()
        with record_sql() as executed:
            loop_thread = run(self._exercise_async_api(store))
        assert executed, "the async API executed no SQL"
        off_pool = [
            e for e in executed if e.thread == loop_thread or not e.thread.startswith(IO_THREADS)
        ]
        assert not off_pool, f"SQL executed outside the private pool: {off_pool[:5]}"
        run(store.aclose())
        assert not _io_threads_started_since(before), "aclose() stops the store's I/O threads"

    @requires(Capability.ASYNC_NATIVE, Capability.SQL)
    def test_native_async_driver_runs_on_the_loop(self, store: Any) -> None:
        with record_sql() as executed:
            loop_thread = run(self._exercise_async_api(store))
        assert executed
        not_native = [e for e in executed if not e.is_async or e.thread != loop_thread]
        assert not not_native, f"statements not on the loop's async driver: {not_native[:5]}"

    @requires(Capability.SQL, Capability.EPHEMERAL)
    def test_ephemeral_database_runs_on_the_loop(self, store: Any) -> None:
        with record_sql() as executed:
            loop_thread = run(self._exercise_async_api(store))
        assert executed
        assert {e.thread for e in executed} == {loop_thread}

    def test_aclose_and_context_manager(self, harness: StoreHarness) -> None:
        before = set(threading.enumerate())
        store: Any = harness.open()
        ctx = run(store.aget_or_create(new_id(), Agent(name="Bot", instructions="")))
        run(ctx.aadd_message(user("u1")))
        run(store.aclose())
        assert not _io_threads_started_since(before), "aclose() stops the store's I/O threads"
        store.close()  # closing twice is harmless
        other: Any = harness.open()
        with other as managed:
            assert managed is other
            assert isinstance(managed.list_sessions(), list)

    def test_deleted_session_errors_on_async_path(self, store: Any) -> None:
        support, billing = make_agents()

        async def scenario() -> None:
            sid = new_id()
            ctx = await store.aget_or_create(sid, support)
            await ctx.aadd_message(user("u1"))
            assert await store.adelete(sid) is True
            with pytest.raises(SessionDeletedError):
                await ctx.aadd_message(user("u2"))
            with pytest.raises(SessionDeletedError):
                await ctx.aset_active_agent(billing)
            with pytest.raises(SessionDeletedError):
                await ctx.aclear_history()
            with pytest.raises(SessionDeletedError):
                await ctx.arollback_to(0)
            with pytest.raises(SessionDeletedError):
                async with ctx.lock:
                    pass
            assert await store.aget(sid) is None
            assert await store.adelete(sid) is False
            fresh = await store.aget_or_create(sid, support)
            assert fresh is not ctx
            assert fresh.history == []

        run(scenario())


# ====================================================== Runner end to end


class TestRunnerEndToEnd(StoreTestBase):
    """The real ``chatflow_agent.Runner`` driving the store with a scripted offline engine."""

    @staticmethod
    def _check_reload(harness: StoreHarness, ctx: Any) -> None:
        if not harness.has(Capability.PERSISTENT):
            return
        fresh: Any = harness.open()
        new_support, _ = make_agents()
        Runner(starting_agent=new_support, session_store=fresh, engine=ScriptedEngine())
        again = fresh.get(ctx.session_id)
        assert dump(again.history) == dump(ctx.history)
        assert again.active_agent.name == ctx.active_agent.name
        assert again.active_agent.get_all_tools(), "the Runner's resolver was not used"
        assert again.metadata == ctx.metadata
        assert_well_formed(again.history)

    def test_tools_handoff_and_failed_turns(self, harness: StoreHarness, store: Any) -> None:
        support, billing = make_agents()
        runner = Runner(starting_agent=support, session_store=store, engine=ScriptedEngine())
        sid = new_id("+1555")

        first = run(runner.run_async(sid, "order 404", metadata={"channel": "web"}))
        assert first.tool_calls_executed == ["check_order_status"]
        assert "IN_TRANSIT" in first.content
        assert first.active_agent_name == "Support"
        ctx = store.get(sid)
        assert [m.role for m in ctx.history] == [Role.USER, Role.MODEL, Role.TOOL, Role.MODEL]
        assert ctx.metadata == {"channel": "web"}
        self._check_reload(harness, ctx)

        second = run(runner.run_async(sid, "transfer billing"))
        assert second.active_agent_name == "Billing"
        assert second.handoff is not None and second.handoff.target_agent_name == "Billing"
        assert second.tool_calls_executed == ["transfer_to_billing"]
        assert ctx.active_agent is billing
        assert len(ctx.history) == 8
        self._check_reload(harness, ctx)

        before = dump(ctx.history)
        with pytest.raises(RuntimeError, match="scripted engine failure"):
            run(runner.run_async(sid, "refund 10 then fail"))
        assert dump(ctx.history) == before
        assert ctx.active_agent is billing
        self._check_reload(harness, ctx)

        with pytest.raises(RuntimeError, match="scripted engine failure"):
            run(runner.run_async(sid, "transfer support then fail"))
        assert dump(ctx.history) == before
        assert ctx.active_agent is billing, "a failed turn must roll its handoff back"
        self._check_reload(harness, ctx)

        third = run(runner.run_async(sid, "refund 10"))
        assert third.tool_calls_executed == ["refund"]
        assert third.active_agent_name == "Billing"
        assert len(ctx.history) == 12
        assert_well_formed(ctx.history)
        self._check_reload(harness, ctx)

    def test_pruning_through_the_runner(self, harness: StoreHarness) -> None:
        store: Any = harness.open(default_max_turns=2)
        support, _ = make_agents()
        runner = Runner(starting_agent=support, session_store=store, engine=ScriptedEngine())
        sid = new_id()
        for text in ["order 1", "order 2", "hello", "order 3"]:
            run(runner.run_async(sid, text))
        ctx = store.get(sid)
        assert [m.content for m in ctx.history if m.role == Role.USER] == ["hello", "order 3"]
        assert len(ctx.history) == 6
        assert_well_formed(ctx.history)
        if harness.has(Capability.PERSISTENT):
            again = reload(harness, sid, default_max_turns=2)
            assert dump(again.history) == dump(ctx.history)
        # a failed turn whose messages pruned the "hello" turn restores it
        before = dump(ctx.history)
        with pytest.raises(RuntimeError):
            run(runner.run_async(sid, "order 9 then fail"))
        assert dump(ctx.history) == before
        if harness.has(Capability.PERSISTENT):
            again = reload(harness, sid, default_max_turns=2)
            assert dump(again.history) == before

    def test_sync_runner_run_across_event_loops(self, harness: StoreHarness, store: Any) -> None:
        support, _ = make_agents()
        runner = Runner(starting_agent=support, session_store=store, engine=ScriptedEngine())
        sid = new_id()
        assert "IN_TRANSIT" in runner.run(sid, "order 7").content
        assert runner.run(sid, "hello").content.startswith("Support re: hello")
        ctx = store.get(sid)
        assert len(ctx.history) == 6
        self._check_reload(harness, ctx)

    @requires(Capability.PERSISTENT)
    def test_new_runner_on_fresh_store_resumes_with_handoff_target(
        self, harness: StoreHarness, store: Any
    ) -> None:
        support, _ = make_agents()
        runner = Runner(starting_agent=support, session_store=store, engine=ScriptedEngine())
        sid = new_id()
        run(runner.run_async(sid, "transfer billing"))
        fresh: Any = harness.open()
        new_support, new_billing = make_agents()
        restarted = Runner(starting_agent=new_support, session_store=fresh, engine=ScriptedEngine())
        response = run(restarted.run_async(sid, "refund 3"))
        assert response.active_agent_name == "Billing"
        assert response.tool_calls_executed == ["refund"]
        assert fresh.get(sid).active_agent is new_billing
        assert len(fresh.get(sid).history) == 8


# ======================================================== seed document


class TestSeedDocumentExamples(StoreTestBase):
    """The examples of upstream's "Sessions and state" page, run against this store."""

    def test_session_context_example(self, harness: StoreHarness, store: Any) -> None:
        agent = Agent(name="Assistant", instructions="Helpful bot", model="gpt-4o")
        session = SessionContext(
            session_id="user-session-1001",
            initial_agent=agent,
            max_turns=40,
            metadata={"user_id": "cust_882", "channel": "whatsapp"},
        )
        assert session.active_agent.name == "Assistant"
        assert session.metadata["channel"] == "whatsapp"
        stored = store.get_or_create(
            "user-session-1001", agent, metadata={"user_id": "cust_882", "channel": "whatsapp"}
        )
        assert stored.active_agent.name == "Assistant"
        assert stored.metadata["channel"] == "whatsapp"
        if harness.has(Capability.PERSISTENT):
            assert reload(harness, "user-session-1001").metadata == {
                "user_id": "cust_882",
                "channel": "whatsapp",
            }

    def test_store_and_runner_example(self, store: Any) -> None:
        agent = Agent(name="Bot", instructions="Assistant", model="gpt-4o")
        runner = Runner(starting_agent=agent, session_store=store, engine=ScriptedEngine())
        session = store.get_or_create(session_id="session-alpha", default_agent=agent)
        assert session.session_id == "session-alpha"
        assert runner.get_session("session-alpha") is session

    def test_agent_resolver_example(self, harness: StoreHarness, store: Any) -> None:
        billing = Agent(name="Billing", instructions="Billing specialist", model="gpt-4o")
        support = Agent(name="Support", instructions="Support", handoffs=[billing], model="gpt-4o")
        store.get_or_create("session-101", support).set_active_agent(billing)
        if harness.has(Capability.PERSISTENT):
            store = harness.open()
        Runner(starting_agent=support, session_store=store, engine=ScriptedEngine())
        store.set_agent_resolver(lambda name: billing if name == "Billing" else support)
        session = store.get("session-101")
        assert session.active_agent.name in ["Billing", "Support"]
        assert session.active_agent is billing

    def test_dedup_example(self, store: Any) -> None:
        from chatflow_sqlalchemy import DEFAULT_DEDUP_TTL_HOURS as ttl

        assert ttl == 192
        msg_id = "wamid.HBgLMjAyNjEwMzAA"
        processed = 0
        for _delivery in range(3):  # the platform retries the webhook
            if not store.is_message_processed(msg_id):
                store.mark_message_processed(msg_id)
                processed += 1
        assert processed == 1

    def test_webhook_handler_example(self, harness: StoreHarness) -> None:
        @tool
        def check_order_status(order_id: str) -> dict[str, str]:
            """Check shipment tracking for an order ID."""
            return {"order_id": order_id, "status": "IN_TRANSIT", "eta": "Tomorrow"}

        agent = Agent(
            name="OrderTrackingAgent",
            instructions="Assist customers with order queries. Use check_order_status.",
            tools=[check_order_status],
            model="gemini-2.5-flash",
        )
        store: Any = harness.open(default_max_turns=30)
        runner = Runner(starting_agent=agent, session_store=store, engine=ScriptedEngine())
        printed: list[str] = []

        async def handle_inbound_webhook(
            user_phone: str, message_text: str, webhook_msg_id: str
        ) -> str | None:
            if store.is_message_processed(webhook_msg_id):
                printed.append(f"Skipping duplicate webhook: {webhook_msg_id}")
                return None
            store.mark_message_processed(webhook_msg_id)
            response = await runner.run_async(
                session_id=user_phone,
                user_message=message_text,
                metadata={"channel": "whatsapp", "phone": user_phone},
            )
            return response.content

        res = run(handle_inbound_webhook("+15550199", "Where is order 404?", "msg_id_001"))
        assert res is not None and "IN_TRANSIT" in res
        again = run(handle_inbound_webhook("+15550199", "Where is order 404?", "msg_id_001"))
        assert again is None
        assert printed == ["Skipping duplicate webhook: msg_id_001"]
        session = store.get("+15550199")
        assert session.metadata == {"channel": "whatsapp", "phone": "+15550199"}
        assert [m.role for m in session.history] == [Role.USER, Role.MODEL, Role.TOOL, Role.MODEL]
        assert session.max_turns == 30
        if harness.has(Capability.PERSISTENT):
            loaded = reload(harness, "+15550199", resolver={agent.name: agent}.get)
            assert dump(loaded.history) == dump(session.history)
            assert loaded.active_agent is agent


# ======================================================= corrupt rows


class TestCorruptRows(StoreTestBase):
    """Behaviour 8: a corrupt stored row gets an error naming its session and row id."""

    @requires(Capability.SQL, Capability.PERSISTENT)
    def test_corrupt_message_row_is_named(self, harness: StoreHarness, store: Any) -> None:
        from sqlalchemy import text

        sid = new_id()
        ctx = store.get_or_create(sid, Agent(name="Bot", instructions=""))
        ctx.add_message(user("u1"))
        ctx.add_message(model("m1"))
        with store.engine.begin() as conn:
            row_id = conn.execute(
                text("SELECT MAX(id) FROM chatflow_messages WHERE session_id = :sid"),
                {"sid": sid},
            ).scalar()
            conn.execute(
                text("UPDATE chatflow_messages SET message_json = :bad WHERE id = :id"),
                {"bad": '{"role": "nobody", "content": ', "id": row_id},
            )
        fresh: Any = harness.open()
        with pytest.raises(ChatflowStoreError) as info:
            fresh.get(sid)
        assert sid in str(info.value)
        assert str(row_id) in str(info.value)


# ========================================================= cross-process


class TestCrossProcess(StoreTestBase):
    """Behaviours 3 and 4 across real OS processes (spawned workers)."""

    @requires(Capability.CROSS_PROCESS, Capability.PERSISTENT)
    def test_concurrent_turns_from_processes_are_kept_whole(self, harness: StoreHarness) -> None:
        sid = new_id()
        n_turns, labels = 5, ["p0", "p1", "p2"]
        spec = harness.spec()
        run_workers(
            turns_worker, [(spec, sid, "Support", label, n_turns) for label in labels], timeout=90
        )
        ctx = reload(harness, sid)
        history = ctx.history
        assert len(history) == 2 * n_turns * len(labels), "messages were lost"
        per_label: dict[str, list[int]] = {label: [] for label in labels}
        for start in range(0, len(history), 2):
            u, m = history[start], history[start + 1]
            assert (u.role, m.role) == (Role.USER, Role.MODEL), "turns interleaved"
            assert u.content == m.content, f"turn {u.content} interleaved with {m.content}"
            label, k = (u.content or "").split("-")
            per_label[label].append(int(k))
        assert per_label == {label: list(range(n_turns)) for label in labels}

    @requires(Capability.CROSS_PROCESS, Capability.PERSISTENT)
    def test_a_lease_given_back_is_taken_again_at_once(self, harness: StoreHarness) -> None:
        """Turns of two stores on one session alternate; each sees the other's last turn."""
        sid = new_id()
        stores = [harness.open(), harness.open()]

        async def alternate() -> None:
            for k in range(6):
                ctx = stores[k % 2].get_or_create(sid, make_agents()[0])
                async with ctx.lock:
                    assert len(ctx.history) == 2 * k, "a turn did not see the one before it"
                    ctx.add_message(user(f"u{k}"))
                    ctx.add_message(model(f"m{k}"))

        run(asyncio.wait_for(alternate(), 60))
        assert len(reload(harness, sid).history) == 12

    @requires(Capability.CROSS_PROCESS, Capability.PERSISTENT)
    def test_a_turn_waits_for_another_stores_lease_and_sees_its_messages(
        self, harness: StoreHarness
    ) -> None:
        """While one store's turn holds the session, another store's turn does not start."""
        sid = new_id()
        first, second = harness.open(), harness.open()
        first.get_or_create(sid, make_agents()[0])
        events: list[str] = []

        async def holder(entered: asyncio.Event, go_on: asyncio.Event) -> None:
            ctx = first.get_or_create(sid, make_agents()[0])
            async with ctx.lock:
                ctx.add_message(user("first"))
                entered.set()
                await go_on.wait()
                events.append("first ends")

        async def waiter(entered: asyncio.Event) -> list[str | None]:
            await entered.wait()
            ctx = second.get_or_create(sid, make_agents()[0])
            async with ctx.lock:
                events.append("second enters")
                return contents(ctx.history)

        async def both() -> list[str | None]:
            entered, go_on = asyncio.Event(), asyncio.Event()
            held = asyncio.ensure_future(holder(entered, go_on))
            waiting = asyncio.ensure_future(waiter(entered))
            await asyncio.sleep(0.5)
            assert not waiting.done(), "a second turn ran while another store held the lease"
            go_on.set()
            await held
            return await waiting

        seen = run(asyncio.wait_for(both(), 60))
        assert events == ["first ends", "second enters"]
        assert seen == ["first"], "the second turn did not see the first one's message"

    @requires(Capability.PERSISTENT)
    def test_a_runner_turn_after_another_store_deleted_the_session_starts_anew(
        self, harness: StoreHarness
    ) -> None:
        """As a returning user whose session another worker's sweep removed."""
        sid = new_id()
        store, other = harness.open(), harness.open()
        runner = Runner(starting_agent=make_agents()[0], session_store=store,
                        engine=ScriptedEngine())
        run(runner.run_async(sid, "first"))
        assert other.delete(sid) is True
        run(runner.run_async(sid, "again"))
        assert contents(reload(harness, sid).history)[0] == "again"

    @requires(Capability.PERSISTENT)
    def test_an_old_context_of_a_recreated_session_leaves_the_new_one_working(
        self, store: Any
    ) -> None:
        """A turn on a stale context fails alone; the new context's turns run.

        Each gives its lease back: the next turn is not kept waiting.
        """
        sid = new_id()
        old = store.get_or_create(sid, make_agents()[0])
        old.add_message(user("before"))
        store.delete(sid)
        new = store.get_or_create(sid, make_agents()[0])
        with pytest.raises(SessionDeletedError):
            old.add_message(user("stale write"))

        async def turns() -> None:
            with pytest.raises(SessionDeletedError):
                async with old.lock:
                    pass
            async with new.lock:
                new.add_message(user("after"))
            async with store.get_or_create(sid, make_agents()[0]).lock:
                pass

        run(asyncio.wait_for(turns(), 30))
        assert contents(store.get_or_create(sid, make_agents()[0]).history) == ["after"]

    @requires(Capability.CROSS_PROCESS, Capability.PERSISTENT)
    def test_a_holder_paused_past_its_lease_writes_nothing(self, harness: StoreHarness) -> None:
        """A turn stalled past ``turn_lease_seconds`` is taken over; its own exit raises.

        The stall blocks the holder's event loop (as a paused process would),
        so its lease is not renewed; another store's turn, on a thread of its
        own, takes the expired lease and commits. The stalled turn then gets
        ``LeaseLostError`` and the database holds only the other turn.
        """
        sid = new_id()
        lease = 1.0
        paused: Any = harness.open(turn_lease_seconds=lease)
        other: Any = harness.open(turn_lease_seconds=lease)
        paused.get_or_create(sid, make_agents()[0])
        took_over = threading.Event()

        def other_turn() -> None:
            async def turn() -> None:
                ctx = other.get_or_create(sid, make_agents()[0])
                async with ctx.lock:
                    ctx.add_message(user("other"))
                    ctx.add_message(model("answer"))
                took_over.set()

            asyncio.run(asyncio.wait_for(turn(), 60))

        async def stalled_turn() -> None:
            ctx = paused.get_or_create(sid, make_agents()[0])
            async with ctx.lock:
                ctx.add_message(user("stalled"))
                thread.start()
                assert took_over.wait(60), "the expired lease was not taken over"

        thread = threading.Thread(target=other_turn)
        with pytest.raises(LeaseLostError):
            run(stalled_turn())
        thread.join(60)
        assert contents(reload(harness, sid).history) == ["other", "answer"]

    @requires(Capability.CROSS_PROCESS, Capability.PERSISTENT)
    def test_process_killed_mid_turn_leaves_well_formed_history(
        self, harness: StoreHarness
    ) -> None:
        locked, unlocked = new_id("locked"), new_id("unlocked")
        exit_code = run_process(crash_worker, (harness.spec(), locked, unlocked), timeout=60)
        assert exit_code == CRASH_EXIT_CODE, f"crash worker exited with {exit_code}"
        after_locked = reload(harness, locked)
        assert contents(after_locked.history) == ["turn 1", "answer 1"], (
            "a turn killed inside session.lock must leave nothing behind"
        )
        # Outside a lock every message is its own write: the USER message and the
        # tool call were stored, but a reload never ends on a call without its
        # result (providers reject that): the dead writer's call is not shown.
        after_unlocked = reload(harness, unlocked)
        assert_well_formed(after_unlocked.history)
        assert contents(after_unlocked.history) == ["turn 1"]
        after_unlocked.add_message(user("turn 2"))
        assert_turn_shaped(reload(harness, unlocked).history)


# ============================================== turn faults (issue 13)


def nested(depth: int) -> Any:
    """A JSON value nested ``depth`` levels deep (lists and objects in turn)."""
    value: Any = "bottom"
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


def deepest_storable_depth() -> int:
    """The deepest tool result pydantic serialises (the installed version decides)."""
    depth = 150
    while depth < 1000:
        message = tool_result(call("deep"), nested(depth + 1))
        try:
            dump_message(message)
        except ValueError:
            return depth
        depth += 1
    return depth


class OneToolEngine(BaseEngine):
    """For the real ``Runner``: a USER message gets one call of ``tool``; its result an answer."""

    def __init__(self, tool_name: str) -> None:
        self.tool_name = tool_name

    async def generate_turn_async(self, agent: Agent, history: list[Message]) -> EngineTurnResult:
        last = history[-1]
        if last.role == Role.USER:
            return EngineTurnResult(tool_calls=[call(self.tool_name, q=last.content)])
        return EngineTurnResult(text=f"done: {last.role.value}")


class _HardStop(BaseException):
    """Stands for KeyboardInterrupt / SystemExit: only ``session.lock`` sees it.

    It is not an ``Exception``, so the Runner does not roll back.
    """


class TestTurnFaults(StoreTestBase):
    """A turn is stored whole or not at all, into its own conversation, and readable."""

    # ---------------------------------------------------------- deep JSON

    @staticmethod
    def _deep_runner(store: Any, depth: dict[str, int]) -> Runner:
        async def deep_lookup(q: str) -> Any:
            return nested(depth["now"])

        agent = Agent(name="Deep", instructions="", tools=[Tool(deep_lookup, name="deep_lookup")])
        engine = OneToolEngine("deep_lookup")
        return Runner(starting_agent=agent, session_store=store, engine=engine)

    def test_deep_tool_results_round_trip_up_to_the_deepest_storable(
        self, harness: StoreHarness, store: Any
    ) -> None:
        # pydantic writes JSON deeper than its own parser reads back (~200 levels):
        # whatever a store writes, it must read back.
        deepest = deepest_storable_depth()
        for depth in sorted({150, 198, 199, 230, deepest}):
            sid = new_id("deep")
            runner = self._deep_runner(store, {"now": depth})
            run(runner.run_async(sid, "first"))
            run(runner.run_async(sid, "second"))
            ctx = store.get(sid)
            results = [m for m in ctx.history if m.role == Role.TOOL]
            assert [r.tool_results[0].content for r in results] == [nested(depth)] * 2
            assert_reloads_identically(harness, ctx)

    def test_json_too_deep_to_store_is_refused_and_nothing_written(
        self, harness: StoreHarness, store: Any
    ) -> None:
        if not harness.has(Capability.SQL) and not harness.has(Capability.PERSISTENT):
            pytest.skip("this store keeps Python objects: nothing is serialised or refused")
        depth = {"now": 3}
        runner = self._deep_runner(store, depth)
        sid = new_id("deep")
        run(runner.run_async(sid, "shallow"))
        ctx = store.get(sid)
        before = dump(ctx.history)
        depth["now"] = deepest_storable_depth() + 1
        with pytest.raises(ValueError, match="nested at most"):
            run(runner.run_async(sid, "too deep"))
        assert dump(ctx.history) == before, "memory must not keep the refused turn"
        assert_reloads_identically(harness, ctx)
        depth["now"] = 3
        run(runner.run_async(sid, "still works"))
        assert [m.content for m in ctx.history if m.role == Role.USER] == [
            "shallow",
            "still works",
        ]
        assert_reloads_identically(harness, ctx)

    # -------------------------------------------------- cancelled turns

    @staticmethod
    def _slow_runner(store: Any, started: asyncio.Event, sid: str) -> Runner:
        async def slow_lookup(q: str) -> str:
            store.get(sid).metadata["during_turn"] = q  # discarded with the turn
            started.set()
            await asyncio.sleep(600)
            return "never"

        agent = Agent(name="Slow", instructions="", tools=[Tool(slow_lookup, name="slow_lookup")])
        engine = OneToolEngine("slow_lookup")
        return Runner(starting_agent=agent, session_store=store, engine=engine)

    def _pre_turn(self, store: Any, sid: str, agent: Agent | None = None) -> Any:
        agent = agent or Agent(name="Slow", instructions="")
        ctx = store.get_or_create(sid, agent, metadata={"v": 1})
        ctx.add_message(user("q1"))
        ctx.add_message(model("a1"))
        return ctx

    def _assert_back_to_pre_turn(self, harness: StoreHarness, store: Any, ctx: Any) -> None:
        assert contents(ctx.history) == ["q1", "a1"], outline(ctx.history)
        assert ctx.metadata == {"v": 1}
        assert not ctx.lock.locked()
        assert_reloads_identically(harness, ctx)
        if harness.has(Capability.PERSISTENT):
            assert reload(harness, ctx.session_id).metadata == {"v": 1}

        async def next_turn_from_another_store() -> None:
            other: Any = harness.open() if harness.has(Capability.PERSISTENT) else store
            again = other.get(ctx.session_id)
            async with again.lock:  # the session's lease was given back too
                again.add_message(user("q2"))
                again.add_message(model("a2"))

        run(asyncio.wait_for(next_turn_from_another_store(), 60))
        if harness.has(Capability.PERSISTENT):
            assert contents(reload(harness, ctx.session_id).history) == ["q1", "a1", "q2", "a2"]

    def test_turn_cancelled_inside_a_tool_writes_nothing(
        self, harness: StoreHarness, store: Any
    ) -> None:
        sid = new_id("cancel")
        started = asyncio.Event()
        runner = self._slow_runner(store, started, sid)
        ctx = self._pre_turn(store, sid, runner.starting_agent)

        async def cancel_mid_tool() -> None:
            task = asyncio.ensure_future(runner.run_async(sid, "slow"))
            await asyncio.wait_for(started.wait(), 60)
            assert [m.role for m in ctx.history][-2:] == [Role.USER, Role.MODEL]
            task.cancel()  # what asyncio.wait_for does when its timeout expires
            with pytest.raises(asyncio.CancelledError):
                await task

        run(cancel_mid_tool())
        self._assert_back_to_pre_turn(harness, store, ctx)

    def test_wait_for_timeout_writes_nothing(self, harness: StoreHarness, store: Any) -> None:
        sid = new_id("timeout")
        runner = self._slow_runner(store, asyncio.Event(), sid)
        ctx = self._pre_turn(store, sid, runner.starting_agent)

        async def timed_out() -> None:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(runner.run_async(sid, "slow"), 0.5)

        run(timed_out())
        self._assert_back_to_pre_turn(harness, store, ctx)

    def test_turn_ended_by_a_base_exception_writes_nothing(
        self, harness: StoreHarness, store: Any
    ) -> None:
        sid = new_id("stop")
        ctx = self._pre_turn(store, sid)
        _, billing = make_agents()

        async def interrupted() -> None:
            async with ctx.lock:
                ctx.add_message(user("q-stop"))
                ctx.set_active_agent(billing)
                ctx.metadata["v"] = 2
                ctx.add_message(model(None, [call("lookup")]))
                raise _HardStop

        with pytest.raises(_HardStop):
            run(interrupted())
        assert ctx.active_agent.name == "Slow"
        self._assert_back_to_pre_turn(harness, store, ctx)

    # ------------------------------------------------- failed turns (6)

    def test_failed_runner_turn_discards_its_metadata_change(
        self, harness: StoreHarness, store: Any
    ) -> None:
        sid = new_id("meta")

        noted: list[str] = []

        async def note(amount: str) -> str:
            store.get(sid).metadata["v"] = 99
            noted.append(amount)
            return "noted"

        # ScriptedEngine: call the tool (named "refund"), then the model fails
        agent = Agent(name="Slow", instructions="", tools=[Tool(note, name="refund")])
        runner = Runner(starting_agent=agent, session_store=store, engine=ScriptedEngine())
        ctx = self._pre_turn(store, sid, agent)
        with pytest.raises(RuntimeError, match="scripted engine failure"):
            run(runner.run_async(sid, "refund 99 then fail"))
        assert noted == ["99"], "the tool changed the metadata before the model failed"
        self._assert_back_to_pre_turn(harness, store, ctx)

    @requires(Capability.SQL)
    def test_failed_end_of_turn_write_leaves_memory_equal_to_disk(
        self, harness: StoreHarness, store: Any
    ) -> None:
        sid = new_id("endfail")
        ctx = self._pre_turn(store, sid)
        _, billing = make_agents()

        async def turn_that_cannot_be_written() -> None:
            async with ctx.lock:
                ctx.add_message(user("q-unsaved"))
                ctx.set_active_agent(billing)
                ctx.metadata["box"] = {}
                ctx.metadata["box"]["bad"] = {1, 2}  # nested: only the write sees it
                ctx.add_message(model("a-unsaved"))

        with pytest.raises(ValueError):
            run(turn_that_cannot_be_written())
        # At once, without get_or_create: memory shows what the database holds.
        assert ctx.active_agent.name == "Slow"
        self._assert_back_to_pre_turn(harness, store, ctx)

    # ------------------------------------------- deleted and re-created (3)

    def _recreating_runner(self, store: Any, other: Any, sid: str) -> Runner:
        async def recreate(q: str) -> str:
            assert other.delete(sid) is True
            fresh = other.get_or_create(sid, Agent(name="Bot", instructions=""))
            fresh.add_message(user("new conversation"))
            return "recreated"

        agent = Agent(name="Bot", instructions="", tools=[Tool(recreate, name="recreate")])
        return Runner(starting_agent=agent, session_store=store, engine=OneToolEngine("recreate"))

    def _check_recreated(self, harness: StoreHarness, store: Any, old: Any, sid: str) -> None:
        with pytest.raises(SessionDeletedError):
            _ = old.history
        current = store.get_or_create(sid, Agent(name="Bot", instructions=""))
        assert current is not old
        assert contents(current.history) == ["new conversation"]
        if harness.has(Capability.PERSISTENT):
            assert contents(reload(harness, sid).history) == ["new conversation"]

    def test_session_recreated_by_the_same_store_mid_turn(self, store: Any) -> None:
        sid = new_id("recreate")
        runner = self._recreating_runner(store, store, sid)
        old = store.get_or_create(sid, runner.starting_agent)
        old.add_message(user("old secret 1"))
        with pytest.raises(SessionDeletedError):
            run(runner.run_async(sid, "old secret 2"))
        current = store.get(sid)
        assert current is not old
        assert contents(current.history) == ["new conversation"]

    @requires(Capability.PERSISTENT)
    def test_session_recreated_elsewhere_mid_turn_gets_nothing_of_the_old_turn(
        self, harness: StoreHarness, store: Any
    ) -> None:
        sid = new_id("recreate")
        other: Any = harness.open()
        runner = self._recreating_runner(store, other, sid)
        old = store.get_or_create(sid, runner.starting_agent)
        old.add_message(user("old secret 1"))
        old.add_message(model("ok"))
        with pytest.raises(SessionDeletedError):
            run(runner.run_async(sid, "old secret 2"))
        self._check_recreated(harness, store, old, sid)

    @requires(Capability.PERSISTENT)
    def test_session_recreated_elsewhere_before_a_direct_write(
        self, harness: StoreHarness, store: Any
    ) -> None:
        sid = new_id("recreate")
        old = store.get_or_create(sid, Agent(name="Bot", instructions=""))
        old.add_message(user("old secret 1"))
        other: Any = harness.open()
        assert other.delete(sid) is True
        other.get_or_create(sid, Agent(name="Bot", instructions="")).add_message(
            user("new conversation")
        )
        with pytest.raises(SessionDeletedError):
            old.add_message(user("old secret 2"))
        self._check_recreated(harness, store, old, sid)

    # ------------------------------------------------ clear wins (4)

    @requires(Capability.PERSISTENT)
    def test_clear_in_a_turn_wins_over_a_concurrent_writer(
        self, harness: StoreHarness, store: Any
    ) -> None:
        sid = new_id("clear")
        ctx = store.get_or_create(sid, Agent(name="Bot", instructions=""))
        for message in [system("sys"), user("private 1"), model("private answer")]:
            ctx.add_message(message)
        other: Any = harness.open()

        async def reset_turn() -> None:
            async with ctx.lock:
                ctx.add_message(user("/reset - forget everything"))
                ctx.clear_history()
                # Another process writes before this turn commits.
                other.get(sid).add_message(user("private 2, written meanwhile"))
                ctx.add_message(user("hello again"))
                ctx.add_message(model("hi"))

        run(reset_turn())
        assert contents(ctx.history) == ["hello again", "hi"]
        assert contents(reload(harness, sid).history) == ["hello again", "hi"]
        ctx.add_message(user("next"))
        assert contents(reload(harness, sid).history) == ["hello again", "hi", "next"]

    @requires(Capability.PERSISTENT)
    def test_direct_clear_wins_over_a_concurrent_writer(
        self, harness: StoreHarness, store: Any
    ) -> None:
        sid = new_id("clear")
        ctx = store.get_or_create(sid, Agent(name="Bot", instructions=""))
        ctx.add_message(user("private 1"))
        ctx.add_message(model("private answer"))
        other: Any = harness.open()
        other.get(sid).add_message(user("private 2"))
        ctx.clear_history()
        assert ctx.history == []
        assert reload(harness, sid).history == []

    @requires(Capability.PERSISTENT)
    def test_replaced_history_is_not_merged_with_a_concurrent_writer(
        self, harness: StoreHarness, store: Any
    ) -> None:
        sid = new_id("replace")
        ctx = store.get_or_create(sid, Agent(name="Bot", instructions=""))
        for text in ["u1", "u2", "u3"]:
            ctx.add_message(user(text))
        other: Any = harness.open()
        other.get(sid).add_message(user("meanwhile"))
        ctx.history = ctx.history[:1]
        assert contents(ctx.history) == ["u1"]
        assert contents(reload(harness, sid).history) == ["u1"]

    # ------------------------------------ unanswered tool calls (5)

    @requires(Capability.PERSISTENT)
    def test_live_writer_keeps_its_call_when_another_writer_appends(
        self, harness: StoreHarness
    ) -> None:
        # A writes a tool call and runs the tool; B loads (the call is hidden),
        # runs a whole turn of its own (its write drops the hidden call). A's
        # result then lands right after its call: nothing lost, nothing dangling.
        writer: Any = harness.open()
        sid = new_id("live")
        ctx = writer.get_or_create(sid, Agent(name="Bot", instructions=""))
        pending = call("lookup", q="slow")
        ctx.add_message(user("u1"))
        ctx.add_message(model(None, [pending]))
        other: Any = harness.open()
        seen = other.get(sid)
        assert contents(seen.history) == ["u1"]

        async def other_turn() -> None:
            async with seen.lock:
                seen.add_message(user("u2"))
                seen.add_message(model("m2"))

        run(other_turn())
        assert contents(reload(harness, sid).history) == ["u1", "u2", "m2"]
        ctx.add_message(tool_result(pending, {"ok": True}))
        ctx.add_message(model("m1"))
        final = reload(harness, sid).history
        assert_well_formed(final)
        assert contents(final) == ["u1", "u2", "m2", None, None, "m1"]
        assert dump(ctx.history) == dump(final)


# ================================================= exact round trips (issue 13)


def _same_json_values(a: Any, b: Any) -> bool:
    """Equal, with the same types at every level (``1.0`` is not ``1``), NaN equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and str(a) == str(b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_json_values(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same_json_values, a, b))
    return bool(a == b)


class TestExactRoundTrip(StoreTestBase):
    """What a store accepts reads back exactly; what it cannot keep is refused up front."""

    AWKWARD_FLOATS: dict[str, Any] = {
        "big": 4.417402109863705e16,
        "huge": 1e300,
        "negative": -1e22,
        "tiny": 5e-324,
        "plain": 1234.0,
        "int": 2**70,
        "nested": [1e16, {"x": 2.5e17, "y": 7}],
    }

    def test_dedup_ttl_out_of_range_refused_at_construction(self, harness: StoreHarness) -> None:
        for bad in (1e8, float("inf"), float("nan"), -float("inf"), 10**400, 876_001):
            with pytest.raises(ValueError, match="dedup_ttl_hours") as info:
                harness.open(dedup_ttl_hours=bad)
            assert "876000" in str(info.value), "the error must give the allowed range"
        longest: Any = harness.open(dedup_ttl_hours=876_000)
        try:
            message_id = new_id("m")
            assert longest.record_processed_message(message_id)
            assert longest.is_message_processed(message_id)
            assert longest.purge_processed_messages() == 0
        finally:
            longest.close()

    def test_metadata_floats_keep_their_type(self, harness: StoreHarness, store: Any) -> None:
        sid = new_id()
        ctx = store.get_or_create(sid, Agent(name="Bot", instructions=""), self.AWKWARD_FLOATS)
        ctx.metadata["later"] = 9.007199254740993e18
        ctx.add_message(user("hi"))
        expected = {**self.AWKWARD_FLOATS, "later": 9.007199254740993e18}
        assert _same_json_values(dict(ctx.metadata), expected)
        if harness.has(Capability.PERSISTENT):
            again = reload(harness, sid).metadata
            assert _same_json_values(dict(again), expected), f"reloaded as {again!r}"

    def test_metadata_a_store_cannot_keep_is_refused(self, store: Any) -> None:
        agent = Agent(name="Bot", instructions="")
        for bad in ({"x": float("nan")}, {"x": [float("inf")]}, {"x": "a\x00b"}, {"a\x00": 1}):
            with pytest.raises(ValueError):
                store.get_or_create(new_id(), agent, metadata=bad)
        ctx = store.get_or_create(new_id(), agent, metadata={"ok": 1})
        for key, value in (("x", float("-inf")), ("y", {"z": "\x00"})):
            with pytest.raises(ValueError):
                ctx.metadata[key] = value
        with pytest.raises(ValueError, match="NUL"):
            ctx.metadata = {"k": "\x00"}
        assert ctx.metadata == {"ok": 1}
        assert store.list_sessions() == [ctx.session_id]
        # An escaped backslash followed by "u0000" is ordinary text.
        ctx.metadata["path"] = "C:\\u0000"
        assert ctx.metadata["path"] == "C:\\u0000"

    def test_metadata_with_a_lone_surrogate_is_refused_everywhere(self, store: Any) -> None:
        """Not UTF-8 text: PostgreSQL's ``jsonb`` rejects it with a raw driver error."""
        agent = Agent(name="Bot", instructions="")
        for bad in ({"x": "a\ud800"}, {"\udc00": 1}, {"x": ["\udbff\udbff"]}):
            with pytest.raises(ValueError, match="surrogate"):
                store.get_or_create(new_id(), agent, metadata=bad)
        ctx = store.get_or_create(new_id(), agent, metadata={"emoji": "\U0001f600"})
        with pytest.raises(ValueError, match="surrogate"):
            ctx.metadata["y"] = "\ud83d"
        assert ctx.metadata == {"emoji": "\U0001f600"}
        assert store.list_sessions() == [ctx.session_id]

    def test_nan_and_infinity_in_tool_calls_round_trip(
        self, harness: StoreHarness, store: Any
    ) -> None:
        sid = new_id()
        ctx = store.get_or_create(sid, Agent(name="Bot", instructions=""))
        lookup = call("stats", mean=float("nan"), hi=float("inf"), lo=float("-inf"), n=3)
        ctx.add_message(user("stats please"))
        ctx.add_message(model(calls=[lookup]))
        ctx.add_message(tool_result(lookup, {"values": [1.5, float("nan")], "big": 1e300}))
        if not harness.has(Capability.PERSISTENT):
            return
        history = reload(harness, sid).history
        args = history[1].tool_calls[0].args  # type: ignore[index]
        assert _same_json_values(args, lookup.args), f"reloaded as {args!r}"
        content = history[2].tool_results[0].content  # type: ignore[index]
        assert _same_json_values(content, {"values": [1.5, float("nan")], "big": 1e300})

    def test_ids_with_nul_are_refused_up_front(self, store: Any) -> None:
        agent = Agent(name="Bot", instructions="")
        with pytest.raises(ValueError, match="NUL"):
            store.get_or_create("s\x00", agent)
        for method in (
            store.record_processed_message,
            store.is_message_processed,
            store.mark_message_processed,
        ):
            with pytest.raises(ValueError, match="NUL"):
                method("wamid\x00")
        assert store.list_sessions() == []

    def test_nul_in_user_text_is_stored(self, harness: StoreHarness, store: Any) -> None:
        sid = new_id()
        ctx = store.get_or_create(sid, Agent(name="Bot", instructions=""))
        ctx.add_message(user("outside\x00a turn"))
        ctx.add_message(model("ok"))

        async def turn() -> None:
            async with ctx.lock:
                ctx.add_message(user("inside\x00a turn \x00"))
                probe = call("echo", text="\x00")
                ctx.add_message(model("\x00", calls=[probe]))
                ctx.add_message(tool_result(probe, "\x00\x00"))
                ctx.add_message(model("done"))

        run(turn())
        assert contents(ctx.history)[:3] == ["outside\x00a turn", "ok", "inside\x00a turn \x00"]
        assert_reloads_identically(harness, ctx)


class TestCorruptSessionRows(StoreTestBase):
    """A session row whose metadata cannot be decoded is a CorruptRowError naming it."""

    def _set_raw_metadata(self, store: Any, sid: str, raw: str) -> None:
        from sqlalchemy import exc, text

        try:
            with store.engine.begin() as conn:
                conn.execute(
                    text("UPDATE chatflow_sessions SET metadata_json = :bad WHERE session_id = :s"),
                    {"bad": raw, "s": sid},
                )
        except exc.DBAPIError as error:
            reason = str(error.orig).splitlines()[0]
            pytest.skip(f"the database validates JSON on write: {reason}")

    @requires(Capability.SQL, Capability.PERSISTENT)
    def test_undecodable_metadata_is_named(self, harness: StoreHarness, store: Any) -> None:
        from chatflow_sqlalchemy import CorruptRowError

        sid = new_id()
        store.get_or_create(sid, Agent(name="Bot", instructions=""), {"a": 1})
        self._set_raw_metadata(store, sid, '{"a": 1,')
        fresh: Any = harness.open()
        with pytest.raises(CorruptRowError) as info:
            fresh.get(sid)
        message = str(info.value)
        assert sid in message and "chatflow_sessions" in message and "metadata_json" in message
        assert info.value.session_id == sid

    @requires(Capability.SQL, Capability.PERSISTENT)
    def test_metadata_that_is_not_an_object_is_named(
        self, harness: StoreHarness, store: Any
    ) -> None:
        from chatflow_sqlalchemy import CorruptRowError

        sid = new_id()
        store.get_or_create(sid, Agent(name="Bot", instructions=""))
        self._set_raw_metadata(store, sid, "[1, 2]")
        fresh: Any = harness.open()
        with pytest.raises(CorruptRowError) as info:
            fresh.get(sid)
        message = str(info.value)
        assert "chatflow_sessions" in message and "chatflow_messages" not in message
        assert sid in message and "id -" not in message and "not a JSON object" in message


# ========================================================= webhook claims


def _claims_runner(store: Any, engine: BaseEngine | None = None) -> Runner:
    bot = Agent(name="Bot", instructions="")
    return Runner(starting_agent=bot, session_store=store, engine=engine or ReplyModel())


async def _on_webhook(
    store: Any, runner: Runner, session_id: str, message_id: str, text: str, prepare: float = 0.0
) -> tuple[str, str | None]:
    """DESIGN.md's webhook handler; returns ``(status, reply)``.

    ``prepare``: seconds of work before the turn (fetching media, say), so a
    later delivery could overtake an earlier one if claims did not order them.
    """
    async with store.claim(message_id, session_id=session_id) as claim:
        if not claim.acquired:
            return claim.status, claim.response
        await asyncio.sleep(prepare)
        result = await runner.run_async(session_id=session_id, user_message=text)
        claim.response = result.content
        return claim.status, result.content


def _user_texts(history: Sequence[Message]) -> list[str | None]:
    return [m.content for m in history if m.role == Role.USER]


def _assert_each_once_in_order(history: Sequence[Message], texts: Sequence[str]) -> None:
    assert_turn_shaped(history)
    got = _user_texts(history)
    assert sorted(map(str, got)) == sorted(texts), (
        f"doubled: {[t for t, n in Counter(got).items() if n > 1]}, "
        f"lost: {[t for t in texts if t not in got]}"
    )
    assert got == list(texts), f"stored out of webhook order: {got}"
    for index, message in enumerate(history):
        if message.role == Role.USER:
            assert history[index + 1].content == reply_to(message.content or "")


class TestWebhookClaims(StoreTestBase):
    """DESIGN "Webhook claims" in one process: statuses, release, fencing, replies, order."""

    def test_first_delivery_acquires_and_later_ones_read_the_reply(self, store: Any) -> None:
        sid, mid = new_id(), new_id("wamid")
        runner = _claims_runner(store)
        assert run(_on_webhook(store, runner, sid, mid, "hello")) == (
            "acquired", reply_to("hello")
        )
        assert run(_on_webhook(store, runner, sid, mid, "hello")) == ("done", reply_to("hello"))
        with store.claim(mid, session_id=sid) as claim:  # the sync form reads it too
            assert (claim.acquired, claim.status, claim.response) == (
                False, "done", reply_to("hello")
            )
        assert _user_texts(store.get(sid).history) == ["hello"]

    def test_a_turns_reply_is_stored_with_its_commit(self, store: Any) -> None:
        """The turn's write stores its reply with the claim; the block's own reply wins.

        A redelivery between the turn's commit and the block's exit (the
        worker died before sending, say) reads the reply already. A block that
        stores another reply, or none, has it stored as it says.
        """
        sid, runner = new_id(), _claims_runner(store)

        async def redelivered(mid: str) -> tuple[str, str | None]:
            async with store.claim(mid, session_id=sid) as again:
                return again.status, again.response

        async def handle(mid: str, text: str, reply: str | None) -> tuple[str, str | None]:
            async with store.claim(mid, session_id=sid) as claim:
                assert claim.acquired
                result = await runner.run_async(session_id=sid, user_message=text)
                assert result.content == reply_to(text)
                seen = await asyncio.create_task(redelivered(mid))
                claim.response = result.content if reply == "same" else reply
            return seen

        ids = {kind: new_id("wamid") for kind in ("same", "other", "none")}
        for kind, reply in (("same", "same"), ("other", "sent: formatted"), ("none", None)):
            assert run(handle(ids[kind], kind, reply)) == ("done", reply_to(kind))
        assert run(redelivered(ids["same"])) == ("done", reply_to("same"))
        assert run(redelivered(ids["other"])) == ("done", "sent: formatted")
        assert run(redelivered(ids["none"])) == ("done", None)

    def test_sync_with_acquires_and_stores_the_reply(self, store: Any) -> None:
        mid = new_id("wamid")
        with store.claim(mid) as claim:
            assert (claim.acquired, claim.status, claim.response) == (True, "acquired", None)
            claim.response = "sent"
        with store.claim(mid) as again:
            assert (again.acquired, again.status, again.response) == (False, "done", "sent")

    def test_sync_runner_turn_inside_sync_claim_is_fenced(self, store: Any) -> None:
        """``with store.claim(...)`` and ``Runner.run``: the claim reaches the turn's commit."""
        sid, kept, lost = new_id(), new_id("wamid"), new_id("wamid")
        runner = _claims_runner(store)
        with store.claim(kept, session_id=sid) as claim:
            claim.response = runner.run(sid, "kept").content
        assert release_claim(store, kept) is False  # done, nothing held

        def redeliver() -> None:  # another worker's thread takes the freed id
            with store.claim(lost, session_id=sid) as thief:
                assert thief.acquired

        with pytest.raises(ClaimLostError), store.claim(lost, session_id=sid) as claim:
            assert release_claim(store, lost) is True
            worker = threading.Thread(target=redeliver)
            worker.start()
            worker.join(60)
            runner.run(sid, "lost")
        _assert_each_once_in_order(store.get(sid).history, ["kept"])

    def test_lease_is_renewed_while_the_block_runs(self, store: Any) -> None:
        """Blocks (async and sync) outlasting their lease keep it: no redelivery takes it."""
        slow_async, slow_sync = new_id("wamid"), new_id("wamid")
        seen: list[str] = []

        def probe(mid: str) -> None:
            with store.claim(mid) as redelivery:
                seen.append(redelivery.status)

        def sync_block() -> None:
            with store.claim(slow_sync, lease_seconds=1.5) as claim:
                assert claim.acquired
                for _ in range(8):
                    time.sleep(0.5)
                    probe(slow_sync)
                claim.response = "sync done"

        async def async_block() -> None:
            async with store.claim(slow_async, lease_seconds=1.5) as claim:
                assert claim.acquired
                for _ in range(8):
                    await asyncio.sleep(0.5)
                    await asyncio.to_thread(probe, slow_async)
                claim.response = "async done"

        async def both() -> None:
            await asyncio.gather(async_block(), asyncio.to_thread(sync_block))

        run(both())
        assert set(seen) == {"in_flight"}, seen
        for mid, reply in ((slow_async, "async done"), (slow_sync, "sync done")):
            with store.claim(mid) as later:
                assert (later.status, later.response) == ("done", reply)

    def test_in_flight_while_another_delivery_holds_it(self, store: Any) -> None:
        mid = new_id("wamid")

        async def scenario() -> tuple[bool, str, str | None]:
            async with store.claim(mid) as held:
                assert held.acquired
                async with store.claim(mid) as other:
                    return other.acquired, other.status, other.response

        assert run(scenario()) == (False, "in_flight", None)

    def test_failed_turn_is_released_and_the_retry_processes_it_once(self, store: Any) -> None:
        sid, mid = new_id(), new_id("wamid")
        runner = _claims_runner(store, ReplyModel(failures=1))
        with pytest.raises(RuntimeError, match="provider is down"):
            run(_on_webhook(store, runner, sid, mid, "where is my order?"))
        assert store.record_processed_message(mid) is False  # still a known id
        assert run(_on_webhook(store, runner, sid, mid, "where is my order?"))[0] == "acquired"
        assert run(_on_webhook(store, runner, sid, mid, "where is my order?"))[0] == "done"
        _assert_each_once_in_order(store.get(sid).history, ["where is my order?"])

    def test_ids_recorded_with_record_processed_message_are_done(self, store: Any) -> None:
        old, new = new_id("wamid"), new_id("wamid")
        assert store.record_processed_message(old) is True
        with store.claim(old) as claim:
            assert (claim.acquired, claim.status, claim.response) == (False, "done", None)
        with store.claim(new) as claim:
            assert claim.acquired
        assert store.record_processed_message(new) is False
        assert store.is_message_processed(new) is True

    def test_turn_of_a_claim_taken_over_writes_nothing(
        self, harness: StoreHarness, store: Any
    ) -> None:
        sid, mid = new_id(), new_id("wamid")
        runner = _claims_runner(store)
        run(_on_webhook(store, runner, sid, new_id("wamid"), "first"))
        ctx = store.get(sid)

        async def redelivery() -> bool:  # another handler: its own task and context
            async with store.claim(mid, session_id=sid) as thief:
                return bool(thief.acquired)

        async def scenario() -> None:
            async with store.claim(mid, session_id=sid) as claim:
                assert claim.acquired
                assert release_claim(store, mid) is True  # an operator frees it...
                assert await asyncio.create_task(redelivery())  # ...and it is taken again
                async with ctx.lock:
                    ctx.add_message(user("lost turn"))
                    ctx.add_message(model("lost answer"))

        with pytest.raises(ClaimLostError) as lost:
            run(scenario())
        assert mid in str(lost.value)
        assert isinstance(lost.value, ChatflowStoreError)
        assert _user_texts(store.get(sid).history) == ["first"], "memory kept a refused turn"
        if harness.has(Capability.PERSISTENT):
            assert _user_texts(reload(harness, sid).history) == ["first"]

    def test_claim_whose_turn_committed_stays_done_when_the_block_fails(
        self, store: Any
    ) -> None:
        sid, mid = new_id(), new_id("wamid")
        runner = _claims_runner(store)

        async def reply_then_fail_to_send() -> None:
            async with store.claim(mid, session_id=sid) as claim:
                result = await runner.run_async(session_id=sid, user_message="hi")
                claim.response = result.content
                raise ConnectionError("the platform's send API is down")

        with pytest.raises(ConnectionError):
            run(reply_then_fail_to_send())
        assert run(_on_webhook(store, runner, sid, mid, "hi")) == ("done", reply_to("hi"))
        _assert_each_once_in_order(store.get(sid).history, ["hi"])

    def test_operator_lists_and_releases_claims(self, store: Any) -> None:
        done, held = new_id("wamid"), new_id("wamid")
        with store.claim(done, session_id="op") as claim:
            claim.response = "ok"

        async def scenario() -> None:
            async with store.claim(held, session_id="op") as claim:
                states = {info.message_id: info for info in list_claims(store)}
                assert states[done].state == "done" and states[done].has_response
                assert states[held].state == "in_flight"
                lease_age = states[held].lease_age
                assert lease_age is not None and lease_age >= 0
                assert states[held].session_id == "op"
                assert release_claim(store, held) is True
                assert release_claim(store, held) is False  # nothing held any more
                assert release_claim(store, done) is False
                assert {i.message_id: i.state for i in list_claims(store)}[held] == "released"
                with store.claim(held) as retry:
                    assert retry.acquired
                claim.response = "too late"

        with pytest.raises(ClaimLostError):
            run(scenario())

    def test_invalid_arguments_are_refused(self, store: Any) -> None:
        for lease in (0, -1.0, "60", True, None, float("nan"), float("inf"), 1e12):
            with pytest.raises(ValueError, match="lease_seconds"):
                store.claim(new_id("wamid"), lease_seconds=lease)
        for bad_id in ("", None, 7):
            with pytest.raises(ValueError):
                store.claim(bad_id)
        with pytest.raises(ValueError):
            store.claim(new_id("wamid"), session_id="")

    def test_concurrent_deliveries_in_one_process_run_in_order(self, store: Any) -> None:
        sid = new_id()
        texts = [f"message {k:02d}" for k in range(16)]
        ids = [new_id("wamid") for _ in texts]
        runner = _claims_runner(store, ReplyModel(latency=0.01, seed=7))
        rng = random.Random(11)

        async def platform_worker() -> None:  # every worker receives every delivery
            for mid, text in zip(ids, texts, strict=True):
                await _on_webhook(store, runner, sid, mid, text, prepare=rng.uniform(0, 0.02))
                await asyncio.sleep(0.002)

        async def scenario() -> None:
            await asyncio.gather(*(platform_worker() for _ in range(3)))

        run(scenario())
        _assert_each_once_in_order(store.get(sid).history, texts)


def _take_over(
    store: Any, runner: Runner, session_id: str, message_id: str, text: str,
    before_turn: Callable[[], None] = lambda: None,
) -> str | None:
    """Redeliver until the claim is acquired (after the old lease), then run the turn."""

    async def attempt() -> tuple[bool, str | None]:
        async with store.claim(message_id, session_id=session_id) as claim:
            if not claim.acquired:
                assert claim.status == "in_flight", "the dead worker's claim is not done"
                return False, None
            before_turn()
            result = await runner.run_async(session_id=session_id, user_message=text)
            claim.response = result.content
            return True, result.content

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        acquired, reply = run(attempt())
        if acquired:
            return reply
        time.sleep(0.1)
    raise AssertionError(f"claim {message_id!r} was never taken over")


class TestWebhookClaimsAcrossProcesses(StoreTestBase):
    """DESIGN "Webhook claims" across real worker processes (killed, stopped, racing)."""

    @requires(Capability.CROSS_PROCESS, Capability.PERSISTENT)
    def test_failed_turn_released_and_retried_in_another_process(
        self, harness: StoreHarness
    ) -> None:
        sid, mid = new_id(), new_id("wamid")
        failing = start_worker(harness.spec(), sid, [(mid, "hello")], mode="fail")
        try:
            assert failing.result() == [(mid, "error", None, "RuntimeError")]
        finally:
            failing.stop()
        retry = start_worker(harness.spec(), sid, [(mid, "hello"), (mid, "hello")])
        try:
            assert retry.result() == [
                (mid, "acquired", reply_to("hello"), None),
                (mid, "done", reply_to("hello"), None),
            ]
        finally:
            retry.stop()
        _assert_each_once_in_order(reload(harness, sid).history, ["hello"])

    @requires(Capability.CROSS_PROCESS, Capability.PERSISTENT)
    def test_sigkilled_worker_claim_is_taken_over_after_its_lease(
        self, harness: StoreHarness
    ) -> None:
        sid, mid = new_id(), new_id("wamid")
        spec = harness.spec()  # the session's turn lease, taken with the claim, lapses soon too
        spec = replace(spec, kwargs={**spec.kwargs, "turn_lease_seconds": 1.0})
        worker = start_worker(spec, sid, [(mid, "hello")], mode="hang", lease_seconds=1)
        try:
            assert worker.next_event()[0] == "ready"  # inside the turn, claim held
            os.kill(worker.pid, signal.SIGKILL)
            worker.process.join(30)
        finally:
            worker.stop()
        store: Any = harness.open()
        assert {i.message_id: i.state for i in list_claims(store)}[mid] in ("in_flight", "expired")
        assert _take_over(store, _claims_runner(store), sid, mid, "hello") == reply_to("hello")
        _assert_each_once_in_order(reload(harness, sid).history, ["hello"])

    @requires(Capability.CROSS_PROCESS, Capability.PERSISTENT)
    def test_sigstopped_worker_is_fenced_after_its_claim_was_taken_over(
        self, harness: StoreHarness
    ) -> None:
        sid, mid = new_id(), new_id("wamid")
        worker = start_worker(
            harness.spec(), sid, [(mid, "hello")], mode="pause", lease_seconds=1, latency=0.2
        )
        stopped = False
        try:
            assert worker.next_event()[0] == "ready"  # inside the turn, claim held
            os.kill(worker.pid, signal.SIGSTOP)
            stopped = True
            store: Any = harness.open()

            def wake_the_old_holder() -> None:  # it resumes while we hold the claim
                os.kill(worker.pid, signal.SIGCONT)

            reply = _take_over(
                store, _claims_runner(store), sid, mid, "hello", before_turn=wake_the_old_holder
            )
            stopped = False
            assert reply == reply_to("hello")
            assert worker.result() == [(mid, "error", None, "ClaimLostError")]
        finally:
            if stopped:
                os.kill(worker.pid, signal.SIGCONT)
            worker.stop()
        _assert_each_once_in_order(reload(harness, sid).history, ["hello"])

    @requires(Capability.CROSS_PROCESS, Capability.PERSISTENT)
    @pytest.mark.parametrize("n_processes", [2, 4])
    def test_burst_delivered_to_every_process_is_stored_once_in_order(
        self, harness: StoreHarness, n_processes: int
    ) -> None:
        sid = new_id()
        texts = [f"message {k:02d}" for k in range(16)]
        deliveries = [(new_id("wamid"), text) for text in texts]
        workers = [
            start_worker(harness.spec(), sid, deliveries, latency=0.02)
            for _ in range(n_processes)
        ]
        try:
            outcomes = [outcome for worker in workers for outcome in worker.result()]
        finally:
            for worker in workers:
                worker.stop()
        errors = [outcome for outcome in outcomes if outcome[1] == "error"]
        assert not errors, errors
        acquired = Counter(mid for mid, status, _reply, _error in outcomes if status == "acquired")
        assert acquired == Counter(mid for mid, _text in deliveries), acquired
        _assert_each_once_in_order(reload(harness, sid).history, texts)

    @requires(Capability.CROSS_PROCESS, Capability.PERSISTENT)
    def test_reply_is_replayed_after_a_restart(self, harness: StoreHarness) -> None:
        sid, mid = new_id(), new_id("wamid")
        first = start_worker(harness.spec(), sid, [(mid, "hello")])
        try:
            assert first.result() == [(mid, "acquired", reply_to("hello"), None)]
        finally:
            first.stop()
        fresh: Any = harness.open()
        with fresh.claim(mid, session_id=sid) as claim:
            assert (claim.acquired, claim.status, claim.response) == (
                False, "done", reply_to("hello")
            )
        again = start_worker(harness.spec(), sid, [(mid, "hello")])
        try:
            assert again.result() == [(mid, "done", reply_to("hello"), None)]
        finally:
            again.stop()


# ================================================ lifecycle and data governance


class TestUserScope(UserScopeTests, StoreTestBase):
    """Per-user scope, ``list_sessions`` filters and keyset pages (see ``lifecycle_suite``)."""


class TestErasureAndExport(ErasureAndExportTests, StoreTestBase):
    """``erase_user`` / ``export_user`` (see ``lifecycle_suite``)."""


class TestRetention(RetentionTests, StoreTestBase):
    """``session_ttl_hours`` and ``sweep()`` (see ``lifecycle_suite``)."""


class TestArchive(ArchiveTests, StoreTestBase):
    """``archive_pruned`` and ``transcript()`` (see ``lifecycle_suite``)."""


class TestEncryption(EncryptionTests, StoreTestBase):
    """``cipher=``, ``require_encryption=``, ``rotate_keys`` (see ``lifecycle_suite``)."""


class TestFailedFirstTurn(FailedFirstTurnTests, StoreTestBase):
    """A failed first turn leaves no empty session behind (see ``first_turn_suite``)."""


class TestForks(ForkTests, StoreTestBase):
    """``store.fork`` / ``afork`` and ``list_sessions(forked_from=)`` (see ``forks_suite``)."""


# ========================================================== durable inbox


class TestInbox(InboxTests, StoreTestBase):
    """``store.inbox`` in one process (see ``inbox_suite``)."""


class TestInboxAcrossProcesses(InboxAcrossProcessesTests, StoreTestBase):
    """Inbox workers killed in other processes (see ``inbox_suite``)."""


# ===================================================== summaries and rewind


class TestSummaries(SummaryTests, StoreTestBase):
    """``summarizer=``, ``ctx.summary`` and ``wait_for_summaries`` (see ``history_suite``)."""


class TestSummariesAcrossProcesses(SummariesAcrossProcessesTests, StoreTestBase):
    """Summaries of one session made by several processes (see ``history_suite``)."""


class TestRewind(RewindTests, StoreTestBase):
    """``ctx.rewind`` / ``arewind`` (see ``history_suite``)."""


__all__ += ["TestRewind", "TestSummaries", "TestSummariesAcrossProcesses"]


# ========================================================== lease clocks

_SKEW = 3600.0
"""How far a skewed worker's clock is off: far more than any lease in these tests."""


def _skew_wall_clock(seconds: float) -> None:
    """Move this process's wall clock, as chatflow-sqlalchemy reads it, by ``seconds``.

    Every wall-clock read of the package goes through ``values.utcnow``;
    each module that imported it gets the skewed one.
    """
    import sys
    from datetime import timedelta

    from chatflow_sqlalchemy import values

    real = values.utcnow
    shift = timedelta(seconds=seconds)

    def skewed() -> Any:
        return real() + shift

    for name, module in list(sys.modules.items()):
        if name.startswith("chatflow_sqlalchemy") and getattr(module, "utcnow", None) is real:
            setattr(module, "utcnow", skewed)  # noqa: B010 - a module attribute, by name


def _skewed_claim_worker(
    spec: Any, message_id: str, session_id: str, skew: float, phase: str,
    lease_seconds: float, barrier: Any, results: Any,
) -> None:
    """Claim ``message_id`` on a clock ``skew`` seconds off, report the status, die holding it.

    ``phase`` says when the clock is off: ``"acquire"`` (from the start) or
    ``"renew"`` (the claim is taken on a true clock, then renewed once on the
    skewed one). The process ends without leaving the block, as a crashed
    worker would: an acquired claim stays held under the lease it stored.
    """
    store: Any = spec.open()
    if phase == "acquire":
        _skew_wall_clock(skew)
    claim = store.claim(message_id, session_id=session_id, lease_seconds=lease_seconds)
    claim.__enter__()
    status = claim.status
    if phase == "renew" and claim.acquired:
        _skew_wall_clock(skew)
        status = "renewed" if claim._backend.renew(claim) else "lost"
    results.put(status)
    results.close()
    results.join_thread()  # the status is on its way before the process ends
    os._exit(0)


@requires(Capability.CROSS_PROCESS, Capability.PERSISTENT)
class TestLeaseClock(StoreTestBase):
    """Claim leases run on the database's clock, never a worker's (DESIGN "Webhook claims").

    A worker whose clock is off neither takes over a live claim nor stores a
    lease longer or shorter than ``lease_seconds`` of the database's time.
    """

    @staticmethod
    def _skewed(
        harness: StoreHarness, mid: str, sid: str, skew: float, phase: str = "acquire",
        lease_seconds: float = 60.0,
    ) -> str:
        args = (harness.spec(), mid, sid, skew, phase, lease_seconds)
        [status] = run_workers(_skewed_claim_worker, [args])
        return str(status)

    def test_a_worker_whose_clock_runs_ahead_does_not_take_over_a_live_claim(
        self, harness: StoreHarness, store: Any
    ) -> None:
        sid, mid = new_id(), new_id("wamid")
        with store.claim(mid, session_id=sid) as held:
            assert held.acquired
            assert self._skewed(harness, mid, sid, _SKEW) == "in_flight"
            held.response = "the holder's reply"
        with store.claim(mid, session_id=sid) as later:
            assert (later.status, later.response) == ("done", "the holder's reply")

    @pytest.mark.parametrize("phase", ["acquire", "renew"])
    @pytest.mark.parametrize("skew", [_SKEW, -_SKEW], ids=["ahead", "behind"])
    def test_a_lease_lasts_lease_seconds_of_database_time_whatever_the_workers_clock(
        self, harness: StoreHarness, store: Any, skew: float, phase: str
    ) -> None:
        sid, mid = new_id(), new_id("wamid")
        assert self._skewed(harness, mid, sid, skew, phase) in ("acquired", "renewed")
        info = {i.message_id: i for i in list_claims(store)}[mid]
        assert info.state == "in_flight"
        assert info.lease_left is not None and 0 < info.lease_left <= 60.0, info
        with store.claim(mid, session_id=sid) as rival:  # a true clock: the lease holds
            assert (rival.acquired, rival.status) == (False, "in_flight")

    @requires(Capability.SQL)
    def test_a_lease_ends_lease_seconds_after_its_claim_on_one_clock(self, store: Any) -> None:
        """The claim's start and its lease's end are read from one clock in one statement."""
        from datetime import timedelta

        from sqlalchemy import select

        from chatflow_sqlalchemy.models import ChatflowProcessedMessage as Row

        mid = new_id("wamid")
        with store.claim(mid, lease_seconds=42.5) as claim:
            assert claim.acquired
            with store.engine.connect() as conn:
                query = select(Row.claimed_at, Row.lease_expires_at).where(Row.message_id == mid)
                claimed_at, lease_end = conn.execute(query).one()
        assert lease_end - claimed_at == timedelta(seconds=42.5)

    def test_a_dead_worker_whose_clock_ran_ahead_is_taken_over_one_lease_later(
        self, harness: StoreHarness, store: Any
    ) -> None:
        sid, mid = new_id(), new_id("wamid")
        assert self._skewed(harness, mid, sid, _SKEW, lease_seconds=1.0) == "acquired"
        deadline = time.monotonic() + 60  # far beyond the 1 s lease, far below the skew
        while time.monotonic() < deadline:
            with store.claim(mid, session_id=sid) as claim:
                if claim.acquired:
                    claim.response = "taken over"
                    break
                assert claim.status == "in_flight"
            time.sleep(0.1)
        else:
            raise AssertionError(f"claim {mid!r} was not taken over after its lease lapsed")
        with store.claim(mid) as later:
            assert (later.status, later.response) == ("done", "taken over")


__all__ += ["TestLeaseClock"]
