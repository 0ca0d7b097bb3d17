"""Store openers for tests that run one scenario on every backend, with the store options
they choose: a SQLite file, PostgreSQL (a schema of its own), MariaDB (through its plugin; a
fresh database) and the in-memory store. Each test gets one database; every store it opens
is on that database and is closed at the end of the test.

The fixtures ``sql_store`` and ``any_store`` (in ``conftest.py``) hand a test an opener.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from chatflow_sqlalchemy import SessionStore, open_store

from . import pg_util
from .test_bad_input import _mariadb_database

__all__ = ["SQL_KINDS", "Opener", "open_on"]

SQL_KINDS = [
    "sqlite",
    pytest.param("postgresql", marks=pytest.mark.postgres),
    pytest.param("mariadb", marks=pytest.mark.mariadb),
]

Opener = Callable[..., Any]
"""``opener(**store_options)``: a store on the test's database (the in-memory one: the same)."""


def open_on(
    kind: str, stack: ExitStack, tmp_path: Path, pg_schema: Callable[[], str] | None = None
) -> Opener:
    """Opens stores with the given options, all on this test's one database of ``kind``.

    ``pg_schema`` hands out the PostgreSQL schema (given back with ``stack``); by
    default a fresh one is created and dropped.
    """
    if kind == "memory":
        memory: dict[str, Any] = {}

        def open_memory(**options: Any) -> Any:
            if "store" not in memory:
                memory["store"] = stack.enter_context(SessionStore(**options))
            return memory["store"]

        return open_memory
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'store.db'}"
        return lambda **options: stack.enter_context(open_store(url, **options))
    if kind == "mariadb":
        pytest.importorskip("chatflow_sqlalchemy_mariadb")
        url = _mariadb_database(stack)
        return lambda **options: stack.enter_context(open_store(url, **options))
    pg = pg_util.postgres_url()
    schema = pg_schema() if pg_schema else stack.enter_context(pg_util.fresh_schema(pg))
    return lambda **options: stack.enter_context(pg_util.schema_store(pg, schema, **options))
