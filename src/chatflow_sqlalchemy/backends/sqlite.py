"""SQLite backend: :class:`SQLiteSessionStore` takes a file path and creates its folder private.

The dialect itself is :class:`~chatflow_sqlalchemy.backends.sqlite_dialect.SQLiteDialectSupport`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import URL, make_url

from chatflow_sqlalchemy.backends.sqlite_dialect import SQLiteDialectSupport
from chatflow_sqlalchemy.backends.sqlite_files import (
    BUSY_TIMEOUT_MS,
    PRIVATE_DIRECTORY_MODE,
    PRIVATE_FILE_MODE,
    create_private_database_file,
    database_file,
    is_ephemeral_sqlite,
    make_private_directories,
)
from chatflow_sqlalchemy.exceptions import DatabaseUnavailableError, DatabaseURLError
from chatflow_sqlalchemy.migrate import auto_migrate_enabled
from chatflow_sqlalchemy.options import SQLStoreKeywords, StoreOptions
from chatflow_sqlalchemy.store import DEFAULT_DEDUP_TTL_HOURS, SQLAlchemySessionStore
from chatflow_sqlalchemy.urls import parse_database_url, quoted_url, require_backend

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "BUSY_TIMEOUT_MS", "PRIVATE_DIRECTORY_MODE", "PRIVATE_FILE_MODE", "SQLiteDialectSupport",
    "SQLiteSessionStore", "create_private_database_file", "database_file", "is_ephemeral_sqlite",
    "make_private_directories", "sqlite_url",
]

_BLOCKING_IO_WORKERS = 4
"""Threads in each on-disk store's private pool for the async API (0.4.0rc1)."""


def sqlite_url(db_path: str | Path) -> URL:
    """Build the SQLAlchemy URL for a path, ``:memory:`` or a ``file:`` URI."""
    path = str(db_path)
    if path.startswith("file:"):
        return make_url(f"sqlite:///{path}").update_query_dict({"uri": "true"})
    return make_url(f"sqlite:///{path}")


def _refuse_url(db_path: str | Path) -> str:
    """``db_path`` as a string; a URL there would become a folder named after it."""
    path = str(db_path)
    if "://" not in path:
        return path
    shown = quoted_url(path)
    if path.startswith("sqlite"):
        fix = f"pass the file's path, or open the URL with open_store({shown})"
    else:
        fix = f"open it with open_store({shown}), which picks the store for its database"
    raise DatabaseURLError(f"SQLiteSessionStore takes a file path, not the URL {shown}: {fix}")


def _make_folder_of(path: Path) -> None:
    try:
        make_private_directories(path.parent)
    except OSError as exc:
        raise DatabaseUnavailableError(
            f"cannot create the folder {str(path.parent)!r} for the SQLite database "
            f"{str(path)!r}: {exc.strerror or exc}; choose a path in a writable folder"
        ) from None


class SQLiteSessionStore(SQLAlchemySessionStore):
    """Session store in an embedded SQLite database: a drop-in for upstream's store.

    Args:
        db_path: File path, ``":memory:"`` or a ``file:`` URI
            (``file::memory:?cache=shared`` and ``mode=memory`` URIs are in-memory).
        default_max_turns: History window of new contexts, in complete turns.
        dedup_ttl_hours: How long a processed webhook id stays claimed.
        **options: The other :class:`~chatflow_sqlalchemy.options.StoreOptions`
            (``auto_migrate=False`` also creates no file or directory).

    WAL, ``synchronous=NORMAL`` and a busy timeout are set internally, with no
    other knob (``busy_timeout=`` is a ``TypeError``, as upstream). A new file
    is created 0600 and missing directories 0700, whatever the umask; an
    existing file keeps its mode.

    """

    dialect_support = SQLiteDialectSupport()
    _blocking_io_workers = _BLOCKING_IO_WORKERS

    def __init__(
        self,
        db_path: str | Path = "chatflow.db",
        default_max_turns: int = 40,
        dedup_ttl_hours: float = DEFAULT_DEDUP_TTL_HOURS,
        **options: Unpack[SQLStoreKeywords],
    ) -> None:
        given = {"default_max_turns": default_max_turns, "dedup_ttl_hours": dedup_ttl_hours}
        chosen = StoreOptions.of(type(self).__name__, {**given, **options})
        self.db_path = _refuse_url(db_path)
        url = sqlite_url(self.db_path)
        path = database_file(url)
        if path is not None and auto_migrate_enabled(chosen.auto_migrate):
            _make_folder_of(path)  # a store refusing to migrate leaves the disk as it was
        self._start(chosen, url)

    @classmethod
    def from_url(cls, url: str | URL, **kwargs: Any) -> SQLAlchemySessionStore:
        """Open ``sqlite:///path`` or a ``file:`` URI (aiosqlite URLs: the generic store)."""
        parsed = parse_database_url(url)
        require_backend(parsed, "sqlite", cls.__name__)
        if parsed.drivername == "sqlite+aiosqlite":
            return SQLAlchemySessionStore(parsed, **kwargs)
        database = parsed.database or ":memory:"
        query = {k: v for k, v in parsed.query.items() if k != "uri"}
        if database.startswith("file:") and query:
            database += "?" + "&".join(f"{k}={v}" for k, v in query.items())
        return cls(database, **kwargs)
