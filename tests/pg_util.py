"""Where the PostgreSQL tests get their server, and a fresh schema per test.

``CHATFLOW_TEST_POSTGRES_URL`` set: that server is used, and a test fails loudly
if it cannot be reached (a silent skip would hide a broken CI). Unset: the
PostgreSQL tests are skipped with a reason that says how to run them.

Every test works in its own ``CREATE SCHEMA t_<uuid>``, selected per
connection with ``options=-csearch_path=<schema>``, dropped with CASCADE after.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa

from chatflow_sqlalchemy.testing import database_problem

ENV_VAR = "CHATFLOW_TEST_POSTGRES_URL"


@functools.cache
def _check_reachable(url: str) -> str | None:
    return database_problem(url)


def postgres_url() -> str:
    """The server's psycopg 3 URL; skip when unconfigured, fail when unreachable."""
    raw = os.environ.get(ENV_VAR)
    if not raw:
        pytest.skip(
            f"PostgreSQL test: set {ENV_VAR}=postgresql+psycopg://user@host:port/db to run it"
        )
    from chatflow_sqlalchemy.backends.postgresql import psycopg_url

    url = psycopg_url(raw).render_as_string(hide_password=False)
    problem = _check_reachable(url)
    if problem is not None:
        pytest.fail(f"{ENV_VAR} is set but PostgreSQL is unreachable: {problem}", pytrace=False)
    return url


def schema_connect_args(schema: str) -> dict[str, Any]:
    """``connect_args`` that put every connection of an engine in ``schema``."""
    return {"options": f"-csearch_path={schema}"}


@contextmanager
def fresh_schema(url: str) -> Iterator[str]:
    """Create ``t_<uuid>``, yield its name, drop it with everything in it."""
    schema = f"t_{uuid.uuid4().hex}"
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        try:
            yield schema
        finally:
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
    finally:
        admin.dispose()


def schema_engine(url: str, schema: str) -> sa.Engine:
    """An engine in ``schema`` set up the way the PostgreSQL store sets up its own."""
    from chatflow_sqlalchemy.backends.postgresql import PostgresDialectSupport

    support = PostgresDialectSupport()
    options = {
        **support.engine_options(sa.make_url(url)),
        "connect_args": schema_connect_args(schema),
    }
    engine = sa.create_engine(url, **options)
    support.prepare_engine(engine)
    return engine


def schema_store(url: str, schema: str, **options: Any) -> Any:
    """A PostgresSessionStore in ``schema``; its connections carry the schema as
    ``application_name``, so a test can find them in ``pg_stat_activity``."""
    from chatflow_sqlalchemy import PostgresSessionStore

    connect_args = {**schema_connect_args(schema), "application_name": schema}
    return PostgresSessionStore(url, connect_args=connect_args, **options)
