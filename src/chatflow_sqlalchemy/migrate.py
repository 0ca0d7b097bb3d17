"""Alembic, driven from code: the schema is created, upgraded and checked here.

The scripts live in the repository's top-level ``migrations/`` folder, which
the wheel ships as the package ``chatflow_sqlalchemy._migrations``; the
Alembic ``Config`` is built in code from it, so an installed user needs no
``alembic.ini`` and no particular working directory.

The version table is ``chatflow_alembic_version`` (not ``alembic_version``)
so the chain can live beside an application's own Alembic history.

Migrations run on one connection inside one transaction that first takes a
cross-process lock (``BEGIN IMMEDIATE`` on SQLite, an advisory lock on
PostgreSQL), so concurrent starts migrate once and a failure leaves nothing
half-done. Set ``CHATFLOW_AUTO_MIGRATE=0`` to make stores refuse an old
schema instead of upgrading it on open.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import URL, Connection, Engine, MetaData, create_engine, inspect, make_url

from chatflow_sqlalchemy.dialect import DialectSupport
from chatflow_sqlalchemy.exceptions import SchemaAheadError, SchemaError

__all__ = [
    "BASELINE_REVISION",
    "VERSION_TABLE",
    "Revision",
    "configure_context",
    "current_revision",
    "downgrade",
    "drift",
    "ensure_schema",
    "head_revision",
    "history",
    "include_name_for",
    "make_config",
    "open_engine",
    "run_locked",
    "stamp",
    "upgrade",
]

VERSION_TABLE = "chatflow_alembic_version"
BASELINE_REVISION = "0001"
"""The revision that describes chatflow-agent 0.3.4's own SQLite schema."""


def script_location() -> str:
    """Folder of the Alembic scripts: the installed package, else the source tree."""
    try:
        return str(resources.files("chatflow_sqlalchemy._migrations"))
    except ModuleNotFoundError:
        return str(Path(__file__).resolve().parents[2] / "migrations")


def make_config(connection: Connection | None = None) -> Config:
    """An Alembic Config built in code; ``connection`` is used instead of a URL."""
    config = Config()
    config.set_main_option("script_location", script_location().replace("%", "%%"))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def include_name_for(target_metadata: MetaData) -> Callable[[str | None, str, Any], bool]:
    """An Alembic ``include_name`` hook that sees only ``target_metadata``'s tables.

    The chatflow tables may share a database with an application's own tables
    (and its own ``alembic_version``); autogenerate and :func:`drift` must
    neither report them as drift nor ever propose dropping them.
    """

    def include_name(name: str | None, type_: str, _parent_names: Any) -> bool:
        return type_ != "table" or name in target_metadata.tables

    return include_name


def configure_context(context: Any, connection: Connection, target_metadata: MetaData) -> None:
    """Configure an Alembic environment context the way every run of the chain needs."""
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        version_table=VERSION_TABLE,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        include_name=include_name_for(target_metadata),
    )


def _support_for(dialect_name: str) -> DialectSupport:
    from chatflow_sqlalchemy.registry import load_backend

    support = load_backend(dialect_name).dialect_support
    return support if support is not None else DialectSupport()


@contextmanager
def locked_connection(engine: Engine, support: DialectSupport) -> Iterator[Connection]:
    """A connection inside one transaction that holds the migration lock."""
    with engine.execution_options(chatflow_write=True).connect() as conn:
        support.begin_migration(conn)
        try:
            with conn.begin():
                support.lock_migrations(conn)
                yield conn
                _check_foreign_keys(conn)
        finally:
            if conn.in_transaction():
                conn.rollback()
            support.end_migration(conn)


def _check_foreign_keys(conn: Connection) -> None:
    """Before commit, check that the chatflow tables' references still hold.

    SQLite migrates with foreign keys off, so a faulty migration could
    otherwise commit orphan rows.
    """
    if conn.dialect.name != "sqlite":
        return
    from chatflow_sqlalchemy.models import metadata

    problems: list[Any] = []
    existing = set(inspect(conn).get_table_names())
    for table in metadata.tables:
        if table in existing:
            problems += conn.exec_driver_sql(f'PRAGMA foreign_key_check("{table}")').fetchall()
    if problems:
        raise SchemaError(
            f"migration left rows whose session does not exist: {problems[:5]}; rolled back",
            found=None,
            expected=head_revision(),
        )


def open_engine(url: str | URL) -> Engine:
    """An engine for ``url`` set up exactly as a store sets it up, without migrating.

    For tools (the CLI, Alembic's env.py) that must look at a database as it is.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() in ("postgresql", "postgres"):
        from chatflow_sqlalchemy.backends.postgresql import psycopg_url

        parsed = psycopg_url(parsed)
    support = _support_for(parsed.get_backend_name())
    engine = create_engine(parsed, **support.engine_options(parsed))
    support.prepare_engine(engine)
    return engine


def run_locked(url: str | None, fn: Callable[[Connection], None]) -> None:
    """Open ``url`` like a store would, and run ``fn`` under the migration lock."""
    if not url:
        raise SchemaError("no database URL: set CHATFLOW_DATABASE_URL", found=None, expected="")
    engine = open_engine(url)
    support = _support_for(engine.dialect.name)
    try:
        with locked_connection(engine, support) as conn:
            fn(conn)
    finally:
        engine.dispose()


def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(make_config())


def head_revision() -> str:
    """The revision the code expects."""
    head = _script().get_current_head()
    assert head is not None
    return head


def current_revision(conn: Connection) -> str | None:
    """The database's revision, or None if it was never migrated."""
    context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
    return context.get_current_revision()


def _read_current(engine: Engine) -> str | None:
    with engine.connect() as conn:
        try:
            return current_revision(conn)
        finally:
            conn.rollback()


def _check_known(found: str | None, expected: str) -> None:
    if found is None:
        return
    try:
        known = _script().get_revision(found)
    except CommandError:
        known = None
    if known is None:
        raise SchemaAheadError(
            f"the database schema is at revision {found}, newer than this chatflow-sqlalchemy "
            f"knows (expected {expected}); upgrade the package: pip install -U chatflow-sqlalchemy",
            found=found,
            expected=expected,
        )


def ensure_schema(engine: Engine, support: DialectSupport) -> None:
    """Create or upgrade the schema to head (what opening a store does).

    Raises:
        SchemaAheadError: The database was migrated by a newer version.
        SchemaError: It is behind and ``CHATFLOW_AUTO_MIGRATE=0`` forbids upgrading.

    """
    expected = head_revision()
    found = _read_current(engine)
    if found == expected:
        return
    _check_known(found, expected)
    if os.environ.get("CHATFLOW_AUTO_MIGRATE", "1") == "0":
        raise SchemaError(
            f"the database schema is at revision {found or 'none'}, the code expects {expected}; "
            "run: chatflow-sqlalchemy db upgrade",
            found=found,
            expected=expected,
        )
    _run(engine, support, lambda cfg: command.upgrade(cfg, "head"))


def _run(engine: Engine, support: DialectSupport, fn: Callable[[Config], None]) -> None:
    with locked_connection(engine, support) as conn:
        fn(make_config(conn))


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Upgrade to ``revision`` under the migration lock."""
    _check_known(_read_current(engine), head_revision())
    _run(engine, _support_for(engine.dialect.name), lambda cfg: command.upgrade(cfg, revision))


def downgrade(engine: Engine, revision: str) -> None:
    """Downgrade to ``revision`` (``base`` drops the tables) under the migration lock."""
    _check_known(_read_current(engine), head_revision())
    _run(engine, _support_for(engine.dialect.name), lambda cfg: command.downgrade(cfg, revision))


def stamp(engine: Engine, revision: str) -> None:
    """Record ``revision`` as current without running migrations."""
    _run(engine, _support_for(engine.dialect.name), lambda cfg: command.stamp(cfg, revision))


@dataclass(frozen=True)
class Revision:
    """One step of the migration chain."""

    revision: str
    down_revision: str | None
    doc: str
    is_head: bool


def history() -> list[Revision]:
    """The migration chain, oldest first."""
    script = _script()
    revisions = list(script.walk_revisions())
    revisions.reverse()
    return [
        Revision(
            revision=rev.revision,
            down_revision=rev.down_revision if isinstance(rev.down_revision, str) else None,
            doc=(rev.doc or "").strip(),
            is_head=rev.is_head,
        )
        for rev in revisions
    ]


def drift(engine: Engine) -> list[str]:
    """Differences between the models and the database schema (empty when in sync)."""
    from chatflow_sqlalchemy.models import metadata

    with engine.connect() as conn:
        try:
            context = MigrationContext.configure(
                conn,
                opts={
                    "version_table": VERSION_TABLE,
                    "compare_type": True,
                    "include_name": include_name_for(metadata),
                },
            )
            diffs = compare_metadata(context, metadata)
        finally:
            conn.rollback()
    return [_describe_diff(diff) for diff in diffs]


def _describe_diff(diff: Any) -> str:
    if isinstance(diff, list):
        return "; ".join(_describe_diff(d) for d in diff)
    kind, *rest = diff
    names = [getattr(item, "name", None) or item for item in rest[:3] if item is not None]
    return f"{kind}: {', '.join(str(n) for n in names)}"
