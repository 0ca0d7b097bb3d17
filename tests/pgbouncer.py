"""A private PgBouncer in transaction-pooling mode, in front of a PostgreSQL server.

Started by the tests on its own loopback port (Debian: ``apt-get install
pgbouncer``): ``pool_mode = transaction`` and ``default_pool_size = 2``, fewer
server connections per database than the tests' clients, so a server
connection is handed to another client at every transaction end, as in a
fleet. Any database name is passed through to the server (``* = ...``), so a
test gets its own database (PgBouncer forwards no ``options`` startup
parameter, hence no per-connection ``search_path``). Authentication is
``trust`` with an ``auth_file`` written here (the server behind trusts too).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from sqlalchemy import URL, make_url

__all__ = ["POOL_SIZE", "PgBouncer", "pgbouncer_problem"]

POOL_SIZE = 2
"""Server connections per database and user (``default_pool_size``)."""


def pgbouncer_problem() -> str | None:
    """Why PgBouncer cannot be started here, or None if it can."""
    if shutil.which("pgbouncer") is None and not Path("/usr/sbin/pgbouncer").exists():
        return "pgbouncer is not installed (Debian: apt-get install pgbouncer)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root without a 'postgres' user to run pgbouncer as"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PgBouncer:
    """One PgBouncer process on ``127.0.0.1:<port>`` in front of ``upstream``."""

    def __init__(self, upstream: str | URL, *, pool_size: int = POOL_SIZE) -> None:
        self.upstream = make_url(upstream)
        self.port = _free_port()
        self.root = Path(tempfile.mkdtemp(prefix="chatflow-pgbouncer-"))
        self.pool_size = pool_size
        self._process: subprocess.Popen[bytes] | None = None

    def url(self, database: str) -> URL:
        """The upstream URL with PgBouncer's host and port and ``database``."""
        return self.upstream.set(host="127.0.0.1", port=self.port, database=database)

    def _write_config(self) -> Path:
        user = self.upstream.username or "postgres"
        (self.root / "users.txt").write_text(f'"{user}" ""\n')
        config = self.root / "pgbouncer.ini"
        config.write_text(
            "[databases]\n"
            f"* = host={self.upstream.host or '127.0.0.1'} port={self.upstream.port or 5432}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\n"
            f"unix_socket_dir =\nauth_type = trust\nauth_file = {self.root / 'users.txt'}\n"
            f"pool_mode = transaction\ndefault_pool_size = {self.pool_size}\n"
            "min_pool_size = 0\nreserve_pool_size = 0\nmax_client_conn = 2000\n"
            "server_reset_query =\nserver_check_delay = 0\nserver_login_retry = 1\n"
            f"logfile = {self.root / 'log'}\npidfile = {self.root / 'pid'}\n"
            "ignore_startup_parameters = extra_float_digits,options\n"
        )
        return config

    def start(self) -> PgBouncer:
        """Start it; return once it accepts TCP connections."""
        config = self._write_config()
        command = [shutil.which("pgbouncer") or "/usr/sbin/pgbouncer", str(config)]
        if os.geteuid() == 0:  # pgbouncer refuses to run as root
            owner = pwd.getpwnam("postgres")
            for path in [self.root, *self.root.iterdir()]:
                os.chown(path, owner.pw_uid, owner.pw_gid)
            command = ["runuser", "-u", "postgres", "--", *command]
        self._process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(
                ("127.0.0.1", self.port), timeout=1
            ):
                return self
            if self._process.poll() is not None or time.monotonic() > deadline:
                log = (self.root / "log").read_text() if (self.root / "log").exists() else ""
                self.stop()
                raise RuntimeError(f"pgbouncer did not start: {log[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop the process and delete its files."""
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        shutil.rmtree(self.root, ignore_errors=True)
