"""Inside one process, the claims of one session take their place in call order.

A burst of deliveries for one conversation, handed to one worker's tasks in the
order they arrived, is stored in that order on every database: the claims draw
their tickets in call order, and each turn waits for the earlier claims.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Role

from chatflow_sqlalchemy import SQLiteSessionStore

from . import pg_util

BOT = Agent(name="Bot", instructions="")
BURST = 12


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    if request.param == "sqlite":
        with SQLiteSessionStore(tmp_path / "order.db") as opened:
            yield opened
        return
    url = pg_util.postgres_url()
    with pg_util.fresh_schema(url) as schema, pg_util.schema_store(url, schema) as opened:
        yield opened


async def _deliver(store: Any, message_id: str) -> None:
    async with store.claim(message_id, session_id="s") as claim:
        assert claim.acquired
        ctx = await store.aget_or_create("s", BOT)
        async with ctx.lock:
            ctx.add_message(Message(role=Role.USER, content=message_id))


def test_a_burst_is_stored_in_call_order(store: Any) -> None:
    for round_ in range(3):
        ids = [f"r{round_}m{n:02d}" for n in range(BURST)]

        async def burst(ids: list[str] = ids) -> None:
            await asyncio.gather(*(_deliver(store, message_id) for message_id in ids))

        store.delete("s")
        asyncio.run(burst())
        stored = [m.content for m in store.get("s").history]
        assert stored == ids, f"round {round_}: {stored}"


def test_sync_claims_from_many_threads_each_store_once(store: Any) -> None:
    """The call order's waits never stall sync claims taken from threads at once."""
    import threading

    ids = [f"t{n:02d}" for n in range(6)]
    store.delete("s")
    started: list[threading.Thread] = []
    for message_id in ids:
        def deliver(message_id: str = message_id) -> None:
            with store.claim(message_id, session_id="s"):
                ctx = store.get_or_create("s", BOT)
                ctx.add_message(Message(role=Role.USER, content=message_id))
        thread = threading.Thread(target=deliver)
        thread.start()
        started.append(thread)
    for thread in started:
        thread.join()
    assert sorted(m.content for m in store.get("s").history) == ids  # all stored once


def test_a_claim_cancelled_on_a_loop_that_stopped_holds_no_other_stores_claims(
    tmp_path: Path,
) -> None:
    """The call order is per store: a claim given up on store A never holds store B's."""
    import threading

    with (
        SQLiteSessionStore(tmp_path / "a.db") as store_a,
        SQLiteSessionStore(tmp_path / "b.db") as store_b,
    ):
        loop = asyncio.new_event_loop()

        async def enter_and_give_up() -> None:
            task = asyncio.ensure_future(store_a.claim("m1", session_id="+5511").__aenter__())
            await asyncio.sleep(0)  # the claim took its place
            task.cancel()  # as asyncio.wait_for's timeout would
            with contextlib.suppress(asyncio.CancelledError):
                await task

        loop.run_until_complete(enter_and_give_up())  # the loop stops with work pending
        done = threading.Event()

        def on_the_other_database() -> None:
            with store_b.claim("m1", session_id="+5511") as claim:
                assert claim.acquired
            done.set()

        worker = threading.Thread(target=on_the_other_database, daemon=True)
        worker.start()
        worker.join(60)  # a bound on a hang, not on speed
        loop.run_until_complete(asyncio.sleep(0.2))
        loop.close()
        assert done.is_set(), "a claim on store B waited for store A's claim"
