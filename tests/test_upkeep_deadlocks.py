"""Upkeep that takes many rows at once, chosen as a deadlock victim, runs again.

InnoDB resolves a deadlock at once by rolling back the smaller transaction.
The inbox's purge deletes every done and sent message past the window in one
statement, so beside inbox writes it is often that smaller transaction: it
was rolled back whole, and it must run again instead of raising the driver's
error 1213. The test builds the deadlock with a transaction of its own that
holds one purgeable row and then asks for another the purge holds.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, update
from sqlalchemy.exc import DBAPIError

from chatflow_sqlalchemy import tables
from chatflow_sqlalchemy.values import utcnow

from .stores import Opener

HANG_GUARD = 60.0
"""Bound of every wait (a hung race fails instead of hanging the suite)."""

_inbox = tables.inbox


def _held_by_another(probe: Connection, message_id: str) -> bool:
    try:
        with probe.begin():
            probe.execute(
                _inbox.select().where(_inbox.c.message_id == message_id)
                .with_for_update(nowait=True)
            )
    except DBAPIError:
        return True
    return False


def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while not condition():
        assert time.monotonic() < deadline, "the race never reached its point"
        time.sleep(0.05)


@pytest.mark.parametrize(
    "sql_store", [pytest.param("mariadb", marks=pytest.mark.mariadb)], indirect=True
)
def test_an_inbox_purge_chosen_as_a_deadlock_victim_runs_again(sql_store: Opener) -> None:
    store = sql_store()
    tag = uuid.uuid4().hex[:8]
    first, second = f"{tag}-first", f"{tag}-second"
    weight = [f"{tag}-w{i}" for i in range(20)]  # makes the other transaction the larger one
    for message_id in (first, second, *weight):
        store.inbox.put(message_id, session_id=f"{tag}-s", text="hi")
    long_ago = utcnow() - timedelta(days=30)
    with store.engine.begin() as conn:
        for offset, message_id in enumerate((first, second)):  # the purge takes first, then second
            conn.execute(update(_inbox).where(_inbox.c.message_id == message_id).values(
                state="done", updated_at=long_ago + timedelta(seconds=offset)))
    outcome: dict[str, Any] = {}

    def purge() -> None:
        try:
            outcome["purged"] = store.inbox.purge()
        except BaseException as exc:
            outcome["purged"] = exc

    purging = threading.Thread(target=purge)
    with store.engine.connect() as other, store.engine.connect() as probe:
        other.begin()
        attempts = _inbox.c.attempts + 1
        other.execute(update(_inbox).where(_inbox.c.message_id.in_(weight)).values(attempts=attempts))
        other.execute(update(_inbox).where(_inbox.c.message_id == second).values(attempts=attempts))
        purging.start()
        _until(lambda: _held_by_another(probe, first))  # the purge has first, waits for second
        # Asking for first closes the circle: InnoDB rolls the smaller purge back.
        other.execute(update(_inbox).where(_inbox.c.message_id == first).values(attempts=attempts))
        other.commit()
        purging.join(HANG_GUARD)
    assert not purging.is_alive()
    assert outcome["purged"] == 2, outcome["purged"]
    assert {entry.message_id for entry in store.inbox.entries(limit=None)} == set(weight)


@pytest.mark.parametrize(
    "sql_store", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True
)
def test_a_deadlock_retry_on_the_event_loop_does_not_sleep_there(
    sql_store: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A native-async store runs ``apurge`` in a greenlet on the loop: its retry must not sleep.

    PostgreSQL's deadlock check runs in the transaction that waited first (the
    purge), which is rolled back and run again; ``time.sleep`` there would
    stall every task on the loop.
    """
    from chatflow_sqlalchemy import runtime

    store = sql_store()
    assert store.runtime.native_async
    slept_on_a_loop: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        try:
            asyncio.get_running_loop()
            slept_on_a_loop.append(seconds)
        except RuntimeError:
            pass
        real_sleep(seconds)

    monkeypatch.setattr(runtime.time, "sleep", sleep)
    tag = uuid.uuid4().hex[:8]
    first, second = f"{tag}-first", f"{tag}-second"
    for message_id in (first, second):
        store.inbox.put(message_id, session_id=f"{tag}-s", text="hi")
    long_ago = utcnow() - timedelta(days=30)
    with store.engine.begin() as conn:
        for offset, message_id in enumerate((first, second)):
            conn.execute(update(_inbox).where(_inbox.c.message_id == message_id).values(
                state="done", updated_at=long_ago + timedelta(seconds=offset)))
    outcome: dict[str, Any] = {}

    def purge() -> None:
        try:
            outcome["purged"] = asyncio.run(store.inbox.apurge())
        except BaseException as exc:
            outcome["purged"] = exc

    purging = threading.Thread(target=purge)
    with store.engine.connect() as other, store.engine.connect() as probe:
        other.begin()
        other.execute(update(_inbox).where(_inbox.c.message_id == second)
                      .values(attempts=_inbox.c.attempts + 1))
        purging.start()
        _until(lambda: _held_by_another(probe, first))  # the purge has first, waits for second
        other.execute(update(_inbox).where(_inbox.c.message_id == first)
                      .values(attempts=_inbox.c.attempts + 1))
        other.commit()
        purging.join(HANG_GUARD)
    assert not purging.is_alive()
    assert outcome["purged"] == 2, outcome["purged"]
    assert slept_on_a_loop == []
