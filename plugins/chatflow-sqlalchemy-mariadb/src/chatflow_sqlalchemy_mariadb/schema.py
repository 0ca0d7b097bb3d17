"""The plugin's own table and migration chain (import-light: no database driver).

``chatflow_mariadb_info`` is a small key/value table the plugin's chain
creates next to the core tables, in its own version table
``chatflow_mariadb_alembic_version``. It records what the backend chose when
it created the schema (the server version and the collation of the id
columns), which ``MariaDBSessionStore.backend_info()`` reads back. It is
also the worked example of a plugin shipping migrations (see
``docs/plugin-authors.md``).

The entry point ``chatflow_sqlalchemy.migrations: mariadb`` names
:data:`MIGRATIONS`; this module must stay importable without PyMySQL so that
``chatflow-sqlalchemy db`` commands on other databases never depend on it.
"""

from __future__ import annotations

from chatflow_sqlalchemy.backend import NAMING_CONVENTION, MigrationChain, UTCDateTime
from sqlalchemy import Column, MetaData, String, Table

__all__ = ["DIALECTS", "INFO_TABLE", "MIGRATIONS", "VERSION_TABLE", "info", "metadata"]

DIALECTS = frozenset({"mysql", "mariadb"})
"""SQLAlchemy dialect names this backend serves (``mariadb+pymysql://`` is ``mariadb``)."""

INFO_TABLE = "chatflow_mariadb_info"
VERSION_TABLE = "chatflow_mariadb_alembic_version"

metadata = MetaData(naming_convention=NAMING_CONVENTION)

info = Table(
    INFO_TABLE,
    metadata,
    Column("name", String(64), primary_key=True),
    Column("value", String(255), nullable=False),
    Column("recorded_at", UTCDateTime, nullable=False),
)
"""``name`` → ``value`` facts the backend recorded about its schema."""

MIGRATIONS = MigrationChain(
    script_location="chatflow_sqlalchemy_mariadb:migrations",
    version_table=VERSION_TABLE,
    target_metadata=metadata,
    dialects=DIALECTS,
)
"""The chain ``chatflow-sqlalchemy db upgrade`` runs after the core chain on MySQL/MariaDB."""
