"""The standing fault suite: a hypothesis state machine over context operations.

One session, two store instances on the same database (think: two worker
processes). Store A runs the operations users run: direct ``add_message``
(tool call then its result), ``set_active_agent``, ``clear_history``,
metadata changes, and Runner-style turns inside ``session.lock`` that
commit, fail midway (rolled back, re-raised), are cancelled, end by a
``BaseException`` or whose end-of-turn write fails. Store B writes between
A's operations and in the middle of A's turns. After every step:

* a fresh store's reload equals the reference model (history, active agent,
  metadata), and never ends on an unanswered tool call;
* A's memory equals what the model says A must show.

The quick slice runs in ``make test``. The long campaign (and the kill -9
campaigns of ``test_processes.py``) runs with ``python -m tests.campaign``;
``CHATFLOW_CAMPAIGN_EXAMPLES`` sets the examples per database here.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Role, ToolCall, ToolResult

from chatflow_sqlalchemy import SessionDeletedError

pytest.importorskip("hypothesis", reason="hypothesis is not installed (the dev extra has it)")

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

MAX_TURNS = 4
LONG = os.environ.get("CHATFLOW_CAMPAIGN") == "long"
EXAMPLES = int(os.environ.get("CHATFLOW_CAMPAIGN_EXAMPLES", "8"))
STEPS = int(os.environ.get("CHATFLOW_CAMPAIGN_STEPS", "25"))

Tag = tuple[str, str]
"""A message as the model sees it: (kind, label); kind is user/model/system/call/tool."""

COUNTS: Counter[str] = Counter()
"""What the campaign did (read by ``tests/campaign.py``)."""


class HardStop(BaseException):
    """Stands for KeyboardInterrupt: not an Exception, so only session.lock sees it."""


# ------------------------------------------------------------------ model


def to_message(tag: Tag) -> Message:
    kind, label = tag
    if kind == "user":
        return Message(role=Role.USER, content=label)
    if kind == "model":
        return Message(role=Role.MODEL, content=label)
    if kind == "system":
        return Message(role=Role.SYSTEM, content=label)
    if kind == "call":
        return Message(role=Role.MODEL, tool_calls=[ToolCall(id=label, name="lookup", args={})])
    result = ToolResult(tool_call_id=label, name="lookup", content={"for": label})
    return Message(role=Role.TOOL, tool_results=[result])


def to_tag(message: Message) -> Tag:
    if message.tool_calls:
        return ("call", message.tool_calls[0].id)
    if message.tool_results:
        return ("tool", message.tool_results[0].tool_call_id)
    return (message.role.value, message.content or "")


def append(history: list[Tag], tag: Tag) -> list[Tag]:
    """DESIGN.md behaviour 1, written plainly: the reference for the store's window."""
    out = list(history)
    n_system = sum(1 for kind, _ in out if kind == "system")
    if tag[0] == "system":
        out.insert(n_system, tag)
    elif tag[0] == "user" or any(kind == "user" for kind, _ in out):
        out.append(tag)
    starts = [i for i, (kind, _) in enumerate(out) if kind == "user"]
    if len(starts) > MAX_TURNS:
        cut = starts[len(starts) - MAX_TURNS]
        out = out[:n_system] + out[cut:]
    return out


def as_reloaded(history: list[Tag]) -> list[Tag]:
    end = len(history)
    while end and history[end - 1][0] == "call":
        end -= 1
    return history[:end]


def assert_well_formed(history: list[Tag]) -> None:
    body = [t for t in history if t[0] != "system"]
    assert not body or body[0][0] == "user", f"starts with {body[0]}"
    for index, (kind, label) in enumerate(body):
        if kind == "call":
            assert index + 1 < len(body), f"ends on an unanswered call: {body}"
            assert body[index + 1] == ("tool", label), f"call {label} without its result"
        if kind == "tool":
            assert index and body[index - 1] == ("call", label), f"result {label} without call"


@dataclass
class Model:
    db: list[Tag] = field(default_factory=list)
    agent: str = "Alpha"
    meta: dict[str, Any] = field(default_factory=dict)
    a_view: list[Tag] = field(default_factory=list)
    a_meta: dict[str, Any] = field(default_factory=dict)
    pending_call: str | None = None
    carry: bool = False

    def a_writes(self, *tags: Tag) -> None:
        """A writes: rebased on the database, its carried tool call first."""
        db = self.db
        if self.carry and self.pending_call is not None:
            db = append(db, ("call", self.pending_call))
            self.carry = False
        for tag in tags:
            db = append(db, tag)
        self.db = db
        self.a_view = list(db)
        self.a_meta = dict(self.meta)

    def b_writes_messages(self, *tags: Tag) -> None:
        """B loaded (the trailing call hidden) and appends: the hidden call row goes."""
        db = self.db
        if db and db[-1][0] == "call":
            db = db[:-1]
            self.carry = self.pending_call is not None
        for tag in tags:
            db = append(db, tag)
        self.db = db


# --------------------------------------------------------------- machine


class TurnFaultMachine(RuleBasedStateMachine):
    """Subclassed per database by the tests below (``open_store`` is set there)."""

    open_store: Any = None
    labels = itertools.count()

    def __init__(self) -> None:
        super().__init__()
        self.alpha = Agent(name="Alpha", instructions="")
        self.beta = Agent(name="Beta", instructions="")
        self.agents = {"Alpha": self.alpha, "Beta": self.beta}
        self.model = Model()
        self.session_id = f"fm-{next(self.labels)}-{os.getpid()}"
        self.a = self.open_store()
        self.b = self.open_store()
        for store in (self.a, self.b):
            store.set_agent_resolver(self.agents.get)
        self.ctx = self.a.get_or_create(self.session_id, self.alpha)
        COUNTS["examples"] += 1

    def teardown(self) -> None:
        for store in (self.a, self.b):
            store.close()

    def label(self, kind: str) -> str:
        return f"{kind}{next(self.labels)}"

    def b_ctx(self) -> Any:
        ctx = self.b.get(self.session_id)
        assert ctx is not None
        return ctx

    # ------------------------------------------------------------ checks

    @invariant()
    def reload_matches_the_model(self) -> None:
        fresh = self.open_store()
        try:
            fresh.set_agent_resolver(self.agents.get)
            ctx = fresh.get(self.session_id)
            assert ctx is not None
            got = [to_tag(m) for m in ctx.history]
            want = as_reloaded(self.model.db)
            lost = len([t for t in want if t not in got])
            dup = sum(n - 1 for n in Counter(got).values() if n > 1)
            COUNTS["lost"] += lost
            COUNTS["duplicated"] += dup
            assert got == want, f"reload {got} != model {want}"
            assert_well_formed(got)
            assert ctx.active_agent.name == self.model.agent
            assert ctx.metadata == self.model.meta
            COUNTS["checks"] += 1
        finally:
            fresh.close()

    @invariant()
    def memory_matches_the_model(self) -> None:
        assert [to_tag(m) for m in self.ctx.history] == self.model.a_view
        assert self.ctx.metadata == self.model.a_meta

    # ---------------------------------------------------- A, direct writes

    @precondition(lambda self: self.model.pending_call is None)
    @rule(kind=st.sampled_from(["user", "model", "system"]))
    def a_adds(self, kind: str) -> None:
        self.a_add((kind, self.label(kind[0])))

    def a_add(self, tag: Tag) -> bool:
        """A adds a message directly; False if its memory dropped it (nothing written)."""
        self.ctx.add_message(to_message(tag))
        if tag[0] not in ("user", "system") and not any(k == "user" for k, _ in self.model.a_view):
            return False  # no turn to belong to in A's memory
        self.model.a_writes(tag)
        return True

    @precondition(lambda self: self.model.pending_call is None)
    @rule()
    def a_adds_a_tool_call(self) -> None:
        if not any(kind == "user" for kind, _ in self.model.a_view):
            return  # a call with no turn to belong to is dropped; not interesting
        label = self.label("c")
        self.a_add(("call", label))
        if self.ctx.history and to_tag(self.ctx.history[-1]) == ("call", label):
            self.model.pending_call = label
        # else: rebased onto a session B had cleared, the call had no turn to join
        # and was dropped; a writer sees that (its call is not last) and sends no result.

    @precondition(lambda self: self.model.pending_call is not None)
    @rule()
    def a_adds_the_tool_result(self) -> None:
        label = self.model.pending_call
        assert label is not None
        self.a_add(("tool", label))
        self.model.pending_call = None
        self.model.carry = False

    @precondition(lambda self: self.model.pending_call is None)
    @rule()
    def a_switches_agent(self) -> None:
        target = self.beta if self.ctx.active_agent.name == "Alpha" else self.alpha
        self.ctx.set_active_agent(target)
        self.model.a_writes()
        self.model.agent = target.name

    @precondition(lambda self: self.model.pending_call is None)
    @rule()
    def a_clears(self) -> None:
        self.ctx.clear_history()
        self.model.db = []
        self.model.a_writes()

    @precondition(lambda self: self.model.pending_call is None)
    @rule()
    def a_sets_metadata(self) -> None:
        value = next(self.labels)
        self.ctx.metadata["a"] = value
        meta = {**self.model.a_meta, "a": value}  # A's whole dict wins a rebase
        self.model.a_writes()
        self.model.meta = meta
        self.model.a_meta = dict(meta)

    @rule()
    def a_reloads(self) -> None:
        """``get_or_create`` (as the Runner calls it): A catches up with the database."""
        assert self.a.get_or_create(self.session_id, self.alpha) is self.ctx
        view = list(self.model.db)
        if self.model.carry and self.model.pending_call is not None:
            view = append(view, ("call", self.model.pending_call))  # unsaved again
        self.model.a_view = view
        self.model.a_meta = dict(self.model.meta)

    # ----------------------------------------------------------- B writes

    @rule(in_lock=st.booleans())
    def b_runs_a_turn(self, in_lock: bool) -> None:
        ctx = self.b_ctx()
        user, answer = ("user", self.label("bu")), ("model", self.label("bm"))

        async def turn() -> None:
            async with ctx.lock:
                ctx.add_message(to_message(user))
                ctx.add_message(to_message(answer))

        if in_lock:
            asyncio.run(turn())
        else:
            ctx.add_message(to_message(user))
            ctx.add_message(to_message(answer))
        self.model.b_writes_messages(user, answer)

    @rule()
    def b_sets_metadata(self) -> None:
        value = next(self.labels)
        self.b_ctx().metadata["b"] = value
        self.model.meta = {**self.model.meta, "b": value}

    @precondition(lambda self: self.model.pending_call is None)
    @rule()
    def b_clears(self) -> None:
        self.b_ctx().clear_history()
        self.model.db = []

    # ------------------------------------------------------------- A turns

    @precondition(lambda self: self.model.pending_call is None)
    @rule(
        ending=st.sampled_from(["commit", "fail", "cancel", "hard_stop", "write_fails"]),
        with_tool=st.booleans(),
        clear_first=st.booleans(),
        switch=st.booleans(),
        set_meta=st.booleans(),
        b_meanwhile=st.sampled_from(["nothing", "message", "metadata"]),
        retry=st.booleans(),
    )
    def a_runs_a_turn(
        self,
        ending: str,
        with_tool: bool,
        clear_first: bool,
        switch: bool,
        set_meta: bool,
        b_meanwhile: str,
        retry: bool,
    ) -> None:
        COUNTS["turns"] += 1
        ctx = self.a.get_or_create(self.session_id, self.alpha)  # as the Runner does
        assert ctx is self.ctx
        self.model.a_view, self.model.a_meta = list(self.model.db), dict(self.model.meta)
        start_view, start_meta = list(self.model.db), dict(self.model.meta)
        call = self.label("tc")
        tags: list[Tag] = [("user", self.label("u"))]
        if with_tool:
            tags += [("call", call), ("tool", call)]
        tags.append(("model", self.label("m")))
        target = self.beta if self.model.agent == "Alpha" else self.alpha
        meta_value = next(self.labels)
        b_tags = (("user", self.label("bu")), ("model", self.label("bm")))
        stopped = asyncio.Event()

        async def body() -> None:
            async with ctx.lock:
                checkpoint = len(ctx.history)
                try:
                    if retry:
                        ctx.add_message(to_message(("user", "draft")))
                        ctx.rollback_to(checkpoint)
                    if clear_first:
                        ctx.clear_history()
                    for tag in tags[:-1]:
                        ctx.add_message(to_message(tag))
                    if switch:
                        ctx.set_active_agent(target)
                    if set_meta:
                        ctx.metadata["a"] = meta_value
                    if b_meanwhile == "message":
                        other = self.b_ctx()
                        for tag in b_tags:
                            other.add_message(to_message(tag))
                    elif b_meanwhile == "metadata":
                        self.b_ctx().metadata["b"] = meta_value
                    if ending == "fail":
                        raise RuntimeError("engine failed midway")
                    if ending == "cancel":
                        stopped.set()
                        await asyncio.sleep(600)
                    if ending == "hard_stop":
                        raise HardStop
                    if ending == "write_fails":
                        ctx.metadata["box"] = {}
                        ctx.metadata["box"]["bad"] = {1, 2}  # only the write sees it
                    ctx.add_message(to_message(tags[-1]))
                except Exception:
                    ctx.rollback_to(checkpoint)  # what the Runner does
                    raise

        async def drive() -> None:
            task = asyncio.ensure_future(body())
            if ending == "cancel":
                await asyncio.wait_for(stopped.wait(), 60)
                task.cancel()
            await task

        expected = {
            "commit": None,
            "fail": RuntimeError,
            "cancel": asyncio.CancelledError,
            "hard_stop": HardStop,
            "write_fails": ValueError,
        }[ending]
        if expected is None:
            asyncio.run(drive())
        else:
            COUNTS["faults"] += 1
            with pytest.raises(expected):
                asyncio.run(drive())
        # B's write in the middle of the turn stands whatever the turn did.
        if b_meanwhile == "message":
            self.model.b_writes_messages(*b_tags)
        elif b_meanwhile == "metadata":
            self.model.meta = {**self.model.meta, "b": meta_value}
        if expected is not None:
            COUNTS["survived"] += 1
            self.model.a_view, self.model.a_meta = start_view, start_meta
            return
        if clear_first:
            self.model.db = []
        meta = {**start_meta, "a": meta_value} if set_meta else None
        self.model.a_writes(*tags)
        if switch:
            self.model.agent = target.name
        if meta is not None:
            self.model.meta = meta  # A's whole dict wins a rebase
            self.model.a_meta = dict(meta)


def _settings() -> settings:
    return settings(
        max_examples=EXAMPLES,
        stateful_step_count=STEPS,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=not LONG,
        database=None,
        # The long campaign reports a failure as found (shrinking it can take hours).
        phases=[Phase.explicit, Phase.generate] if LONG else list(Phase),
    )


def run_machine(open_store: Any) -> None:
    """Run the machine against stores made by ``open_store()`` (one database)."""
    machine = type("Machine", (TurnFaultMachine,), {"open_store": staticmethod(open_store)})
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(machine, settings=_settings())


def test_turn_faults_on_sqlite(tmp_path: Any) -> None:
    from chatflow_sqlalchemy import SQLiteSessionStore

    path = tmp_path / "model.db"
    run_machine(lambda: SQLiteSessionStore(path, default_max_turns=MAX_TURNS))


@pytest.mark.postgres
def test_turn_faults_on_postgresql(pg_url: str, pg_schema: str) -> None:
    from . import pg_util

    run_machine(lambda: pg_util.schema_store(pg_url, pg_schema, default_max_turns=MAX_TURNS))


def test_deleted_session_is_reported_not_merged(tmp_path: Any) -> None:
    """The model's one terminal fault: B deletes and re-creates the session."""
    from chatflow_sqlalchemy import SQLiteSessionStore

    a = SQLiteSessionStore(tmp_path / "d.db")
    b = SQLiteSessionStore(tmp_path / "d.db")
    try:
        ctx = a.get_or_create("s", Agent(name="Alpha", instructions=""))
        ctx.add_message(to_message(("user", "old")))
        b.delete("s")
        b.get_or_create("s", Agent(name="Alpha", instructions="")).add_message(
            to_message(("user", "new"))
        )
        with pytest.raises(SessionDeletedError):
            ctx.add_message(to_message(("model", "leak")))
        again = a.get("s")
        assert again is not None
        assert [to_tag(m) for m in again.history] == [("user", "new")]
    finally:
        a.close()
        b.close()
