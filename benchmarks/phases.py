"""Where a turn's time goes, phase by phase: ``python -m benchmarks.phases``.

Runs the one-process webhook-turn workload on a SQLite file twice, timing
each phase of every turn with ``time.perf_counter``: once through
``chatflow_sqlalchemy.SQLiteSessionStore`` and once by hand on raw
``sqlite3`` with the very statements and transactions the store sends (the
``raw-sqlite-ours`` reference's SQL). The turn's write runs inline here (not
on the store's thread pool) so that its cost is not mixed with the hop's;
``python -m benchmarks`` measures the hop separately (``raw-sqlite-hop``).
Per-phase means in microseconds; noisy like any timing on a shared VM, so it
runs ``--rounds`` times and prints the median of each phase.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import statistics
import tempfile
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from chatflow_agent import Message

from benchmarks import MAX_TURNS
from benchmarks.stores.chatflow import make_agent
from benchmarks.stores.floors import OURS_SQL, TTL
from benchmarks.workload import build_messages, session_ids

PHASES = ("claim", "get_or_create", "lock + 4 add_message", "write (inline)")


def _ours(path: Path, sessions: int, turns: int) -> dict[str, float]:
    from chatflow_sqlalchemy import SQLiteSessionStore

    store = SQLiteSessionStore(path, default_max_turns=MAX_TURNS)
    agent = make_agent()
    store.set_agent_resolver(lambda name: agent)

    async def inline(fn: Any, *args: Any) -> Any:
        return fn(*args)

    store._run_blocking = inline  # type: ignore[method-assign]
    spent: defaultdict[str, float] = defaultdict(float)
    payloads = {(s, t): build_messages(s, t) for s in session_ids(sessions) for t in range(turns)}

    async def run() -> None:
        for turn in range(turns):
            for sid in session_ids(sessions):
                t0 = time.perf_counter()
                store.record_processed_message(f"wamid.{sid}.{turn}")
                t1 = time.perf_counter()
                session = store.get_or_create(sid, agent)
                t2 = time.perf_counter()
                lock = session.lock
                await lock.__aenter__()
                _checkpoint = len(session.history)
                for message in payloads[(sid, turn)]:
                    session.add_message(message)
                t3 = time.perf_counter()
                await lock.__aexit__(None, None, None)
                t4 = time.perf_counter()
                for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3),
                                          strict=True):
                    spent[phase] += seconds

    asyncio.run(run())
    store.close()
    return {phase: spent[phase] / (sessions * turns) * 1e6 for phase in PHASES}


def _by_hand(path: Path, sessions: int, turns: int) -> dict[str, float]:
    from chatflow_sqlalchemy import SQLiteSessionStore

    SQLiteSessionStore(path).close()  # the store's schema
    conn = sqlite3.connect(path, isolation_level=None)
    for pragma in ("foreign_keys = ON", "journal_mode = WAL", "synchronous = NORMAL"):
        conn.execute(f"PRAGMA {pragma}")
    state: dict[str, tuple[int, int]] = {}
    windows: defaultdict[str, list[list[Message]]] = defaultdict(list)
    spent: defaultdict[str, float] = defaultdict(float)
    payloads = {(s, t): build_messages(s, t) for s in session_ids(sessions) for t in range(turns)}
    for turn in range(turns):
        for sid in session_ids(sessions):
            t0 = time.perf_counter()
            now = datetime.now(timezone.utc)
            stamp = now.isoformat()
            conn.execute(OURS_SQL["claim"], (f"wamid.{sid}.{turn}", stamp,
                                             (now - TTL).isoformat())).fetchall()
            t1 = time.perf_counter()
            if conn.execute(OURS_SQL["version"], (sid,)).fetchone() is None:
                conn.execute(OURS_SQL["create"], (sid, "Support", stamp, stamp))
                state[sid] = (0, 1)
            t2 = time.perf_counter()
            payload, window = payloads[(sid, turn)], windows[sid]
            pruned = window.pop(0) if len(window) == MAX_TURNS else []
            t3 = time.perf_counter()
            version, seq = state[sid]
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(OURS_SQL["bump"], (version + 1, stamp, sid, version))
            first = seq - len(window) * len(payload) - len(pruned)
            conn.executemany(OURS_SQL["delete"], [(sid, first + i) for i in range(len(pruned))])
            conn.executemany(OURS_SQL["insert"], [
                (sid, seq + i, m.role.value, m.content, m.model_dump_json(), stamp)
                for i, m in enumerate(payload)
            ])
            conn.execute("COMMIT")
            state[sid] = (version + 1, seq + len(payload))
            window.append(payload)
            t4 = time.perf_counter()
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                spent[phase] += seconds
    conn.close()
    return {phase: spent[phase] / (sessions * turns) * 1e6 for phase in PHASES}


def main() -> None:
    """Time both, ``--rounds`` times each (interleaved); print the median per phase."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.phases")
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--turns", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"ours-sqlite": [], "by hand": []}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            for name, run in (("ours-sqlite", _ours), ("by hand", _by_hand)):
                path = Path(tmp) / f"{name.replace(' ', '-')}-{index}.db"
                results[name].append(run(path, args.sessions, args.turns))
    print(f"per turn, us (median of {args.rounds} rounds; S={args.sessions} T={args.turns})")
    print("| phase | ours-sqlite | by hand (same SQL, raw sqlite3) |\n|---|---|---|")
    for phase in (*PHASES, "total"):
        cells = []
        for name in ("ours-sqlite", "by hand"):
            rounds = results[name]
            values = [sum(r.values()) if phase == "total" else r[phase] for r in rounds]
            cells.append(f"{statistics.median(values):.0f}")
        print(f"| {phase} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
