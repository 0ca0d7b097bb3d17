"""The start and end of a turn (``async with session.lock``) on a SQL store.

Before a turn: take the session's lease (:mod:`chatflow_sqlalchemy.lease`),
polling with a bounded backoff while another turn holds it, and catch the
context up if the session moved since it last saw it. While the turn runs:
renew the lease in the background, holding nothing between renewals. After
it: write the turn in one transaction that checks the lease and gives it
back (with its webhook claim's fence). A turn ended by an exception writes
nothing and gives the lease back; a session made for it that nothing was
written to is unborn again (no agent: ``get`` and ``list_sessions`` do not
show it), by the same statement.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chatflow_sqlalchemy import telemetry
from chatflow_sqlalchemy.claims import ClaimFence, Renewal, active_fence
from chatflow_sqlalchemy.context import SessionContext
from chatflow_sqlalchemy.exceptions import SessionDeletedError
from chatflow_sqlalchemy.inbox import BatchFence, active_batch
from chatflow_sqlalchemy.lease import SessionLeases
from chatflow_sqlalchemy.runtime import RunBlocking, StoreRuntime
from chatflow_sqlalchemy.values import Lease

__all__ = ["CatchUp", "Turns", "Write"]

logger = logging.getLogger("chatflow_sqlalchemy")

_FIRST_POLL, _LAST_POLL = 0.002, 0.025
"""Backoff while another turn holds the lease: a freed lease is noticed within the last."""


CatchUp = Callable[[SessionContext, tuple[bool, int | None]], bool]
"""Brings a context up to the database at a lease's version; False if the session is gone."""

Write = Callable[[SessionContext, ClaimFence | None, Lease | None, BatchFence | None], None]
"""Writes a context's pending turn with its claim fence, lease and inbox batch."""


@dataclass
class _Held:
    """A lease held by a running turn, and the task that renews it.

    A turn run by an inbox batch uses the batch's lease: the batch renews
    it and gives it back (``batch`` is set, ``renewal`` None).
    """

    lease: Lease
    renewal: Renewal | None
    batch: BatchFence | None = None

    async def stop_renewing(self) -> None:
        """Cancel the renewal and wait for it; a cancellation of the caller still raises."""
        if self.renewal is not None:
            await self.renewal.stop()

    @property
    def ours(self) -> bool:
        """The turn gives the lease back (it is not an inbox batch's)."""
        return not self.lease.kept and not self.lease.released


class Turns:
    """Begins and ends the turns of one store's contexts.

    Args:
        runtime: Where the store's statements run.
        leases: The store's session leases.
        run_blocking: The store's way to run blocking work off the loop.
        catch_up: The store's catch-up of a context at a lease's version.
        write: The store's write of a context's turn.

    """

    def __init__(
        self,
        runtime: StoreRuntime,
        leases: SessionLeases,
        run_blocking: RunBlocking,
        catch_up: CatchUp,
        write: Write,
    ) -> None:
        self._runtime = runtime
        self._run_blocking = run_blocking
        self._catch_up = catch_up
        self._write = write
        self.leases = leases
        self._held: dict[int, _Held] = {}  # by id() of the context in its turn
        self._orphans: set[asyncio.Task[Any]] = set()
        self._offered: dict[str, tuple[Lease, float]] = {}
        self._lent: dict[str, Lease] = {}
        self._offered_lock = threading.Lock()

    def offer(self, lease: Lease) -> None:
        """A lease taken for a coming turn (with a webhook claim): the next turn here uses it.

        Any turn of this store on the session takes it, the claim's or
        another task's (which would otherwise wait for it to expire).
        """
        with self._offered_lock:
            self._offered[lease.session_id] = (lease, time.monotonic())

    def lend(self, lease: Lease) -> None:
        """An inbox batch holds ``lease``: this store's turns use it while ``handle`` runs.

        A turn of another task (or a thread) on the batch's session would
        otherwise wait for the lease while holding ``session.lock``, which the
        batch's own turn then waits for. Once ``handle`` returned, the batch
        gives the lease back after sending: a turn begun then takes its own.
        """
        self._lent[lease.session_id] = lease

    def unlend(self, lease: Lease) -> None:
        """The batch ends: turns take the session's lease again."""
        if self._lent.get(lease.session_id) is lease:
            del self._lent[lease.session_id]

    def withdraw(self, lease: Lease) -> bool:
        """Take back an offered lease; False if a turn has used it (it is the turn's now)."""
        with self._offered_lock:
            offered = self._offered.get(lease.session_id)
            if offered is None or offered[0] is not lease:
                return False
            del self._offered[lease.session_id]
            return True

    def forget_offered(self, session_id: str) -> None:
        """The session was deleted: a lease offered on its row went with it.

        A turn begun since on a session made anew under the id takes a lease
        of its own, so one that then fails leaves no empty session behind.
        """
        with self._offered_lock:
            self._offered.pop(session_id, None)

    def is_offered(self, lease: Lease) -> bool:
        """Whether ``lease`` still waits for a turn (no turn has used it yet)."""
        with self._offered_lock:
            offered = self._offered.get(lease.session_id)
            return offered is not None and offered[0] is lease

    async def begin(self, ctx: SessionContext) -> None:
        """Take the session's lease, then catch up with the database.

        Raises:
            SessionDeletedError: The session is gone (no lease is kept).

        """
        batch = active_batch(ctx.session_id)
        if batch is not None:
            held = _Held(batch.lease, None, batch)
        else:
            lease = await self._offered_lease(ctx.session_id) or await self._take(ctx.session_id)
            renewal = None if lease.kept else Renewal(
                self.leases.lease_seconds / 3, lambda: self._renew(lease)
            )
            held = _Held(lease, renewal)
        self._held[id(ctx)] = held
        lease = held.lease
        try:
            # A context already at the lease's version has nothing to catch up: no hop.
            current = lease.version is not None and ctx.is_current(lease.version)
            if not current and not await self._run_blocking(
                self._catch_up, ctx, (True, lease.version)
            ):
                raise SessionDeletedError(ctx.session_id)
        except BaseException:
            await self.discard(ctx)
            raise

    async def end(self, ctx: SessionContext) -> None:
        """Write the turn in one transaction that also gives the lease back.

        A turn inside a webhook claim block for this session commits the claim
        with it (the claim is found here, in the caller's context); a turn of
        an inbox batch records the batch's reply and keeps its lease. A write
        that failed fails the turn: a session made for it is unborn again, as
        after :meth:`discard`.
        """
        held = self._held.pop(id(ctx))
        made = ctx.made_version  # a write that stood moved the version past it
        try:
            await held.stop_renewing()
            fence = active_fence(ctx.session_id)
            await self._run_blocking(
                self._write, ctx, fence, held.lease, held.batch
            )
            made = None
        finally:
            if held.ours:
                await self._give_back(held.lease, made)
            elif made is not None:
                await self._run_safely(self.leases.unmake, held.lease, made)

    async def discard(self, ctx: SessionContext, made: int | None = None) -> None:
        """After a turn ended by an exception: write nothing, give the lease back.

        ``made``: the version this store made the session at for the turn;
        if the session is still at it, the statement that gives the lease
        back (or, for an inbox batch's lease, one that keeps it) also makes
        it unborn again (:meth:`SessionLeases.release`).
        """
        held = self._held.pop(id(ctx), None)
        if held is not None:
            try:
                await held.stop_renewing()
            finally:
                if held.ours:
                    await self._give_back(held.lease, made)
                elif made is not None:
                    await self._run_safely(self.leases.unmake, held.lease, made)

    async def _offered_lease(self, session_id: str) -> Lease | None:
        """The lease a webhook claim took for this session, renewed first if one is due.

        None if there is none, or if it could not be renewed (it lapsed):
        the turn then takes the lease as usual.
        """
        with self._offered_lock:
            lease, since = self._offered.pop(session_id, (None, 0.0))
        if lease is None or time.monotonic() - since < self.leases.lease_seconds / 3:
            return lease
        if await self._run_blocking(self.leases.renew, lease):
            return lease
        return None

    async def _take(self, session_id: str) -> Lease:
        """Poll the lease until taken (bounded backoff; turns of this process queue first)."""
        delay = _FIRST_POLL
        with telemetry.operation("turn.lease", self._runtime.system) as op:
            attempts = 0
            while True:
                attempts += 1
                lent = self._lent.get(session_id)
                lease = lent if lent is not None and lent.shared else None
                lease = lease or await self._take_once(session_id)
                if lease is not None:
                    op.set("chatflow.lease.attempts", attempts)
                    return lease
                await asyncio.sleep(delay)
                delay = min(delay * 2, _LAST_POLL)

    async def _take_once(self, session_id: str) -> Lease | None:
        """One try; a lease taken as the caller was cancelled is given back, not dropped.

        The take commits on the server whether or not its caller still waits,
        so it runs as a task of its own that a cancellation does not stop.
        """
        take = asyncio.ensure_future(self._run_blocking(self.leases.take, session_id))
        try:
            return await asyncio.shield(take)
        except asyncio.CancelledError:
            take.add_done_callback(self._give_back_orphan)
            raise

    def _give_back_orphan(self, take: asyncio.Future[Lease | None]) -> None:
        """A take whose caller was cancelled finished: give back what it took."""
        if take.cancelled() or take.exception() is not None or take.result() is None:
            return
        lease = take.result()
        assert lease is not None
        orphan = asyncio.ensure_future(self._run_safely(self.leases.release, lease))
        self._orphans.add(orphan)
        orphan.add_done_callback(self._orphans.discard)

    async def _renew(self, lease: Lease) -> None:
        """Renew ``lease`` now, then every third of its length until cancelled or lost."""
        interval = self.leases.lease_seconds / 3
        while True:
            try:
                held = await self._run_blocking(self.leases.renew, lease)
            except Exception as exc:  # the next renewal or the write will tell
                logger.warning("could not renew the lease of session %r: %s",
                               lease.session_id, exc)
                held = True
            if not held:
                logger.warning("lost the lease of session %r: its turn will not be written",
                               lease.session_id)
                return
            await asyncio.sleep(interval)

    async def _give_back(self, lease: Lease, made: int | None = None) -> None:
        """Release ``lease``, even if the caller is cancelled meanwhile.

        The release runs as a task of its own, so a cancellation (a second
        one, at shutdown) does not stop it. A failure only delays the next
        turn until the lease expires. ``made``: see :meth:`discard`.
        """
        release = asyncio.ensure_future(self._run_safely(self.leases.release, lease, made))
        self._orphans.add(release)
        release.add_done_callback(self._orphans.discard)
        await asyncio.shield(release)

    async def _run_safely(self, fn: Callable[..., object], lease: Lease, *args: Any) -> None:
        """``fn(lease, *args)`` off the loop: a failure is logged (the lease expires on its own)."""
        try:
            await self._run_blocking(fn, lease, *args)
        except Exception as exc:
            logger.warning("could not give back the lease of session %r (it expires on its "
                           "own): %s", lease.session_id, exc)
