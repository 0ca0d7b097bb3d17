"""Client CPU per turn, store against its floor: ``python -m benchmarks.cpu``.

Run: ``python -m benchmarks.cpu [--stores ours-pg-claim,raw-pg-claim,...]
[--sessions S] [--turns T] [--rounds R] [--profile FILE]``.

On a shared, loaded machine wall-clock ratios move with the neighbours; the
CPU this process spends per turn (``os.times``, user and system: the same
clock as ``time.process_time``, every thread of it, the store's I/O threads
included) moves much less, and it is what the layer
adds over its floor. Each round runs every store on a fresh database, one
process, S sessions x T webhook turns round-robin, the stores interleaved;
it prints the median CPU ms and wall ms per turn, and statements per turn
(counted on the store's engines; floors show ``-``), and Python function calls
per turn from one more pass under cProfile: a count the machine's load does
not move, to compare two versions of the code. ``--profile`` writes a
cProfile of the first store's last round (all threads merged).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from sqlalchemy import event

from benchmarks.workload import TurnRef

__all__ = ["main", "measure"]

DEFAULT_STORES = ("ours-pg-claim", "raw-pg-claim", "ours-pg", "raw-pg", "ours-sqlite",
                  "raw-sqlite")


@contextmanager
def _counted(adapter: Any) -> Iterator[list[int]]:
    """Count the statements the adapter's store sends while the block runs."""
    count = [0]
    store = getattr(adapter, "store", None)
    engines = [] if store is None else list({id(e): e for e in store.engines}.values())

    def seen(*_args: Any) -> None:
        count[0] += 1

    for engine in engines:
        event.listen(engine, "before_cursor_execute", seen)
    try:
        yield count if engines else []
    finally:
        for engine in engines:
            event.remove(engine, "before_cursor_execute", seen)


def _refs(sessions: int, turns: int, label: str) -> list[TurnRef]:
    return [TurnRef(f"+55{label}{k % sessions:04d}", k // sessions, f"{label}-{k}")
            for k in range(sessions * turns)]


async def _count_calls(adapter: Any, timed: list[tuple[TurnRef, Any]]) -> float:
    """Python function calls per turn (cProfile, every thread): a deterministic proxy for CPU."""
    from benchmarks.profiling import Profiler

    profiler = Profiler(getattr(adapter, "store", None))
    with profiler:
        for ref, payload in timed:
            await adapter.turn(ref, payload)
    return float(profiler.stats().total_calls) / len(timed)  # type: ignore[attr-defined]


async def _drive(adapter: Any, refs: list[TurnRef], warm: int,
                 profile: str | None, calls: bool = False) -> dict[str, float]:
    payloads = [adapter.payload(ref) for ref in refs]
    await adapter.open()
    try:
        for ref, payload in zip(refs[:warm], payloads[:warm], strict=True):
            await adapter.turn(ref, payload)
        timed = list(zip(refs[warm:], payloads[warm:], strict=True))
        if calls:  # a pass of its own: the profiler's cost must not reach the timings
            return {"calls": await _count_calls(adapter, timed)}
        profiler: Any = None
        if profile:
            from benchmarks.profiling import Profiler

            profiler = Profiler(adapter.store if hasattr(adapter, "store") else None)
        with _counted(adapter) as count, profiler or nullcontext():
            times, wall = os.times(), time.perf_counter()
            for ref, payload in timed:
                await adapter.turn(ref, payload)
            wall = time.perf_counter() - wall
            user, system = os.times().user - times.user, os.times().system - times.system
        if profiler is not None and profile:
            profiler.stats().dump_stats(profile)
        per = 1000 / len(timed)
        return {"cpu ms": (user + system) * per, "user ms": user * per,
                "system ms": system * per, "wall ms": wall * per,
                "statements": count[0] / len(timed) if count else float("nan")}
    finally:
        await adapter.close()


def measure(name: str, sessions: int, turns: int, label: str, folder: Path,
            pg_url: str | None, profile: str | None = None,
            calls: bool = False) -> dict[str, float]:
    """One store, one fresh database: CPU and wall ms per turn after a warm-up turn each."""
    from benchmarks.pg import create_schema, drop_schema
    from benchmarks.stores import Target, adapter_class

    cls = adapter_class(name)
    schema = None
    if cls.backend == "postgres":
        assert pg_url is not None
        schema = create_schema(pg_url, label)
        target = Target(pg_url=pg_url, schema=schema)
    else:
        target = Target(path=str(folder / f"{label}.db"))
    try:
        cls.prepare(target)
        refs = _refs(sessions, turns + 1, label)
        return asyncio.run(_drive(cls(target), refs, sessions, profile, calls))
    finally:
        if schema is not None and pg_url is not None:
            drop_schema(pg_url, schema)


def main(argv: list[str] | None = None) -> int:
    """Interleaved rounds over the stores; a markdown table of medians."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--stores", default=",".join(DEFAULT_STORES))
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pg-url", default=None)
    parser.add_argument("--profile", default=None, help="cProfile file of the first store")
    args = parser.parse_args(argv)
    from benchmarks.pg import pg_url_from_env

    stores = [s for s in args.stores.split(",") if s]
    pg_url = pg_url_from_env(args.pg_url) if any("pg" in s for s in stores) else None
    folder = Path(tempfile.mkdtemp(prefix="chatflow-cpu-"))
    results: dict[str, list[dict[str, float]]] = {s: [] for s in stores}
    try:
        for round_ in range(args.rounds):
            for index, store in enumerate(stores):
                last = round_ == args.rounds - 1 and index == 0
                results[store].append(measure(
                    store, args.sessions, args.turns, f"cpu{round_}_{index}", folder, pg_url,
                    args.profile if last else None))
        counted = {store: measure(store, args.sessions, args.turns, f"calls{index}", folder,
                                  pg_url, calls=True)["calls"]
                   for index, store in enumerate(stores)}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    _print(results, counted)
    return 0


def _print(results: dict[str, list[dict[str, float]]], counted: dict[str, float]) -> None:
    print(f"per turn, medians of {len(next(iter(results.values())))} rounds "
          f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    print("| store | client CPU ms (user + system) | wall ms | statements | Python calls |")
    print("|---|---|---|---|---|")
    for store, rounds in results.items():
        cpu = statistics.median(r["cpu ms"] for r in rounds)
        user = statistics.median(r["user ms"] for r in rounds)
        system = statistics.median(r["system ms"] for r in rounds)
        wall = statistics.median(r["wall ms"] for r in rounds)
        stmts = statistics.median(r["statements"] for r in rounds)
        shown = "-" if stmts != stmts else f"{stmts:.2f}"
        print(f"| `{store}` | {cpu:.3f} ({user:.3f} + {system:.3f}) | {wall:.3f} | {shown} "
              f"| {counted[store]:.0f} |")


if __name__ == "__main__":
    raise SystemExit(main())
