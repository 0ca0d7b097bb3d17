"""PostgreSQL helpers: the server URL, availability, and a fresh schema per run."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

__all__ = [
    "DEFAULT_PG_URL",
    "create_schema",
    "drop_schema",
    "libpq_url",
    "pg_available",
    "pg_url_from_env",
    "schema_connect_args",
    "server_version",
]

DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def pg_url_from_env(url: str | None = None) -> str:
    """``url``, else ``$CHATFLOW_BENCH_POSTGRES_URL``, ``$CHATFLOW_TEST_POSTGRES_URL``, local."""
    return (
        url
        or os.environ.get("CHATFLOW_BENCH_POSTGRES_URL")
        or os.environ.get("CHATFLOW_TEST_POSTGRES_URL")
        or DEFAULT_PG_URL
    )


def libpq_url(url: str, driver: str = "postgresql") -> str:
    """The same URL with another driver name (``postgresql`` = plain libpq, for psycopg)."""
    from sqlalchemy import make_url

    return make_url(url).set(drivername=driver).render_as_string(hide_password=False)


def schema_connect_args(schema: str) -> dict[str, Any]:
    """psycopg ``connect_args`` that put every connection in ``schema``."""
    return {"options": f"-csearch_path={schema}"}


def _execute(url: str, sql: str, patience: float = 30.0) -> Any:
    """Run one statement; wait out a server that is restarting (tests may restart it)."""
    import psycopg

    deadline = time.monotonic() + patience
    while True:
        try:
            with psycopg.connect(libpq_url(url), autocommit=True, connect_timeout=3) as conn:
                cursor = conn.execute(sql)
                row = cursor.fetchone() if cursor.description else None
                return row[0] if row else None
        except psycopg.OperationalError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


def pg_available(url: str) -> str | None:
    """None when the server answers, else why not."""
    try:
        _execute(url, "SELECT 1", patience=5.0)
    except Exception as exc:
        return str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
    return None


def server_version(url: str) -> str:
    """``SHOW server_version``."""
    return str(_execute(url, "SHOW server_version"))


def create_schema(url: str, label: str) -> str:
    """Create and return a fresh schema named after ``label``."""
    schema = f"bench_{label.replace('-', '_')}_{uuid.uuid4().hex[:8]}"
    _execute(url, f'CREATE SCHEMA "{schema}"')
    return schema


def drop_schema(url: str, schema: str) -> None:
    """Drop ``schema`` and everything in it."""
    _execute(url, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
