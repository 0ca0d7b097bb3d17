"""PostgreSQL round trips and commits per Runner turn, counted (not timed); and a 1 ms-RTT run.

Run: ``python -m benchmarks.roundtrips`` (needs the PostgreSQL server
binaries for a private cluster, and ``pip install -e '.[bench]'`` for the
latency comparison).

**Counts.** A private cluster (``tests/pg_private.py``, nothing else talks
to it) behind the counting TCP proxy (``tests/faultproxy.py``). Per Runner
turn, averaged over ``turns`` turns after a warm-up:

* ``round trips``: times a client sent something after the server had
  answered (a psycopg pipeline or a multi-statement query is one);
* ``syncs``: ``Sync`` + simple ``Query`` messages (each ends in a
  ``ReadyForQuery``);
* ``commits``: transaction ids consumed (``txid_current()`` before and after,
  less the probes' own): a write transaction's commit is a WAL flush, a
  read-only one is not counted.

Three handlers: ``bare`` (``runner.run_async``), ``record`` (the 0.3.4
``record_processed_message`` claim, then the turn) and ``claim`` (``async with
store.claim(...)``, the turn, ``claim.response = ...``: durable claim before
the model call, the reply stored with the claim).

The ``raw-pg-claim`` floor (a claimed turn's guarantees in two autocommit
statements, ``benchmarks/stores/floors.py``) is counted the same way.

**Latency.** The same cluster behind the proxy in delay mode (0.5 ms each way,
so ~1 ms per round trip): the webhook-turn workload of ``python -m
benchmarks`` (claim, 4 messages) on ``ours-pg`` (``record_processed_message``),
``ours-pg-claim`` (the same turn in ``async with store.claim(...)``, its reply
stored), the ``raw-pg`` floor, the guarantee-equivalent ``raw-pg-claim`` floor
and openai-agents' ``oai-sqla-pg``, interleaved in one run; turns/s, client
CPU per turn (``time.process_time``) and ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

__all__ = ["LATENCY_STORES", "claiming_adapter", "count_floor", "count_turns", "latency_run",
           "main"]

DELAY_MS = 0.5


def _txid(direct_url: str) -> int:
    import psycopg

    from benchmarks.pg import libpq_url

    with psycopg.connect(libpq_url(direct_url), autocommit=True) as conn:
        row = conn.execute("SELECT txid_current()").fetchone()
        assert row is not None
        return int(row[0])


def _runner(store: Any) -> Any:
    from chatflow_agent import Agent, Runner

    from chatflow_sqlalchemy.testing import ScriptedEngine

    return Runner(starting_agent=Agent(name="Bot", instructions=""), session_store=store,
                  engine=ScriptedEngine())


async def _handle(kind: str, store: Any, runner: Any, session_id: str, k: int) -> None:
    mid = f"{kind}-{session_id}-{k}"
    if kind == "bare":
        await runner.run_async(session_id, f"q{k}")
    elif kind == "record":
        if store.record_processed_message(mid):
            await runner.run_async(session_id, f"q{k}")
    else:
        async with store.claim(mid, session_id=session_id) as claim:
            if claim.acquired:
                result = await runner.run_async(session_id, f"q{k}")
                claim.response = result.content


def count_turns(proxy: Any, direct_url: str, turns: int = 40) -> dict[str, dict[str, float]]:
    """Per-turn counts of each handler (see the module docstring)."""
    from chatflow_sqlalchemy import PostgresSessionStore

    results: dict[str, dict[str, float]] = {}
    for kind in ("bare", "record", "claim"):
        store = PostgresSessionStore(proxy.url(direct_url))
        runner = _runner(store)
        sessions = [f"{kind}-s{i}" for i in range(4)]

        async def drive(first: int, count: int, store: Any = store, runner: Any = runner,
                        sessions: list[str] = sessions, kind: str = kind) -> None:
            for k in range(first, first + count):
                await _handle(kind, store, runner, sessions[k % len(sessions)], k)

        async def run_all(drive: Any = drive) -> dict[str, int]:
            await drive(0, 8)  # warm-up: connections opened, sessions created
            before = _txid(direct_url)
            proxy.reset_counts()
            await drive(8, turns)
            counts: dict[str, int] = proxy.reset_counts()
            counts["xids"] = _txid(direct_url) - before - 1
            return counts

        try:
            counts = asyncio.run(run_all())
        finally:
            store.close()
        results[kind] = {
            "round trips": counts["round_trips"] / turns,
            "syncs": counts["syncs"] / turns,
            "commits": counts["xids"] / turns,
        }
    return results


def claiming_adapter() -> type[Any]:
    """``ours-pg`` with each turn in ``async with store.claim(...)``, its reply stored."""
    from benchmarks.stores import adapter_class

    return adapter_class("ours-pg-claim")


def _refs(prefix: str, turns: int) -> list[Any]:
    from benchmarks.workload import TurnRef

    return [TurnRef(f"s{k % 10}", k // 10, f"{prefix}-{k}") for k in range(turns)]


def count_floor(proxy: Any, direct_url: str, turns: int = 40) -> dict[str, float]:
    """Per-turn counts of the ``raw-pg-claim`` floor, as :func:`count_turns` counts."""
    from benchmarks.pg import create_schema
    from benchmarks.stores import Target, adapter_class

    cls = adapter_class("raw-pg-claim")
    target = Target(pg_url=proxy.url(direct_url), schema=create_schema(direct_url, "count"))
    cls.prepare(target)
    adapter = cls(target)
    refs = _refs("count", turns + 20)

    async def run_all() -> dict[str, int]:
        await adapter.open()
        try:
            for ref in refs[:20]:  # warm-up: sessions created, statements prepared
                await adapter.turn(ref, adapter.payload(ref))
            before = _txid(direct_url)
            proxy.reset_counts()
            for ref in refs[20:]:
                await adapter.turn(ref, adapter.payload(ref))
            counts: dict[str, int] = proxy.reset_counts()
            counts["xids"] = _txid(direct_url) - before - 1
            return counts
        finally:
            await adapter.close()

    counts = asyncio.run(run_all())
    return {"round trips": counts["round_trips"] / turns, "syncs": counts["syncs"] / turns,
            "commits": counts["xids"] / turns}


LATENCY_STORES = ("raw-pg", "raw-pg-claim", "ours-pg", "ours-pg-claim", "oai-sqla-pg")


async def _timed(adapter: Any, refs: list[Any], payloads: list[Any]) -> tuple[float, float]:
    """(turns/s, client CPU ms per turn) of ``adapter`` over ``refs`` after one warm-up turn."""
    await adapter.open()
    try:
        await adapter.turn(refs[0], payloads[0])
        start, cpu = time.perf_counter(), time.process_time()
        for ref, payload in zip(refs[1:], payloads[1:], strict=True):
            await adapter.turn(ref, payload)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        return (len(refs) - 1) / wall, cpu * 1000 / (len(refs) - 1)
    finally:
        await adapter.close()


def latency_run(proxy: Any, direct_url: str, turns: int = 300,
                rounds: int = 3) -> dict[str, tuple[float, float]]:
    """Median (turns/s, client CPU ms per turn) of each store behind a ~1 ms-RTT proxy."""
    from benchmarks.pg import create_schema
    from benchmarks.runner import median
    from benchmarks.stores import Target, adapter_class
    from tests.faultproxy import Mode

    url = proxy.url(direct_url)
    rates: dict[str, list[tuple[float, float]]] = {}
    proxy.set_mode(Mode.DELAY, delay_ms=DELAY_MS)
    try:
        for round_ in range(rounds):
            for name in LATENCY_STORES:
                cls = adapter_class(name)
                target = Target(pg_url=url, schema=create_schema(direct_url, name))
                cls.prepare(target)
                adapter = cls(target)
                refs = _refs(f"r{round_}-{name}", turns)
                payloads = [adapter.payload(ref) for ref in refs]
                rates.setdefault(name, []).append(asyncio.run(_timed(adapter, refs, payloads)))
    finally:
        proxy.set_mode(Mode.PASS)
    return {name: (median([r for r, _ in values]), median([c for _, c in values]))
            for name, values in rates.items()}


def _print_latency(rates: dict[str, tuple[float, float]]) -> None:
    columns = ("raw-pg", "raw-pg-claim", "oai-sqla-pg")
    print(f"\n| store ({DELAY_MS} ms each way) | turns/s | client CPU ms/turn | "
          + " | ".join(f"x {c}" for c in columns) + " |")
    print("|---|---|---|" + "---|" * len(columns))
    for name, (rate, cpu) in rates.items():
        ratios = " | ".join(f"{rate / rates[c][0]:.2f}" for c in columns)
        print(f"| {name} | {rate:.0f} | {cpu:.2f} | {ratios} |")


def main(argv: list[str] | None = None) -> int:
    """Start a private cluster and the proxy, print both tables (markdown)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=40, help="counted turns per handler")
    parser.add_argument("--latency-turns", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-latency", action="store_true")
    args = parser.parse_args(argv)

    from tests.faultproxy import FaultProxy
    from tests.pg_private import PrivateCluster, private_cluster_problem

    problem = private_cluster_problem()
    if problem:
        raise SystemExit(f"cannot start a private PostgreSQL cluster: {problem}")
    cluster = PrivateCluster().start()
    try:
        with FaultProxy("127.0.0.1", cluster.port) as proxy:
            counted = count_turns(proxy, cluster.url, args.turns)
            print("| handler | round trips / turn | Sync+Query / turn | commits / turn |")
            print("|---|---|---|---|")
            counted["raw-pg-claim floor"] = count_floor(proxy, cluster.url, args.turns)
            for kind, row in counted.items():
                print(f"| {kind} | {row['round trips']:.2f} | {row['syncs']:.2f} "
                      f"| {row['commits']:.2f} |")
            if not args.no_latency:
                _print_latency(latency_run(proxy, cluster.url, args.latency_turns, args.rounds))
    finally:
        cluster.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
