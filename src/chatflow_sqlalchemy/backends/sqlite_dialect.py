"""SQLite's dialect support, without its store (looking backends up loads no store).

Writes start with ``BEGIN IMMEDIATE``: the write lock is taken up front, so
concurrent writers queue on the busy timeout instead of failing on lock upgrade.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any

from sqlalchemy import URL, Connection, Engine, bindparam, event
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.pool import StaticPool
from sqlalchemy.sql.dml import Insert
from sqlalchemy.sql.schema import Table

from chatflow_sqlalchemy.backends.sqlite_files import (
    BUSY_TIMEOUT_MS,
    create_private_database_file,
    is_ephemeral_sqlite,
)
from chatflow_sqlalchemy.dialect import (
    RECLAIMED_AS_DONE,
    DialectSupport,
    first_time_on,
    on_conflict_acquire,
)
from chatflow_sqlalchemy.tables import UTCDateTime

__all__ = ["SQLiteDialectSupport"]

_WAL_RETRY_SECONDS = 0.005


class SQLiteDialectSupport(DialectSupport):
    """SQLite specifics: pragmas, ``BEGIN IMMEDIATE`` writes, ``ON CONFLICT`` upserts."""

    name = "sqlite"
    store_class = "chatflow_sqlalchemy.backends.sqlite:SQLiteSessionStore"

    def engine_options(self, url: URL) -> dict[str, Any]:
        """A shared single connection in memory; a small pool of connections on disk."""
        if is_ephemeral_sqlite(url):
            return {"poolclass": StaticPool, "connect_args": {"check_same_thread": False}}
        return {"connect_args": {"check_same_thread": False, "timeout": BUSY_TIMEOUT_MS / 1000}}

    def autocommit_options(self) -> dict[str, Any]:
        """The connection already runs in autocommit mode; the begin hook skips BEGIN."""
        return {"chatflow_autocommit": True}

    def is_ephemeral(self, url: URL) -> bool:
        """See :func:`is_ephemeral_sqlite`."""
        return is_ephemeral_sqlite(url)

    def sync_url(self, url: URL) -> URL:
        """``sqlite+aiosqlite://`` keeps pysqlite for the sync API."""
        return url.set(drivername="sqlite") if url.drivername == "sqlite+aiosqlite" else url

    def async_url(self, url: URL) -> URL | None:
        """Native async only with ``sqlite+aiosqlite://`` (a private thread pool is faster)."""
        if url.drivername == "sqlite+aiosqlite" and not is_ephemeral_sqlite(url):
            return url
        return None

    def prepare_engine(self, engine: Engine) -> None:
        """Set pragmas on each connection and take transaction control from pysqlite (once).

        A missing file is created private just before SQLite would create it.
        """
        if not first_time_on(engine, "sqlite pragmas and BEGIN"):
            return
        ephemeral = is_ephemeral_sqlite(engine.url)

        @event.listens_for(engine, "do_connect")
        def _create_private_file(*_args: Any) -> None:
            create_private_database_file(engine.url)

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_connection: Any, _record: Any) -> None:
            # pysqlite's implicit BEGIN would defer the write lock to the first
            # write and make DDL non-transactional; we emit BEGIN ourselves.
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute("PRAGMA foreign_keys = ON")
                cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
                if not ephemeral:
                    _enter_wal(cursor)
                    cursor.execute("PRAGMA synchronous = NORMAL")
            finally:
                cursor.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            options = conn.get_execution_options()
            if options.get("chatflow_autocommit"):
                return  # one self-contained statement: SQLite makes it atomic by itself
            write = options.get("chatflow_write", False)
            # SQLAlchemy's documented recipe for pysqlite: the BEGIN goes through the
            # connection, so echo, cursor events and instrumentation see it too.
            conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    def insert_ignore(self, table: Table) -> Insert:
        """``INSERT ... ON CONFLICT DO NOTHING``."""
        return sqlite_insert(table).on_conflict_do_nothing()

    def claim_processed(self, table: Table) -> Insert:
        """Insert the id, or take over an expired claim; a live claim changes nothing."""
        stmt = sqlite_insert(table)
        return stmt.on_conflict_do_update(
            index_elements=[table.c.message_id],
            set_={"processed_at": stmt.excluded.processed_at, **RECLAIMED_AS_DONE},
            where=table.c.processed_at < bindparam("cutoff", type_=UTCDateTime()),
        ).returning(table.c.message_id)

    def acquire_claim(self, table: Table) -> Insert:
        """``ON CONFLICT DO UPDATE ... WHERE``; the ticket is ``MAX + 1`` under the write lock."""
        return on_conflict_acquire(sqlite_insert, table, self.claim_ticket(table))

    def upsert_processed(self, table: Table) -> Insert:
        """Insert the id or move its timestamp to now."""
        stmt = sqlite_insert(table)
        return stmt.on_conflict_do_update(
            index_elements=[table.c.message_id],
            set_={"processed_at": stmt.excluded.processed_at},
        )

    def lock_session_row(self, select: Any) -> Any:
        """No row locks in SQLite: ``BEGIN IMMEDIATE`` already holds the database write lock."""
        return select

    def begin_migration(self, connection: Connection) -> None:
        """Turn foreign keys off: rebuilding a parent table must not cascade-delete children."""
        # Outside any transaction (the pragma is a no-op inside one), on the raw connection.
        _raw(connection).execute("PRAGMA foreign_keys = OFF")

    def end_migration(self, connection: Connection) -> None:
        """Turn foreign keys back on (the migration checked our tables before committing)."""
        _raw(connection).execute("PRAGMA foreign_keys = ON")


def _enter_wal(cursor: Any) -> None:
    """Switch the file to WAL, waiting out other connections doing the same.

    SQLite answers ``database is locked`` at once here, without its busy handler.
    """
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(_WAL_RETRY_SECONDS)


def _raw(connection: Connection) -> Any:
    return connection.connection.dbapi_connection
