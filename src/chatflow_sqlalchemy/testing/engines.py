"""An offline engine for the real ``chatflow_agent.Runner``: no network, no API key.

:class:`ScriptedEngine` stands in for an LLM provider wherever a real one is
unwanted: a quick start, a demo, a test. It plays a script written in the user's
own message, so what a turn does is plain to read from the text that starts it.

This module imports only chatflow-agent and the standard library (no pytest),
so applications can use it outside a test run.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from typing import Any

from chatflow_agent import Agent, BaseEngine, Message, Role, ToolCall
from chatflow_agent.core.engines import EngineTurnResult

__all__ = ["ScriptedEngine"]

_ORDER = re.compile(r"\border\s+#?(\w+)", re.IGNORECASE)
_TRANSFER = re.compile(r"\btransfer\s+(?:to\s+)?(\w+)", re.IGNORECASE)
_REFUND = re.compile(r"\brefund\s+(\w+)", re.IGNORECASE)


def _call(name: str, **args: Any) -> ToolCall:
    """A tool call with an id unique across sessions and processes."""
    return ToolCall(id=f"call-{uuid.uuid4().hex[:12]}", name=name, args=args)


class ScriptedEngine(BaseEngine):
    """An offline engine for the real ``Runner``, scripted by the user's words.

    The latest user message is split on ``" then "`` into steps, and step *k*
    runs once the turn holds *k* TOOL messages, so one message can script a
    whole turn (``"order 42 then transfer billing then refund 10"``):

    * ``order <id>``: call ``check_order_status(order_id=<id>)``;
    * ``transfer <agent>`` (or ``transfer to <agent>``): call the handoff tool
      ``transfer_to_<agent>``;
    * ``refund <amount>``: call ``refund(amount=<amount>)``;
    * ``fail``: raise ``RuntimeError``, as a provider outage would (the Runner
      rolls the turn back);
    * anything else, a step whose tool the active agent lacks, or no step
      left: answer ``"<agent> re: <message>"``, followed by
      ``" | <last tool result as JSON>"`` when the turn called a tool.

    A step's keyword may sit anywhere in it (``"Where is my order 42?"``
    calls the tool too). Example::

        from chatflow_agent import Agent, Runner
        from chatflow_sqlalchemy import open_store
        from chatflow_sqlalchemy.testing import ScriptedEngine

        runner = Runner(starting_agent=Agent(name="Bot", instructions=""),
                        session_store=open_store("sqlite:///chat.db"),
                        engine=ScriptedEngine())
        print(runner.run("user-1", "hello").content)  # Bot re: hello

    Args:
        delay: Seconds to ``await asyncio.sleep`` before every answer, so that
            concurrent turns get a chance to interleave as they would while
            waiting on a real provider.

    Attributes:
        calls: How many times the engine was asked for a model turn.

    """

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.calls = 0

    async def generate_turn_async(self, agent: Agent, history: list[Message]) -> EngineTurnResult:
        """The next model step of ``agent``'s turn: a tool call or the text answer.

        Raises:
            RuntimeError: The current step is ``fail``.

        """
        self.calls += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        start = max(i for i, m in enumerate(history) if m.role == Role.USER)
        text = history[start].content or ""
        turn = history[start + 1 :]
        done = sum(1 for m in turn if m.role == Role.TOOL)
        steps = [s.strip() for s in text.split(" then ")]
        if done < len(steps):
            step = steps[done]
            if step.lower() == "fail":
                raise RuntimeError(f"scripted engine failure in turn {text!r}")
            planned = self._plan(agent, step)
            if planned is not None:
                return EngineTurnResult(tool_calls=[planned])
        results = [r.content for m in turn if m.role == Role.TOOL for r in m.tool_results or []]
        tail = f" | {json.dumps(results[-1], sort_keys=True)}" if results else ""
        return EngineTurnResult(text=f"{agent.name} re: {text}{tail}")

    @staticmethod
    def _plan(agent: Agent, step: str) -> ToolCall | None:
        """The tool call ``step`` asks for, when ``agent`` has that tool."""
        tools = {t.name for t in agent.get_all_tools()}
        if (m := _TRANSFER.search(step)) and f"transfer_to_{m[1].lower()}" in tools:
            return _call(f"transfer_to_{m[1].lower()}", reason=step)
        if (m := _ORDER.search(step)) and "check_order_status" in tools:
            return _call("check_order_status", order_id=m[1])
        if (m := _REFUND.search(step)) and "refund" in tools:
            return _call("refund", amount=m[1])
        return None
