"""The test suite's fake model engines: what the public ScriptedEngine cannot play.

Tests use :class:`chatflow_sqlalchemy.testing.ScriptedEngine` wherever the
user's words can script the turn. The engines here cover the rest: a fixed
list of model turns with fixed call ids (:class:`Playback`), a tool of any
name (:class:`ToolThenAnswer`) and a record of what each model call saw
(:class:`Recording`).
They import nothing beyond chatflow-agent and the kit, so worker processes
can use them too.
"""

from __future__ import annotations

import asyncio

from chatflow_agent import Agent, BaseEngine, Message, Role, ToolCall
from chatflow_agent.core.engines import EngineTurnResult

from chatflow_sqlalchemy.testing import ScriptedEngine

__all__ = ["Playback", "Recording", "ToolThenAnswer", "calls", "say"]


def calls(*specs: tuple[str, str, dict[str, object]]) -> EngineTurnResult:
    """A model turn calling tools: ``(call id, tool name, args)`` each."""
    return EngineTurnResult(tool_calls=[ToolCall(id=i, name=n, args=a) for i, n, a in specs])


def say(text: str) -> EngineTurnResult:
    """A model turn answering ``text``."""
    return EngineTurnResult(text=text)


class Playback(BaseEngine):
    """Plays a fixed list of model turns (:func:`calls`, :func:`say`) in order.

    For histories that must be identical byte for byte across runs (fixed
    call ids) or that call a tool the agent lacks.
    """

    def __init__(self, script: list[EngineTurnResult]) -> None:
        self.script = list(script)

    async def generate_turn_async(self, agent: Agent, history: list[Message]) -> EngineTurnResult:
        assert history, "the Runner always passes the history"
        return self.script.pop(0)


class ToolThenAnswer(BaseEngine):
    """USER -> one call of ``tool`` with ``q=<the question>``; TOOL -> ``answer to <q>``.

    Args:
        tool: The tool's name (the agent's own tool, of any name).
        pause: Seconds to yield to the loop before each answer (0: one bare yield).

    """

    def __init__(self, tool: str, pause: float = 0.0) -> None:
        self.tool = tool
        self.pause = pause

    async def generate_turn_async(self, agent: Agent, history: list[Message]) -> EngineTurnResult:
        await asyncio.sleep(self.pause)
        last = history[-1]
        if last.role == Role.USER:
            call = ToolCall(id=f"call-{last.content}", name=self.tool, args={"q": last.content})
            return EngineTurnResult(tool_calls=[call])
        question = next(m.content for m in reversed(history) if m.role == Role.USER)
        return EngineTurnResult(text=f"answer to {question}")


class Recording(ScriptedEngine):
    """:class:`ScriptedEngine` that keeps the contents of every history it was given."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__(delay)
        self.seen: list[list[str | None]] = []

    async def generate_turn_async(self, agent: Agent, history: list[Message]) -> EngineTurnResult:
        self.seen.append([m.content for m in history])
        return await super().generate_turn_async(agent, history)

