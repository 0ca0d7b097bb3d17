"""The async API under load: disk work stays off the event loop, and the Runner at scale."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Role, Runner

from chatflow_sqlalchemy import SessionStore, SQLiteSessionStore

from .fakes import ToolThenAnswer
from .pg_util import fresh_schema, postgres_url, schema_connect_args

HANG_GUARD_SECONDS = 60.0  # only against a hang; never a speed bound


async def test_loop_keeps_ticking_while_eight_disk_writers_work_on_the_pool(
    tmp_path: Path,
) -> None:
    """Structure, not speed: every disk flush runs on a store pool thread, and while it
    runs the event loop keeps serving other tasks (a ticker advances mid-flush).

    The loop-lag figure itself is measured by ``python -m benchmarks`` (``looplag``).
    """
    store = SQLiteSessionStore(tmp_path / "lag.db")
    agent = Agent(name="Bot", instructions="")
    payload = "x" * 2048
    loop_thread = threading.current_thread()
    ticks = [0]
    flushes: list[tuple[str, bool]] = []  # (thread name, did the loop tick during it)
    original = store._flush_context

    def spy(ctx: Any) -> None:
        here = threading.current_thread()
        advanced = False
        stalled_before = any(not ok for _, ok in flushes)  # fail once, not once per flush
        if here is not loop_thread and not stalled_before:  # on the loop it could never tick
            seen = ticks[0]
            deadline = time.monotonic() + HANG_GUARD_SECONDS
            while ticks[0] == seen and time.monotonic() < deadline:
                time.sleep(0.0005)
            advanced = ticks[0] != seen
        flushes.append((here.name, advanced))
        original(ctx)

    store._flush_context = spy  # type: ignore[method-assign]

    async def writer(index: int) -> None:
        session = await store.aget_or_create(f"writer-{index}", agent)
        for turn in range(40):
            role = Role.USER if turn % 2 == 0 else Role.MODEL
            await session.aadd_message(Message(role=role, content=payload))

    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            ticks[0] += 1
            await asyncio.sleep(0.0005)

    tick = asyncio.create_task(ticker())
    try:
        await asyncio.gather(*(writer(i) for i in range(8)))
    finally:
        done.set()
        await tick
        await store.aclose()
    assert len(flushes) >= 8 * 40
    on_loop = [name for name, _ in flushes if not name.startswith("chatflow-io")]
    assert not on_loop, f"{len(on_loop)} flushes ran off the store's pool, e.g. on {on_loop[0]}"
    assert all(advanced for _, advanced in flushes), "the loop stood still during a flush"
    reopened = SQLiteSessionStore(tmp_path / "lag.db")
    try:
        assert all(len(reopened.get(f"writer-{i}").history) == 40 for i in range(8))  # type: ignore[union-attr]
    finally:
        reopened.close()


async def test_disk_io_runs_on_the_private_pool_not_the_loop(tmp_path: Path) -> None:
    store = SQLiteSessionStore(tmp_path / "pool.db")
    seen: list[str] = []
    original = store._flush_context

    def spy(ctx: Any) -> None:
        seen.append(threading.current_thread().name)
        original(ctx)

    store._flush_context = spy  # type: ignore[method-assign]
    session = await store.aget_or_create("s", Agent(name="Bot", instructions=""))
    await session.aadd_message(Message(role=Role.USER, content="hi"))
    await store.aclose()
    assert seen and all(name.startswith("chatflow-io") for name in seen)
    assert store.runtime.pool is None  # aclose shut the pool down


def lookup(q: str) -> str:
    return f"found {q}"


@pytest.fixture(params=["sqlite-file", "sqlite-memory", "memory",
                        pytest.param("postgresql", marks=pytest.mark.postgres)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    kind = request.param
    if kind == "postgresql":
        url = postgres_url()
        with fresh_schema(url) as schema:
            from chatflow_sqlalchemy import PostgresSessionStore

            def open_pg(**kw: Any) -> Any:
                return PostgresSessionStore(url, connect_args=schema_connect_args(schema), **kw)

            yield {"open": open_pg, "persistent": True}
        return
    if kind == "sqlite-file":
        yield {"open": lambda **kw: SQLiteSessionStore(tmp_path / "r.db", **kw),
               "persistent": True}
    elif kind == "sqlite-memory":
        yield {"open": lambda **kw: SQLiteSessionStore(":memory:", **kw), "persistent": False}
    else:
        yield {"open": lambda **kw: SessionStore(**kw), "persistent": False}


@pytest.mark.usefixtures("postgres_connection_budget")  # fifty turn locks at once
async def test_runner_fifty_concurrent_sessions_ten_turns(backend: dict[str, Any]) -> None:
    store = backend["open"](default_max_turns=40)
    runner = Runner(
        starting_agent=Agent(name="Bot", instructions="", tools=[lookup]),
        session_store=store,
        engine=ToolThenAnswer("lookup"),  # a yield to the loop before each answer
    )

    async def conversation(index: int) -> None:
        for turn in range(10):
            response = await runner.run_async(f"user-{index}", f"u{index}-t{turn}")
            assert response.content == f"answer to u{index}-t{turn}"

    await asyncio.gather(*(conversation(i) for i in range(50)))
    check = store
    if backend["persistent"]:
        store.close()
        check = backend["open"](default_max_turns=40)
    try:
        assert len(check.list_sessions()) == 50
        for index in range(50):
            session = check.get(f"user-{index}")
            assert session is not None
            history = session.history
            assert len(history) == 40
            questions = [m.content for m in history if m.role == Role.USER]
            assert questions == [f"u{index}-t{t}" for t in range(10)]
            for start in range(0, 40, 4):
                user, call, result, answer = history[start : start + 4]
                assert call.tool_calls and result.tool_results
                assert result.tool_results[0].tool_call_id == call.tool_calls[0].id
                assert answer.content == f"answer to {user.content}"
    finally:
        check.close()


async def test_async_store_context_manager_closes(tmp_path: Path) -> None:
    async with SQLiteSessionStore(tmp_path / "cm.db") as store:
        assert await store.arecord_processed_message("m1")
    with pytest.raises(RuntimeError, match="closed"):
        store.list_sessions()


@pytest.mark.parametrize("base", ["memory", "sqlite", pytest.param("postgresql",
                                                                   marks=pytest.mark.postgres)])
async def test_a_subclass_run_blocking_runs_its_contexts_async_writes(
    base: str, tmp_path: Path
) -> None:
    """A store subclass's ``_run_blocking`` is how its contexts run their async writes too.

    The contexts reach their store through an owner object: it hands the work to
    the store's own method, so an override (the PostgreSQL store's time bound is
    one) is honoured on every store, the in-memory one included.
    """
    ran: list[str] = []

    def counting(cls: Any) -> Any:
        class Counting(cls):  # type: ignore[misc, valid-type]
            async def _run_blocking(self, fn: Any, *args: Any) -> Any:
                ran.append(getattr(fn, "__name__", repr(fn)))
                return await super()._run_blocking(fn, *args)

        return Counting

    if base == "postgresql":
        from chatflow_sqlalchemy import PostgresSessionStore

        url = postgres_url()
        with fresh_schema(url) as schema:
            store = counting(PostgresSessionStore)(
                url, connect_args=schema_connect_args(schema)
            )
            await _add_one_async(store, ran)
        return
    store = (counting(SessionStore)() if base == "memory"
             else counting(SQLiteSessionStore)(tmp_path / "sub.db"))
    await _add_one_async(store, ran)


async def _add_one_async(store: Any, ran: list[str]) -> None:
    try:
        ctx = await store.aget_or_create("s", Agent(name="Bot", instructions=""))
        ran.clear()
        await ctx.aadd_message(Message(role=Role.USER, content="hi"))
        assert ran == ["add_message"]
        assert [m.content for m in store.get("s").history] == ["hi"]
    finally:
        await store.aclose()


@pytest.mark.postgres
async def test_postgres_async_runs_natively_on_the_loop_without_threads() -> None:
    import greenlet

    from chatflow_sqlalchemy import PostgresSessionStore

    url = postgres_url()
    with fresh_schema(url) as schema:
        store = PostgresSessionStore(url, connect_args=schema_connect_args(schema))
        seen: list[tuple[str, bool]] = []
        original = store._flush_context

        def spy(ctx: Any) -> None:
            in_greenlet = greenlet.getcurrent().parent is not None
            seen.append((threading.current_thread().name, in_greenlet))
            original(ctx)

        store._flush_context = spy  # type: ignore[method-assign]
        try:
            session = await store.aget_or_create("s", Agent(name="Bot", instructions=""))
            await asyncio.gather(
                *(session.aadd_message(Message(role=Role.USER, content=f"m{i}")) for i in range(10))
            )
            assert await store.arecord_processed_message("w1")
            assert not await store.arecord_processed_message("w1")
        finally:
            await store.aclose()
        assert seen and all(entry == (threading.main_thread().name, True) for entry in seen)
        assert store.runtime.pool is None  # the thread pool was never started
        fresh = PostgresSessionStore(url, connect_args=schema_connect_args(schema))
        try:
            contents = [m.content for m in fresh.get("s").history]  # type: ignore[union-attr]
            assert sorted(contents, key=lambda c: int(c[1:])) == [f"m{i}" for i in range(10)]
        finally:
            fresh.close()


async def test_aiosqlite_url_runs_natively(tmp_path: Path) -> None:
    from chatflow_sqlalchemy import open_store

    url = f"sqlite+aiosqlite:///{tmp_path / 'aio.db'}"
    store = open_store(url)
    try:
        assert store.runtime.native_async
        session = await store.aget_or_create("s", Agent(name="Bot", instructions=""))
        await session.aadd_message(Message(role=Role.USER, content="hello"))
        assert await store.arecord_processed_message("m1")
        assert await store.alist_sessions() == ["s"]
    finally:
        await store.aclose()
    assert store.runtime.pool is None
    reopened = SQLiteSessionStore(tmp_path / "aio.db")
    try:
        assert [m.content for m in reopened.get("s").history] == ["hello"]  # type: ignore[union-attr]
        assert reopened.is_message_processed("m1")
    finally:
        reopened.close()


@pytest.mark.parametrize("base", ["memory", "sqlite"])
async def test_a_wrapper_set_on_the_store_after_it_opened_runs_its_contexts_writes(
    base: str, tmp_path: Path
) -> None:
    """Contexts call the store's ``_run_blocking`` and ``_flush_context`` as it has them now.

    A test or benchmark wraps them on an open store (this module's spies do):
    the in-memory store honours that as the SQL stores do.
    """
    store: Any = SessionStore() if base == "memory" else SQLiteSessionStore(tmp_path / "w.db")
    seen: list[str] = []
    flush, run_blocking = store._flush_context, store._run_blocking

    def flush_spy(ctx: Any) -> None:
        seen.append("flush")
        flush(ctx)

    async def run_spy(fn: Any, *args: Any) -> Any:
        seen.append("run")
        return await run_blocking(fn, *args)

    store._flush_context, store._run_blocking = flush_spy, run_spy
    try:
        ctx = await store.aget_or_create("s", Agent(name="Bot", instructions=""))
        seen.clear()
        await ctx.aadd_message(Message(role=Role.USER, content="hi"))
        assert seen == ["run", "flush"]
    finally:
        await store.aclose()
