"""MariaDB / MySQL backend for chatflow-sqlalchemy.

Installing this distribution is all it takes::

    pip install chatflow-sqlalchemy-mariadb

    from chatflow_sqlalchemy import open_store
    store = open_store("mysql+pymysql://bot:secret@db.internal/chat")

It registers the backend names ``mysql`` and ``mariadb`` in the entry-point
group ``chatflow_sqlalchemy.backends``, and its own migration chain (the
``chatflow_mariadb_info`` table) in ``chatflow_sqlalchemy.migrations``.
Names are imported lazily, so ``import chatflow_sqlalchemy_mariadb`` does not
import the driver.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatflow_sqlalchemy_mariadb.dialect import MariaDBDialectSupport
    from chatflow_sqlalchemy_mariadb.schema import MIGRATIONS
    from chatflow_sqlalchemy_mariadb.store import MariaDBSessionStore

__version__ = "0.1.0"

_LAZY = {
    "MariaDBDialectSupport": "chatflow_sqlalchemy_mariadb.dialect",
    "MariaDBSessionStore": "chatflow_sqlalchemy_mariadb.store",
    "MIGRATIONS": "chatflow_sqlalchemy_mariadb.schema",
}

__all__ = ["MIGRATIONS", "MariaDBDialectSupport", "MariaDBSessionStore", "__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
