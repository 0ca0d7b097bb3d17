"""The in-memory store is a context manager like the SQL stores: ``with`` and ``async with``."""

from __future__ import annotations

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
