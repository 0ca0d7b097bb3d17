"""The in-memory store's lifecycle matches the SQL stores': ``with``, ``async with``, ``clear``."""

from __future__ import annotations

from typing import Any

import pytest
from chatflow_agent import Agent, Message, Role

from chatflow_sqlalchemy import SessionStore, SQLiteSessionStore

BOT = Agent(name="Bot", instructions="")


def test_with_returns_the_store_and_closes_it() -> None:
    with SessionStore() as store:
        ctx = store.get_or_create("s", BOT)
        ctx.add_message(Message(role=Role.USER, content="hi"))
        assert store.list_sessions() == ["s"]
    with pytest.raises(RuntimeError, match="closed"):
        store.list_sessions()
    with pytest.raises(RuntimeError, match="closed"):
        ctx.add_message(Message(role=Role.USER, content="after close"))
    store.close()  # twice is harmless


async def test_async_with_returns_the_store_and_closes_it() -> None:
    async with SessionStore() as store:
        ctx = await store.aget_or_create("s", BOT)
        await ctx.aadd_message(Message(role=Role.USER, content="hi"))
        assert await store.arecord_processed_message("m1")
        assert await store.alist_sessions() == ["s"]
    with pytest.raises(RuntimeError, match="closed"):
        await store.arecord_processed_message("m2")
    with pytest.raises(RuntimeError, match="closed"):
        await store.aget_or_create("t", BOT)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_same_lifecycle_as_the_sql_store(kind: str, tmp_path: object) -> None:
    store = SessionStore() if kind == "memory" else SQLiteSessionStore(":memory:")
    async with store as entered:
        assert entered is store
        assert store.list_sessions() == []
    for call in (store.list_sessions, lambda: store.get("s"), lambda: store.delete("s")):
        with pytest.raises(RuntimeError, match="this session store is closed"):
            call()


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_clear_forgets_what_waited_for_the_summary(kind: str) -> None:
    # Turns a failed summarizer left waiting belong to the cleared session: a new
    # session under the same id must never have them summarized into its own.
    seen: list[list[str]] = []
    failing = [True]

    async def summarizer(previous: str | None, dropped: list[Any]) -> str:
        seen.append([m.content for m in dropped])
        if failing[0]:
            raise RuntimeError("summarizer down")
        return "summary"

    options: dict[str, Any] = {"default_max_turns": 1, "summarizer": summarizer}
    store = SessionStore(**options) if kind == "memory" else SQLiteSessionStore(
        ":memory:", **options
    )
    with store:
        ctx = store.get_or_create("s", BOT)
        for i in range(4):
            ctx.add_message(Message(role=Role.USER, content=f"old-{i}"))
            ctx.add_message(Message(role=Role.MODEL, content=f"old-reply-{i}"))
        assert store.wait_for_summaries(30)
        store.clear()
        failing[0] = False
        seen.clear()
        ctx = store.get_or_create("s", BOT)
        for i in range(2):
            ctx.add_message(Message(role=Role.USER, content=f"new-{i}"))
            ctx.add_message(Message(role=Role.MODEL, content=f"new-reply-{i}"))
        assert store.wait_for_summaries(30)
        assert seen == [["new-0", "new-reply-0"]]
        assert ctx.summary == "summary"
