"""``MariaDBSessionStore``: the chatflow session store on MariaDB or MySQL.

The core's :class:`~chatflow_sqlalchemy.backend.ServerSessionStore` with this
backend's dialect hooks (:mod:`.dialect`), and ``backend_info()``.
"""

from __future__ import annotations

from chatflow_sqlalchemy.backend import ServerSessionStore
from sqlalchemy import select

from chatflow_sqlalchemy_mariadb.dialect import MariaDBDialectSupport
from chatflow_sqlalchemy_mariadb.schema import info

__all__ = ["MariaDBSessionStore"]


class MariaDBSessionStore(ServerSessionStore):
    """Session store on MariaDB or MySQL, for many workers sharing sessions.

    ``MariaDBSessionStore(url, default_max_turns=40, dedup_ttl_hours=192, **options)``:
    ``mysql://`` and ``mariadb://`` URLs use PyMySQL (``mysql+mysqldb://``,
    mysqlclient); store options and engine options by keyword, as
    :class:`~chatflow_sqlalchemy.backend.ServerSessionStore` takes them. The
    async API runs on the store's private thread pool (PyMySQL is sync).

    Tested on MariaDB 10.11 (needs 10.3+: ``utf8mb4_nopad_bin``, ``DATETIME(6)``,
    JSON, sequences). MySQL 8.0.17+ is meant to work but is not tested here.
    """

    dialect_support = MariaDBDialectSupport()

    def backend_info(self) -> dict[str, str]:
        """What the plugin recorded when it created this schema (``chatflow_mariadb_info``)."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(info.c.name, info.c.value)).all()
        return {name: value for name, value in rows}
