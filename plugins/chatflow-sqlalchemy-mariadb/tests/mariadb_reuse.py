"""Migrated MariaDB databases handed from test to test, emptied in between.

Running the two migration chains into a new database costs most of a short
MariaDB test, and nearly every conformance test opens a store on a database
of its own. As the core suite does for PostgreSQL (``tests/pg_reuse.py``), a
database a test is done with is reused when it has exactly the shape a fresh
migration gives (tables, columns, indexes, constraints, triggers, routines,
both revisions and the facts the plugin recorded): its tables are emptied,
its counters restarted, and the next test of this pytest worker gets it. A
database whose shape a test changed, or that cannot be emptied quickly (a
killed worker's transaction still holds a lock), is dropped as before. A
database nobody migrated is handed on as it is. One test at a time uses a
database, so tests stay isolated.
"""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa

__all__ = ["DatabasePool"]

_KEPT = {  # rows the migrations write: part of the shape, never emptied
    "chatflow_alembic_version": "version_num",
    "chatflow_mariadb_alembic_version": "version_num",
    "chatflow_mariadb_info": "CONCAT(name, '=', value)",
}

_SHAPE = [  # catalog rows; CONCAT_WS skips NULLs, which is precise enough here
    "SELECT 'tbl', CONCAT_WS(':', table_name, table_type, engine, table_collation)"
    " FROM information_schema.tables WHERE table_schema = :s",
    "SELECT 'col', CONCAT_WS(':', table_name, column_name, ordinal_position, column_type,"
    " is_nullable, column_default, extra, collation_name)"
    " FROM information_schema.columns WHERE table_schema = :s",
    "SELECT 'idx', CONCAT_WS(':', table_name, index_name, seq_in_index, column_name, non_unique)"
    " FROM information_schema.statistics WHERE table_schema = :s",
    "SELECT 'con', CONCAT_WS(':', table_name, constraint_name, constraint_type)"
    " FROM information_schema.table_constraints WHERE constraint_schema = :s",
    "SELECT 'chk', CONCAT_WS(':', table_name, constraint_name, check_clause)"
    " FROM information_schema.check_constraints WHERE constraint_schema = :s",
    "SELECT 'fk', CONCAT_WS(':', table_name, constraint_name, update_rule, delete_rule,"
    " referenced_table_name) FROM information_schema.referential_constraints"
    " WHERE constraint_schema = :s",
    "SELECT 'trg', CONCAT_WS(':', trigger_name, event_object_table, action_timing,"
    " event_manipulation, MD5(action_statement))"
    " FROM information_schema.triggers WHERE trigger_schema = :s",
    "SELECT 'fn', CONCAT_WS(':', routine_name, routine_type, MD5(routine_definition))"
    " FROM information_schema.routines WHERE routine_schema = :s",
]


def _tables(conn: sa.Connection, database: str) -> dict[str, str]:
    rows = conn.execute(
        sa.text("SELECT table_name, table_type FROM information_schema.tables"
                " WHERE table_schema = :s"),
        {"s": database},
    )
    return {name: kind for name, kind in rows}


def shape(conn: sa.Connection, database: str) -> frozenset[tuple[str, str]]:
    """Everything a test could change in ``database`` besides its rows, and the kept rows."""
    found = {tuple(row) for row in conn.execute(sa.text(" UNION ALL ".join(_SHAPE)),
                                               {"s": database})}
    tables = _tables(conn, database)
    for table, value in _KEPT.items():
        if table in tables:
            rows = conn.execute(sa.text(f"SELECT {value} FROM `{database}`.`{table}`"))
            found.update((table, str(v)) for (v,) in rows)
    return frozenset(found)


def empty(conn: sa.Connection, database: str) -> None:
    """Delete every row (but the kept ones) and restart every counter of ``database``."""
    for table, kind in _tables(conn, database).items():
        if kind == "SEQUENCE":
            conn.execute(sa.text(f"ALTER SEQUENCE `{database}`.`{table}` RESTART"))
        elif table not in _KEPT:
            conn.execute(sa.text(f"DELETE FROM `{database}`.`{table}`"))
    counters = conn.execute(
        sa.text("SELECT table_name FROM information_schema.tables"
                " WHERE table_schema = :s AND auto_increment > 1"),
        {"s": database},
    ).scalars().all()
    for table in counters:
        conn.execute(sa.text(f"ALTER TABLE `{database}`.`{table}` AUTO_INCREMENT = 1"))


class DatabasePool:
    """Databases of one kind (one migrated shape), reused test after test in this process.

    Args:
        admin: An engine on the server (AUTOCOMMIT), used for every database by name.
        migrate: Migrates the (empty) database it is given, as the store under test does;
            run once, on the first database, to learn the shape a fresh migration gives.
        new_database: Creates an empty database and returns its name.
        drop_database: Drops a database with everything in it.

    """

    def __init__(
        self,
        admin: sa.Engine,
        migrate: Callable[[str], None],
        new_database: Callable[[], str],
        drop_database: Callable[[str], None],
    ) -> None:
        self._admin = admin
        self._migrate = migrate
        self._new = new_database
        self._drop = drop_database
        self._fresh: frozenset[tuple[str, str]] | None = None
        self._free: list[str] = []

    def take(self) -> str:
        """A database with no rows: migrated or empty."""
        if self._fresh is None:  # the first: learn the migrated shape on it
            name = self._new()
            self._migrate(name)
            with self._admin.connect() as conn:
                self._fresh = shape(conn, name)
            return name
        return self._free.pop() if self._free else self._new()

    def give_back(self, name: str) -> None:
        """Empty database ``name`` for the next test if its shape is a fresh one, else drop it."""
        try:
            with self._admin.connect() as conn:
                conn.execute(sa.text("SET SESSION lock_wait_timeout = 2,"
                                     " innodb_lock_wait_timeout = 2, foreign_key_checks = 0"))
                try:
                    now = shape(conn, name)
                    if now and now != self._fresh:
                        raise _Changed
                    if now:
                        empty(conn, name)
                finally:  # the admin engine's pooled connection drops databases later
                    conn.execute(sa.text("SET SESSION lock_wait_timeout = DEFAULT,"
                                         " innodb_lock_wait_timeout = DEFAULT,"
                                         " foreign_key_checks = DEFAULT"))
        except (_Changed, sa.exc.DBAPIError):
            self._drop(name)
            return
        self._free.append(name)

    def close(self) -> None:
        """Drop every database waiting for a test."""
        while self._free:
            self._drop(self._free.pop())


class _Changed(Exception):
    """A test changed the database's shape: it is dropped, not reused."""
