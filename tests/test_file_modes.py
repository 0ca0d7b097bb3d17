"""SQLite database files are private to their owner (issue 13, item 16)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from chatflow_agent import Agent, Message, Role

from chatflow_sqlalchemy import SQLAlchemySessionStore, SQLiteSessionStore

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The usual umask, under which SQLite alone would create 0644 files."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _write_a_turn(store: SQLAlchemySessionStore) -> None:
    ctx = store.get_or_create("s", Agent(name="Bot", instructions=""))
    ctx.add_message(Message(role=Role.USER, content="private"))


@pytest.mark.usefixtures("umask_022")
def test_new_database_wal_and_shm_are_0600_and_new_directories_0700(tmp_path: Path) -> None:
    db = tmp_path / "new" / "nested" / "chat.db"
    with SQLiteSessionStore(db) as store:
        _write_a_turn(store)
        files = [db, Path(f"{db}-wal"), Path(f"{db}-shm")]
        assert all(f.exists() for f in files), "WAL mode keeps -wal and -shm while open"
        assert {f.name: oct(_mode(f)) for f in files} == {f.name: "0o600" for f in files}
    assert oct(_mode(tmp_path / "new")) == "0o700"
    assert oct(_mode(tmp_path / "new" / "nested")) == "0o700"


@pytest.mark.usefixtures("umask_022")
def test_generic_store_and_uri_create_private_files(tmp_path: Path) -> None:
    for url in (f"sqlite:///{tmp_path}/generic.db", f"sqlite:///file:{tmp_path}/uri.db?uri=true"):
        with SQLAlchemySessionStore(url) as store:
            _write_a_turn(store)
    assert oct(_mode(tmp_path / "generic.db")) == "0o600"
    assert oct(_mode(tmp_path / "uri.db")) == "0o600"


@pytest.mark.usefixtures("umask_022")
def test_an_existing_file_keeps_the_mode_its_owner_gave_it(tmp_path: Path) -> None:
    db = tmp_path / "shared.db"
    db.touch(mode=0o640)
    db.chmod(0o640)
    with SQLiteSessionStore(db) as store:
        _write_a_turn(store)
        assert oct(_mode(Path(f"{db}-wal"))) == "0o640"
    assert oct(_mode(db)) == "0o640"
    existing_dir = tmp_path / "kept"
    existing_dir.mkdir(mode=0o755)
    existing_dir.chmod(0o755)
    with SQLiteSessionStore(existing_dir / "x.db") as store:
        _write_a_turn(store)
    assert oct(_mode(existing_dir)) == "0o755"
