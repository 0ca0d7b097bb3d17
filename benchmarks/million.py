"""A million sessions: turn latency, listing, memory and size with a big database loaded.

Run: ``python -m benchmarks.million [--sessions N] [--messages-per-session M]
[--backend sqlite|postgresql|both]`` (defaults 1,000,000 and 10: 10M messages;
try ``--sessions 100000`` first on a small machine).

Per backend (SQLite: a file under ``/var/tmp``; PostgreSQL: a fresh schema of
its own on ``--url``, dropped at the end):

1. open the store (the schema is migrated to head), write ``M / 2`` turns
   into 310 sessions through it, reopen it and time Runner turns (the
   scripted offline engine, no claims) on this near-empty database:
   ``repeat`` (10 sessions x 30 turns, round robin) and ``spread`` (300
   sessions, one turn each), on new sessions and on the seeded ones;
2. close it and bulk-load ``N`` sessions of ``M`` messages (USER/MODEL
   pairs) straight into the tables (SQLite: ``executemany`` in big
   transactions; PostgreSQL: ``COPY ... FROM STDIN``, foreign-key triggers
   off), in the column formats the store itself writes (checked against a
   row the store wrote, and by reading loaded sessions back through a store).
   The load runs in a child process, so its buffers never count in this
   process's RSS;
3. reopen the store and time the same turns on new sessions, and on loaded
   sessions (``repeat``: 10 of them x 30 turns; ``spread``: 300 of them, one
   turn each). A near-empty control database (seeded like step 1's) is
   driven alternately turn for turn in the same process, so that whatever
   else the machine does slows both alike; ratios are given to the control
   and to step 1. Loaded sessions were last written long ago: on SQLite a
   turn on a session idle for over an hour first commits the store's
   ``updated_at`` touch, which step 1's freshly seeded sessions skip (the
   control's pay it too once they have sat through a long load);
4. time ``list_sessions(limit=100)`` (first page, a page from the middle via
   ``after=``), the unpaged ``list_sessions()`` (time and RSS growth) and the
   CLI's ``sessions list --limit 100 [--after ID]`` and unpaged
   ``sessions list --json``;
5. report the process RSS before and after the turns, and the database size
   per 1k turns (a turn = USER + MODEL message) beside LangGraph's published
   figure for one thread.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from benchmarks.pg import (
    create_schema,
    drop_schema,
    libpq_url,
    pg_url_from_env,
    schema_connect_args,
)
from benchmarks.runner import percentile
from benchmarks.workload import USER_FILLER

__all__ = ["BackendResult", "main", "run_backend"]

LANGGRAPH_BYTES_PER_1K_TURNS = 219e6 * 1000 / 500  # published: 219 MB per 500 turns

REPEAT_SESSIONS, REPEAT_TURNS = 10, 30
SPREAD_SESSIONS = 300
BATCH_SESSIONS = 20_000
BASE_TIME = datetime(2026, 10, 1, 8, 0, 0, 123457, tzinfo=timezone.utc)
"""First loaded session's start; micros not zero, so every timestamp text has them."""
SPAN_SECONDS = 30 * 24 * 3600
TURN_SECONDS = 120


def loaded_id(index: int) -> str:
    """The id of the ``index``-th loaded session (phone-like, sorted as loaded)."""
    return f"+5511{index:09d}"


def _rss_kb() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _peak_kb() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


# ------------------------------------------------------------------ the rows


@dataclass(frozen=True)
class _Templates:
    """message_json of every message position, split around its timestamp."""

    roles: list[str]
    contents: list[str]
    parts: list[tuple[str, str]]


def _user_text(turn: int) -> str:
    return f"{USER_FILLER} (#{turn})"


def _templates(messages: int) -> _Templates:
    from chatflow_agent import Message, Role

    from chatflow_sqlalchemy.context import dump_message

    sentinel = datetime(2001, 2, 3, 4, 5, 6, 789012, tzinfo=timezone.utc)
    mark = "2001-02-03T04:05:06.789012Z"
    roles, contents, parts = [], [], []
    for position in range(messages):
        turn = position // 2
        if position % 2 == 0:
            message = Message(role=Role.USER, content=_user_text(turn), timestamp=sentinel)
        else:
            message = Message(role=Role.MODEL, content=f"Bot re: {_user_text(turn)}",
                              timestamp=sentinel)
        text = dump_message(message)
        assert text.count(mark) == 1, text
        assert not any(c in text for c in "\\\t\n\r"), "templates need no COPY escaping"
        before, after = text.split(mark)
        roles.append(message.role.value)
        contents.append(message.content or "")
        parts.append((before, after))
    return _Templates(roles, contents, parts)


def _json_ts(value: datetime) -> str:
    return value.strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # pydantic's text for non-zero micros


def _sqlite_ts(value: datetime) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S.%f")  # UTCDateTime's SQLite text


def _pg_ts(value: datetime) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S.%f+00")


@dataclass
class _Session:
    session_id: str
    version: int
    created: datetime
    updated: datetime
    user_id: str
    # (seq, role, content, message_json, created_at) per message
    messages: list[tuple[int, str, str, str, datetime]]


def _sessions(first: int, count: int, per_session: int, tpl: _Templates,
              seed: int) -> Iterator[_Session]:
    """Loaded sessions ``first`` .. ``first + count - 1``, as the store would have written them.

    A turn's USER message is stamped ``T``, its MODEL message ``T + 1 s``, and
    both rows ``created_at = T + 1 s`` (the store writes a turn's rows with one
    ``now``); turns are ``TURN_SECONDS`` apart; the session's ``updated_at`` is
    its last write. Start times and versions are a hash of the index (any
    session can be regenerated alone).
    """
    one = timedelta(seconds=1)
    for index in range(first, first + count):
        mixed = ((index + 1) * 0x9E3779B97F4A7C15 + seed) % (1 << 64)
        start = BASE_TIME + timedelta(seconds=mixed % SPAN_SECONDS)
        rows = []
        written = start
        for position in range(per_session):
            turn = position // 2
            asked = start + timedelta(seconds=turn * TURN_SECONDS)
            stamp = asked if position % 2 == 0 else asked + one
            written = asked + one
            before, after = tpl.parts[position]
            rows.append((position + 1, tpl.roles[position], tpl.contents[position],
                         f"{before}{_json_ts(stamp)}{after}", written))
        yield _Session(loaded_id(index), mixed >> 12, start, written, f"user-{index // 3}",
                       rows)


def expected_history(index: int, per_session: int, seed: int) -> list[str]:
    """The message_json texts of loaded session ``index`` (regenerated, for the read-back)."""
    (session,) = _sessions(index, 1, per_session, _templates(per_session), seed)
    return [row[3] for row in session.messages]


# ------------------------------------------------------------------ backends


def _in_child(loader: Callable[..., float], *args: Any) -> float:
    """Run ``loader`` in a fresh process, so that its buffers never count in this one's RSS."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return float(pool.submit(loader, *args).result())


@dataclass
class _Backend:
    """How to open the store, bulk-load it, size it and point the CLI at it."""

    name: str
    open_store: Callable[[], Any]
    load: Callable[[int, int, int], float]
    size: Callable[[], dict[str, int]]
    cli_url: str
    cleanup: Callable[[], None]
    raw_row: Callable[[str], dict[str, Any]]
    explain: Callable[[], dict[str, str]]


def _sqlite_backend(workdir: Path, name: str = "million",
                    pragmas: Sequence[str] = ()) -> _Backend:
    import sqlite3

    from chatflow_sqlalchemy import SQLiteSessionStore

    path = workdir / f"{name}.db"

    def open_store() -> Any:
        store = SQLiteSessionStore(str(path))
        if pragmas:  # an experiment (--sqlite-pragma): on every connection from now on
            from sqlalchemy import event

            def more(dbapi_connection: Any, _record: Any) -> None:
                for pragma in pragmas:
                    dbapi_connection.execute(f"PRAGMA {pragma}")

            event.listen(store.engine, "connect", more)
            store.engine.dispose()
        return store

    def load(sessions: int, per_session: int, seed: int) -> float:
        return _in_child(_load_sqlite, str(path), sessions, per_session, seed)

    def size() -> dict[str, int]:
        found = {}
        for suffix in ("", "-wal", "-shm"):
            file = Path(f"{path}{suffix}")
            found[f"file{suffix}"] = file.stat().st_size if file.exists() else 0
        return found

    def raw_row(session_id: str) -> dict[str, Any]:
        conn = sqlite3.connect(str(path))
        try:
            session = conn.execute(
                "SELECT typeof(version), created_at, typeof(created_at), updated_at, metadata_json"
                " FROM chatflow_sessions WHERE session_id = ?", (session_id,)).fetchone()
            message = conn.execute(
                "SELECT seq, typeof(seq), role, created_at, typeof(content)"
                " FROM chatflow_messages WHERE session_id = ? ORDER BY seq LIMIT 1",
                (session_id,)).fetchone()
        finally:
            conn.close()
        return {"session": list(session), "message": list(message)}

    def explain() -> dict[str, str]:
        conn = sqlite3.connect(str(path))
        try:
            plans = {}
            for label, sql, args in _EXPLAINED_SQLITE:
                rows = conn.execute(f"EXPLAIN QUERY PLAN {sql}", args).fetchall()
                plans[label] = "; ".join(str(row[-1]) for row in rows)
            return plans
        finally:
            conn.close()

    def cleanup() -> None:
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)

    return _Backend("sqlite", open_store, load, size, f"sqlite:///{path}", cleanup, raw_row,
                    explain)


def _load_sqlite(path: str, sessions: int, per_session: int, seed: int) -> float:
    import sqlite3

    tpl = _templates(per_session)
    conn = sqlite3.connect(str(path), isolation_level=None)
    conn.execute("PRAGMA journal_mode=DELETE")  # no WAL for the load: one write, not two
    conn.execute("PRAGMA synchronous=OFF")
    conn.execute("PRAGMA cache_size=-262144")
    started = time.perf_counter()
    done = 0
    while done < sessions:
        count = min(BATCH_SESSIONS, sessions - done)
        batch = list(_sessions(done, count, per_session, tpl, seed))
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO chatflow_sessions (session_id, active_agent_name, metadata_json,"
            " version, created_at, updated_at, user_id) VALUES (?, 'Bot', '{}', ?, ?, ?, ?)",
            [(s.session_id, s.version, _sqlite_ts(s.created), _sqlite_ts(s.updated),
              s.user_id) for s in batch],
        )
        conn.executemany(
            "INSERT INTO chatflow_messages (session_id, seq, role, content, message_json,"
            " created_at) VALUES (?, ?, ?, ?, ?, ?)",
            [(s.session_id, seq, role, content, body, _sqlite_ts(at))
             for s in batch for seq, role, content, body, at in s.messages],
        )
        conn.execute("COMMIT")
        done += count
    conn.execute("PRAGMA journal_mode=WAL")  # as the store left it
    conn.close()
    with open(path, "rb+") as file:  # the load's dirty pages on disk, not in a turn's fsync
        os.fsync(file.fileno())
    return time.perf_counter() - started


_EXPLAINED_SQLITE = [
    ("session by id", "SELECT * FROM chatflow_sessions WHERE session_id = ?", ("+5511000000007",)),
    ("window", "SELECT id, seq, message_json FROM chatflow_messages WHERE session_id = ?"
     " ORDER BY seq", ("+5511000000007",)),
    ("list page", "SELECT session_id FROM chatflow_sessions WHERE session_id > ?"
     " ORDER BY session_id LIMIT 100", ("+5511000500000",)),
]


def _postgres_backend(url: str, name: str = "million") -> _Backend:
    import psycopg

    from chatflow_sqlalchemy import PostgresSessionStore

    schema = create_schema(url, name)
    options = f"-csearch_path={schema}"

    def open_store() -> Any:
        return PostgresSessionStore(url, connect_args=schema_connect_args(schema))

    def load(sessions: int, per_session: int, seed: int) -> float:
        return _in_child(_load_postgres, url, schema, sessions, per_session, seed)

    def size() -> dict[str, int]:
        with psycopg.connect(libpq_url(url), options=options) as conn:
            rows = conn.execute(
                "SELECT c.relname, pg_total_relation_size(c.oid) FROM pg_class c"
                " JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = %s AND c.relkind = 'r'", (schema,)).fetchall()
        return {str(name): int(total) for name, total in rows}

    def raw_row(session_id: str) -> dict[str, Any]:
        with psycopg.connect(libpq_url(url), options=options) as conn:
            session = conn.execute(
                "SELECT pg_typeof(version)::text, created_at, updated_at, metadata_json::text"
                " FROM chatflow_sessions WHERE session_id = %s", (session_id,)).fetchone()
            message = conn.execute(
                "SELECT seq, role, created_at, content IS NULL FROM chatflow_messages"
                " WHERE session_id = %s ORDER BY seq LIMIT 1", (session_id,)).fetchone()
        assert session is not None and message is not None
        return {"session": [str(v) for v in session], "message": [str(v) for v in message]}

    def explain() -> dict[str, str]:
        plans = {}
        with psycopg.connect(libpq_url(url), options=options) as conn:
            for label, sql, args in _EXPLAINED_SQLITE:
                rows = conn.execute("EXPLAIN ANALYZE " + sql.replace("?", "%s"), args).fetchall()
                plans[label] = " / ".join(str(r[0]).strip() for r in rows)
        return plans

    def cleanup() -> None:
        drop_schema(url, schema)

    scoped = f"{url}?options={options.replace('=', '%3D')}"
    return _Backend("postgresql", open_store, load, size, scoped, cleanup, raw_row, explain)


def _load_postgres(url: str, schema: str, sessions: int, per_session: int, seed: int) -> float:
    import psycopg

    options = f"-csearch_path={schema}"
    tpl = _templates(per_session)
    started = time.perf_counter()
    with psycopg.connect(libpq_url(url), options=options) as conn:
        # The rows are consistent by construction: skip the per-row foreign-key
        # triggers, as a restore does (superuser only; else they run).
        try:
            conn.execute("SET session_replication_role = replica")
        except psycopg.Error:
            conn.rollback()
        done = 0
        while done < sessions:
            count = min(BATCH_SESSIONS, sessions - done)
            batch = list(_sessions(done, count, per_session, tpl, seed))
            with conn.cursor() as cur:
                with cur.copy(
                    "COPY chatflow_sessions (session_id, active_agent_name, metadata_json,"
                    " version, created_at, updated_at, user_id) FROM STDIN"
                ) as copy:
                    copy.write("".join(
                        f"{s.session_id}\tBot\t{{}}\t{s.version}\t{_pg_ts(s.created)}\t"
                        f"{_pg_ts(s.updated)}\t{s.user_id}\n" for s in batch))
                with cur.copy(
                    "COPY chatflow_messages (session_id, seq, role, content, message_json,"
                    " created_at) FROM STDIN"
                ) as copy:
                    copy.write("".join(
                        f"{s.session_id}\t{seq}\t{role}\t{content}\t{body}\t{_pg_ts(at)}\n"
                        for s in batch for seq, role, content, body, at in s.messages))
            conn.commit()
            done += count
        conn.execute("RESET session_replication_role")
        conn.commit()
        conn.autocommit = True
        conn.execute("ANALYZE chatflow_sessions")
        conn.execute("ANALYZE chatflow_messages")
        with contextlib.suppress(psycopg.Error):  # the load's dirty buffers written now,
            conn.execute("CHECKPOINT")  # not during the timed turns
    return time.perf_counter() - started


# ------------------------------------------------------------------ turns


@dataclass
class TurnFigures:
    """Latencies of one workload."""

    label: str
    turns: int
    p50_ms: float
    p99_ms: float


def _runner(store: Any) -> Any:
    from chatflow_agent import Agent, Runner

    from chatflow_sqlalchemy.testing.suite import ScriptedEngine

    return Runner(starting_agent=Agent(name="Bot", instructions=""), session_store=store,
                  engine=ScriptedEngine())


async def _timed_turns(runner: Any, plan: Sequence[tuple[str, int]]) -> list[float]:
    latencies = []
    for session_id, turn in plan:
        started = time.perf_counter()
        await runner.run_async(session_id, _user_text(turn))
        latencies.append((time.perf_counter() - started) * 1000)
    return latencies


def _repeat_plan(ids: Sequence[str], turns: int, first_turn: int = 0) -> list[tuple[str, int]]:
    return [(sid, first_turn + k) for k in range(turns) for sid in ids]


def _figures(label: str, latencies: list[float]) -> TurnFigures:
    return TurnFigures(label, len(latencies), percentile(latencies, 0.50),
                       percentile(latencies, 0.99))


def _seed(store: Any, ids: Sequence[str], per_session: int) -> None:
    """Write ``per_session // 2`` turns into each of ``ids`` through the store (untimed)."""
    runner = _runner(store)
    plan = [(sid, turn) for sid in ids for turn in range(per_session // 2)]
    asyncio.run(_timed_turns(runner, plan))


def _measure(arms: Sequence[tuple[Any, Sequence[str]]], phase: str,
             first_turn: int) -> list[list[TurnFigures]]:
    """The four workloads on each (store, existing session ids) arm, turns interleaved.

    New sessions (10 repeated x 30 turns, 300 touched once) and ``existing``
    ones (the first 10 repeated, the next 300 touched once). With two arms the
    turns alternate between them, so that whatever else the machine does
    slows both alike.
    """
    runners = [_runner(store) for store, _ in arms]

    async def drive() -> list[list[TurnFigures]]:
        for runner in runners:
            await _timed_turns(runner, [(f"warm-{phase}", k) for k in range(10)])
        plans: list[tuple[str, list[list[tuple[str, int]]]]] = []
        new_repeat = [f"{phase}-r{i}" for i in range(REPEAT_SESSIONS)]
        new_spread = [f"{phase}-s{i:03d}" for i in range(SPREAD_SESSIONS)]
        plans.append(("repeat, new sessions",
                      [_repeat_plan(new_repeat, REPEAT_TURNS) for _ in arms]))
        plans.append(("spread, new sessions", [[(sid, 0) for sid in new_spread] for _ in arms]))
        plans.append(("repeat, existing sessions", [
            _repeat_plan(ids[:REPEAT_SESSIONS], REPEAT_TURNS, first_turn) for _, ids in arms]))
        plans.append(("spread, existing sessions", [
            [(sid, first_turn) for sid in ids[REPEAT_SESSIONS:]] for _, ids in arms]))
        found: list[list[TurnFigures]] = [[] for _ in arms]
        for label, per_arm in plans:
            latencies: list[list[float]] = [[] for _ in arms]
            for step in range(len(per_arm[0])):
                for arm, runner in enumerate(runners):
                    latencies[arm] += await _timed_turns(runner, [per_arm[arm][step]])
            for arm in range(len(arms)):
                found[arm].append(_figures(label, latencies[arm]))
        return found

    return asyncio.run(drive())


# ------------------------------------------------------------------ listing


def _timed(call: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    value = call()
    return (time.perf_counter() - started) * 1000, value


def _cli(url: str, args: list[str], timeout: float) -> tuple[float | None, int]:
    """Wall ms of ``chatflow-sqlalchemy --url URL <args>`` (None: timed out), output bytes."""
    exe = Path(sys.executable).parent / "chatflow-sqlalchemy"
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "chatflow_sqlalchemy.cli"]
    started = time.perf_counter()
    try:
        done = subprocess.run([*command, "--url", url, *args], capture_output=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None, 0
    wall = (time.perf_counter() - started) * 1000
    if done.returncode != 0:
        raise RuntimeError(f"CLI {args} failed: {done.stderr.decode()[-500:]}")
    return wall, len(done.stdout)


# ------------------------------------------------------------------ one backend


@dataclass
class BackendResult:
    """Everything measured on one backend."""

    backend: str
    sessions: int
    messages: int
    load_seconds: float = 0.0
    empty: list[TurnFigures] = field(default_factory=list)
    loaded: list[TurnFigures] = field(default_factory=list)
    control: list[TurnFigures] = field(default_factory=list)
    listing_ms: dict[str, float | None] = field(default_factory=dict)
    unpaged_ids: int = 0
    unpaged_rss_growth_mb: float = 0.0
    rss_mb: dict[str, float] = field(default_factory=dict)
    size_bytes: dict[str, int] = field(default_factory=dict)
    turns_stored: int = 0
    checks: dict[str, Any] = field(default_factory=dict)
    plans: dict[str, str] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        """The database's size (SQLite: file + WAL + shm; PostgreSQL: every table's total)."""
        return sum(self.size_bytes.values())

    @property
    def bytes_per_1k_turns(self) -> float:
        """Database bytes per 1,000 stored turns."""
        return self.total_bytes / self.turns_stored * 1000 if self.turns_stored else 0.0


def run_backend(backend: _Backend, control: _Backend, sessions: int, per_session: int,
                seed: int, cli_timeout: float, log: Callable[[str], None]) -> BackendResult:
    """Steps 1-6 of the module docstring on ``backend``; ``control`` stays near-empty."""
    result = BackendResult(backend.name, sessions, sessions * per_session)
    rng = random.Random(seed + 1)
    seeded = [f"seeded-{i:03d}" for i in range(REPEAT_SESSIONS + SPREAD_SESSIONS)]
    for target in (backend, control):
        store = target.open_store()
        try:
            _seed(store, seeded, per_session)
        finally:
            store.close()
    store = backend.open_store()  # no context cached: the first touch reads the rows
    try:
        result.rss_mb["empty, before turns"] = _rss_kb() / 1024
        (result.empty,) = _measure([(store, seeded)], "empty", per_session // 2)
        result.rss_mb["empty, after turns"] = _rss_kb() / 1024
    finally:
        store.close()
    written = backend.raw_row(seeded[0])
    log(f"{backend.name}: empty-database turns done; loading {sessions:,} sessions")
    result.load_seconds = backend.load(sessions, per_session, seed)
    log(f"{backend.name}: loaded in {result.load_seconds:.0f} s")
    loaded_row = backend.raw_row(loaded_id(0))
    result.checks["row shape (store-written vs loaded)"] = _same_shape(written, loaded_row)
    gc.collect()
    store, control_store = backend.open_store(), control.open_store()
    try:
        probes = sorted({0, sessions // 2, sessions - 1, rng.randrange(sessions)})
        result.checks["loaded sessions read back"] = all(
            _read_back(store, index, per_session, seed) for index in probes)
        result.rss_mb["loaded, before turns"] = _rss_kb() / 1024
        picked = rng.sample(range(sessions), REPEAT_SESSIONS + SPREAD_SESSIONS)
        result.loaded, result.control = _measure(
            [(store, [loaded_id(i) for i in picked]), (control_store, seeded)], "loaded",
            per_session // 2)
        result.rss_mb["loaded, after turns"] = _rss_kb() / 1024
        log(f"{backend.name}: loaded-database turns done")
        ms, first = _timed(lambda: store.list_sessions(limit=100))
        result.listing_ms["list_sessions(limit=100), first page"] = ms
        middle = loaded_id(sessions // 2)
        ms, page = _timed(lambda: store.list_sessions(limit=100, after=middle))
        result.listing_ms["list_sessions(limit=100, after=<middle id>)"] = ms
        result.checks["pages keyset-ordered"] = (
            len(first) == 100 and first == sorted(first) and page[0] > middle)
        gc.collect()
        before = _rss_kb()
        result.rss_mb["peak (ru_maxrss) before unpaged list_sessions()"] = _peak_kb() / 1024
        ms, everything = _timed(lambda: store.list_sessions())
        result.unpaged_rss_growth_mb = (_rss_kb() - before) / 1024
        result.listing_ms["list_sessions() unpaged"] = ms
        result.unpaged_ids = len(everything)
        del everything
        gc.collect()
        result.rss_mb["after unpaged list_sessions()"] = _rss_kb() / 1024
    finally:
        store.close()
        control_store.close()
    log(f"{backend.name}: CLI on the near-empty control database")
    result.listing_ms["CLI sessions list --limit 100, near-empty control database"], _ = _cli(
        control.cli_url, ["sessions", "list", "--limit", "100"], cli_timeout)
    for label, args in (
        ("CLI sessions list --limit 100", ["sessions", "list", "--limit", "100"]),
        ("CLI sessions list --limit 100 --after <middle id>",
         ["sessions", "list", "--limit", "100", "--after", loaded_id(sessions // 2)]),
        ("CLI sessions list --json (unpaged)", ["sessions", "list", "--json"]),
    ):
        log(f"{backend.name}: {label}")
        result.listing_ms[label], _ = _cli(backend.cli_url, args, cli_timeout)
    result.size_bytes = backend.size()
    per_phase = 10 + 2 * (REPEAT_SESSIONS * REPEAT_TURNS + SPREAD_SESSIONS)
    bench_turns = 2 * per_phase + len(seeded) * (per_session // 2)
    result.turns_stored = sessions * per_session // 2 + bench_turns
    result.plans = backend.explain()
    result.rss_mb["peak (ru_maxrss) at the end"] = _peak_kb() / 1024
    return result


def _same_shape(written: dict[str, Any], loaded: dict[str, Any]) -> str:
    """"same" when the loaded row's types and text formats match the store-written one's."""
    def shape(value: Any) -> str:
        text = str(value)
        return "".join("9" if ch.isdigit() else ch for ch in text) if len(text) < 40 else text

    diffs = [
        f"{part}[{i}]: {w!r} vs {ld!r}"
        for part in ("session", "message")
        for i, (w, ld) in enumerate(zip(written[part], loaded[part], strict=True))
        if shape(w) != shape(ld)
    ]
    return "same" if not diffs else "DIFFERENT: " + "; ".join(diffs)


def _read_back(store: Any, index: int, per_session: int, seed: int) -> bool:
    from chatflow_sqlalchemy.context import dump_message

    ctx = store.get(loaded_id(index))
    if ctx is None:
        return False
    return [dump_message(m) for m in ctx.history] == expected_history(index, per_session, seed)


# ------------------------------------------------------------------ report


def render(results: list[BackendResult]) -> str:
    """The figures as markdown tables."""
    lines = []
    for r in results:
        lines += [
            f"### {r.backend}: {r.sessions:,} sessions, {r.messages:,} messages loaded "
            f"in {r.load_seconds:.0f} s",
            "",
            "Turn latency, ms (p50 / p99). *empty*: step 1, this database before the load; "
            "*control*: a near-empty database driven turn-for-turn alternately with the "
            "loaded one (same noise); ratios are loaded / control (loaded / empty).",
            "",
            "| turns (300 each) | empty | control | loaded | p50 ratio | p99 ratio |",
            "|---|---|---|---|---|---|",
        ]
        for e, c, f in zip(r.empty, r.control, r.loaded, strict=True):
            lines.append(
                f"| {f.label} | {e.p50_ms:.2f} / {e.p99_ms:.2f} "
                f"| {c.p50_ms:.2f} / {c.p99_ms:.2f} | {f.p50_ms:.2f} / {f.p99_ms:.2f} "
                f"| {f.p50_ms / c.p50_ms:.2f}x ({f.p50_ms / e.p50_ms:.2f}x) "
                f"| {f.p99_ms / c.p99_ms:.2f}x ({f.p99_ms / e.p99_ms:.2f}x) |")
        lines += ["", "| listing | ms |", "|---|---|"]
        for label, ms in r.listing_ms.items():
            lines.append(f"| {label} | {'timed out' if ms is None else f'{ms:,.1f}'} |")
        lines += [
            f"| (unpaged list_sessions(): {r.unpaged_ids:,} ids, RSS +"
            f"{r.unpaged_rss_growth_mb:.0f} MB) | |",
            "", "| process RSS | MB |", "|---|---|",
        ]
        lines += [f"| {label} | {mb:.0f} |" for label, mb in r.rss_mb.items()]
        mb = 1e6
        lines += [
            "",
            f"Database: {r.total_bytes / mb:,.0f} MB for {r.turns_stored:,} turns = "
            f"**{r.bytes_per_1k_turns / mb:.2f} MB per 1k turns** (LangGraph, published: "
            f"219 MB per 500 turns of one thread = {LANGGRAPH_BYTES_PER_1K_TURNS / mb:.0f} MB "
            "per 1k turns). Parts: "
            + ", ".join(f"{k} {v / mb:,.0f} MB" for k, v in sorted(r.size_bytes.items())),
            "",
            "Checks: " + "; ".join(f"{k}: {v}" for k, v in r.checks.items()),
            "",
            "Plans: " + "; ".join(f"{k}: {v}" for k, v in r.plans.items()),
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line: run the backends asked for, print markdown (and JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sessions", type=int, default=1_000_000)
    parser.add_argument("--messages-per-session", type=int, default=10)
    parser.add_argument("--backend", choices=("sqlite", "postgresql", "both"), default="both")
    parser.add_argument("--url", default=None, help="PostgreSQL server (a schema of its own)")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--cli-timeout", type=float, default=600.0,
                        help="seconds before the unpaged CLI listing counts as timed out")
    parser.add_argument("--sqlite-pragma", action="append", default=[], metavar="NAME=VALUE",
                        help="experiment: also set this pragma on the SQLite stores' connections")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.messages_per_session < 2 or args.messages_per_session % 2:
        parser.error("--messages-per-session must be even (USER/MODEL pairs)")

    def log(text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    names = ("sqlite", "postgresql") if args.backend == "both" else (args.backend,)
    results = []
    for name in names:
        workdir = None
        if name == "sqlite":
            base = "/var/tmp" if os.path.isdir("/var/tmp") else None
            workdir = Path(tempfile.mkdtemp(prefix="chatflow-million-", dir=base))
            backend = _sqlite_backend(workdir, pragmas=args.sqlite_pragma)
            control = _sqlite_backend(workdir, "control", args.sqlite_pragma)
        else:
            backend = _postgres_backend(pg_url_from_env(args.url))
            control = _postgres_backend(pg_url_from_env(args.url), "million_control")
        try:
            results.append(run_backend(backend, control, args.sessions,
                                       args.messages_per_session, args.seed, args.cli_timeout,
                                       log))
        finally:
            backend.cleanup()
            control.cleanup()
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
        print(render(results[-1:]), flush=True)
    if args.json:
        args.json.write_text(json.dumps([_as_json(r) for r in results], indent=2, default=str))
    return 0


def _as_json(result: BackendResult) -> dict[str, Any]:
    from dataclasses import asdict

    figures = asdict(result)
    figures["total_bytes"] = result.total_bytes
    figures["bytes_per_1k_turns"] = result.bytes_per_1k_turns
    return figures


if __name__ == "__main__":
    raise SystemExit(main())
