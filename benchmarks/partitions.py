"""What partitioned claims cost a claimed turn on PostgreSQL: its SQL replayed on variant schemas.

Run: ``python -m benchmarks.partitions [--turns N] [--rounds R] [--url URL] [--explain]``.

Each round captures the SQL of ``ours-pg-claim`` (the turn in ``async with
store.claim(...)``, its reply stored) on a schema the store migrated
(:func:`benchmarks.replay.capture`), then sends it on raw psycopg
(:class:`benchmarks.replay.PostgresReplay`: no SQLAlchemy, no store code) to
fresh schemas the store migrated that differ only in the claims table and its
functions. The store itself and the ``raw-pg-claim`` floor run in the same
round. The turns go in blocks of :data:`BLOCK`, and every run takes each block
in turn, in an order that shifts by one each block: a load that comes and goes
on a shared machine falls on every run alike.

* **partitioned**: as migrated (revision 0006): day partitions, and
  ``chatflow_claim_day`` takes the id's advisory lock and looks for its row
  across the partitions.
* **partitioned, 8 past days**: the same with a day partition for each of
  the 8 days before today (empty), as a store purged under the default 8-day
  dedup window keeps them: 17 partitions instead of 9.
* **plain + day lookup**: ``chatflow_processed_messages`` an ordinary table
  with the same columns and indexes, primary key ``message_id`` alone;
  ``chatflow_claim_day`` unchanged (its lock and its lookup, on one table).
* **plain**: the same table, and ``chatflow_claim_day`` returns NULL at once,
  with no lock (still PL/pgSQL, so the call itself is still paid): a claim
  without partitioning.
* **plain, ticket unlocked**: also ``chatflow_claim_ticket`` draws from the
  sequence with no session lock. A measurement, not a design: without that
  lock two claims of one session can draw tickets in one order and commit in
  the other, the race the lock closes.

On the plain table the acquire's ``ON CONFLICT (message_id, partition_day)``
is sent as ``ON CONFLICT (message_id)`` (a conflict target must match a unique
key); every other statement is sent as captured, the day function's calls
included. ``--explain`` sends the replays' two claim statements (the acquire,
the write) under ``EXPLAIN (ANALYZE, TIMING OFF, SUMMARY)`` instead, to tell the
server's planning from its execution (no store, no floor, no wall times).
Every run but the floor's is checked: its schema must end with the
rows the capture left (claims, claims done with their reply, sessions with
their lease released, the messages themselves), every turn's claim done, or
the run fails.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections import defaultdict
from typing import Any

from benchmarks.replay import PostgresReplay, Trace, capture, turn_refs

__all__ = ["BLOCK", "VARIANTS", "main"]

BLOCK = 10
"""Turns a run takes before the next run's turn: small, so bursts of load fall on all."""

_PLAIN = (
    "CREATE TABLE plain (LIKE chatflow_processed_messages INCLUDING ALL)",
    "ALTER TABLE plain DROP CONSTRAINT plain_pkey, ADD PRIMARY KEY (message_id)",
    "DROP TABLE chatflow_processed_messages",
    "ALTER TABLE plain RENAME TO chatflow_processed_messages",
)
_PAST_DAYS = """DO $$ DECLARE day date; BEGIN
FOR n IN 1..8 LOOP
    day := CAST(timezone('UTC', now()) AS date) - n;
    EXECUTE format('CREATE TABLE %I PARTITION OF chatflow_processed_messages '
                   'FOR VALUES FROM (%L) TO (%L)',
                   'chatflow_processed_messages_p' || to_char(day, 'YYYYMMDD'), day, day + 1);
END LOOP; END $$"""
_NO_DAY = """CREATE OR REPLACE FUNCTION chatflow_claim_day(claim_id text) RETURNS date
LANGUAGE plpgsql VOLATILE AS $$ BEGIN RETURN NULL; END $$"""
_NO_TICKET_LOCK = """CREATE OR REPLACE FUNCTION chatflow_claim_ticket(claim_session text)
RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
BEGIN RETURN nextval('chatflow_claim_ticket_seq'); END $$"""

VARIANTS: dict[str, tuple[str, ...]] = {
    "partitioned": (),
    "partitioned, 8 past days": (_PAST_DAYS,),
    "plain + day lookup": _PLAIN,
    "plain": (*_PLAIN, _NO_DAY),
    "plain, ticket unlocked": (*_PLAIN, _NO_DAY, _NO_TICKET_LOCK),
}
"""Each replay's schema: the DDL run on a freshly migrated one."""

_CONFLICT = ("ON CONFLICT (message_id, partition_day)", "ON CONFLICT (message_id)")
_STATE = (
    "SELECT (SELECT count(*) FROM chatflow_processed_messages), "
    "(SELECT count(*) FROM chatflow_processed_messages "
    " WHERE state = 'done' AND response IS NOT NULL), "
    "(SELECT count(*) FROM chatflow_sessions WHERE lease_owner IS NULL), "
    "(SELECT md5(string_agg(concat_ws(':', session_id, seq, role, content), ',' "
    " ORDER BY session_id, seq)) FROM chatflow_messages)"
)


def _execute(url: str, schema: str, statements: tuple[str, ...]) -> list[Any]:
    """Run ``statements`` in ``schema``; the first row of the last one."""
    import psycopg

    from benchmarks.pg import libpq_url, schema_connect_args

    row: Any = None
    with psycopg.connect(libpq_url(url), autocommit=True, **schema_connect_args(schema)) as conn:
        for statement in statements:
            cursor = conn.execute(statement)
            row = cursor.fetchone() if cursor.description else None
    return list(row or ())


_EXPLAINED = {"WITH acquired": "acquire", "WITH locked": "write"}


class _Explained(PostgresReplay):
    """A replay that sends the claim's two statements under ``EXPLAIN ANALYZE``."""

    def __init__(self, url: str, schema: str) -> None:
        super().__init__(url, schema)
        self.times: dict[str, list[float]] = defaultdict(list)

    def send(self, steps: list[tuple[int, str, Any, Any]]) -> float:
        """Send ``steps``, noting the server's ms of each claim statement; 0 seconds."""
        for step in steps:
            index, _kind, statement, parameters = step
            name = _EXPLAINED.get((statement or "").split(" AS", 1)[0])
            if name is None:
                super().send([step])
                continue
            explain = "EXPLAIN (ANALYZE, TIMING OFF, SUMMARY, FORMAT JSON) "
            plan = self.connection(index).execute(explain + statement, parameters).fetchone()
            self.times[f"{name} planning"].append(plan[0][0]["Planning Time"])
            self.times[f"{name} execution"].append(plan[0][0]["Execution Time"])
        return 0.0


def _on_plain_table(trace: Trace) -> Trace:
    """``trace`` with the acquire's conflict target the plain table's primary key."""
    steps = [(index, kind, statement and statement.replace(*_CONFLICT), parameters)
             for index, kind, statement, parameters in trace.steps]
    return Trace(steps=steps)


async def _captured(adapter: Any, blocks: list[list[Any]]) -> list[Trace]:
    """Run ``blocks`` of turns on ``adapter``'s store; the trace of each block."""
    traces = []
    await adapter.open()
    try:
        for block in blocks:
            with capture(adapter.store.engines) as trace:
                for ref in block:
                    await adapter.turn(ref, adapter.payload(ref))
            traces.append(trace)
        return traces
    finally:
        await adapter.close()


async def _timed(adapters: dict[str, Any], replays: dict[str, PostgresReplay],
                 blocks: list[list[Any]], traces: dict[str, list[Trace]]) -> dict[str, float]:
    """Every run takes each block in turn, in a shifting order; seconds by run."""
    runs = [*adapters, *replays]
    seconds = dict.fromkeys(runs, 0.0)
    payloads = {name: [[a.payload(ref) for ref in block] for block in blocks]
                for name, a in adapters.items()}
    for adapter in adapters.values():
        await adapter.open()
    try:
        for number, block in enumerate(blocks):
            shift = number % len(runs)
            for name in runs[shift:] + runs[:shift]:
                if name in replays:
                    seconds[name] += replays[name].send(traces[name][number].steps)
                    continue
                start = time.perf_counter()
                for ref, payload in zip(block, payloads[name][number], strict=True):
                    await adapters[name].turn(ref, payload)
                seconds[name] += time.perf_counter() - start
        return seconds
    finally:
        for adapter in adapters.values():
            await adapter.close()
        for replay in replays.values():
            replay.close()


def _round(url: str, turns: int, label: str, explain: bool) -> dict[str, float]:
    """One round: the capture, then every run interleaved; ms per turn by run.

    With ``explain``, the replays only: the server's mean ms a statement, by
    variant, statement and phase.
    """
    from benchmarks.pg import create_schema, drop_schema
    from benchmarks.stores import Target, adapter_class

    store, floor = adapter_class("ours-pg-claim"), adapter_class("raw-pg-claim")
    schemas = {name: create_schema(url, "parts") for name in ["capture", "store", *VARIANTS,
                                                              "floor"]}
    try:
        for name, schema in schemas.items():
            (floor if name == "floor" else store).prepare(Target(pg_url=url, schema=schema))
            _execute(url, schema, VARIANTS.get(name, ()))
        refs = turn_refs(turns, label)
        blocks = [refs[k:k + BLOCK] for k in range(0, turns, BLOCK)]
        captured = asyncio.run(_captured(store(Target(pg_url=url, schema=schemas["capture"])),
                                         blocks))
        expected = _execute(url, schemas["capture"], (_STATE,))
        if expected[:2] != [turns, turns]:
            raise RuntimeError(f"capture: {expected[:2]} claims (done), not {turns} of each")
        plain = [_on_plain_table(trace) for trace in captured]
        traces = {name: captured if name.startswith("partitioned") else plain
                  for name in VARIANTS}
        adapters = {} if explain else {
            "store": store(Target(pg_url=url, schema=schemas["store"])),
            "floor": floor(Target(pg_url=url, schema=schemas["floor"]))}
        kind = _Explained if explain else PostgresReplay
        replays = {name: kind(url, schemas[name]) for name in VARIANTS}
        seconds = asyncio.run(_timed(adapters, replays, blocks, traces))
        for name in [*adapters, *VARIANTS]:
            if name != "floor" and (state := _execute(url, schemas[name], (_STATE,))) != expected:
                raise RuntimeError(f"{name}: ended with {state}, the capture with {expected} "
                                   "(claims, claims done, sessions released, messages digest)")
        if explain:
            return {f"{name}: {phase}": statistics.mean(times)
                    for name, replay in replays.items() if isinstance(replay, _Explained)
                    for phase, times in replay.times.items()}
        return {name: seconds[name] / turns * 1000 for name in ["store", *VARIANTS, "floor"]}
    finally:
        for schema in schemas.values():
            drop_schema(url, schema)


def main(argv: list[str] | None = None) -> int:
    """Run the rounds and print a markdown table of the figures, with medians."""
    from benchmarks.pg import pg_url_from_env

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--url", default=None, help="PostgreSQL URL (default: the bench URL)")
    parser.add_argument("--explain", action="store_true",
                        help="the server's planning and execution of the replays' statements")
    args = parser.parse_args(argv)
    url = pg_url_from_env(args.url)
    rounds, loads = [], []
    for number in range(args.rounds):
        loads.append(os.getloadavg()[0])
        rounds.append(_round(url, args.turns, f"r{number}", args.explain))
    loads.append(os.getloadavg()[0])
    median = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
    floor = median.get("floor")
    print(("| server ms, a statement | " if args.explain else "| ms per turn | ")
          + " | ".join(f"round {i + 1}" for i in range(len(rounds)))
          + " | median |" + (" x floor |" if floor else ""))
    print("|---|" + "---|" * (len(rounds) + 1 + bool(floor)))
    for name, value in median.items():
        cells = " | ".join(f"{r[name]:.3f}" for r in rounds)
        print(f"| {name} | {cells} | {value:.3f} |" + (f" {floor / value:.2f} |" if floor else ""))
    for name in ("partitioned", "partitioned, 8 past days") if floor else ():
        cost = statistics.median(r[name] - r["plain"] for r in rounds)  # paired in each round
        share = statistics.median((r[name] - r["plain"]) / r[name] for r in rounds)
        print(f"\n{name}: partitioning costs {cost:.3f} ms a turn, {share:.0%} of the SQL's "
              "time (medians of each round's difference to plain)")
    print(f"\n1-min load at each round's start and the end: {', '.join(f'{x:.2f}' for x in loads)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
