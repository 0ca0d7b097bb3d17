"""Every entry point refuses a URL it cannot mean, with the fix, and creates nothing.

One test per mistake a new user made (issue 28, outcome 1): each used to open the
wrong database, create a stray folder, or fail with a driver's bare error.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from chatflow_agent import Agent

from chatflow_sqlalchemy import (
    BackendNotFoundError,
    DatabaseUnavailableError,
    DatabaseURLError,
    PostgresSessionStore,
    SQLAlchemySessionStore,
    SQLiteSessionStore,
    open_store,
    registry,
)
from chatflow_sqlalchemy.cli import main


@pytest.fixture(autouse=True)
def _in_empty_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CHATFLOW_DATABASE_URL", raising=False)
    return tmp_path


def _refused(error: type[Exception], opener: Any, *args: Any) -> str:
    """Open and expect ``error``; the folder must still be empty."""
    with pytest.raises(error) as info:
        opener(*args).close()
    assert os.listdir(".") == []
    return str(info.value)


def test_two_slashes_are_refused_instead_of_opening_memory() -> None:
    message = _refused(DatabaseURLError, open_store, "sqlite://chat.db")
    assert "'sqlite:///chat.db'" in message and "in-memory" in message
    assert isinstance(DatabaseURLError("x"), ValueError)
    for opener in (SQLAlchemySessionStore, SQLiteSessionStore.from_url):
        assert "two slashes" in _refused(DatabaseURLError, opener, "sqlite://chat.db")


def test_the_cli_refuses_the_same_url(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sessions", "list", "--url", "sqlite://chat.db"]) != 0
    assert "sqlite:///chat.db" in capsys.readouterr().err
    assert os.listdir(".") == []


def test_a_sqlite_url_given_as_a_path_creates_no_folder() -> None:
    message = _refused(DatabaseURLError, SQLiteSessionStore, "sqlite:///chat.db")
    assert "file path" in message and "open_store('sqlite:///chat.db')" in message


def test_another_databases_url_given_to_the_sqlite_store_is_refused() -> None:
    message = _refused(
        DatabaseURLError, SQLiteSessionStore, "postgresql://bot:secret@127.0.0.1/chat"
    )
    assert "open_store(" in message
    assert "secret" not in message


def test_a_bare_path_is_not_a_url() -> None:
    message = _refused(DatabaseURLError, open_store, "chat.db")
    assert "'sqlite:///chat.db'" in message


def test_the_postgresql_store_refuses_a_sqlite_url() -> None:
    message = _refused(DatabaseURLError, PostgresSessionStore, "sqlite:///x.db")
    assert "PostgresSessionStore" in message and "open_store(url)" in message


def test_another_postgresql_driver_is_refused_with_the_psycopg_url() -> None:
    pytest.importorskip("psycopg")
    message = _refused(
        DatabaseURLError, open_store, "postgresql+asyncpg://bot@127.0.0.1/chat"
    )
    assert "'postgresql+psycopg://bot@127.0.0.1/chat'" in message


def test_mysql_without_its_plugin_names_the_real_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "entry_points", lambda group: [])
    message = _refused(BackendNotFoundError, open_store, "mysql+pymysql://bot@127.0.0.1/chat")
    assert "pip install chatflow-sqlalchemy-mariadb" in message
    message = _refused(BackendNotFoundError, open_store, "mariadb+pymysql://bot@127.0.0.1/chat")
    assert "pip install chatflow-sqlalchemy-mariadb" in message


def test_a_web_url_is_not_a_database() -> None:
    message = _refused(BackendNotFoundError, open_store, "http://example.com/chat")
    assert "not a database SQLAlchemy knows" in message
    assert "pip install" not in message


def test_open_store_reads_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CHATFLOW_DATABASE_URL", f"sqlite:///{tmp_path / 'from-env.db'}")
    with open_store() as store:
        store.get_or_create("s", Agent(name="Bot", instructions=""))
    assert (tmp_path / "from-env.db").is_file()


def test_a_folder_that_cannot_be_made_is_a_clear_error() -> None:
    message = _refused(DatabaseUnavailableError, SQLiteSessionStore, "/proc/no/such/chat.db")
    assert "'/proc/no/such'" in message and "writable folder" in message
    message = _refused(DatabaseUnavailableError, open_store, "sqlite:////proc/no/such/chat.db")
    assert "writable folder" in message


def test_an_unreadable_url_hides_its_password() -> None:
    message = _refused(DatabaseURLError, open_store, "postgresql://bot:secret@host:port/chat")
    assert "port is not a number" in message and "secret" not in message
