"""A private PostgreSQL cluster for tests that must not disturb (or be disturbed by) others.

Tests that stop or restart a server, or that need a server nobody else restarts
under them, start their own: ``initdb`` in a temporary directory, ``pg_ctl``
on a free loopback port, trust authentication, ``fsync=off``. Needs the
PostgreSQL server binaries (Debian: ``apt-get install postgresql``) and, when
run as root, the ``postgres`` system user to own the data directory.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["PrivateCluster", "private_cluster_problem"]


def _bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def private_cluster_problem() -> str | None:
    """Why a private cluster cannot be started here, or None if it can."""
    if _bin_dir() is None:
        return "no PostgreSQL server binaries (initdb) installed"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root without a 'postgres' user to own the cluster"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrivateCluster:
    """One throw-away PostgreSQL server on ``127.0.0.1:<port>`` (database ``postgres``)."""

    def __init__(self) -> None:
        bin_dir = _bin_dir()
        assert bin_dir is not None, private_cluster_problem()
        self._bin = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="chatflow-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self._as_owner: list[str] = []
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
            self._as_owner = ["runuser", "-u", "postgres", "--"]

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the cluster's ``postgres`` database."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        subprocess.run(
            [*self._as_owner, *args], check=True, capture_output=True, timeout=120, cwd=self.root
        )

    def start(self) -> PrivateCluster:
        """initdb (first time) and start; returns when the server accepts connections."""
        if not self.data.exists():
            self._run(
                str(self._bin / "initdb"), "-D", str(self.data), "-U", "postgres",
                "--auth=trust", "--no-sync",
            )
        self.ctl("start")
        return self

    def ctl(self, action: str) -> None:
        """``pg_ctl start|stop|restart``, waiting until it is done."""
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c full_page_writes=off -c synchronous_commit=off"
        )
        self._run(
            str(self._bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "log"),
            "-o", options, "-w", "-t", "60", "-m", "fast", action,
        )

    def wait_until_ready(self, timeout: float = 30.0) -> None:
        """Return once a connection succeeds (raise after ``timeout`` seconds)."""
        import psycopg

        deadline = time.monotonic() + timeout
        dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        while True:
            try:
                psycopg.connect(dsn, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def destroy(self) -> None:
        """Stop the server and delete its files."""
        with contextlib.suppress(subprocess.SubprocessError):
            self.ctl("stop")
        shutil.rmtree(self.root, ignore_errors=True)
