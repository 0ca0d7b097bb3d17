"""Worker processes for the multi-process tests (run as ``python tests/_workers.py``).

Each worker opens a store from a JSON spec, does its part, and exits; the
tests kill some of them mid-turn on purpose.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from typing import Any

from chatflow_agent import Agent, BaseEngine, Message, Role, Runner, ToolCall, ToolResult
from chatflow_agent.core.engines.base import EngineTurnResult


def open_store(spec: dict[str, Any], **kwargs: Any) -> Any:
    """Open the store a test describes: ``{"kind": "sqlite", "path": ...}`` or postgres."""
    if spec["kind"] == "sqlite":
        from chatflow_sqlalchemy import SQLiteSessionStore

        return SQLiteSessionStore(spec["path"], **kwargs)
    from chatflow_sqlalchemy import PostgresSessionStore

    return PostgresSessionStore(
        spec["url"], connect_args={"options": f"-csearch_path={spec['schema']}"}, **kwargs
    )


class ToolThenAnswer(BaseEngine):
    """USER -> one tool call; TOOL -> a text answer naming the question."""

    async def generate_turn_async(self, agent: Agent, history: list[Message]) -> EngineTurnResult:
        last = history[-1]
        if last.role == Role.USER:
            call = ToolCall(id=f"call-{last.content}", name="slow_tool", args={"q": last.content})
            return EngineTurnResult(tool_calls=[call])
        question = next(m.content for m in reversed(history) if m.role == Role.USER)
        return EngineTurnResult(text=f"answer to {question}")


def kill_mid_turn(spec: dict[str, Any]) -> None:
    """Two whole turns, then a third that blocks inside its tool until killed."""
    blocking = {"on": False}

    def slow_tool(q: str) -> str:
        if blocking["on"]:
            print("READY", flush=True)
            time.sleep(600)
        return f"looked up {q}"

    agent = Agent(name="Bot", instructions="", tools=[slow_tool])
    store = open_store(spec)
    runner = Runner(starting_agent=agent, session_store=store, engine=ToolThenAnswer())
    runner.run("s1", "q1")
    runner.run("s1", "q2")
    blocking["on"] = True
    runner.run("s1", "q3")


def direct_writes_then_hang(spec: dict[str, Any]) -> None:
    """Persist USER and a MODEL tool call outside any turn, then hang before the result."""
    store = open_store(spec)
    session = store.get_or_create("s1", Agent(name="Bot", instructions=""))
    session.add_message(Message(role=Role.USER, content="q1"))
    session.add_message(Message(role=Role.MODEL, content="a1"))
    session.add_message(Message(role=Role.USER, content="q2"))
    call = ToolCall(id="c2", name="lookup", args={})
    session.add_message(Message(role=Role.MODEL, tool_calls=[call]))
    print("READY", flush=True)
    time.sleep(600)


def turn_lock_then_hang(spec: dict[str, Any]) -> None:
    """Inside ``session.lock``: USER and a MODEL tool call, then hang before the result."""
    store = open_store(spec)
    session = store.get_or_create("s1", Agent(name="Bot", instructions=""))
    session.add_message(Message(role=Role.USER, content="q1"))
    session.add_message(Message(role=Role.MODEL, content="a1"))

    async def turn() -> None:
        async with session.lock:
            session.add_message(Message(role=Role.USER, content="q2"))
            call = ToolCall(id="c2", name="lookup", args={})
            session.add_message(Message(role=Role.MODEL, tool_calls=[call]))
            print("READY", flush=True)
            await asyncio.sleep(600)

    asyncio.run(turn())


class SlowEcho(BaseEngine):
    """Answers after a pause, and logs how much history each call saw."""

    def __init__(self, log: list[dict[str, Any]], delay: float) -> None:
        self.log = log
        self.delay = delay

    async def generate_turn_async(self, agent: Agent, history: list[Message]) -> EngineTurnResult:
        question = history[-1].content
        self.log.append({"question": question, "seen": len(history)})
        await asyncio.sleep(self.delay)
        return EngineTurnResult(text=f"answer to {question}")


def fleet(spec: dict[str, Any], worker: str, turns: int, sessions: list[str], delay: float,
          log_path: str) -> None:
    """Run ``turns`` turns on every session concurrently through the real Runner."""
    log: list[dict[str, Any]] = []
    store = open_store(spec, default_max_turns=10_000)
    runner = Runner(
        starting_agent=Agent(name="Bot", instructions=""),
        session_store=store,
        engine=SlowEcho(log, delay),
    )

    async def drive(session_id: str) -> None:
        for turn in range(turns):
            await runner.run_async(session_id, f"{worker}:{session_id}:{turn}")

    async def main() -> None:
        await asyncio.gather(*(drive(s) for s in sessions))

    asyncio.run(main())
    store.close()
    with open(log_path, "w") as fh:
        json.dump(log, fh)


def campaign_writer(spec: dict[str, Any], session_id: str, label: str, mode: str,
                    seed: int) -> None:
    """Write whole turns forever, printing ``ACK <user text>`` once each is stored.

    ``mode`` ``"direct"``: every message is its own ``add_message`` outside any
    lock (USER, MODEL tool call, TOOL result, MODEL answer), as upstream's docs
    do. ``"locked"``: each turn runs through the real Runner inside
    ``session.lock``, its tool pausing a little. The test kills it at random.
    """
    import random

    rng = random.Random(seed)
    store = open_store(spec, default_max_turns=10_000)
    agent = Agent(name="Bot", instructions="", tools=[_pausing_lookup(rng)])
    if mode == "locked":
        runner = Runner(starting_agent=agent, session_store=store, engine=ToolThenAnswer())
        for turn in itertools.count():
            question = f"{label}-{turn}"
            runner.run(session_id, question)
            print(f"ACK {question}", flush=True)
    session = store.get_or_create(session_id, agent)
    for turn in itertools.count():
        question = f"{label}-{turn}"
        call = ToolCall(id=f"call-{question}", name="lookup", args={"q": question})
        session.add_message(Message(role=Role.USER, content=question))
        session.add_message(Message(role=Role.MODEL, tool_calls=[call]))
        time.sleep(rng.uniform(0, 0.004))  # the tool runs
        result = ToolResult(tool_call_id=call.id, name="lookup", content={"q": question})
        session.add_message(Message(role=Role.TOOL, tool_results=[result]))
        session.add_message(Message(role=Role.MODEL, content=f"answer to {question}"))
        print(f"ACK {question}", flush=True)


def _pausing_lookup(rng: Any) -> Any:
    async def slow_tool(q: str) -> str:
        await asyncio.sleep(rng.uniform(0, 0.004))
        return f"looked up {q}"

    return slow_tool


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    decoded = [json.loads(a) for a in args]
    {"kill_mid_turn": kill_mid_turn, "direct_writes_then_hang": direct_writes_then_hang,
     "turn_lock_then_hang": turn_lock_then_hang, "fleet": fleet,
     "campaign_writer": campaign_writer}[name](*decoded)
