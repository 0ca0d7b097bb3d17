"""Catching up with another writer parses only the rows it wrote.

A context that finds its session moved re-reads the window in one snapshot,
but reuses the messages it already holds when their stored text is unchanged
(compared by seq *and* text, so a seq reused after a cleared history is never
mistaken for the old row).
"""

from __future__ import annotations

from collections.abc import Callable

from chatflow_agent import Agent, Message, Role

from chatflow_sqlalchemy import SQLAlchemySessionStore

Opener = Callable[[], SQLAlchemySessionStore]
BOT = Agent(name="Bot", instructions="")


def _text(role: Role, content: str) -> Message:
    return Message(role=role, content=content)


def test_catch_up_reuses_the_messages_it_holds(store_opener: Opener) -> None:
    mine, theirs = store_opener(), store_opener()
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
    reread = store_opener().get("s")
    assert reread is not None
    assert [m.content for m in reread.history] == [m.content for m in ctx.history]


def test_a_reused_seq_with_new_text_is_parsed_not_reused(store_opener: Opener) -> None:
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
