"""Webhook claims on the SQL stores: the statements, and the store's claim backend.

How claims behave is described in :mod:`chatflow_sqlalchemy.claims`; this
module is that behaviour on ``chatflow_processed_messages``. The acquire
statement is the dialect's (:meth:`DialectSupport.acquire_claim`); the rest
is portable Core.

**One clock for leases: the database's.** Every lease a claim stores, and
every comparison that decides whether a lease still holds (takeover, order,
renewal), reads the database's clock inside the statement
(:mod:`chatflow_sqlalchemy.clock`), never a worker's: a worker whose clock
runs ahead can no longer take over a live claim, and one whose clock runs
behind no longer stores a lease that has already lapsed. The workers' clock
values are still sent, for databases the clock module does not compile for.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import (
    Connection,
    Text,
    bindparam,
    literal_column,
    null,
    select,
    update,
)

from chatflow_sqlalchemy import tables, telemetry
from chatflow_sqlalchemy.claims import Acquisition, ClaimInfo, claim_info
from chatflow_sqlalchemy.clock import CLAIM_HORIZON, CLAIM_LEASE, CLAIM_NOW, DatabaseNow
from chatflow_sqlalchemy.tables import UTCDateTime
from chatflow_sqlalchemy.values import CLAIM_ACQUIRED, CLAIM_DONE, CLAIM_RELEASED, Lease, utcnow

if TYPE_CHECKING:  # the store's machinery: read_claims (``dedup list``) needs none of it
    from chatflow_sqlalchemy.claims import WebhookClaim
    from chatflow_sqlalchemy.dialect import DialectSupport
    from chatflow_sqlalchemy.runtime import RunBlocking, StoreRuntime
    from chatflow_sqlalchemy.turns import Turns

logger = logging.getLogger("chatflow_sqlalchemy")

__all__ = [
    "CLAIM_IS_MINE",
    "FENCE_CLAIM",
    "SQLClaims",
    "free_claim",
    "read_claims",
]

_T = TypeVar("_T")


_processed = tables.processed_messages
_c = _processed.c
CLAIM_IS_MINE = (_c.message_id == bindparam("claim_id")) & (_c.token == bindparam("claim_token"))
"""The claim row of ``claim_id`` while it still holds this holder's ``claim_token``."""

FENCE_CLAIM = (
    update(_processed)
    .where(CLAIM_IS_MINE)
    .values(
        # Constants inline, not as anonymous binds: one cached statement.
        state=literal_column(f"'{CLAIM_DONE}'"),
        processed_at=DatabaseNow(bindparam("claim_now", type_=UTCDateTime())),
        lease_expires_at=null(),
        response=bindparam("claim_reply", type_=Text()),
    )
)
"""The fenced UPDATE a claimed turn adds to its write transaction (rowcount 1: still ours)."""

_RENEW = (
    update(_processed)
    .where(CLAIM_IS_MINE, _c.state == CLAIM_ACQUIRED)
    .values(lease_expires_at=CLAIM_LEASE)
)
_FINISH = (
    update(_processed)
    .where(CLAIM_IS_MINE)
    .values(
        state=CLAIM_DONE, response=bindparam("reply"), processed_at=CLAIM_NOW, lease_expires_at=None
    )
)
_RELEASE = (
    update(_processed)
    .where(CLAIM_IS_MINE, _c.state == CLAIM_ACQUIRED)
    .values(state=CLAIM_RELEASED, token=None, lease_expires_at=None, processed_at=CLAIM_NOW)
)
_FREE = (
    update(_processed)
    .where(_c.message_id == bindparam("claim_id"), _c.state == CLAIM_ACQUIRED)
    .values(state=CLAIM_RELEASED, token=None, lease_expires_at=None, processed_at=CLAIM_NOW)
)
_STATUS = select(_c.state, _c.response, _c.lease_expires_at, _c.processed_at).where(
    _c.message_id == bindparam("claim_id")
)
_TICKET = select(_c.ticket).where(CLAIM_IS_MINE)
_EARLIER_IN_FLIGHT = (
    select(_c.message_id)
    .where(
        _c.session_id == bindparam("session_id"),
        _c.ticket < bindparam("ticket"),
        _c.state == CLAIM_ACQUIRED,
        _c.lease_expires_at > CLAIM_HORIZON,
    )
    .limit(1)
)
"""An earlier claim of the session still held, or lapsed less than one lease ago (see
:meth:`WebhookClaim.order_horizon`)."""
_LIST = select(
    CLAIM_NOW.label("now"),
    _c.message_id,
    _c.state,
    _c.session_id,
    _c.ticket,
    _c.claimed_at,
    _c.lease_expires_at,
    _c.processed_at,
    _c.response.is_not(None).label("has_response"),
)


class SQLClaims:
    """:class:`ClaimBackend` of the SQL stores: the statements above on the store's engine.

    Args:
        runtime: Where the statements run.
        run_blocking: The store's way to run blocking work off the loop.
        support: The dialect's hooks (the acquire statement, and reading its row).
        turns: The store's turns, offered a session lease taken with a claim.
        dedup_ttl: The store's dedup window.
        upkeep: The store's dedup upkeep, called after each acquire.

    """

    def __init__(
        self,
        runtime: StoreRuntime,
        run_blocking: RunBlocking,
        support: DialectSupport,
        turns: Turns,
        dedup_ttl: timedelta,
        upkeep: Callable[[datetime], None],
    ) -> None:
        self._runtime = runtime
        self._run_blocking = run_blocking
        self._support = support
        self._turns = turns
        self._dedup_ttl = dedup_ttl
        self._upkeep = upkeep
        self._acquire = support.acquire_claim(_processed)
        # Session leases taken with a claim and not yet used by a turn, per claim.
        self._offered: weakref.WeakKeyDictionary[WebhookClaim, Lease] = (
            weakref.WeakKeyDictionary()
        )

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run blocking work as the store's async API does."""
        return await self._run_blocking(fn, *args)

    def _execute(self, statement: Any, params: dict[str, Any]) -> Any:
        with self._runtime.transaction(single=True) as conn:
            return conn.execute(statement, params)

    def acquire(self, claim: WebhookClaim) -> Acquisition:
        """Take the claim in one statement, or read why not (done, or in flight)."""
        now = utcnow()
        params = {
            "message_id": claim.message_id,
            "now": now,
            "cutoff": now - self._dedup_ttl,
            "token": claim.token,
            "lease": claim.lease_until(now),
            "session_id": claim.session_id,
            "claim_id": claim.message_id,
            "claim_token": claim.token,
            "horizon": claim.order_horizon(now),
            "lease_seconds": claim.lease_seconds,
            "ttl_seconds": self._dedup_ttl.total_seconds(),
        }
        # The session's turn lease, for a backend that takes it with the claim.
        params.update(self._turns.leases.take_params())
        with telemetry.operation("claim", self._runtime.system) as op:
            got = self._acquire_in_one_call(claim, params)
            op.set("chatflow.claim.status", got.status)
        self._upkeep(now)
        return got

    def _acquire_in_one_call(self, claim: WebhookClaim, params: dict[str, Any]) -> Acquisition:
        ordered = claim.session_id is not None
        with self._runtime.transaction(single=True) as conn:
            got = self._support.read_claim(conn.execute(self._acquire, params))
            if not got.acquired:
                row = conn.execute(_STATUS, params).first()
                if row is None or row.state != CLAIM_DONE:
                    return Acquisition(False)
                return Acquisition(False, done=True, response=row.response)
            ticket = got.ticket
            if ticket is None and ordered:
                ticket = conn.execute(_TICKET, params).scalar()
            earlier_seen = True
            if ticket is not None and ordered:
                earlier_seen = (
                    got.earlier_in_flight
                    if got.earlier_in_flight is not None
                    # A statement of its own: it must see claims committed after the
                    # acquire began (a plain RETURNING column reads the acquire's snapshot).
                    else conn.execute(_EARLIER_IN_FLIGHT, {**params, "ticket": ticket}).first()
                    is not None
                )
        if got.lease_fence is not None and claim.session_id is not None:
            assert got.session_version is not None
            lease = Lease(
                claim.session_id, params["holder_token"], got.lease_fence, got.session_version
            )
            self._offered[claim] = lease
            self._turns.offer(lease)
        return Acquisition(
            True, ticket=ticket, partition_day=got.partition_day,
            session_version=got.session_version, version_read=got.session_checked,
            earlier_seen=earlier_seen,
        )

    def finish(self, claim: WebhookClaim) -> bool:
        """Mark the claim done with its reply; False if the token is gone.

        Nothing to send when the claim's turn already stored this very reply
        with the claim (the turn's last model message, the usual
        ``claim.response``).
        """
        try:
            if claim.stored_with_turn:
                return True
            params = {
                "claim_id": claim.message_id,
                "claim_token": claim.token,
                "reply": claim.response,
                "now": utcnow(),
            }
            return bool(self._execute(_FINISH, params).rowcount == 1)
        finally:
            self._withdraw_session_lease(claim)

    def finishes_in_memory(self, claim: WebhookClaim) -> bool:
        """Whether :meth:`finish` sends nothing: its turn stored this reply with the claim.

        Nor is there a session lease to give back (none was taken with the
        claim, or a turn used it), so the caller may finish on the loop.
        """
        if not claim.stored_with_turn:
            return False
        lease = self._offered.get(claim)
        return lease is None or not self._turns.is_offered(lease)

    def renew(self, claim: WebhookClaim) -> bool:
        """Extend the lease while the token holds; False once it is gone."""
        params = {
            "claim_id": claim.message_id,
            "claim_token": claim.token,
            "lease": claim.lease_until(utcnow()),
            "lease_seconds": claim.lease_seconds,
        }
        return bool(self._execute(_RENEW, params).rowcount == 1)

    def release(self, claim: WebhookClaim) -> None:
        """Let the next delivery acquire the id (a done claim is left done)."""
        params = {"claim_id": claim.message_id, "claim_token": claim.token, "now": utcnow()}
        try:
            self._execute(_RELEASE, params)
        finally:
            self._withdraw_session_lease(claim)

    def _withdraw_session_lease(self, claim: WebhookClaim) -> None:
        """The lease the acquire took, if no turn used it, goes back (best effort)."""
        lease = self._offered.pop(claim, None)
        if lease is not None and self._turns.withdraw(lease):
            try:
                self._turns.leases.release(lease)
            except Exception as exc:  # it expires on its own
                logger.warning("could not give back the lease of session %r: %s",
                               lease.session_id, exc)

    def earlier_in_flight(self, claim: WebhookClaim) -> bool:
        """True while an earlier claim of the session is held under a live lease."""
        if claim.ticket is None:
            return False
        params = {
            "session_id": claim.session_id,
            "ticket": claim.ticket,
            "horizon": claim.order_horizon(utcnow()),
            "lease_seconds": claim.lease_seconds,
        }
        with self._runtime.transaction(single=True) as conn:
            return conn.execute(_EARLIER_IN_FLIGHT, params).first() is not None

    def list(self, limit: int | None) -> list[ClaimInfo]:
        """Rows for ``dedup list``, most recently changed first."""
        with self._runtime.transaction() as conn:
            return read_claims(conn, limit=limit)

    def free(self, message_id: str) -> bool:
        """Release a held claim whoever holds it (``dedup release``); False if none is held."""
        with self._runtime.transaction(write=True) as conn:
            return free_claim(conn, message_id)


def read_claims(conn: Connection, *, limit: int | None = 100) -> list[ClaimInfo]:
    """``dedup list`` on a connection (a read-only one will do): newest change first.

    Leases are judged by the database's clock, as the claims themselves are.
    """
    query = _LIST.order_by(_c.processed_at.desc(), _c.message_id)
    if limit is not None:
        query = query.limit(limit)
    return [
        claim_info(
            row.message_id, row.state, row.session_id, row.ticket, row.claimed_at,
            row.lease_expires_at, row.processed_at, bool(row.has_response), row.now,
        )
        for row in conn.execute(query, {"now": utcnow()})
    ]


def free_claim(conn: Connection, message_id: str) -> bool:
    """``dedup release ID`` on a connection (the caller commits): True if a claim was held."""
    return bool(conn.execute(_FREE, {"claim_id": message_id, "now": utcnow()}).rowcount == 1)
