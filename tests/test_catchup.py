"""Catching up with another writer: the context shows what the database holds.

A seq can be used again after another process cleared the history (a fresh
loader starts its seqs over), and a writer behind another one rebases its
turn after the other's rows, whole.
"""

from __future__ import annotations

from collections.abc import Callable

from chatflow_agent import Agent, Message, Role

from chatflow_sqlalchemy import SQLAlchemySessionStore

Opener = Callable[[], SQLAlchemySessionStore]
BOT = Agent(name="Bot", instructions="")


def _text(role: Role, content: str) -> Message:
    return Message(role=role, content=content)


def test_catch_up_after_a_cleared_history_shows_the_new_rows(store_opener: Opener) -> None:
    mine = store_opener()
    ctx = mine.get_or_create("s", BOT)
    ctx.add_message(_text(Role.USER, "old question"))
    ctx.add_message(_text(Role.MODEL, "old answer"))
    clearer = store_opener().get_or_create("s", BOT)
    clearer.clear_history()  # every row gone: a fresh loader starts its seqs over
    fresh = store_opener().get_or_create("s", BOT)
    fresh.add_message(_text(Role.USER, "new question"))

    caught_up = mine.get_or_create("s", BOT)
    assert [m.content for m in caught_up.history] == ["new question"]


def test_catch_up_inside_a_turn_rebases_on_the_other_writers_rows(store_opener: Opener) -> None:
    import asyncio

    mine, theirs = store_opener(), store_opener()
    ctx = mine.get_or_create("s", BOT)
    ctx.add_message(_text(Role.USER, "u0"))
    ctx.add_message(_text(Role.MODEL, "m0"))

    async def turn() -> None:
        async with ctx.lock:
            theirs.get_or_create("s", BOT).add_message(_text(Role.USER, "theirs"))
            ctx.add_message(_text(Role.USER, "u1"))
            ctx.add_message(_text(Role.MODEL, "m1"))

    asyncio.run(turn())
    reread = store_opener().get("s")
    assert reread is not None
    contents = [m.content for m in reread.history]
    assert contents[:2] == ["u0", "m0"] and "theirs" in contents
    assert contents[-2:] == ["u1", "m1"], "our turn must stay whole, after the other rows"


def test_catch_up_replaces_unpersisted_in_place_edits(store_opener: Opener) -> None:
    """An element replaced in the history list in place is not written; a reload drops it."""
    mine = store_opener()
    ctx = mine.get_or_create("s", BOT)
    for content in ("q1", "a1"):
        ctx.add_message(_text(Role.USER if content.startswith("q") else Role.MODEL, content))
    ctx.history[1] = _text(Role.MODEL, "edited in place, never stored")
    store_opener().get_or_create("s", BOT).add_message(_text(Role.USER, "q2"))

    caught_up = mine.get_or_create("s", BOT)
    assert [m.content for m in caught_up.history] == ["q1", "a1", "q2"]


def test_catch_up_despite_an_unsaved_nested_metadata_change(store_opener: Opener) -> None:
    """A nested metadata edit waits for the next write; lookups still show others' rows.

    And another writer's committed metadata survives: the unsaved edit is what gives way.
    """
    mine, theirs = store_opener(), store_opener()
    ctx = mine.get_or_create("s", BOT, metadata={"prefs": {}})
    ctx.metadata["prefs"]["lang"] = "fr"  # nested: not noticed, written with the next write
    other = theirs.get_or_create("s", BOT)
    other.add_message(_text(Role.USER, "theirs"))
    other.metadata["plan"] = "pro"

    caught_up = mine.get("s")
    assert caught_up is not None
    assert [m.content for m in caught_up.history] == ["theirs"]
    caught_up.add_message(_text(Role.MODEL, "answer"))
    reread = store_opener().get("s")
    assert reread is not None
    assert [m.content for m in reread.history] == ["theirs", "answer"]
    assert reread.metadata.get("plan") == "pro"
