"""Worker processes for the webhook-claim tests of the conformance suite.

Each worker opens its own store from a :class:`~.harness.StoreSpec` and runs
DESIGN.md's webhook handler (``store.claim`` around ``Runner.run_async``)
for a list of deliveries, reporting on a queue: ``("ready", pid)`` when its
model is called (so a test can kill or stop it inside the turn), then
``("done", pid, outcomes)`` with one ``(message_id, status, response,
error)`` per delivery (the :class:`~.harness.Worker` protocol).
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from chatflow_agent import Agent, BaseEngine, Message, Role, Runner
from chatflow_agent.core.engines import EngineTurnResult

from chatflow_sqlalchemy.testing.harness import StoreSpec, Worker, start_process

__all__ = ["ReplyModel", "reply_to", "start_worker", "webhook_worker"]

Outcome = tuple[str, str, "str | None", "str | None"]


def reply_to(text: str) -> str:
    """The reply the workers' model gives to ``text``."""
    return f"reply to {text}"


class ReplyModel(BaseEngine):
    """The claim tests' model: it answers :func:`reply_to` the user's text.

    Args:
        failures: How many calls fail first (the model provider is down); -1: all.
        latency: Each reply comes after a random pause of up to this many seconds.
        seed: Seed of those pauses.
        before_reply: Awaited before each reply, in place of the pause (a worker
            reports ``ready`` there, then hangs or pauses).

    """

    def __init__(
        self,
        failures: int = 0,
        latency: float = 0.0,
        seed: int = 0,
        before_reply: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.failures = failures
        self.latency = latency
        self.rng = random.Random(seed)
        self.before_reply = before_reply

    async def generate_turn_async(self, agent: Agent, history: list[Message]) -> EngineTurnResult:
        """``reply_to`` the latest user message, unless this call is one that fails."""
        if self.failures:
            self.failures -= 1
            raise RuntimeError("the model provider is down")
        if self.before_reply is not None:
            await self.before_reply()
        elif self.latency:
            await asyncio.sleep(self.rng.uniform(0, self.latency))
        text = next(m.content for m in reversed(history) if m.role == Role.USER) or ""
        return EngineTurnResult(text=reply_to(text))


def webhook_worker(
    spec: StoreSpec,
    session_id: str,
    deliveries: Sequence[tuple[str, str]],
    mode: str,
    lease_seconds: float,
    latency: float,
    events: Any,
) -> None:
    """Handle ``deliveries`` (``(message_id, text)``) one after the other.

    ``mode``: ``ok`` (prepare, then answer, each after a random delay of up
    to ``latency`` seconds), ``fail`` (the model raises), ``hang`` (report ready and never
    answer: the test kills it), ``pause`` (report ready, then answer after
    ``latency`` seconds: the test stops and continues it meanwhile).
    """
    rng = random.Random(os.getpid())

    async def ready_then_wait() -> None:
        events.put(("ready", os.getpid()))
        await asyncio.sleep(3600 if mode == "hang" else latency)

    if mode == "fail":
        model = ReplyModel(failures=-1)
    elif mode in ("hang", "pause"):
        model = ReplyModel(before_reply=ready_then_wait)
    else:
        model = ReplyModel(latency=latency, seed=os.getpid())
    store: Any = spec.open()
    runner = Runner(
        starting_agent=Agent(name="Bot", instructions=""), session_store=store, engine=model
    )

    async def on_webhook(message_id: str, text: str) -> Outcome:
        try:
            async with store.claim(
                message_id, session_id=session_id, lease_seconds=lease_seconds
            ) as claim:
                if not claim.acquired:
                    return message_id, claim.status, claim.response, None
                if mode == "ok" and latency:  # work before the turn (fetching media, say)
                    await asyncio.sleep(rng.uniform(0, latency))
                result = await runner.run_async(session_id=session_id, user_message=text)
                claim.response = result.content
                return message_id, claim.status, result.content, None
        except Exception as exc:
            return message_id, "error", None, type(exc).__name__

    async def deliver_all() -> list[Outcome]:
        outcomes = []
        for message_id, text in deliveries:
            outcomes.append(await on_webhook(message_id, text))
            await asyncio.sleep(rng.uniform(0.001, 0.005))  # the next delivery, a few ms later
        return outcomes

    try:
        events.put(("done", os.getpid(), asyncio.run(deliver_all())))
    finally:
        store.close()


def start_worker(
    spec: StoreSpec,
    session_id: str,
    deliveries: Sequence[tuple[str, str]],
    *,
    mode: str = "ok",
    lease_seconds: float = 60.0,
    latency: float = 0.0,
) -> Worker:
    """Start :func:`webhook_worker` in a worker process (:func:`~.harness.start_process`).

    Its ``result()`` is one ``(message_id, status, response, error)`` per delivery.
    """
    return start_process(
        webhook_worker, spec, session_id, list(deliveries), mode, lease_seconds, latency
    )
