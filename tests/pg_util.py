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


def _os_error_in(exc: BaseException) -> OSError | None:
    """The operating-system error at the root of ``exc`` (docker-py nests it in args)."""
    seen: list[object] = [exc]
    while seen:
        item = seen.pop()
        if isinstance(item, OSError) and item.errno is not None:
            return item
        if isinstance(item, BaseException):
            seen.extend([*item.args, item.__cause__, item.__context__])
    return None


def _docker_problem_in_words(exc: BaseException) -> str:
    """Say in plain words why the Docker client could not reach a daemon."""
    where = os.environ.get("DOCKER_HOST") or "/var/run/docker.sock"
    root = _os_error_in(exc)
    if isinstance(root, FileNotFoundError):
        return f"Docker is not available (no Docker daemon socket at {where})"
    if isinstance(root, PermissionError):
        return f"Docker is not usable (permission denied on {where})"
    if isinstance(root, ConnectionRefusedError):
        return f"Docker is not available (nothing answers at {where})"
    return f"Docker is not usable ({str(exc).strip().splitlines()[0]})"


def postgres_container_class() -> Any:
    """testcontainers' ``PostgresContainer`` (its ``community`` module from 4.x on)."""
    try:
        from testcontainers.community.postgres import PostgresContainer
    except ImportError:
        from testcontainers.postgres import PostgresContainer
    return PostgresContainer


@functools.cache
def docker_unusable() -> str | None:
    """Return, in plain words, why testcontainers cannot start PostgreSQL, or None."""
    try:
        import docker

        postgres_container_class()
    except ImportError as exc:
        return f"testcontainers is not installed ({exc})"
    try:
        client = docker.from_env(timeout=5)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:
        return _docker_problem_in_words(exc)
    return None


def unset_reason() -> str:
    """The one skip reason of every PostgreSQL test when no server is configured."""
    docker = docker_unusable()
    how = f"set {ENV_VAR}=postgresql+psycopg://user@host:5432/db to run them"
    if docker:
        return f"PostgreSQL tests skipped: {ENV_VAR} is unset and {docker}; {how}"
    return (f"PostgreSQL tests skipped: {ENV_VAR} is unset (Docker serves only the "
            f"conformance suite); {how}")


def postgres_url() -> str:
    """The server's psycopg 3 URL; skip when unconfigured, fail when unreachable."""
    raw = os.environ.get(ENV_VAR)
    if not raw:
        pytest.skip(unset_reason())
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



def writes_session(sql: str) -> bool:
    """True for a statement that writes a turn (swaps the session's version).

    Not the turn's lease statements, which update the session row too.
    """
    return "UPDATE chatflow_sessions SET" in sql and "version=" in sql
