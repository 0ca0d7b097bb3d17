"""The store behind a real PgBouncer in transaction pooling mode (see ``tests/pgbouncer.py``).

The conformance suite runs through it as the ``postgresql-pgbouncer`` store
(conftest.py). Here: worker processes sharing sessions, and migrations from
processes that start at once, all through a pool of 2 server connections per
database, fewer than the clients. No setting is needed: the store prepares
no statement by default (PgBouncer 1.18 cannot carry a prepared statement
from one transaction to the next, whose server connection may be another).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from chatflow_sqlalchemy import migrate
from chatflow_sqlalchemy.testing import StoreSpec
from chatflow_sqlalchemy.testing.harness import run_workers

from . import _workers
from ._workers import POSTGRES, postgres_spec
from .conftest import PGBOUNCER_CONNECT_ARGS
from .test_migrations import HEAD, version_rows
from .test_processes import check_fleet_histories, run_fleet

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def _spec(url: str) -> StoreSpec:
    return postgres_spec(url)


@pytest.mark.parametrize("workers", [2, 4])
def test_workers_on_one_session_through_pgbouncer(
    bounced_database: str, tmp_path: Path, workers: int
) -> None:
    """Workers x turns on one session: every turn whole, in order, none lost."""
    spec = _spec(bounced_database)
    turns = 40 // workers
    log = run_fleet(spec, tmp_path, workers=workers, turns=turns, sessions=["a"], delay=0.01)
    assert len(log) == workers * turns
    check_fleet_histories(spec, ["a"], expected=2 * workers * turns)


def test_concurrent_turns_need_a_pool_slot_each_plus_one(
    postgres_url: str, postgres_admin: Engine, tmp_path: Path
) -> None:
    """Two workers each running two sessions at once: four turn locks held together.

    A held turn lock keeps a transaction open on its own connection, so it
    pins one PgBouncer server connection for the whole turn, and the turn's
    reads and writes need another. With ``default_pool_size = 2`` these turns
    stall until ``operation_timeout`` (the README's sizing rule: a pool of at
    least the turns in flight plus one); with 5 they pass.
    """
    from .pgbouncer import PgBouncer, pgbouncer_problem

    problem = pgbouncer_problem()
    if problem:
        pytest.skip(f"PgBouncer tests skipped: {problem}")
    bouncer = PgBouncer(postgres_url, pool_size=5).start()
    name = f"t_{uuid.uuid4().hex}"
    with postgres_admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        spec = _spec(bouncer.url(name).render_as_string(hide_password=False))
        log = run_fleet(spec, tmp_path, workers=2, turns=10, sessions=["a", "b"], delay=0.01)
        assert len(log) == 40
        check_fleet_histories(spec, ["a", "b"], expected=40)
    finally:
        bouncer.stop()
        with postgres_admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def test_processes_migrating_one_empty_database_through_pgbouncer(
    bounced_database: str,
) -> None:
    """Six processes open one empty database at once: the chain runs once, no drift.

    The migration lock is ``pg_advisory_xact_lock``, held by the migrating
    transaction, so it survives a pooler that moves sessions between clients.
    """
    spec = StoreSpec(POSTGRES, (bounced_database,), {"connect_args": PGBOUNCER_CONNECT_ARGS})
    ran = run_workers(_workers.open_counting_migrations, [(spec,)] * 6, timeout=180)
    assert sum(1 for lines in ran if lines) == 1, f"one process migrated: {ran}"
    engine = migrate.open_engine(bounced_database)
    try:
        assert version_rows(engine) == [HEAD]
        assert migrate.drift(engine) == []
    finally:
        engine.dispose()
