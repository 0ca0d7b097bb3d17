"""PostgreSQL's dialect support: what differs in PostgreSQL, without its store.

``ON CONFLICT`` upserts, row locks, a turn's write in one statement, day
partitions for dedup claims, connection defaults (timeouts, TCP keepalives,
no server-side prepared statements) and migrations serialised by an
advisory lock.

The registry loads this module for the ``postgresql`` backend; it imports
neither psycopg nor a store (``store_class`` names
:class:`~chatflow_sqlalchemy.backends.postgresql.PostgresSessionStore` by
string), so listing or looking up backends loads neither. The SQL of claims
and writes (:mod:`.postgresql_claims`, :mod:`.postgresql_write`) is imported
when a statement is first built.
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
    "CONNECT_TIMEOUT_SECONDS",
    "INSTALL_HINT",
    "MIGRATION_LOCK_KEY",
    "PREPARE_THRESHOLD",
    "TCP_OPTIONS",
    "PostgresDialectSupport",
    "default_connect_args",
    "jsonb_dumps",
]

INSTALL_HINT = "PostgreSQL needs psycopg 3: pip install 'chatflow-sqlalchemy[postgres]'"
"""What to install when psycopg is missing (the ``postgres`` extra)."""

MIGRATION_LOCK_KEY = 0x63686174666C6F77 & 0x7FFFFFFFFFFFFFFF
"""Advisory lock key ("chatflow") held while migrations run."""

CONNECT_TIMEOUT_SECONDS = 10
"""libpq ``connect_timeout`` unless the URL or ``connect_args`` set one: how long opening
a connection (TCP, TLS, startup and authentication) may take before it fails."""

TCP_OPTIONS: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}
"""libpq TCP settings of every connection, unless the URL or ``connect_args`` set them.

Against a real network partition (packets dropped) a connection waiting on
the server fails after about 30 s instead of TCP's ~15 minutes. They cannot
help when something still acknowledges the packets (a hung proxy): that is
what :data:`OPERATION_TIMEOUT_SECONDS` bounds.
"""

PREPARE_THRESHOLD: int | None = None
"""psycopg's ``prepare_threshold`` unless ``connect_args`` set one: None prepares nothing.

A transaction-pooling PgBouncer (also RDS Proxy, Supavisor) gives each
transaction whichever server connection is free, where a statement prepared
by an earlier transaction is missing or, under the same name, another one
(``DuplicatePreparedStatement: prepared statement "_pg3_0" already exists``).
Everything else the store does is transaction-scoped, so with this default
it needs no setting behind a pooler. Connected straight to the server,
``connect_args={"prepare_threshold": 5}`` (psycopg's default) turns
preparing back on.
"""

def default_connect_args(url: URL, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The timeouts, TCP settings and psycopg options that neither ``url`` nor ``given`` set.

    Then ``given`` on top.

    ``connect_args`` win over the URL's query in SQLAlchemy, so a default is
    only added where the user's URL does not name the parameter. psycopg's
    ``prepare_threshold`` is None (:data:`PREPARE_THRESHOLD`): no server-side
    prepared statements, so the store works unchanged behind a
    transaction-pooling PgBouncer.
    """
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

    ``jsonb`` keeps numbers as ``numeric``, which prints ``4.417402109863705e+16``
    back as ``44174021098637050``: an int to every JSON reader. Python writes
    every float from 1e16 up in exponent form; those are written out in full
    with a trailing ``.0`` instead (``numeric`` keeps that scale), which reads
    back as the same float. Everything else is exactly ``json.dumps``.
    """
    floats: list[float] = []
    _collect_exponent_integral_floats(value, floats)
    if not floats:
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


def _collect_exponent_integral_floats(value: Any, found: list[float]) -> None:
    if isinstance(value, float):
        if _exponent_integral(value):
            found.append(value)
    elif isinstance(value, dict):
        for item in value.values():
            _collect_exponent_integral_floats(item, found)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect_exponent_integral_floats(item, found)


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
        """A pool of 10 (+10 overflow); idle connections are pinged (:meth:`prepare_engine`).

        ``json_serializer`` keeps metadata floats floats through ``jsonb``
        (see :func:`jsonb_dumps`); ``connect_args`` bound connecting
        (:data:`CONNECT_TIMEOUT_SECONDS`) and a partitioned network
        (:data:`TCP_OPTIONS`), except where the URL's query sets them.
        """
        return {
            "pool_size": 10,
            "max_overflow": 10,
            "json_serializer": jsonb_dumps,
            "connect_args": default_connect_args(url),
        }

    def prepare_engine(self, engine: Engine) -> None:
        """Ping connections idle for over a second, so a restarted server is survived.

        Not every checkout (``pool_pre_ping``): that is a round trip per
        statement group, several per turn. See :func:`ping_when_idle`.
        """
        ping_when_idle(engine)

    def async_url(self, url: URL) -> URL | None:
        """Async work runs natively on psycopg 3's async driver (no thread hop)."""
        return psycopg_url(url)

    def insert_ignore(self, table: Table) -> Insert:
        """``INSERT ... ON CONFLICT DO NOTHING``."""
        return pg_insert(table).on_conflict_do_nothing()

    def claim_processed(self, table: Table) -> Insert:
        """Insert the id, or take over an expired claim; a live claim changes nothing.

        The id's row may sit in any day partition: its day comes from
        ``chatflow_claim_day`` (:mod:`.postgresql_claims`).
        """
        stmt = pg_insert(table).values(_processed_row())
        return stmt.on_conflict_do_update(
            index_elements=[table.c.message_id, table.c.partition_day],
            set_={"processed_at": stmt.excluded.processed_at, **RECLAIMED_AS_DONE},
            where=table.c.processed_at < bindparam("cutoff", type_=UTCDateTime()),
        ).returning(table.c.message_id)

    def acquire_claim(self, table: Table) -> Executable:
        """``ON CONFLICT DO UPDATE ... WHERE ... RETURNING`` and the session's lease, at once.

        The ticket is drawn under the session's lock; ``RETURNING`` gives it,
        whether a claim with a smaller one is in flight, the session's
        version (:mod:`.postgresql_claims`) and the row's day partition. A
        ``WITH`` clause then takes the session's turn lease when the claim
        was acquired with no earlier claim of its session in flight, so the
        block's turn needs no statement of its own before the model runs.
        """
        from chatflow_sqlalchemy.backends import postgresql_claims as pg_claims

        return pg_claims.acquire_with_lease(table, self.claim_ticket(table))

    def read_claim(self, result: CursorResult[Any]) -> AcquiredClaim:
        """The ticket, the look for earlier claims, the session's version and the day, off one row.

        The version serves the claim block's first ``get_or_create``; the turn
        lock reads it again, so a session written or deleted elsewhere since
        is caught up with, or raises ``SessionDeletedError``, before the turn.
        """
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
        """``FOR NO KEY UPDATE``: excludes other writers of the row, not foreign-key checks.

        The lock the compare-and-swap UPDATE itself takes: message inserts
        (their foreign-key check takes ``KEY SHARE``) are not held up by it.
        """
        return select.with_for_update(key_share=True)

    def execute_write(self, connection: Connection, write: SessionWrite) -> bool:
        """Every write as one statement of ``WITH`` clauses (:mod:`.postgresql_write`)."""
        from chatflow_sqlalchemy.backends import postgresql_write

        return postgresql_write.execute_write(connection, write)

    def lock_migrations(self, connection: Connection) -> None:
        """Wait for the advisory lock; it is released when the transaction ends."""
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
