"""PostgreSQL specifics of ``sweep()``: a turn lock held by another process keeps its session."""

from __future__ import annotations

import time
from urllib.parse import quote

import pytest
from chatflow_agent import Agent

from chatflow_sqlalchemy import open_store
from chatflow_sqlalchemy.backends.postgresql import session_lock_key

from . import pg_util

pytestmark = pytest.mark.postgres
psycopg = pytest.importorskip("psycopg", reason="the postgres extra is not installed")


def test_sweep_keeps_a_session_whose_turn_lock_is_held_elsewhere() -> None:
    url = pg_util.postgres_url()
    with pg_util.fresh_schema(url) as schema:
        scoped = f"{url}?options={quote(f'-csearch_path={schema}')}"
        agent = Agent(name="a", instructions="", model="gemini-2.5-flash")
        with open_store(scoped, session_ttl_hours=0.0005) as store:
            for sid in ("busy", "idle"):
                store.get_or_create(sid, agent)
            time.sleep(2.5)
            dsn = url.replace("postgresql+psycopg://", "postgresql://")
            with psycopg.connect(dsn, autocommit=True) as other:  # another worker's turn
                other.execute("BEGIN")
                other.execute("SELECT pg_advisory_xact_lock(%s)", (session_lock_key("busy"),))
                assert store.sweep() == 1
                assert store.list_sessions() == ["busy"]
                other.execute("ROLLBACK")
            assert store.sweep() == 1
            assert store.list_sessions() == []
