"""Run one case: spawn worker processes, start them together, verify what they left behind."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.pg import create_schema, drop_schema
from benchmarks.stores import Target, adapter_class
from benchmarks.workload import session_ids, verify_windows

__all__ = ["CaseResult", "Env", "percentile", "run_case", "run_workers", "scratch_target"]

ROOT = Path(__file__).resolve().parent.parent
WORKER_TIMEOUT = 900.0


@dataclass
class Env:
    """Where scratch data goes, and the PostgreSQL server (None: no PostgreSQL)."""

    workdir: Path
    pg_url: str | None

    @classmethod
    def create(cls, pg_url: str | None) -> Env:
        """A fresh scratch directory (on disk, not tmpfs, when /var/tmp exists)."""
        base = "/var/tmp" if os.path.isdir("/var/tmp") else None
        return cls(Path(tempfile.mkdtemp(prefix="chatflow-bench-", dir=base)), pg_url)

    def cleanup(self) -> None:
        """Remove the scratch directory."""
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class CaseResult:
    """One store, one mode, one round."""

    store: str
    mode: str
    workers: int
    turns: int
    ran: int = 0
    seconds: float = 0.0
    throughput: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    peak_rss_mb: float = 0.0
    rss_delta_mb: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when the run completed and verified."""
        return not self.problems


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..1); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


class _Worker:
    """A ``python -m benchmarks.worker`` child speaking the READY/GO/RESULT protocol."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        self.early: dict[str, Any] | None = None

    def wait_ready(self) -> None:
        """Block until READY (or an early RESULT carrying an error)."""
        line = self._line()
        if line.startswith("RESULT "):
            self.early = json.loads(line[7:])
        elif line != "READY":
            self.early = {"error": f"worker said {line!r}"}

    def go(self) -> None:
        """Release the worker."""
        if self.early is None and self.proc.stdin is not None:
            self.proc.stdin.write("GO\n")
            self.proc.stdin.flush()

    def result(self) -> dict[str, Any]:
        """The RESULT payload (or an error)."""
        if self.early is not None:
            self.proc.wait(WORKER_TIMEOUT)
            return self.early
        line = self._line()
        self.proc.wait(WORKER_TIMEOUT)
        if not line.startswith("RESULT "):
            return {"error": f"worker exited with {self.proc.returncode}: {line!r}"}
        return dict(json.loads(line[7:]))

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()


def run_workers(specs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Start one process per spec, release them together, collect their results."""
    workers = [_Worker(spec) for spec in specs]
    for worker in workers:
        worker.wait_ready()
    for worker in workers:
        worker.go()
    return [worker.result() for worker in workers]


def scratch_target(store: str, env: Env, label: str) -> Target:
    """A fresh place for one run's data."""
    backend = adapter_class(store).backend
    if backend == "postgres":
        assert env.pg_url is not None
        return Target(pg_url=env.pg_url, schema=create_schema(env.pg_url, label))
    if backend == "sqlite-file":
        return Target(path=str(env.workdir / f"{label}.db"))
    return Target()


def drop_target(target: Target) -> None:
    """Delete one run's data."""
    if target.schema and target.pg_url:
        drop_schema(target.pg_url, target.schema)
    if target.path:
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(target.path + suffix).unlink(missing_ok=True)


async def _read_back(store: str, target: Target, sessions: list[str]) -> dict[str, Any]:
    adapter = adapter_class(store)(target)
    await adapter.open()
    try:
        return await adapter.read_windows(sessions)
    finally:
        await adapter.close()


def _summarise(case: CaseResult, results: list[dict[str, Any]]) -> None:
    latencies = [lat for r in results for lat in r["latencies_ms"]]
    case.ran = sum(r["ran"] for r in results)
    case.seconds = max(r["end"] for r in results) - min(r["start"] for r in results)
    case.throughput = case.ran / case.seconds if case.seconds > 0 else 0.0
    case.p50_ms = percentile(latencies, 0.50)
    case.p99_ms = percentile(latencies, 0.99)
    case.peak_rss_mb = max(r["rss_peak_kb"] for r in results) / 1024
    case.rss_delta_mb = max(r["rss_peak_kb"] - r["rss_ready_kb"] for r in results) / 1024


def _exactly_once(results: list[dict[str, Any]], expected: int) -> list[str]:
    won = [wid for r in results for wid in r["won"]]
    if len(won) == expected and len(set(won)) == expected:
        return []
    dupes = len(won) - len(set(won))
    return [f"exactly-once broken: {len(won)} turns run for {expected} webhooks ({dupes} twice)"]


def _verify(case: CaseResult, results: list[dict[str, Any]], target: Target,
            sessions: list[str], turns: int) -> list[str]:
    cls = adapter_class(case.store)
    expected = len(sessions) * turns
    problems: list[str] = []
    if case.mode == "redelivery":
        problems += _exactly_once(results, expected)
    elif case.ran != expected:
        problems.append(f"{case.ran} turns ran, expected {expected}")
    if cls.ephemeral:
        windows = results[0]["windows"]
    else:
        windows = asyncio.run(_read_back(case.store, target, sessions))
    return problems + verify_windows(windows, case.mode, turns, case.workers)


UNAVAILABLE = ("connection refused", "shutting down", "starting up", "server closed the connection",
               "cannot reach", "terminating connection", "connection failed")
"""Worker errors that mean the server went away (e.g. a test suite restarting it), not a bug."""


def _unavailable(case: CaseResult) -> bool:
    return any(m in p.lower() for p in case.problems if p.startswith("worker error")
               for m in UNAVAILABLE)


def run_case(store: str, mode: str, workers: int, sessions: int, turns: int, env: Env,
             label: str, profile: str | None = None, attempts: int = 3) -> CaseResult:
    """Run ``store`` in ``mode`` with ``workers`` processes; summarise and verify.

    A case whose workers lost the database server (a restart by something else
    on the machine) is run again from scratch, up to ``attempts`` times; every
    other failure stands.
    """
    for attempt in range(attempts):
        case = _run_case_once(store, mode, workers, sessions, turns, env,
                              f"{label}-a{attempt}", profile)
        if not _unavailable(case):
            break
        time.sleep(2.0)
    return case


def _run_case_once(store: str, mode: str, workers: int, sessions: int, turns: int, env: Env,
                   label: str, profile: str | None) -> CaseResult:
    case = CaseResult(store, mode, workers, turns)
    target = scratch_target(store, env, label)
    try:
        adapter_class(store).prepare(target)
        base = {"action": "turns", "adapter": store, "target": target.to_json(), "mode": mode,
                "sessions": sessions, "turns": turns, "workers": workers, "profile": profile}
        results = run_workers([{**base, "worker": index} for index in range(workers)])
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            case.problems = [f"worker error: {error}" for error in errors[:2]]
            return case
        _summarise(case, results)
        case.problems = _verify(case, results, target, session_ids(sessions), turns)
    except Exception as exc:
        case.problems = [f"{type(exc).__name__}: {exc}"]
    finally:
        drop_target(target)
    return case


def median(values: Sequence[float]) -> float:
    """Median, 0.0 for none."""
    return statistics.median(values) if values else 0.0


def run_alone(suite: Callable[[Env, Callable[[str], None], Any], str], quick: Any) -> None:
    """``python -m benchmarks.<suite> [--quick]``: one suite alone, its table on stdout.

    ``suite(env, log, cfg)`` is the suite's run function; ``quick`` its ``--quick`` config.
    PostgreSQL cases run when ``$CHATFLOW_TEST_POSTGRES_URL`` reaches a server.
    """
    from benchmarks.pg import pg_available, pg_url_from_env

    url = pg_url_from_env()
    environment = Env.create(url if pg_available(url) is None else None)
    try:
        cfg = quick if "--quick" in sys.argv[1:] else None
        print(suite(environment, lambda m: print(m, file=sys.stderr, flush=True), cfg))
    finally:
        environment.cleanup()
