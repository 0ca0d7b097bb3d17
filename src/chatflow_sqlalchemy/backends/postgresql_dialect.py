"""PostgreSQL's dialect support, importing neither psycopg nor a store.

The SQL of claims and writes (:mod:`.postgresql_claims`, :mod:`.postgresql_write`)
is imported when a statement is first built.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import URL, Connection, CursorResult, Engine, Executable, Select, bindparam, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.dml import Insert
from sqlalchemy.sql.schema import Table

from chatflow_sqlalchemy.dialect import (
    RECLAIMED_AS_DONE,
    AcquiredClaim,
    DialectSupport,
    SessionWrite,
    ping_when_idle,
)
from chatflow_sqlalchemy.tables import UTCDateTime
from chatflow_sqlalchemy.urls import psycopg_url

__all__ = [
    "CONNECT_TIMEOUT_SECONDS", "INSTALL_HINT", "MIGRATION_LOCK_KEY", "PREPARE_THRESHOLD",
    "TCP_OPTIONS", "PostgresDialectSupport", "default_connect_args", "jsonb_dumps",
]

INSTALL_HINT = "PostgreSQL needs psycopg 3: pip install 'chatflow-sqlalchemy[postgres]'"
"""What to install when psycopg is missing (the ``postgres`` extra)."""

MIGRATION_LOCK_KEY = 0x63686174666C6F77 & 0x7FFFFFFFFFFFFFFF
"""Advisory lock key ("chatflow") held while migrations run."""

CONNECT_TIMEOUT_SECONDS = 10
"""libpq ``connect_timeout`` (opening a connection) unless the URL or ``connect_args`` set one."""

TCP_OPTIONS: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}
"""libpq TCP settings unless the URL or ``connect_args`` set them: a partitioned connection
fails in about 30 s, not TCP's ~15 minutes (a hung proxy needs the operation timeout)."""

PREPARE_THRESHOLD: int | None = None
"""psycopg's ``prepare_threshold`` unless ``connect_args`` set one: None prepares nothing,
so a transaction-pooling PgBouncer works unchanged (``connect_args={"prepare_threshold": 5}``
turns preparing back on, connected straight to the server)."""


def default_connect_args(url: URL, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``given``, over the defaults (timeouts, TCP, psycopg) that neither it nor ``url`` set."""
    given = dict(given or {})
    defaults: dict[str, Any] = {
        "connect_timeout": CONNECT_TIMEOUT_SECONDS,
        **TCP_OPTIONS,
        "prepare_threshold": PREPARE_THRESHOLD,
    }
    chosen = {k: v for k, v in defaults.items() if k not in url.query and k not in given}
    return {**chosen, **given}


def jsonb_dumps(value: Any) -> str:
    """``json.dumps`` for ``jsonb``, writing integral floats so they read back as floats.

    ``jsonb`` would give ``4.417402109863705e+16`` back as an int; such floats
    are written in full with a trailing ``.0``. Everything else is ``json.dumps``.
    """
    if not _any_exponent_integral(value):
        return json.dumps(value)
    marker = f"chatflow-float-{uuid.uuid4().hex}-"
    numbers: dict[str, str] = {}

    def replace(item: Any) -> Any:
        if isinstance(item, float) and _exponent_integral(item):
            key = f"{marker}{len(numbers)}"
            numbers[json.dumps(key)] = f"{int(item)}.0"
            return key
        if isinstance(item, dict):
            return {k: replace(v) for k, v in item.items()}
        if isinstance(item, (list, tuple)):
            return [replace(v) for v in item]
        return item

    text = json.dumps(replace(value))
    for placeholder, number in numbers.items():
        text = text.replace(placeholder, number)
    return text


def _exponent_integral(number: float) -> bool:
    return math.isfinite(number) and number.is_integer() and "e" in float.__repr__(number)


def _any_exponent_integral(value: Any) -> bool:
    """Whether ``value`` holds such a float, walked without recursion.

    A loop, so any nesting ``json.dumps`` takes passes here too; a container
    seen before is skipped, leaving a cycle for ``json.dumps`` to report.
    """
    pending, seen = [value], set()
    while pending:
        item = pending.pop()
        if isinstance(item, float):
            if _exponent_integral(item):
                return True
        elif isinstance(item, (dict, list, tuple)) and id(item) not in seen:
            seen.add(id(item))
            pending.extend(item.values() if isinstance(item, dict) else item)
    return False


def _processed_row() -> dict[str, Any]:
    """The values of a dedup row inserted by id (its day read under the id's lock)."""
    from chatflow_sqlalchemy.backends import postgresql_claims as pg_claims

    now = bindparam("processed_at", type_=UTCDateTime())
    return {
        "message_id": bindparam("message_id"),
        "processed_at": now,
        "partition_day": pg_claims.claim_day(now),
    }


class PostgresDialectSupport(DialectSupport):
    """PostgreSQL specifics: ``ON CONFLICT`` upserts, row locks, a one-statement write."""

    name = "postgresql"
    store_class = "chatflow_sqlalchemy.backends.postgresql:PostgresSessionStore"
    install_hint = INSTALL_HINT
    expires_processed_whole = True
    one_statement_write = True

    def engine_options(self, url: URL) -> dict[str, Any]:
        """A pool of 10 (+10 overflow), :func:`jsonb_dumps` and :func:`default_connect_args`."""
        return {
            "pool_size": 10,
            "max_overflow": 10,
            "json_serializer": jsonb_dumps,
            "connect_args": default_connect_args(url),
        }

    def prepare_engine(self, engine: Engine) -> None:
        """Ping connections idle for over a second (:func:`ping_when_idle`), surviving restarts."""
        ping_when_idle(engine)

    def async_url(self, url: URL) -> URL | None:
        """Async work runs natively on psycopg 3's async driver (no thread hop)."""
        return psycopg_url(url)

    def insert_ignore(self, table: Table) -> Insert:
        """``INSERT ... ON CONFLICT DO NOTHING``."""
        return pg_insert(table).on_conflict_do_nothing()

    def claim_processed(self, table: Table) -> Insert:
        """Insert the id, or take over an expired claim (in any day partition); else nothing."""
        stmt = pg_insert(table).values(_processed_row())
        return stmt.on_conflict_do_update(
            index_elements=[table.c.message_id, table.c.partition_day],
            set_={"processed_at": stmt.excluded.processed_at, **RECLAIMED_AS_DONE},
            where=table.c.processed_at < bindparam("cutoff", type_=UTCDateTime()),
        ).returning(table.c.message_id)

    def acquire_claim(self, table: Table) -> Executable:
        """``ON CONFLICT DO UPDATE ... WHERE ... RETURNING`` and the session's lease, at once.

        The block's turn then needs no statement of its own before the model runs.
        """
        from chatflow_sqlalchemy.backends import postgresql_claims as pg_claims

        return pg_claims.acquire_with_lease(table, self.claim_ticket(table))

    def read_claim(self, result: CursorResult[Any]) -> AcquiredClaim:
        """The ticket, earlier claims in flight, the session's version and the day, off one row."""
        row = result.first()
        if row is None:
            return AcquiredClaim(False)
        ticket, earlier, version, day, fence = tuple(row)
        return AcquiredClaim(True, ticket, bool(earlier), True, version, day, fence)

    def claim_ticket(self, table: Table) -> Any:
        """``chatflow_claim_ticket(session_id)``: ``nextval`` under the session's lock."""
        from chatflow_sqlalchemy.backends import postgresql_claims as pg_claims

        return pg_claims.claim_ticket()

    def upsert_processed(self, table: Table) -> Insert:
        """Insert the id or move its timestamp to now."""
        stmt = pg_insert(table).values(_processed_row())
        return stmt.on_conflict_do_update(
            index_elements=[table.c.message_id, table.c.partition_day],
            set_={"processed_at": stmt.excluded.processed_at},
        )

    def drop_expired_processed(
        self, connection: Connection, cutoff: datetime, now: datetime
    ) -> int:
        """Drop the expired day partitions, keep a week of them ready."""
        from chatflow_sqlalchemy.backends import postgresql_claims as pg_claims

        return pg_claims.drop_expired_days(connection, cutoff, now)

    def lock_session_row(self, select: Select[Any]) -> Select[Any]:
        """``FOR NO KEY UPDATE`` (as the swap's UPDATE): message inserts' FK checks pass."""
        return select.with_for_update(key_share=True)

    def execute_write(self, connection: Connection, write: SessionWrite) -> bool:
        """Every write as one statement of ``WITH`` clauses (:mod:`.postgresql_write`)."""
        from chatflow_sqlalchemy.backends import postgresql_write

        return postgresql_write.execute_write(connection, write)

    def lock_migrations(self, connection: Connection) -> None:
        """Wait for the advisory lock; it is released when the transaction ends."""
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
