"""Webhook claims: exactly-once, in-order processing of platform deliveries.

``store.claim(message_id, *, session_id=None, lease_seconds=60.0)`` returns a
:class:`WebhookClaim`, used as ``async with`` (or ``with``)::

    async with store.claim(message_id, session_id=phone) as claim:
        if not claim.acquired:
            return claim.response      # "done": the stored reply; "in_flight": None
        result = await runner.run_async(session_id=phone, user_message=text)
        claim.response = result.content

How it holds (one row of ``chatflow_processed_messages`` per id):

* **Acquire** is one atomic statement (:meth:`DialectSupport.acquire_claim`):
  insert the id as ``acquired`` with a random fencing ``token`` and a lease,
  or take over a ``released`` row, an expired lease, or an id past the dedup
  TTL. Exactly one of any number of racing workers gets it.
* **Lease**: renewed in the background every third of ``lease_seconds``
  while the block runs (an asyncio task, or a thread for ``with``), only
  while the token still holds. A worker that dies stops renewing, and the
  next delivery after the lease takes the id over with a new token. Lease
  times are the database's clock on the SQL stores, never a worker's
  (:class:`~chatflow_sqlalchemy.clock.DatabaseNow`).
* **Fencing**: a turn run inside the block on ``session_id`` (the Runner's
  ``session.lock``) marks the claim done in the same transaction as its
  messages, with ``WHERE token = :ours``; if the token is gone the
  transaction rolls back, nothing of the turn is written and
  :class:`~chatflow_sqlalchemy.exceptions.ClaimLostError` is raised. The
  store finds the claim through a ``ContextVar`` read on the caller's side
  (the store's I/O threads do not see the caller's context).
* **Exit**: normal exit marks the claim done and stores ``claim.response``;
  an exception releases it (a claim whose turn committed stays done).
* **Order**: claims with a ``session_id`` get a ticket from the database
  (a sequence, or ``MAX + 1`` under SQLite's write lock) on first insert.
  Within one process the claims of a session send their acquire in the
  order they were entered, so their tickets follow call order.
  An acquired claim's block starts only when no earlier ticket of the same
  session is still ``acquired``, under a live lease or one that lapsed less
  than ``lease_seconds`` (this claim's) ago: a dead holder's message is
  usually redelivered and taken over within that time, and then goes first.
  The wait is bounded by the earlier claims: each one ends, is released, or
  stops being renewed (its worker died), lapses ``lease_seconds`` later and
  stops counting one lease after that, so a dead predecessor that is never
  redelivered holds the session back at most its remaining lease plus one
  lease. A live worker stuck inside its block keeps renewing; ``dedup
  release ID`` frees it.

Operators: :func:`list_claims` (``dedup list``) and :func:`release_claim`
(``dedup release ID``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import logging
import secrets
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, cast

from chatflow_sqlalchemy.values import (
    CLAIM_ACQUIRED,
    CLAIM_DONE,
    CLAIM_RELEASED,
    DEFAULT_DEDUP_TTL_HOURS,
    SESSION_ID_MAX_LENGTH,
    check_storable_text,
    utcnow,
    validate_page_limit,
)

if TYPE_CHECKING:
    from chatflow_agent import Message

# chatflow-agent (and the errors, which load it) are imported where they are used:
# ``dedup list`` reads claims without them.

__all__ = [
    "DEFAULT_DEDUP_TTL_HOURS",
    "DEFAULT_LEASE_SECONDS",
    "MAX_DEDUP_TTL_HOURS",
    "MAX_LEASE_SECONDS",
    "Acquisition",
    "ClaimFence",
    "ClaimInfo",
    "ClaimStatus",
    "MemoryClaims",
    "WebhookClaim",
    "active_fence",
    "claim_info",
    "claimed_session_version",
    "list_claims",
    "release_claim",
    "reply_of",
    "validate_dedup_ttl",
    "validate_lease",
    "validate_message_id",
]

_T = TypeVar("_T")
_Run = Callable[..., Coroutine[Any, Any, Any]]
"""How a claim's step runs a backend call: ``await run(fn, *args)`` is ``fn(*args)``."""
_Sleep = Callable[[float], Coroutine[Any, Any, None]]

logger = logging.getLogger("chatflow_sqlalchemy")

MAX_DEDUP_TTL_HOURS = 876_000
"""Longest accepted dedup window: 100 years. Every database can store a cutoff that
far back, which ``now - ttl`` must be."""

DEFAULT_LEASE_SECONDS = 60.0
MAX_LEASE_SECONDS = 30 * 86400.0
"""Longest lease accepted (longer ones overflow date arithmetic, or never lapse in practice)."""

ClaimStatus = Literal["acquired", "done", "in_flight"]

_ORDER_WAIT_MAX = 5.0
"""Seconds a claim waits for the acquire of the claim entered before it (see _CallOrder)."""

_ORDER_POLL_MIN = 0.005
_ORDER_POLL_MAX = 0.1
"""Seconds between checks for earlier claims of the session (doubling up to the max)."""

class _CallOrder:
    """The claims of one session, in this process, send their acquire in call order.

    A claim takes its place when it is entered and sends its acquire once the
    claim entered before it (same store, same session) has had its answer, so
    the tickets the database draws follow the order the claims were entered
    in. Best effort, never a stall: a claim waits for the one before it at
    most ``_ORDER_WAIT_MAX`` seconds (the one before may sit on a stopped
    loop), and gives its place up as soon as its own acquire returned.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[tuple[object, str], concurrent.futures.Future[None]] = {}

    def take_place(self, claim: WebhookClaim) -> _Place:
        """Give ``claim`` its place, behind the claim of its session entered before it."""
        if claim.session_id is None:
            return _Place(None, None, None)
        key = (claim._backend, claim.session_id)
        mine: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            before = self._last.get(key)
            self._last[key] = mine
        return _Place(key, before, mine)

    def leave(self, place: _Place) -> None:
        """The claim had its answer: the next one may send its acquire."""
        if place.key is None or place.mine is None:
            return
        with self._lock:
            if self._last.get(place.key) is place.mine:
                del self._last[place.key]
        if not place.mine.done():
            place.mine.set_result(None)


@dataclass(frozen=True)
class _Place:
    key: tuple[object, str] | None
    before: concurrent.futures.Future[None] | None
    mine: concurrent.futures.Future[None] | None


_CALL_ORDER = _CallOrder()

_LATE_RELEASES: set[asyncio.Future[bool]] = set()
"""Releases of claims acquired after their handler was cancelled (kept until done)."""

_ACTIVE: contextvars.ContextVar[WebhookClaim | None] = contextvars.ContextVar(
    "chatflow_webhook_claim", default=None
)


def validate_message_id(message_id: object) -> str:
    """Return ``message_id`` if usable as a webhook id, else raise ``ValueError``."""
    if not isinstance(message_id, str) or not message_id:
        raise ValueError(f"message_id must be a non-empty str, got {message_id!r}")
    if len(message_id) > SESSION_ID_MAX_LENGTH:
        raise ValueError(f"message_id is longer than {SESSION_ID_MAX_LENGTH} characters")
    check_storable_text(message_id, "message_id")  # refused on every backend alike
    return message_id


def validate_dedup_ttl(value: object) -> float:
    """``dedup_ttl_hours`` as a float, if within ``0 < value <= MAX_DEDUP_TTL_HOURS``.

    Checked when a store is built: a window reaching back before year 1 (or
    an infinite or NaN one) would only fail at the first claim.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value <= MAX_DEDUP_TTL_HOURS
    ):
        raise ValueError(
            f"dedup_ttl_hours must be a number of hours with 0 < dedup_ttl_hours <= "
            f"{MAX_DEDUP_TTL_HOURS} (100 years), got {value!r}"
        )
    return float(value)


def validate_lease(value: object) -> float:
    """Return ``value`` as seconds if it is a usable lease, else raise ``ValueError``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value <= MAX_LEASE_SECONDS  # also refuses NaN
    ):
        raise ValueError(
            f"lease_seconds must be a positive number of seconds, at most "
            f"{MAX_LEASE_SECONDS:.0f} (30 days), got {value!r}"
        )
    return float(value)


@dataclass
class ClaimFence:
    """What a turn needs to commit its claim: the id, the token, and whether it did.

    Attributes:
        message_id: The claimed webhook id.
        token: This holder's token (the fence holds while the row still has it).
        committed: The turn's write marked the claim done.
        reply: The reply that write stored with the claim (the model answer
            the turn added, see :func:`reply_of`); the block's exit stores
            ``claim.response`` only if it differs.
        partition_day: The day partition the claim's row was in when taken
            (see :class:`~chatflow_sqlalchemy.dialect.AcquiredClaim`), or None:
            none known, or the turn's write did not find the row from that day
            on (it then looks in every day).

    """

    message_id: str
    token: str
    committed: bool = False
    reply: str | None = None
    partition_day: date | None = None

    def params(self, now: datetime, reply: str | None) -> dict[str, Any]:
        """Parameters of :data:`FENCE_CLAIM`: the claim, the time, the reply stored with it.

        With a ``partition_day``, also ``claim_day``: a backend partitioned by
        day may look for the row from that day on (rows only ever move to a
        later day, see :mod:`~chatflow_sqlalchemy.backends.postgresql_claims`).
        """
        params: dict[str, Any] = {
            "claim_id": self.message_id,
            "claim_token": self.token,
            "claim_now": now,
            "claim_reply": reply,
        }
        if self.partition_day is not None:
            params["claim_day"] = self.partition_day
        return params


def reply_of(added: Message | None) -> str | None:
    """The reply a claimed turn stores with its claim: ``added``'s text, if it is an answer.

    ``added`` is the last message the turn added (None: it added none). A
    model answer without tool calls is what ``Runner.run_async`` returns as
    ``content``; the turn's write stores it with the claim, so the block's
    ``claim.response = result.content`` needs no statement of its own.

    Raises:
        ValueError: The answer holds text a claim cannot store as its reply
            (see :func:`~chatflow_sqlalchemy.values.check_storable_text`),
            raised before the turn is written, so the turn is discarded and
            the claim released rather than done without its reply.

    """
    from chatflow_agent import Role

    if added is None or added.role != Role.MODEL or added.tool_calls:
        return None
    if added.content is not None:
        _check_reply(added.content, "the model's reply")
    return added.content


def _check_reply(reply: str, name: str) -> None:
    try:
        check_storable_text(reply, name)
    except ValueError as exc:
        raise ValueError(
            f"{exc}; a webhook claim stores the reply as text on every backend (with "
            "PostgreSQL's text type no NUL): clean the model's output (an output guardrail "
            "or a wrapper engine), or run this turn outside store.claim"
        ) from None


def active_fence(session_id: str) -> ClaimFence | None:
    """The fence of the claim block this code runs in, if it claimed ``session_id``.

    Read it on the caller's side (the event-loop task), before handing work
    to a thread: the store's I/O threads do not carry the caller's context.
    """
    claim = _ACTIVE.get()
    if claim is None or claim._fence is None or claim.session_id != session_id:
        return None
    return claim._fence


def claimed_session_version(session_id: str, backend: ClaimBackend) -> tuple[bool, int | None]:
    """The version of ``session_id`` read with the active claim's acquire, once.

    Returns ``(True, version or None if no such session)`` the first time it
    is asked inside a claim block of ``backend`` for the claimed session, on
    backends whose acquire reads it; ``(False, None)`` otherwise. The turn's
    lease reads the version again (the turn then catches up or finds the
    session gone), so the block's first ``get_or_create`` uses it instead of
    a round trip of its own.
    """
    claim = _ACTIVE.get()
    if (
        claim is None
        or claim._backend is not backend
        or claim.session_id != session_id
        or not claim._version_read
    ):
        return False, None
    claim._version_read = False
    return True, claim._session_version


@dataclass(frozen=True)
class ClaimInfo:
    """One row of ``dedup list``.

    Attributes:
        message_id: The webhook id.
        state: ``in_flight`` (held under a live lease), ``expired`` (held, but
            its lease lapsed: the next delivery takes it over), ``done`` or
            ``released``.
        session_id: The session the claim was made for, if any.
        ticket: Its place in its session's order, if any.
        lease_age: Seconds since this holder acquired the id
            (``in_flight`` / ``expired`` only).
        lease_left: Seconds until the lease lapses (negative once it has).
        updated_at: When the row last changed state.
        has_response: Whether a reply is stored.

    """

    message_id: str
    state: str
    session_id: str | None
    ticket: int | None
    lease_age: float | None
    lease_left: float | None
    updated_at: datetime
    has_response: bool


class Renewal:
    """A lease renewed every ``interval`` seconds while a block runs; only a timer until then.

    Most blocks end before their first renewal is due: they pay for a timer,
    not for a task. The first beat starts ``beat()`` as a task, which renews
    at once and then keeps its own pace. :meth:`stop` cancels either, and
    waits for a renewal under way to end.
    """

    __slots__ = ("_task", "_timer")

    def __init__(self, interval: float, beat: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._task: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(interval, self._start, beat)

    def _start(self, beat: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._task = asyncio.get_running_loop().create_task(beat())

    async def stop(self) -> None:
        """Stop renewing; a cancellation of the caller still raises."""
        self._timer.cancel()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])


@dataclass(frozen=True)
class Acquisition:
    """What a backend's acquire decided; the claim applies it to itself.

    Attributes:
        acquired: This delivery holds the id under the claim's token.
        done: Not acquired: the id is processed (else another worker holds it).
        response: The stored reply of a done id.
        ticket: The claim's place in its session's order.
        partition_day: The day of the row, where claims are partitioned by day.
        session_version: The claimed session's version, read with the acquire
            (None: no such session, or not read).
        version_read: Whether ``session_version`` was read.
        earlier_seen: Whether an earlier claim of the session was in flight
            when this one was taken (True where the acquire did not look).

    """

    acquired: bool
    done: bool = False
    response: str | None = None
    ticket: int | None = None
    partition_day: date | None = None
    session_version: int | None = None
    version_read: bool = False
    earlier_seen: bool = True

    @property
    def status(self) -> ClaimStatus:
        """The claim's status as decided: acquired, done or in flight."""
        return "acquired" if self.acquired else "done" if self.done else "in_flight"


class ClaimBackend(Protocol):
    """What a store provides to :class:`WebhookClaim` (sync calls; ``run`` for async)."""

    def acquire(self, claim: WebhookClaim) -> Acquisition: ...

    def renew(self, claim: WebhookClaim) -> bool: ...

    def finish(self, claim: WebhookClaim) -> bool: ...

    def finishes_in_memory(self, claim: WebhookClaim) -> bool: ...

    def release(self, claim: WebhookClaim) -> None: ...

    def earlier_in_flight(self, claim: WebhookClaim) -> bool: ...

    def list(self, limit: int | None) -> list[ClaimInfo]: ...

    def free(self, message_id: str) -> bool: ...

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T: ...


class WebhookClaim:
    """One delivery's claim on a webhook id; see the module docstring.

    Attributes:
        message_id: The webhook id.
        session_id: The session whose turns it orders and fences (or None).
        lease_seconds: How long the claim survives without renewal.
        acquired: True when this delivery does the work.
        status: ``"acquired"`` (ours), ``"done"`` (processed; ``response``
            holds the stored reply) or ``"in_flight"`` (another worker holds
            it under a live lease).
        response: The reply: set it inside the block to have it stored; for
            a done id, the stored one. A str or None (``TypeError`` otherwise:
            ``json.dumps`` structured data), without NUL (``ValueError``).

    """

    def __init__(
        self,
        backend: ClaimBackend,
        message_id: str,
        *,
        session_id: str | None,
        lease_seconds: float,
    ) -> None:
        self._backend = backend
        self.message_id = message_id
        self.session_id = session_id
        self.lease_seconds = validate_lease(lease_seconds)
        self.acquired = False
        self.status: ClaimStatus = "in_flight"
        self._response: str | None = None
        self.token: str | None = None
        self.ticket: int | None = None
        self.lost = False
        self.earlier_seen = True
        """Whether an earlier claim of the session was in flight when this one was taken
        (True also where the acquire did not look: look again)."""
        self._fence: ClaimFence | None = None
        self._version_read = False
        self._session_version: int | None = None
        self._entered = False
        self._var_token: contextvars.Token[WebhookClaim | None] | None = None
        self._renewal: Renewal | None = None
        self._stop = threading.Event()

    @property
    def response(self) -> str | None:
        """The reply stored with the claim (see the class docstring)."""
        return self._response

    @response.setter
    def response(self, value: str | None) -> None:
        if value is not None and not isinstance(value, str):
            raise TypeError(
                f"claim.response must be a str or None, got {type(value).__name__}: store "
                "text (json.dumps(value) for structured data, value.decode('utf-8') for bytes)"
            )
        if value is not None:
            _check_reply(value, "claim.response")
        self._response = value

    @property
    def stored_with_turn(self) -> bool:
        """The claim's turn marked it done in its own write, with this very reply."""
        fence = self._fence
        return fence is not None and fence.committed and fence.reply == self._response

    def lease_until(self, now: datetime) -> datetime:
        """When a lease taken or renewed at ``now`` lapses."""
        return now + timedelta(seconds=self.lease_seconds)

    def order_horizon(self, now: datetime) -> datetime:
        """Earlier claims whose lease lapsed after this instant still hold this one back.

        A holder that died leaves its claim ``acquired`` with a lapsed lease;
        its message is usually redelivered and taken over soon after. Waiting
        one more ``lease_seconds`` past the lapse lets that redelivery go first,
        so a crash does not reorder the session; the wait stays bounded.
        """
        return now - timedelta(seconds=self.lease_seconds)

    def _apply(self, got: Acquisition) -> None:
        """Take on what the acquire decided (the token was sent with it)."""
        self.status = got.status
        if not got.acquired:
            self.token = None
            self._response = got.response if got.done else None  # as stored: not checked again
            return
        assert self.token is not None
        self.acquired = True
        self.ticket = got.ticket
        self._fence = ClaimFence(self.message_id, self.token, partition_day=got.partition_day)
        self._version_read = got.version_read and self.session_id is not None
        self._session_version = got.session_version
        self.earlier_seen = got.earlier_seen

    # ------------------------------------------------------------ async use

    async def __aenter__(self) -> WebhookClaim:
        self._enter_once()
        place = _CALL_ORDER.take_place(self)
        acquiring = asyncio.ensure_future(self._acquire_after(place))
        try:
            await asyncio.shield(acquiring)
        except asyncio.CancelledError:
            # The acquire goes on in the I/O thread: a claim it takes is given back, or
            # the id would stay in flight (and hold its session's later claims) a lease.
            acquiring.add_done_callback(self._give_back_late_acquire)
            raise
        if not self.acquired:
            return self
        self._var_token = _ACTIVE.set(self)
        self._renewal = Renewal(self.lease_seconds / 3, self._renew_loop)
        await self._await_earlier_claims(self._backend.run, asyncio.sleep)
        return self

    async def _acquire_after(self, place: _Place) -> None:
        try:
            if place.before is not None:  # shielded: a timeout must not cancel the other's place
                waiting = asyncio.shield(asyncio.wrap_future(place.before))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(waiting, _ORDER_WAIT_MAX)
            await self._backend.run(self._acquire_in_place, place)
        finally:
            _CALL_ORDER.leave(place)  # the acquire never ran (cancelled): free the place

    def _acquire_in_place(self, place: _Place) -> None:
        try:
            self.token = secrets.token_hex(16)  # a fresh fencing token for each acquire
            self._apply(self._backend.acquire(self))
        finally:
            _CALL_ORDER.leave(place)  # here, not on the loop: a stopped loop holds nobody

    def _give_back_late_acquire(self, acquiring: asyncio.Future[None]) -> None:
        if acquiring.cancelled() or acquiring.exception() is not None or not self.acquired:
            return
        release = self._finish_or_release(failed=True)
        task = asyncio.ensure_future(self._backend.run(release))
        _LATE_RELEASES.add(task)
        task.add_done_callback(_LATE_RELEASES.discard)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.acquired:
            await self._close(self._backend.run, failed=exc is not None)

    async def _renew_loop(self) -> None:
        """Renew now, then every third of the lease (started by :class:`Renewal`)."""
        while await self._renew_once(self._backend.run):
            await asyncio.sleep(self.lease_seconds / 3)

    # ------------------------------------------------------------ sync use

    def __enter__(self) -> WebhookClaim:
        self._enter_once()
        place = _CALL_ORDER.take_place(self)
        if place.before is not None and not _on_a_running_loop():
            # On a loop's own thread, waiting would stall the claim before this one.
            with contextlib.suppress(concurrent.futures.TimeoutError):
                place.before.result(timeout=_ORDER_WAIT_MAX)
        self._acquire_in_place(place)
        if self.acquired:
            self._var_token = _ACTIVE.set(self)
            _SYNC_RENEWALS.add(self)
            _run_here(self._await_earlier_claims(_here, _sleep_here))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.acquired:
            _run_here(self._close(_here, failed=exc is not None))

    # ------------------------------------------------------------ shared
    # The steps below run the backend's calls through ``run``: the backend's own
    # (off the loop) in the async form, ``_here`` (in the calling thread) in the sync one.

    async def _await_earlier_claims(self, run: _Run, sleep: _Sleep) -> None:
        """Hold the block back while an earlier claim of its session is in flight.

        If the wait fails (or is cancelled), the claim is closed as failed first.
        """
        try:
            delay = _ORDER_POLL_MIN
            while (
                self.session_id is not None
                and self.earlier_seen
                and await run(self._backend.earlier_in_flight, self)
            ):
                await sleep(delay)
                delay = min(delay * 2, _ORDER_POLL_MAX)
        except BaseException:
            await self._close(run, failed=True)
            raise

    async def _close(self, run: _Run, *, failed: bool) -> None:
        renewal, self._renewal = self._renewal, None
        if renewal is not None:
            await renewal.stop()
        else:  # the sync form's: a renewal already under way can only miss now, not "lose"
            self._stop.set()
            _SYNC_RENEWALS.discard(self)
        self._reset_var()
        finish = self._finish_or_release(failed)
        local = not failed and self._backend.finishes_in_memory(self)
        if not (finish() if local else await run(finish)):
            from chatflow_sqlalchemy.exceptions import ClaimLostError

            raise ClaimLostError(self.message_id)

    async def _renew_once(self, run: _Run) -> bool:
        """One renewal; False once the claim needs no more."""
        try:
            held: bool = await run(self._backend.renew, self)
        except Exception as exc:  # the database is away: try again at the next beat
            logger.warning("could not renew webhook claim %r: %s", self.message_id, exc)
            return True
        if not held and not self._stop.is_set():  # not just finished meanwhile
            self._mark_lost()
        return held

    def _enter_once(self) -> None:
        if self._entered:
            raise RuntimeError("a WebhookClaim is entered once; call store.claim() again")
        self._entered = True

    def _reset_var(self) -> None:
        if self._var_token is not None:
            try:
                _ACTIVE.reset(self._var_token)
            except ValueError:  # exited in another context than entered: just clear it
                _ACTIVE.set(None)
            self._var_token = None

    def _mark_lost(self) -> None:
        if self._fence is not None and self._fence.committed:
            return  # our own turn made it done: nothing left to renew, nothing lost
        self.lost = True
        logger.warning(
            "webhook claim %r lost its lease (another delivery took it over); "
            "its turn will not be written",
            self.message_id,
        )

    def _finish_or_release(self, failed: bool) -> Callable[[], bool]:
        """The exit step: True unless a normal exit found the claim no longer ours.

        A failed block releases the claim, unless its turn already committed
        it as done: then only a reply set meanwhile is stored.
        """
        backend = self._backend
        committed = self._fence is not None and self._fence.committed
        if not failed or (committed and self.response is not None):
            return lambda: backend.finish(self) or failed

        def release() -> bool:
            try:
                backend.release(self)
            except Exception as exc:  # the block's own error is the one to raise
                logger.warning(
                    "could not release webhook claim %r (%s); the next delivery takes it "
                    "over when its lease lapses",
                    self.message_id,
                    exc,
                )
            return True

        return release

    def __repr__(self) -> str:
        return (
            f"<WebhookClaim {self.message_id!r} status={self.status} "
            f"session={self.session_id!r} ticket={self.ticket}>"
        )


def _on_a_running_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def _here(fn: Callable[..., _T], *args: Any) -> _T:
    """The sync form's ``run``: the call, in the calling thread."""
    return fn(*args)


async def _sleep_here(seconds: float) -> None:
    """The sync form's ``sleep``: the calling thread's."""
    time.sleep(seconds)


def _run_here(step: Coroutine[Any, Any, _T]) -> _T:
    """Run a step of the sync form to its end (it awaits only ``_here`` and ``_sleep_here``)."""
    try:
        step.send(None)
    except StopIteration as done:
        return cast(_T, done.value)
    step.close()
    raise AssertionError("a sync claim step awaited the event loop")


class _SyncRenewals:
    """One daemon thread renews the leases of every open sync ``with`` claim block.

    A thread per block would cost a thread start per webhook; this one sleeps
    until the next renewal is due (a third of that claim's lease).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        # Each claim's next renewal, run in the context of the block that opened the claim.
        self._due: dict[WebhookClaim, tuple[float, contextvars.Context]] = {}
        self._thread: threading.Thread | None = None

    def add(self, claim: WebhookClaim) -> None:
        with self._cond:
            due = time.monotonic() + claim.lease_seconds / 3
            self._due[claim] = due, contextvars.copy_context()
            if self._thread is None or not self._thread.is_alive():  # also after a fork
                self._thread = threading.Thread(
                    target=self._run, name="chatflow-claim-renewals", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def discard(self, claim: WebhookClaim) -> None:
        with self._cond:
            self._due.pop(claim, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                ready = [(claim, ctx) for claim, (due, ctx) in self._due.items() if due <= now]
                if not ready:
                    wait = min((due for due, _ in self._due.values()), default=now + 60.0) - now
                    self._cond.wait(wait)
                    continue
                for claim, ctx in ready:
                    self._due[claim] = now + claim.lease_seconds / 3, ctx
            for claim, ctx in ready:
                if not ctx.run(_run_here, claim._renew_once(_here)):
                    self.discard(claim)


_SYNC_RENEWALS = _SyncRenewals()


def claim_info(
    message_id: str,
    state: str,
    session_id: str | None,
    ticket: int | None,
    claimed_at: datetime | None,
    lease_expires_at: datetime | None,
    updated_at: datetime,
    has_response: bool,
    now: datetime,
) -> ClaimInfo:
    """Build a :class:`ClaimInfo`, telling a live lease from a lapsed one."""
    lease_age = lease_left = None
    if state == CLAIM_ACQUIRED and lease_expires_at is not None:
        lease_left = (lease_expires_at - now).total_seconds()
        state = "in_flight" if lease_left > 0 else "expired"
        renewed = claimed_at if claimed_at is not None else updated_at
        lease_age = max(0.0, (now - renewed).total_seconds())
    return ClaimInfo(
        message_id, state, session_id, ticket, lease_age, lease_left, updated_at, has_response
    )


def _backend_of(store: Any) -> ClaimBackend:
    claims = getattr(store, "_claims", None)
    if claims is None:
        raise TypeError(
            f"{type(store).__name__} has no webhook claims; use a chatflow-sqlalchemy store"
        )
    return cast(ClaimBackend, claims())


def list_claims(store: Any, *, limit: int | None = 100) -> list[ClaimInfo]:
    """``dedup list``: each id's claim state, most recently changed first.

    Args:
        store: Any chatflow-sqlalchemy store.
        limit: At most this many rows (None: all).

    Raises:
        ValueError: ``limit`` is not a positive int or None.

    """
    return _backend_of(store).list(validate_page_limit(limit))


def release_claim(store: Any, message_id: str) -> bool:
    """``dedup release ID``: free an id held by a stuck or dead worker.

    The next delivery of the id acquires it at once; the old holder's turn,
    if it ever commits, gets :class:`~chatflow_sqlalchemy.exceptions.ClaimLostError`.
    Returns False when the id is not held (unknown, done or released).
    """
    return _backend_of(store).free(message_id)


@dataclass
class _HeldInMemory:
    """One claim of the in-memory store (its ``_processed`` stamp is the TTL anchor)."""

    state: str
    token: str | None
    session_id: str | None
    ticket: int
    lease_until: float
    claimed_at: datetime
    updated_at: datetime
    response: str | None = None


class MemoryClaims:
    """:class:`ClaimBackend` of the in-memory ``SessionStore`` (one process's semantics).

    Rows live beside the store's dedup stamps, under the store's lock; an id
    whose stamp expired or was evicted is forgotten here too.

    Args:
        lock: The store's lock, held by every read and change of the rows.
        stamps: The store's dedup stamps (``time.monotonic()`` of each id's last claim).
        ttl_seconds: The store's dedup window.
        remember: Stamps an id now, as the store's own claims do (evicting the oldest).

    """

    def __init__(
        self,
        lock: threading.RLock,
        stamps: Mapping[str, float],
        ttl_seconds: float,
        remember: Callable[[str, float], None],
    ) -> None:
        self._lock = lock
        self._stamps = stamps
        self._ttl_seconds = ttl_seconds
        self._remember = remember
        self.rows: dict[str, _HeldInMemory] = {}
        self._tickets = 0

    run = staticmethod(_here)  # no I/O: calls run directly

    def _live(self, message_id: str, now: float) -> tuple[bool, _HeldInMemory | None]:
        stamp = self._stamps.get(message_id)
        if stamp is None or now - stamp > self._ttl_seconds:
            self.rows.pop(message_id, None)
            return False, None
        return True, self.rows.get(message_id)

    def acquire(self, claim: WebhookClaim) -> Acquisition:
        """Take the claim, or say why not (as the SQL statement decides)."""
        now = time.monotonic()
        with self._lock:
            live, row = self._live(claim.message_id, now)
            if live and row is None:  # recorded with record_processed_message
                return Acquisition(False, done=True)
            if row is not None and not (
                row.state == CLAIM_RELEASED
                or (row.state == CLAIM_ACQUIRED and row.lease_until < now)
            ):
                return Acquisition(False, done=row.state == CLAIM_DONE, response=row.response)
            if row is None:
                self._tickets += 1
            stamp = utcnow()
            ticket = row.ticket if row is not None else self._tickets
            self.rows[claim.message_id] = _HeldInMemory(
                CLAIM_ACQUIRED, claim.token, claim.session_id, ticket,
                now + claim.lease_seconds, stamp, stamp,
            )
            self._remember(claim.message_id, now)
            return Acquisition(True, ticket=ticket)

    def _mine(self, claim: WebhookClaim | ClaimFence) -> _HeldInMemory | None:
        row = self.rows.get(claim.message_id)
        return row if row is not None and row.token == claim.token else None

    def renew(self, claim: WebhookClaim) -> bool:
        """Extend the lease while the token holds."""
        with self._lock:
            row = self._mine(claim)
            if row is None or row.state != CLAIM_ACQUIRED:
                return False
            row.lease_until = time.monotonic() + claim.lease_seconds
            return True

    def commit_turn(self, fence: ClaimFence) -> bool:
        """The in-memory fence of a turn: mark the claim done if the token holds."""
        with self._lock:
            row = self._mine(fence)
            if row is None:
                return False
            row.state, row.lease_until, row.updated_at = CLAIM_DONE, 0.0, utcnow()
            row.response = fence.reply
            fence.committed = True
            return True

    def finish(self, claim: WebhookClaim) -> bool:
        """Mark the claim done with its reply.

        False once the claim is no longer ours, unless its turn already stored
        this very reply with it (then, as on the SQL stores, there is nothing
        left to write: its session may have been deleted since).
        """
        with self._lock:
            row = self._mine(claim)
            if row is None:
                return claim.stored_with_turn
            row.state, row.lease_until, row.updated_at = CLAIM_DONE, 0.0, utcnow()
            row.response = claim.response
            self._remember(claim.message_id, time.monotonic())
            return True

    def finishes_in_memory(self, claim: WebhookClaim) -> bool:
        """Always: this backend does no I/O."""
        return True

    def release(self, claim: WebhookClaim) -> None:
        """Let the next delivery acquire the id (a done claim is left done)."""
        with self._lock:  # re-entered by free
            if self._mine(claim) is not None:
                self.free(claim.message_id)

    def earlier_in_flight(self, claim: WebhookClaim) -> bool:
        """True while an earlier claim of the session is held under a live lease."""
        horizon = time.monotonic() - claim.lease_seconds  # as order_horizon
        with self._lock:
            return any(
                row.session_id == claim.session_id
                and claim.ticket is not None
                and row.ticket < claim.ticket
                and row.state == CLAIM_ACQUIRED
                and row.lease_until > horizon
                for row in self.rows.values()
            )

    def list(self, limit: int | None) -> list[ClaimInfo]:
        """Rows for ``dedup list``, most recently changed first."""
        now, wall = time.monotonic(), utcnow()
        with self._lock:
            items = sorted(self.rows.items(), key=lambda item: item[1].updated_at, reverse=True)
        infos = [
            claim_info(
                message_id, row.state, row.session_id, row.ticket, row.claimed_at,
                wall + timedelta(seconds=row.lease_until - now) if row.lease_until else None,
                row.updated_at, row.response is not None, wall,
            )
            for message_id, row in items
        ]
        return infos if limit is None else infos[:limit]

    def free(self, message_id: str) -> bool:
        """Release a held claim whoever holds it."""
        with self._lock:
            row = self.rows.get(message_id)
            if row is None or row.state != CLAIM_ACQUIRED:
                return False
            row.state, row.token, row.updated_at = CLAIM_RELEASED, None, utcnow()
            return True

