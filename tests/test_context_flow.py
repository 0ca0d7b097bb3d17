"""Every I/O the store does runs in the caller's ``contextvars`` context.

A request id set in the request must be visible to an engine's
``before_cursor_execute`` listener for the store's statements (what tracing
and logging integrations rely on): on the caller's thread (sync), on the
store's I/O threads (async, on-disk SQLite) and in greenlets (async
PostgreSQL on psycopg's async driver).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from chatflow_agent import Agent, Runner
from sqlalchemy import Engine, event

from chatflow_sqlalchemy import SQLiteSessionStore
from chatflow_sqlalchemy.backends.postgresql import PostgresSessionStore
from chatflow_sqlalchemy.testing import ScriptedEngine

from .pg_util import fresh_schema, postgres_url, schema_connect_args

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "test_request_id", default=None
)
BOT = Agent(name="Bot", instructions="")


@contextmanager
def seen_request_ids() -> Iterator[list[tuple[str | None, str]]]:
    """Record ``(REQUEST_ID, statement)`` for every statement of every engine."""
    seen: list[tuple[str | None, str]] = []

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append((REQUEST_ID.get(), statement))

    event.listen(Engine, "before_cursor_execute", before)
    try:
        yield seen
    finally:
        event.remove(Engine, "before_cursor_execute", before)


@pytest.fixture(
    params=["sqlite-file", pytest.param("postgresql", marks=pytest.mark.postgres)]
)
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], Any]]:
    with ExitStack() as stack:
        if request.param == "sqlite-file":
            def opener() -> Any:
                return stack.enter_context(SQLiteSessionStore(tmp_path / "ctx.db"))
        else:
            url = postgres_url()
            schema = stack.enter_context(fresh_schema(url))

            def opener() -> Any:
                return stack.enter_context(
                    PostgresSessionStore(url, connect_args=schema_connect_args(schema))
                )
        yield opener


def _statements_of_request(seen: list[tuple[str | None, str]], request_id: str) -> None:
    assert seen, "the listener saw the store's statements"
    strangers = [statement for value, statement in seen if value != request_id]
    assert not strangers, f"statements run outside the request's context: {strangers[:3]}"


def test_sync_calls_run_in_the_callers_context(open_store: Callable[[], Any]) -> None:
    store = open_store()
    with seen_request_ids() as seen:
        REQUEST_ID.set("sync-1")
        try:
            ctx = store.get_or_create("s-sync", BOT)
            store.list_sessions()
            store.delete(ctx.session_id)
        finally:
            REQUEST_ID.set(None)
    _statements_of_request(seen, "sync-1")


def test_async_calls_and_runner_turns_run_in_the_callers_context(
    open_store: Callable[[], Any],
) -> None:
    store = open_store()
    runner = Runner(starting_agent=BOT, session_store=store, engine=ScriptedEngine())

    async def request(request_id: str, session_id: str) -> None:
        REQUEST_ID.set(request_id)
        await runner.run_async(session_id, "hello")
        await store.alist_sessions()
        await store.aget(session_id)
        await store.arecord_processed_message(f"m-{request_id}")

    async def scenario() -> None:
        await store.alist_sessions()  # warm up outside any request (engine, pool, threads)
        with seen_request_ids() as seen:
            await asyncio.create_task(request("async-1", "s-async"))
        _statements_of_request(seen, "async-1")

    asyncio.run(scenario())
