"""What partitioned claims cost a claimed turn on PostgreSQL: its SQL replayed on variant schemas.

Run: ``python -m benchmarks.partitions [--turns N] [--rounds R] [--url URL]``.

Each round captures the SQL of ``ours-pg-claim`` (the turn in ``async with
store.claim(...)``, its reply stored) on a schema the store migrated
(:func:`benchmarks.replay.capture`), then sends that one trace on raw psycopg
(:func:`benchmarks.replay.replay_postgres`: no SQLAlchemy, no store code) to
fresh schemas the store migrated that differ only in the claims table and its
functions. The store itself and the ``raw-pg-claim`` floor run in the same
round, and the order of the runs turns by one each round:

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
included. Every run but the floor's is checked: its schema must end with the
rows the capture left (claims, claims done with their reply, sessions with
their lease released, the messages themselves), every turn's claim done, or
the run fails.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from typing import Any

from benchmarks.replay import Trace, drive, replay_postgres, tracing, turn_refs, untraced

__all__ = ["VARIANTS", "main"]

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


def _on_plain_table(trace: Trace) -> Trace:
    """``trace`` with the acquire's conflict target the plain table's primary key."""
    steps = [(index, kind, statement and statement.replace(*_CONFLICT), parameters)
             for index, kind, statement, parameters in trace.steps]
    return Trace(steps=steps)


def _round(url: str, turns: int, number: int) -> dict[str, float]:
    """One round: capture, then every run in this round's order; ms per turn by run."""
    from benchmarks.pg import create_schema, drop_schema
    from benchmarks.stores import Target, adapter_class

    store, floor = adapter_class("ours-pg-claim"), adapter_class("raw-pg-claim")
    runs = ["store", *VARIANTS, "floor"]
    schemas = {name: create_schema(url, "parts") for name in ["capture", *runs]}
    try:
        for name, schema in schemas.items():
            (floor if name == "floor" else store).prepare(Target(pg_url=url, schema=schema))
            _execute(url, schema, VARIANTS.get(name, ()))
        refs = turn_refs(turns, f"r{number}")
        traces: list[Trace] = []
        target = Target(pg_url=url, schema=schemas["capture"])
        asyncio.run(drive(store(target), refs, tracing(traces)))
        expected = _execute(url, schemas["capture"], (_STATE,))
        if expected[:2] != [turns, turns]:
            raise RuntimeError(f"capture: {expected[:2]} claims (done), not {turns} of each")
        ms: dict[str, float] = {}
        shift = number % len(runs)
        for name in runs[shift:] + runs[:shift]:
            target = Target(pg_url=url, schema=schemas[name])
            if name in VARIANTS:
                trace = traces[0] if name.startswith("partitioned") else _on_plain_table(traces[0])
                seconds = replay_postgres(url, schemas[name], trace)
            else:
                seconds = asyncio.run(
                    drive((store if name == "store" else floor)(target), refs, untraced))
            if name != "floor" and (state := _execute(url, schemas[name], (_STATE,))) != expected:
                raise RuntimeError(f"{name}: ended with {state}, the capture with {expected} "
                                   "(claims, claims done, sessions released, messages digest)")
            ms[name] = seconds / turns * 1000
        return ms
    finally:
        for schema in schemas.values():
            drop_schema(url, schema)


def main(argv: list[str] | None = None) -> int:
    """Run the rounds and print a markdown table of ms per turn, with medians."""
    from benchmarks.pg import pg_url_from_env

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--url", default=None, help="PostgreSQL URL (default: the bench URL)")
    args = parser.parse_args(argv)
    url = pg_url_from_env(args.url)
    rounds, loads = [], []
    for number in range(args.rounds):
        loads.append(os.getloadavg()[0])
        rounds.append(_round(url, args.turns, number))
    loads.append(os.getloadavg()[0])
    median = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
    print("| ms per turn | " + " | ".join(f"round {i + 1}" for i in range(len(rounds)))
          + " | median | x floor |")
    print("|---|" + "---|" * (len(rounds) + 2))
    for name, value in median.items():
        cells = " | ".join(f"{r[name]:.3f}" for r in rounds)
        print(f"| {name} | {cells} | {value:.3f} | {median['floor'] / value:.2f} |")
    for name in ("partitioned", "partitioned, 8 past days"):
        cost = median[name] - median["plain"]
        print(f"\n{name}: partitioning costs {cost:.3f} ms of the {median[name]:.3f} ms "
              f"replayed a turn ({cost / median[name]:.0%})")
    print(f"\n1-min load at each round's start and the end: {', '.join(f'{x:.2f}' for x in loads)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
