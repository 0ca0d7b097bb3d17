"""chatflow-sqlalchemy: SQLAlchemy session persistence for chatflow-agent.

Drop-in ``session_store=`` for ``chatflow_agent.Runner``::

    from chatflow_agent import Runner
    from chatflow_sqlalchemy import SQLiteSessionStore

    runner = Runner(starting_agent=agent, session_store=SQLiteSessionStore("chat.db"))

Names are imported lazily (PEP 562): the import costs nothing until a name is
used, and a missing database driver never breaks it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatflow_sqlalchemy.backends.postgresql import PostgresSessionStore
    from chatflow_sqlalchemy.backends.sqlite import SQLiteSessionStore
    from chatflow_sqlalchemy.claims import DEFAULT_DEDUP_TTL_HOURS, WebhookClaim
    from chatflow_sqlalchemy.context import SessionContext
    from chatflow_sqlalchemy.exceptions import (
        BackendImportError,
        BackendNotFoundError,
        ChatflowStoreError,
        ClaimLostError,
        CorruptRowError,
        DatabaseUnavailableError,
        DatabaseURLError,
        DuplicateBackendError,
        LeaseLostError,
        SchemaAheadError,
        SchemaError,
        SessionDeletedError,
    )
    from chatflow_sqlalchemy.inbox import Inbox, InboxBatch, InboxItem, InboxReply
    from chatflow_sqlalchemy.memory import SessionStore
    from chatflow_sqlalchemy.opening import open_store
    from chatflow_sqlalchemy.registry import available_backends, register
    from chatflow_sqlalchemy.store import SQLAlchemySessionStore
    from chatflow_sqlalchemy.summaries import Summarizer

__version__ = "0.1.0"

_MODULES: dict[str, tuple[str, ...]] = {
    "claims": ("DEFAULT_DEDUP_TTL_HOURS", "WebhookClaim"),
    "store": ("SQLAlchemySessionStore",),
    "backends.sqlite": ("SQLiteSessionStore",),
    "backends.postgresql": ("PostgresSessionStore",),
    "memory": ("SessionStore",),
    "context": ("SessionContext",),
    "inbox": ("Inbox", "InboxBatch", "InboxItem", "InboxReply"),
    "summaries": ("Summarizer",),
    "registry": ("available_backends", "register"),
    "opening": ("open_store",),
    "exceptions": (
        "BackendImportError", "BackendNotFoundError", "ChatflowStoreError", "ClaimLostError",
        "CorruptRowError", "DatabaseUnavailableError", "DatabaseURLError",
        "DuplicateBackendError", "LeaseLostError", "SchemaAheadError", "SchemaError",
        "SessionDeletedError",
    ),
}
_LAZY = {name: f"chatflow_sqlalchemy.{module}" for module, names in _MODULES.items()
         for name in names}

__all__ = [
    "DEFAULT_DEDUP_TTL_HOURS", "BackendImportError", "BackendNotFoundError",
    "ChatflowStoreError", "ClaimLostError", "CorruptRowError", "DatabaseURLError",
    "DatabaseUnavailableError", "DuplicateBackendError", "Inbox", "InboxBatch", "InboxItem",
    "InboxReply", "LeaseLostError", "PostgresSessionStore", "SQLAlchemySessionStore",
    "SQLiteSessionStore", "SchemaAheadError", "SchemaError", "SessionContext",
    "SessionDeletedError", "SessionStore", "Summarizer", "WebhookClaim", "__version__",
    "available_backends", "open_store", "register",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'chatflow_sqlalchemy' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
