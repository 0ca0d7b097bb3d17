"""What the one observable path costs, and where: the store's own SQL replayed on raw DBAPI.

Run: ``python -m benchmarks.replay [--backend sqlite|postgresql] [--turns N]
[--rounds R] [--delay-ms D]``.

Each round runs the one-process webhook-turn workload of ``python -m
benchmarks`` (``record_processed_message``, ``get_or_create``, ``async with
session.lock`` and four messages) three times, each on a fresh database
prepared by the store itself (same migrations, same partitions):

1. **store**: ``ours-sqlite`` / ``ours-pg``, untouched, timed.
2. **capture**: the same store with listeners on every engine it has
   (``store.engines``: the store's and its AsyncEngine's). They
   record every statement the driver is given, with its parameters, in order,
   and the commits and rollbacks; and they time each execution twice: the
   driver's part (``before/after_cursor_execute``) and SQLAlchemy Core's whole
   ``execute`` (``before/after_execute``).
3. **replay**: the captured trace sent again, in the same order, on plain
   driver connections (``sqlite3``; psycopg, one connection per engine of the
   store, autocommit), with no SQLAlchemy, no thread hop and no store code:
   the cost of the SQL itself, the floor of any layer that sends these
   statements.

``store - replay`` per turn is what the layer costs: SQLAlchemy's execution,
the store's Python (contexts, diffs, telemetry), the thread hop (SQLite) or
greenlet and async adapter (PostgreSQL). The capture run splits it: time
inside the driver, SQLAlchemy Core around it, and the rest. ``--delay-ms``
puts PostgreSQL behind the counting proxy's delay (``tests/faultproxy.py``,
each way) with the ``raw-pg`` floor in the same run: whether the store's own
statements, sent with no layer at all, could reach a ratio of the floor.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, event

from benchmarks.workload import TurnRef

__all__ = [
    "SESSIONS",
    "PostgresReplay",
    "Trace",
    "capture",
    "main",
    "replay_postgres",
    "replay_sqlite",
    "turn_refs",
]

SESSIONS = 50


@dataclass
class Trace:
    """Every statement a store sent, in order, and how long its parts took."""

    steps: list[tuple[int, str, Any, Any]] = field(default_factory=list)
    """``(engine index, kind, statement, parameters)``.

    ``kind`` is execute, many (``executemany``), commit or rollback (no statement).
    """
    driver_s: float = 0.0
    """Seconds inside the driver's execute (``before/after_cursor_execute``)."""
    core_s: float = 0.0
    """Seconds inside SQLAlchemy Core's ``execute`` (``before/after_execute``), driver included."""
    driver_in_core_s: float = 0.0
    """The part of ``driver_s`` inside a Core ``execute`` (``exec_driver_sql`` has none)."""


@contextmanager
def capture(engines: tuple[Engine, ...]) -> Iterator[Trace]:
    """Record what ``engines`` send while the block runs (listeners removed after)."""
    trace = Trace()
    hooks: list[tuple[Engine, str, Callable[..., Any]]] = []
    for index, engine in enumerate(_unique(engines)):
        hooks.extend((engine, name, fn) for name, fn in _hooks(trace, index).items())
    for engine, name, fn in hooks:
        event.listen(engine, name, fn)
    try:
        yield trace
    finally:
        for engine, name, fn in hooks:
            event.remove(engine, name, fn)


def _hooks(trace: Trace, index: int) -> dict[str, Callable[..., Any]]:
    clock = time.perf_counter

    def before_execute(conn: Any, *_args: Any) -> None:
        conn.info.setdefault("replay_core", []).append(clock())

    def after_execute(conn: Any, *_args: Any) -> None:
        trace.core_s += clock() - conn.info["replay_core"].pop()

    def before_cursor(conn: Any, _cursor: Any, statement: str, parameters: Any,
                      _context: Any, executemany: bool) -> None:
        kind = "many" if executemany else "execute"
        trace.steps.append((index, kind, statement, _copied(parameters)))
        conn.info["replay_driver"] = clock()

    def after_cursor(conn: Any, *_args: Any) -> None:
        elapsed = clock() - conn.info.pop("replay_driver")
        trace.driver_s += elapsed
        if conn.info.get("replay_core"):
            trace.driver_in_core_s += elapsed

    def commit(_conn: Any) -> None:
        trace.steps.append((index, "commit", None, None))

    def rollback(_conn: Any) -> None:
        trace.steps.append((index, "rollback", None, None))

    return {
        "before_execute": before_execute,
        "after_execute": after_execute,
        "before_cursor_execute": before_cursor,
        "after_cursor_execute": after_cursor,
        "commit": commit,
        "rollback": rollback,
    }


def _copied(parameters: Any) -> Any:
    if isinstance(parameters, list):
        return [_copied(item) for item in parameters]
    if isinstance(parameters, dict):
        return dict(parameters)
    return parameters


def turn_refs(turns: int, label: str) -> list[TurnRef]:
    """``turns`` webhook turns round-robin over the sessions; ids and sessions tagged ``label``."""
    return [TurnRef(f"+55{label}{k % SESSIONS:04d}", k // SESSIONS, f"{label}-{k}")
            for k in range(turns)]


async def _drive(adapter: Any, refs: list[TurnRef], on_open: Callable[[Any], Any]) -> float:
    """Open ``adapter``, run ``refs`` as turns; seconds for the turns only."""
    payloads = [adapter.payload(ref) for ref in refs]
    await adapter.open()
    try:
        with on_open(adapter):
            start = time.perf_counter()
            for ref, payload in zip(refs, payloads, strict=True):
                await adapter.turn(ref, payload)
            return time.perf_counter() - start
    finally:
        await adapter.close()


@contextmanager
def _nothing(_adapter: Any) -> Iterator[None]:
    yield None


# ----------------------------------------------------------------- replays


def replay_sqlite(path: str, trace: Trace) -> float:
    """Send ``trace`` on one plain ``sqlite3`` connection set up as the store's; seconds."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    for pragma in ("foreign_keys = ON", "busy_timeout = 30000", "journal_mode = WAL",
                   "synchronous = NORMAL"):
        conn.execute(f"PRAGMA {pragma}")
    start = time.perf_counter()
    for _index, kind, statement, parameters in trace.steps:
        if kind == "execute":
            conn.execute(statement, parameters or ()).fetchall()
        elif kind == "many":
            conn.executemany(statement, parameters)
        elif conn.in_transaction:
            conn.commit() if kind == "commit" else conn.rollback()
    elapsed = time.perf_counter() - start
    conn.close()
    return elapsed


class PostgresReplay:
    """Plain psycopg connections to ``schema``, one per engine of the store, that send steps.

    Autocommit, as the store's single statements run (the turn's lease and
    its write are one statement each); nothing prepared, as the store prepares
    nothing.
    """

    def __init__(self, url: str, schema: str) -> None:
        from benchmarks.pg import libpq_url, schema_connect_args

        self.conninfo = libpq_url(url)
        self.options = schema_connect_args(schema)
        self.connections: dict[int, Any] = {}

    def connection(self, index: int) -> Any:
        """The connection of the store's engine ``index`` (opened on first use)."""
        import psycopg

        if index not in self.connections:
            self.connections[index] = psycopg.connect(
                self.conninfo, autocommit=True, prepare_threshold=None, **self.options
            )
        return self.connections[index]

    def send(self, steps: list[tuple[int, str, Any, Any]]) -> float:
        """Send ``steps`` (a :class:`Trace`'s) in order; seconds, connecting not counted."""
        for index in {step[0] for step in steps}:
            self.connection(index)
        start = time.perf_counter()
        for index, kind, statement, parameters in steps:
            if kind == "execute":
                cursor = self.connections[index].execute(statement, parameters)
                if cursor.description is not None:
                    cursor.fetchall()
            elif kind == "many":
                self.connections[index].cursor().executemany(statement, parameters)
        return time.perf_counter() - start

    def close(self) -> None:
        """Close the connections."""
        for conn in self.connections.values():
            conn.close()


def replay_postgres(url: str, schema: str, trace: Trace) -> float:
    """Send ``trace`` on a fresh :class:`PostgresReplay`; seconds."""
    replay = PostgresReplay(url, schema)
    try:
        return replay.send(trace.steps)
    finally:
        replay.close()


# ------------------------------------------------------------------- runs


def _sqlite_round(turns: int, label: str) -> dict[str, float]:
    from benchmarks.stores import Target, adapter_class

    cls = adapter_class("ours-sqlite")
    folder = Path(tempfile.mkdtemp(prefix="chatflow-replay-"))
    try:
        empty = folder / "empty.db"
        cls.prepare(Target(path=str(empty)))
        paths = {name: folder / f"{name}.db" for name in ("store", "capture", "replay")}
        for path in paths.values():
            shutil.copyfile(empty, path)
        refs = turn_refs(turns, label)
        store_s = asyncio.run(_drive(cls(Target(path=str(paths["store"]))), refs, _nothing))
        traces: list[Trace] = []

        @contextmanager
        def traced(adapter: Any) -> Iterator[None]:
            with capture(adapter.store.engines) as trace:
                traces.append(trace)
                yield None

        capture_s = asyncio.run(_drive(cls(Target(path=str(paths["capture"]))), refs, traced))
        replay_s = replay_sqlite(str(paths["replay"]), traces[0])
        return _figures(turns, store_s, capture_s, replay_s, traces[0])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _postgres_round(url: str, turns: int, label: str, delayed: str | None,
                    workload: str) -> dict[str, float]:
    from benchmarks.pg import create_schema, drop_schema
    from benchmarks.roundtrips import claiming_adapter
    from benchmarks.stores import Target, adapter_class

    cls = claiming_adapter() if workload == "claim" else adapter_class("ours-pg")
    run_url = delayed or url
    schemas = {name: create_schema(url, f"replay_{name}") for name in ("store", "capture",
                                                                      "replay", "floor")}
    try:
        for name in ("store", "capture", "replay"):
            cls.prepare(Target(pg_url=url, schema=schemas[name]))
        refs = turn_refs(turns, label)
        store_s = asyncio.run(
            _drive(cls(Target(pg_url=run_url, schema=schemas["store"])), refs, _nothing))
        traces: list[Trace] = []

        @contextmanager
        def traced(adapter: Any) -> Iterator[None]:
            with capture(adapter.store.engines) as trace:
                traces.append(trace)
                yield None

        capture_s = asyncio.run(
            _drive(cls(Target(pg_url=run_url, schema=schemas["capture"])), refs, traced))
        trace = traces[0]
        replay_s = replay_postgres(run_url, schemas["replay"], trace)
        figures = _figures(turns, store_s, capture_s, replay_s, trace)
        floor = adapter_class("raw-pg")
        floor_target = Target(pg_url=run_url, schema=schemas["floor"])
        floor.prepare(Target(pg_url=url, schema=schemas["floor"]))
        figures["floor ms"] = asyncio.run(_drive(floor(floor_target), refs, _nothing)) \
            / turns * 1000
        return figures
    finally:
        for schema in schemas.values():
            drop_schema(url, schema)


def _unique(engines: tuple[Engine, ...]) -> list[Engine]:
    unique: list[Engine] = []
    for engine in engines:
        if all(engine is not seen for seen in unique):
            unique.append(engine)
    return unique


def _figures(turns: int, store_s: float, capture_s: float, replay_s: float,
             trace: Trace) -> dict[str, float]:
    per_turn = 1000 / turns
    outside = capture_s - trace.core_s - (trace.driver_s - trace.driver_in_core_s)
    return {
        "store ms": store_s * per_turn,
        "replay ms": replay_s * per_turn,
        "statements": sum(step[1] in ("execute", "many") for step in trace.steps) / turns,
        "capture: driver ms": trace.driver_s * per_turn,
        "capture: Core around it ms": (trace.core_s - trace.driver_in_core_s) * per_turn,
        "capture: rest ms": outside * per_turn,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the rounds and print a markdown table of medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--url", default=None, help="PostgreSQL URL (default: the bench URL)")
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="PostgreSQL behind a proxy adding this delay each way")
    parser.add_argument("--workload", choices=("record", "claim"), default="record",
                        help="PostgreSQL: record_processed_message + turn, or store.claim + "
                             "turn + reply")
    args = parser.parse_args(argv)
    rounds: list[dict[str, float]] = []
    if args.backend == "sqlite":
        for round_ in range(args.rounds):
            rounds.append(_sqlite_round(args.turns, f"r{round_}"))
    else:
        rounds = _postgres_rounds(args)
    _print(rounds)
    return 0


def _postgres_rounds(args: argparse.Namespace) -> list[dict[str, float]]:
    from benchmarks.pg import pg_url_from_env

    url = pg_url_from_env(args.url)
    if not args.delay_ms:
        return [_postgres_round(url, args.turns, f"r{r}", None, args.workload)
                for r in range(args.rounds)]
    from sqlalchemy import make_url

    from tests.faultproxy import FaultProxy, Mode

    parsed = make_url(url)
    with FaultProxy(parsed.host or "127.0.0.1", parsed.port or 5432) as proxy:
        proxy.set_mode(Mode.DELAY, delay_ms=args.delay_ms)
        delayed = proxy.url(url)
        return [_postgres_round(url, args.turns, f"r{r}", delayed, args.workload)
                for r in range(args.rounds)]


def _print(rounds: list[dict[str, float]]) -> None:
    keys = list(rounds[0])
    print("| per turn | " + " | ".join(f"round {i + 1}" for i in range(len(rounds)))
          + " | median |")
    print("|---|" + "---|" * (len(rounds) + 1))
    for key in keys:
        values = [round_[key] for round_ in rounds]
        cells = " | ".join(f"{value:.3f}" for value in values)
        print(f"| {key} | {cells} | {statistics.median(values):.3f} |")
    store = statistics.median(r["store ms"] for r in rounds)
    replay = statistics.median(r["replay ms"] for r in rounds)
    print(f"\nthe layer: {store - replay:.3f} ms per turn ({store / replay:.2f}x the replay)")
    if "floor ms" in rounds[0]:
        floor = statistics.median(r["floor ms"] for r in rounds)
        print(f"x floor: store {floor / store:.2f}, replay of the store's SQL {floor / replay:.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
