"""Many event loops, one store: threads that each call ``asyncio.run`` per turn.

Sync web servers (Flask, Django, gunicorn threads) call ``Runner.run`` per
request, i.e. ``asyncio.run`` per call, in several threads over one shared
store. Turns must neither deadlock, nor get lost, nor interleave within a
session. Hang guards only (joins with a generous deadline); no timing bounds.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Role, Runner

from chatflow_sqlalchemy import SessionStore, SQLAlchemySessionStore, SQLiteSessionStore
from chatflow_sqlalchemy.backends.postgresql import PostgresSessionStore
from chatflow_sqlalchemy.testing import ScriptedEngine

from .pg_util import fresh_schema, postgres_url, schema_connect_args

THREADS = 4
TURNS = 25
HANG_GUARD = 600.0
BOT = Agent(name="Bot", instructions="")


@pytest.fixture(
    params=["sqlite-file", "memory", pytest.param("postgresql", marks=pytest.mark.postgres)]
)
def shared_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    turns = THREADS * TURNS
    with ExitStack() as stack:
        if request.param == "sqlite-file":
            store: Any = SQLiteSessionStore(tmp_path / "loops.db", default_max_turns=turns)
        elif request.param == "memory":
            store = SessionStore(default_max_turns=turns)
        else:
            (store,) = _postgres_stores(stack, 1, default_max_turns=turns)
        stack.callback(store.close)
        yield store


def _postgres_stores(stack: ExitStack, count: int, **options: Any) -> list[Any]:
    """``count`` PostgreSQL stores on one fresh schema (dropped when ``stack`` closes)."""
    url = postgres_url()
    schema = stack.enter_context(fresh_schema(url))
    return [
        PostgresSessionStore(url, connect_args=schema_connect_args(schema), **options)
        for _ in range(count)
    ]


def _run_threads(target: Callable[[int], None]) -> None:
    errors: list[BaseException] = []

    def guarded(index: int) -> None:
        try:
            target(index)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,), daemon=True) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG_GUARD)
    assert not [t for t in threads if t.is_alive()], "a thread hung (deadlock)"
    assert not errors, errors


def _assert_all_turns_whole(store: Any, session_id: str, questions: set[str]) -> None:
    ctx = store.get(session_id)
    assert ctx is not None
    history = ctx.history
    asked = [m.content for m in history if m.role == Role.USER]
    assert sorted(asked) == sorted(questions), "no turn lost, none doubled"
    for question, answer in zip(history[::2], history[1::2], strict=True):
        assert question.role == Role.USER
        assert answer.content == f"Bot re: {question.content}", "turns never interleave"


def test_threads_with_their_own_loops_share_one_session(shared_store: Any) -> None:
    runner = Runner(starting_agent=BOT, session_store=shared_store, engine=ScriptedEngine(0.001))

    def worker(index: int) -> None:
        for turn in range(TURNS):
            reply = asyncio.run(runner.run_async("shared", f"t{index}-{turn}"))
            assert reply.content == f"Bot re: t{index}-{turn}"

    _run_threads(worker)
    expected = {f"t{i}-{t}" for i in range(THREADS) for t in range(TURNS)}
    _assert_all_turns_whole(shared_store, "shared", expected)


def test_threads_with_their_own_loops_on_distinct_sessions(shared_store: Any) -> None:
    runner = Runner(starting_agent=BOT, session_store=shared_store, engine=ScriptedEngine(0.001))

    def worker(index: int) -> None:
        for turn in range(TURNS):
            reply = asyncio.run(runner.run_async(f"own-{index}", f"t{index}-{turn}"))
            assert reply.content == f"Bot re: t{index}-{turn}"

    _run_threads(worker)
    for index in range(THREADS):
        expected = {f"t{index}-{t}" for t in range(TURNS)}
        _assert_all_turns_whole(shared_store, f"own-{index}", expected)


@pytest.fixture(params=["sqlite-file", pytest.param("postgresql", marks=pytest.mark.postgres)])
def two_stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    """Two stores on one database: the process under test and "another process"."""
    with ExitStack() as stack:
        if request.param == "sqlite-file":
            path = tmp_path / "two.db"
            stores = [SQLiteSessionStore(path, default_max_turns=100) for _ in range(2)]
        else:
            stores = _postgres_stores(stack, 2, default_max_turns=100)
        for store in stores:
            stack.callback(store.close)
        yield stores[0], stores[1]


def test_lookups_from_other_threads_never_drop_a_turns_unsaved_messages(
    two_stores: tuple[Any, Any],
) -> None:
    """A lookup refreshes the shared context; a turn open (or ending) on it must keep its messages.

    Another store keeps moving the session, so every lookup finds the
    database ahead of the context; the turns run meanwhile in their own loops.
    """
    store, elsewhere = two_stores
    runner = Runner(starting_agent=BOT, session_store=store, engine=ScriptedEngine(0.0))
    store.get_or_create("busy", BOT)
    done = threading.Event()

    def look_up() -> None:
        while not done.is_set():
            store.get("busy")

    def move_elsewhere() -> None:
        count = 0
        while not done.is_set():
            elsewhere.get("busy").metadata["moved"] = count
            count += 1

    helpers = [threading.Thread(target=look_up), threading.Thread(target=move_elsewhere)]
    for helper in helpers:
        helper.start()
    try:
        for turn in range(TURNS * 2):
            asyncio.run(runner.run_async("busy", f"q{turn}"))
    finally:
        done.set()
        for helper in helpers:
            helper.join(HANG_GUARD)
    _assert_all_turns_whole(elsewhere, "busy", {f"q{turn}" for turn in range(TURNS * 2)})


@pytest.fixture(
    params=["sqlite-aiosqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
)
def native_async_pair(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    """A native-async store (greenlets on the loop thread) and a sync "other process"."""
    with ExitStack() as stack:
        if request.param == "sqlite-aiosqlite":
            path = tmp_path / "native.db"
            mine: Any = SQLAlchemySessionStore(
                f"sqlite+aiosqlite:///{path}", default_max_turns=1000
            )
            other: Any = SQLiteSessionStore(path, default_max_turns=1000)
        else:
            mine, other = _postgres_stores(stack, 2, default_max_turns=1000)
        for store in (mine, other):
            stack.callback(store.close)
        yield mine, other


def test_native_async_writes_survive_lookups_racing_them(
    native_async_pair: tuple[Any, Any],
) -> None:
    """Outside a turn, ``aadd_message`` writes while ``aget`` refreshes the same context.

    On a native-async store both run in greenlets on the loop thread, where the
    context's thread mutex cannot keep them apart: a refresh must not install
    the database's rows (another process keeps writing) over a write in progress.
    """
    mine, other = native_async_pair
    writes = 120
    done = threading.Event()

    def write_elsewhere() -> None:
        theirs = other.get_or_create("raced", BOT)
        count = 0
        while not done.is_set() and count < 600:  # the window keeps every message
            theirs.add_message(Message(role=Role.USER, content=f"theirs-{count}"))
            count += 1

    async def scenario() -> None:
        ctx = await mine.aget_or_create("raced", BOT)

        async def write() -> None:
            for index in range(writes):
                await ctx.aadd_message(Message(role=Role.USER, content=f"mine-{index}"))

        async def look_up() -> None:
            for _ in range(writes * 3):
                await mine.aget("raced")

        await asyncio.gather(write(), look_up())

    other.get_or_create("raced", BOT)
    helper = threading.Thread(target=write_elsewhere)
    helper.start()
    try:
        asyncio.run(scenario())
    finally:
        done.set()
        helper.join(HANG_GUARD)
    reread = other.get("raced")
    assert reread is not None
    stored = [m.content for m in reread.history]
    assert [c for c in stored if c.startswith("mine-")] == [f"mine-{i}" for i in range(writes)]
