"""chatflow-sqlalchemy: SQLAlchemy session persistence for chatflow-agent.

Drop-in ``session_store=`` for ``chatflow_agent.Runner``::

    from chatflow_agent import Runner
    from chatflow_sqlalchemy import SQLiteSessionStore

    runner = Runner(starting_agent=agent, session_store=SQLiteSessionStore("chat.db"))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from chatflow_sqlalchemy.context import SessionContext
from chatflow_sqlalchemy.exceptions import (
    BackendImportError,
    BackendNotFoundError,
    ChatflowStoreError,
    CorruptRowError,
    DatabaseUnavailableError,
    DuplicateBackendError,
    SchemaAheadError,
    SchemaError,
    SessionDeletedError,
)
from chatflow_sqlalchemy.memory import SessionStore
from chatflow_sqlalchemy.registry import available_backends, open_store, register
from chatflow_sqlalchemy.store import DEFAULT_DEDUP_TTL_HOURS, SQLAlchemySessionStore

if TYPE_CHECKING:
    from chatflow_sqlalchemy.backends.postgresql import PostgresSessionStore
    from chatflow_sqlalchemy.backends.sqlite import SQLiteSessionStore

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_DEDUP_TTL_HOURS",
    "BackendImportError",
    "BackendNotFoundError",
    "ChatflowStoreError",
    "CorruptRowError",
    "DatabaseUnavailableError",
    "DuplicateBackendError",
    "PostgresSessionStore",
    "SQLAlchemySessionStore",
    "SQLiteSessionStore",
    "SchemaAheadError",
    "SchemaError",
    "SessionContext",
    "SessionDeletedError",
    "SessionStore",
    "__version__",
    "available_backends",
    "open_store",
    "register",
]


def __getattr__(name: str) -> Any:
    # Backends import lazily, so a missing driver never breaks `import chatflow_sqlalchemy`.
    if name == "SQLiteSessionStore":
        from chatflow_sqlalchemy.backends.sqlite import SQLiteSessionStore

        return SQLiteSessionStore
    if name == "PostgresSessionStore":
        from chatflow_sqlalchemy.backends.postgresql import PostgresSessionStore

        return PostgresSessionStore
    raise AttributeError(f"module 'chatflow_sqlalchemy' has no attribute {name!r}")
