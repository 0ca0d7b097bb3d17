"""Failover: the primary dies under a steady load of claimed Runner turns, the replica is promoted.

A private primary and a streaming replica on loopback (``initdb`` +
``pg_basebackup -R``); the store is opened with SQLAlchemy's multi-host URL
(``?host=127.0.0.1:P1&host=127.0.0.1:P2&target_session_attrs=read-write``).
Worker processes answer webhooks the documented way (``store.claim``, then
``Runner.run_async``, ``claim.response``) and log each id once its claim
block exited cleanly: acknowledged to the platform. Mid-run the primary is
stopped with ``pg_ctl stop -m immediate`` (a crash) and the replica
promoted. The workers are not restarted: their failed calls raise, and they
redeliver the same ids (as a platform retries an unanswered webhook) until
each is acknowledged. Afterwards every acknowledged id must be in the stored
history.

With synchronous replication (``synchronous_standby_names``) a commit is
acknowledged only once the replica has it: nothing acknowledged may be lost.
With asynchronous replication the last commits before the crash can be
missing on the replica; the test reports how many (nothing is asserted).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from chatflow_sqlalchemy.testing.harness import start_process

from . import _workers
from .pg_private import _bin_dir, _free_port, private_cluster_problem

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

class _Server:
    """One PostgreSQL server of the pair (data directory, port, pg_ctl)."""

    def __init__(self, root: Path, name: str) -> None:
        self.bin = _bin_dir()
        self.data = root / name
        self.log = root / f"{name}.log"
        self.port = _free_port()
        self.root = root

    def run(self, *args: str) -> subprocess.CompletedProcess[bytes]:
        owner = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        return subprocess.run(
            [*owner, *args], check=True, capture_output=True, timeout=120, cwd=self.root
        )

    def ctl(self, action: str, *extra: str, options: str = "") -> None:
        args = [str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w",
                "-t", "60", *extra, action]
        if options:
            args[1:1] = ["-o", options]
        self.run(*args)

    def start(self, settings: str) -> None:
        self.ctl("start", options=(
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 {settings}"
        ))

    def sql(self, query: str) -> Any:
        import psycopg

        with psycopg.connect(
            f"postgresql://postgres@127.0.0.1:{self.port}/postgres", autocommit=True,
            connect_timeout=5,
        ) as conn:
            cursor = conn.execute(query)
            return cursor.fetchall() if cursor.description else None


@pytest.fixture
def pair_root() -> Any:
    problem = private_cluster_problem()
    if problem:
        pytest.skip(f"PostgreSQL tests skipped: {problem}")
    root = Path(tempfile.mkdtemp(prefix="chatflow-failover-"))
    if os.geteuid() == 0:
        owner = pwd.getpwnam("postgres")
        os.chown(root, owner.pw_uid, owner.pw_gid)
    servers: list[_Server] = []
    yield root, servers
    for server in servers:
        with contextlib.suppress(subprocess.SubprocessError):
            server.ctl("stop", "-m", "immediate")
    shutil.rmtree(root, ignore_errors=True)


def _start_pair(root: Path, servers: list[_Server], synchronous: bool) -> tuple[_Server, _Server]:
    primary, replica = _Server(root, "primary"), _Server(root, "replica")
    servers.extend([primary, replica])
    primary.run(str(primary.bin / "initdb"), "-D", str(primary.data), "-U", "postgres",
                "--auth=trust", "--no-sync")
    sync = "-c synchronous_standby_names=replica1 " if synchronous else ""
    # fsync stays off (a test machine); an immediate stop kills processes, not the OS cache.
    primary.start(f"{sync}-c fsync=off -c wal_level=replica -c max_wal_senders=5")
    primary.run(str(primary.bin / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(primary.port),
                "-U", "postgres", "-D", str(replica.data), "-R", "-X", "stream")
    replica.start("-c fsync=off -c cluster_name=replica1 -c hot_standby=on")
    wanted = "sync" if synchronous else "async"
    deadline = time.monotonic() + 60
    while primary.sql("SELECT sync_state FROM pg_stat_replication") != [(wanted,)]:
        assert time.monotonic() < deadline, "the replica never streamed"
        time.sleep(0.2)
    return primary, replica


def _acked(paths: list[Path]) -> list[str]:
    return [line for path in paths if path.exists() for line in path.read_text().split()]


@pytest.mark.parametrize("synchronous", [True, False], ids=["sync", "async"])
def test_primary_killed_and_replica_promoted_under_claimed_turns(
    pair_root: Any, synchronous: bool
) -> None:
    root, servers = pair_root
    primary, replica = _start_pair(root, servers, synchronous)
    url = (
        f"postgresql+psycopg://postgres@/postgres?host=127.0.0.1:{primary.port}"
        f"&host=127.0.0.1:{replica.port}&target_session_attrs=read-write"
    )
    from chatflow_sqlalchemy import PostgresSessionStore

    PostgresSessionStore(url).close()  # the schema, created on the primary
    workers, per_worker = 3, 40  # the crash comes after 30 acknowledged: most are after it
    acks = [root / f"acks-{i}.txt" for i in range(workers)]
    procs = [
        start_process(_workers.failover_worker, url, f"w{i}", per_worker, str(acks[i]))
        for i in range(workers)
    ]
    try:
        # Every worker past its start (a store opened during the crash raises: the
        # supervisor's job, not the store's) and a steady load under way.
        deadline = time.monotonic() + 120
        while len(_acked(acks)) < 30 or not all(_acked([path]) for path in acks):
            assert time.monotonic() < deadline, "no steady load before the crash"
            failed = [p for p in procs if p.process.exitcode not in (None, 0)]  # 0: done already
            assert not failed, [p.process.exitcode for p in failed]
            time.sleep(0.05)
        acked_before_crash = len(_acked(acks))
        primary.ctl("stop", "-m", "immediate")
        replica.ctl("promote")
        outcomes = [proc.result(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            proc.stop()
    acked = _acked(acks)
    store = PostgresSessionStore(url, default_max_turns=100_000)
    try:
        questions = [
            message.content
            for session_id in ("s0", "s1", "s2")
            for message in (store.get(session_id) or _Empty()).history
            if message.role.value == "user"
        ]
    finally:
        store.close()
    stored = set(questions)
    lost = sorted(set(acked) - stored)
    report = {
        "replication": "sync" if synchronous else "async",
        "acknowledged": len(acked),
        "acknowledged_before_crash": acked_before_crash,
        "stored": len(stored),
        "acknowledged_lost": len(lost),
        "stored_twice": len(questions) - len(stored),
        "worker_errors_retried": sum(o["errors"] for o in outcomes),
    }
    print("failover:", json.dumps(report))
    assert len(acked) == len(set(acked)) == workers * per_worker, report
    assert sum(o["errors"] for o in outcomes) > 0, "the crash was never noticed"
    if synchronous:
        assert lost == [], report
        assert len(questions) == len(stored), f"a turn ran twice: {report}"


class _Empty:
    history: list[Any] = []
