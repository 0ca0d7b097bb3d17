"""Catching up with another writer parses only the rows it wrote.

A context that finds its session moved re-reads the window in one snapshot,
but reuses the messages it already holds when their stored text is unchanged
(compared by seq *and* text, so a seq reused after a cleared history is never
mistaken for the old row).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from chatflow_agent import Agent, Message, Role

from chatflow_sqlalchemy import PostgresSessionStore, SQLAlchemySessionStore, SQLiteSessionStore

from . import pg_util

Opener = Callable[[], SQLAlchemySessionStore]
BOT = Agent(name="Bot", instructions="")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    """Opens a new store instance on one database per call (think: one process each)."""
    with ExitStack() as stack:
        if request.param == "sqlite":
            def open_one() -> SQLAlchemySessionStore:
                return stack.enter_context(SQLiteSessionStore(tmp_path / "x.db"))
        else:
            url = pg_util.postgres_url()
            schema = stack.enter_context(pg_util.fresh_schema(url))

            def open_one() -> SQLAlchemySessionStore:
                return stack.enter_context(
                    PostgresSessionStore(url, connect_args=pg_util.schema_connect_args(schema))
                )
        yield open_one


def _text(role: Role, content: str) -> Message:
    return Message(role=role, content=content)


def test_catch_up_reuses_the_messages_it_holds(opener: Opener) -> None:
    mine, theirs = opener(), opener()
    ctx = mine.get_or_create("s", BOT)
    for turn in range(5):
        ctx.add_message(_text(Role.USER, f"u{turn}"))
        ctx.add_message(_text(Role.MODEL, f"m{turn}"))
    held = list(ctx.history)
    other = theirs.get_or_create("s", BOT)
    other.add_message(_text(Role.USER, "from the other process"))

    caught_up = mine.get_or_create("s", BOT)
    assert caught_up is ctx
    assert [m.content for m in ctx.history][-1] == "from the other process"
    assert all(a is b for a, b in zip(ctx.history[:10], held, strict=True)), "re-parsed"
    ctx.add_message(_text(Role.MODEL, "answer"))
    reread = opener().get("s")
    assert reread is not None
    assert [m.content for m in reread.history] == [m.content for m in ctx.history]


def test_a_reused_seq_with_new_text_is_parsed_not_reused(opener: Opener) -> None:
    mine = opener()
    ctx = mine.get_or_create("s", BOT)
    ctx.add_message(_text(Role.USER, "old question"))
    ctx.add_message(_text(Role.MODEL, "old answer"))
    clearer = opener().get_or_create("s", BOT)
    clearer.clear_history()  # every row gone: a fresh loader starts its seqs over
    fresh = opener().get_or_create("s", BOT)
    fresh.add_message(_text(Role.USER, "new question"))

    caught_up = mine.get_or_create("s", BOT)
    assert [m.content for m in caught_up.history] == ["new question"]


def test_catch_up_inside_a_turn_rebases_on_the_other_writers_rows(opener: Opener) -> None:
    import asyncio

    mine, theirs = opener(), opener()
    ctx = mine.get_or_create("s", BOT)
    ctx.add_message(_text(Role.USER, "u0"))
    ctx.add_message(_text(Role.MODEL, "m0"))

    async def turn() -> None:
        async with ctx.lock:
            theirs.get_or_create("s", BOT).add_message(_text(Role.USER, "theirs"))
            ctx.add_message(_text(Role.USER, "u1"))
            ctx.add_message(_text(Role.MODEL, "m1"))

    asyncio.run(turn())
    reread = opener().get("s")
    assert reread is not None
    contents = [m.content for m in reread.history]
    assert contents[:2] == ["u0", "m0"] and "theirs" in contents
    assert contents[-2:] == ["u1", "m1"], "our turn must stay whole, after the other rows"
