"""MariaDB / MySQL backend for chatflow-sqlalchemy (see its README).

Installed, it serves ``open_store("mysql+pymysql://...")`` (entry points
``mysql`` and ``mariadb``) and runs its migration chain with the core's.
Names are imported lazily: importing the package imports no driver.
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
