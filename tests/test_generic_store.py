"""The generic ``SQLAlchemySessionStore`` on a server backend: the store class does not matter.

A turn's lease is a row of the session, taken by portable SQL, so a store
opened as ``SQLAlchemySessionStore(engine=...)`` runs Runner turns and
excludes other processes from a session's turn exactly like the backend's own
class. (The URL form runs the whole conformance suite: ``postgresql-generic``
in ``conftest.py``.)
"""

from __future__ import annotations

import asyncio

import pytest
from chatflow_agent import Agent, Runner
from sqlalchemy import create_engine

from chatflow_sqlalchemy import SQLAlchemySessionStore
from chatflow_sqlalchemy.testing import ScriptedEngine

from .pg_util import fresh_schema, postgres_url, schema_connect_args

pytestmark = pytest.mark.postgres

BOT = Agent(name="Bot", instructions="")


def test_generic_store_on_a_postgres_engine_runs_runner_turns_under_a_cross_process_lease() -> None:
    url = postgres_url()
    with fresh_schema(url) as schema:
        engine = create_engine(url, connect_args=schema_connect_args(schema))
        other_engine = create_engine(url, connect_args=schema_connect_args(schema))
        try:
            with SQLAlchemySessionStore(engine=engine) as store, SQLAlchemySessionStore(
                engine=other_engine
            ) as other:
                runner = Runner(starting_agent=BOT, session_store=store, engine=ScriptedEngine())

                async def scenario() -> None:
                    for turn in range(3):
                        reply = await runner.run_async("s1", f"hello {turn}")
                        assert reply.content == f"Bot re: hello {turn}"
                    ctx = await store.aget_or_create("s1", BOT)
                    async with ctx.lock:
                        held = other.turns.leases.take("s1")
                        assert held is None, "another store (process) is kept out of the turn"
                    lease = other.turns.leases.take("s1")
                    assert lease is not None, "the turn gave its lease back"
                    other.turns.leases.release(lease)

                asyncio.run(scenario())
                reloaded = other.get("s1")
                assert reloaded is not None
                assert [m.content for m in reloaded.history][-2:] == ["hello 2", "Bot re: hello 2"]
        finally:
            engine.dispose()
            other_engine.dispose()


def test_engine_options_reach_the_engine_the_generic_store_creates() -> None:
    """Over the dialect's defaults: schema connect args, pool size; the store owns it."""
    url = postgres_url()
    with fresh_schema(url) as schema:
        store = SQLAlchemySessionStore(
            url,
            engine_options={"pool_size": 3, "connect_args": schema_connect_args(schema)},
        )
        with store:
            assert store.engine.pool.size() == 3  # type: ignore[attr-defined]
            store.get_or_create("s", BOT)
            with store.engine.connect() as conn:
                assert conn.exec_driver_sql("SELECT current_schema()").scalar() == schema
                parameters = conn.connection.dbapi_connection.info.get_parameters()  # type: ignore[union-attr]
                assert parameters.get("connect_timeout"), "the dialect's connect_args stay"
        assert store.engine.pool.checkedout() == 0  # type: ignore[attr-defined]


def test_engine_options_reach_the_postgres_store_through_open_store() -> None:
    from chatflow_sqlalchemy import open_store

    url = postgres_url()
    with fresh_schema(url) as schema:
        options = {"pool_size": 3, "connect_args": schema_connect_args(schema)}
        with open_store(url, engine_options=options) as store:
            assert type(store).__name__ == "PostgresSessionStore"
            assert store.engine.pool.size() == 3


def test_engine_options_with_a_callers_engine_are_refused() -> None:
    engine = create_engine("sqlite://")
    try:
        with pytest.raises(ValueError, match="configure the engine you pass"):
            SQLAlchemySessionStore(engine=engine, engine_options={"pool_size": 3})
    finally:
        engine.dispose()
