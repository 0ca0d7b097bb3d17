"""Thread-safe in-memory session store with the same contract as the SQL stores.

For tests, CLIs and short-lived services. Contexts prune incrementally (no
regroup of the whole history per message, which dominates upstream's
in-memory store), deletion is visible to live contexts, and the dedup claim
is atomic under one lock with a TTL and a bounded number of entries.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from chatflow_agent import Agent, BaseSessionStore

from chatflow_sqlalchemy.claims import (
    DEFAULT_LEASE_SECONDS,
    ClaimFence,
    MemoryClaims,
    WebhookClaim,
    active_fence,
)
from chatflow_sqlalchemy.context import (
    SessionContext,
    _Snapshot,
    dump_metadata,
    validate_max_turns,
    validate_session_id,
)
from chatflow_sqlalchemy.exceptions import ClaimLostError
from chatflow_sqlalchemy.store import DEFAULT_DEDUP_TTL_HOURS, _validate_message_id, _validate_ttl

__all__ = ["SessionStore"]

_T = TypeVar("_T")


def _turn_changed(ctx: SessionContext, start: _Snapshot) -> bool:
    same = len(ctx._history) == len(start.history) and all(
        now is then for now, then in zip(ctx._history, start.history, strict=True)
    )
    return not same or ctx.active_agent is not start.agent


class SessionStore(BaseSessionStore):
    """In-memory session registry; nothing survives the process.

    Args:
        default_max_turns: History window of new contexts, in complete turns.
        dedup_ttl_hours: How long a processed webhook id stays claimed.

    Like the SQL stores it is a context manager (``with`` and ``async with``)
    that closes on exit; a closed store drops what it held and refuses further
    use with ``RuntimeError``.

    """

    dedup_max_entries = 100_000
    """Oldest claims are evicted beyond this many, bounding memory."""

    def __init__(
        self, default_max_turns: int = 40, dedup_ttl_hours: float = DEFAULT_DEDUP_TTL_HOURS
    ) -> None:
        self.default_max_turns = validate_max_turns(default_max_turns, "default_max_turns")
        self.dedup_ttl_hours = _validate_ttl(dedup_ttl_hours)
        self._ttl_seconds = self.dedup_ttl_hours * 3600.0
        self._sessions: dict[str, SessionContext] = {}
        self._updated: dict[str, float] = {}
        self._processed: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.RLock()
        self._agent_resolver: Callable[[str], Agent | None] | None = None
        self._closed = False
        self._claim_rows = MemoryClaims(self)
        self._turn_starts: dict[int, _Snapshot] = {}

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this session store is closed; open a new one")

    def set_agent_resolver(self, resolver: Callable[[str], Agent | None]) -> None:
        """Accepted for API parity; in-memory contexts keep their Agent objects."""
        self._agent_resolver = resolver

    def get_or_create(
        self, session_id: str, default_agent: Agent, metadata: dict[str, Any] | None = None
    ) -> SessionContext:
        """Return the session's context, creating it (with ``metadata``) if needed."""
        validate_session_id(session_id)
        dump_metadata(metadata or {})
        with self._lock:
            self._check_open()
            ctx = self._sessions.get(session_id)
            if ctx is None:
                ctx = SessionContext(
                    session_id, default_agent, max_turns=self.default_max_turns,
                    metadata=dict(metadata or {}),
                )
                ctx._owner = self
                self._sessions[session_id] = ctx
                self._updated[session_id] = time.monotonic()
            return ctx

    # The ContextOwner protocol: contexts report their writes, which only move
    # the session to the front of list_sessions (there is nothing to persist).

    def _flush_context(self, ctx: SessionContext) -> None:
        with self._lock:
            self._check_open()
            if self._sessions.get(ctx.session_id) is ctx:
                self._updated[ctx.session_id] = time.monotonic()

    async def _abegin_turn(self, ctx: SessionContext) -> None:
        self._check_open()
        ctx._check_alive()
        if active_fence(ctx.session_id) is not None:  # kept to discard a fenced-out turn
            self._turn_starts[id(ctx)] = ctx._snapshot()

    async def _aend_turn(self, ctx: SessionContext) -> None:
        ctx._check_alive()  # a turn of a session deleted meanwhile is not kept
        start = self._turn_starts.pop(id(ctx), None)
        fence = active_fence(ctx.session_id)
        if fence is not None and start is not None and _turn_changed(ctx, start):
            self._commit_claim(ctx, fence, start)
        self._flush_context(ctx)

    async def _adiscard_turn(self, ctx: SessionContext) -> None:
        """A turn ended by an exception: the context restored itself; forget its start."""
        self._turn_starts.pop(id(ctx), None)

    async def _run_blocking(self, fn: Callable[..., _T], *args: Any) -> _T:
        return fn(*args)

    def _commit_claim(self, ctx: SessionContext, fence: ClaimFence, start: _Snapshot) -> None:
        """As the SQL stores: a turn that changed something commits its claim, or is undone."""
        if not self._claim_rows.commit_turn(fence):
            with ctx._mutex:
                ctx._restore(start)
            raise ClaimLostError(fence.message_id)

    def get(self, session_id: str) -> SessionContext | None:
        """Return the session's context, or None."""
        validate_session_id(session_id)
        with self._lock:
            self._check_open()
            return self._sessions.get(session_id)

    def delete(self, session_id: str) -> bool:
        """Delete the session; its live contexts then raise SessionDeletedError."""
        validate_session_id(session_id)
        with self._lock:
            self._check_open()
            ctx = self._sessions.pop(session_id, None)
            self._updated.pop(session_id, None)
        if ctx is None:
            return False
        ctx._deleted = True
        return True

    def list_sessions(self) -> list[str]:
        """Session ids, most recently updated first."""
        with self._lock:
            self._check_open()
            return sorted(self._updated, key=self._updated.__getitem__, reverse=True)

    def clear(self) -> None:
        """Delete every session (processed webhook ids are kept)."""
        with self._lock:
            self._check_open()
            contexts = list(self._sessions.values())
            self._sessions.clear()
            self._updated.clear()
        for ctx in contexts:
            ctx._deleted = True

    def is_message_processed(self, message_id: str) -> bool:
        """True if ``message_id`` was claimed within the TTL."""
        _validate_message_id(message_id)
        with self._lock:
            self._check_open()
            stamp = self._processed.get(message_id)
            return stamp is not None and time.monotonic() - stamp <= self._ttl_seconds

    def mark_message_processed(self, message_id: str) -> None:
        """Record ``message_id`` as processed now."""
        _validate_message_id(message_id)
        with self._lock:
            self._check_open()
            self._remember(message_id, time.monotonic())

    def record_processed_message(self, message_id: str) -> bool:
        """Atomically claim ``message_id``: True only for its first caller within the TTL."""
        _validate_message_id(message_id)
        now = time.monotonic()
        with self._lock:
            self._check_open()
            stamp = self._processed.get(message_id)
            if stamp is not None and now - stamp <= self._ttl_seconds:
                return False
            self._remember(message_id, now)
            return True

    def _remember(self, message_id: str, now: float) -> None:
        self._processed.pop(message_id, None)
        self._processed[message_id] = now  # insertion order == age order
        while len(self._processed) > self.dedup_max_entries:
            evicted, _ = self._processed.popitem(last=False)
            self._claim_rows.rows.pop(evicted, None)

    def claim(
        self,
        message_id: str,
        *,
        session_id: str | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ) -> WebhookClaim:
        """Claim a webhook delivery (see :mod:`chatflow_sqlalchemy.claims`), in this process."""
        _validate_message_id(message_id)
        if session_id is not None:
            validate_session_id(session_id)
        return WebhookClaim(
            self._claim_rows, message_id, session_id=session_id, lease_seconds=lease_seconds
        )

    def _claims(self) -> MemoryClaims:
        return self._claim_rows

    def purge_processed_messages(self) -> int:
        """Drop expired claims; return how many went."""
        cutoff = time.monotonic() - self._ttl_seconds
        removed = 0
        with self._lock:
            self._check_open()
            while self._processed:
                message_id, stamp = next(iter(self._processed.items()))
                if stamp >= cutoff:
                    break
                del self._processed[message_id]
                self._claim_rows.rows.pop(message_id, None)
                removed += 1
        return removed

    def close(self) -> None:
        """Drop every session and claim; later calls raise ``RuntimeError`` (as SQL stores do).

        Closing twice is harmless.
        """
        with self._lock:
            self._closed = True
            self._sessions.clear()
            self._updated.clear()
            self._processed.clear()

    def __enter__(self) -> SessionStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> SessionStore:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aget_or_create(
        self, session_id: str, default_agent: Agent, metadata: dict[str, Any] | None = None
    ) -> SessionContext:
        """Async :meth:`get_or_create` (no I/O: runs directly)."""
        return self.get_or_create(session_id, default_agent, metadata)

    async def aget(self, session_id: str) -> SessionContext | None:
        """Async :meth:`get`."""
        return self.get(session_id)

    async def adelete(self, session_id: str) -> bool:
        """Async :meth:`delete`."""
        return self.delete(session_id)

    async def alist_sessions(self) -> list[str]:
        """Async :meth:`list_sessions`."""
        return self.list_sessions()

    async def aclear(self) -> None:
        """Async :meth:`clear`."""
        self.clear()

    async def ais_message_processed(self, message_id: str) -> bool:
        """Async :meth:`is_message_processed`."""
        return self.is_message_processed(message_id)

    async def amark_message_processed(self, message_id: str) -> None:
        """Async :meth:`mark_message_processed`."""
        self.mark_message_processed(message_id)

    async def arecord_processed_message(self, message_id: str) -> bool:
        """Async :meth:`record_processed_message`."""
        return self.record_processed_message(message_id)

    async def apurge_processed_messages(self) -> int:
        """Async :meth:`purge_processed_messages`."""
        return self.purge_processed_messages()

    async def aclose(self) -> None:
        """Async :meth:`close`."""
        self.close()
