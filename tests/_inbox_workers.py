"""The inbox kill campaign's worker process (``tests/test_inbox_campaign.py``).

A worker serves ``store.inbox`` as DESIGN.md's "Durable inbox" shows: its
``handle`` runs a real ``Runner`` turn on the store (an offline engine that
waits a little, as a model would) and returns the reply; its ``send``
appends the reply to a file of its own, one JSON line written with
``O_APPEND`` and fsync'd before it returns, so the test can count what was
sent across processes that it kills.

It also kills itself (``SIGKILL``) at named points, once each across the
whole fleet: the first worker to reach a point with its marked message
creates the point's file (a hard link: only one can) and dies there. The
points are:

* ``taken``: ``handle`` was called (the batch is in flight), before the turn;
* ``mid_turn``: inside the turn, while the engine "thinks";
* ``after_commit``: the turn and the reply are committed, ``send`` not done;
* ``after_send``: ``send`` delivered (the line is on disk), before the
  inbox records it as sent: the documented at-least-once window.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

from chatflow_agent import Agent, Message, Role, Runner
from chatflow_agent.core.engines import EngineTurnResult

from chatflow_sqlalchemy.testing import ScriptedEngine, StoreSpec

__all__ = [
    "KILL_POINTS",
    "SENDS_GLOB",
    "inbox_worker",
    "point_file",
    "sends_file",
]

KILL_POINTS = ("taken", "mid_turn", "after_commit", "after_send")
"""Where a worker kills itself, in the order a batch passes them."""

SENDS_GLOB = "sends-*.jsonl"
"""The files the workers' ``send`` appends to (one per worker slot)."""

THINK_SECONDS = (0.005, 0.05)
"""How long the engine waits before each answer: a model call, shortened."""

_SENDING: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "inbox_campaign_sending", default=None
)
"""The message ids of the reply this task last sent (the inbox records it next, in the
same task's context)."""


def sends_file(log_dir: str | Path, slot: int) -> Path:
    """Where the worker in ``slot`` appends what it sent."""
    return Path(log_dir) / f"sends-{slot}.jsonl"


def point_file(log_dir: str | Path, point: str) -> Path:
    """The file whose creation claims the kill at ``point``: it holds the victim's pid
    and the time it died (wall clock)."""
    return Path(log_dir) / f"kill-{point}"


def _die_at(log_dir: str, point: str) -> None:
    """Kill this process at ``point`` if no worker has died there yet.

    The claim is a hard link to a file already written, so the point's file
    exists whole or not at all, even if the test kills this process meanwhile.
    """
    draft = Path(log_dir) / f"draft-{point}-{os.getpid()}"
    draft.write_text(f"{os.getpid()} {time.time()!r}")
    try:
        os.link(draft, point_file(log_dir, point))
    except FileExistsError:
        return
    finally:
        draft.unlink()
    os.kill(os.getpid(), signal.SIGKILL)


def _append_line(path: Path, record: dict[str, Any]) -> None:
    """One JSON line, in one ``write`` with ``O_APPEND``, on disk before this returns."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _record_recorded(rows: Any, path: Path, slot: int) -> None:
    """After the inbox records a reply sent, append a ``recorded`` line for its messages."""
    recorded = rows.sent

    def sent(token: str) -> None:
        recorded(token)
        ids = _SENDING.get()
        if ids is not None:
            _append_line(path, {"event": "recorded", "pid": os.getpid(), "slot": slot,
                                "at": time.time(), "message_ids": ids})

    rows.sent = sent


class _ThinkingEngine(ScriptedEngine):
    """:class:`ScriptedEngine` that waits a little first, and dies mid-turn when marked."""

    def __init__(self, log_dir: str, marked: str, rng: random.Random) -> None:
        super().__init__()
        self._log_dir = log_dir
        self._marked = marked
        self._rng = rng

    async def generate_turn_async(self, agent: Agent, history: list[Message]) -> EngineTurnResult:
        await asyncio.sleep(self._rng.uniform(*THINK_SECONDS))
        asked = next(m.content or "" for m in reversed(history) if m.role == Role.USER)
        if self._marked in asked.split("\n"):
            _die_at(self._log_dir, "mid_turn")
        return await super().generate_turn_async(agent, history)


def inbox_worker(
    spec: StoreSpec,
    slot: int,
    log_dir: str,
    marks: dict[str, str],
    texts: dict[str, str],
    serve_options: dict[str, Any],
    store_options: dict[str, Any],
    seed: int,
    events: Any,
) -> None:
    """Serve the inbox until killed; die at each marked point the first time it is reached.

    Args:
        spec: How to open the store.
        slot: The worker's place in the fleet (names its sends file).
        log_dir: Where the sends files and the kill points' files live.
        marks: Kill point (:data:`KILL_POINTS`) -> the message id whose batch dies there.
        texts: Message id -> its text (the mid-turn point recognises its message by it).
        serve_options: Keywords of ``store.inbox.serve`` (besides ``send``).
        store_options: Keywords of the store (``turn_lease_seconds``).
        seed: Seeds the engine's waits.
        events: Gets ``("ready", pid)`` once the worker serves.

    """
    rng = random.Random(seed)
    store: Any = spec.open(default_max_turns=10_000, **store_options)
    engine = _ThinkingEngine(log_dir, texts[marks["mid_turn"]], rng)
    runner = Runner(
        starting_agent=Agent(name="Bot", instructions=""), session_store=store, engine=engine
    )
    sends = sends_file(log_dir, slot)

    async def handle(batch: Any) -> str | None:
        if marks["taken"] in batch.message_ids:
            _die_at(log_dir, "taken")
        result = await runner.run_async(session_id=batch.session_id, user_message=batch.text)
        return result.content

    async def send(reply: Any) -> None:
        if marks["after_commit"] in reply.message_ids:
            _die_at(log_dir, "after_commit")
        _append_line(sends, {
            "event": "sent", "pid": os.getpid(), "slot": slot, "at": time.time(),
            "session_id": reply.session_id, "message_ids": list(reply.message_ids),
            "text": reply.text,
        })
        _SENDING.set(list(reply.message_ids))
        if marks["after_send"] in reply.message_ids:
            _die_at(log_dir, "after_send")

    _record_recorded(store.inbox.rows, sends, slot)

    async def serve() -> None:
        events.put(("ready", os.getpid()))
        await store.inbox.serve(handle, send=send, **serve_options)

    asyncio.run(serve())
