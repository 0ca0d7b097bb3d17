"""Point chatflow-sqlalchemy's shipped conformance suite at a MariaDB / MySQL server.

The server comes from ``CHATFLOW_TEST_MARIADB_URL`` (e.g.
``mysql+pymysql://root@127.0.0.1:3306/test``):

* set: every test runs, in a database of its own (``CREATE DATABASE
  t_<uuid>``, dropped afterwards); if the server cannot be reached every
  test FAILS with the reason, it is never silently skipped;
* unset: every test is skipped with a reason that says how to run them.

This file is also the worked example of ``docs/plugin-authors.md``: the only
thing a backend must provide to run the suite is the ``store_factory``
fixture returning a ``StoreHarness`` with the capabilities it has.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from chatflow_sqlalchemy.testing import (
    Capability,
    SpecHarness,
    StoreHarness,
    StoreSpec,
    UnreachableHarness,
    database_problem,
)
from sqlalchemy import URL, Engine, create_engine, make_url, text

MARIADB_ENV = "CHATFLOW_TEST_MARIADB_URL"
STORE_TARGET = "chatflow_sqlalchemy_mariadb:MariaDBSessionStore"
GENERIC_TARGET = "chatflow_sqlalchemy.store:SQLAlchemySessionStore"

CAPABILITIES = {
    Capability.PERSISTENT,  # every harness.open() reaches the same database
    Capability.CROSS_PROCESS,  # spawned workers open it from the StoreSpec
    Capability.SQL,  # store.engine over the chatflow tables
    Capability.ASYNC_THREADPOOL,  # PyMySQL is sync: async work runs on the private pool
    Capability.USER_SCOPE,  # user_id, list_sessions filters and pages, erase/export_user
    Capability.RETENTION,  # session_ttl_hours and sweep()
    Capability.ARCHIVE,  # archive_pruned and transcript()
    Capability.ENCRYPTION,  # cipher=, require_encryption=, rotate_keys()
    Capability.FORKS,  # store.fork / afork and list_sessions(forked_from=)
}


def _mask(url: str | URL) -> str:
    return make_url(url).render_as_string(hide_password=True)


class MariaDBUnreachable(Exception):
    """``CHATFLOW_TEST_MARIADB_URL`` is set but its server cannot be reached."""


@pytest.fixture(scope="session")
def mariadb_url() -> URL:
    """The configured server's URL (with the PyMySQL driver); skip or fail as described above."""
    raw = os.environ.get(MARIADB_ENV)
    if not raw:
        pytest.skip(
            f"MariaDB tests skipped: {MARIADB_ENV} is unset; "
            f"set {MARIADB_ENV}=mysql+pymysql://user@host:3306/db to run them"
        )
    from chatflow_sqlalchemy_mariadb.dialect import MariaDBDialectSupport

    url = MariaDBDialectSupport().sync_url(make_url(raw))
    problem = database_problem(url)
    if problem:
        raise MariaDBUnreachable(
            f"{MARIADB_ENV} is set to {_mask(url)} but the server is unreachable ({problem}). "
            f"Start MariaDB, fix the URL, or unset {MARIADB_ENV} to skip these tests."
        )
    return url


@pytest.fixture(scope="session")
def mariadb_admin(mariadb_url: URL) -> Iterator[Engine]:
    """An engine used only to create and drop the per-test databases."""
    engine = create_engine(mariadb_url, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    yield engine
    engine.dispose()


def fresh_database(url: URL, admin: Engine) -> tuple[URL, Callable[[], None]]:
    """Create ``t_<uuid>``; return its URL and a callable that drops it."""
    name = f"t_{uuid.uuid4().hex}"
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))

    return url.set(database=name), drop


@pytest.fixture
def new_database(mariadb_url: URL, mariadb_admin: Engine) -> Iterator[Callable[[], URL]]:
    """A factory of new, empty databases; each is dropped after the test."""
    drops: list[Callable[[], None]] = []

    def make() -> URL:
        url, drop = fresh_database(mariadb_url, mariadb_admin)
        drops.append(drop)
        return url

    try:
        yield make
    finally:
        for drop in drops:
            drop()


@pytest.fixture
def mariadb_database(new_database: Callable[[], URL]) -> URL:
    """The URL of a new, empty database, dropped after the test."""
    return new_database()


@pytest.fixture(params=["mariadb", "mariadb-generic"])
def store_factory(request: pytest.FixtureRequest) -> Iterator[StoreHarness]:
    """The MariaDB backend under test (overrides the conformance plugin's default).

    ``mariadb-generic`` opens the core's ``SQLAlchemySessionStore(url)``: the
    plugin's dialect support alone (its turn locks included) must make it work.
    """
    name: str = request.param
    try:
        url: URL = request.getfixturevalue("mariadb_url")
    except MariaDBUnreachable as exc:
        yield UnreachableHarness(name, str(exc))
        return
    target = GENERIC_TARGET if name == "mariadb-generic" else STORE_TARGET
    pool = request.getfixturevalue("mariadb_databases")[target]
    database = pool.take()
    spec = StoreSpec(target, (_on(url, database),))
    harness = SpecHarness(name, spec, CAPABILITIES, cleanup=lambda: pool.give_back(database))
    yield harness
    harness.close()


def _on(url: URL, database: str) -> str:
    return url.set(database=database).render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def mariadb_databases(mariadb_url: URL, mariadb_admin: Engine) -> Iterator[dict[str, Any]]:
    """Databases for the harnesses, reused test after test (``mariadb_reuse.py``).

    Keyed by the store's target: the plugin's store and the generic store each get theirs.
    """
    from mariadb_reuse import DatabasePool

    def new_database() -> str:
        name = f"t_{uuid.uuid4().hex}"
        with mariadb_admin.connect() as conn:
            conn.execute(text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
        return name

    def drop_database(name: str) -> None:
        with mariadb_admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))

    def migrator(target: str) -> Callable[[str], None]:
        def migrate(name: str) -> None:
            store: Any = StoreSpec(target, (_on(mariadb_url, name),)).open()
            store.close()

        return migrate

    pools = {
        target: DatabasePool(mariadb_admin, migrator(target), new_database, drop_database)
        for target in (STORE_TARGET, GENERIC_TARGET)
    }
    yield pools
    for pool in pools.values():
        pool.close()


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Say where the MariaDB tests run."""
    raw = os.environ.get(MARIADB_ENV)
    return [f"chatflow-sqlalchemy MariaDB tests: {_mask(raw) if raw else 'skipped (unset)'}"]
