"""Alembic, driven from code (no ``alembic.ini``): the schema is created, upgraded and checked.

The version table ``chatflow_alembic_version`` lets the chain live beside an
application's own Alembic history. Every run holds the backend's migration
lock in one transaction, so concurrent starts migrate once. Plugin chains
(:class:`MigrationChain` entry points, see docs/plugin-authors.md) run after
the core chain, under the same lock.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from importlib import resources
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    URL,
    Connection,
    Engine,
    MetaData,
    String,
    column,
    create_engine,
    inspect,
    make_url,
    select,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy import table as table_named

from chatflow_sqlalchemy.dialect import DialectSupport
from chatflow_sqlalchemy.registry import support_for
from chatflow_sqlalchemy.tables import BACKEND_SHAPED
from chatflow_sqlalchemy.urls import psycopg_url

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    from chatflow_sqlalchemy.exceptions import MigrationPluginError

logger = logging.getLogger("chatflow_sqlalchemy")

_ALEMBIC_QUIET: ContextVar[bool] = ContextVar("chatflow_alembic_quiet", default=False)


class _AlembicInfoToDebug(logging.Filter):
    """Inside :func:`alembic_chatter_at_debug` only, Alembic's INFO records become DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _ALEMBIC_QUIET.get() or record.levelno != logging.INFO:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


_ALEMBIC_FILTER = _AlembicInfoToDebug()
_KNOWN_ALEMBIC_LOGGERS = ("alembic.runtime.migration", "alembic.runtime.plugins")


@contextmanager
def alembic_chatter_at_debug() -> Iterator[None]:
    """Run the block with Alembic's INFO logging demoted to DEBUG (this context only).

    A filter, not a logging configuration: an application's own Alembic runs are untouched.
    """
    names = [name for name in list(logging.Logger.manager.loggerDict)
             if name.partition(".")[0] == "alembic"]
    for name in {*names, *_KNOWN_ALEMBIC_LOGGERS}:
        alembic_logger = logging.getLogger(name)
        if _ALEMBIC_FILTER not in alembic_logger.filters:
            alembic_logger.addFilter(_ALEMBIC_FILTER)
    token = _ALEMBIC_QUIET.set(True)
    try:
        yield
    finally:
        _ALEMBIC_QUIET.reset(token)


__all__ = [
    "AUTO_MIGRATE_ENV", "BASELINE_REVISION", "CORE_CHAIN", "EMPTY_DATABASE",
    "MIGRATIONS_ENTRY_POINT_GROUP", "UPSTREAM_TABLES", "VERSION_TABLE", "ChainStatus",
    "MigrationChain", "MigrationPluginError", "Revision", "alembic_chatter_at_debug",
    "auto_migrate_enabled", "chain_status", "chains_for", "check_not_ahead",
    "configure_context", "core_chain", "current_revision", "describe_revision", "downgrade",
    "drift", "ensure_schema", "find_chain", "head_revision", "history", "include_name_for",
    "open_engine", "plugin_chains", "require_existing_database", "run_locked", "stamp",
    "upgrade",
]

VERSION_TABLE = "chatflow_alembic_version"
BASELINE_REVISION = "0001"
"""The revision that describes chatflow-agent 0.3.4's own SQLite schema."""
CORE_REVISIONS = (
    "0001", "0002", "0003", "0004", "0005", "0006", "0007", "0008", "0009", "0010",
)
"""The core chain's revisions, oldest first (head last): reading where a database stands
needs neither Alembic nor the scripts. A test checks it against the scripts."""

CORE_CHAIN = "core"
"""Name of chatflow-sqlalchemy's own chain (plugin chains are named by their entry point)."""

MIGRATIONS_ENTRY_POINT_GROUP = "chatflow_sqlalchemy.migrations"

AUTO_MIGRATE_ENV = "CHATFLOW_AUTO_MIGRATE"
"""Environment variable: may stores create and upgrade the schema on open? (default yes)"""

UPSTREAM_TABLES = "chatflow-agent 0.3.4 tables (unversioned)"
"""How a database holding upstream's tables but no revision is described."""

EMPTY_DATABASE = "empty database"
"""How a database without chatflow tables is described."""


def _errors() -> ModuleType:
    """The error classes, imported when one is raised (they load chatflow-agent)."""
    from chatflow_sqlalchemy import exceptions

    return exceptions


def __getattr__(name: str) -> Any:
    """``MigrationPluginError`` lives in :mod:`chatflow_sqlalchemy.exceptions` (loaded lazily)."""
    if name == "MigrationPluginError":
        return _errors().MigrationPluginError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def auto_migrate_enabled(auto_migrate: bool | None = None) -> bool:
    """Whether a store may create or upgrade the schema when it opens.

    Args:
        auto_migrate: The store's ``auto_migrate=`` argument; None reads
            ``CHATFLOW_AUTO_MIGRATE`` (``1/true/yes/on`` or ``0/false/no/off``,
            any case; unset or empty means yes).

    Raises:
        ValueError: ``CHATFLOW_AUTO_MIGRATE`` holds another value.
        TypeError: ``auto_migrate`` is neither a bool nor None.

    """
    if auto_migrate is not None:
        if not isinstance(auto_migrate, bool):
            raise TypeError(f"auto_migrate must be True, False or None, not {auto_migrate!r}")
        return auto_migrate
    raw = os.environ.get(AUTO_MIGRATE_ENV, "")
    word = raw.strip().lower()
    if word in ("", "1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError(
        f"{AUTO_MIGRATE_ENV}={raw!r} is not understood; set it to 0, false, no or off to "
        "make stores refuse an old schema, or to 1, true, yes or on (the default)"
    )


@dataclass(frozen=True)
class MigrationChain:
    """One Alembic chain: the core's, or a plugin's (``chatflow_sqlalchemy.migrations``).

    Attributes:
        script_location: The folder holding ``versions/`` (no ``env.py``):
            ``"package:folder"`` (importlib.resources) or a filesystem path.
        version_table: The chain's own version table (never
            ``chatflow_alembic_version`` or ``alembic_version``).
        target_metadata: The ``MetaData`` of the chain's tables: checked for
            collisions with the core tables, and compared by ``db check``.
        dialects: Dialect names the chain applies to (kept as a frozenset); None: every database.
        name: The chain's name (filled in from the entry point; ``core`` for ours).
        distribution: The distribution that provides it (filled in), for messages.

    """

    script_location: str
    version_table: str
    target_metadata: MetaData
    dialects: AbstractSet[str] | None = None
    name: str = ""
    distribution: str = ""

    def __post_init__(self) -> None:
        if self.dialects is not None:
            object.__setattr__(self, "dialects", frozenset(self.dialects))

    @property
    def is_core(self) -> bool:
        """True for chatflow-sqlalchemy's own chain."""
        return self.name == CORE_CHAIN and self.version_table == VERSION_TABLE

    @property
    def label(self) -> str:
        """How messages name the chain."""
        if self.is_core:
            return "chatflow-sqlalchemy"
        origin = f" from {self.distribution}" if self.distribution else ""
        return f"migration plugin {self.name!r}{origin}"

    def applies_to(self, dialect_name: str) -> bool:
        """True when the chain runs on databases of ``dialect_name``."""
        return self.dialects is None or dialect_name in self.dialects

    def directory(self) -> str:
        """The chain's folder: ``package:folder`` through importlib.resources, else a path."""
        location = self.script_location
        is_drive = location[1:2] == ":" and location[0].isalpha()  # C:/... on Windows
        if ":" in location and not Path(location).is_absolute() and not is_drive:
            package, _, folder = location.partition(":")
            base = resources.files(package)
            parts = [part for part in folder.split("/") if part]
            return str(base.joinpath(*parts) if folder else base)
        return str(Path(location))


@dataclass(frozen=True)
class ChainStatus:
    """Where a database stands on one chain."""

    chain: MigrationChain
    current: str | None
    head: str

    @property
    def at_head(self) -> bool:
        """True when the database is at the chain's head."""
        return self.current == self.head


def script_location() -> str:
    """Folder of the Alembic scripts: the installed package, else the source tree."""
    try:
        return str(resources.files("chatflow_sqlalchemy._migrations"))
    except ModuleNotFoundError:
        return str(Path(__file__).resolve().parents[2] / "migrations")


def include_name_for(target_metadata: MetaData) -> Callable[[str | None, str, Any], bool]:
    """An Alembic ``include_name`` hook that sees only ``target_metadata``'s tables.

    An application's own tables may share the database: they are never reported or dropped.
    """

    def include_name(name: str | None, type_: str, _parent_names: Any) -> bool:
        return type_ != "table" or name in target_metadata.tables

    return include_name


def _context_options(
    dialect_name: str, target_metadata: MetaData, version_table: str
) -> dict[str, Any]:
    """Alembic context options for running or comparing a chain on ``dialect_name``."""

    def include_object(
        obj: Any, _name: str | None, type_: str, _reflected: bool, _compare_to: Any
    ) -> bool:
        # A column a backend's migration creates its own way (PostgreSQL's partition key).
        shaped = getattr(obj, "info", {}).get(BACKEND_SHAPED, ()) if type_ == "column" else ()
        return dialect_name not in shaped

    return {
        "target_metadata": target_metadata,
        "version_table": version_table,
        "render_as_batch": dialect_name == "sqlite",
        "compare_type": True,
        "include_name": include_name_for(target_metadata),
        "include_object": include_object,
    }


def configure_context(
    context: Any,
    connection: Connection,
    target_metadata: MetaData,
    version_table: str = VERSION_TABLE,
) -> None:
    """Configure an Alembic environment context the way every run of a chain needs."""
    context.configure(
        connection=connection,
        **_context_options(connection.dialect.name, target_metadata, version_table),
    )


# --------------------------------------------------------------------------- chains


@functools.cache
def core_chain() -> MigrationChain:
    """chatflow-sqlalchemy's own chain (revisions 0001, 0002, ...)."""
    from chatflow_sqlalchemy.tables import metadata

    return MigrationChain(
        script_location=script_location(),
        version_table=VERSION_TABLE,
        target_metadata=metadata,
        name=CORE_CHAIN,
        distribution="chatflow-sqlalchemy",
    )


def plugin_chains(dialect_name: str | None = None) -> list[MigrationChain]:
    """Every installed plugin chain (that applies to ``dialect_name``), validated.

    Raises:
        MigrationPluginError: A plugin cannot be loaded, or collides with the
            core or another plugin (its name, distribution and table named).

    """
    chains = _installed_chains(tuple(sys.path))
    return [c for c in chains if dialect_name is None or c.applies_to(dialect_name)]


@functools.lru_cache(maxsize=1)
def _installed_chains(_sys_path: tuple[str, ...]) -> tuple[MigrationChain, ...]:
    chains = tuple(_discover())
    _validate(chains)
    return chains


def _discover() -> Iterator[MigrationChain]:
    for ep in sorted(entry_points(group=MIGRATIONS_ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = getattr(ep, "dist", None)
        origin = f"{dist.name} {dist.version}" if dist is not None else "an unknown distribution"
        where = f"migration plugin {ep.name!r} from {origin} ({ep.value})"
        try:
            obj: Any = ep.load()
            if callable(obj) and not isinstance(obj, MigrationChain):
                obj = obj()
        except Exception as exc:
            raise _errors().MigrationPluginError(
                f"{where} cannot be loaded: {type(exc).__name__}: {exc}; nothing was migrated. "
                f"Reinstall it (pip install --force-reinstall '{dist.name if dist else ep.name}') "
                "or uninstall it"
            ) from exc
        if not isinstance(obj, MigrationChain):
            raise _errors().MigrationPluginError(
                f"{where} is a {type(obj).__name__}, not a "
                "chatflow_sqlalchemy.migrate.MigrationChain; nothing was migrated"
            )
        yield replace(obj, name=ep.name, distribution=origin)


def _validate(chains: Iterable[MigrationChain]) -> None:
    """Reject plugin chains that would touch what the core or another plugin owns."""
    core_tables = core_chain().target_metadata.tables
    owners = {table: "a chatflow-sqlalchemy core table" for table in core_tables}
    owners[VERSION_TABLE] = "chatflow-sqlalchemy's version table"
    owners["alembic_version"] = "Alembic's default version table (your application's)"
    for chain in chains:
        if chain.name == CORE_CHAIN:
            raise _errors().MigrationPluginError(
                f"{chain.label} uses the reserved name {CORE_CHAIN!r}; rename its entry point"
            )
        if not isinstance(chain.target_metadata, MetaData):
            raise _errors().MigrationPluginError(
                f"{chain.label} declares no target_metadata (a MetaData)"
            )
        if chain.version_table in chain.target_metadata.tables:
            raise _errors().MigrationPluginError(
                f"{chain.label} uses its own table {chain.version_table!r} as its version "
                "table; give the chain a version table of its own. Nothing was migrated"
            )
        for table in [*chain.target_metadata.tables, chain.version_table]:
            owner = owners.get(table)
            if owner is not None:
                kind = "version table" if table == chain.version_table else "table"
                raise _errors().MigrationPluginError(
                    f"{chain.label} declares the {kind} {table!r}, which is {owner}; a plugin "
                    "may only create tables of its own (rename it, e.g. with the plugin's name "
                    "as prefix). Nothing was migrated; uninstall or fix the plugin"
                )
            owners[table] = f"a table of {chain.label}"
        directory = Path(chain.directory())
        if not (directory / "versions").is_dir():
            raise _errors().MigrationPluginError(
                f"{chain.label}: script_location {chain.script_location!r} resolves to "
                f"{directory}, which has no versions/ folder"
            )


def chains_for(dialect_name: str) -> list[MigrationChain]:
    """The core chain, then every plugin chain that applies to ``dialect_name``."""
    return [core_chain(), *plugin_chains(dialect_name)]


def find_chain(name: str, dialect_name: str | None = None) -> MigrationChain:
    """The chain called ``name`` (``core`` or a plugin's entry-point name).

    Raises:
        MigrationPluginError: No such chain is installed (or it does not apply
            to ``dialect_name``).

    """
    if name == CORE_CHAIN:
        return core_chain()
    installed = plugin_chains()
    for chain in installed:
        if chain.name == name:
            if dialect_name is not None and not chain.applies_to(dialect_name):
                raise _errors().MigrationPluginError(
                    f"{chain.label} does not apply to {dialect_name} databases "
                    f"(only {', '.join(sorted(chain.dialects or ()))})"
                )
            return chain
    names = ", ".join([CORE_CHAIN, *(c.name for c in installed)])
    raise _errors().MigrationPluginError(f"no migration chain named {name!r} (installed: {names})")


@functools.lru_cache(maxsize=64)
def _scripts_at(directory: str) -> ScriptDirectory:
    with alembic_chatter_at_debug():  # importing Alembic logs "setup plugin ..." at INFO
        from alembic.script import ScriptDirectory

    return ScriptDirectory(directory)


def _script(chain: MigrationChain | None = None) -> ScriptDirectory:
    return _scripts_at((chain or core_chain()).directory())


# --------------------------------------------------------------------------- running


@contextmanager
def locked_connection(engine: Engine, support: DialectSupport) -> Iterator[Connection]:
    """A connection inside one transaction that holds the migration lock (FKs checked at end)."""
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
    """Before commit on SQLite (migrated with foreign keys off), refuse orphan rows."""
    if conn.dialect.name != "sqlite":
        return
    tables = [t for chain in chains_for("sqlite") for t in chain.target_metadata.tables]
    problems: list[Any] = []
    existing = set(inspect(conn).get_table_names())
    for table in tables:
        if table in existing:
            problems += conn.exec_driver_sql(f'PRAGMA foreign_key_check("{table}")').fetchall()
    if problems:
        raise _errors().SchemaError(
            f"migration left rows whose parent row does not exist: {problems[:5]}; rolled back",
            found=None,
            expected=head_revision(),
        )


def open_engine(url: str | URL) -> Engine:
    """An engine for ``url`` set up exactly as a store sets it up, without migrating."""
    parsed = make_url(url)
    if parsed.get_backend_name() in ("postgresql", "postgres"):
        parsed = psycopg_url(parsed)
    support = support_for(parsed.get_backend_name())
    parsed = support.sync_url(parsed)
    engine = create_engine(parsed, **support.engine_options(parsed))
    support.prepare_engine(engine)
    return engine


def run_locked(url: str | None, fn: Callable[[Connection], None]) -> None:
    """Open ``url`` like a store would, and run ``fn`` under the migration lock."""
    if not url:
        raise _errors().SchemaError(
            "no database URL: set CHATFLOW_DATABASE_URL", found=None, expected=""
        )
    engine = open_engine(url)
    support = support_for(engine.dialect.name)
    try:
        with locked_connection(engine, support) as conn:
            fn(conn)
    finally:
        engine.dispose()


_VERBS = {"upgrade": "upgraded", "downgrade": "downgraded", "stamp": "stamped"}


def _alembic_command(action: str) -> Callable[[Config, str], None]:
    """Alembic's ``upgrade``, ``downgrade`` or ``stamp`` command (Alembic is imported here)."""
    with alembic_chatter_at_debug():
        from alembic import command

    return {"upgrade": command.upgrade, "downgrade": command.downgrade,
            "stamp": command.stamp}[action]


def _chain_config(connection: Connection, chain: MigrationChain) -> Config:
    """An Alembic Config that runs ``chain`` on ``connection`` through our ``env.py``.

    A plugin chain's ``versions/`` is its only version location: it ships revision files alone.
    """
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", script_location().replace("%", "%%"))
    config.attributes.update(connection=connection, chatflow_chain=chain)
    if not chain.is_core:
        versions = str(Path(chain.directory()) / "versions")
        # One location; a newline never occurs in a path, ":" (os.pathsep) may.
        config.set_main_option("path_separator", "newline")  # Alembic >= 1.16
        config.set_main_option("version_path_separator", "newline")  # older releases
        config.set_main_option("version_locations", versions.replace("%", "%%"))
    return config


def head_revision(chain: MigrationChain | None = None) -> str:
    """The revision the code expects (of the core chain, or of ``chain``)."""
    if chain is None or chain.is_core:
        return CORE_REVISIONS[-1]
    head = _script(chain).get_current_head()
    assert head is not None
    return head


def current_revision(conn: Connection, chain: MigrationChain | None = None) -> str | None:
    """The database's revision of the core chain (or ``chain``); None if never migrated."""
    name = (chain or core_chain()).version_table
    if not inspect(conn).has_table(name):
        return None
    version = column("version_num", String)
    found = list(conn.execute(select(version).select_from(table_named(name))).scalars())
    if len(found) <= 1:
        return found[0] if found else None
    with alembic_chatter_at_debug():  # Alembic refuses several heads in its own words
        from alembic.runtime.migration import MigrationContext

        context = MigrationContext.configure(conn, opts={"version_table": name})
        return context.get_current_revision()


def chain_status(
    engine: Engine, chains: Iterable[MigrationChain] | None = None
) -> list[ChainStatus]:
    """Where the database stands on ``chains`` (default: core, then each plugin that applies)."""
    chains = list(chains) if chains is not None else chains_for(engine.dialect.name)
    with engine.connect() as conn:  # closing it rolls back what reading began
        found = [current_revision(conn, chain) for chain in chains]
    return [
        ChainStatus(chain, current, head_revision(chain))
        for chain, current in zip(chains, found, strict=True)
    ]


def check_not_ahead(found: str | None, chain: MigrationChain | None = None) -> None:
    """Raise :class:`SchemaAheadError` (naming the package to upgrade) for an unknown ``found``."""
    if found is None:
        return
    chain = chain or core_chain()
    if chain.is_core and found in CORE_REVISIONS:
        return
    from alembic.util.exc import CommandError

    expected = head_revision(chain)
    try:
        known = _script(chain).get_revision(found)
    except CommandError:
        known = None
    if known is None:
        if chain.is_core:
            what, package = "the database schema", "chatflow-sqlalchemy"
        else:
            what = f"the database schema of {chain.label}"
            package = chain.distribution.split()[0] if chain.distribution else chain.name
        raise _errors().SchemaAheadError(
            f"{what} is at revision {found}, newer than this installation knows "
            f"(expected {expected}); upgrade the package: pip install -U {package}",
            found=found,
            expected=expected,
        )


def describe_revision(
    conn: Connection, revision: str | None, chain: MigrationChain | None = None
) -> str:
    """How logs and errors name where a database stands on a chain.

    Without a revision the core chain tells :data:`EMPTY_DATABASE` from
    :data:`UPSTREAM_TABLES`; a plugin chain says ``none``.
    """
    if revision is not None:
        return revision
    if chain is not None and not chain.is_core:
        return "none"
    from chatflow_sqlalchemy.tables import sessions

    return UPSTREAM_TABLES if inspect(conn).has_table(sessions.name) else EMPTY_DATABASE


def ensure_schema(
    engine: Engine, support: DialectSupport, *, auto_migrate: bool | None = None
) -> None:
    """Create or upgrade the core schema and every plugin's to head (what opening a store does).

    Args:
        engine: The store's engine.
        support: Its backend's dialect support (takes the migration lock).
        auto_migrate: False refuses instead of migrating; None reads
            ``CHATFLOW_AUTO_MIGRATE`` (see :func:`auto_migrate_enabled`).

    Raises:
        SchemaAheadError: The database was migrated by a newer version.
        SchemaError: It is behind (or missing) and auto-migration is off;
            nothing was created or changed.
        MigrationPluginError: An installed plugin chain is unusable.

    """
    allowed = auto_migrate_enabled(auto_migrate)
    if not allowed:
        require_existing_database(engine)
    with alembic_chatter_at_debug():
        statuses = _chain_status_beside_migrators(engine, support)
        behind = [status for status in statuses if not status.at_head]
        if not behind:
            return
        for status in behind:
            check_not_ahead(status.current, status.chain)
        if not allowed:
            _refuse(engine, behind[0])
        _run(engine, [(status.chain, "upgrade", "head") for status in behind], support)


def _chain_status_beside_migrators(engine: Engine, support: DialectSupport) -> list[ChainStatus]:
    """:func:`chain_status`, read again under the migration lock if the quick read fails.

    Reading the catalog beside another process's non-transactional DDL can
    fail (MariaDB error 1684).
    """
    try:
        return chain_status(engine)
    except sa_exc.OperationalError as exc:
        if exc.connection_invalidated:
            raise
        logger.debug("schema status unreadable beside a migration (%s); reading it locked", exc)
    with locked_connection(engine, support):
        return chain_status(engine)


def _database(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=True)


def _refuse(engine: Engine, status: ChainStatus) -> None:
    with engine.connect() as conn:
        found = describe_revision(conn, status.current, status.chain)
    what = "the schema" if status.chain.is_core else f"the schema of {status.chain.label}"
    if status.current is not None:
        found = f"revision {found}"
    raise _errors().SchemaError(
        f"{_database(engine)}: {what} is behind (found: {found}; this code needs revision "
        f"{status.head}) and auto-migration is off (auto_migrate=False or "
        "CHATFLOW_AUTO_MIGRATE), so nothing was changed; run: chatflow-sqlalchemy db upgrade",
        found=status.current,
        expected=status.head,
    )


def require_existing_database(engine: Engine) -> None:
    """Refuse an on-disk SQLite database whose file does not exist (connecting would create it).

    Other databases, in-memory SQLite and ``file:`` URIs pass.

    Raises:
        SchemaError: The file does not exist (the message says how to create it).

    """
    if engine.dialect.name != "sqlite":
        return
    database = engine.url.database or ""
    if database in ("", ":memory:") or database.startswith("file:"):
        return
    if not Path(database).exists():
        raise _errors().SchemaError(
            f"the SQLite database {database} does not exist and auto-migration is off "
            "(auto_migrate=False or CHATFLOW_AUTO_MIGRATE), so it was not created; create it "
            f"with: CHATFLOW_DATABASE_URL={_database(engine)} chatflow-sqlalchemy db upgrade",
            found=None,
            expected=head_revision(),
        )


def _run(
    engine: Engine,
    steps: list[tuple[MigrationChain, str, str]],
    support: DialectSupport | None = None,
) -> None:
    """Run ``steps`` in one locked transaction; log each chain that moved once committed."""
    moved: list[tuple[MigrationChain, str, str, str, float]] = []
    support = support or support_for(engine.dialect.name)
    with alembic_chatter_at_debug(), locked_connection(engine, support) as conn:
        for chain, action, revision in steps:
            started = time.perf_counter()
            before = describe_revision(conn, current_revision(conn, chain), chain)
            _alembic_command(action)(_chain_config(conn, chain), revision)
            after = describe_revision(conn, current_revision(conn, chain), chain)
            if after != before:
                moved.append((chain, action, before, after, time.perf_counter() - started))
    for chain, action, before, after, seconds in moved:
        where = "" if chain.is_core else f" ({chain.label})"
        head = " (head)" if after == head_revision(chain) else ""
        logger.info(
            "%s %s%s from %s to %s%s in %.2f s",
            _VERBS[action], _database(engine), where, before, after, head, seconds,
        )


def upgrade(
    engine: Engine, revision: str = "head", chain: str | MigrationChain | None = None
) -> None:
    """Upgrade under the migration lock.

    Without ``chain``, ``head`` moves the core chain then every plugin chain
    that applies, another revision the core chain only; with ``chain``
    (``"core"`` or a plugin's name) only that chain moves.
    """
    _move(engine, "upgrade", revision, chain, every_chain=revision == "head")


def downgrade(engine: Engine, revision: str, chain: str | MigrationChain | None = None) -> None:
    """Downgrade under the migration lock.

    Without ``chain``, ``base`` moves every plugin chain then the core chain
    (dropping all tables), another revision the core chain only.
    """
    _move(engine, "downgrade", revision, chain, every_chain=revision == "base")


def _move(
    engine: Engine,
    action: str,
    revision: str,
    chain: str | MigrationChain | None,
    *,
    every_chain: bool,
) -> None:
    """Refuse if any chain's database is ahead of the code, then move them all in one run."""
    if chain is None and every_chain:
        chains = chains_for(engine.dialect.name)
        if action == "downgrade":
            chains.reverse()  # plugin chains first: their tables may refer to the core's
    else:
        chains = [_chain_named(engine, chain)]
    for status in chain_status(engine, chains):
        check_not_ahead(status.current, status.chain)
    _run(engine, [(item, action, revision) for item in chains])


def _chain_named(engine: Engine, chain: str | MigrationChain | None) -> MigrationChain:
    if isinstance(chain, MigrationChain):
        return chain
    return find_chain(CORE_CHAIN if chain is None else chain, engine.dialect.name)


def stamp(engine: Engine, revision: str, chain: str | MigrationChain | None = None) -> None:
    """Record ``revision`` of the core chain (or ``chain``) as current without migrating."""
    _run(engine, [(_chain_named(engine, chain), "stamp", revision)])


@dataclass(frozen=True)
class Revision:
    """One step of a migration chain."""

    revision: str
    down_revision: str | None
    doc: str
    is_head: bool
    chain: str = CORE_CHAIN


def history(chain: MigrationChain | None = None) -> list[Revision]:
    """A migration chain (the core's by default), oldest first."""
    target = chain or core_chain()
    return [
        Revision(
            revision=rev.revision,
            down_revision=rev.down_revision if isinstance(rev.down_revision, str) else None,
            doc=(rev.doc or "").strip(),
            is_head=rev.is_head,
            chain=target.name,
        )
        for rev in reversed(list(_script(target).walk_revisions()))
    ]


def drift(engine: Engine, chain: MigrationChain | None = None) -> list[str]:
    """Differences between the models and the schema (default: every chain that applies)."""
    chains = [chain] if chain is not None else chains_for(engine.dialect.name)
    found: list[str] = []
    with alembic_chatter_at_debug(), engine.connect() as conn:
        from alembic.autogenerate import compare_metadata
        from alembic.runtime.migration import MigrationContext

        for item in chains:
            options = _context_options(conn.dialect.name, item.target_metadata, item.version_table)
            context = MigrationContext.configure(conn, opts=options)
            prefix = "" if item.is_core or chain is not None else f"plugin {item.name}: "
            found += [
                prefix + _describe_diff(diff)
                for diff in compare_metadata(context, item.target_metadata)
            ]
    return found


def _describe_diff(diff: Any) -> str:
    if isinstance(diff, list):
        return "; ".join(_describe_diff(d) for d in diff)
    kind, *rest = diff
    names = [getattr(item, "name", None) or item for item in rest[:3] if item is not None]
    return f"{kind}: {', '.join(str(n) for n in names)}"
