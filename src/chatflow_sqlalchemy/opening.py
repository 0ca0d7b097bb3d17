"""``open_store``: a store for any database URL (above the registry, which imports no store)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import URL

from chatflow_sqlalchemy.registry import store_class_for
from chatflow_sqlalchemy.urls import parse_database_url

if TYPE_CHECKING:
    from chatflow_sqlalchemy.store import SQLAlchemySessionStore

__all__ = ["open_store"]


def open_store(url: str | URL | None = None, **kwargs: Any) -> SQLAlchemySessionStore:
    """Open a session store for ``url``, picking the backend by its dialect.

    Without ``url``, ``$CHATFLOW_DATABASE_URL``, else ``sqlite:///chatflow.db``.
    Keyword arguments go to the backend's ``store_class.from_url``.

    Raises:
        DatabaseURLError: The URL cannot mean a database (the message gives the fix).
        BackendNotFoundError: The dialect has no installed backend (lists installed ones).
        BackendImportError: Its driver is missing (names the extra to install).
        DuplicateBackendError: Two installed plugins claim the dialect.

    """
    parsed = parse_database_url(url)
    store_class = store_class_for(parsed.get_backend_name())
    return cast("SQLAlchemySessionStore", store_class.from_url(parsed, **kwargs))
