"""Worker processes for the multi-process tests, started with the kit's harness.

Each is a module-level function ``worker(spec, ..., events)`` for
:func:`chatflow_sqlalchemy.testing.harness.start_process`: it opens a store
from a :class:`~chatflow_sqlalchemy.testing.StoreSpec`, does its part and
reports on ``events`` (``("ready", pid)`` where the test kills it, ``("ack",
question)`` once a turn is stored, ``("done", pid, result)``); the tests
kill some of them mid-turn on purpose.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import time
from typing import Any

from chatflow_agent import Agent, Message, Role, Runner, ToolCall, ToolResult

from chatflow_sqlalchemy.testing import StoreSpec

from .fakes import Recording, ToolThenAnswer

SQLITE = "chatflow_sqlalchemy.backends.sqlite:SQLiteSessionStore"
POSTGRES = "chatflow_sqlalchemy.backends.postgresql:PostgresSessionStore"


def sqlite_spec(path: Any) -> StoreSpec:
    """How a worker process opens the SQLite file ``path``."""
    return StoreSpec(SQLITE, (str(path),))


def postgres_spec(url: str, schema: str | None = None) -> StoreSpec:
    """How a worker process opens PostgreSQL at ``url``, in ``schema`` (None: as it is)."""
    connect_args = {"options": f"-csearch_path={schema}"} if schema else {}
    return StoreSpec(POSTGRES, (url,), {"connect_args": connect_args})


def kill_mid_turn(spec: StoreSpec, events: Any) -> None:
    """Two whole turns, then a third that blocks inside its tool until killed."""
    blocking = {"on": False}

    def slow_tool(q: str) -> str:
        if blocking["on"]:
            events.put(("ready", os.getpid()))
            time.sleep(600)
        return f"looked up {q}"

    agent = Agent(name="Bot", instructions="", tools=[slow_tool])
    store = spec.open()
    runner = Runner(starting_agent=agent, session_store=store, engine=ToolThenAnswer("slow_tool"))
    runner.run("s1", "q1")
    runner.run("s1", "q2")
    blocking["on"] = True
    runner.run("s1", "q3")


def direct_writes_then_hang(spec: StoreSpec, events: Any) -> None:
    """Persist USER and a MODEL tool call outside any turn, then hang before the result."""
    store = spec.open()
    session = store.get_or_create("s1", Agent(name="Bot", instructions=""))
    session.add_message(Message(role=Role.USER, content="q1"))
    session.add_message(Message(role=Role.MODEL, content="a1"))
    session.add_message(Message(role=Role.USER, content="q2"))
    call = ToolCall(id="c2", name="lookup", args={})
    session.add_message(Message(role=Role.MODEL, tool_calls=[call]))
    events.put(("ready", os.getpid()))
    time.sleep(600)


def turn_lock_then_hang(spec: StoreSpec, events: Any) -> None:
    """Inside ``session.lock``: USER and a MODEL tool call, then hang before the result."""
    store = spec.open()
    session = store.get_or_create("s1", Agent(name="Bot", instructions=""))
    session.add_message(Message(role=Role.USER, content="q1"))
    session.add_message(Message(role=Role.MODEL, content="a1"))

    async def turn() -> None:
        async with session.lock:
            session.add_message(Message(role=Role.USER, content="q2"))
            call = ToolCall(id="c2", name="lookup", args={})
            session.add_message(Message(role=Role.MODEL, tool_calls=[call]))
            events.put(("ready", os.getpid()))
            await asyncio.sleep(600)

    asyncio.run(turn())


def fleet(spec: StoreSpec, worker: str, turns: int, sessions: list[str], delay: float,
          events: Any) -> None:
    """Run ``turns`` turns on every session concurrently through the real Runner.

    Its result: one ``{"question", "seen"}`` per model call (how many messages
    of history the call saw).
    """
    engine = Recording(delay)
    store: Any = spec.open(default_max_turns=10_000)
    runner = Runner(
        starting_agent=Agent(name="Bot", instructions=""), session_store=store, engine=engine
    )

    async def drive(session_id: str) -> None:
        for turn in range(turns):
            await runner.run_async(session_id, f"{worker}:{session_id}:{turn}")

    async def main() -> None:
        await asyncio.gather(*(drive(s) for s in sessions))

    asyncio.run(main())
    store.close()
    log = [{"question": seen[-1], "seen": len(seen)} for seen in engine.seen]
    events.put(("done", os.getpid(), log))


CAMPAIGN_LEASE_SECONDS = 3.0
"""The campaign writers' ``turn_lease_seconds``: long beside a turn, short to wait out."""


def campaign_writer(spec: StoreSpec, session_id: str, label: str, mode: str, seed: int,
                    events: Any) -> None:
    """Write whole turns forever, sending ``("ack", <user text>)`` once each is stored.

    ``mode`` ``"direct"``: every message is its own ``add_message`` outside any
    lock (USER, MODEL tool call, TOOL result, MODEL answer), as upstream's docs
    do. ``"locked"``: each turn runs through the real Runner inside
    ``session.lock``, its tool pausing a little. The test kills it at random.
    """
    rng = random.Random(seed)
    # A writer killed inside a turn leaves its lease: the next one waits it out.
    store = spec.open(default_max_turns=10_000, turn_lease_seconds=CAMPAIGN_LEASE_SECONDS)
    agent = Agent(name="Bot", instructions="", tools=[_pausing_lookup(rng)])
    if mode == "locked":
        runner = Runner(starting_agent=agent, session_store=store,
                        engine=ToolThenAnswer("slow_tool"))
        for turn in itertools.count():
            question = f"{label}-{turn}"
            runner.run(session_id, question)
            events.put(("ack", question))
    session = store.get_or_create(session_id, agent)
    for turn in itertools.count():
        question = f"{label}-{turn}"
        call = ToolCall(id=f"call-{question}", name="lookup", args={"q": question})
        session.add_message(Message(role=Role.USER, content=question))
        session.add_message(Message(role=Role.MODEL, tool_calls=[call]))
        time.sleep(rng.uniform(0, 0.004))  # the tool runs
        result = ToolResult(tool_call_id=call.id, name="lookup", content={"q": question})
        session.add_message(Message(role=Role.TOOL, tool_results=[result]))
        session.add_message(Message(role=Role.MODEL, content=f"answer to {question}"))
        events.put(("ack", question))


def _pausing_lookup(rng: Any) -> Any:
    async def slow_tool(q: str) -> str:
        await asyncio.sleep(rng.uniform(0, 0.004))
        return f"looked up {q}"

    return slow_tool


def open_counting_migrations(spec: StoreSpec, barrier: Any, results: Any) -> None:
    """Open (and close) a store at the same instant as the others; report what it migrated.

    For :func:`~chatflow_sqlalchemy.testing.harness.run_workers`: the result is
    the Alembic ``Running upgrade ...`` lines this process ran (none if another
    process had migrated first).
    """
    import logging

    ran: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("Running "):
                ran.append(record.getMessage())

    log = logging.getLogger("alembic.runtime.migration")
    log.setLevel(logging.DEBUG)  # the store passes Alembic's INFO lines on at DEBUG
    log.addHandler(Capture())
    try:
        barrier.wait(60)
        store: Any = spec.open()
        store.close()
        results.put(ran)
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))


CRASH_EXIT = 17
"""Exit status of :func:`crash_mid_migration` when it died where it meant to."""


def crash_mid_migration(url: str, step: str, schema: str | None) -> None:
    """Upgrade ``url`` to head and die (``os._exit``) at Alembic operation ``step``.

    No rollback, no close: like a kill -9 in the middle of a revision.
    """
    from alembic.operations import Operations

    from chatflow_sqlalchemy import migrate

    def crash(*args: Any, **kwargs: Any) -> None:
        os._exit(CRASH_EXIT)

    setattr(Operations, step, crash)
    if schema is not None:
        from sqlalchemy import create_engine

        from chatflow_sqlalchemy.backends.postgresql import PostgresDialectSupport

        engine = create_engine(url, connect_args={"options": "-csearch_path=" + schema})
        PostgresDialectSupport().prepare_engine(engine)
    else:
        engine = migrate.open_engine(url)
    migrate.upgrade(engine)
    raise SystemExit("the migration was expected to crash")


def failover_worker(url: str, worker: str, count: int, ack_path: str, events: Any) -> None:
    """Answer ``count`` webhooks the documented way, redelivering each until acknowledged.

    Each id is appended to ``ack_path`` once its claim block exited cleanly;
    the result is ``{"errors": <failed attempts retried>}``.
    """
    from chatflow_sqlalchemy import PostgresSessionStore
    from chatflow_sqlalchemy.testing import ScriptedEngine

    class Store(PostgresSessionStore):
        operation_timeout = 5.0

    # Nothing pruned: every turn is counted. Leases the crash kept from being given back
    # (replicated to the promoted server) expire soon.
    store = Store(url, default_max_turns=10_000, turn_lease_seconds=3.0)
    runner = Runner(starting_agent=Agent(name="Bot", instructions=""), session_store=store,
                    engine=ScriptedEngine(delay=0.01))
    errors = 0

    async def deliver(mid: str, session_id: str) -> bool:
        nonlocal errors
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                async with store.claim(mid, session_id=session_id, lease_seconds=2.0) as claim:
                    if claim.acquired:
                        result = await runner.run_async(session_id, mid)
                        claim.response = result.content
                    elif claim.status != "done":
                        await asyncio.sleep(0.2)
                        continue
                return True
            except Exception:
                errors += 1
                await asyncio.sleep(0.2)
        return False

    async def main() -> None:
        with open(ack_path, "a") as acks:
            for k in range(count):
                mid = f"{worker}-{k}"
                if await deliver(mid, f"s{k % 3}"):
                    acks.write(mid + "\n")
                    acks.flush()

    asyncio.run(main())
    store.close()
    events.put(("done", os.getpid(), {"errors": errors}))


def lease_holder(spec: StoreSpec, session_id: str, label: str, release_path: str,
                 store_options: dict[str, Any], events: Any) -> None:
    """Hold a turn on ``session_id`` until ``release_path`` exists, then write it.

    Inside ``session.lock``: a USER message ``label``, ``("ready", pid)``, then
    the "model call" (waiting for the file) and a MODEL message ``label +
    " answer"``. The tests kill it or stop it while it waits. Its result: None
    once the turn is written, ``"lease lost"`` if its turn raised
    ``LeaseLostError`` (any other error is a crash).
    """
    from chatflow_sqlalchemy import LeaseLostError

    store: Any = spec.open(**store_options)
    session = store.get_or_create(session_id, Agent(name="Bot", instructions=""))

    async def turn() -> str | None:
        try:
            async with session.lock:
                await session.aadd_message(Message(role=Role.USER, content=label))
                events.put(("ready", os.getpid()))
                while not os.path.exists(release_path):
                    await asyncio.sleep(0.02)
                await session.aadd_message(Message(role=Role.MODEL, content=f"{label} answer"))
        except LeaseLostError:
            return "lease lost"
        return None

    outcome = asyncio.run(turn())
    store.close()
    events.put(("done", os.getpid(), outcome))


def lease_taker(spec: StoreSpec, session_id: str, label: str, store_options: dict[str, Any],
                events: Any) -> None:
    """Take a turn on ``session_id`` (USER ``label``, MODEL ``label + " answer"``).

    Reports ``("waiting", pid)`` just before ``session.lock``, ``("entered",
    pid, contents)`` with the history it sees once inside; its result is that
    same list.
    """
    store: Any = spec.open(**store_options)
    session = store.get_or_create(session_id, Agent(name="Bot", instructions=""))

    async def turn() -> list[str | None]:
        events.put(("waiting", os.getpid()))
        async with session.lock:
            seen = [m.content for m in session.history]
            events.put(("entered", os.getpid(), seen))
            await session.aadd_message(Message(role=Role.USER, content=label))
            await session.aadd_message(Message(role=Role.MODEL, content=f"{label} answer"))
        return seen

    seen = asyncio.run(turn())
    store.close()
    events.put(("done", os.getpid(), seen))


def held_waiter(spec: StoreSpec, session_id: str, label: str, release_path: str,
                events: Any) -> None:
    """Read ``session_id``, then take a turn on it held until ``release_path`` exists.

    Reports ``("waiting", pid)`` once it read the session (before ``session.lock``),
    ``("entered", pid, contents)`` inside the turn after its USER message
    ``label``; then waits for the file and adds ``label + " answer"``. Its result:
    the history it saw when it entered.
    """
    store: Any = spec.open()
    session = store.get_or_create(session_id, Agent(name="Bot", instructions=""))

    async def turn() -> list[str | None]:
        events.put(("waiting", os.getpid()))
        async with session.lock:
            seen = [m.content for m in session.history]
            await session.aadd_message(Message(role=Role.USER, content=label))
            events.put(("entered", os.getpid(), seen))
            while not os.path.exists(release_path):
                await asyncio.sleep(0.02)
            await session.aadd_message(Message(role=Role.MODEL, content=f"{label} answer"))
        return seen

    seen = asyncio.run(turn())
    store.close()
    events.put(("done", os.getpid(), seen))
