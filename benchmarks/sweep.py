"""Retention sweep at scale: 4 processes sweep 100k expired sessions on PostgreSQL at once.

Run: ``python -m benchmarks.sweep [--sessions 100000] [--sweepers 4] [--url URL]``.

In a fresh schema it loads, with ``COPY``, ``--sessions`` sessions last
updated two days ago (one USER message each) plus live ones that must
survive: ``--live`` fresh sessions, ``--live`` expired sessions held by a
live webhook claim, and ``--live`` expired sessions under a live turn lease
(their rows hold an unexpired lease, as while a turn runs). Then
``--sweepers`` processes open a store with ``session_ttl_hours=24`` and call
``sweep()`` together. Reported: wall time of the sweep, each sweeper's
count, and the checks: counts add up to the expired sessions (nothing swept
twice), no expired session is left, every live session is intact.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from benchmarks.pg import (
    create_schema,
    drop_schema,
    libpq_url,
    pg_url_from_env,
    schema_connect_args,
)

__all__ = ["main", "run_sweep"]


def _sweeper(url: str, schema: str, ready: Any, go: Any, results: Any) -> None:
    from chatflow_sqlalchemy.backends.postgresql import PostgresSessionStore

    store = PostgresSessionStore(
        url, session_ttl_hours=24, connect_args=schema_connect_args(schema)
    )
    try:
        store.list_sessions(limit=1)
        ready.put(True)
        go.wait(600)
        started = time.perf_counter()
        removed = store.sweep()
        results.put((removed, time.perf_counter() - started))
    finally:
        store.close()


def _load(url: str, schema: str, n: int, live: int) -> dict[str, list[str]]:
    import psycopg

    old = datetime.now(timezone.utc) - timedelta(hours=48)
    now = datetime.now(timezone.utc)
    groups = {
        "expired": [f"x{i:07d}" for i in range(n)],
        "fresh": [f"f{i:05d}" for i in range(live)],
        "claimed": [f"c{i:05d}" for i in range(live)],
        "leased": [f"l{i:05d}" for i in range(live)],
    }
    with psycopg.connect(libpq_url(url), options=f"-csearch_path={schema}") as conn:
        with conn.cursor() as cur:
            with cur.copy(
                "COPY chatflow_sessions (session_id, active_agent_name, metadata_json, version,"
                " created_at, updated_at) FROM STDIN"
            ) as copy:
                for name, ids in groups.items():
                    stamp = now if name == "fresh" else old
                    for sid in ids:
                        copy.write_row((sid, "support", "{}", 1, stamp, stamp))
            with cur.copy(
                "COPY chatflow_messages (session_id, seq, role, content, message_json, created_at)"
                " FROM STDIN"
            ) as copy:
                for ids in groups.values():
                    for sid in ids:
                        body = json.dumps({"role": "user", "content": f"hello {sid}"})
                        copy.write_row((sid, 1, "user", f"hello {sid}", body, old))
            lease = now + timedelta(minutes=10)
            cur.executemany(
                "INSERT INTO chatflow_processed_messages (message_id, processed_at, state, token,"
                " session_id, ticket, lease_expires_at, claimed_at, partition_day)"
                " VALUES (%s, %s, 'acquired', 'bench', %s, 1, %s, %s, %s)",
                [(f"m-{sid}", now, sid, lease, now, now.date()) for sid in groups["claimed"]],
            )
            cur.execute(  # the running turns: a lease taken, unexpired by the server's clock
                "UPDATE chatflow_sessions SET lease_owner = 'bench', lease_fence = 1,"
                " lease_expires_at = now() + interval '10 minutes'"
                " WHERE session_id = ANY(%s)",
                (groups["leased"],),
            )
        conn.commit()
    return groups


def run_sweep(url: str, n: int, sweepers: int, live: int) -> dict[str, Any]:
    """Load, sweep with ``sweepers`` processes, check; return the figures."""
    import psycopg

    from chatflow_sqlalchemy.backends.postgresql import PostgresSessionStore

    schema = create_schema(url, "sweep")
    try:
        PostgresSessionStore(url, connect_args=schema_connect_args(schema)).close()
        started = time.perf_counter()
        groups = _load(url, schema, n, live)
        load_seconds = time.perf_counter() - started
        ctx = multiprocessing.get_context("spawn")
        ready, go, results = ctx.Queue(), ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_sweeper, args=(url, schema, ready, go, results))
                 for _ in range(sweepers)]
        for proc in procs:
            proc.start()
        for _ in procs:  # every sweeper has imported, connected and is waiting
            ready.get(timeout=600)
        started = time.perf_counter()
        go.set()
        counts = [results.get(timeout=1800) for _ in procs]
        wall = time.perf_counter() - started
        for proc in procs:
            proc.join(60)
        with psycopg.connect(libpq_url(url), options=f"-csearch_path={schema}") as conn:
            left = {row[0] for row in conn.execute("SELECT session_id FROM chatflow_sessions")}
            messages = conn.execute("SELECT count(*) FROM chatflow_messages").fetchone()
        live_ids = set(groups["fresh"]) | set(groups["claimed"]) | set(groups["leased"])
        removed = [c for c, _ in counts]
        return {
            "expired": n,
            "sweepers": sweepers,
            "load_seconds": round(load_seconds, 1),
            "sweep_wall_seconds": round(wall, 1),
            "per_sweeper": removed,
            "sessions_per_second": round(n / wall),
            "counts_add_up": sum(removed) == n,
            "expired_left": len(left - live_ids),
            "live_intact": live_ids <= left,
            "live_sessions": len(live_ids),
            "messages_left": messages[0] if messages else None,
        }
    finally:
        drop_schema(url, schema)


def main(argv: list[str] | None = None) -> None:
    """Command line: print the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None)
    parser.add_argument("--sessions", type=int, default=100_000)
    parser.add_argument("--sweepers", type=int, default=4)
    parser.add_argument("--live", type=int, default=100)
    args = parser.parse_args(argv)
    figures = run_sweep(pg_url_from_env(args.url), args.sessions, args.sweepers, args.live)
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
