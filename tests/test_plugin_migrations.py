"""Plugin migration chains (issue 6, part 3), with simulated installed plugins.

A fake plugin distribution (a ``*.dist-info`` folder on ``sys.path``, see
``fake_dists``) declares an Alembic chain in the entry-point group
``chatflow_sqlalchemy.migrations``: its own tables, its own version table.
Proven here, on SQLite files and PostgreSQL:

* opening a store and ``chatflow-sqlalchemy db upgrade`` run the core chain
  and then the plugin's; ``db current`` / ``db check`` / ``db history --all``
  report it; ``db downgrade base`` removes the plugin's tables first;
* a chain applies only to the dialects it names;
* a plugin table or version table colliding with the core (or another
  plugin) is rejected, naming the plugin and the table, and nothing runs;
* a plugin that cannot be loaded, or whose database revision is newer than
  its code, gets a clear error; a failing plugin migration on SQLite leaves
  no core table behind either (one transaction).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa

from chatflow_sqlalchemy import SchemaAheadError, SchemaError, migrate
from chatflow_sqlalchemy.backends.postgresql import PostgresSessionStore
from chatflow_sqlalchemy.backends.sqlite import SQLiteSessionStore
from chatflow_sqlalchemy.cli import main
from chatflow_sqlalchemy.migrate import MIGRATIONS_ENTRY_POINT_GROUP, MigrationPluginError
from tests.fake_dists import unique_module, write_dist, write_module
from tests.pg_util import fresh_schema, postgres_url, schema_connect_args, schema_engine

CORE_TABLES = {"chatflow_sessions", "chatflow_messages", "chatflow_processed_messages"}

CHAIN_MODULE = """
import sqlalchemy as sa
from chatflow_sqlalchemy.migrate import MigrationChain

metadata = sa.MetaData()
{tables}

CHAIN = MigrationChain(
    script_location={location!r},
    version_table={version_table!r},
    target_metadata=metadata,
    dialects={dialects!r},
)
"""

TABLE = """
sa.Table(
    {name!r},
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("note", sa.String(100), nullable=False),
)
"""

REVISION = '''
"""{doc}

Revision ID: {rev}
Revises: {down}
"""
import sqlalchemy as sa
from alembic import op

revision = {rev!r}
down_revision = {down!r}
branch_labels = None
depends_on = None


def upgrade():
{upgrade}


def downgrade():
{downgrade}
'''


@dataclass
class FakePlugin:
    name: str
    dist: str
    module: str
    tables: list[str]
    version_table: str


class PluginSite:
    """Fake plugin distributions in one folder on ``sys.path``."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        monkeypatch.syspath_prepend(str(root))

    def add(
        self,
        name: str = "audit",
        *,
        dist: str = "chatflow-sqlalchemy-audit",
        tables: list[str] | None = None,
        version_table: str | None = None,
        dialects: set[str] | None = None,
        fail_in_migration: bool = False,
        broken_module: bool = False,
    ) -> FakePlugin:
        module = unique_module(name)
        tables = tables if tables is not None else [f"{name}_log"]
        version_table = version_table or f"{name}_alembic_version"
        source = CHAIN_MODULE.format(
            tables="".join(TABLE.format(name=t) for t in tables),
            location=f"{module}:migrations",
            version_table=version_table,
            dialects=dialects,
        )
        if broken_module:
            source = "raise ImportError('the chain module is broken')\n"
        write_module(self.root, f"{module}.__init__", source)
        versions = self.root / module / "migrations" / "versions"
        versions.mkdir(parents=True)
        first = tables[0] if tables else f"{name}_log"
        create = "\n".join(
            f"    op.create_table({t!r}, sa.Column('id', sa.Integer, primary_key=True), "
            f"sa.Column('note', sa.String(100), nullable=False))"
            for t in tables
        ) or "    pass"
        drop = "\n".join(f"    op.drop_table({t!r})" for t in reversed(tables)) or "    pass"
        (versions / "a001_tables.py").write_text(
            REVISION.format(doc="create the plugin's tables", rev="a001", down=None,
                            upgrade=create, downgrade=drop)
        )
        second = f"    op.execute(\"INSERT INTO {first} (id, note) VALUES (1, 'installed')\")"
        if fail_in_migration:
            second += "\n    raise RuntimeError('plugin migration failed half-way')"
        (versions / "a002_seed.py").write_text(
            REVISION.format(doc="seed a row", rev="a002", down="a001", upgrade=second,
                            downgrade=f"    op.execute('DELETE FROM {first}')")
        )
        write_dist(
            self.root, dist, {MIGRATIONS_ENTRY_POINT_GROUP: {name: f"{module}:CHAIN"}}
        )
        return FakePlugin(name, dist, module, tables, version_table)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PluginSite:
    return PluginSite(tmp_path / "site", monkeypatch)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def tables_of(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    return {row[0] for row in rows}


def version_of(path: Path, table: str) -> str | None:
    with sqlite3.connect(path) as conn:
        row = conn.execute(f"SELECT version_num FROM {table}").fetchone()
    return row[0] if row else None


# --------------------------------------------------------------------------- SQLite


def test_store_open_runs_core_then_plugin_chain(site: PluginSite, tmp_path: Path) -> None:
    plugin = site.add()
    path = tmp_path / "chat.db"
    store = SQLiteSessionStore(str(path))
    try:
        assert migrate.drift(store.engine) == []
        statuses = {s.chain.name: s for s in migrate.chain_status(store.engine)}
        assert set(statuses) == {"core", "audit"}
        assert all(s.at_head for s in statuses.values())
    finally:
        store.close()
    assert tables_of(path) >= CORE_TABLES | {"audit_log", plugin.version_table}
    assert "alembic_version" not in tables_of(path)
    assert version_of(path, "chatflow_alembic_version") == migrate.head_revision()
    assert version_of(path, plugin.version_table) == "a002"
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT note FROM audit_log").fetchall() == [("installed",)]
    # a second open finds everything at head and runs nothing
    SQLiteSessionStore(str(path)).close()
    assert version_of(path, plugin.version_table) == "a002"


def test_db_commands_run_and_report_plugin_chains(
    site: PluginSite, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    site.add()
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    code, out, err = run(capsys, "--url", url, "db", "upgrade")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert f"to {migrate.head_revision()} (head)" in lines[0]
    assert "plugin audit: upgraded from none to a002 (head)" in lines[1]

    code, out, _ = run(capsys, "--url", url, "db", "current")
    assert code == 0
    assert "plugin audit (chatflow-sqlalchemy-audit 1.0): a002 (head)" in out

    code, out, _ = run(capsys, "--url", url, "db", "check")
    assert code == 0, out
    assert "plugin audit at a002 (head)" in out

    code, out, _ = run(capsys, "db", "history", "--all")
    assert "plugin audit (chatflow-sqlalchemy-audit 1.0; version table audit_alembic_version" in out
    assert "a001 -> a002 (head): seed a row" in out
    code, out, _ = run(capsys, "db", "history", "--chain", "audit")
    assert out.strip().splitlines() == [
        "a001 -> a002 (head): seed a row",
        "<base> -> a001: create the plugin's tables",
    ]

    # one chain at a time
    code, out, _ = run(capsys, "--url", url, "db", "downgrade", "a001", "--chain", "audit", "--yes")
    assert code == 0
    assert "plugin audit: downgraded from a002 to a001" in out
    code, out, _ = run(capsys, "--url", url, "db", "check")
    assert code == 1
    assert "behind" in out and "plugin audit is at revision a001" in out
    code, out, _ = run(capsys, "--url", url, "db", "current")
    assert "plugin audit (chatflow-sqlalchemy-audit 1.0): a001; head is a002" in out
    assert "run: chatflow-sqlalchemy db upgrade" in out
    code, out, _ = run(capsys, "--url", url, "db", "upgrade")
    assert code == 0
    assert "plugin audit: upgraded from a001 to a002 (head)" in out
    assert "already at revision" in out.splitlines()[0]

    code, out, _ = run(capsys, "--url", url, "db", "stamp", "a001", "--chain", "audit")
    assert code == 0 and "plugin audit: stamped revision a001 (was a002)" in out
    run(capsys, "--url", url, "db", "stamp", "a002", "--chain", "audit")

    # base takes the plugin's tables away first, then the core's
    code, out, _ = run(capsys, "--url", url, "db", "downgrade", "base", "--yes")
    assert code == 0
    lines = out.strip().splitlines()
    assert "plugin audit: downgraded from a002 to none" in lines[0]
    assert "downgraded from" in lines[1] and "plugin" not in lines[1]
    path = tmp_path / "cli.db"
    assert not tables_of(path) & (CORE_TABLES | {"audit_log"})

    code, out, err = run(capsys, "--url", url, "db", "upgrade", "--chain", "nosuch")
    assert code == 2
    assert "no migration chain named 'nosuch'" in err and "audit" in err


def test_chain_applies_only_to_its_dialects(site: PluginSite, tmp_path: Path) -> None:
    site.add("pgonly", dist="pg-only-plugin", dialects={"postgresql"})
    path = tmp_path / "chat.db"
    SQLiteSessionStore(str(path)).close()
    assert "pgonly_log" not in tables_of(path)
    assert [c.name for c in migrate.chains_for("sqlite")] == ["core"]
    assert [c.name for c in migrate.chains_for("postgresql")] == ["core", "pgonly"]
    with pytest.raises(MigrationPluginError, match="does not apply to sqlite"):
        migrate.upgrade(migrate.open_engine(f"sqlite:///{path}"), "head", "pgonly")


@pytest.mark.parametrize(
    ("tables", "version_table", "culprit"),
    [
        (["audit_log", "chatflow_sessions"], None, "chatflow_sessions"),
        (["chatflow_messages"], None, "chatflow_messages"),
        (["audit_log"], "chatflow_alembic_version", "chatflow_alembic_version"),
        (["audit_log"], "alembic_version", "alembic_version"),
        (["audit_log"], "audit_log", "audit_log"),
    ],
)
def test_collision_with_the_core_is_rejected(
    site: PluginSite,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    tables: list[str],
    version_table: str | None,
    culprit: str,
) -> None:
    site.add(tables=tables, version_table=version_table)
    path = tmp_path / "chat.db"
    with pytest.raises(MigrationPluginError) as info:
        SQLiteSessionStore(str(path))
    message = str(info.value)
    assert "'audit'" in message and "chatflow-sqlalchemy-audit 1.0" in message
    assert repr(culprit) in message
    assert "Nothing was migrated" in message
    assert not tables_of(path), "nothing may run when a plugin is rejected"
    code, _, err = run(capsys, "--url", f"sqlite:///{path}", "db", "upgrade")
    assert code == 2
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert culprit in err and "audit" in err


def test_two_plugins_claiming_one_table_are_rejected(site: PluginSite, tmp_path: Path) -> None:
    site.add("first", dist="first-plugin", tables=["shared_table"])
    site.add("second", dist="second-plugin", tables=["shared_table"])
    with pytest.raises(MigrationPluginError) as info:
        SQLiteSessionStore(str(tmp_path / "chat.db"))
    message = str(info.value)
    assert "shared_table" in message
    assert "first-plugin" in message and "second-plugin" in message


def test_plugin_that_cannot_load_is_named(site: PluginSite, tmp_path: Path) -> None:
    site.add(broken_module=True)
    with pytest.raises(MigrationPluginError) as info:
        SQLiteSessionStore(str(tmp_path / "chat.db"))
    assert "'audit'" in str(info.value) and "the chain module is broken" in str(info.value)
    assert "chatflow-sqlalchemy-audit" in str(info.value)


def test_failed_plugin_migration_leaves_nothing_on_sqlite(
    site: PluginSite, tmp_path: Path
) -> None:
    site.add(fail_in_migration=True)
    path = tmp_path / "chat.db"
    with pytest.raises(RuntimeError, match="plugin migration failed half-way"):
        SQLiteSessionStore(str(path))
    assert not tables_of(path), "core and plugin chains run in one transaction"


def test_plugin_schema_ahead_or_behind(
    site: PluginSite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin = site.add()
    path = tmp_path / "chat.db"
    SQLiteSessionStore(str(path)).close()
    with sqlite3.connect(path) as conn:
        conn.execute(f"UPDATE {plugin.version_table} SET version_num = 'a999'")
    with pytest.raises(SchemaAheadError) as ahead:
        SQLiteSessionStore(str(path))
    assert "a999" in str(ahead.value) and "'audit'" in str(ahead.value)
    assert "pip install -U chatflow-sqlalchemy-audit" in str(ahead.value)
    with sqlite3.connect(path) as conn:
        conn.execute(f"UPDATE {plugin.version_table} SET version_num = 'a002'")
    engine = migrate.open_engine(f"sqlite:///{path}")
    try:
        migrate.downgrade(engine, "a001", "audit")
    finally:
        engine.dispose()
    monkeypatch.setenv("CHATFLOW_AUTO_MIGRATE", "0")
    with pytest.raises(SchemaError) as behind:
        SQLiteSessionStore(str(path))
    assert "a001" in str(behind.value) and "a002" in str(behind.value)
    assert "chatflow-sqlalchemy db upgrade" in str(behind.value)
    monkeypatch.setenv("CHATFLOW_AUTO_MIGRATE", "1")
    SQLiteSessionStore(str(path)).close()
    assert version_of(path, plugin.version_table) == "a002"


def test_plugin_drift_is_reported(
    site: PluginSite, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    site.add()
    path = tmp_path / "chat.db"
    SQLiteSessionStore(str(path)).close()
    with sqlite3.connect(path) as conn:
        conn.execute("ALTER TABLE audit_log ADD COLUMN extra TEXT")
    code, out, _ = run(capsys, "--url", f"sqlite:///{path}", "db", "check")
    assert code == 1
    assert "plugin audit: remove_column" in out and "extra" in out


def test_script_location_may_be_a_path(site: PluginSite, tmp_path: Path) -> None:
    plugin = site.add()
    chain = migrate.find_chain("audit")
    as_path = migrate.MigrationChain(
        script_location=str(site.root / plugin.module / "migrations"),
        version_table="other_version",
        target_metadata=sa.MetaData(),
        name="by_path",
    )
    assert as_path.directory() == chain.directory()
    assert [r.revision for r in migrate.history(as_path)] == ["a001", "a002"]


@pytest.mark.parametrize("folder", ["app:v2", "100% done", "a b:c%d"])
def test_plugin_installed_under_any_folder_name_migrates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folder: str
) -> None:
    """":" (the OS path separator), "%" (configparser) and spaces in the plugin's path."""
    site = PluginSite(tmp_path / folder, monkeypatch)
    plugin = site.add()
    chain = migrate.find_chain("audit")
    path = tmp_path / "chat.db"
    SQLiteSessionStore(str(path)).close()
    assert version_of(path, plugin.version_table) == "a002"
    assert "audit_log" in tables_of(path)
    engine = sa.create_engine(f"sqlite:///{path}")
    try:
        migrate.downgrade(engine, "base", chain=chain)
        assert version_of(path, plugin.version_table) is None
        assert "audit_log" not in tables_of(path)
        migrate.stamp(engine, "a001", chain=chain)
        assert version_of(path, plugin.version_table) == "a001"
    finally:
        engine.dispose()


# --------------------------------------------------------------------------- PostgreSQL


@pytest.mark.postgres
def test_postgres_runs_both_chains(site: PluginSite, capsys: pytest.CaptureFixture[str]) -> None:
    url = postgres_url()
    site.add("pgaudit", dist="pg-audit-plugin", dialects={"postgresql"})
    with fresh_schema(url) as schema:
        store = PostgresSessionStore(url, connect_args=schema_connect_args(schema))
        try:
            assert migrate.drift(store.engine) == []
        finally:
            store.close()
        engine = schema_engine(url, schema)
        try:
            names = set(sa.inspect(engine).get_table_names())
            assert names >= CORE_TABLES | {"pgaudit_log", "pgaudit_alembic_version"}
            with engine.connect() as conn:
                assert conn.execute(sa.text("SELECT note FROM pgaudit_log")).scalar() == "installed"
            migrate.downgrade(engine, "base")
            assert not set(sa.inspect(engine).get_table_names()) & (CORE_TABLES | {"pgaudit_log"})
            migrate.upgrade(engine)
            assert {s.chain.name: s.current for s in migrate.chain_status(engine)} == {
                "core": migrate.head_revision(),
                "pgaudit": "a002",
            }
        finally:
            engine.dispose()


@pytest.mark.postgres
def test_postgres_failed_plugin_migration_rolls_back_everything(site: PluginSite) -> None:
    url = postgres_url()
    site.add("pgfail", dist="pg-fail-plugin", fail_in_migration=True)
    with fresh_schema(url) as schema:
        with pytest.raises(RuntimeError, match="half-way"):
            PostgresSessionStore(url, connect_args=schema_connect_args(schema))
        engine = schema_engine(url, schema)
        try:
            assert sa.inspect(engine).get_table_names() == []
        finally:
            engine.dispose()
