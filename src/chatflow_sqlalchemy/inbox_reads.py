"""What operators read of the inbox (``inbox list``, ``inbox stats``), and how.

Its states, the values read and the statements that read them, kept apart from
the worker (:mod:`chatflow_sqlalchemy.inbox`) and the store's inbox rows
(:mod:`chatflow_sqlalchemy.sql_inbox`), so the CLI's read commands load neither.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, bindparam, func, literal_column, select

from chatflow_sqlalchemy import tables
from chatflow_sqlalchemy.clock import DatabaseNow
from chatflow_sqlalchemy.tables import UTCDateTime
from chatflow_sqlalchemy.values import utcnow

__all__ = [
    "DEAD", "DONE", "INBOX_STATES", "IN_FLIGHT", "PENDING", "SENT", "InboxEntry", "InboxStats",
    "read_entries", "read_stats",
]

PENDING, IN_FLIGHT, DONE, SENT, DEAD = "pending", "in_flight", "done", "sent", "dead"
INBOX_STATES = (PENDING, IN_FLIGHT, DONE, SENT, DEAD)
"""Every state an inbox message can be in, in the order it goes through them."""

_i = tables.inbox
_ENTRIES = select(
    _i.c.message_id, _i.c.session_id, _i.c.state, _i.c.attempts, _i.c.received_at,
    _i.c.updated_at, _i.c.sent_at, _i.c.error,
).order_by(_i.c.id)
_COUNTS = select(_i.c.state, func.count()).group_by(_i.c.state)
_OLDEST_PENDING = select(
    DatabaseNow(bindparam("now", type_=UTCDateTime())).label("now"), func.min(_i.c.received_at)
).where(_i.c.state == literal_column(f"'{PENDING}'"))
_DEAD_LAST_HOUR = select(func.count()).where(
    _i.c.state == literal_column(f"'{DEAD}'"),
    _i.c.updated_at > DatabaseNow(bindparam("hour_ago", type_=UTCDateTime()), -3600.0),
)


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


@dataclass(frozen=True)
class InboxEntry:
    """One inbox message as operators see it (``inbox list``).

    Attributes:
        message_id: The platform's id.
        session_id: Its session.
        state: One of :data:`INBOX_STATES`.
        attempts: Batches that took it.
        received_at: When it was stored.
        updated_at: Its last change of state.
        sent_at: The platform's timestamp, if given.
        error: Why its last attempt failed, if it did.

    """

    message_id: str
    session_id: str
    state: str
    attempts: int
    received_at: datetime
    updated_at: datetime
    sent_at: datetime | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (times as ISO 8601)."""
        fields = asdict(self)
        for name in ("received_at", "updated_at", "sent_at"):
            fields[name] = _iso(fields[name])
        return fields


@dataclass(frozen=True)
class InboxStats:
    """Counts for operators (``inbox stats``).

    Attributes:
        counts: Messages per state (every state present, zero included).
        oldest_pending_seconds: Age of the oldest pending message, None if none.
        dead_last_hour: Messages that died in the last hour.

    """

    counts: dict[str, int]
    oldest_pending_seconds: float | None
    dead_last_hour: int

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return asdict(self)


def read_entries(conn: Connection, state: str | None, limit: int | None) -> list[InboxEntry]:
    """``inbox list`` on a connection (a read-only one will do): messages in arrival order.

    ``state``, if given, is one of the inbox's states (checked by the caller).
    """
    query = _ENTRIES if state is None else _ENTRIES.where(_i.c.state == state)
    return [InboxEntry(*row) for row in conn.execute(query.limit(limit))]


def read_stats(conn: Connection) -> InboxStats:
    """``inbox stats`` on a connection (a read-only one will do).

    The oldest pending message's age and the last hour are the database's clock, as
    the leases are.
    """
    now = utcnow()
    counts = dict.fromkeys(INBOX_STATES, 0)
    counts.update({state: int(n) for state, n in conn.execute(_COUNTS)})
    clock, oldest = conn.execute(_OLDEST_PENDING, {"now": now}).one()
    dead = conn.execute(_DEAD_LAST_HOUR, {"hour_ago": now - timedelta(hours=1)})
    age = None if oldest is None else max(0.0, (clock - oldest).total_seconds())
    return InboxStats(counts, age, int(dead.scalar() or 0))
