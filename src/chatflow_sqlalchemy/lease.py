"""The turn's lease on its session row: what a turn holds while the model runs.

A turn takes the session's lease with one statement (an ``UPDATE`` of the
session row that succeeds only if the lease is free or expired), which also
reads the session's version, so the context knows whether it must catch up.
The lease is an owner token, an expiry and a fencing counter bumped by every
take, kept in the session row; expiry is judged by the database's clock
(:class:`~chatflow_sqlalchemy.clock.DatabaseNow`). Nothing else is held: no
connection, no transaction, no advisory lock. The turn's write checks that
the lease is still this holder's and releases it in the same statement
(:mod:`chatflow_sqlalchemy.writer`); a turn that writes nothing releases it
with :data:`RELEASE` (a failed turn on a session made for it, that nothing
was written to, also makes it unborn again: :meth:`SessionLeases.release`).

The statements are portable SQL: every backend, SQLite included, gets the
same cross-process exclusion. A backend without ``UPDATE ... RETURNING``
reads the version back in the same transaction.
"""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import ColumnElement, Float, bindparam, null, or_, select, update

from chatflow_sqlalchemy import tables
from chatflow_sqlalchemy.clock import DatabaseNow
from chatflow_sqlalchemy.tables import UTCDateTime
from chatflow_sqlalchemy.values import UNBORN_AGENT, Lease, utcnow

if TYPE_CHECKING:  # the CLI's sweep reads lease times without the store's runtime
    from chatflow_sqlalchemy.runtime import StoreRuntime

__all__ = [
    "KEEP_HELD",
    "LEASE_FREE",
    "LEASE_HELD",
    "RELEASE",
    "TAKE_VALUES",
    "SessionLeases",
    "free_at",
    "lease_params",
]

_s = tables.sessions
_SECONDS = bindparam("turn_lease_seconds", type_=Float())
_NOW = DatabaseNow(bindparam("lease_now", type_=UTCDateTime()))
_UNTIL = DatabaseNow(bindparam("lease_until", type_=UTCDateTime()), _SECONDS)
_SESSION = _s.c.session_id == bindparam("sid")
_MINE = (
    _SESSION
    & (_s.c.lease_owner == bindparam("holder_token"))
    & (_s.c.lease_fence == bindparam("holder_fence"))
)

LEASE_HELD = _MINE & (_s.c.lease_expires_at > _NOW)
"""The session row while this holder's lease is unexpired (parameters: :func:`lease_params`)."""


def free_at(now: ColumnElement[datetime]) -> ColumnElement[bool]:
    """The session row's lease is free, or expired at ``now`` (a database-clock time)."""
    return or_(_s.c.lease_owner.is_(None), _s.c.lease_expires_at <= now)


LEASE_FREE = free_at(_NOW)
"""The session row's lease is free or expired (parameter ``lease_now``)."""
TAKE_VALUES: dict[str, Any] = {
    "lease_owner": bindparam("holder_token"),
    "lease_fence": _s.c.lease_fence + 1,
    "lease_expires_at": _UNTIL,
}
"""What taking the lease sets (``holder_token``, ``lease_until``, ``turn_lease_seconds``)."""
_TAKE = update(_s).where(_SESSION, LEASE_FREE).values(TAKE_VALUES)
_TAKE_RETURNING = _TAKE.returning(_s.c.version, _s.c.lease_fence)
"""The take where UPDATE returns rows: built once, so SQLAlchemy's compiled cache hits at once."""
_TAKEN = select(_s.c.version, _s.c.lease_fence).where(
    _SESSION, _s.c.lease_owner == bindparam("holder_token")
)
_EXISTS = select(_s.c.session_id).where(_SESSION)
KEEP_HELD = update(_s).where(LEASE_HELD).values(lease_expires_at=_UNTIL)
"""Check the lease is still held and move it on (also :meth:`SessionLeases.until_params`):
a renewal, and an inbox batch's own transactions, which keep the lease for its reply."""
RELEASE = update(_s).where(_MINE).values(lease_owner=null(), lease_expires_at=null())
"""Give the lease back (whether or not it expired meanwhile), if it is still this holder's."""
_UNMAKE = (
    update(_s)
    .where(_MINE, _s.c.version == bindparam("made_version"))
    .values(active_agent_name=UNBORN_AGENT, version=_s.c.version + 1)
)
"""Make a session unborn again if it is still at the version it was made at, under this lease."""
_RELEASE_UNMADE = _UNMAKE.values(lease_owner=null(), lease_expires_at=null())
_UNMAKE_FREE = (
    update(_s)
    .where(_SESSION, LEASE_FREE, _s.c.version == bindparam("made_version"))
    .values(active_agent_name=UNBORN_AGENT, version=_s.c.version + 1)
)
""":data:`_UNMAKE` for a session whose lease no one holds: the turn's lease went with a
deleted row, and the session made anew under the id for the turn is not under it."""


def lease_params(lease: Lease) -> dict[str, Any]:
    """Bind parameters of :data:`LEASE_HELD` and :data:`RELEASE`."""
    return {
        "sid": lease.session_id,
        "holder_token": lease.owner,
        "holder_fence": lease.fence,
        "lease_now": utcnow(),
    }


class SessionLeases:
    """Takes, renews and gives back the turn leases of one store's sessions.

    Each call is one short transaction on the store's runtime; the caller
    (the store's turns) decides when to poll and when to renew.

    Args:
        runtime: Where the statements run.
        lease_seconds: How long a lease lasts without renewal.

    """

    def __init__(self, runtime: StoreRuntime, lease_seconds: float) -> None:
        self._runtime = runtime
        self.lease_seconds = lease_seconds
        self._returning = runtime.engine.dialect.update_returning

    def take(self, session_id: str) -> Lease | None:
        """Take the session's lease if it is free or expired; None while another holds it.

        Raises:
            SessionDeletedError: The session does not exist.

        """
        params = {"sid": session_id, **self.take_params()}
        if self._returning:
            with self._runtime.transaction(single=True) as conn:
                row = conn.execute(_TAKE_RETURNING, params).first()
        else:
            with self._runtime.transaction(write=True) as conn:
                taken = conn.execute(_TAKE, params).rowcount == 1
                row = conn.execute(_TAKEN, params).first() if taken else None
        if row is not None:
            return Lease(session_id, params["holder_token"], int(row[1]), int(row[0]))
        with self._runtime.transaction(single=True) as conn:
            exists = conn.execute(_EXISTS, params).first() is not None
        if not exists:
            from chatflow_sqlalchemy.exceptions import SessionDeletedError

            raise SessionDeletedError(session_id)
        return None

    def renew(self, lease: Lease) -> bool:
        """Move the lease's expiry on; False if it expired or was taken over."""
        params = {**lease_params(lease), **self.until_params()}
        with self._runtime.transaction(single=True) as conn:
            return conn.execute(KEEP_HELD, params).rowcount == 1

    def release(self, lease: Lease, made: int | None = None) -> None:
        """Give the lease back (a turn that wrote nothing, or whose write failed).

        ``made``: the version the session was made at for the turn, which
        failed. If the session is still at it (nothing was ever written to
        it), the same statement makes it unborn again (no agent, version + 1):
        ``get`` and ``list_sessions`` no longer show it, and a turn waiting
        for the lease catches up and gives it its agent by its write. So it
        is too if the lease is no longer on its row (the session was deleted
        under the turn and made anew for it) and no one else holds that row's.
        """
        params = lease_params(lease)
        if made is None:
            with self._runtime.transaction(single=True) as conn:
                conn.execute(RELEASE, params)
        else:
            with self._runtime.transaction(write=True) as conn:
                unmade = conn.execute(_RELEASE_UNMADE, {**params, "made_version": made})
                if unmade.rowcount != 1 and conn.execute(RELEASE, params).rowcount != 1:
                    conn.execute(_UNMAKE_FREE, {**params, "made_version": made})
        lease.released = True

    def unmake(self, lease: Lease, made: int) -> None:
        """:meth:`release`'s unmaking alone, for a lease its inbox batch keeps."""
        params = {**lease_params(lease), "made_version": made}
        with self._runtime.transaction(write=True) as conn:
            if conn.execute(_UNMAKE, params).rowcount != 1:
                conn.execute(_UNMAKE_FREE, params)

    def take_params(self) -> dict[str, Any]:
        """Parameters of a take by a new holder (a fresh token), but the session's."""
        return {"holder_token": secrets.token_hex(16), "lease_now": utcnow(), **self.until_params()}

    def until_params(self) -> dict[str, Any]:
        """The expiry's parameters (the worker's value only where no database clock renders)."""
        until = utcnow() + timedelta(seconds=self.lease_seconds)
        return {"lease_until": until, "turn_lease_seconds": self.lease_seconds}
