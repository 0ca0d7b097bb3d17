"""PostgreSQL backend on psycopg 3.

What differs from the generic store: ``postgresql://`` URLs are mapped to the
psycopg 3 driver, dedup claims and session creation use ``ON CONFLICT``,
session rows are locked with ``SELECT ... FOR UPDATE`` during a write, and
migrations are serialised across processes with a transaction-scoped
advisory lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import psycopg
from sqlalchemy import URL, Connection, Engine, Select, bindparam, make_url, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.sql.dml import Insert
from sqlalchemy.sql.schema import Table
from sqlalchemy.util.concurrency import await_

from chatflow_sqlalchemy.dialect import (
    RECLAIMED_AS_DONE,
    DialectSupport,
    on_conflict_acquire,
    ping_when_idle,
)
from chatflow_sqlalchemy.driver import (
    DriverConnection,
    DriverStatement,
    translate_driver_errors,
)
from chatflow_sqlalchemy.exceptions import DatabaseUnavailableError
from chatflow_sqlalchemy.models import CLAIM_TICKETS, UTCDateTime
from chatflow_sqlalchemy.store import DEFAULT_DEDUP_TTL_HOURS, SQLAlchemySessionStore

__all__ = [
    "MIGRATION_LOCK_KEY",
    "AdvisoryTurnLocks",
    "PostgresDialectSupport",
    "PostgresSessionStore",
    "psycopg_url",
    "session_lock_key",
]

MIGRATION_LOCK_KEY = 0x63686174666C6F77 & 0x7FFFFFFFFFFFFFFF
"""Advisory lock key ("chatflow") held while migrations run."""


def psycopg_url(url: str | URL) -> URL:
    """Map ``postgresql://`` / ``postgres://`` URLs to the psycopg 3 driver."""
    parsed = make_url(str(url).replace("postgres://", "postgresql://", 1)
                      if isinstance(url, str) else url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


_R = TypeVar("_R")

_PENDING: set[asyncio.Future[Any]] = set()
"""Lock calls that outlive a cancelled caller (strong references until they finish)."""


def _keep(future: asyncio.Future[_R]) -> asyncio.Future[_R]:
    _PENDING.add(future)
    future.add_done_callback(_PENDING.discard)
    return future


def session_lock_key(session_id: str) -> int:
    """A stable signed 64-bit advisory-lock key for a session id."""
    digest = hashlib.blake2b(session_id.encode(), digest_size=8, person=b"chatflow").digest()
    return int.from_bytes(digest, "big", signed=True)


class AdvisoryTurnLocks:
    """Session-level advisory locks for turns, all held on one dedicated connection.

    One connection per store holds the locks of any number of sessions, so a
    turn that waits on a slow model does not pin a pooled connection. The
    locks die with the connection, so a crashed worker never leaves a session
    locked. The connection is a plain psycopg ``AsyncConnection`` (outside the
    SQLAlchemy pool) owned by the event loop that uses it; calls are
    serialised because the connection is shared.
    """

    def __init__(self, connect: Callable[[], Awaitable[psycopg.AsyncConnection[Any]]]) -> None:
        self._connect = connect
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._mutex: asyncio.Lock | None = None

    def _bind_to_running_loop(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # A connection of a finished loop cannot be awaited any more; closing the
            # socket synchronously still makes the server drop its locks at once.
            self._abandon()
            self._loop = loop
            self._mutex = asyncio.Lock()
        assert self._mutex is not None
        return self._mutex

    def _abandon(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.pgconn.finish()

    async def _call(self, sql: str, param: object) -> Any:
        async with self._bind_to_running_loop():
            if self._conn is None or self._conn.closed:
                self._conn = await self._connect()
            try:
                cursor = await self._conn.execute(sql, (param,))
                row = await cursor.fetchone()
            except Exception:
                self._abandon()
                raise
            return row[0] if row else None

    async def try_acquire_reading_version(self, session_id: str) -> tuple[bool, int | None]:
        """Try the lock and read the session's version in one round trip (a pipeline).

        The server runs the two statements in order, each in its own snapshot,
        so the version is read after the lock was taken and reflects every
        turn committed before. It is meaningless when the lock was not taken.
        """
        task = _keep(asyncio.ensure_future(self._lock_and_read_version(session_id)))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # The caller gave up, but the call goes on: a lock it takes must be given
            # back, or the session stays locked for every process until this
            # connection closes.
            task.add_done_callback(lambda done: self._give_back(session_id, done))
            raise

    def _give_back(self, session_id: str, done: asyncio.Future[tuple[bool, int | None]]) -> None:
        if done.cancelled() or done.exception() is not None or not done.result()[0]:
            return
        _keep(asyncio.ensure_future(self.release(session_id)))

    async def _lock_and_read_version(self, session_id: str) -> tuple[bool, int | None]:
        async with self._bind_to_running_loop():
            if self._conn is None or self._conn.closed:
                self._conn = await self._connect()
            conn = self._conn
            try:
                async with conn.pipeline():
                    lock = await conn.execute(
                        "SELECT pg_try_advisory_lock(%s)", (session_lock_key(session_id),)
                    )
                    version = await conn.execute(
                        "SELECT version FROM chatflow_sessions WHERE session_id = %s",
                        (session_id,),
                    )
                taken = await lock.fetchone()
                row = await version.fetchone()
            except Exception:
                self._abandon()
                raise
        acquired = bool(taken and taken[0])
        return acquired, (None if row is None else int(row[0]))

    async def release(self, session_id: str) -> None:
        """Release the session's lock (a lost connection already released it).

        Shielded: a caller cancelled meanwhile does not stop the unlock.
        """
        call = self._call("SELECT pg_advisory_unlock(%s)", session_lock_key(session_id))
        with contextlib.suppress(Exception):
            await asyncio.shield(_keep(asyncio.ensure_future(call)))

    async def aclose(self) -> None:
        """Close the connection, releasing every lock it holds."""
        conn, self._conn = self._conn, None
        if conn is not None and self._loop is asyncio.get_running_loop():
            with contextlib.suppress(Exception):
                await conn.close()
        elif conn is not None:
            self._conn = conn
            self._abandon()

    def close(self) -> None:
        """Close from sync code: drop the socket (the server releases the locks)."""
        self._abandon()


class PostgresDialectSupport(DialectSupport):
    """PostgreSQL specifics: ``ON CONFLICT`` upserts, row locks, advisory locks."""

    name = "postgresql"
    cross_process_turn_lock = True
    driver_statements = True

    def engine_options(self, url: URL) -> dict[str, Any]:
        """A pool of 10 (+10 overflow); idle connections are pinged (:meth:`prepare_engine`)."""
        return {"pool_size": 10, "max_overflow": 10}

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
        """Insert the id, or take over an expired claim; a live claim changes nothing."""
        stmt = pg_insert(table)
        return stmt.on_conflict_do_update(
            index_elements=[table.c.message_id],
            set_={"processed_at": stmt.excluded.processed_at, **RECLAIMED_AS_DONE},
            where=table.c.processed_at < bindparam("cutoff", type_=UTCDateTime()),
        ).returning(table.c.message_id)

    def acquire_claim(self, table: Table) -> Insert:
        """``ON CONFLICT DO UPDATE ... WHERE ... RETURNING ticket`` in one autocommit statement."""
        return on_conflict_acquire(pg_insert, table, self.claim_ticket(table))

    def claim_ticket(self, table: Table) -> Any:
        """``nextval('chatflow_claim_ticket_seq')``: atomic across every connection."""
        return CLAIM_TICKETS.next_value()

    def upsert_processed(self, table: Table) -> Insert:
        """Insert the id or move its timestamp to now."""
        stmt = pg_insert(table)
        return stmt.on_conflict_do_update(
            index_elements=[table.c.message_id],
            set_={"processed_at": stmt.excluded.processed_at},
        )

    def lock_session_row(self, select: Select[Any]) -> Select[Any]:
        """``FOR NO KEY UPDATE``: excludes other writers of the row, not foreign-key checks.

        A writer whose pipelined compare-and-swap missed has already sent its
        inserts, whose foreign-key check takes ``KEY SHARE`` on the session
        row; under ``FOR UPDATE`` that check and the rebasing writer's insert
        of the same seq would wait on each other (a deadlock).
        """
        return select.with_for_update(key_share=True)

    def run_pipelined(
        self, connection: DriverConnection, steps: Sequence[tuple[DriverStatement, Any]]
    ) -> list[int]:
        """Send every step in one psycopg pipeline: one round trip instead of one each.

        Works on the sync driver and, inside the store's greenlets, on the
        async one (SQLAlchemy's adapter has no pipeline, so the psycopg
        connection under it is used directly, in the same transaction).
        """
        driver = connection.driver_connection
        with translate_driver_errors(connection, "; ".join(step.sql for step, _ in steps)):
            if isinstance(driver, psycopg.AsyncConnection):
                return await_(_apipelined(driver, steps))
            return _pipelined(cast(psycopg.Connection[Any], driver), steps)

    def lock_migrations(self, connection: Connection) -> None:
        """Wait for the advisory lock; it is released when the transaction ends."""
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})


def _lock_unavailable(session_id: str, exc: BaseException) -> DatabaseUnavailableError:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
    return DatabaseUnavailableError(
        f"cannot take the turn lock of session {session_id!r}: {reason}"
    )


def _pipelined(
    driver: psycopg.Connection[Any], steps: Sequence[tuple[DriverStatement, Any]]
) -> list[int]:
    cursors = []
    with driver.pipeline():
        for statement, params in steps:
            cursor = driver.cursor()
            if isinstance(params, Mapping):
                cursor.execute(statement.sql, statement.parameters(params))
            else:
                cursor.executemany(statement.sql, statement.parameter_rows(params))
            cursors.append(cursor)
    return [cursor.rowcount for cursor in cursors]


async def _apipelined(
    driver: psycopg.AsyncConnection[Any], steps: Sequence[tuple[DriverStatement, Any]]
) -> list[int]:
    cursors = []
    async with driver.pipeline():
        for statement, params in steps:
            cursor = driver.cursor()
            if isinstance(params, Mapping):
                await cursor.execute(statement.sql, statement.parameters(params))
            else:
                await cursor.executemany(statement.sql, statement.parameter_rows(params))
            cursors.append(cursor)
    return [cursor.rowcount for cursor in cursors]


class PostgresSessionStore(SQLAlchemySessionStore):
    """Session store on PostgreSQL (psycopg 3), for many workers sharing conversations.

    Args:
        url: ``postgresql://`` or ``postgresql+psycopg://`` URL.
        default_max_turns: History window of new contexts, in complete turns.
        dedup_ttl_hours: How long a processed webhook id stays claimed.
        **engine_options: Passed to ``sqlalchemy.create_engine`` (pool size, echo, ...).

    """

    dialect_support = PostgresDialectSupport()

    def __init__(
        self,
        url: str | URL,
        default_max_turns: int = 40,
        dedup_ttl_hours: float = DEFAULT_DEDUP_TTL_HOURS,
        **engine_options: Any,
    ) -> None:
        parsed = psycopg_url(url)
        options = {**self.dialect_support.engine_options(parsed), **engine_options}
        self._pg_url = parsed
        self._pg_options = options
        self._open_owned(
            parsed,
            options,
            install_hint="PostgreSQL needs psycopg 3: pip install 'chatflow-sqlalchemy[postgres]'",
            default_max_turns=default_max_turns,
            dedup_ttl_hours=dedup_ttl_hours,
        )
        self._turn_locks = AdvisoryTurnLocks(self._connect_lock_connection)

    async def _connect_lock_connection(self) -> psycopg.AsyncConnection[Any]:
        args, params = self.engine.dialect.create_connect_args(self._pg_url)
        params.update(self._pg_options.get("connect_args", {}))
        return await psycopg.AsyncConnection.connect(*args, autocommit=True, **params)

    def _make_async_engine(self) -> AsyncEngine:
        return create_async_engine(self._pg_url, **self._pg_options)

    async def _atry_turn_lock_reading_version(
        self, session_id: str
    ) -> tuple[bool, tuple[bool, int | None]]:
        with self._guard():
            try:
                acquired, version = await self._turn_locks.try_acquire_reading_version(session_id)
            except psycopg.OperationalError as exc:
                raise _lock_unavailable(session_id, exc) from exc
        return acquired, (True, version)

    async def _arelease_turn_lock(self, session_id: str) -> None:
        await self._turn_locks.release(session_id)

    async def aclose(self) -> None:
        """Close the turn-lock connection, then the pools."""
        await self._turn_locks.aclose()
        await super().aclose()

    def close(self) -> None:
        """Drop the turn-lock connection, the thread pool and the engine."""
        if hasattr(self, "_turn_locks"):
            self._turn_locks.close()
        super().close()

    @classmethod
    def from_url(cls, url: str | URL, **kwargs: Any) -> PostgresSessionStore:
        """Open ``url`` (what ``open_store`` calls)."""
        return cls(url, **kwargs)
