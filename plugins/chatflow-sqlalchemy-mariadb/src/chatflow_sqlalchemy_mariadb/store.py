"""``MariaDBSessionStore``: the chatflow session store on MariaDB or MySQL.

Everything but the dialect hooks (:mod:`.dialect`) is the generic
:class:`~chatflow_sqlalchemy.SQLAlchemySessionStore`: turns of one session
exclude each other across processes by the session's lease, as on every
backend. The async API runs on the store's private thread pool (PyMySQL is a
sync driver).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chatflow_sqlalchemy.backend import (
    DEFAULT_DEDUP_TTL_HOURS,
    DEFAULT_TURN_LEASE_SECONDS,
    AESGCMCipher,
    SQLAlchemySessionStore,
    Summarizer,
)
from sqlalchemy import URL, make_url, select

from chatflow_sqlalchemy_mariadb.dialect import (
    MariaDBDialectSupport,
    with_driver,
)
from chatflow_sqlalchemy_mariadb.schema import info

__all__ = ["MariaDBSessionStore"]


class MariaDBSessionStore(SQLAlchemySessionStore):
    """Session store on MariaDB or MySQL, for many workers sharing sessions.

    Tested on MariaDB 10.11 (needs 10.3+: ``utf8mb4_nopad_bin``, ``DATETIME(6)``,
    JSON). MySQL 8.0.17+ is meant to work (``utf8mb4_0900_bin`` ids) but is not
    tested by this project.

    Args:
        url: ``mysql+pymysql://user:pw@host/db`` (``mysql://`` and ``mariadb://``
            use PyMySQL; ``mysql+mysqldb://`` uses mysqlclient if installed).
        default_max_turns: History window of new contexts, in complete turns.
        dedup_ttl_hours: How long a processed webhook id stays claimed.
        session_ttl_hours: A session not updated for this many hours is expired
            and removed by ``sweep()``; None (the default) keeps sessions forever.
        archive_pruned: Keep the messages pruning drops from the window in the
            archive table (read back by ``transcript()``) instead of deleting them.
        cipher: An :class:`~chatflow_sqlalchemy.crypto.AESGCMCipher`: message
            content and metadata are encrypted at rest (see :mod:`~chatflow_sqlalchemy.sealing`).
        require_encryption: Refuse plaintext rows with ``CorruptRowError``.
        auto_migrate: False refuses a missing or old schema instead of creating
            or upgrading it; None (the default) reads ``CHATFLOW_AUTO_MIGRATE``.
        engine_options: Passed to ``sqlalchemy.create_engine`` (pool size,
            ``connect_args``, ...), over the backend's defaults (``connect_args``
            key by key); also as keyword arguments of their own.
        turn_lease_seconds: How long a turn's lease lasts without renewal.
        summarizer: An async callable ``(previous_summary, dropped) -> str``
            that summarizes the turns pruning drops (see
            :mod:`~chatflow_sqlalchemy.summaries`); None keeps no summary.

    Raises:
        BackendImportError: The driver is not installed.
        DatabaseUnavailableError: The server cannot be reached.

    """

    dialect_support = MariaDBDialectSupport()

    def __init__(
        self,
        url: str | URL,
        default_max_turns: int = 40,
        dedup_ttl_hours: float = DEFAULT_DEDUP_TTL_HOURS,
        *,
        auto_migrate: bool | None = None,
        session_ttl_hours: float | None = None,
        archive_pruned: bool = False,
        cipher: AESGCMCipher | None = None,
        require_encryption: bool = False,
        engine_options: Mapping[str, Any] | None = None,
        turn_lease_seconds: float = DEFAULT_TURN_LEASE_SECONDS,
        summarizer: Summarizer | None = None,
        **more_engine_options: Any,
    ) -> None:
        super().__init__(
            with_driver(make_url(url)),
            engine_options={**(engine_options or {}), **more_engine_options},
            default_max_turns=default_max_turns,
            dedup_ttl_hours=dedup_ttl_hours,
            auto_migrate=auto_migrate,
            session_ttl_hours=session_ttl_hours,
            archive_pruned=archive_pruned,
            cipher=cipher,
            require_encryption=require_encryption,
            turn_lease_seconds=turn_lease_seconds,
            summarizer=summarizer,
        )

    @classmethod
    def from_url(cls, url: str | URL, **kwargs: Any) -> MariaDBSessionStore:
        """Open ``url`` (what ``open_store`` calls)."""
        return cls(url, **kwargs)

    def backend_info(self) -> dict[str, str]:
        """What the plugin recorded when it created this schema (``chatflow_mariadb_info``)."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(info.c.name, info.c.value)).all()
        return {name: value for name, value in rows}
