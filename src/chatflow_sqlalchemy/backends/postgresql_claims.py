"""PostgreSQL's webhook claims: the table partitioned by day, one row per id, ordered tickets.

``chatflow_processed_messages`` is a ``PARTITION BY RANGE (partition_day)``
table on PostgreSQL (revision 0006): one partition per UTC day, named
``chatflow_processed_messages_pYYYYMMDD``, and a ``DEFAULT`` partition for rows
of a day that has none yet. Purging expired ids drops whole day partitions
instead of deleting row by row, so the table gives its disk back at once and
writes no WAL for the rows it removes.

**One row per id, across partitions.** PostgreSQL requires the partition key
in every unique key, so the primary key is ``(message_id, partition_day)``
and cannot by itself stop a second row of an id in another day's partition.
Every statement that inserts an id therefore takes its day from
``chatflow_claim_day(id)`` (created by revision 0006): it waits for a
transaction-scoped advisory lock on the id, then (a volatile PL/pgSQL function
takes a fresh snapshot for each query) returns the day of the id's existing
row, whatever partition holds it. A concurrent insert of the same id waits
for the lock, sees the committed row, and lands on it with ``ON CONFLICT``;
only an id never seen before goes to today's partition.

**Claims of one session in order, in one statement.** A claim's ticket comes
from ``chatflow_claim_ticket(session)``, which draws it under a
transaction-scoped advisory lock on the session: the claims of a session
draw their tickets one at a time, each after the one before committed. The
claim's ``RETURNING`` then asks ``chatflow_claim_waits(session, ticket,
horizon)`` whether an earlier claim of the session is still in flight, in a
snapshot of its own that sees every claim with a smaller ticket. So the
acquire and the first look for earlier claims are one round trip, and two
claims of one session taken at the same moment can no longer both miss each
other. The ``RETURNING`` also gives the session's version (:func:`session_version`),
for the claim block's first ``get_or_create``.

**Upkeep** (:func:`drop_expired_days`, run by the store's purge and
``chatflow-sqlalchemy dedup purge``): partitions are created a week ahead;
a day partition entirely before the purge's cutoff is dropped, after the few
rows in it that are still live (an id taken over or finished days after its
first claim: ``processed_at`` moved on) are moved to today's partition. Rows
that fell into the default partition (a day without a partition of its own)
stay there and are deleted in batches once expired. One purge runs at a
time per table (:data:`PURGE_LOCK_KEYS`); a role that does not own the table cannot
create or drop partitions and deletes expired rows in batches instead.
"""

from __future__ import annotations

import logging
import re
from datetime import date, datetime, timedelta, timezone
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Date,
    Select,
    Table,
    bindparam,
    cast,
    exists,
    func,
    literal_column,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import DBAPIError, OperationalError

from chatflow_sqlalchemy import rows
from chatflow_sqlalchemy.clock import CLAIM_HORIZON
from chatflow_sqlalchemy.dialect import on_conflict_acquire
from chatflow_sqlalchemy.lease import LEASE_FREE, TAKE_VALUES
from chatflow_sqlalchemy.tables import UTCDateTime

__all__ = [
    "CLAIM_LOCK_CLASS",
    "DAYS_AHEAD",
    "DEFAULT_PARTITION",
    "DRAIN_BATCH",
    "DROP_LOCK_TIMEOUT",
    "PARENT",
    "PURGE_LOCK_CLASS",
    "PURGE_LOCK_KEYS",
    "acquire_with_lease",
    "claim_day",
    "claim_ticket",
    "claim_waits",
    "create_day_partitions",
    "drop_expired_days",
    "partition_name",
    "session_version",
    "utc_day",
]

logger = logging.getLogger(__name__)

PARENT = "chatflow_processed_messages"
"""The partitioned table (what every statement names)."""

DEFAULT_PARTITION = f"{PARENT}_default"
"""Rows of a day that has no partition of its own land here."""

PURGE_LOCK_CLASS = 0x63667075
"""The first key of the purge's two-key advisory lock ("cfpu"): one purge at a time.

The second key is the claims table's oid, so a purge of the table in another
schema of the database never holds this one back."""

PURGE_LOCK_KEYS = f"{PURGE_LOCK_CLASS}, CAST(CAST(CAST('{PARENT}' AS regclass) AS oid) AS integer)"
"""The lock's two keys, as SQL (the table is found on the ``search_path``)."""

DRAIN_BATCH = 1000
"""Expired rows of the default partition deleted by one upkeep."""

DAYS_AHEAD = 7
"""Day partitions kept ready beyond today, so a week without a purge still drops by day."""

DROP_LOCK_TIMEOUT = "2s"
"""How long the purge waits for the table lock that dropping a partition needs.

Claims wait behind the purge's lock request, so the purge gives up rather
than stall them behind a long transaction; the next purge tries again."""

CLAIM_LOCK_CLASS = 0x63666C77
"""The first key of the two-key advisory locks on message ids ("cflw").

The two-key form is a key space of its own: these locks never meet the
store's turn locks or its migration lock (one-key ``bigint`` locks)."""

# The claim functions (chatflow_claim_day, chatflow_claim_ticket, chatflow_claim_waits)
# are created by revision 0006, which holds their SQL; a change to them is a new revision.

_DAY_NAME = re.compile(rf"^{PARENT}_p(\d{{8}})$")


def partition_name(day: date) -> str:
    """The table name of ``day``'s partition."""
    return f"{PARENT}_p{day:%Y%m%d}"


def utc_day(moment: datetime) -> date:
    """The UTC calendar day of an aware ``moment``."""
    return moment.astimezone(timezone.utc).date()


def claim_day(now: Any) -> Any:
    """The ``partition_day`` of an inserted id: its row's day, else the UTC day of ``now``.

    ``now`` is the statement's timestamp: a bind parameter, or the database's
    clock for a claim (``clock.CLAIM_NOW``).
    """
    return func.coalesce(
        func.chatflow_claim_day(bindparam("message_id")),
        cast(func.timezone(literal_column("'UTC'"), now), Date),
    )


def claim_ticket() -> Any:
    """A claim's ticket: drawn under its session's lock (bind parameter ``session_id``)."""
    return func.chatflow_claim_ticket(bindparam("session_id"))


def claim_waits(table: Table) -> Any:
    """The ``RETURNING`` column that says whether an earlier claim of the session is in flight.

    Its horizon (one lease ago) is read from the database's clock.
    """
    c = table.c
    return func.chatflow_claim_waits(c.session_id, c.ticket, CLAIM_HORIZON).label("earlier")


def session_version(table: Table) -> Any:
    """The ``RETURNING`` column with the claimed session's version (NULL: no such session)."""
    sessions = rows.sessions.name
    # Spelled out: SQLAlchemy does not correlate a subquery inside RETURNING.
    version = (
        f"(SELECT {sessions}.version FROM {sessions} "
        f"WHERE {sessions}.session_id = {table.name}.session_id)"
    )
    return literal_column(version, BigInteger()).label("session_version")


def acquire_with_lease(table: Table, ticket: Any) -> Select[Any]:
    """The claim's acquire, then the session's turn lease in the same statement.

    Returns one row when the claim was acquired: ``(ticket, earlier,
    session_version, partition_day, lease_fence)``. The lease is taken (as
    :mod:`chatflow_sqlalchemy.lease` takes it) only when no earlier claim of
    the session is in flight and the lease is free or expired; otherwise
    ``lease_fence`` is NULL. The session row is locked ``SKIP LOCKED``:
    the acquire never waits for it, so it cannot deadlock with a transaction
    that locks the session before its claims (``erase_user``, ``sweep``); a
    row locked elsewhere means no lease with the claim (the turn takes it).
    """
    day = claim_day(bindparam("now", type_=UTCDateTime()))
    acquired = (
        on_conflict_acquire(pg_insert, table, ticket, day)
        .returning(claim_waits(table), session_version(table), table.c.partition_day)
        .cte("acquired")
    )
    sessions = rows.sessions
    free_row = (
        select(sessions.c.session_id)
        .where(sessions.c.session_id == bindparam("session_id"), LEASE_FREE)
        .with_for_update(key_share=True, skip_locked=True)
        .scalar_subquery()
    )
    leased = (
        update(sessions)
        .where(
            sessions.c.session_id == free_row,
            exists(select(acquired.c.ticket).where(~acquired.c.earlier)),
        )
        # session_id set to itself: else SQLAlchemy would SET it from the
        # statement's "session_id" parameter (a DML in a WITH takes its SET
        # columns from the execution's parameter names too).
        .values({**TAKE_VALUES, "session_id": sessions.c.session_id})
        .returning(sessions.c.version, sessions.c.lease_fence)
        .cte("leased")
    )
    return select(
        acquired.c.ticket,
        acquired.c.earlier,
        func.coalesce(
            select(leased.c.version).scalar_subquery(), acquired.c.session_version
        ),
        acquired.c.partition_day,
        select(leased.c.lease_fence).scalar_subquery(),
    )


def create_day_partitions(connection: Connection, first: date, last: date) -> list[str]:
    """Create the missing day partitions from ``first`` to ``last``; return their names.

    A day whose rows already sit in the default partition is skipped (its
    partition could not be attached over them); they stay there, and the
    upkeep deletes them in batches once expired.
    """
    created = []
    for day in _missing_days(connection, first, last, set(_children(connection))):
        name = partition_name(day)
        bounds = f"FOR VALUES FROM ('{day}') TO ('{day + timedelta(1)}')"
        connection.execute(
            text(f'CREATE TABLE IF NOT EXISTS "{name}" PARTITION OF {PARENT} {bounds}')
        )
        created.append(name)
    return created


def drop_expired_days(connection: Connection, cutoff: datetime, now: datetime) -> int:
    """Drop the day partitions before ``cutoff``'s day; return the expired rows removed.

    The module's upkeep, in the caller's transaction (its ``lock_timeout`` is
    put back after). A purge that finds another one running returns 0 at once;
    the table's lock is waited for at most :data:`DROP_LOCK_TIMEOUT`, and when
    it is not granted no partition changes (logged). A role that does not own
    the table deletes one batch of expired rows instead (warned once).
    """
    taken = connection.execute(
        text(f"SELECT pg_try_advisory_xact_lock({PURGE_LOCK_KEYS})")
    ).scalar()
    if not taken:
        return 0
    today = utc_day(now)
    if not _owns_table(connection):
        _warn_not_owner()
        return _purge_batch(connection, PARENT, cutoff)  # row by row, as on other databases
    removed = _purge_batch(connection, DEFAULT_PARTITION, cutoff)
    children = _children(connection)
    expired = sorted(day for day in _days(children) if day < utc_day(cutoff))
    ahead = today + timedelta(DAYS_AHEAD)
    if not expired and not _missing_days(connection, today, ahead, set(children)):
        return removed
    # Counted before the lock: nothing inserts into a past day (new ids go to today).
    sizes = {day: _size(connection, day) for day in expired}
    previous = connection.execute(text("SELECT current_setting('lock_timeout')")).scalar()
    connection.execute(text(f"SET LOCAL lock_timeout = '{DROP_LOCK_TIMEOUT}'"))
    try:
        with connection.begin_nested():
            removed += _rotate(connection, cutoff, today, sizes)
    except DBAPIError as exc:
        level = logging.INFO if isinstance(exc, OperationalError) else logging.WARNING
        logger.log(
            level,
            "claims purge: day partitions left as they are (%s); creating and dropping them "
            "needs the table's owner and its lock within %s",
            exc.orig, DROP_LOCK_TIMEOUT,
        )
    finally:
        connection.execute(
            text("SELECT set_config('lock_timeout', :value, true)"), {"value": previous}
        )
    return removed


def _rotate(
    connection: Connection, cutoff: datetime, today: date, sizes: dict[date, int]
) -> int:
    # Claims read the day of an id's row, then write it: they must not see it move.
    connection.execute(text(f"LOCK TABLE {PARENT} IN ACCESS EXCLUSIVE MODE"))
    create_day_partitions(connection, today, today + timedelta(DAYS_AHEAD))
    present = set(_days(_children(connection)))
    removed = 0
    for day, size in sizes.items():
        if day in present:
            removed += size - _drop_day(connection, day, cutoff, today)
    return removed


def _drop_day(connection: Connection, day: date, cutoff: datetime, today: date) -> int:
    """Move the day's live rows to today, drop the day; return how many moved."""
    moved = connection.execute(
        text(
            f"UPDATE {PARENT} SET partition_day = :today "
            "WHERE partition_day = :day AND processed_at >= :cutoff"
        ),
        {"today": today, "day": day, "cutoff": cutoff},
    ).rowcount
    name = partition_name(day)
    connection.execute(text(f'DROP TABLE IF EXISTS "{name}"'))
    logger.debug("claims purge: dropped %s (%d live rows moved to today)", name, moved)
    return int(moved)


def _purge_batch(connection: Connection, table: str, cutoff: datetime) -> int:
    """Delete one batch of expired rows from ``table`` (the default partition, or all)."""
    return int(
        connection.execute(
            text(
                f"DELETE FROM {table} WHERE message_id IN (SELECT message_id "
                f"FROM {table} WHERE processed_at < :cutoff LIMIT {DRAIN_BATCH})"
            ),
            {"cutoff": cutoff},
        ).rowcount
    )


def _missing_days(
    connection: Connection, first: date, last: date, existing: set[str]
) -> list[date]:
    """Days without a partition that one can be made for (none of their rows in default)."""
    return [
        day
        for day in (first + timedelta(n) for n in range((last - first).days + 1))
        if partition_name(day) not in existing and not _default_holds(connection, day)
    ]


def _owns_table(connection: Connection) -> bool:
    """Whether this role may create and drop the table's partitions (it owns the table)."""
    return bool(
        connection.execute(
            text(
                "SELECT pg_has_role(current_user, relowner, 'USAGE') FROM pg_class "
                "WHERE oid = CAST(:parent AS regclass)"
            ),
            {"parent": PARENT},
        ).scalar()
    )


_WARNED_NOT_OWNER: list[bool] = []


def _warn_not_owner() -> None:
    if not _WARNED_NOT_OWNER:
        _WARNED_NOT_OWNER.append(True)
        logger.warning(
            "claims purge: this role does not own %s, so day partitions are neither created "
            "nor dropped (expired ids are deleted row by row); run the purge as the owner, "
            "e.g. `chatflow-sqlalchemy dedup purge` from the role that migrated",
            PARENT,
        )


def _size(connection: Connection, day: date) -> int:
    return int(
        connection.execute(text(f'SELECT count(*) FROM "{partition_name(day)}"')).scalar_one()
    )


def _children(connection: Connection) -> list[str]:
    rows = connection.execute(
        text(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = CAST(:parent AS regclass)"
        ),
        {"parent": PARENT},
    )
    return [row[0] for row in rows]


def _days(children: list[str]) -> list[date]:
    found = []
    for name in children:
        match = _DAY_NAME.match(name)
        if match:
            found.append(datetime.strptime(match.group(1), "%Y%m%d").date())
    return found


def _default_holds(connection: Connection, day: date) -> bool:
    row = connection.execute(
        text(f"SELECT 1 FROM {DEFAULT_PARTITION} WHERE partition_day = :day LIMIT 1"),
        {"day": day},
    ).first()
    return row is not None
