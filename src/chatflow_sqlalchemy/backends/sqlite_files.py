"""SQLite files: which URL names which file, and how a new one is made private.

Kept apart from the SQLite store so that tools which only look at a database
file (the CLI's read commands) need neither the store nor chatflow-agent.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from urllib.parse import unquote

from sqlalchemy import URL

__all__ = [
    "BUSY_TIMEOUT_MS",
    "PRIVATE_DIRECTORY_MODE",
    "PRIVATE_FILE_MODE",
    "create_private_database_file",
    "database_file",
    "is_ephemeral_sqlite",
    "make_private_directories",
]

BUSY_TIMEOUT_MS = 30_000
"""How long a writer waits for another connection's write lock before failing."""

PRIVATE_FILE_MODE = 0o600
"""Mode of a database file the store creates (SQLite gives ``-wal``/``-shm`` the same)."""

PRIVATE_DIRECTORY_MODE = 0o700
"""Mode of the directories ``SQLiteSessionStore`` creates for its database file."""


def is_ephemeral_sqlite(url: URL) -> bool:
    """True for ``:memory:``, ``file::memory:...`` and any ``mode=memory`` URI."""
    database = url.database or ""
    if database in ("", ":memory:"):
        return True
    if database.startswith("file:"):
        mode = url.query.get("mode")
        return database.startswith("file::memory:") or mode == "memory" or "mode=memory" in database
    return False


def database_file(url: URL) -> Path | None:
    """The file an SQLite URL opens (plain path or ``file:`` URI), None when in memory."""
    if is_ephemeral_sqlite(url):
        return None
    database = url.database or ""
    if database.startswith("file:"):
        if url.query.get("mode") == "ro" or "mode=ro" in database:
            return None
        path = unquote(database[len("file:"):].split("?", 1)[0])
        if path.startswith("//"):  # file://host/path: only the local host is meaningful
            path = "/" + path[2:].split("/", 1)[-1]
        return Path(path) if path else None
    return Path(database)


def create_private_database_file(url: URL) -> None:
    """Create a missing database file readable by its owner only (0600).

    SQLite would create it following the umask (0644 under the usual 022:
    every local user could read every conversation), and gives its ``-wal``
    and ``-shm`` files the main file's permissions. An existing file keeps
    its mode: to share a database with a group, create the file with the
    mode wanted (an empty file is an empty database) before opening it.
    """
    path = database_file(url)
    if path is None or path.exists():
        return
    with contextlib.suppress(FileExistsError, FileNotFoundError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE))


def make_private_directories(directory: Path) -> None:
    """Create ``directory`` and its missing parents with mode 0700; existing ones are kept."""
    missing = [p for p in (directory, *directory.parents) if not p.exists()]
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=PRIVATE_DIRECTORY_MODE)
