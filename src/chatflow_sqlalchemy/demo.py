"""An offline, deterministic tour of chatflow-sqlalchemy driving the real Runner.

``chatflow-sqlalchemy demo`` runs a two-agent support bot on an embedded
SQLite file; :class:`~chatflow_sqlalchemy.testing.engines.ScriptedEngine`
plays the steps written in each user message, so no network or key is
needed. Every claim it prints is also checked (:class:`DemoError`).
"""

from __future__ import annotations

import asyncio
import json
import random
import shlex
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from chatflow_agent import Agent, BaseEngine, Message, Role, Runner
from chatflow_agent.core.engines.base import EngineTurnResult

from chatflow_sqlalchemy.backends.sqlite import SQLiteSessionStore
from chatflow_sqlalchemy.summaries import Summarizer
from chatflow_sqlalchemy.testing.engines import ScriptedEngine

__all__ = [
    "DEMO_MAX_TURNS", "DEMO_SESSION_ID", "DemoError", "build_agents", "engine_summarizer",
    "run_demo",
]

DEMO_SESSION_ID = "whatsapp:+15550100"
"""The session the demo talks in."""

DEMO_MAX_TURNS = 3
"""History window of the demo store, small enough to see pruning happen."""

_WEBHOOK_ID = "wamid.X"
_RETRY_SESSION_ID = "whatsapp:+15550111"
_BURST_SESSION_ID = "whatsapp:+15550122"
_BURST = 6
_SUMMARY_SESSION_ID = "whatsapp:+15550133"
_SUMMARY_WAIT_SECONDS = 60.0


class DemoError(RuntimeError):
    """A behaviour the demo shows did not hold (the demo doubles as a smoke test)."""


def _format_value(value: Any, limit: int = 72) -> str:
    if isinstance(value, dict):
        text = ", ".join(f"{k}={_format_value(v)}" for k, v in value.items())
    elif isinstance(value, str):
        text = value
    else:
        text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- agents


def check_order_status(order_id: str) -> dict[str, Any]:
    """Look up the shipping status of an order."""
    number = int(order_id) if order_id.isdigit() else 0
    status = ("processing", "shipped", "in transit", "delivered")[number % 4]
    return {"order_id": order_id, "status": status, "eta": f"2025-06-{10 + number % 20:02d}"}


def refund(amount: str) -> dict[str, Any]:
    """Refund an amount to the customer."""
    return {"refund_id": f"RF-{amount}", "amount": f"{amount} EUR", "status": "approved"}


def build_agents() -> dict[str, Agent]:
    """Build the demo's two agents (fresh objects each call, as after a restart).

    Returns:
        ``{"Support": ..., "Billing": ...}``; Support starts, each can hand off
        to the other.

    """
    support = Agent(
        name="Support",
        instructions="You answer order questions and route refunds to Billing.",
        tools=[check_order_status],
    )
    billing = Agent(
        name="Billing",
        instructions="You handle refunds and invoices.",
        tools=[refund],
    )
    support.add_handoff(billing)
    billing.add_handoff(support)
    return {"Support": support, "Billing": billing}


def engine_summarizer(engine: BaseEngine) -> Summarizer:
    """A store ``summarizer`` that asks ``engine`` for the summary, as a Runner asks it for a turn.

    The prompt (the summary so far, then what the user said in the dropped
    turns) goes as one USER message; the engine's text is the new summary.
    """
    agent = Agent(
        name="Summarizer",
        instructions="Summarize the conversation; keep every name, order number and amount.",
    )

    async def summarize(previous: str | None, dropped: list[Message]) -> str:
        said = [m.content for m in dropped if m.role == Role.USER and m.content]
        prompt = ([f"Summary so far: {previous}"] if previous else []) + [
            "The user said: " + "; ".join(said)
        ]
        result = await engine.generate_turn_async(
            agent=agent, history=[Message(role=Role.USER, content="\n".join(prompt))]
        )
        if not result.text:
            raise RuntimeError("the engine answered without text")  # retried at the next prune
        return result.text

    return summarize


# --------------------------------------------------------------------------- output


def _describe_message(message: Message) -> list[str]:
    role = message.role.value
    lines: list[str] = []
    if message.content:
        lines.append(f"{role:>6}: {_format_value(message.content, 100)}")
    for call in message.tool_calls or []:
        args = ", ".join(f"{k}={v!r}" for k, v in call.args.items())
        lines.append(f"{role:>6}: calls {call.name}({args})  [{call.id}]")
    for result in message.tool_results or []:
        flag = " (error)" if result.is_error else ""
        lines.append(f"{role:>6}: {result.name}{flag} -> {_format_value(result.content)}")
    return lines or [f"{role:>6}: (empty)"]


def _last_turn(history: Sequence[Message]) -> list[Message]:
    for index in range(len(history) - 1, -1, -1):
        if history[index].role == Role.USER:
            return list(history[index:])
    return []


def _turns(history: Sequence[Message]) -> list[list[Message]]:
    turns: list[list[Message]] = []
    for message in history:
        if message.role == Role.USER:
            turns.append([message])
        elif turns and message.role != Role.SYSTEM:
            turns[-1].append(message)
    return turns


def _dump(history: Sequence[Message]) -> list[dict[str, Any]]:
    return [message.model_dump(mode="json") for message in history]


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise DemoError(f"demo check failed: {what}")


def _pairs_intact(history: Sequence[Message]) -> bool:
    """Every tool call has its result right after it, and every result its call."""
    for index, message in enumerate(history):
        if message.tool_calls:
            following = history[index + 1] if index + 1 < len(history) else None
            if following is None or following.role != Role.TOOL:
                return False
            answered = {r.tool_call_id for r in following.tool_results or []}
            if {c.id for c in message.tool_calls} != answered:
                return False
        if message.role == Role.TOOL:
            previous = history[index - 1] if index else None
            if previous is None or not previous.tool_calls:
                return False
    return True


# --------------------------------------------------------------------------- the tour


class _Demo:
    def __init__(self, db_path: str, out: Callable[[str], None]) -> None:
        self.db_path = db_path
        self.out = out
        self.engine = ScriptedEngine()
        self.store = SQLiteSessionStore(db_path, default_max_turns=DEMO_MAX_TURNS)
        self.agents = build_agents()
        self.runner = self.new_runner()

    def heading(self, text: str) -> None:
        self.out("")
        self.out(text)

    def new_runner(self) -> Runner:
        return Runner(
            starting_agent=self.agents["Support"], session_store=self.store, engine=self.engine
        )

    def history(self) -> list[Message]:
        session = self.store.get(DEMO_SESSION_ID)
        _check(session is not None, "the demo session exists")
        assert session is not None
        return list(session.history)

    def active_agent(self) -> Agent:
        session = self.store.get(DEMO_SESSION_ID)
        assert session is not None
        return session.active_agent

    async def turn(self, text: str) -> None:
        response = await self.runner.run_async(DEMO_SESSION_ID, text)
        for message in _last_turn(self.history()):
            for line in _describe_message(message):
                self.out("  " + line)
        if response.handoff is not None:
            self.out(f"  -- handoff to {response.handoff.target_agent_name}")

    def reopen(self, summarizer: Summarizer | None = None) -> SQLiteSessionStore:
        """A second, independent store on the same file (what another process sees)."""
        store = SQLiteSessionStore(
            self.db_path, default_max_turns=DEMO_MAX_TURNS, summarizer=summarizer
        )
        store.set_agent_resolver(self.agents.get)
        return store

    async def run(self) -> None:
        try:
            await self.tools()
            await self.handoff()
            await self.restart()
            await self.pruning()
            await self.duplicate()
            await self.rollback()
            await self.retried()
            await self.burst()
            await self.summaries()
        finally:
            await self.store.aclose()
        self.out("")
        self.out("All steps behaved as described.")

    async def tools(self) -> None:
        self.heading("1. Tool call (Support agent)")
        await self.turn("Hi! Where is my order 404?")
        history = self.history()
        _check(
            any(c.name == "check_order_status" for m in history for c in m.tool_calls or []),
            "Support called check_order_status",
        )

    async def handoff(self) -> None:
        self.heading("2. Handoff: a refund goes to Billing, which uses its own tool")
        await self.turn("It never arrived. Please transfer to billing then refund 49")
        _check(self.active_agent().name == "Billing", "Billing is now the active agent")
        called = [c.name for m in _last_turn(self.history()) for c in m.tool_calls or []]
        _check("refund" in called, "Billing called refund")
        self.out("  active agent: Billing")

    async def restart(self) -> None:
        self.heading("3. Restart: close the store, reopen the file with a new Runner")
        before = _dump(self.history())
        await self.store.aclose()
        self.out("  store closed (simulated process exit)")
        self.store = self.reopen()
        self.agents = build_agents()
        self.runner = self.new_runner()
        agent = self.active_agent()
        tools = [tool.name for tool in agent.get_all_tools()]
        _check(agent is self.agents["Billing"], "the new Runner's Billing agent was resolved")
        _check(_dump(self.history()) == before, "the reloaded history is identical")
        self.out(f"  reloaded: {len(before)} messages, active agent {agent.name}")
        self.out(f"  {agent.name}'s tools after restart: {', '.join(tools)}")

    async def pruning(self) -> None:
        self.heading(f"4. Pruning: max_turns={DEMO_MAX_TURNS} keeps the newest whole turns")
        for text in (
            "Thanks! Please transfer to support",
            "Where is order 405?",
            "And order 406?",
        ):
            await self.turn(text)
        history = self.history()
        turns = _turns(history)
        _check(len(turns) == DEMO_MAX_TURNS, f"{DEMO_MAX_TURNS} turns remain")
        _check(history[0].role == Role.USER, "the history starts with a USER message")
        _check(_pairs_intact(history), "tool calls and results stay paired")
        self.out(f"  after 5 turns, {len(turns)} remain ({len(history)} messages):")
        for turn in turns:
            self.out(f"    - {turn[0].content!r} ({len(turn)} messages)")
        self.out("  first message is USER; every tool call still has its result")
        with self.reopen() as fresh:
            reloaded = fresh.get(DEMO_SESSION_ID)
            assert reloaded is not None
            _check(_dump(reloaded.history) == _dump(history), "a fresh store reloads the same")
        self.out("  a fresh store reloads the identical history")

    async def duplicate(self) -> None:
        self.heading("5. Duplicate webhook: the same WhatsApp message delivered twice")
        replies = []
        for delivery in ("first", "second"):
            async with self.store.claim(_WEBHOOK_ID, session_id=DEMO_SESSION_ID) as claim:
                if claim.acquired:
                    self.out(f"  {delivery} delivery of {_WEBHOOK_ID}: claimed, processing it")
                    await self.turn("Is order 406 insured?")
                    claim.response = _last_reply(self.history())
                else:
                    self.out(
                        f"  {delivery} delivery of {_WEBHOOK_ID}: duplicate ({claim.status}), "
                        "its stored reply is sent again"
                    )
                replies.append(claim.response)
            _check(claim.acquired == (delivery == "first"), "only the first delivery is claimed")
        _check(replies[0] is not None and replies[0] == replies[1], "the reply was stored")

    async def rollback(self) -> None:
        self.heading("6. Rollback: the provider fails mid-turn, after a handoff")
        before = _dump(self.history())
        agent_before = self.active_agent().name
        self.out(f"  before: {len(before)} messages, active agent {agent_before}")
        text = "Refund order 406 too: transfer to billing then fail"
        calls = self.engine.calls
        try:
            await self.runner.run_async(DEMO_SESSION_ID, text)
        except RuntimeError as exc:
            self.out(f"    user: {text}")
            self.out(f"  Support handed off to Billing, then the provider failed: {exc}")
        else:
            raise DemoError("demo check failed: the failing turn raised")
        # Step 2 ("fail") runs only once step 1's handoff has its TOOL result.
        _check(self.engine.calls == calls + 2, "the turn failed after its handoff")
        after = _dump(self.history())
        agent_after = self.active_agent().name
        _check(after == before, "the history is unchanged after the rollback")
        _check(agent_after == agent_before, "the active agent is unchanged after the rollback")
        self.out(f"  in memory: {len(after)} messages, active agent {agent_after}")
        with self.reopen() as fresh:
            reloaded = fresh.get(DEMO_SESSION_ID)
            assert reloaded is not None
            _check(_dump(reloaded.history) == before, "the database holds the pre-turn history")
            _check(reloaded.active_agent.name == agent_before, "the database holds the agent")
            self.out(
                f"  reloaded: {len(reloaded.history)} messages, "
                f"active agent {reloaded.active_agent.name}"
            )
        self.out("  the Runner rolled the turn back: no messages, no handoff left behind")

    async def retried(self) -> None:
        self.heading("7. Webhook claim: the provider is down, the platform retries the delivery")
        tour = _ClaimsTour(self, _RETRY_SESSION_ID)
        runner = tour.runner(_ProviderDown(failures=1))
        try:
            try:
                await tour.on_webhook(runner, "wamid.R", "Where is order 407?")
            except RuntimeError as exc:
                self.out(f"  delivery 1 of wamid.R: {exc}; the claim is released")
            else:
                raise DemoError("demo check failed: the first delivery failed")
            for delivery in (2, 3):
                status, reply = await tour.on_webhook(runner, "wamid.R", "Where is order 407?")
                self.out(f"  delivery {delivery} of wamid.R: {status} -> {reply}")
                _check(status == ("acquired" if delivery == 2 else "done"), "retry processed")
            _check(tour.user_texts() == ["Where is order 407?"], "processed exactly once")
            self.out("  stored once: the failed turn left nothing, the retry was not skipped")
        finally:
            await tour.store.aclose()

    async def burst(self) -> None:
        self.heading(
            f"8. A burst of {_BURST} messages, every one delivered to three handlers at once"
        )
        tour = _ClaimsTour(self, _BURST_SESSION_ID)
        runner = tour.runner(ScriptedEngine(delay=0.01))  # a model that takes its time
        rng = random.Random(9)
        texts = [f"message {k + 1}" for k in range(_BURST)]

        async def handler() -> None:  # each handler receives every delivery, in order
            for k, text in enumerate(texts):
                await tour.on_webhook(runner, f"wamid.B{k}", text, prepare=rng.uniform(0, 0.02))

        try:
            await asyncio.gather(handler(), handler(), handler())
            stored = tour.user_texts()
            self.out(f"  stored: {', '.join(map(str, stored))}")
            _check(stored == texts, "each message was processed once, in webhook order")
            self.out("  each message once, in order: a later claim's turn waits for earlier ones")
        finally:
            await tour.store.aclose()

    async def summaries(self) -> None:
        self.heading("9. Summaries: a summarizer on the demo's own engine keeps what pruning drops")
        store = self.reopen(summarizer=engine_summarizer(self.engine))
        runner = Runner(
            starting_agent=self.agents["Support"], session_store=store, engine=self.engine
        )
        texts = ("I am Ada; my parcel for order 408 arrived broken", "Where is order 409?",
                 "And order 410?", "Thanks, that is all")
        try:
            for text in texts:
                await runner.run_async(_SUMMARY_SESSION_ID, text)
                self.out(f"    user: {text}")
            written = await asyncio.to_thread(store.wait_for_summaries, _SUMMARY_WAIT_SECONDS)
            _check(written, "the summary was written in the background")
            session = store.get(_SUMMARY_SESSION_ID)
            assert session is not None
            summary, history = session.summary, list(session.history)
        finally:
            await store.aclose()
        _check(len(_turns(history)) == DEMO_MAX_TURNS, "the first turn was pruned")
        _check(summary is not None and "order 408" in summary, "the summary keeps order 408")
        _check(history[0].role == Role.SYSTEM and (history[0].content or "").endswith(str(summary)),
               "the model sees the summary first, as one SYSTEM message")
        self.out(f"  {len(texts)} turns, max_turns={DEMO_MAX_TURNS}: the first left the window;")
        self.out("  after that turn, in the background, the engine wrote a summary of it:")
        self.out(f"    summary: {summary}")
        self.out("  the model now sees it first, as one SYSTEM message")
        self.out("  store closed (simulated process exit)")
        self.summary_reloads(summary, history)

    def summary_reloads(self, summary: str | None, history: list[Message]) -> None:
        """A fresh store (another process) shows the same summary, then the same turns."""
        with self.reopen() as fresh:
            reloaded = fresh.get(_SUMMARY_SESSION_ID)
            assert reloaded is not None
            again = list(reloaded.history)
        _check(reloaded.summary == summary, "a fresh store reloads the summary")
        _check(again[0].role == Role.SYSTEM and again[0].content == history[0].content,
               "a fresh store shows the same summary message first")
        _check(_dump(again[1:]) == _dump(history[1:]), "a fresh store reloads the same turns")
        self.out(f"  reloaded: {len(again)} messages, the same summary first")


def _last_reply(history: Sequence[Message]) -> str | None:
    return next((m.content for m in reversed(history) if m.role == Role.MODEL), None)


class _ProviderDown(ScriptedEngine):
    """:class:`ScriptedEngine` behind a provider that is down for its first ``failures`` calls."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def generate_turn_async(self, agent: Agent, history: list[Message]) -> EngineTurnResult:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("503 from the model provider")
        return await super().generate_turn_async(agent, history)


class _ClaimsTour:
    """Steps 7 and 8: ``store.claim`` as DESIGN.md's webhook handler uses it."""

    def __init__(self, demo: _Demo, session_id: str) -> None:
        self.demo = demo
        self.session_id = session_id
        self.store = SQLiteSessionStore(demo.db_path)  # the default window: every turn shows
        self.store.set_agent_resolver(demo.agents.get)

    async def on_webhook(
        self, runner: Runner, message_id: str, text: str, prepare: float = 0.0
    ) -> tuple[str, str | None]:
        async with self.store.claim(message_id, session_id=self.session_id) as claim:
            if not claim.acquired:
                return claim.status, claim.response  # done: send it again; in_flight: retry
            await asyncio.sleep(prepare)  # e.g. fetching the message's media
            result = await runner.run_async(self.session_id, text)
            claim.response = result.content
            return claim.status, result.content

    def runner(self, engine: BaseEngine) -> Runner:
        return Runner(
            starting_agent=self.demo.agents["Support"], session_store=self.store, engine=engine
        )

    def user_texts(self) -> list[str | None]:
        session = self.store.get(self.session_id)
        history = session.history if session is not None else []
        return [m.content for m in history if m.role == Role.USER]


def run_demo(db_path: str, out: Callable[[str], None] = print) -> None:
    """Run the whole demo on a new SQLite file at ``db_path``, printing through ``out``.

    Args:
        db_path: Where to create the database; the file must not exist yet, so
            the demo never touches a real database.
        out: Receives each output line (default :func:`print`).

    Raises:
        FileExistsError: ``db_path`` already exists.
        DemoError: A behaviour the demo shows did not hold.

    """
    path = Path(db_path)
    if path.exists():
        raise FileExistsError(
            f"{db_path} already exists; the demo needs a new file (remove it or pick another path)"
        )
    out("chatflow-sqlalchemy demo: offline scripted engine, real chatflow_agent.Runner")
    out(f"database: {db_path} (SQLite), session {DEMO_SESSION_ID}, max_turns={DEMO_MAX_TURNS}")
    asyncio.run(_Demo(str(path), out).run())
    url = shlex.quote(f"sqlite:///{path}")
    out(f"inspect it: chatflow-sqlalchemy --url {url} sessions show {DEMO_SESSION_ID}")
