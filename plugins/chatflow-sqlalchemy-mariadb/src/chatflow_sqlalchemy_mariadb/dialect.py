"""What MariaDB and MySQL need that the core's portable SQL cannot express.

PyMySQL by default; ``READ COMMITTED``, UTC, ``utf8mb4`` connections;
``INSERT ... ON DUPLICATE KEY UPDATE`` upserts whose affected-row counts
decide claims (MySQL has no ``RETURNING`` there); ``SKIP LOCKED`` only where
the server has it; migrations serialised by a named lock, since MySQL's DDL
is not transactional. Ids are ``utf8mb4`` with a binary, no-pad collation
(revision 0001 of the core), so they compare exactly as on other backends.
"""

from __future__ import annotations

import hashlib
from typing import Any

from chatflow_sqlalchemy.backend import (
    CLAIM_CUTOFF,
    CLAIM_LEASE,
    CLAIM_NOW,
    CLAIM_TICKETS,
    RECLAIMED_AS_DONE,
    DialectSupport,
    UTCDateTime,
)
from sqlalchemy import (
    URL,
    Connection,
    Engine,
    Select,
    Table,
    and_,
    bindparam,
    case,
    event,
    func,
    or_,
    text,
)
from sqlalchemy.dialects.mysql import insert as mysql_insert
from sqlalchemy.engine import CursorResult
from sqlalchemy.sql.dml import Insert

__all__ = ["MIGRATION_LOCK_TIMEOUT", "MariaDBDialectSupport"]

MIGRATION_LOCK_TIMEOUT = 300
"""Seconds a process waits for another one's migrations before giving up."""

_CLIENT_FOUND_ROWS = 2
"""``CLIENT.FOUND_ROWS`` (same value in PyMySQL and mysqlclient)."""


def _migration_lock(connection: Connection) -> str:
    """The server-wide named lock of this database's migrations (<= 64 characters)."""
    database = connection.engine.url.database or ""
    digest = hashlib.blake2b(f"{database}\0".encode(), digest_size=16, person=b"chatflow")
    return f"chatflow:migrate:{digest.hexdigest()}"


class MariaDBDialectSupport(DialectSupport):
    """MariaDB / MySQL specifics (PyMySQL or mysqlclient): the backend ``mysql``/``mariadb``.

    The entry points name this class; ``open_store`` opens its
    :attr:`store_class`, imported only then (this module imports no store).
    """

    name = "mysql"
    store_class = "chatflow_sqlalchemy_mariadb.store:MariaDBSessionStore"
    install_hint = "MariaDB/MySQL needs a driver: pip install PyMySQL"
    default_driver = "pymysql"

    def engine_options(self, url: URL) -> dict[str, Any]:
        """A pre-pinged, recycled pool on READ COMMITTED, UTC, utf8mb4 connections."""
        return {
            "pool_pre_ping": True,
            "pool_recycle": 3600,
            "pool_size": 10,
            "max_overflow": 10,
            "isolation_level": "READ COMMITTED",
            "connect_args": {"charset": "utf8mb4", "init_command": "SET time_zone = '+00:00'"},
        }

    def prepare_engine(self, engine: Engine) -> None:
        """Turn ``CLIENT_FOUND_ROWS`` off: affected-row counts decide dedup claims."""

        @event.listens_for(engine, "do_connect")
        def _affected_rows(_dialect: Any, _record: Any, _cargs: Any, cparams: Any) -> None:
            flags = int(cparams.get("client_flag", 0))
            cparams["client_flag"] = flags & ~_CLIENT_FOUND_ROWS

    def insert_ignore(self, table: Table) -> Insert:
        """``INSERT ... ON DUPLICATE KEY UPDATE pk = pk``: a no-op on an existing key."""
        keys = {column.name: column for column in table.primary_key.columns}
        return mysql_insert(table).on_duplicate_key_update(keys)

    def claim_processed(self, table: Table) -> Insert:
        """Insert the id, or take over an expired claim; a live claim is left as it is.

        Affected rows: 1 inserted, 2 an expired claim taken over, 0 a live
        claim (see :meth:`claimed`).
        """
        stmt = mysql_insert(table)
        cutoff = bindparam("cutoff", type_=UTCDateTime())
        expired = table.c.processed_at < cutoff
        # Columns of store.claim first (reset when expired), processed_at last: the
        # expiry test reads it, and MySQL assigns left to right.
        resets = [
            (name, func.if_(expired, value, table.c[name]))
            for name, value in RECLAIMED_AS_DONE.items()
        ]
        return stmt.on_duplicate_key_update(
            [
                *resets,
                (
                    "processed_at",
                    func.if_(expired, stmt.inserted.processed_at, table.c.processed_at),
                ),
            ]
        )

    def claimed(self, result: CursorResult[Any]) -> bool:
        """1 (inserted) or 2 (taken over) affected rows: the claim (or ``store.claim``) is ours."""
        return result.rowcount in (1, 2)

    def acquire_claim(self, table: Table) -> Insert:
        """``INSERT ... ON DUPLICATE KEY UPDATE`` with every column behind one condition.

        MySQL has no ``WHERE`` on the update branch and assigns columns left to
        right, each seeing the ones before: ``token`` is assigned first
        (under the takeover condition, read on the old row), and every later
        column tests ``token = VALUES(token)`` (a fresh random token: only a
        takeover sets it). ``processed_at`` goes last since the expiry test
        reads it. Affected rows: 1 inserted, 2 taken over, 0 left alone.
        Every time in it is the server's ``UTC_TIMESTAMP(6)`` (``CLAIM_NOW``...).
        """
        c = table.c
        now = CLAIM_NOW
        stmt = mysql_insert(table).values(
            message_id=bindparam("message_id"),
            processed_at=now,
            state="acquired",
            token=bindparam("token"),
            session_id=bindparam("session_id"),
            ticket=self.claim_ticket(table),
            lease_expires_at=CLAIM_LEASE,
            claimed_at=now,
        )
        new = stmt.inserted
        expired = c.processed_at < CLAIM_CUTOFF
        takeover = or_(
            c.state == "released", and_(c.state == "acquired", c.lease_expires_at < now), expired
        )
        won = c.token == new.token
        ticket = case((expired, new.ticket), else_=func.coalesce(c.ticket, new.ticket))

        def ours(value: Any, column: Any) -> Any:
            return func.if_(won, value, column)

        return stmt.on_duplicate_key_update(
            [
                ("token", func.if_(takeover, new.token, c.token)),
                ("ticket", ours(ticket, c.ticket)),
                ("session_id", ours(new.session_id, c.session_id)),
                ("state", ours(new.state, c.state)),
                ("lease_expires_at", ours(new.lease_expires_at, c.lease_expires_at)),
                ("claimed_at", ours(new.claimed_at, c.claimed_at)),
                ("response", ours(None, c.response)),
                ("processed_at", ours(new.processed_at, c.processed_at)),
            ]
        )

    def claim_ticket(self, table: Table) -> Any:
        """``nextval(chatflow_claim_ticket_seq)`` (MariaDB 10.3+ sequences; revision 0003)."""
        return CLAIM_TICKETS.next_value()

    def upsert_processed(self, table: Table) -> Insert:
        """Insert the id or move its timestamp to now."""
        stmt = mysql_insert(table)
        return stmt.on_duplicate_key_update(processed_at=stmt.inserted.processed_at)

    def lock_batch(self, select: Select[Any], connection: Connection) -> Select[Any]:
        """``FOR UPDATE SKIP LOCKED`` from MariaDB 10.6 / MySQL 8.0.1, else ``FOR UPDATE``.

        On older servers concurrent sweeps and key rotations wait for one another.
        """
        dialect = connection.dialect
        version = tuple(dialect.server_version_info or ())
        newer = (10, 6) if getattr(dialect, "is_mariadb", False) else (8, 0, 1)
        return select.with_for_update(skip_locked=not version or version >= newer)

    def lock_migrations(self, connection: Connection) -> None:
        """Wait (up to :data:`MIGRATION_LOCK_TIMEOUT`) for the migration lock of this database."""
        name = _migration_lock(connection)
        got = connection.execute(
            text("SELECT GET_LOCK(:name, :timeout)"),
            {"name": name, "timeout": MIGRATION_LOCK_TIMEOUT},
        ).scalar()
        if got != 1:
            raise TimeoutError(
                f"another process has been migrating {connection.engine.url.database!r} for "
                f"{MIGRATION_LOCK_TIMEOUT}s (named lock {name} is held); try again later"
            )

    def end_migration(self, connection: Connection) -> None:
        """Release the migration lock (it is held per connection, not per transaction).

        Called once the migration transaction ended, so ``RELEASE_LOCK`` goes
        through ``connection`` where engine events see it, in a transaction of
        its own that is rolled back at once (named locks ignore transactions).
        """
        if connection.invalidated:  # a lost connection has released the lock already
            return
        name = _migration_lock(connection)
        try:
            began = not connection.in_transaction()
            connection.exec_driver_sql("SELECT RELEASE_LOCK(%s)", (name,)).all()
            if began:
                connection.rollback()
        except Exception:  # a lost connection has released the lock already
            connection.invalidate()
