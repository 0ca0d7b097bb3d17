"""The start and end of a turn (``async with session.lock``) on a SQL store.

Before a turn: take the cross-process turn lock where the dialect has one,
then catch the context up with the database, so the turn runs on the newest
history. After it: write the turn in one transaction (with its webhook claim's
fence), then let other processes in. A turn ended by an exception writes
nothing. Without turn locks (SQLite), a turn on a session idle for a while
first moves its ``updated_at``, so no other process's sweep takes it mid-turn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from chatflow_sqlalchemy import telemetry
from chatflow_sqlalchemy.claims import ClaimFence, active_fence
from chatflow_sqlalchemy.context import SessionContext
from chatflow_sqlalchemy.dialect import TurnLocks
from chatflow_sqlalchemy.exceptions import SessionDeletedError
from chatflow_sqlalchemy.lifecycle import touch_interval
from chatflow_sqlalchemy.models import utcnow
from chatflow_sqlalchemy.runtime import StoreRuntime
from chatflow_sqlalchemy.sql_lifecycle import touch_session

__all__ = ["RECENTLY_VERIFIED", "Turns"]

_T = TypeVar("_T")

RECENTLY_VERIFIED = 0.05
"""Seconds during which a context checked against the database counts as current.

Only backends without a cross-process turn lock use it (to skip a second
version check right after ``get_or_create``); their writes still compare and
swap the version, so a stale context is rebased, never merged blindly.
"""

_FIRST_POLL, _LAST_POLL = 0.002, 0.005
"""Backoff of a contended turn lock: a freed lock is noticed within the last."""


class _Store(Protocol):
    """What turns need of their store."""

    async def _run_blocking(self, fn: Callable[..., _T], *args: Any) -> _T: ...

    def _refresh(self, ctx: SessionContext) -> bool: ...

    def _flush_context(self, ctx: SessionContext, fence: ClaimFence | None = None) -> None: ...

    def _forget(self, session_id: str) -> None: ...


class Turns:
    """Begins and ends the turns of one store's contexts.

    Args:
        store: The store whose contexts these are.
        runtime: Where the store's statements run.
        locks: The dialect's cross-process turn locks, or None.
        session_ttl_hours: The store's session TTL (how often an idle session is touched).

    """

    def __init__(
        self,
        store: _Store,
        runtime: StoreRuntime,
        locks: TurnLocks | None,
        session_ttl_hours: float | None,
    ) -> None:
        self._store = store
        self._runtime = runtime
        self.locks = locks
        self._touch_interval = touch_interval(session_ttl_hours)

    async def begin(self, ctx: SessionContext) -> None:
        """Take the turn lock, then catch up with the database.

        The lock is polled with a short backoff rather than waited for, so a
        contended session never pins one of the I/O threads.

        Raises:
            SessionDeletedError: The session is gone (the lock is not kept).

        """
        locks = self.locks
        if locks is None:
            await self._touch_if_idle(ctx)
            recent = time.monotonic() - ctx._verified_at < RECENTLY_VERIFIED
            if recent and not ctx._stale:
                return  # the Runner's get_or_create checked the version a moment ago
            if not await self._store._run_blocking(self._store._refresh, ctx):
                raise SessionDeletedError(ctx.session_id)
            return
        known, version = await self._await_lock(locks, ctx.session_id)
        try:
            if self._locked_version_matches(ctx, known, version):
                return
            if not await self._store._run_blocking(self._store._refresh, ctx):
                raise SessionDeletedError(ctx.session_id)
        except BaseException:
            await locks.release(ctx.session_id)
            raise

    async def end(self, ctx: SessionContext) -> None:
        """Write the turn in one transaction, then let other processes in.

        A turn inside a webhook claim block for this session commits the claim
        with it (the claim is found here, in the caller's context).
        """
        fence = active_fence(ctx.session_id)
        try:
            await self._store._run_blocking(self._store._flush_context, ctx, fence)
        finally:
            if self.locks is not None:
                await self.locks.release(ctx.session_id)

    async def discard(self, ctx: SessionContext) -> None:
        """After a turn ended by an exception: write nothing, let other processes in."""
        if self.locks is not None:
            await self.locks.release(ctx.session_id)

    async def _await_lock(self, locks: TurnLocks, session_id: str) -> tuple[bool, int | None]:
        """Poll the turn lock until taken; return (version known, version) read with it."""
        delay = _FIRST_POLL
        with telemetry.operation("turn.lock", self._runtime.system) as op:
            attempts = 0
            while True:
                attempts += 1
                with self._runtime.guard:
                    acquired, known, version = await locks.try_acquire(session_id)
                if acquired:
                    op.set("chatflow.lock.attempts", attempts)
                    return known, version
                await asyncio.sleep(delay)
                delay = min(delay * 2, _LAST_POLL)

    def _locked_version_matches(
        self, ctx: SessionContext, known: bool, version: int | None
    ) -> bool:
        """True if the version read with the turn lock held equals the one ``ctx`` knows."""
        if not known:
            return False
        if version is None:
            self._store._forget(ctx.session_id)
            raise SessionDeletedError(ctx.session_id)
        durable = ctx._durable
        if durable is None or durable.version != version or ctx._stale:
            return False
        ctx._verified_at = time.monotonic()
        return True

    async def _touch_if_idle(self, ctx: SessionContext) -> None:
        """Without turn locks: mark the session as in use, so no sweep takes it mid-turn.

        Another process's sweep cannot see this turn; it keeps sessions
        updated within its TTL, so a turn on a session idle for a while
        moves ``updated_at`` first (one statement; see ``touch_interval``).
        """
        if time.monotonic() - ctx._touched_at < self._touch_interval:
            return
        if not await self._store._run_blocking(self.touch, ctx.session_id):
            # Gone (swept or deleted elsewhere since it was last checked), or touched
            # elsewhere: check the version instead of trusting a recent check.
            ctx._verified_at = float("-inf")
        ctx._touched_at = time.monotonic()

    def touch(self, session_id: str) -> bool:
        """Move the session's ``updated_at`` to now if older than the touch interval."""
        with self._runtime.transaction(single=True) as conn:
            return touch_session(conn, session_id, utcnow(), self._touch_interval)
