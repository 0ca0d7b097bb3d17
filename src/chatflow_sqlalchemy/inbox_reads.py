"""What operators read of the inbox (``inbox list``, ``inbox stats``): the statements.

Kept apart from the worker (:mod:`chatflow_sqlalchemy.inbox`) and the store's inbox
rows (:mod:`chatflow_sqlalchemy.sql_inbox`), so the CLI's read commands load neither;
the values they return live in :mod:`chatflow_sqlalchemy.values`, which the in-memory
store (no SQLAlchemy) shares.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import Connection, bindparam, func, literal_column, select

from chatflow_sqlalchemy import tables
from chatflow_sqlalchemy.clock import DatabaseNow
from chatflow_sqlalchemy.tables import UTCDateTime
from chatflow_sqlalchemy.values import DEAD, INBOX_STATES, PENDING, InboxEntry, InboxStats, utcnow

__all__ = ["read_entries", "read_stats"]

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
