"""What opening a store may do: auto-migration on or off, what it logs, nothing left behind.

* ``CHATFLOW_AUTO_MIGRATE`` and the stores' ``auto_migrate=`` argument;
* a refusal raises ``SchemaError`` naming ``chatflow-sqlalchemy db upgrade`` and
  creates no file, directory, table or schema;
* a store that migrates logs one INFO line on ``chatflow_sqlalchemy`` (from, to,
  which database without its password, how long), and Alembic's INFO lines
  are not passed on at INFO.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest
import sqlalchemy as sa

from chatflow_sqlalchemy import SQLAlchemySessionStore, SQLiteSessionStore, migrate
from chatflow_sqlalchemy.exceptions import SchemaError

from . import pg_util

HEAD = migrate.head_revision()


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(migrate.AUTO_MIGRATE_ENV, raising=False)


def upstream_file(path: Path) -> Path:
    """A chatflow-agent 0.3.4 database, as upstream's own store writes it."""
    from chatflow_agent import Agent
    from chatflow_agent import SQLiteSessionStore as UpstreamStore

    store = UpstreamStore(str(path))
    store.get_or_create("s1", Agent(name="Bot", instructions=""))
    if hasattr(store, "close"):
        store.close()
    return path


# --------------------------------------------------------------------------- the variable


@pytest.mark.parametrize("value", ["0", "false", "FALSE", "No", "off", " Off "])
def test_env_words_that_turn_auto_migrate_off(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(migrate.AUTO_MIGRATE_ENV, value)
    assert migrate.auto_migrate_enabled() is False


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "Yes", "on", ""])
def test_env_words_that_keep_auto_migrate_on(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(migrate.AUTO_MIGRATE_ENV, value)
    assert migrate.auto_migrate_enabled() is True


def test_env_unset_means_on() -> None:
    assert migrate.auto_migrate_enabled() is True


@pytest.mark.parametrize("value", ["2", "nope", "disabled", "f"])
def test_env_other_words_are_a_clear_error(
    value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(migrate.AUTO_MIGRATE_ENV, value)
    with pytest.raises(ValueError, match=r"CHATFLOW_AUTO_MIGRATE=.*0, false, no or off"):
        SQLiteSessionStore(tmp_path / "new" / "x.db")
    assert not (tmp_path / "new").exists()


def test_argument_wins_over_the_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(migrate.AUTO_MIGRATE_ENV, "off")
    with SQLiteSessionStore(tmp_path / "x.db", auto_migrate=True) as store:
        assert store.list_sessions() == []
    monkeypatch.setenv(migrate.AUTO_MIGRATE_ENV, "on")
    with pytest.raises(SchemaError):
        SQLiteSessionStore(tmp_path / "y.db", auto_migrate=False)


def test_sqlite_store_arguments_stay_strict(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        SQLiteSessionStore(tmp_path / "x.db", busy_timeout=5)  # type: ignore[call-arg]
    with pytest.raises(TypeError):  # keyword-only: a fourth positional is a mistake
        SQLiteSessionStore(tmp_path / "x.db", 40, 192, False)  # type: ignore[misc]
    with pytest.raises(TypeError, match="auto_migrate must be"):
        SQLiteSessionStore(tmp_path / "x.db", auto_migrate="no")  # type: ignore[arg-type]
    assert not (tmp_path / "x.db").exists()


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("how", ["argument", "env"])
def test_refusal_on_a_missing_sqlite_file_creates_nothing(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "new" / "dir" / "x.db"
    kwargs = {"auto_migrate": False} if how == "argument" else {}
    if how == "env":
        monkeypatch.setenv(migrate.AUTO_MIGRATE_ENV, "false")
    with pytest.raises(SchemaError, match="chatflow-sqlalchemy db upgrade") as caught:
        SQLiteSessionStore(target, **kwargs)
    assert str(target) in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_refusal_through_the_generic_store_creates_no_file(tmp_path: Path) -> None:
    target = tmp_path / "x.db"
    with pytest.raises(SchemaError, match="chatflow-sqlalchemy db upgrade"):
        SQLAlchemySessionStore(f"sqlite:///{target}", auto_migrate=False)
    assert list(tmp_path.iterdir()) == []


def test_refusal_on_upstream_tables_names_them_and_changes_nothing(tmp_path: Path) -> None:
    db = upstream_file(tmp_path / "upstream.db")
    before = _dump(db)
    with pytest.raises(SchemaError, match="chatflow-sqlalchemy db upgrade") as caught:
        SQLiteSessionStore(db, auto_migrate=False)
    assert migrate.UPSTREAM_TABLES in str(caught.value)
    assert (caught.value.found, caught.value.expected) == (None, HEAD)
    assert _dump(db) == before
    with SQLiteSessionStore(db, auto_migrate=True) as store:
        assert store.list_sessions() == ["s1"]
    with SQLiteSessionStore(db, auto_migrate=False) as store:  # at head: nothing to refuse
        assert store.list_sessions() == ["s1"]


def test_refusal_on_an_old_revision_names_it(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    engine = migrate.open_engine(f"sqlite:///{db}")
    try:
        migrate.upgrade(engine, migrate.BASELINE_REVISION)
    finally:
        engine.dispose()
    with pytest.raises(SchemaError, match=f"revision {migrate.BASELINE_REVISION}; .* {HEAD}"):
        SQLiteSessionStore(db, auto_migrate=False)


@pytest.mark.postgres
def test_postgres_refusal_leaves_the_schema_empty(pg_url: str, pg_schema: str) -> None:
    from chatflow_sqlalchemy import PostgresSessionStore

    args = pg_util.schema_connect_args(pg_schema)
    with pytest.raises(SchemaError, match="chatflow-sqlalchemy db upgrade") as caught:
        PostgresSessionStore(pg_url, auto_migrate=False, connect_args=args)
    assert migrate.EMPTY_DATABASE in str(caught.value)
    engine = sa.create_engine(pg_url, connect_args=args)
    try:
        assert sa.inspect(engine).get_table_names(schema=pg_schema) == []
    finally:
        engine.dispose()
    with PostgresSessionStore(pg_url, auto_migrate=True, connect_args=args) as store:
        assert store.list_sessions() == []


def _dump(db: Path) -> list[str]:
    conn = sqlite3.connect(db)
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


# --------------------------------------------------------------------------- logging


def _info_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.INFO]


def test_opening_a_new_store_logs_one_line_and_no_alembic_info(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    db = tmp_path / "x.db"
    with SQLiteSessionStore(db):
        pass
    records = _info_records(caplog)
    assert [r.name for r in records] == ["chatflow_sqlalchemy"], [r.getMessage() for r in records]
    message = records[0].getMessage()
    assert f"sqlite:///{db}" in message
    assert f"from {migrate.EMPTY_DATABASE} to {HEAD}" in message
    assert " s" in message.rsplit(" in ", 1)[1]  # a duration
    assert not any(r.name.startswith("alembic") and r.levelno >= logging.INFO
                   for r in caplog.records)

    caplog.clear()
    with SQLiteSessionStore(db):  # at head: nothing migrated, nothing said
        pass
    assert _info_records(caplog) == []


def test_adopting_upstream_tables_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = upstream_file(tmp_path / "upstream.db")
    caplog.set_level(logging.INFO)
    with SQLiteSessionStore(db):
        pass
    (record,) = _info_records(caplog)
    assert f"from {migrate.UPSTREAM_TABLES} to {HEAD}" in record.getMessage()


def test_alembic_info_is_kept_at_debug_only_when_asked_for(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with SQLiteSessionStore(tmp_path / "a.db"):
        pass
    assert not [r for r in caplog.records if r.name.startswith("alembic")]
    caplog.clear()
    caplog.set_level(logging.DEBUG, logger="alembic")
    with SQLiteSessionStore(tmp_path / "b.db"):
        pass
    alembic = [r for r in caplog.records if r.name.startswith("alembic")]
    assert alembic and {r.levelno for r in alembic} == {logging.DEBUG}
    assert any("Running upgrade" in r.getMessage() for r in alembic)


def test_an_applications_own_alembic_logging_is_untouched(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    with SQLiteSessionStore(":memory:"):
        pass
    caplog.clear()
    engine = sa.create_engine("sqlite://")
    try:
        with engine.connect() as conn:
            from alembic.runtime.migration import MigrationContext

            MigrationContext.configure(conn)
    finally:
        engine.dispose()
    assert any(r.name == "alembic.runtime.migration" and r.levelno == logging.INFO
               for r in caplog.records)


@pytest.mark.postgres
def test_postgres_log_line_hides_the_password(
    pg_url: str, pg_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    from chatflow_sqlalchemy import PostgresSessionStore

    url = sa.make_url(pg_url).set(password="s3cret-pw")  # trust auth ignores it
    caplog.set_level(logging.INFO)
    with PostgresSessionStore(url, connect_args=pg_util.schema_connect_args(pg_schema)):
        pass
    (record,) = _info_records(caplog)
    assert "s3cret-pw" not in record.getMessage()
    assert "***" in record.getMessage()
    assert f"from {migrate.EMPTY_DATABASE} to {HEAD}" in record.getMessage()


def test_open_store_passes_auto_migrate_through(tmp_path: Path) -> None:
    from chatflow_sqlalchemy import open_store

    with pytest.raises(SchemaError, match="chatflow-sqlalchemy db upgrade"):
        open_store(f"sqlite:///{tmp_path / 'new' / 'x.db'}", auto_migrate=False)
    assert list(tmp_path.iterdir()) == []
    with open_store(f"sqlite:///{tmp_path / 'y.db'}", auto_migrate=True) as store:
        assert store.auto_migrate is True
