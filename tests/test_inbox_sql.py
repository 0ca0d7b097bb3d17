"""The durable inbox on the SQL stores beyond the conformance kit: rows, encryption, upkeep.

The behaviour every store shares is in the kit (``TestInbox*``); these tests
look at what only SQL stores have: the ``chatflow_inbox`` rows, text sealed
at rest, the session the inbox creates for its lease, and the purge.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from chatflow_agent import Agent, Runner
from sqlalchemy import text

from chatflow_sqlalchemy import SQLiteSessionStore
from chatflow_sqlalchemy.crypto import AESGCMCipher
from chatflow_sqlalchemy.inbox import InboxBatch, InboxReply
from chatflow_sqlalchemy.testing.claim_workers import ReplyModel, reply_to

from . import pg_util

_FAST = {"coalesce_seconds": 0.0, "retry_seconds": 0.0}


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """Opens a store with the given options on one database per test (SQLite or PostgreSQL)."""
    with ExitStack() as stack:
        if request.param == "sqlite":
            def open_one(**options: Any) -> Any:
                return stack.enter_context(SQLiteSessionStore(tmp_path / "x.db", **options))
        else:
            url = pg_util.postgres_url()
            schema = stack.enter_context(pg_util.fresh_schema(url))

            def open_one(**options: Any) -> Any:
                return stack.enter_context(pg_util.schema_store(url, schema, **options))
        yield open_one


async def _serve_until(store: Any, handle: Any, states: dict[str, str], **options: Any) -> None:
    serving = asyncio.ensure_future(store.inbox.serve(handle, **{**_FAST, **options}))
    try:
        for _ in range(3000):  # a 60 s hang guard
            found = {e.message_id: e.state for e in await store.inbox.aentries(limit=None)}
            if all(found.get(mid) == state for mid, state in states.items()):
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"the inbox did not reach {states}")
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


def _runner(store: Any) -> Runner:
    return Runner(starting_agent=Agent(name="Bot", instructions=""), session_store=store,
                  engine=ReplyModel())


def _row(store: Any, message_id: str) -> Any:
    with store.engine.connect() as conn:
        return conn.execute(
            text("SELECT text, reply, state FROM chatflow_inbox WHERE message_id = :m"),
            {"m": message_id},
        ).one()


def test_text_and_reply_are_sealed_at_rest(open_store: Any) -> None:
    cipher = AESGCMCipher(keys={"k1": bytes(range(32))}, primary="k1")
    store = open_store(cipher=cipher, require_encryption=True)
    store.inbox.put("m1", session_id="alice", text="my card is 4111")
    runner, sent = _runner(store), []

    async def handle(batch: InboxBatch) -> str:
        result = await runner.run_async(session_id=batch.session_id, user_message=batch.text)
        return str(result.content)

    async def send(reply: InboxReply) -> None:
        sent.append(reply)

    asyncio.run(_serve_until(store, handle, {"m1": "sent"}, send=send))
    stored_text, stored_reply, _ = _row(store, "m1")
    assert "card is 4111" not in stored_text and "card is 4111" not in stored_reply
    assert sent == [InboxReply("alice", reply_to("my card is 4111"), ("m1",))]


def test_a_plaintext_row_dies_where_encryption_is_required(tmp_path: Path) -> None:
    """A row the store cannot read is dead at once, with the reason: never handed to
    ``handle``, never retried forever, and the session's readable messages go on."""
    with SQLiteSessionStore(tmp_path / "x.db") as plain:
        plain.inbox.put("m1", session_id="alice", text="hello")
    cipher = AESGCMCipher(keys={"k1": bytes(range(32))}, primary="k1")
    with SQLiteSessionStore(tmp_path / "x.db", cipher=cipher, require_encryption=True) as store:
        store.inbox.put("m2", session_id="alice", text="sealed")
        seen: list[InboxBatch] = []

        async def handle(batch: InboxBatch) -> None:
            seen.append(batch)

        asyncio.run(_serve_until(store, handle, {"m1": "dead", "m2": "done"}))
        assert [batch.text for batch in seen] == ["sealed"]
        (dead,) = store.inbox.entries(state="dead")
        assert "plaintext" in (dead.error or "") and "chatflow_inbox" in (dead.error or "")


def test_the_first_turn_adopts_the_session_the_inbox_created(open_store: Any) -> None:
    """The inbox leases a session before its first turn; get_or_create then gives it its
    agent and metadata, as if it created it. Until then get() and list_sessions() skip it."""
    store = open_store()
    store.inbox.put("m1", session_id="alice", text="hi")
    store.inbox.put("m2", session_id="bob", text="hi")
    bot = Agent(name="Bot", instructions="")
    runner = Runner(starting_agent=bot, session_store=store, engine=ReplyModel())

    async def handle(batch: InboxBatch) -> str:
        if batch.session_id == "bob":
            raise RuntimeError("bob's turn fails")
        await store.aget_or_create(batch.session_id, bot, {"channel": "whatsapp"},
                                   user_id="u-alice")
        result = await runner.run_async(session_id=batch.session_id, user_message=batch.text)
        return str(result.content)

    asyncio.run(_serve_until(store, handle, {"m1": "done", "m2": "dead"}, max_attempts=1))
    fresh = open_store()
    alice = fresh.get("alice")
    assert alice is not None
    assert (alice.active_agent.name, alice.metadata) == ("Bot", {"channel": "whatsapp"})
    assert fresh.list_sessions(user_id="u-alice") == ["alice"]
    assert fresh.get("bob") is None
    assert "bob" not in fresh.list_sessions()


def test_done_and_sent_messages_are_purged_after_the_dedup_window(open_store: Any) -> None:
    store = open_store(session_ttl_hours=1.0)
    for mid in ("old", "new", "waiting"):
        store.inbox.put(mid, session_id="alice", text=mid)

    async def handle(batch: InboxBatch) -> None:
        return None

    asyncio.run(_serve_until(store, handle, {"old": "done", "new": "done", "waiting": "done"}))
    store.inbox.put("pending", session_id="carol", text="later")
    with store.engine.begin() as conn:
        conn.execute(text(
            "UPDATE chatflow_inbox SET updated_at = :then WHERE message_id = 'old'"
        ), {"then": "2000-01-01 00:00:00"})
    assert store.inbox.purge() == 1
    assert store.inbox.put("old", session_id="alice", text="again") is True  # past the window
    store.sweep()  # the sweep purges too: nothing more is old enough
    assert {e.message_id for e in store.inbox.entries(limit=None)} == {
        "old", "new", "waiting", "pending"
    }


def test_a_deeply_nested_payload_is_stored_as_given(open_store: Any) -> None:
    # A payload json.dumps takes (here 450 levels) is stored on every backend;
    # PostgreSQL's jsonb serializer, looking for floats it must write out in
    # full, recursed two frames per level and raised RecursionError from put.
    payload: Any = {"value": 1.5}
    for _ in range(450):
        payload = {"changes": [payload]}
    store = open_store()
    assert store.inbox.put("m1", session_id="alice", text="hi", payload=payload) is True
    with store.engine.connect() as conn:
        stored = conn.execute(
            text("SELECT payload FROM chatflow_inbox WHERE message_id = 'm1'")
        ).scalar_one()
    stored = json.loads(stored) if isinstance(stored, str) else stored
    assert stored == payload
