"""The turn lease across a fleet (DESIGN.md "The turn: one lease, one write (0.3)").

Only the public contract: ``async with ctx.lock`` is a turn, the store option
``turn_lease_seconds``, and ``LeaseLostError``. What a turn holds while its
model runs is a lease row, not a connection, so:

* through PgBouncer in transaction mode with two server connections, thirty
  turns whose model calls overlap all finish and are all stored;
* on every SQL backend (SQLite file, PostgreSQL, MariaDB) a second process's
  turn on a leased session waits for the first turn's write and sees it;
* a holder killed with ``kill -9`` frees its session when its lease expires,
  and nothing of its turn is stored;
* a holder stopped past its lease loses it: another process's turn runs, and
  the holder's turn, once resumed, raises ``LeaseLostError`` and writes nothing.

Processes are synchronised by events and files, never by sleeping for a
guessed time; the bounds below are hang guards many times what a turn takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Role

from chatflow_sqlalchemy.testing import StoreSpec
from chatflow_sqlalchemy.testing.harness import Worker, start_process

from . import _workers, pg_util
from ._workers import postgres_spec, sqlite_spec
from .test_bad_input import _mariadb_database
from .test_processes import kill_when_ready

BOT = Agent(name="Bot", instructions="")

MARIADB_TARGET = "chatflow_sqlalchemy_mariadb:MariaDBSessionStore"

CONCURRENT_TURNS = 30
"""Turns in flight at once through PgBouncer's two server connections."""

MODEL_CALL_SECONDS = 1.0
"""How long each of those turns' model call lasts, inside its lock."""

OVERLAPPING_TURNS_BOUND = 60.0
"""Hang guard of the thirty overlapping turns. A turn that held a server connection
across its model call would stall the others until the store's operation timeout
fails them with DatabaseUnavailableError, which fails the test long before this."""

TAKEOVER_BOUND = 30.0
"""Hang guard of a turn waiting for an expired lease (of one or two seconds)."""

WRONG_ENTRY_WINDOW = 1.5
"""How long a second turn gets to (wrongly) enter a session whose lease is held."""


# ------------------------------------------------------------------ PgBouncer


async def overlapping_turns(store: Any, sessions: list[str]) -> None:
    """One turn per session, all at once; each model call waits until every turn is in.

    Inside its lock a turn adds its question, then its model call lasts
    :data:`MODEL_CALL_SECONDS` and does not end before every other turn is
    inside its own lock too: the model calls overlap by construction, so a
    turn that held a connection while its model runs would keep the others
    out and they would never finish.
    """
    inside = 0
    everyone_inside = asyncio.Event()

    async def turn(session_id: str) -> None:
        nonlocal inside
        ctx = await store.aget_or_create(session_id, BOT)
        async with ctx.lock:
            await ctx.aadd_message(Message(role=Role.USER, content=f"q {session_id}"))
            inside += 1
            if inside == len(sessions):
                everyone_inside.set()
            await asyncio.gather(asyncio.sleep(MODEL_CALL_SECONDS), everyone_inside.wait())
            await ctx.aadd_message(Message(role=Role.MODEL, content=f"a {session_id}"))

    await asyncio.gather(*(turn(session_id) for session_id in sessions))


@pytest.mark.postgres
@pytest.mark.slow
def test_thirty_model_calls_in_flight_through_two_server_connections(
    pgbouncer: Any, bounced_database: str
) -> None:
    """A pool sized by statements in flight, not by model calls in flight."""
    assert pgbouncer.pool_size == 2
    spec = postgres_spec(bounced_database)
    sessions = [f"s{k}" for k in range(CONCURRENT_TURNS)]
    store: Any = spec.open()
    try:
        try:
            asyncio.run(
                asyncio.wait_for(overlapping_turns(store, sessions), OVERLAPPING_TURNS_BOUND)
            )
        except asyncio.TimeoutError:
            pytest.fail(
                f"{CONCURRENT_TURNS} overlapping turns did not finish within "
                f"{OVERLAPPING_TURNS_BOUND:g} s through {pgbouncer.pool_size} server "
                "connections: a turn holds a connection while its model runs"
            )
    finally:
        store.close()
    assert {s: contents(spec, s) for s in sessions} == {
        s: [f"q {s}", f"a {s}"] for s in sessions
    }


# ------------------------------------------------------------------ every backend


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param("postgresql", marks=pytest.mark.postgres),
        pytest.param("mariadb", marks=pytest.mark.mariadb),
    ]
)
def spec(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreSpec]:
    """A fresh database of each SQL backend, its schema created (as a deploy step would)."""
    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            made = sqlite_spec(tmp_path / "lease.db")
        elif request.param == "postgresql":
            url = pg_util.postgres_url()
            made = postgres_spec(url, stack.enter_context(pg_util.fresh_schema(url)))
        else:
            pytest.importorskip(
                "chatflow_sqlalchemy_mariadb", reason="the MariaDB plugin is not installed"
            )
            pytest.importorskip("pymysql", reason="the MariaDB plugin's driver is not installed")
            made = StoreSpec(MARIADB_TARGET, (_mariadb_database(stack),))
        made.open().close()
        yield made


@pytest.fixture
def session_id() -> str:
    """A session id of the test's own: today's PostgreSQL advisory locks are keyed by
    session id across schemas, so tests running beside it must not share one."""
    return f"lease-{uuid.uuid4().hex[:12]}"


def contents(spec: StoreSpec, session_id: str) -> list[str | None]:
    """What a fresh store reads back of ``session_id``'s history."""
    store: Any = spec.open(default_max_turns=10_000)
    try:
        session = store.get(session_id)
        return [] if session is None else [m.content for m in session.history]
    finally:
        store.close()


def event_within(worker: Worker, seconds: float) -> tuple[Any, ...] | None:
    """The worker's next event if it sends one within ``seconds``, else None."""
    try:
        event: tuple[Any, ...] = worker.events.get(timeout=seconds)
    except queue.Empty:
        return None
    return event


def test_a_second_process_waits_for_the_turn_and_sees_it(
    spec: StoreSpec, session_id: str, tmp_path: Path
) -> None:
    """B's turn does not start while A's lease is held, and starts on A's messages."""
    release = tmp_path / "release-a"
    holder = start_process(
        _workers.lease_holder, spec, session_id, "from A", str(release), {}
    )
    taker: Worker | None = None
    try:
        assert holder.next_event()[0] == "ready"
        taker = start_process(_workers.lease_taker, spec, session_id, "from B", {})
        assert taker.next_event()[0] == "waiting"
        early = event_within(taker, WRONG_ENTRY_WINDOW)
        assert early is None, f"B's turn ran while A held the session's lease: {early!r}"
        release.touch()
        assert holder.result() is None, "A's turn was not written"
        entered = taker.next_event()
        assert entered[0] == "entered", entered
        assert entered[2] == ["from A", "from A answer"], "B did not see A's turn"
        taker.result()
    finally:
        holder.stop()
        if taker is not None:
            taker.stop()
    assert contents(spec, session_id) == [
        "from A", "from A answer", "from B", "from B answer"
    ]


def take_turn(spec: StoreSpec, session_id: str, label: str, **options: Any) -> None:
    """A turn of this process's own store on ``session_id``, bounded by :data:`TAKEOVER_BOUND`."""
    store: Any = spec.open(**options)

    async def turn() -> None:
        ctx = await store.aget_or_create(session_id, BOT)
        async with ctx.lock:
            await ctx.aadd_message(Message(role=Role.USER, content=label))
            await ctx.aadd_message(Message(role=Role.MODEL, content=f"{label} answer"))

    try:
        asyncio.run(asyncio.wait_for(turn(), TAKEOVER_BOUND))
    except asyncio.TimeoutError:
        pytest.fail(f"the session was still leased {TAKEOVER_BOUND:g} s later")
    finally:
        store.close()


def test_a_killed_holders_session_is_free_once_its_lease_expires(
    spec: StoreSpec, session_id: str, tmp_path: Path
) -> None:
    """kill -9 inside a turn: the next turn runs after the expiry; nothing of the
    killed turn is stored."""
    never = str(tmp_path / "never-released")
    kill_when_ready(
        start_process(
            _workers.lease_holder, spec, session_id, "killed turn", never,
            {"turn_lease_seconds": 2.0},
        )
    )
    take_turn(spec, session_id, "after the kill", turn_lease_seconds=2.0)
    assert contents(spec, session_id) == ["after the kill", "after the kill answer"]


def test_a_holder_stopped_past_its_lease_loses_it_and_writes_nothing(
    spec: StoreSpec, session_id: str, tmp_path: Path
) -> None:
    """SIGSTOP past the expiry: another process's turn commits; the resumed
    holder's turn raises LeaseLostError and the database keeps only the other turn.

    The stop lasts until the other turn has committed, which it can only do
    once the lease expired: longer than the lease, without guessing a time.
    A stop landing inside one of the holder's own statements (a renewal)
    would keep the database locked for the taker too: a renewal that holds a
    transaction only for its own round trip keeps that window tiny.
    """
    release = tmp_path / "release-holder"
    options = {"turn_lease_seconds": 1.0}
    holder = start_process(
        _workers.lease_holder, spec, session_id, "stale", str(release), options
    )
    taker: Worker | None = None
    try:
        assert holder.next_event()[0] == "ready"
        os.kill(holder.pid, signal.SIGSTOP)
        try:
            taker = start_process(_workers.lease_taker, spec, session_id, "fresh", {})
            seen = taker.result(timeout=TAKEOVER_BOUND)
        finally:
            release.touch()
            os.kill(holder.pid, signal.SIGCONT)
        assert seen == [], "the taker saw messages of the stopped turn"
        assert holder.result() == "lease lost", "the resumed holder's turn did not fail"
    finally:
        holder.stop()
        if taker is not None:
            taker.stop()
    assert contents(spec, session_id) == ["fresh", "fresh answer"]


def test_a_process_waiting_behind_a_failed_first_turn_runs_and_makes_the_session(
    spec: StoreSpec, session_id: str, tmp_path: Path
) -> None:
    """A's first turn fails while B's process waits for the lease (issue 28).

    The session A made is unborn again, not deleted: B, which read it before,
    is unharmed; until B writes, no store shows the session; B's write makes it.
    """
    import threading

    from chatflow_agent import Runner

    from chatflow_sqlalchemy.testing import ScriptedEngine

    entered, go = threading.Event(), threading.Event()

    class Held(ScriptedEngine):
        async def generate_turn_async(self, agent: Agent, history: list[Message]) -> Any:
            entered.set()
            while not go.is_set():
                await asyncio.sleep(0.01)
            return await super().generate_turn_async(agent, history)

    store: Any = spec.open()
    runner = Runner(starting_agent=Agent(name="support", instructions=""),
                    session_store=store, engine=Held())
    failed: list[BaseException] = []

    def first_turn() -> None:
        try:
            asyncio.run(runner.run_async(session_id, "fail"))
        except RuntimeError as exc:
            failed.append(exc)

    thread = threading.Thread(target=first_turn)
    release = tmp_path / "release-b"
    waiter: Worker | None = None
    try:
        thread.start()
        assert entered.wait(60)
        waiter = start_process(_workers.held_waiter, spec, session_id, "from B", str(release))
        assert waiter.next_event()[0] == "waiting"  # B read the session A made
        go.set()
        thread.join(60)
        assert failed, "A's turn did not fail"
        entered_b = waiter.next_event()
        assert entered_b[0] == "entered" and entered_b[2] == [], entered_b
        fresh: Any = spec.open()
        try:
            assert fresh.get(session_id) is None  # A failed, B has not written yet
            assert session_id not in fresh.list_sessions()
        finally:
            fresh.close()
        release.touch()
        assert waiter.result() == []
    finally:
        go.set()
        release.touch()
        thread.join(60)
        if waiter is not None:
            waiter.stop()
        store.close()
    assert contents(spec, session_id) == ["from B", "from B answer"]
    reader: Any = spec.open()
    try:
        assert reader.get(session_id).active_agent.name == "support"
        assert reader.list_sessions() == [session_id]
    finally:
        reader.close()
