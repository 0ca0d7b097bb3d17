"""``get_or_create`` called on a running event loop (issue 26, outcome 6).

``Runner.run_async`` calls the sync ``get_or_create`` inside its coroutine. There
the store sends nothing: the context it returns is read (or created, or caught up)
when first used, by the turn's start off the loop, or in place by any other use.
These tests count the statements each store sends (engine events on
``store.engines``, on the real database) and check that what the context shows
is right whichever way it is first used. Sync callers (no running loop) are
unchanged: they read at once.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Role, Runner
from sqlalchemy import event

from chatflow_sqlalchemy import DatabaseUnavailableError
from chatflow_sqlalchemy.testing import ScriptedEngine

from . import pg_util
from .stores import Opener

BOT = Agent(name="Bot", instructions="")
OTHER = Agent(name="Other", instructions="")


@contextmanager
def _counting(store: Any) -> Iterator[list[str]]:
    """The statements ``store`` sends meanwhile, on every engine it runs them on."""
    sent: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        sent.append(statement)

    engines = store.engines
    for engine in engines:
        event.listen(engine, "before_cursor_execute", record)
    try:
        yield sent
    finally:
        for engine in engines:
            event.remove(engine, "before_cursor_execute", record)


def _contents(session: Any) -> list[str | None]:
    return [m.content for m in session.history]


def test_a_new_session_is_created_by_its_first_turn_off_the_loop(sql_store: Opener) -> None:
    store = sql_store()
    other = sql_store()

    async def scenario() -> Any:
        with _counting(store) as sent:
            session = store.get_or_create("new", BOT, {"plan": "gold"})
            again = store.get_or_create("new", OTHER, {"plan": "lead"})
        assert sent == [], "get_or_create waited on the database on the loop"
        assert again is session  # one context per session, so its lock serialises turns
        assert other.get("new") is None  # nothing was written yet
        async with session.lock:
            session.add_message(Message(role=Role.USER, content="hi"))
        return session

    session = asyncio.run(scenario())
    stored = other.get("new")
    assert stored is not None
    assert stored.metadata == {"plan": "gold"} and stored.active_agent.name == "Bot"
    assert _contents(stored) == ["hi"] == _contents(session)


def test_a_context_handed_out_unread_is_right_on_its_first_sync_use(
    sql_store: Opener,
) -> None:
    """Read outside a turn, a context the loop got unread loads first: the stored agent,
    metadata, history, not the defaults the caller passed."""
    store = sql_store()
    writer = sql_store()
    first = writer.get_or_create("s", BOT, {"plan": "gold"})
    first.add_message(Message(role=Role.USER, content="q"))
    first.set_active_agent(OTHER)

    async def scenario() -> tuple[Any, bool]:
        with _counting(store) as sent:
            session = store.get_or_create("s", BOT, {"plan": "ignored"})
        assert sent == []
        return session, session.loaded

    session, loaded = asyncio.run(scenario())
    assert not loaded
    assert session.active_agent.name == "Other"
    assert session.metadata == {"plan": "gold"}
    assert _contents(session) == ["q"]
    assert session.loaded


def test_a_live_context_catches_up_on_first_use(sql_store: Opener) -> None:
    store = sql_store()
    writer = sql_store()
    store.get_or_create("s", BOT).add_message(Message(role=Role.USER, content="one"))
    writer.get_or_create("s", BOT).add_message(Message(role=Role.MODEL, content="two"))

    async def scenario() -> Any:
        with _counting(store) as sent:
            session = store.get_or_create("s", BOT)
        assert sent == []
        return session

    session = asyncio.run(scenario())
    assert _contents(session) == ["one", "two"]


def test_a_runner_turn_sees_what_other_writers_stored_since(sql_store: Opener) -> None:
    """A live context of a session another store moved: the turn's start catches it up
    on its own, off the loop."""
    store = sql_store()
    writer = sql_store()
    runner = Runner(starting_agent=BOT, session_store=store, engine=ScriptedEngine())
    runner.run("s", "first")
    writer.get_or_create("s", BOT).add_message(Message(role=Role.USER, content="elsewhere"))
    runner.run("s", "second")
    stored = writer.get("s")
    assert stored is not None
    assert _contents(stored) == [
        "first", "Bot re: first", "elsewhere", "second", "Bot re: second",
    ]


def test_invalid_arguments_still_fail_at_the_call(sql_store: Opener) -> None:
    store = sql_store()

    async def scenario() -> None:
        with pytest.raises(ValueError):
            store.get_or_create("", BOT)
        with pytest.raises(ValueError):
            store.get_or_create("s", BOT, {"x": math.nan})
        with pytest.raises(TypeError):
            store.get_or_create("s", BOT, {1: "int key"})
        with pytest.raises(ValueError):
            store.get_or_create("s", Agent(name="", instructions=""))
        with pytest.raises(ValueError):
            store.get_or_create("s", BOT, user_id="")

    asyncio.run(scenario())
    assert store.get("s") is None


def test_another_users_session_is_refused_on_first_use(sql_store: Opener) -> None:
    """The owner check needs the row: on the loop it comes with the first use, and the
    context of another user's session is not kept."""
    store = sql_store()
    sql_store().get_or_create("s", BOT, user_id="alice")

    async def scenario() -> None:
        session = store.get_or_create("s", BOT, user_id="bob")
        with pytest.raises(ValueError, match="another user_id"):
            async with session.lock:
                pass
        mine = store.get_or_create("s", BOT, user_id="alice")
        assert mine is not session
        async with mine.lock:
            mine.add_message(Message(role=Role.USER, content="alice's"))

    asyncio.run(scenario())
    with pytest.raises(ValueError, match="another user_id"):
        store.get_or_create("s", BOT, user_id="bob")  # no loop: at the call, as before
    assert store.list_sessions(user_id="alice") == ["s"]


def test_sync_callers_read_at_once(sql_store: Opener) -> None:
    store = sql_store()
    with _counting(store) as sent:
        session = store.get_or_create("s", BOT, {"k": 1})
    assert sent and session.loaded
    assert sql_store().get("s") is not None


def test_aget_or_create_reads_before_it_returns(sql_store: Opener) -> None:
    store = sql_store()

    async def scenario() -> Any:
        return await store.aget_or_create("s", BOT, {"k": 1})

    session = asyncio.run(scenario())
    assert session.loaded
    assert sql_store().get("s") is not None


def test_a_user_id_given_while_the_first_read_is_pending_is_recorded_with_it(
    sql_store: Opener,
) -> None:
    """The owner of a live context (shared) is checked at the call, after its first read."""
    store = sql_store()

    async def scenario() -> None:
        session = store.get_or_create("new", BOT, {"k": 1})
        assert store.get_or_create("new", BOT, user_id="carol") is session
        async with session.lock:
            session.add_message(Message(role=Role.USER, content="hi"))

    asyncio.run(scenario())
    assert sql_store().list_sessions(user_id="carol") == ["new"]
    stored = sql_store().get("new")
    assert stored is not None and stored.metadata == {"k": 1}


def test_a_runner_turn_on_a_session_deleted_elsewhere_starts_it_anew(sql_store: Opener) -> None:
    """The live context of a session another process deleted: the turn (which caught up
    through its lease, not through get_or_create) creates the session anew, as
    get_or_create off the loop does."""
    store = sql_store()
    other = sql_store()
    runner = Runner(starting_agent=BOT, session_store=store, engine=ScriptedEngine())
    runner.run("s", "before")
    assert other.delete("s")
    assert runner.run("s", "after").content == "Bot re: after"
    stored = other.get("s")
    assert stored is not None
    assert _contents(stored) == ["after", "Bot re: after"]


def test_a_live_context_of_a_session_deleted_elsewhere_is_new_on_first_use(
    sql_store: Opener,
) -> None:
    store = sql_store()
    other = sql_store()
    store.get_or_create("s", BOT).add_message(Message(role=Role.USER, content="gone"))
    assert other.delete("s")

    async def scenario() -> Any:
        return store.get_or_create("s", BOT, {"fresh": True})

    session = asyncio.run(scenario())
    assert _contents(session) == [] and session.metadata == {"fresh": True}
    session.add_message(Message(role=Role.USER, content="anew"))
    stored = other.get("s")
    assert stored is not None and _contents(stored) == ["anew"]



@pytest.mark.postgres
def test_a_pool_with_no_connection_coming_free_is_database_unavailable() -> None:
    """Every pooled connection busy (each waiting on a database that stopped answering,
    here simply held): the pool's bounded wait is a DatabaseUnavailableError too."""
    url = pg_util.postgres_url()
    options = {"pool_size": 1, "max_overflow": 0, "pool_timeout": 0.2}
    with pg_util.fresh_schema(url) as schema, pg_util.schema_store(
        url, schema, engine_options=options
    ) as store:
        with store.engine.connect(), pytest.raises(DatabaseUnavailableError, match="pool_timeout"):
            store.get("s")
        assert store.get("s") is None  # the connection is back: the store works on


def test_another_users_failed_check_leaves_the_live_context_usable(sql_store: Opener) -> None:
    store = sql_store()

    async def scenario() -> None:
        mine = store.get_or_create("s", BOT, user_id="alice")
        async with mine.lock:
            mine.add_message(Message(role=Role.USER, content="one"))
        with pytest.raises(ValueError, match="another user_id"):
            store.get_or_create("s", BOT, user_id="bob")
        async with mine.lock:
            mine.add_message(Message(role=Role.USER, content="two"))

    asyncio.run(scenario())
    stored = sql_store().get("s")
    assert stored is not None and _contents(stored) == ["one", "two"]


def test_a_session_deleted_and_created_anew_elsewhere_fails_one_runner_turn(
    sql_store: Opener,
) -> None:
    """The old context's first use finds another conversation under its id: it raises
    SessionDeletedError (an old turn never lands in the new conversation), and the next
    call gets the new context (docs/guarantees.md, "A deleted session stays deleted")."""
    from chatflow_sqlalchemy import SessionDeletedError

    store = sql_store()
    other = sql_store()
    runner = Runner(starting_agent=BOT, session_store=store, engine=ScriptedEngine())
    runner.run("s", "old")
    assert other.delete("s")
    other.get_or_create("s", BOT).add_message(Message(role=Role.USER, content="new"))
    with pytest.raises(SessionDeletedError):
        runner.run("s", "lost")
    runner.run("s", "next")
    stored = other.get("s")
    assert stored is not None
    assert _contents(stored) == ["new", "next", "Bot re: next"]
