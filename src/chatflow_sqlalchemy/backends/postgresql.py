"""PostgreSQL backend on psycopg 3.

What differs from the generic store: ``postgresql://`` URLs are mapped to the
psycopg 3 driver, dedup claims and session creation use ``ON CONFLICT``,
a turn's write is one statement, and migrations are serialised across
processes with a transaction-scoped advisory lock.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import uuid
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import URL, Connection, CursorResult, Engine, Executable, Select, bindparam, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.dml import Insert
from sqlalchemy.sql.schema import Table

from chatflow_sqlalchemy.backends import postgresql_claims as pg_claims
from chatflow_sqlalchemy.backends import postgresql_write
from chatflow_sqlalchemy.dialect import (
    RECLAIMED_AS_DONE,
    AcquiredClaim,
    DialectSupport,
    SessionWrite,
    ping_when_idle,
)
from chatflow_sqlalchemy.exceptions import BackendImportError, DatabaseUnavailableError
from chatflow_sqlalchemy.runtime import describe
from chatflow_sqlalchemy.server_store import ServerSessionStore
from chatflow_sqlalchemy.tables import UTCDateTime
from chatflow_sqlalchemy.urls import psycopg_url

if TYPE_CHECKING:  # the asyncio extension needs greenlet: imported only where it is used
    import psycopg
else:
    try:
        import psycopg
    except ImportError:  # the class stays importable; opening a store names the extra
        psycopg = None

__all__ = [
    "CONNECT_TIMEOUT_SECONDS",
    "INSTALL_HINT",
    "MIGRATION_LOCK_KEY",
    "OPERATION_TIMEOUT_SECONDS",
    "PREPARE_THRESHOLD",
    "TCP_OPTIONS",
    "PostgresDialectSupport",
    "PostgresSessionStore",
    "default_connect_args",
    "jsonb_dumps",
    "psycopg_url",
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

OPERATION_TIMEOUT_SECONDS = 15.0
"""Bound of each async store operation and each turn-lock call (the default of
``PostgresSessionStore.operation_timeout``)."""

logger = logging.getLogger("chatflow_sqlalchemy")


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


_R = TypeVar("_R")


def _processed_row() -> dict[str, Any]:
    """The values of a dedup row inserted by id (its day read under the id's lock)."""
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
        return pg_claims.drop_expired_days(connection, cutoff, now)

    def lock_session_row(self, select: Select[Any]) -> Select[Any]:
        """``FOR NO KEY UPDATE``: excludes other writers of the row, not foreign-key checks.

        The lock the compare-and-swap UPDATE itself takes: message inserts
        (their foreign-key check takes ``KEY SHARE``) are not held up by it.
        """
        return select.with_for_update(key_share=True)

    def write_at_once(
        self, connection: Connection, write: SessionWrite
    ) -> tuple[bool, bool] | None:
        """The swap, the message diff and the fence as one statement (``WITH`` clauses)."""
        return postgresql_write.write_at_once(connection, write)

    def lock_migrations(self, connection: Connection) -> None:
        """Wait for the advisory lock; it is released when the transaction ends."""
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})


async def _bounded(awaitable: Awaitable[_R], seconds: float) -> _R:
    """``awaitable`` cancelled after ``seconds`` (``asyncio.TimeoutError``), without a new task."""
    timeout = getattr(asyncio, "timeout", None)
    if timeout is None:  # Python 3.10
        return await asyncio.wait_for(awaitable, seconds)
    async with timeout(seconds):
        return await awaitable


class PostgresSessionStore(ServerSessionStore):
    """Session store on PostgreSQL (psycopg 3), for many workers sharing conversations.

    Args:
        url: ``postgresql://`` or ``postgresql+psycopg://`` URL.
        default_max_turns: History window of new contexts, in complete turns.
        dedup_ttl_hours: How long a processed webhook id stays claimed.
        **options: Store options by keyword (see
            :class:`~chatflow_sqlalchemy.options.StoreOptions`); any other
            keyword, and ``engine_options=``, goes to ``create_engine`` (pool
            size, echo, ...). ``connect_args`` are added to the backend's
            defaults (a connect timeout and TCP keepalives, see
            :func:`default_connect_args`).

    Hangs are bounded: opening a connection by libpq's ``connect_timeout``
    (:data:`CONNECT_TIMEOUT_SECONDS` unless the URL or ``connect_args`` say
    otherwise); each async operation (``aget_or_create``, the turn's lease,
    catch-up and write) by :attr:`operation_timeout`; a lost connection
    under a real network partition by TCP keepalives and
    ``tcp_user_timeout`` (:data:`TCP_OPTIONS`). A bound that runs out is a
    :class:`~chatflow_sqlalchemy.exceptions.DatabaseUnavailableError`. A
    turn holds no connection while it runs, only its lease: a worker gone
    silent frees its session after ``turn_lease_seconds``.

    """

    dialect_support = PostgresDialectSupport()

    operation_timeout: float = OPERATION_TIMEOUT_SECONDS
    """Seconds an async operation may wait on the server before it fails.

    A stuck query is then cancelled by psycopg (which itself waits up to
    about 10 s more for the server before closing the connection).
    """

    @classmethod
    def store_url(cls, url: str | URL) -> URL:
        """``url`` on psycopg 3 (``postgresql://`` → ``postgresql+psycopg://``).

        Raises:
            BackendImportError: psycopg is not installed (names the extra).
            DatabaseURLError: Not a PostgreSQL URL, or one naming another driver.

        """
        if psycopg is None:
            raise BackendImportError(INSTALL_HINT)
        return psycopg_url(url)

    async def _run_blocking(self, fn: Callable[..., _R], *args: Any) -> _R:
        """Run database work as the generic store does, bounded by :attr:`operation_timeout`.

        Only the native async path can be bounded (a coroutine can be
        cancelled; a thread blocked in libpq cannot): there the store's
        operations run as psycopg coroutines.
        """
        if not self.runtime.native_async:
            return await super()._run_blocking(fn, *args)
        try:
            return await _bounded(super()._run_blocking(fn, *args), self.operation_timeout)
        except asyncio.TimeoutError as exc:
            raise DatabaseUnavailableError(
                f"no answer from {describe(self.url)} within {self.operation_timeout:g} s "
                "(PostgresSessionStore.operation_timeout); the operation was cancelled"
            ) from exc
