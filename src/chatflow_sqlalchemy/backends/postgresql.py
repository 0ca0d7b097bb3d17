"""PostgreSQL backend on psycopg 3.

What differs from the generic store: ``postgresql://`` URLs are mapped to the
psycopg 3 driver, dedup claims and session creation use ``ON CONFLICT``,
session rows are locked with ``SELECT ... FOR UPDATE`` during a write, and
migrations are serialised across processes with a transaction-scoped
advisory lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from typing import Any

from sqlalchemy import URL, Connection, Engine, bindparam, make_url, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.dml import Insert
from sqlalchemy.sql.schema import Table

from chatflow_sqlalchemy.dialect import DialectSupport
from chatflow_sqlalchemy.models import UTCDateTime
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


def session_lock_key(session_id: str) -> int:
    """A stable signed 64-bit advisory-lock key for a session id."""
    digest = hashlib.blake2b(session_id.encode(), digest_size=8, person=b"chatflow").digest()
    return int.from_bytes(digest, "big", signed=True)


class AdvisoryTurnLocks:
    """Session-level advisory locks for turns, all held on one dedicated connection.

    One connection per store can hold the locks of any number of sessions, so
    a turn that waits on a slow model does not pin a pooled connection. The
    locks die with the connection, so a crashed worker never leaves a
    session locked. Calls are serialised: the connection is shared.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._conn: Connection | None = None
        self._mutex = threading.Lock()

    def _connection(self) -> Connection:
        if self._conn is None or self._conn.closed or self._conn.invalidated:
            self._conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        return self._conn

    def _call(self, sql: str, session_id: str) -> bool:
        with self._mutex:
            conn = self._connection()
            try:
                return bool(conn.execute(text(sql), {"key": session_lock_key(session_id)}).scalar())
            except Exception:
                self._discard()
                raise

    def try_acquire(self, session_id: str) -> bool:
        """Take the session's lock if free; never waits."""
        return self._call("SELECT pg_try_advisory_lock(:key)", session_id)

    def release(self, session_id: str) -> None:
        """Release the session's lock (a lost connection already released it)."""
        with contextlib.suppress(Exception):
            self._call("SELECT pg_advisory_unlock(:key)", session_id)

    def _discard(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.invalidate()
                conn.close()

    def close(self) -> None:
        """Close the dedicated connection, releasing every lock it holds."""
        with self._mutex:
            conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


class PostgresDialectSupport(DialectSupport):
    """PostgreSQL specifics: ``ON CONFLICT`` upserts, row locks, advisory locks."""

    name = "postgresql"
    cross_process_turn_lock = True

    def engine_options(self, url: URL) -> dict[str, Any]:
        """A pre-pinged pool, so connections killed by a server restart are replaced."""
        return {"pool_pre_ping": True, "pool_size": 10, "max_overflow": 10}

    def insert_ignore(self, table: Table) -> Insert:
        """``INSERT ... ON CONFLICT DO NOTHING``."""
        return pg_insert(table).on_conflict_do_nothing()

    def claim_processed(self, table: Table) -> Insert:
        """Insert the id, or take over an expired claim; a live claim changes nothing."""
        stmt = pg_insert(table)
        return stmt.on_conflict_do_update(
            index_elements=[table.c.message_id],
            set_={"processed_at": stmt.excluded.processed_at},
            where=table.c.processed_at < bindparam("cutoff", type_=UTCDateTime()),
        ).returning(table.c.message_id)

    def upsert_processed(self, table: Table) -> Insert:
        """Insert the id or move its timestamp to now."""
        stmt = pg_insert(table)
        return stmt.on_conflict_do_update(
            index_elements=[table.c.message_id],
            set_={"processed_at": stmt.excluded.processed_at},
        )

    def lock_migrations(self, connection: Connection) -> None:
        """Wait for the advisory lock; it is released when the transaction ends."""
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})


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
        from sqlalchemy import create_engine

        parsed = psycopg_url(url)
        options = {**self.dialect_support.engine_options(parsed), **engine_options}
        try:
            engine = create_engine(parsed, **options)
        except ImportError as exc:
            from chatflow_sqlalchemy.exceptions import BackendImportError

            raise BackendImportError(
                f"PostgreSQL needs psycopg 3: pip install 'chatflow-sqlalchemy[postgres]' ({exc})"
            ) from exc
        super().__init__(
            engine=engine, default_max_turns=default_max_turns, dedup_ttl_hours=dedup_ttl_hours
        )
        self._owns_engine = True
        self._turn_locks = AdvisoryTurnLocks(engine)

    def _try_turn_lock(self, session_id: str) -> bool:
        with self._guard():
            return self._turn_locks.try_acquire(session_id)

    def _release_turn_lock(self, session_id: str) -> None:
        self._turn_locks.release(session_id)

    def close(self) -> None:
        """Release the turn-lock connection, the thread pool and the engine."""
        if hasattr(self, "_turn_locks"):
            self._turn_locks.close()
        super().close()

    @classmethod
    def from_url(cls, url: str | URL, **kwargs: Any) -> PostgresSessionStore:
        """Open ``url`` (what ``open_store`` calls)."""
        return cls(url, **kwargs)
