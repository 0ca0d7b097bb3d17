"""Run the shipped conformance suite against every built-in backend.

``store_factory`` (overriding the plugin's default) is parametrised over:

============================  ==================================================
``sqlite-file``               a temporary file (a copy of one the store migrated):
                              PERSISTENT, CROSS_PROCESS, SQL,
                              ASYNC_THREADPOOL
``sqlite-memory``             ``":memory:"`` (each store is its own database):
                              SQL, EPHEMERAL
``sqlite-shared-uri``         ``file:<unique>?mode=memory&cache=shared``, kept
                              alive by an anchor connection: PERSISTENT (within
                              this process), SQL, EPHEMERAL
``memory``                    ``chatflow_sqlalchemy.SessionStore``: EPHEMERAL
``postgresql``                a schema per test (reused, emptied, by the next
                              test: tests/pg_reuse.py): PERSISTENT,
                              CROSS_PROCESS, SQL, and ASYNC_NATIVE (psycopg
                              async) or ASYNC_THREADPOOL, as the store runs
============================  ==================================================

PostgreSQL comes from ``CHATFLOW_TEST_POSTGRES_URL``; when it is set and the
server cannot be reached, every PostgreSQL test FAILS with the reason (it is
never silently skipped). When it is unset, a testcontainers ``PostgresContainer``
is started if Docker is usable; otherwise the PostgreSQL tests are skipped,
and the end of the run says so once, in plain words (``pytest_terminal_summary``
groups every skip by reason instead of listing each test).
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import tempfile
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, make_url, text

from chatflow_sqlalchemy.testing import (
    Capability,
    SpecHarness,
    StoreHarness,
    StoreSpec,
    UnreachableHarness,
    database_problem,
)

from .stores import SQL_KINDS, Opener, open_on

POSTGRES_ENV = "CHATFLOW_TEST_POSTGRES_URL"
POSTGRES_IMAGE = "postgres:16-alpine"

SQLITE_TARGET = "chatflow_sqlalchemy.backends.sqlite:SQLiteSessionStore"
POSTGRES_TARGET = "chatflow_sqlalchemy.backends.postgresql:PostgresSessionStore"
MEMORY_TARGET = "chatflow_sqlalchemy.memory:SessionStore"
GENERIC_TARGET = "chatflow_sqlalchemy.store:SQLAlchemySessionStore"

BACKENDS = [
    "sqlite-file",
    "sqlite-memory",
    "sqlite-shared-uri",
    "memory",
    pytest.param("postgresql", marks=pytest.mark.postgres),
    pytest.param("postgresql-generic", marks=pytest.mark.postgres),
    pytest.param("postgresql-pgbouncer", marks=pytest.mark.postgres),
]


def _mask(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


class PostgresUnreachable(Exception):
    """``CHATFLOW_TEST_POSTGRES_URL`` is set but its server cannot be reached."""


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A reachable PostgreSQL server for the whole session (env URL or a container).

    Raises:
        PostgresUnreachable: The env URL is set but the server cannot be reached.

    """
    url = os.environ.get(POSTGRES_ENV)
    if url:
        problem = database_problem(url)
        if problem:
            raise PostgresUnreachable(
                f"{POSTGRES_ENV} is set to {_mask(url)} but the server is unreachable "
                f"({problem}). Start PostgreSQL, fix the URL, or unset {POSTGRES_ENV} "
                "to fall back to testcontainers."
            )
        yield url
        return
    from . import pg_util

    if pg_util.docker_unusable():
        pytest.skip(pg_util.unset_reason())
    with pg_util.postgres_container_class()(POSTGRES_IMAGE, driver="psycopg") as container:
        yield container.get_connection_url()


@pytest.fixture
def postgres_connection_budget() -> Iterator[None]:
    """Run the test alone among the connection-hungry ones, across pytest-xdist workers.

    A test that holds dozens of PostgreSQL connections at once (fifty concurrent turn
    locks) beside another such test in another worker would pass the server's
    ``max_connections`` (100 by default) and fail with "too many clients already".
    An exclusive ``flock`` on a file every worker (and every pytest run on this
    machine) shares keeps them one at a time; other tests run beside them.
    """
    try:
        import fcntl
    except ImportError:  # Windows: no flock; such runs use one worker
        yield
        return
    path = Path(tempfile.gettempdir()) / "chatflow-tests-postgres-connections.lock"
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def postgres_admin(postgres_url: str) -> Iterator[Engine]:
    """An engine used only to create and drop the per-test schemas."""
    engine = create_engine(postgres_url, pool_size=2)
    yield engine
    engine.dispose()


def _postgres_spec(url: str, schema: str, *, generic: bool = False) -> StoreSpec:
    """How the store under test opens ``schema``."""
    options = f"-csearch_path={schema}"
    if generic:  # SQLAlchemySessionStore(url): the schema rides in the URL's query
        generic_url = make_url(url).update_query_dict({"options": options})
        return StoreSpec(GENERIC_TARGET, (generic_url.render_as_string(hide_password=False),))
    return StoreSpec(POSTGRES_TARGET, (url,), {"connect_args": {"options": options}})


@pytest.fixture(scope="session")
def postgres_schemas(postgres_url: str, postgres_admin: Engine) -> Iterator[dict[bool, Any]]:
    """Schemas for the PostgreSQL harnesses, reused test after test (tests/pg_reuse.py).

    Keyed by ``generic``: the generic store and the PostgreSQL store each get theirs.
    """
    from .pg_reuse import SchemaPool

    def new_schema() -> str:
        schema = f"t_{uuid.uuid4().hex}"
        with postgres_admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        return schema

    def drop_schema(schema: str) -> None:
        with postgres_admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))

    def migrator(generic: bool) -> Any:
        def migrate_schema(schema: str) -> None:
            store: Any = _postgres_spec(postgres_url, schema, generic=generic).open()
            store.close()

        return migrate_schema

    pools = {
        generic: SchemaPool(postgres_admin, migrator(generic), new_schema, drop_schema)
        for generic in (False, True)
    }
    yield pools
    for pool in pools.values():
        pool.close()


def _postgres_harness(
    url: str, pool: Any, async_mode: Capability, *, generic: bool = False
) -> StoreHarness:
    schema = pool.take()
    return SpecHarness(
        "postgresql-generic" if generic else "postgresql",
        _postgres_spec(url, schema, generic=generic),
        {
            Capability.PERSISTENT, Capability.CROSS_PROCESS, Capability.SQL, async_mode,
            Capability.ENCRYPTION,
            Capability.USER_SCOPE, Capability.RETENTION, Capability.ARCHIVE, Capability.FORKS,
        },
        cleanup=lambda: pool.give_back(schema),
    )


@pytest.fixture(scope="session")
def postgres_async_mode(postgres_url: str, postgres_schemas: dict[bool, Any]) -> Capability:
    """How the PostgreSQL store runs its async API: native driver or thread pool.

    Declared from what the installed store really does (psycopg's async mode
    when greenlet is available), so the suite checks the right guarantee.
    """
    harness = _postgres_harness(
        postgres_url, postgres_schemas[False], Capability.ASYNC_THREADPOOL
    )
    try:
        native = harness.open().runtime.native_async
    finally:
        harness.close()
    return Capability.ASYNC_NATIVE if native else Capability.ASYNC_THREADPOOL


@pytest.fixture(scope="session")
def pgbouncer(postgres_url: str) -> Iterator[Any]:
    """A private PgBouncer (transaction pooling, 2 server connections per database).

    Skipped, with the reason, where pgbouncer is not installed (CI installs it).
    """
    from .pgbouncer import PgBouncer, pgbouncer_problem

    problem = pgbouncer_problem()
    if problem:
        pytest.skip(f"PgBouncer tests skipped: {problem}")
    bouncer = PgBouncer(postgres_url).start()
    yield bouncer
    bouncer.stop()


PGBOUNCER_CONNECT_ARGS: dict[str, Any] = {}
"""What a store behind a transaction-pooling PgBouncer needs: nothing (prepared statements
are off by default, see ``postgresql.PREPARE_THRESHOLD``)."""


def _bounced_spec(bouncer: Any, database: str) -> StoreSpec:
    url = bouncer.url(database).render_as_string(hide_password=False)
    return StoreSpec(POSTGRES_TARGET, (url,), {"connect_args": PGBOUNCER_CONNECT_ARGS})


@pytest.fixture(scope="session")
def pgbouncer_databases(
    pgbouncer: Any, postgres_url: str, postgres_admin: Engine
) -> Iterator[Any]:
    """Databases behind PgBouncer, reused test after test (tests/pg_reuse.py)."""
    from sqlalchemy.pool import NullPool

    from .pg_reuse import SchemaPool

    engines: dict[str, Engine] = {}

    def engine_on(database: str) -> Engine:  # direct, not through PgBouncer
        if database not in engines:
            url = make_url(postgres_url).set(database=database)
            engines[database] = create_engine(url, poolclass=NullPool)
        return engines[database]

    def new_database() -> str:
        database = f"t_{uuid.uuid4().hex}"
        with postgres_admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f'CREATE DATABASE "{database}"'))
        return database

    def drop_database(database: str) -> None:
        engines.pop(database, None)
        with postgres_admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))

    def migrate_database(database: str) -> None:
        store: Any = _bounced_spec(pgbouncer, database).open()
        store.close()

    pool = SchemaPool(engine_on, migrate_database, new_database, drop_database)
    yield pool
    pool.close()


@pytest.fixture
def bounced_database(pgbouncer: Any, postgres_admin: Engine) -> Iterator[str]:
    """A fresh database, as a URL through PgBouncer; dropped after the test."""
    name = f"t_{uuid.uuid4().hex}"
    with postgres_admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    yield pgbouncer.url(name).render_as_string(hide_password=False)
    with postgres_admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def _pgbouncer_harness(bouncer: Any, pool: Any, async_mode: Capability) -> StoreHarness:
    """A database of its own per test (reused, emptied, after it), reached through PgBouncer."""
    database = pool.take()
    return SpecHarness(
        "postgresql-pgbouncer",
        _bounced_spec(bouncer, database),
        {Capability.PERSISTENT, Capability.CROSS_PROCESS, Capability.SQL, async_mode},
        cleanup=lambda: pool.give_back(database),
    )


@pytest.fixture(scope="session")
def sqlite_migrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file the store migrated (once per pytest process), to copy per test.

    A copy is what a fresh file becomes when the store opens it, without running
    the migration chain again for every test (the migration tests start empty).
    """
    path = tmp_path_factory.mktemp("sqlite-migrated") / "chatflow.db"
    store: Any = StoreSpec(SQLITE_TARGET, (str(path),)).open()
    store.close()
    assert not path.with_name("chatflow.db-wal").exists(), "the template has a WAL left"
    return path


def _sqlite_file_harness(tmp_path: Path, migrated: Path) -> StoreHarness:
    path = tmp_path / "chatflow.db"
    shutil.copyfile(migrated, path)
    return SpecHarness(
        "sqlite-file",
        StoreSpec(SQLITE_TARGET, (str(path),)),
        {
            Capability.PERSISTENT,
            Capability.CROSS_PROCESS,
            Capability.SQL,
            Capability.ENCRYPTION,
            Capability.ASYNC_THREADPOOL,
            Capability.USER_SCOPE, Capability.RETENTION, Capability.ARCHIVE, Capability.FORKS,
        },
    )


def _sqlite_shared_uri_harness() -> StoreHarness:
    # A named shared-cache memory database lives while one connection is open:
    # the anchor keeps it alive between store instances, so reloads work, but
    # only inside this process.
    uri = f"file:chatflow_{uuid.uuid4().hex}?mode=memory&cache=shared"
    anchor = sqlite3.connect(uri, uri=True, check_same_thread=False)
    return SpecHarness(
        "sqlite-shared-uri",
        StoreSpec(SQLITE_TARGET, (uri,)),
        {
            Capability.PERSISTENT, Capability.SQL, Capability.EPHEMERAL, Capability.ENCRYPTION,
            Capability.USER_SCOPE, Capability.RETENTION, Capability.ARCHIVE, Capability.FORKS,
        },
        cleanup=anchor.close,
    )


@pytest.fixture(params=BACKENDS)
def store_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreHarness]:
    """The backend under test (overrides the conformance plugin's default)."""
    name: str = request.param
    harness: StoreHarness
    if name == "sqlite-file":
        harness = _sqlite_file_harness(tmp_path, request.getfixturevalue("sqlite_migrated"))
    elif name == "sqlite-memory":
        harness = SpecHarness(
            name,
            StoreSpec(SQLITE_TARGET, (":memory:",)),
            {
                Capability.SQL, Capability.EPHEMERAL, Capability.ENCRYPTION,
                Capability.USER_SCOPE, Capability.RETENTION, Capability.ARCHIVE, Capability.FORKS,
            },
        )
    elif name == "sqlite-shared-uri":
        harness = _sqlite_shared_uri_harness()
    elif name == "memory":
        harness = SpecHarness(
            name,
            StoreSpec(MEMORY_TARGET),
            {
                Capability.EPHEMERAL, Capability.USER_SCOPE, Capability.RETENTION,
                Capability.ARCHIVE, Capability.FORKS,
            },
        )
    elif name in ("postgresql", "postgresql-generic"):
        try:
            url: str = request.getfixturevalue("postgres_url")
        except PostgresUnreachable as exc:
            yield UnreachableHarness(name, str(exc))
            return
        generic = name == "postgresql-generic"
        pool = request.getfixturevalue("postgres_schemas")[generic]
        mode: Capability = request.getfixturevalue("postgres_async_mode")
        harness = _postgres_harness(url, pool, mode, generic=generic)
    elif name == "postgresql-pgbouncer":
        try:
            request.getfixturevalue("postgres_url")
        except PostgresUnreachable as exc:
            yield UnreachableHarness(name, str(exc))
            return
        harness = _pgbouncer_harness(
            request.getfixturevalue("pgbouncer"),
            request.getfixturevalue("pgbouncer_databases"),
            request.getfixturevalue("postgres_async_mode"),
        )
    else:  # pragma: no cover
        raise AssertionError(name)
    yield harness
    harness.close()


@pytest.fixture
def pg_url() -> str:
    """The PostgreSQL URL for tests that open their own stores (see ``pg_util``)."""
    from . import pg_util

    return pg_util.postgres_url()


@pytest.fixture
def pg_schema(pg_url: str) -> Iterator[str]:
    """A fresh schema on that server, dropped after the test."""
    from . import pg_util

    with pg_util.fresh_schema(pg_url) as schema:
        yield schema


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store_opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """Opens a new store instance on one database per call (think: one process each).

    For tests of the SQL stores' internals across the two built-in databases;
    every instance is closed after the test.
    """
    from contextlib import ExitStack

    from chatflow_sqlalchemy import SQLiteSessionStore

    from . import pg_util

    with ExitStack() as stack:
        if request.param == "sqlite":
            def open_one() -> Any:
                return stack.enter_context(SQLiteSessionStore(tmp_path / "x.db"))
        else:
            url = pg_util.postgres_url()
            schema = _pooled_schema(request, stack)

            def open_one() -> Any:
                return stack.enter_context(pg_util.schema_store(url, schema))
        yield open_one


def pytest_configure(config: pytest.Config) -> None:
    """Register the suite's marker here too, so ``-p no:chatflow_sqlalchemy`` still collects."""
    config.addinivalue_line(
        "markers", "chatflow_requires(*capabilities): needs these store capabilities"
    )


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Say where the PostgreSQL tests will run."""
    url: Any = os.environ.get(POSTGRES_ENV)
    where = _mask(url) if url else "testcontainers if Docker is usable, else skipped"
    return [f"chatflow-sqlalchemy PostgreSQL tests: {where}"]


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


SERVER_SKIPS = ("PostgreSQL tests skipped:", "MariaDB tests skipped:", "PgBouncer tests skipped:")


_CAPABILITY_SKIP = re.compile(
    r"^store '(?P<store>[^']+)' lacks capability (?P<missing>.+?) \(has: "
)


def _group_capability_skips(counts: dict[str, int]) -> tuple[list[str], dict[str, int]]:
    """One line per store: how many tests it skipped, and for which missing capability."""
    per_store: dict[str, Counter[str]] = {}
    rest: dict[str, int] = {}
    for reason, n in counts.items():
        match = _CAPABILITY_SKIP.match(reason)
        if match:
            missing = "+".join(part.strip() for part in match["missing"].split(","))
            per_store.setdefault(match["store"], Counter())[missing] += n
        else:
            rest[reason] = n
    lines = []
    for store, missing in sorted(per_store.items()):
        detail = ", ".join(f"{what} {n}" for what, n in missing.most_common())
        lines.append(f"  {store}: {sum(missing.values())} tests (lacks {detail})")
    return lines, rest


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Skips grouped by reason: one line per missing server, one line per store for capabilities.

    Replaces pytest's one-line-per-skipped-test list (``-rs`` still shows it).
    """
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if r.skipped]
    if not skipped:
        return
    counts = Counter(_skip_reason(report) for report in skipped)
    servers = {reason: n for reason, n in counts.items() if reason.startswith(SERVER_SKIPS)}
    stores, others = _group_capability_skips(
        {reason: n for reason, n in counts.items() if reason not in servers}
    )
    terminalreporter.section("skipped, by reason (pytest -rs lists every test)", sep="-")
    for reason, n in sorted(servers.items()):
        terminalreporter.line(f"{reason} ({n} tests)")
    if stores:
        terminalreporter.line("Tests a store cannot take (its capability flags):")
        for line in stores:
            terminalreporter.line(line)
    for reason, n in sorted(others.items(), key=lambda item: (-item[1], item[0])):
        terminalreporter.line(f"{n} x {reason}")


def _pooled_schema(request: pytest.FixtureRequest, stack: ExitStack) -> str:
    """A schema of ``postgres_schemas`` (migrated or empty), given back when ``stack`` closes.

    For the store openers' tests, whose stores migrate a schema they are given: the
    pool saves each of them the migration (tests/pg_reuse.py).
    """
    pool = request.getfixturevalue("postgres_schemas")[False]
    schema: str = pool.take()
    stack.callback(pool.give_back, schema)
    return schema


@pytest.fixture(params=SQL_KINDS)
def sql_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    """Opens SQL stores (given options) on one database per test (see ``tests/stores.py``)."""
    with ExitStack() as stack:
        yield open_on(request.param, stack, tmp_path, lambda: _pooled_schema(request, stack))


@pytest.fixture(params=[*SQL_KINDS, "memory"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    """Like ``sql_store``, the in-memory store too (one store for the whole test)."""
    with ExitStack() as stack:
        yield open_on(request.param, stack, tmp_path, lambda: _pooled_schema(request, stack))
