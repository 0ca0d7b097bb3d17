"""Summaries: what a session remembers of the turns pruning dropped from its window.

A store opened with ``summarizer=`` keeps, with each session, one summary of
every turn its window no longer shows; the model sees it as one SYSTEM
message after the session's own. A write that prunes keeps the dropped
messages waiting and marks the session due; on the store's own thread and
event loop (so no turn waits for it) one process at a time claims the
session, runs the summarizer holding no lease and no connection, and applies
the summary as a turn of its own, only over the summary it was made from.

A summarizer that raises, returns something other than a str, or runs past
:data:`SUMMARY_TIMEOUT_SECONDS` never fails a turn: a warning is logged and
the messages wait for the next prune.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Protocol

from chatflow_agent import Message

from chatflow_sqlalchemy import telemetry
from chatflow_sqlalchemy.context import SessionContext
from chatflow_sqlalchemy.exceptions import SessionDeletedError
from chatflow_sqlalchemy.values import check_storable_text

__all__ = [
    "SUMMARY_TIMEOUT_SECONDS", "PendingSummary", "Summaries", "Summarizer", "SummaryRows",
    "validate_summarizer",
]

logger = logging.getLogger("chatflow_sqlalchemy")

Summarizer = Callable[[str | None, list[Message]], Awaitable[str]]
"""``(previous_summary, dropped) -> new summary``: any async callable, so any model."""

SUMMARY_TIMEOUT_SECONDS = 120.0
"""How long one summarizer call may run before it counts as failed."""

CLAIM_SECONDS = SUMMARY_TIMEOUT_SECONDS + 30.0  # a dead worker's claim lapses after this
CLOSE_GRACE_SECONDS = 10.0  # how long close waits for cancelled summaries to give claims back


def validate_summarizer(summarizer: object) -> Summarizer | None:
    """``summarizer`` if it is None or callable, else ``ValueError`` saying what it takes."""
    if summarizer is not None and not callable(summarizer):
        raise ValueError(
            "summarizer must be an async callable (previous_summary, dropped_messages) -> str, "
            f"or None; got {type(summarizer).__name__}"
        )
    return summarizer


@dataclass(frozen=True)
class PendingSummary:
    """What a claimed session's next summary is made from.

    Attributes:
        previous: The session's summary now (None before the first).
        through: The seq ``previous`` covers up to (0: none).
        dropped: The messages pruned since, oldest first.
        last_seq: The seq of the newest of them: what the new summary covers.
        incarnation: Which session of that id it was read from.

    """

    previous: str | None
    through: int
    dropped: list[Message]
    last_seq: int
    incarnation: object = None


class SummaryRows(Protocol):
    """Where a store keeps summaries' inputs (the SQL stores' and the in-memory store's)."""

    def claim(self, session_id: str) -> PendingSummary | None:
        """Claim the session's summarizing and read its input; None if held or nothing waits."""

    def give_up(self, session_id: str) -> None:
        """Give back a claim without a new summary (the messages wait for the next prune)."""

    def incarnation(self, ctx: SessionContext) -> object:
        """What tells ``ctx``'s session from a later one of the same id (as ``claim`` reads it)."""


async def _cancel_others() -> None:
    """Cancel every other task of the running loop and wait until each has ended."""
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _run(loop: asyncio.AbstractEventLoop) -> None:
    """The summaries' thread: run ``loop`` until stopped, let what is left end, close it.

    What is left: a cancellation ``close`` asked for while a summarizer blocked
    the thread, and what cancelled work started (giving a claim or lease back).
    """
    try:
        loop.run_forever()
        left = asyncio.all_tasks(loop)
        if left:
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
    finally:
        loop.close()


class Summaries:
    """Makes the summaries of one store's sessions, on a thread of its own.

    Args:
        summarizer: The store's ``summarizer``.
        rows: Where the store keeps summaries' inputs.
        context: The store's live context of a session (None if it is gone).
        system: The store's telemetry system name.
        on_loop: Called with the summaries' event loop when it starts.

    """

    def __init__(
        self,
        summarizer: Summarizer,
        rows: SummaryRows,
        context: Callable[[str], SessionContext | None],
        system: str,
        on_loop: Callable[[asyncio.AbstractEventLoop], None] | None = None,
    ) -> None:
        self._summarizer = summarizer
        self._rows = rows
        self._context = context
        self._system = system
        self._on_loop = on_loop
        self._mutex = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._running: dict[str, futures.Future[None]] = {}
        self._again: set[str] = set()
        self._closed = False

    def due(self, session_id: str) -> None:
        """A write pruned ``session_id``: summarize it, unless this store is doing so already."""
        with self._mutex:
            if self._closed:
                return
            if session_id in self._running:
                self._again.add(session_id)  # looked at again before that run ends
                return
            loop = self._started()
            # A fresh context: nothing of the caller's (a claim's fence, an inbox
            # batch, the async facade of its write) follows the work to this loop.
            self._running[session_id] = contextvars.Context().run(
                asyncio.run_coroutine_threadsafe, self._summarize(session_id), loop
            )

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no summary is being made; False if ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._mutex:
                running = next((f for f in self._running.values() if not f.done()), None)
            if running is None:
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            futures.wait([running], timeout=left)

    def close(self) -> None:
        """Stop: summaries in progress are dropped (their messages wait for the next prune).

        Their work is cancelled and awaited, so each gives its claim back (the
        next prune anywhere summarizes the session); a summarizer that will not
        stop is left behind after :data:`CLOSE_GRACE_SECONDS`.
        """
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        stopping = asyncio.run_coroutine_threadsafe(_cancel_others(), loop)
        with contextlib.suppress(Exception):  # (the grace running out too) stop all the same
            stopping.result(CLOSE_GRACE_SECONDS)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(CLOSE_GRACE_SECONDS if stopping.done() else 0.0)
        if thread.is_alive():  # a summarizer blocks the loop's thread (blocking code in it)
            logger.warning(
                "close: a summarizer blocks the summaries' thread; it is left to end on its "
                "own (its claim lapses); keep blocking calls out of the summarizer"
            )

    def _started(self) -> asyncio.AbstractEventLoop:
        """The summaries thread's event loop, started on first use (under ``_mutex``)."""
        if self._loop is None:
            loop = asyncio.new_event_loop()
            if self._on_loop is not None:
                self._on_loop(loop)
            thread = threading.Thread(
                target=_run, args=(loop,), name="chatflow-summaries", daemon=True
            )
            thread.start()
            self._loop, self._thread = loop, thread
        return self._loop

    async def _summarize(self, session_id: str) -> None:
        """Fold every message waiting for the session's summary into it, one claim at a time."""
        try:
            while True:
                with self._mutex:
                    self._again.discard(session_id)
                # The context before the claim: the summary goes to the session it is
                # made from, never to a new session under the id of one deleted meanwhile.
                try:
                    ctx = await asyncio.to_thread(self._context, session_id)
                    if ctx is None:
                        return
                    pending = await asyncio.to_thread(self._rows.claim, session_id)
                except Exception as exc:
                    logger.warning("could not read what session %r's summary is made from "
                                   "(%s: %s)", session_id, type(exc).__name__, exc)
                    await asyncio.to_thread(self._rows.give_up, session_id)
                    return
                if pending is not None:
                    await self._fold(ctx, pending)
                with self._mutex:
                    if session_id not in self._again:  # nothing pruned since the claim read
                        return
        finally:
            with self._mutex:
                self._running.pop(session_id, None)
                again = session_id in self._again  # a prune came after the last look
            if again:
                self.due(session_id)

    async def _fold(self, ctx: SessionContext, pending: PendingSummary) -> None:
        """Make one summary of ``ctx``'s session and apply it; a failure is logged."""
        session_id = ctx.session_id
        with telemetry.operation("summary", self._system) as op:
            op.set("chatflow.messages", len(pending.dropped))
            try:
                summary = await asyncio.wait_for(
                    self._call(pending.previous, list(pending.dropped)), SUMMARY_TIMEOUT_SECONDS
                )
                if not isinstance(summary, str):
                    raise TypeError(f"the summarizer returned {type(summary).__name__}, not str")
                check_storable_text(summary, "summary")
                await self._apply(ctx, pending, summary)
            except asyncio.CancelledError:
                await asyncio.to_thread(self._rows.give_up, session_id)
                raise
            except Exception as exc:
                logger.warning(
                    "could not summarize session %r (%s: %s); its %d pruned message(s) wait "
                    "for the next prune",
                    session_id, type(exc).__name__, exc, len(pending.dropped),
                )
                telemetry.count("chatflow.summaries.failed", 1, self._system)
                await asyncio.to_thread(self._rows.give_up, session_id)

    async def _call(self, previous: str | None, dropped: list[Message]) -> object:
        """The summarizer's answer; whatever else it raises but a cancellation is an Exception.

        A KeyboardInterrupt or SystemExit would stop this thread's loop (every
        later summary), and another BaseException would keep the claim held.
        """
        called = self._summarizer(previous, dropped)
        if not inspect.isawaitable(called):
            raise TypeError(
                f"the summarizer returned {type(called).__name__}, not an awaitable: "
                "make it an async function (async def ...)"
            )
        try:
            return await called
        except (asyncio.CancelledError, Exception):
            raise
        except BaseException as exc:
            raise RuntimeError(f"the summarizer raised {type(exc).__name__}: {exc}") from exc

    async def _apply(self, ctx: SessionContext, pending: PendingSummary, summary: str) -> None:
        """Store ``summary`` as a turn of ``ctx`` (if the claim read it), over its ``previous``."""
        applied = False
        if self._rows.incarnation(ctx) == pending.incarnation:
            with contextlib.suppress(SessionDeletedError):  # deleted meanwhile
                applied = await ctx.aapply_summary(summary, pending.through, pending.last_seq)
        if applied:
            telemetry.count("chatflow.summaries.written", 1, self._system)
        else:
            # A claim that went with its session's row is gone already; giving back
            # another worker's at worst lets a summary be made twice, never applied twice.
            await asyncio.to_thread(self._rows.give_up, ctx.session_id)
