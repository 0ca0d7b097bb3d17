"""PostgreSQL backend on psycopg 3: :class:`PostgresSessionStore` bounds each async operation.

The dialect: :class:`~chatflow_sqlalchemy.backends.postgresql_dialect.PostgresDialectSupport`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import URL

from chatflow_sqlalchemy.backends.postgresql_dialect import (
    CONNECT_TIMEOUT_SECONDS,
    INSTALL_HINT,
    MIGRATION_LOCK_KEY,
    PREPARE_THRESHOLD,
    TCP_OPTIONS,
    PostgresDialectSupport,
    default_connect_args,
    jsonb_dumps,
)
from chatflow_sqlalchemy.exceptions import BackendImportError, DatabaseUnavailableError
from chatflow_sqlalchemy.runtime import describe
from chatflow_sqlalchemy.server_store import ServerSessionStore
from chatflow_sqlalchemy.urls import psycopg_url

if TYPE_CHECKING:  # the asyncio extension needs greenlet: imported only where it is used
    import psycopg
else:
    try:
        import psycopg
    except ImportError:  # the class stays importable; opening a store names the extra
        psycopg = None

__all__ = [
    "CONNECT_TIMEOUT_SECONDS", "INSTALL_HINT", "MIGRATION_LOCK_KEY", "OPERATION_TIMEOUT_SECONDS",
    "PREPARE_THRESHOLD", "TCP_OPTIONS", "PostgresDialectSupport", "PostgresSessionStore",
    "default_connect_args", "jsonb_dumps", "psycopg_url",
]

OPERATION_TIMEOUT_SECONDS = 15.0
"""Default of ``PostgresSessionStore.operation_timeout``."""

_R = TypeVar("_R")

_timeout = getattr(asyncio, "timeout", None)
"""``asyncio.timeout`` (Python 3.11 and later), else None."""


class PostgresSessionStore(ServerSessionStore):
    """Session store on PostgreSQL (psycopg 3), for many workers sharing conversations.

    Args:
        url: ``postgresql://`` or ``postgresql+psycopg://`` URL.
        default_max_turns: History window of new contexts, in complete turns.
        dedup_ttl_hours: How long a processed webhook id stays claimed.
        **options: :class:`~chatflow_sqlalchemy.options.StoreOptions`; any
            other keyword (and ``engine_options=``) goes to ``create_engine``;
            ``connect_args`` add to :func:`default_connect_args`.

    Hangs are bounded (a :class:`~chatflow_sqlalchemy.exceptions.DatabaseUnavailableError`):
    connecting by :data:`CONNECT_TIMEOUT_SECONDS`, each async operation by
    :attr:`operation_timeout`, a partitioned connection by TCP keepalives
    (:data:`TCP_OPTIONS`). A turn holds no connection while it runs, only its lease.

    """

    dialect_support = PostgresDialectSupport()

    operation_timeout: float = OPERATION_TIMEOUT_SECONDS
    """Seconds an async operation may wait on the server before it is cancelled and fails."""

    @classmethod
    def store_url(cls, url: str | URL) -> URL:
        """``url`` on psycopg 3 (``postgresql://`` → ``postgresql+psycopg://``).

        Raises:
            BackendImportError: psycopg is not installed (names the extra).
            DatabaseURLError: Not a PostgreSQL URL, or one naming another driver.

        """
        if psycopg is None:
            raise BackendImportError(INSTALL_HINT)
        return psycopg_url(url)

    async def _run_blocking(self, fn: Callable[..., _R], *args: Any) -> _R:
        """Run database work as the generic store does; on native async, bounded in time.

        A thread blocked in libpq cannot be cancelled; a coroutine can.
        """
        if not self.runtime.native_async:
            return await super()._run_blocking(fn, *args)
        try:
            if _timeout is None:  # Python 3.10
                work = super()._run_blocking(fn, *args)
                return await asyncio.wait_for(work, self.operation_timeout)
            # Not through wait_for (a new task) or a wrapper coroutine: every
            # statement takes this path, stepped through each time the driver waits.
            async with _timeout(self.operation_timeout):
                return await super()._run_blocking(fn, *args)
        except asyncio.TimeoutError as exc:
            raise DatabaseUnavailableError(
                f"no answer from {describe(self.url)} within {self.operation_timeout:g} s "
                "(PostgresSessionStore.operation_timeout); the operation was cancelled"
            ) from exc
