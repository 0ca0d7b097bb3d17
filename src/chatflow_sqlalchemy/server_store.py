"""``ServerSessionStore``: the store class of a backend for a database server.

``PostgresSessionStore`` and a plugin's store (``MariaDBSessionStore``) are this
class with their ``dialect_support`` set, adding only what differs (a URL check,
methods of their own).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from sqlalchemy import URL

from chatflow_sqlalchemy.claims import DEFAULT_DEDUP_TTL_HOURS
from chatflow_sqlalchemy.options import StoreOptions
from chatflow_sqlalchemy.store import SQLAlchemySessionStore
from chatflow_sqlalchemy.urls import parse_database_url, require_backend

__all__ = ["ServerSessionStore"]

_STORE_OPTIONS = frozenset(f.name for f in fields(StoreOptions))


class ServerSessionStore(SQLAlchemySessionStore):
    """Session store on one backend's database server (set ``dialect_support`` in a subclass).

    Args:
        url: The server's URL; :meth:`store_url` gives it the backend's driver.
        default_max_turns: History window of new contexts, in complete turns.
        dedup_ttl_hours: How long a processed webhook id stays claimed.
        **options: Store options by keyword (``session_ttl_hours``,
            ``archive_pruned``, ``turn_lease_seconds``, ``summarizer``,
            ``auto_migrate``, ``cipher``, ``require_encryption``: see
            :class:`~chatflow_sqlalchemy.options.StoreOptions`); every other
            keyword, and the mapping ``engine_options=``, goes to
            ``create_engine`` over the backend's defaults (``connect_args``
            key by key).

    Raises:
        BackendImportError: The driver is not installed.
        DatabaseURLError: The URL is not one of this backend's databases.
        DatabaseUnavailableError: The server cannot be reached.

    """

    def __init__(
        self,
        url: str | URL,
        default_max_turns: int = 40,
        dedup_ttl_hours: float = DEFAULT_DEDUP_TTL_HOURS,
        **options: Any,
    ) -> None:
        engine_options = dict(options.pop("engine_options", None) or {})
        chosen = {name: options.pop(name) for name in _STORE_OPTIONS & options.keys()}
        given = {"default_max_turns": default_max_turns, "dedup_ttl_hours": dedup_ttl_hours}
        store_options = StoreOptions.of(type(self).__name__, {**given, **chosen})
        engine_options.update(options)
        self._start(store_options, self.store_url(url), engine_options=engine_options)

    @classmethod
    def store_url(cls, url: str | URL) -> URL:
        """``url`` with the driver the backend runs on (its support's ``sync_url``).

        Another backend's URL is refused as the caller wrote it, before a
        default driver is added to it (``postgresql+pymysql`` would mislead).
        """
        support = cls.dialect_support
        parsed = parse_database_url(url)
        if support is None:
            return parsed
        require_backend(parsed, support.name, cls.__name__)
        return support.sync_url(parsed)
