"""The durable inbox: nothing lost after the webhook's 200, bursts answered as one turn.

A webhook puts each message into ``store.inbox`` (durable when ``put``
returns, idempotent by message id) and answers 200; workers of
``store.inbox.serve(handle, send=...)`` answer them, on any number of
processes. A worker takes a session with pending messages whose turn lease is
free and keeps the lease through the batch and its reply; a turn run by
``handle`` records the reply and the items' answered state in the
transaction that writes it, so a batch is never handled twice. Each store
provides the rows (:class:`InboxRows`); this module holds what is the same
everywhere: validation, the worker loop, the turn's hook.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import logging
import random
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol, TypeVar

from chatflow_sqlalchemy import telemetry
from chatflow_sqlalchemy.claims import validate_message_id
from chatflow_sqlalchemy.exceptions import LeaseLostError
from chatflow_sqlalchemy.values import (
    DEAD,
    DONE,
    IN_FLIGHT,
    INBOX_STATES,
    PENDING,
    SENT,
    SESSION_ID_MAX_LENGTH,
    InboxEntry,
    InboxStats,
    Lease,
    check_storable_text,
)

__all__ = [
    "DEAD", "DONE", "INBOX_STATES", "IN_FLIGHT", "MAX_COALESCE_FACTOR", "PENDING",
    "PURGE_EVERY_SECONDS", "SENT", "BatchFence", "Inbox", "InboxBatch", "InboxEntry",
    "InboxItem", "InboxReply", "InboxRows", "InboxStats", "Unsent", "active_batch",
    "check_serve_options", "parse_sent_at", "resumed_token",
]

logger = logging.getLogger("chatflow_sqlalchemy")

_T = TypeVar("_T")

MAX_COALESCE_FACTOR = 10
"""A session whose messages keep coming is served once its oldest one waited this many
coalesce windows."""

BATCH_LIMIT = 100  # messages per batch; the rest go to the next
_FIRST_POLL, _LAST_POLL = 0.005, 0.25  # an idle worker's backoff (a local put wakes it)
_MAX_RETRY_SECONDS = 3600.0
_SPREAD = 4  # ready sessions looked at per free slot, tried in random order
PURGE_EVERY_SECONDS = 300.0
"""How often a worker deletes the done and sent messages past the dedup window."""


@dataclass(frozen=True)
class InboxItem:
    """One inbound message, as ``handle`` sees it.

    Attributes:
        message_id: The platform's id (the dedup key).
        session_id: The conversation it belongs to.
        text: What the user wrote.
        sent_at: When the platform says it was sent (UTC), if it said.
        received_at: When the inbox stored it (the database's clock).
        payload: The JSON document given to ``put``, if any.
        attempts: How many batches took it, this one included.

    """

    message_id: str
    session_id: str
    text: str
    sent_at: datetime | None
    received_at: datetime
    payload: Any = None
    attempts: int = 1


@dataclass(frozen=True)
class InboxBatch:
    """The messages of one session answered as one turn, in order.

    Attributes:
        session_id: Their session.
        items: The messages, ordered by ``sent_at`` (when given) then arrival.

    """

    session_id: str
    items: tuple[InboxItem, ...]

    @property
    def text(self) -> str:
        """The items' texts, in order, joined by newlines: the turn's user message."""
        return "\n".join(item.text for item in self.items)

    @property
    def message_ids(self) -> tuple[str, ...]:
        """The items' message ids, in order."""
        return tuple(item.message_id for item in self.items)


@dataclass(frozen=True)
class InboxReply:
    """What ``send`` delivers: a batch's reply.

    Attributes:
        session_id: The session (on WhatsApp, the user's phone).
        text: The reply ``handle`` returned.
        message_ids: The messages it answers.

    """

    session_id: str
    text: str
    message_ids: tuple[str, ...]


@dataclass(frozen=True)
class Unsent:
    """A reply stored with its turn and not sent yet: a batch token and its reply."""

    token: str
    reply: InboxReply


@dataclass
class BatchFence:
    """A batch in progress, which a turn run by ``handle`` commits with (under its lease)."""

    session_id: str
    lease: Lease
    token: str
    size: int

    @property
    def open(self) -> bool:
        """``handle`` still runs (a task it started may outlive it)."""
        return self.lease.shared


_BATCH: contextvars.ContextVar[BatchFence | None] = contextvars.ContextVar(
    "chatflow_inbox_batch", default=None
)


def resumed_token(token: str, n: int) -> str:
    """The token under which a worker holding ``token`` sends its ``n``-th recovered reply."""
    return f"{token[:24]}{n:08x}"


def active_batch(session_id: str) -> BatchFence | None:
    """The inbox batch this code runs in, if it is ``session_id``'s."""
    batch = _BATCH.get()
    if batch is None or not batch.open or batch.session_id != session_id:
        return None
    return batch


class InboxRows(Protocol):
    """What a store provides for its inbox: its rows, and its sessions' leases.

    Every call is one short transaction (or one step under the in-memory
    store's lock). A call that takes a ``lease`` changes nothing once the
    lease is lost: it returns False or raises
    :class:`~chatflow_sqlalchemy.exceptions.LeaseLostError`.
    """

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run a blocking call off the event loop."""

    def put(
        self, message_id: str, session_id: str, text: str, sent_at: datetime | None, payload: Any
    ) -> bool:
        """Store a pending message; False if its id is already in the inbox."""

    def ready(self, coalesce_seconds: float, limit: int, busy: Collection[str]) -> list[str]:
        """Up to ``limit`` sessions, not in ``busy``, with a batch due and a free lease."""

    def take(self, session_id: str) -> Lease | None:
        """Take the session's lease (creating an empty session if none exists yet)."""

    def warm(self, lease: Lease) -> None:
        """Cache the session's context, so the Runner's sync ``get_or_create`` reads nothing."""

    def renew(self, lease: Lease) -> bool:
        """Move the lease on; False if it is lost."""

    def release(self, lease: Lease) -> None:
        """Give the lease back."""

    def open_batch(
        self, lease: Lease, token: str, max_attempts: int
    ) -> tuple[list[Unsent], list[InboxItem]]:
        """Recover what a dead holder left; return its unsent replies and the new batch's items."""

    def finish(self, lease: Lease, token: str, reply: str | None, to_send: bool) -> bool:
        """Store ``handle``'s reply; the items are done, or wait for ``send`` if ``to_send``."""

    def sent(self, token: str) -> None:
        """The batch's reply was sent (recorded whatever the lease, since it is true)."""

    def failed(
        self, lease: Lease, token: str, error: str, retry_in: float, max_attempts: int
    ) -> None:
        """``handle`` raised: pending again after ``retry_in`` seconds, or dead.

        Dead after ``max_attempts``, or at once if the batch's turn committed (it
        must not run twice).
        """

    def undeliverable(self, lease: Lease, token: str, error: str) -> None:
        """``send`` kept failing: the items are dead, their reply kept for a retry."""

    def abandon(self, lease: Lease, token: str) -> None:
        """``serve`` stopped during ``handle``: unanswered items pending again, uncounted."""

    def entries(self, state: str | None, limit: int | None) -> list[InboxEntry]:
        """Messages in arrival order, optionally of one state."""

    def retry(self, message_id: str) -> bool:
        """A dead message (with its dead batch) back to pending; False if it is not dead."""

    def stats(self) -> InboxStats:
        """Counts per state, oldest pending age, dead in the last hour."""

    def purge(self, older_than_seconds: float) -> int:
        """Delete done and sent messages older than that; return how many."""


Handle = Callable[[InboxBatch], Awaitable[str | None]]
Send = Callable[[InboxReply], Awaitable[None]]


class Inbox:
    """A store's durable inbox (``store.inbox``): put messages, serve them, inspect them.

    Args:
        rows: The store's inbox rows.
        lease_seconds: The store's ``turn_lease_seconds``: a batch's lease.
        dedup_seconds: How long done and sent messages stay, refusing their id.
        system: The database, for telemetry.

    """

    def __init__(
        self, rows: InboxRows, *, lease_seconds: float, dedup_seconds: float, system: str
    ) -> None:
        self.rows = rows
        self.lease_seconds = lease_seconds
        self.system = system
        self._dedup_seconds = dedup_seconds
        self._wakers: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._wakers_lock = threading.Lock()

    def put(
        self,
        message_id: str,
        *,
        session_id: str,
        text: str,
        sent_at: datetime | int | float | str | None = None,
        payload: Any = None,
    ) -> bool:
        """Store an inbound message; durable when this returns.

        Args:
            message_id: The platform's message id (the dedup key).
            session_id: The conversation (on WhatsApp, the sender's phone).
            text: The message's text.
            sent_at: The platform's timestamp: an aware ``datetime``, or epoch
                seconds as int, float or digit string (as WhatsApp sends it).
            payload: Any JSON document to keep with the message.

        Returns:
            False if the id is already in the inbox (a redelivery): do nothing more.

        Raises:
            ValueError: A bad argument (the message says which and why).

        """
        args = _checked(message_id, session_id, text, sent_at, payload)
        with telemetry.operation("inbox.put", self.system):
            return self._received(self.rows.put(*args))

    async def aput(
        self,
        message_id: str,
        *,
        session_id: str,
        text: str,
        sent_at: datetime | int | float | str | None = None,
        payload: Any = None,
    ) -> bool:
        """:meth:`put` without blocking the event loop."""
        args = _checked(message_id, session_id, text, sent_at, payload)
        with telemetry.operation("inbox.put", self.system):
            return self._received(await self.rows.run(self.rows.put, *args))

    def _received(self, accepted: bool) -> bool:
        if accepted:
            telemetry.count("chatflow.inbox.received", 1, self.system)
            self.wake()
        return accepted

    async def serve(
        self,
        handle: Handle,
        *,
        send: Send | None = None,
        concurrency: int = 4,
        coalesce_seconds: float = 1.0,
        max_attempts: int = 5,
        retry_seconds: float = 1.0,
    ) -> None:
        """Answer the inbox's messages until cancelled.

        Args:
            handle: ``async handle(batch) -> reply``: runs the batch's turn and
                returns the reply (None: nothing to send).
            send: ``async send(reply)``: delivers a reply; retried with
                backoff on failure, never re-running the turn.
            concurrency: Batches (of distinct sessions) in flight at once.
            coalesce_seconds: A session's messages closer than this are one batch.
            max_attempts: Batches (and sends) tried before the messages are dead.
            retry_seconds: First backoff after a failure; it doubles each time.

        Raises:
            ValueError: A bad argument.

        """
        check_serve_options(concurrency, coalesce_seconds, max_attempts, retry_seconds)
        await _Worker(self, handle, send, concurrency, float(coalesce_seconds), max_attempts,
                      float(retry_seconds)).run()

    def entries(self, *, state: str | None = None, limit: int | None = 100) -> list[InboxEntry]:
        """Messages in arrival order, optionally of one state (``inbox list``)."""
        return self.rows.entries(_checked_state(state), limit)

    def retry(self, message_id: str) -> bool:
        """Give a dead message another try, with the rest of its batch; False if not dead."""
        return self.rows.retry(validate_message_id(message_id))

    def stats(self) -> InboxStats:
        """Counts per state, oldest pending age, dead in the last hour (``inbox stats``)."""
        return self.rows.stats()

    def purge(self) -> int:
        """Delete done and sent messages past the dedup window; return how many."""
        return self.rows.purge(self._dedup_seconds)

    async def aentries(
        self, *, state: str | None = None, limit: int | None = 100
    ) -> list[InboxEntry]:
        """:meth:`entries` without blocking the event loop."""
        return await self.rows.run(self.rows.entries, _checked_state(state), limit)

    async def aretry(self, message_id: str) -> bool:
        """:meth:`retry` without blocking the event loop."""
        return await self.rows.run(self.rows.retry, validate_message_id(message_id))

    async def astats(self) -> InboxStats:
        """:meth:`stats` without blocking the event loop."""
        return await self.rows.run(self.rows.stats)

    async def apurge(self) -> int:
        """:meth:`purge` without blocking the event loop."""
        return await self.rows.run(self.rows.purge, self._dedup_seconds)

    def waker(self) -> asyncio.Event:
        """An event a local ``put`` sets (so a worker here need not poll for it)."""
        event = asyncio.Event()
        with self._wakers_lock:
            self._wakers.add((asyncio.get_running_loop(), event))
        return event

    def drop_waker(self, event: asyncio.Event) -> None:
        """Stop setting ``event``."""
        with self._wakers_lock:
            self._wakers = {pair for pair in self._wakers if pair[1] is not event}

    def wake(self) -> None:
        """Set every local worker's waker: there may be work (a put, a batch finished)."""
        with self._wakers_lock:
            wakers = list(self._wakers)
        for loop, event in wakers:
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)


class _Worker:
    """One ``serve`` call: finds ready sessions and runs their batches."""

    def __init__(
        self, inbox: Inbox, handle: Handle, send: Send | None, concurrency: int,
        coalesce_seconds: float, max_attempts: int, retry_seconds: float,
    ) -> None:
        self._inbox = inbox
        self._rows = inbox.rows
        self._handle = handle
        self._send = send
        self._concurrency = concurrency
        self._coalesce = coalesce_seconds
        self._max_attempts = max_attempts
        self._retry = retry_seconds
        self._running: dict[str, asyncio.Task[None]] = {}
        self._orphans: set[asyncio.Future[Any]] = set()
        """Work a stop does not cancel (a take, a give-back, a record): run waits for it."""
        self._stopping = False

    async def run(self) -> None:
        wake = self._inbox.waker()
        idle = _FIRST_POLL
        next_purge = time.monotonic()
        try:
            while True:
                wake.clear()
                if time.monotonic() >= next_purge:
                    next_purge = time.monotonic() + PURGE_EVERY_SECONDS
                    try:
                        await self._inbox.apurge()
                    except Exception as exc:  # upkeep: the next one will do
                        logger.warning("inbox: could not purge answered messages: %s", exc)
                started = await self._start_ready()
                idle = _FIRST_POLL if started else min(idle * 2, _LAST_POLL)
                await _until_woken(wake, idle)
        finally:
            self._stopping = True
            self._inbox.drop_waker(wake)
            running = list(self._running.values())
            for task in running:
                task.cancel()
            if running:
                await asyncio.wait(running)
            while self._orphans:  # a take that finishes now starts its give-back: loop
                await asyncio.wait(set(self._orphans))

    async def _start_ready(self) -> int:
        """Take the lease of each ready session there is room for; start its batch."""
        room = self._concurrency - len(self._running)
        if room <= 0:
            return 0
        try:
            ready = await self._rows.run(
                self._rows.ready, self._coalesce, room * _SPREAD, frozenset(self._running)
            )
        except Exception as exc:  # the database is away: look again later
            logger.warning("inbox: could not look for ready sessions: %s", exc)
            return 0
        random.shuffle(ready)  # workers seeing the same oldest sessions race less for them
        started = 0
        for session_id in ready:
            if started == room:
                break
            lease = await self._take(session_id)
            if lease is None:
                continue
            task = asyncio.get_running_loop().create_task(self._serve_session(lease))
            self._running[session_id] = task
            task.add_done_callback(functools.partial(self._finished, session_id))
            started += 1
        return started

    def _finished(self, session_id: str, _: asyncio.Task[None]) -> None:
        self._running.pop(session_id, None)
        self._inbox.wake()

    async def _take(self, session_id: str) -> Lease | None:
        """Take the lease; one taken as the worker is cancelled is given back."""
        take = self._keep(self._rows.run(self._rows.take, session_id))
        try:
            return await asyncio.shield(take)
        except asyncio.CancelledError:
            take.add_done_callback(self._give_back_orphan)
            raise
        except Exception as exc:
            logger.warning("inbox: could not take session %r: %s", session_id, exc)
            return None

    def _give_back_orphan(self, take: asyncio.Future[Lease | None]) -> None:
        if take.cancelled() or take.exception() is not None:
            return
        lease = take.result()
        if lease is not None:
            self._keep(self._rows.run(self._rows.release, lease))

    def _keep(self, work: Awaitable[_T]) -> asyncio.Future[_T]:
        """Run ``work`` as a task of its own that :meth:`run` waits for before it returns.

        Cancelling the caller does not stop it (see :meth:`_shielded`), and
        no task of the worker outlives ``serve``: the app's lifespan (or a
        test) that stops it finds the inbox's work done, not still running
        (a lease given back, a reply recorded as sent).
        """
        task = asyncio.ensure_future(work)
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)
        return task

    async def _shielded(self, work: Awaitable[_T]) -> _T:
        """Finish ``work`` even if the caller is cancelled meanwhile (the caller still is)."""
        return await asyncio.shield(self._keep(work))

    async def _serve_session(self, lease: Lease) -> None:
        """Send what a dead holder answered, then run one batch; always give the lease back."""
        renewal = self._keep(self._renew(lease))  # cancelled below; run waits for its end
        try:
            token = secrets.token_hex(16)
            unsent, items = await self._rows.run(
                self._rows.open_batch, lease, token, self._max_attempts
            )
            try:
                for answered in unsent:
                    await self._deliver(lease, answered.token, answered.reply)
            except BaseException:  # the new messages were not handled: not an attempt
                if items:
                    await self._shielded(self._rows.run(self._rows.abandon, lease, token))
                raise
            if items:
                await self._run_batch(lease, token, tuple(items))
        except LeaseLostError:
            logger.warning("inbox: lost the lease of session %r: it expired, another worker "
                           "took it over, or the session was deleted", lease.session_id)
        except Exception:
            logger.exception("inbox: serving session %r failed; it is tried again",
                             lease.session_id)
        finally:
            renewal.cancel()
            try:
                await self._shielded(self._rows.run(self._rows.release, lease))
            except Exception as exc:
                logger.warning("inbox: could not give back session %r (its lease expires on "
                               "its own): %s", lease.session_id, exc)

    async def _renew(self, lease: Lease) -> None:
        while True:
            await asyncio.sleep(self._inbox.lease_seconds / 3)
            try:
                if not await self._rows.run(self._rows.renew, lease):
                    logger.warning("inbox: lost the lease of session %r", lease.session_id)
                    return
            except Exception as exc:
                logger.warning("inbox: could not renew session %r: %s", lease.session_id, exc)

    async def _run_batch(self, lease: Lease, token: str, items: tuple[InboxItem, ...]) -> None:
        batch = InboxBatch(lease.session_id, items)
        fence = BatchFence(lease.session_id, lease, token, len(items))
        system = self._inbox.system
        lease.shared = True
        reset = _BATCH.set(fence)
        try:
            with telemetry.operation("inbox.batch", system, **{"inbox.items": len(items)}):
                await self._rows.run(self._rows.warm, lease)
                reply = await self._handle(batch)
        except (asyncio.CancelledError, Exception) as exc:
            if isinstance(exc, asyncio.CancelledError) and self._stopping:
                # serve stops (a deploy): not the batch's fault
                await self._shielded(self._rows.run(self._rows.abandon, lease, token))
                raise
            await self._failed(lease, token, items, exc)  # a cancellation inside handle too
            return
        finally:
            lease.shared = False  # a task handle started takes its own lease from now on
            _BATCH.reset(reset)
        if reply is not None and not isinstance(reply, str):
            await self._failed(lease, token, items, TypeError(
                f"handle must return the reply as str or None, got {type(reply).__name__}"))
            return
        reply = reply or None  # an empty reply is nothing to send
        to_send = self._send is not None and reply is not None
        finish = self._rows.run(self._rows.finish, lease, token, reply, to_send)
        if not await self._shielded(finish):  # handle's work is kept even if serve stops now
            raise LeaseLostError(lease.session_id)
        telemetry.count("chatflow.inbox.answered", len(items), system)
        if to_send:
            assert reply is not None
            answer = InboxReply(lease.session_id, reply, batch.message_ids)
            await self._deliver(lease, token, answer)

    async def _failed(
        self, lease: Lease, token: str, items: tuple[InboxItem, ...], exc: BaseException
    ) -> None:
        telemetry.count("chatflow.inbox.failed", len(items), self._inbox.system)
        attempts = max(item.attempts for item in items)
        retry_in = min(self._retry * 2 ** (attempts - 1), _MAX_RETRY_SECONDS)
        logger.warning("inbox: handling %d message(s) of session %r failed (attempt %d of %d): "
                       "%s", len(items), lease.session_id, attempts, self._max_attempts,
                       _describe(exc))
        await self._rows.run(
            self._rows.failed, lease, token, _describe(exc), retry_in, self._max_attempts
        )

    async def _deliver(self, lease: Lease, token: str, reply: InboxReply) -> None:
        """``send`` the reply, retried with backoff; dead after ``max_attempts`` failures."""
        if self._send is None:  # a reply stored by a worker that had a send
            await self._rows.run(self._rows.finish, lease, token, reply.text, False)
            return
        system = self._inbox.system
        delay = self._retry
        error = ""
        for attempt in range(1, self._max_attempts + 1):
            if attempt > 1 and not await self._rows.run(self._rows.renew, lease):
                raise LeaseLostError(lease.session_id)  # the new holder sends it
            try:
                with telemetry.operation("inbox.send", system):
                    await self._send(reply)
            except Exception as exc:
                telemetry.count("chatflow.inbox.send_failures", 1, system)
                error = _describe(exc)
                logger.warning("inbox: sending the reply of session %r failed (attempt %d of "
                               "%d): %s", reply.session_id, attempt, self._max_attempts, error)
                if attempt < self._max_attempts:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, _MAX_RETRY_SECONDS)
                continue
            # Sent: recorded even if serve is stopping meanwhile, or it would be sent again.
            await self._shielded(self._rows.run(self._rows.sent, token))
            return
        await self._rows.run(self._rows.undeliverable, lease, token, f"send failed: {error}")


async def _until_woken(wake: asyncio.Event, timeout: float) -> None:
    """Wait for ``wake`` at most ``timeout`` seconds.

    Not ``asyncio.wait_for``: before Python 3.12 it can swallow a
    cancellation that arrives as the event is set, and ``serve`` would then
    never stop.
    """
    woken = asyncio.ensure_future(wake.wait())
    try:
        await asyncio.wait({woken}, timeout=timeout)
    finally:
        woken.cancel()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _checked(
    message_id: object, session_id: object, text: object, sent_at: object, payload: object
) -> tuple[str, str, str, datetime | None, Any]:
    checked_id = validate_message_id(message_id)
    if not isinstance(session_id, str) or not session_id:
        raise ValueError(f"session_id must be a non-empty str, got {session_id!r}")
    if len(session_id) > SESSION_ID_MAX_LENGTH:
        raise ValueError(f"session_id is longer than {SESSION_ID_MAX_LENGTH} characters")
    check_storable_text(session_id, "session_id")
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    check_storable_text(text, "text")
    if payload is not None:
        try:
            json.dumps(payload, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"payload must be JSON-serialisable: {exc}") from None
    return checked_id, session_id, text, parse_sent_at(sent_at), payload


def parse_sent_at(value: object) -> datetime | None:
    """The platform's timestamp as an aware UTC ``datetime`` (None stays None).

    Raises:
        ValueError: Neither an aware datetime nor epoch seconds (int, float or
            a string of digits, WhatsApp's ``timestamp``).

    """
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError("sent_at must be timezone-aware (e.g. datetime.now(timezone.utc))")
        return value.astimezone(timezone.utc)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return datetime.fromtimestamp(value, timezone.utc)
        except (OverflowError, OSError, ValueError):
            pass
    raise ValueError(
        f"sent_at must be an aware datetime or epoch seconds (int, float or digits), "
        f"got {value!r}"
    )


def _checked_state(state: str | None) -> str | None:
    if state is not None and state not in INBOX_STATES:
        raise ValueError(f"unknown inbox state {state!r}; use one of {', '.join(INBOX_STATES)}")
    return state


def check_serve_options(
    concurrency: int, coalesce_seconds: float, max_attempts: int, retry_seconds: float
) -> None:
    """``serve``'s options, checked; a bad one raises ``ValueError`` naming it."""
    counts: tuple[tuple[str, object], ...] = (
        ("concurrency", concurrency), ("max_attempts", max_attempts)
    )
    for name, value in counts:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name, value in (("coalesce_seconds", coalesce_seconds), ("retry_seconds", retry_seconds)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number of seconds, got {value!r}")
        if not 0 <= value <= 86400:  # NaN too
            raise ValueError(f"{name} must be between 0 and 86400 seconds, got {value!r}")
