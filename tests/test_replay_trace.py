"""Nothing the store writes bypasses SQLAlchemy's events: what they saw, replayed, is the database.

Turns (a claim, a handoff, metadata, pruning, a rollback, a delete) run on
one database while listeners on every engine in ``store.engines`` record each
statement the driver is given, with its parameters and the commits
(``benchmarks/replay.py``, whose cost figures rest on the same trace). The
trace is then sent on plain driver connections to a second database that the
store prepared identically. A statement sent around the events (a raw cursor,
a driver call) would leave the two databases different.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from chatflow_agent import Agent, Message, Role, ToolCall, ToolResult

from benchmarks.replay import capture, replay_postgres, replay_sqlite
from chatflow_sqlalchemy import PostgresSessionStore, SQLAlchemySessionStore, SQLiteSessionStore

from . import pg_util

TRIAGE = Agent(name="Triage", instructions="")
BILLING = Agent(name="Billing", instructions="")
TABLES = ("chatflow_sessions", "chatflow_messages", "chatflow_processed_messages")


def _turns(store: SQLAlchemySessionStore) -> None:
    """What a day of webhooks does to a store, through its public API."""
    store.set_agent_resolver({"Triage": TRIAGE, "Billing": BILLING}.get)

    async def run() -> None:
        for k in range(6):
            session_id = f"+55{k % 2}"
            assert store.record_processed_message(f"wamid-{k}")
            session = store.get_or_create(session_id, TRIAGE, metadata={"k": k})
            session.max_turns = 2
            async with session.lock:
                checkpoint = len(session.history)
                session.add_message(Message(role=Role.USER, content=f"oi {k}"))
                session.add_message(Message(role=Role.MODEL, tool_calls=[
                    ToolCall(id=f"c{k}", name="lookup", args={"n": k})]))
                session.add_message(Message(role=Role.TOOL, tool_results=[
                    ToolResult(tool_call_id=f"c{k}", name="lookup", content={"ok": True})]))
                if k == 3:
                    session.rollback_to(checkpoint)
                    continue
                session.add_message(Message(role=Role.MODEL, content=f"pronto {k}"))
                session.metadata["last"] = k
                session.set_active_agent(BILLING if k % 3 == 0 else TRIAGE)
        assert not store.record_processed_message("wamid-0")
        store.get_or_create("+55gone", TRIAGE).add_message(Message(role=Role.USER, content="x"))
        assert store.delete("+55gone")

    asyncio.run(run())


def _contents(engine: sa.Engine) -> dict[str, list[tuple[Any, ...]]]:
    metadata = sa.MetaData()
    with engine.connect() as conn:
        tables = [sa.Table(name, metadata, autoload_with=conn) for name in TABLES]
        return {
            table.name: sorted(tuple(map(repr, row))
                               for row in conn.execute(sa.select(table)).all())
            for table in tables
        }


def _takes_a_lease(statement: str | None) -> bool:
    """Whether ``statement`` is a turn's take of its session's lease."""
    return " ".join((statement or "").split()).startswith(
        "UPDATE chatflow_sessions SET lease_owner="
    ) and "RETURNING" in (statement or "")


def _traced(store: SQLAlchemySessionStore) -> Any:
    with capture(store.engines) as trace:
        _turns(store)
    store.close()
    return trace


def test_sqlite_replayed_trace_is_the_database(tmp_path: Path) -> None:
    SQLiteSessionStore(tmp_path / "empty.db").close()
    shutil.copyfile(tmp_path / "empty.db", tmp_path / "replayed.db")
    trace = _traced(SQLiteSessionStore(tmp_path / "empty.db"))
    assert any(step[2] == "BEGIN IMMEDIATE" for step in trace.steps)
    assert any(_takes_a_lease(step[2]) for step in trace.steps)
    assert any(step[1] == "many" for step in trace.steps)  # the messages' executemany

    replay_sqlite(str(tmp_path / "replayed.db"), trace)
    original = sa.create_engine(f"sqlite:///{tmp_path / 'empty.db'}")
    replayed = sa.create_engine(f"sqlite:///{tmp_path / 'replayed.db'}")
    expected = _contents(original)
    assert expected["chatflow_messages"], "the turns wrote nothing"
    assert _contents(replayed) == expected


@pytest.mark.postgres
def test_postgres_replayed_trace_is_the_database() -> None:
    url = pg_util.postgres_url()
    with pg_util.fresh_schema(url) as original, pg_util.fresh_schema(url) as replayed:
        PostgresSessionStore(url, connect_args=pg_util.schema_connect_args(replayed)).close()
        store = PostgresSessionStore(url, connect_args=pg_util.schema_connect_args(original))
        trace = _traced(store)
        assert any(_takes_a_lease(step[2]) for step in trace.steps)

        replay_postgres(url, replayed, trace)
        engines = [sa.create_engine(url, connect_args=pg_util.schema_connect_args(schema))
                   for schema in (original, replayed)]
        try:
            expected, got = (_contents(engine) for engine in engines)
        finally:
            for engine in engines:
                engine.dispose()
        assert expected["chatflow_messages"], "the turns wrote nothing"
        assert got == expected
