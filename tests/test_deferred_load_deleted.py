"""A context get_or_create handed out on a loop, unread, whose session is deleted meanwhile.

Its deferred load must not store the session again: the caller (or another
user's) deleted it, and the context's next use raises SessionDeletedError.
"""

from __future__ import annotations

import asyncio

import pytest
from chatflow_agent import Agent, Message, Role

from chatflow_sqlalchemy.context import SessionContext
from chatflow_sqlalchemy.exceptions import SessionDeletedError

from .stores import SQL_KINDS, Opener

pytestmark = pytest.mark.parametrize("sql_store", SQL_KINDS, indirect=True)

AGENT = Agent(name="support", instructions="help")


def test_a_session_deleted_before_its_deferred_load_is_not_created_by_it(
    sql_store: Opener,
) -> None:
    """get_or_create on a loop, then delete: the context's next use must not store it."""
    store = sql_store()

    async def on_the_loop() -> SessionContext:
        made: SessionContext = store.get_or_create("wa:9", AGENT)
        return made

    ctx = asyncio.run(on_the_loop())
    store.delete("wa:9")
    with pytest.raises(SessionDeletedError):
        ctx.history  # noqa: B018
    with pytest.raises(SessionDeletedError):
        asyncio.run(_turn(ctx))
    assert sql_store().get("wa:9") is None
    assert sql_store().list_sessions() == []


async def _turn(ctx: SessionContext) -> None:
    async with ctx.lock:
        ctx.add_message(Message(role=Role.USER, content="late"))


def test_a_context_refused_to_another_user_creates_nothing_later(sql_store: Opener) -> None:
    """Bob's pending context is refused (Alice's session) and forgotten; Alice then deletes it."""
    sql_store().get_or_create("wa:10", AGENT, user_id="alice")
    store = sql_store()

    async def on_the_loop() -> SessionContext:
        made: SessionContext = store.get_or_create("wa:10", AGENT, user_id="bob")
        return made

    ctx = asyncio.run(on_the_loop())
    with pytest.raises(ValueError, match="another user_id"):
        ctx.history  # noqa: B018
    assert sql_store().delete("wa:10")
    with pytest.raises(SessionDeletedError):
        ctx.history  # noqa: B018
    assert sql_store().get("wa:10") is None

