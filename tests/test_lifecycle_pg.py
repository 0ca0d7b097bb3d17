"""``sweep()`` on PostgreSQL through ``open_store``: a turn's lease keeps its session.

A session under a live turn lease (judged by the server's clock) is not
swept, whoever holds it; once the turn ended, or the lease of a holder that
died expired, the session is swept like any other.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from urllib.parse import quote

import pytest
from chatflow_agent import Agent

from chatflow_sqlalchemy import open_store

from . import pg_util

pytestmark = pytest.mark.postgres

AGENT = Agent(name="a", instructions="", model="gemini-2.5-flash")

TTL_HOURS = 0.0002
"""Sessions expire 0.72 s after their last write."""

EXPIRED_AFTER = 1.0
"""Seconds after which sessions last written now are expired under :data:`TTL_HOURS`."""

HANG_GUARD = 60.0
"""Bound of the wait for a lease to expire (a lease of one second)."""


@pytest.fixture
def scoped_url() -> Iterator[str]:
    """The server's URL with a fresh schema as every connection's search path."""
    url = pg_util.postgres_url()
    with pg_util.fresh_schema(url) as schema:
        yield f"{url}?options={quote(f'-csearch_path={schema}')}"


def test_sweep_keeps_a_session_whose_turn_runs_in_another_store(scoped_url: str) -> None:
    with open_store(scoped_url, session_ttl_hours=TTL_HOURS) as store, open_store(
        scoped_url
    ) as other:
        for sid in ("busy", "idle"):
            store.get_or_create(sid, AGENT)
        time.sleep(EXPIRED_AFTER)
        ctx = other.get_or_create("busy", AGENT)

        async def sweep_during_the_other_stores_turn() -> int:
            async with ctx.lock:  # another worker's turn, with nothing to write
                return store.sweep()

        assert asyncio.run(sweep_during_the_other_stores_turn()) == 1
        assert store.list_sessions() == ["busy"]
        assert store.sweep() == 1, "the ended turn's session is expired again"
        assert store.list_sessions() == []


def test_sweep_takes_a_dead_holders_session_once_its_lease_expired(scoped_url: str) -> None:
    """A lease never given back (its worker died) keeps the session only until it expires."""
    with open_store(scoped_url, session_ttl_hours=TTL_HOURS) as store, open_store(
        scoped_url, turn_lease_seconds=1.0
    ) as dead:
        store.get_or_create("abandoned", AGENT)
        time.sleep(EXPIRED_AFTER)
        assert dead.turns.leases.take("abandoned") is not None  # and never released
        deadline = time.monotonic() + HANG_GUARD
        while store.sweep() == 0:
            assert time.monotonic() < deadline, "the expired lease still keeps its session"
            time.sleep(0.1)
        assert store.list_sessions() == []
