"""Claim leases on the database's clock: what each dialect reads, and what it stores.

The behaviour (a worker whose clock is off neither takes over a live claim nor
stores a lease of another length) is the kit's ``TestLeaseClock``, on every
backend; these are the SQL store's own details.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.dialects import mssql

from chatflow_sqlalchemy import SQLiteSessionStore
from chatflow_sqlalchemy.clock import CLAIM_LEASE, CLAIM_NOW
from chatflow_sqlalchemy.models import ChatflowProcessedMessage as Row
from chatflow_sqlalchemy.sql_claims import _RENEW

from . import pg_util


def test_sqlite_stores_the_databases_time_in_the_columns_own_text(tmp_path: Path) -> None:
    """Text comparisons with stored values hold only if the clock writes the same format."""
    with SQLiteSessionStore(tmp_path / "clock.db") as store, store.claim("m1") as claim:
        assert claim.acquired
        with store.engine.connect() as conn:
            raw = conn.execute(
                text("SELECT claimed_at, lease_expires_at FROM chatflow_processed_messages")
            ).one()
            typed = conn.execute(select(Row.claimed_at, Row.lease_expires_at)).one()
    stamp = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}$")
    assert all(stamp.match(value) for value in raw), raw
    assert all(value.utcoffset() == timedelta(0) for value in typed), typed


@pytest.mark.postgres
def test_postgresql_reads_the_statements_time_not_the_transactions() -> None:
    """Inside a long transaction the clock still moves: ``now()`` would not."""
    url = pg_util.postgres_url()
    with (
        pg_util.fresh_schema(url) as schema,
        pg_util.schema_store(url, schema) as store,
        store.engine.connect() as conn,
    ):
        started = conn.execute(text("SELECT now()")).scalar_one()
        time.sleep(0.05)
        clock, lease = conn.execute(select(CLAIM_NOW, CLAIM_LEASE), {"lease_seconds": 30.0}).one()
        conn.rollback()
    assert clock > started
    assert lease - clock == timedelta(seconds=30)


def test_a_database_without_a_clock_of_its_own_keeps_the_workers_value() -> None:
    """Another dialect renders the worker's bind parameter, so its backends keep working."""
    sql = str(_RENEW.compile(dialect=mssql.dialect()))
    assert "lease_expires_at=:lease " in sql, sql


def test_every_clocked_dialect_reads_the_database(tmp_path: Path) -> None:
    """SQLite, PostgreSQL and MySQL/MariaDB render a server-side clock, no bind parameter."""
    from sqlalchemy.dialects import mysql, postgresql, sqlite

    expected: dict[Any, str] = {
        sqlite.dialect(): "strftime(",
        postgresql.dialect(): "statement_timestamp()",
        mysql.dialect(): "UTC_TIMESTAMP(6)",
    }
    for dialect, clock in expected.items():
        sql = str(_RENEW.compile(dialect=dialect))
        assert clock in sql and "lease)" not in sql and ":lease " not in sql, sql


def test_mariadb_reads_utc_whatever_the_sessions_time_zone() -> None:
    """``DATETIME(6)`` columns hold naive UTC: the clock must not follow ``time_zone``."""
    import os

    from sqlalchemy import create_engine

    pytest.importorskip("pymysql", reason="the MariaDB plugin's driver is not installed")
    url = os.environ.get("CHATFLOW_TEST_MARIADB_URL")
    if not url:
        pytest.skip("set CHATFLOW_TEST_MARIADB_URL=mysql+pymysql://user@host:3306/db to run it")
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            conn.execute(text("SET time_zone = '+05:00'"))
            clock, utc, local = conn.execute(
                select(CLAIM_NOW, text("UTC_TIMESTAMP(6)"), text("NOW(6)"))
            ).one()
    finally:
        engine.dispose()
    assert clock == utc.replace(tzinfo=clock.tzinfo)
    assert local - utc == timedelta(hours=5)


def test_a_sweeper_whose_clock_runs_ahead_keeps_a_session_under_a_live_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep judges a claim's lease as the claims do, by the database's clock."""
    from chatflow_agent import Agent

    from chatflow_sqlalchemy import store as store_module
    from chatflow_sqlalchemy.values import utcnow

    with SQLiteSessionStore(tmp_path / "sweep.db", session_ttl_hours=1) as store:
        store.get_or_create("s1", Agent(name="Bot", instructions=""))
        with store.claim("m1", session_id="s1") as claim:
            assert claim.acquired
            monkeypatch.setattr(store_module, "utcnow", lambda: utcnow() + timedelta(hours=2))
            assert store.sweep() == 0
            assert "s1" in store.list_sessions()
        assert store.sweep() == 1  # the claim is done: the session is two hours stale


def _skew_every_clock(monkeypatch: pytest.MonkeyPatch, shift: timedelta) -> None:
    """Every wall-clock read of the package goes through ``values.utcnow``: skew them all."""
    import sys

    from chatflow_sqlalchemy import values

    real = values.utcnow
    for name, module in list(sys.modules.items()):
        if name.startswith("chatflow_sqlalchemy") and getattr(module, "utcnow", None) is real:
            monkeypatch.setattr(module, "utcnow", lambda: real() + shift)


def test_a_claim_done_by_its_turn_is_stamped_by_the_databases_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dedup TTL of a finished id runs from the database's time, like its lease did."""
    import asyncio

    from chatflow_agent import Agent, Message, Role

    from chatflow_sqlalchemy.values import utcnow

    with SQLiteSessionStore(tmp_path / "done.db") as store:
        _skew_every_clock(monkeypatch, timedelta(hours=2))

        async def claimed_turn() -> None:
            async with store.claim("m1", session_id="s") as claim:
                ctx = await store.aget_or_create("s", Agent(name="Bot", instructions=""))
                async with ctx.lock:
                    ctx.add_message(Message(role=Role.USER, content="hi"))
                    ctx.add_message(Message(role=Role.MODEL, content="hello"))
                claim.response = "hello"

        asyncio.run(claimed_turn())
        monkeypatch.undo()
        with store.engine.connect() as conn:
            query = select(Row.processed_at).where(Row.message_id == "m1")
            stamped = conn.execute(query).scalar_one()
    assert abs(stamped - utcnow()) < timedelta(minutes=30), stamped
