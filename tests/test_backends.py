"""What each built-in backend sets up underneath: SQLite pragmas, Postgres drift checks."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import pytest
from sqlalchemy import text

from chatflow_sqlalchemy import SQLiteSessionStore, open_store
from chatflow_sqlalchemy.backends.sqlite import BUSY_TIMEOUT_MS
from chatflow_sqlalchemy.cli import main

from . import pg_util


def test_sqlite_file_connections_are_configured(tmp_path: Path) -> None:
    store = SQLiteSessionStore(tmp_path / "p.db")
    try:
        with store.engine.connect() as conn:
            pragmas = {
                name: conn.execute(text(f"PRAGMA {name}")).scalar()
                for name in ("journal_mode", "synchronous", "busy_timeout", "foreign_keys")
            }
            conn.rollback()
    finally:
        store.close()
    assert pragmas == {
        "journal_mode": "wal",
        "synchronous": 1,  # NORMAL
        "busy_timeout": BUSY_TIMEOUT_MS,
        "foreign_keys": 1,
    }


def test_sqlite_memory_enforces_foreign_keys_too() -> None:
    store = SQLiteSessionStore(":memory:")
    try:
        with store.engine.connect() as conn:
            assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
            conn.rollback()
    finally:
        store.close()


def test_open_store_maps_postgres_urls_to_psycopg() -> None:
    from chatflow_sqlalchemy.backends.postgresql import psycopg_url

    assert psycopg_url("postgresql://u@h/db").drivername == "postgresql+psycopg"
    assert psycopg_url("postgres://u@h/db").drivername == "postgresql+psycopg"
    assert psycopg_url("postgresql+psycopg://u@h/db").drivername == "postgresql+psycopg"


@pytest.mark.postgres
def test_db_check_reports_drift_on_postgres(capsys: pytest.CaptureFixture[str]) -> None:
    url = pg_util.postgres_url()
    with pg_util.fresh_schema(url) as schema:
        scoped = f"{url}?options={quote(f'-csearch_path={schema}')}"
        store = open_store(scoped)
        store.close()
        assert main(["--url", scoped, "db", "check"]) == 0
        engine = pg_util.schema_engine(url, schema)
        try:
            with engine.begin() as conn:
                conn.execute(text("DROP INDEX ix_chatflow_sessions_updated_at"))
        finally:
            engine.dispose()
        capsys.readouterr()
        assert main(["--url", scoped, "db", "check"]) == 1
        assert "ix_chatflow_sessions_updated_at" in capsys.readouterr().out


def test_an_autocommit_engine_is_refused_with_the_fix(tmp_path: Path) -> None:
    """A turn is one transaction: an engine that autocommits every statement cannot hold it."""
    from sqlalchemy import create_engine

    from chatflow_sqlalchemy import SQLAlchemySessionStore

    engine = create_engine(f"sqlite:///{tmp_path / 'a.db'}")
    try:
        with pytest.raises(ValueError, match="without it"):
            SQLAlchemySessionStore(engine=engine.execution_options(isolation_level="AUTOCOMMIT"))
    finally:
        engine.dispose()


def test_two_stores_share_one_sqlite_engine(tmp_path: Path) -> None:
    """The engine is prepared once: a second store must not add a second BEGIN hook."""
    from chatflow_agent import Agent, Message, Role
    from sqlalchemy import create_engine

    from chatflow_sqlalchemy import SQLAlchemySessionStore

    engine = create_engine(f"sqlite:///{tmp_path / 'shared.db'}")
    agent = Agent(name="Bot", instructions="")
    try:
        with SQLAlchemySessionStore(engine=engine) as one, \
                SQLAlchemySessionStore(engine=engine) as two:
            one.get_or_create("a", agent).add_message(Message(role=Role.USER, content="1"))
            two.get_or_create("b", agent).add_message(Message(role=Role.USER, content="2"))
            assert one.record_processed_message("m") and not two.record_processed_message("m")
            assert sorted(two.list_sessions()) == ["a", "b"]
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_postgres_store_refuses_isolation_level_autocommit(pg_url: str, pg_schema: str) -> None:
    from chatflow_sqlalchemy import PostgresSessionStore

    with pytest.raises(ValueError, match="autocommit"):
        PostgresSessionStore(
            pg_url,
            isolation_level="AUTOCOMMIT",
            connect_args=pg_util.schema_connect_args(pg_schema),
        )
