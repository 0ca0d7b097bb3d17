"""Migrated PostgreSQL schemas handed from test to test, emptied in between.

Creating a schema and running the migration chain into it costs most of a
short PostgreSQL test. A schema a test is done with is reused when it has
exactly the shape a fresh migration gives (the same tables, columns,
constraints, indexes, triggers, functions and revision): its tables are
emptied (``TRUNCATE``, sequences restarted) and the next test of this pytest
worker gets it. A schema whose shape a test changed, or that cannot be
emptied quickly, is dropped as before. A schema nobody migrated is handed on
as it is. One test at a time uses a schema, so tests stay isolated.
"""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa

from chatflow_sqlalchemy.migrate import VERSION_TABLE

__all__ = ["SchemaPool"]

_IN_SCHEMA = "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = :s"
_SHAPE = [  # catalog columns, not deparsed SQL: a few milliseconds per test
    "SELECT 'rel', concat_ws(':', c.relname, c.relkind, c.relnatts, c.relchecks,"
    f" c.relhastriggers, c.relispartition) FROM pg_class c {_IN_SCHEMA}",
    "SELECT 'col', concat_ws(':', c.relname, a.attname, a.atttypid, a.atttypmod, a.attnotnull,"
    " a.atthasdef, a.attidentity, a.attgenerated) FROM pg_attribute a"
    f" JOIN pg_class c ON c.oid = a.attrelid {_IN_SCHEMA} AND a.attnum > 0"
    " AND NOT a.attisdropped",
    "SELECT 'con', concat_ws(':', c.relname, k.conname, k.contype, k.conkey::text,"
    " k.confkey::text, k.confdeltype, k.convalidated) FROM pg_constraint k"
    f" JOIN pg_class c ON c.oid = k.conrelid {_IN_SCHEMA}",
    "SELECT 'idx', concat_ws(':', c.relname, i.indkey::text, i.indisunique, i.indisvalid,"
    f" i.indpred IS NULL) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid {_IN_SCHEMA}",
    "SELECT 'trg', concat_ws(':', c.relname, t.tgname, t.tgenabled, t.tgtype) FROM pg_trigger t"
    f" JOIN pg_class c ON c.oid = t.tgrelid {_IN_SCHEMA} AND NOT t.tgisinternal",
    "SELECT 'fn', concat_ws(':', p.proname, md5(p.prosrc)) FROM pg_proc p"
    " JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = :s",
    "SELECT 'typ', t.typname FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace"
    " WHERE n.nspname = :s AND t.typtype NOT IN ('c', 'b')",
]


def shape(conn: sa.Connection, schema: str) -> frozenset[tuple[str, str]]:
    """Everything a test could change in ``schema`` besides its rows, and its revision.

    The schema's own name is left out, so that two schemas of one shape compare equal.
    """
    rows = conn.execute(sa.text(" UNION ALL ".join(_SHAPE)), {"s": schema})
    found = {(kind, what.replace(schema, "<schema>")) for kind, what in rows}
    if ("rel", f"{VERSION_TABLE}:r") in found:
        versions = conn.execute(sa.text(f'SELECT version_num FROM "{schema}".{VERSION_TABLE}'))
        found.update(("rev", str(v)) for (v,) in versions)
    return frozenset(found)


def empty(conn: sa.Connection, schema: str) -> None:
    """Delete every row (but the revision) and restart every sequence of ``schema``.

    ``DELETE`` rather than ``TRUNCATE``: a test leaves a few rows, and ``TRUNCATE``
    rewrites every table and index file, which costs more than the rows.
    """
    tables = conn.execute(sa.text(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = :s AND c.relkind IN ('r', 'p') AND NOT c.relispartition"
        " AND c.relname <> :version"
    ), {"s": schema, "version": VERSION_TABLE}).scalars().all()
    conn.execute(sa.text("SET LOCAL session_replication_role = replica"))  # no FK order
    for table in tables:
        conn.execute(sa.text(f'DELETE FROM "{schema}"."{table}"'))
    conn.execute(sa.text(
        "SELECT setval(format('%I.%I', schemaname, sequencename), start_value, false)"
        " FROM pg_sequences WHERE schemaname = :s"
    ), {"s": schema})


class SchemaPool:
    """Schemas of one kind (one migrated shape), reused test after test in this process.

    Args:
        admin: An engine on the database the schemas live in; or, for a pool of
            databases, ``database name -> engine on it`` (their schema is ``public``).
        migrate: Migrates the (empty) schema it is given, as the store under test does;
            run once, on the first schema, to learn the shape a fresh migration gives.
        new_schema: Creates an empty schema (or database) and returns its name.
        drop_schema: Drops a schema (or database) with everything in it.

    """

    def __init__(
        self,
        admin: sa.Engine | Callable[[str], sa.Engine],
        migrate: Callable[[str], None],
        new_schema: Callable[[], str],
        drop_schema: Callable[[str], None],
    ) -> None:
        if isinstance(admin, sa.Engine):
            engine = admin
            self._where: Callable[[str], tuple[sa.Engine, str]] = lambda name: (engine, name)
        else:
            self._where = lambda name: (admin(name), "public")
        self._migrate = migrate
        self._new = new_schema
        self._drop = drop_schema
        self._fresh: frozenset[tuple[str, str]] | None = None
        self._free: list[str] = []

    def take(self) -> str:
        """A schema with no rows: migrated or empty."""
        if self._fresh is None:  # the first: learn the migrated shape on it
            name = self._new()
            self._migrate(name)
            engine, schema = self._where(name)
            with engine.connect() as conn:
                self._fresh = shape(conn, schema)
            return name
        return self._free.pop() if self._free else self._new()

    def give_back(self, name: str) -> None:
        """Empty schema ``name`` for the next test if its shape is a fresh one, else drop it."""
        engine, schema = self._where(name)
        try:
            with engine.begin() as conn:
                conn.execute(sa.text("SET LOCAL lock_timeout = '2s'"))
                now = shape(conn, schema)
                if now and now != self._fresh:
                    raise _Changed
                if now:
                    empty(conn, schema)
        except (_Changed, sa.exc.DBAPIError):
            self._drop(name)
            return
        self._free.append(name)

    def close(self) -> None:
        """Drop every schema waiting for a test."""
        while self._free:
            self._drop(self._free.pop())


class _Changed(Exception):
    """A test changed the schema's shape: it is dropped, not reused."""
