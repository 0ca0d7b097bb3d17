"""The inbox suite: how many messages ``store.inbox`` answers, and how soon.

Two parts:

* **throughput** (PostgreSQL, a fresh schema): a backlog of ``messages``
  messages, one per session (so every batch is one message: the worst
  case), is drained by 4 worker **processes**, each running one
  ``store.inbox.serve(handle, concurrency=4, coalesce_seconds=0)`` loop
  whose ``handle`` returns a short string and runs no turn: what the
  inbox itself costs. Twice: ``send=None`` (messages end ``done``) and a
  no-op ``send`` (they end ``sent``: one more statement). Against its floor,
  measured in the same rounds: ``raw-pg-queue``, a hand-written
  ``FOR UPDATE SKIP LOCKED`` queue on psycopg 3 (4 processes x 4 tasks, one
  connection each) that takes a message and marks it done (and sent), with
  none of the inbox's guarantees: no per-session order or exclusivity, no
  lease, so a killed worker's message stays taken forever. The sessions
  exist (an untimed first drain created them).
* **latency** (PostgreSQL and a SQLite file): one message at a time (the
  next once the reply is sent), each a real ``Runner`` turn (offline engine)
  on one of ``latency_sessions`` sessions. The inbox: ``put`` (what the
  webhook waits for before its 200), then put -> ``send``
  (``coalesce_seconds=0``), with the worker in the webhook's process (a local
  put wakes it) and in another process (it finds the put by polling). Beside
  it the claim path: ``store.claim`` -> the same turn -> the reply, all
  before the webhook's 200. Then, the worker in another process, messages
  ``idle_gap`` apart: how long an idle worker takes to notice a put.

Run alone: ``python -m benchmarks --only inbox`` or ``python -m benchmarks.inbox``.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.pg import create_schema, drop_schema, libpq_url, schema_connect_args
from benchmarks.runner import Env, median, percentile, run_alone

__all__ = ["QUICK", "InboxConfig", "render_inbox", "run_inbox"]

Progress = Callable[[str], None]


@dataclass(frozen=True)
class InboxConfig:
    """Sizes of the inbox suite."""

    messages: int = 1000
    workers: int = 4
    concurrency: int = 4
    latency_messages: int = 300
    latency_sessions: int = 30
    idle_messages: int = 20
    idle_gap: float = 0.4
    rounds: int = 3


QUICK = InboxConfig(messages=400, latency_messages=60, idle_messages=10, rounds=1)
"""The sizes of ``--quick``."""


def _open(spec: dict[str, Any], **kwargs: Any) -> Any:
    if spec["kind"] == "sqlite":
        from chatflow_sqlalchemy import SQLiteSessionStore

        return SQLiteSessionStore(spec["path"], **kwargs)
    from chatflow_sqlalchemy import PostgresSessionStore

    return PostgresSessionStore(
        spec["url"], connect_args=schema_connect_args(spec["schema"]), **kwargs
    )


def _connect(spec: dict[str, Any]) -> Any:
    """A psycopg 3 connection in the spec's schema (autocommit)."""
    import psycopg

    return psycopg.connect(libpq_url(spec["url"]), autocommit=True,
                           options=f"-csearch_path={spec['schema']}")


# ------------------------------------------------------------------ throughput


def _inbox_worker(spec: dict[str, Any], send: bool, concurrency: int, ready: Any,
                  go: Any) -> None:
    """Serve the inbox with a no-op ``handle`` (and a no-op ``send``) until terminated."""
    store = _open(spec)
    store.inbox.stats()  # connected, statements warm

    async def handle(batch: Any) -> str:
        return "ok"

    async def deliver(reply: Any) -> None:
        return None

    ready.put(1)
    go.wait()
    asyncio.run(store.inbox.serve(handle, send=deliver if send else None,
                                  concurrency=concurrency, coalesce_seconds=0))


_QUEUE_DDL = """
CREATE TABLE IF NOT EXISTS bench_queue (
    id bigserial PRIMARY KEY, session_id text NOT NULL, message_id text NOT NULL UNIQUE,
    text text NOT NULL, state text NOT NULL, reply text, updated_at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS bench_queue_state_id ON bench_queue (state, id);
"""
_QUEUE_TAKE = """
UPDATE bench_queue SET state = 'in_flight', updated_at = now()
WHERE id = (SELECT id FROM bench_queue WHERE state = 'pending' ORDER BY id
            FOR UPDATE SKIP LOCKED LIMIT 1)
RETURNING id, session_id, text
"""
_QUEUE_FINISH = "UPDATE bench_queue SET state = %s, reply = %s, updated_at = now() WHERE id = %s"
_QUEUE_SENT = "UPDATE bench_queue SET state = 'sent', updated_at = now() WHERE id = %s"


def _queue_worker(spec: dict[str, Any], send: bool, concurrency: int, ready: Any,
                  go: Any) -> None:
    """The floor: ``concurrency`` tasks, a connection each, drain ``bench_queue``."""
    import psycopg

    async def drain() -> None:
        conn = await psycopg.AsyncConnection.connect(
            libpq_url(spec["url"]), autocommit=True, options=f"-csearch_path={spec['schema']}"
        )
        async with conn:
            while True:
                row = await (await conn.execute(_QUEUE_TAKE)).fetchone()
                if row is None:
                    return
                await conn.execute(_QUEUE_FINISH, ("in_flight" if send else "done", "ok", row[0]))
                if send:
                    await conn.execute(_QUEUE_SENT, (row[0],))

    async def main() -> None:
        await asyncio.gather(*(drain() for _ in range(concurrency)))

    ready.put(1)
    go.wait()
    asyncio.run(main())


def _backlog(spec: dict[str, Any], floor: bool, label: str, n: int) -> None:
    """Put ``n`` messages, one per session ``s0..s{n-1}`` (untimed)."""
    if floor:
        with _connect(spec) as conn, conn.cursor() as cur:
            cur.execute(_QUEUE_DDL)
            cur.executemany(
                "INSERT INTO bench_queue (session_id, message_id, text, state, updated_at) "
                "VALUES (%s, %s, %s, 'pending', now())",
                [(f"s{k}", f"{label}-{k}", f"hello {k}") for k in range(n)],
            )
        return
    store = _open(spec)
    try:
        for k in range(n):
            store.inbox.put(f"{label}-{k}", session_id=f"s{k}", text=f"hello {k}")
    finally:
        store.close()


def _outstanding(spec: dict[str, Any], floor: bool) -> int:
    """Messages not answered yet (pending or in flight): an index search on ``state``."""
    table = "bench_queue" if floor else "chatflow_inbox"
    with _connect(spec) as conn:
        row = conn.execute(
            f"SELECT count(*) FROM {table} WHERE state IN ('pending', 'in_flight')"
        ).fetchone()
    return int(row[0])


def _verify(spec: dict[str, Any], floor: bool, send: bool, label: str, n: int) -> None:
    """Every message of the case ended answered (``sent``, or ``done`` without ``send``).

    Raises:
        RuntimeError: Some did not: the case's figure would not count.

    """
    table = "bench_queue" if floor else "chatflow_inbox"
    with _connect(spec) as conn:
        rows = conn.execute(
            f"SELECT state, count(*) FROM {table} WHERE message_id LIKE %s GROUP BY state",
            (f"{label}-%",),
        ).fetchall()
    states = {state: int(count) for state, count in rows}
    if states != {"sent" if send else "done": n}:
        raise RuntimeError(f"case {label}: states {states}, expected all {n} answered")


def _drain(spec: dict[str, Any], cfg: InboxConfig, floor: bool, send: bool, label: str
           ) -> dict[str, Any]:
    """Put the backlog, start the workers together, time until every message is answered."""
    _backlog(spec, floor, label, cfg.messages)
    ctx = multiprocessing.get_context("spawn")
    ready, go = ctx.Queue(), ctx.Event()
    target = _queue_worker if floor else _inbox_worker
    workers = [ctx.Process(target=target, args=(spec, send, cfg.concurrency, ready, go),
                           daemon=True) for _ in range(cfg.workers)]
    for worker in workers:
        worker.start()
    try:
        for _ in workers:
            ready.get(timeout=120)
        began = time.perf_counter()
        go.set()
        deadline = began + 600
        while (left := _outstanding(spec, floor)) > 0:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{left} of {cfg.messages} unanswered after 600 s")
            time.sleep(0.01)
        seconds = time.perf_counter() - began
    finally:
        for worker in workers:
            worker.terminate()
            worker.join(10)
    _verify(spec, floor, send, label, cfg.messages)
    return {"seconds": seconds, "per_s": cfg.messages / seconds}


def _throughput(env: Env, cfg: InboxConfig, log: Progress) -> dict[str, list[float]]:
    """messages/s per case, over rounds (floor and inbox interleaved)."""
    assert env.pg_url is not None
    schema = create_schema(env.pg_url, "inbox")
    spec = {"kind": "postgresql", "url": env.pg_url, "schema": schema}
    series: dict[str, list[float]] = {}
    try:
        _open(spec).close()  # the store's tables
        _drain(spec, cfg, floor=False, send=False, label="warm")  # creates the sessions
        cases = [(floor, send) for send in (False, True) for floor in (True, False)]
        for rnd in range(cfg.rounds):
            for floor, send in cases:
                name = f"{'raw-pg-queue' if floor else 'inbox'} send={'no-op' if send else 'None'}"
                result = _drain(spec, cfg, floor, send, f"r{rnd}-{int(floor)}{int(send)}")
                series.setdefault(name, []).append(result["per_s"])
                log(f"  round {rnd + 1}: {name:24} {result['per_s']:8.0f} messages/s "
                    f"({cfg.messages} in {result['seconds']:.2f} s)")
    finally:
        drop_schema(env.pg_url, schema)
    return series


# ------------------------------------------------------------------ latency


def _runner(store: Any) -> Any:
    from chatflow_agent import Agent, Runner

    from chatflow_sqlalchemy.testing import ScriptedEngine

    return Runner(starting_agent=Agent(name="Bot", instructions=""), session_store=store,
                  engine=ScriptedEngine())


async def _inbox_latency(store: Any, cfg: InboxConfig, label: str
                         ) -> tuple[list[float], list[float]]:
    """(put ms, put -> send ms) per message, the worker in this process and loop."""
    runner = _runner(store)
    arrived: dict[str, asyncio.Future[float]] = {}

    async def handle(batch: Any) -> str | None:
        result = await runner.run_async(session_id=batch.session_id, user_message=batch.text)
        return str(result.content)

    async def send(reply: Any) -> None:
        now = time.perf_counter()
        for mid in reply.message_ids:
            arrived[mid].set_result(now)

    serving = asyncio.get_running_loop().create_task(
        store.inbox.serve(handle, send=send, concurrency=4, coalesce_seconds=0))
    puts, totals = [], []
    try:
        for k in range(cfg.latency_messages):
            mid = f"{label}-{k}"
            arrived[mid] = asyncio.get_running_loop().create_future()
            began = time.perf_counter()
            await store.inbox.aput(mid, session_id=f"l{k % cfg.latency_sessions}",
                                   text=f"hello {k}")
            puts.append((time.perf_counter() - began) * 1e3)
            totals.append((await asyncio.wait_for(arrived[mid], 30) - began) * 1e3)
        await _settled(store)
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
    return puts, totals


async def _settled(store: Any) -> None:
    """Wait until the inbox recorded the last reply as sent.

    Cancelling ``serve`` between a ``send`` and its record leaves the reply to
    be sent again by the next worker (the record is cancelled with the batch).
    """
    deadline = time.monotonic() + 30
    while (await store.inbox.astats()).counts["in_flight"] and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def _latency_worker(spec: dict[str, Any], ready: Any, sent: Any) -> None:
    """Serve with real turns; report each sent message id with ``time.monotonic()``."""
    store = _open(spec, default_max_turns=10_000)
    runner = _runner(store)

    async def handle(batch: Any) -> str | None:
        result = await runner.run_async(session_id=batch.session_id, user_message=batch.text)
        return str(result.content)

    async def send(reply: Any) -> None:
        now = time.monotonic()
        for mid in reply.message_ids:
            sent.put((mid, now))

    store.inbox.stats()
    ready.put(1)
    asyncio.run(store.inbox.serve(handle, send=send, concurrency=4, coalesce_seconds=0))


def _remote_latency(spec: dict[str, Any], cfg: InboxConfig, label: str, count: int,
                    gap: float = 0.0) -> list[float]:
    """put -> send ms per message, the worker in another process (it polls for work).

    ``gap``: seconds between a reply and the next put, so that the worker is
    idle (its polling backs off) when the message comes.
    """
    ctx = multiprocessing.get_context("spawn")
    ready, sent = ctx.Queue(), ctx.Queue()
    worker = ctx.Process(target=_latency_worker, args=(spec, ready, sent), daemon=True)
    worker.start()
    store = _open(spec, default_max_turns=10_000)
    totals = []
    try:
        ready.get(timeout=120)
        for k in range(count):
            time.sleep(gap)
            mid = f"{label}-{k}"
            began = time.monotonic()
            store.inbox.put(mid, session_id=f"r{k % cfg.latency_sessions}", text=f"hello {k}")
            got, at = sent.get(timeout=30)
            assert got == mid, f"sent {got}, expected {mid}"
            totals.append((at - began) * 1e3)
        asyncio.run(_settled(store))
    finally:
        worker.terminate()
        worker.join(10)
        store.close()
    return totals


async def _claim_latency(store: Any, cfg: InboxConfig, label: str) -> list[float]:
    """claim -> turn -> reply ms per message (DESIGN.md's claim pattern, then a no-op send)."""
    runner = _runner(store)

    async def send(reply: str) -> None:
        return None

    totals = []
    for k in range(cfg.latency_messages):
        session_id = f"c{k % cfg.latency_sessions}"
        began = time.perf_counter()
        async with store.claim(f"{label}-{k}", session_id=session_id) as claim:
            if claim.acquired:
                result = await runner.run_async(session_id=session_id, user_message=f"hi {k}")
                claim.response = result.content
        await send(str(claim.response))
        totals.append((time.perf_counter() - began) * 1e3)
    return totals


def _latency(spec: dict[str, Any], cfg: InboxConfig, rnd: int) -> dict[str, list[float]]:
    store = _open(spec, default_max_turns=10_000)
    try:
        puts, local = asyncio.run(_inbox_latency(store, cfg, f"local-r{rnd}"))
        claim = asyncio.run(_claim_latency(store, cfg, f"claim-r{rnd}"))
    finally:
        store.close()
    remote = _remote_latency(spec, cfg, f"remote-r{rnd}", cfg.latency_messages)
    idle = _remote_latency(spec, cfg, f"idle-r{rnd}", cfg.idle_messages, cfg.idle_gap)
    return {"put (the 200)": puts, "put -> send, worker in-process": local,
            "put -> send, worker in another process": remote,
            f"put -> send, another process, {cfg.idle_gap:g} s apart": idle,
            "claim -> turn -> reply (then the 200)": claim}


def _latencies(env: Env, cfg: InboxConfig, log: Progress
               ) -> dict[str, dict[str, dict[str, list[float]]]]:
    """backend -> path -> {"p50": [per round], "p99": [...]}."""
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    targets: list[tuple[str, dict[str, Any], Callable[[], None]]] = []
    sqlite_dir = Path(env.workdir) / "inbox"
    sqlite_dir.mkdir(exist_ok=True)
    targets.append(("sqlite", {"kind": "sqlite", "path": str(sqlite_dir / "inbox.db")},
                    lambda: None))
    if env.pg_url is not None:
        url = env.pg_url
        schema = create_schema(url, "inbox_latency")
        targets.append(("postgresql", {"kind": "postgresql", "url": url, "schema": schema},
                        lambda: drop_schema(url, schema)))
    for name, spec, cleanup in targets:
        try:
            _open(spec).close()
            for rnd in range(cfg.rounds):
                for path, values in _latency(spec, cfg, rnd).items():
                    cell = out.setdefault(name, {}).setdefault(path, {"p50": [], "p99": []})
                    cell["p50"].append(percentile(values, 0.5))
                    cell["p99"].append(percentile(values, 0.99))
                    log(f"  round {rnd + 1}: {name:10} {path:40} p50 {cell['p50'][-1]:7.2f} ms"
                        f"  p99 {cell['p99'][-1]:7.2f} ms")
        finally:
            cleanup()
    return out


# ------------------------------------------------------------------ suite


def run_inbox(env: Env, log: Progress, cfg: InboxConfig | None = None) -> str:
    """Run both parts (throughput only with PostgreSQL); return the markdown section."""
    cfg = cfg or InboxConfig()
    throughput: dict[str, list[float]] = {}
    if env.pg_url is not None:
        log(f"inbox: throughput, {cfg.messages} messages, {cfg.workers} processes")
        throughput = _throughput(env, cfg, log)
    log(f"inbox: latency, {cfg.latency_messages} messages one at a time")
    latency = _latencies(env, cfg, log)
    return render_inbox(throughput, latency, cfg)


def render_inbox(throughput: dict[str, list[float]],
                 latency: dict[str, dict[str, dict[str, list[float]]]],
                 cfg: InboxConfig) -> str:
    """The markdown of the inbox suite (medians over rounds)."""
    lines = [f"### Inbox: throughput, {cfg.messages} messages (one per session), "
             f"{cfg.workers} processes x concurrency {cfg.concurrency}, no-op handle, "
             f"PostgreSQL (medians of {cfg.rounds} rounds)", ""]
    if throughput:
        lines += ["| path | send | messages/s | x `raw-pg-queue` (same send) |",
                  "|---|---|---:|---:|"]
        for name, values in throughput.items():
            path, send = name.split(" send=")
            floor = median(throughput[f"raw-pg-queue send={send}"])
            ratio = "1.00 (floor)" if path == "raw-pg-queue" else f"{median(values) / floor:.2f}x"
            lines.append(f"| `{path}` | {send} | {median(values):,.0f} | {ratio} |")
    else:
        lines.append("(not run: no PostgreSQL)")
    lines += ["", f"### Inbox: latency, {cfg.latency_messages} messages one at a time, a Runner "
              f"turn each on {cfg.latency_sessions} sessions, coalesce_seconds=0 "
              f"(medians of {cfg.rounds} rounds)", "",
              "| database | path | p50 ms | p99 ms |", "|---|---|---:|---:|"]
    for db, paths in latency.items():
        for path, cell in paths.items():
            lines.append(f"| {db} | {path} | {median(cell['p50']):.2f} | "
                         f"{median(cell['p99']):.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """``python -m benchmarks.inbox [--quick]``: this suite alone."""
    run_alone(run_inbox, QUICK)


if __name__ == "__main__":
    main()
