"""PostgreSQL faults: a server restart under a live store, bad credentials, no server."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from chatflow_agent import Agent, Message, Role
from sqlalchemy import make_url

from chatflow_sqlalchemy import DatabaseUnavailableError, PostgresSessionStore, open_store

pytestmark = pytest.mark.postgres


@pytest.fixture
def schema(pg_url: str, pg_schema: str) -> Iterator[str]:
    """``pg_schema``, but the server is back up before it is dropped."""
    yield pg_schema
    _wait_for_server(pg_url.replace("postgresql+psycopg://", "postgresql://"))


def _wait_for_server(dsn: str, timeout: float = 30.0) -> None:
    import psycopg

    deadline = time.monotonic() + timeout
    while True:
        try:
            psycopg.connect(dsn, connect_timeout=2).close()
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _cluster() -> list[str]:
    """The pg_ctlcluster command for the local server, or skip when there is none."""
    if shutil.which("pg_ctlcluster") is None or not Path("/etc/postgresql").is_dir():
        pytest.skip("no local PostgreSQL cluster to restart (pg_ctlcluster)")
    if os.geteuid() != 0:
        pytest.skip("restarting the server needs root")
    version = sorted(os.listdir("/etc/postgresql"))[0]
    return ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main"]


def _ctl(action: str) -> None:
    subprocess.run([*_cluster(), action], check=True, capture_output=True, timeout=120)


def test_store_survives_server_restart_and_fails_cleanly_while_down(
    pg_url: str, schema: str
) -> None:
    host = make_url(pg_url).host or ""
    if host not in ("127.0.0.1", "localhost", "::1", ""):
        pytest.skip("the server under test is not local; it cannot be restarted here")
    _cluster()
    options = {"connect_args": {"options": f"-csearch_path={schema}", "connect_timeout": 3}}
    store = PostgresSessionStore(pg_url, **options)
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")
    try:
        session = store.get_or_create("s", Agent(name="Bot", instructions=""))
        session.add_message(Message(role=Role.USER, content="before restart"))

        _ctl("restart")
        _wait_for_server(dsn)
        session.add_message(Message(role=Role.MODEL, content="after restart"))
        assert store.record_processed_message("m-after-restart")

        _ctl("stop")
        try:
            with pytest.raises(DatabaseUnavailableError) as caught:
                session.add_message(Message(role=Role.USER, content="while down"))
            assert "test" in str(caught.value)
            assert [m.content for m in session.history] == ["before restart", "after restart"]
        finally:
            _ctl("start")
            _wait_for_server(dsn)

        session.add_message(Message(role=Role.USER, content="back again"))
    finally:
        store.close()
    fresh = PostgresSessionStore(pg_url, **options)
    try:
        reloaded = fresh.get("s")
        assert reloaded is not None
        assert [m.content for m in reloaded.history] == [
            "before restart", "after restart", "back again",
        ]
        assert fresh.is_message_processed("m-after-restart")
    finally:
        fresh.close()


def test_unreachable_server_names_host_and_database_never_the_password() -> None:
    url = "postgresql+psycopg://chat:s3cr3t-pw@127.0.0.1:1/chatdb?connect_timeout=2"
    with pytest.raises(DatabaseUnavailableError) as caught:
        open_store(url)
    message = str(caught.value)
    assert "127.0.0.1" in message and "chatdb" in message
    assert "s3cr3t-pw" not in message
    assert "s3cr3t-pw" not in str(caught.value.args)


def test_missing_database_is_a_clear_error(pg_url: str) -> None:
    url = make_url(pg_url).set(database=f"no_such_db_{uuid.uuid4().hex[:6]}", password="pw-x1")
    with pytest.raises(DatabaseUnavailableError) as caught:
        PostgresSessionStore(url.render_as_string(hide_password=False))
    assert url.database in str(caught.value)
    assert "pw-x1" not in str(caught.value)


def _terminate_backends(dsn: str, application_name: str) -> int:
    """Kill every server connection opened under ``application_name``."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
            (application_name,),
        ).fetchall()
    return len(rows)


def test_idle_connections_killed_by_the_server_are_pinged_and_replaced(
    pg_url: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connections idle past IDLE_PING_SECONDS are checked on checkout; busy ones are not."""
    from chatflow_sqlalchemy import dialect, driver

    class SteppedClock:  # idle time moves only when told: no race with a loaded machine
        now = time.monotonic()

        def monotonic(self) -> float:
            return self.now

    clock = SteppedClock()
    monkeypatch.setattr(dialect, "time", clock)
    monkeypatch.setattr(driver, "time", clock)
    app = f"idle-ping-{schema[-12:]}"
    options = {"connect_args": {"options": f"-csearch_path={schema}", "application_name": app}}
    store = PostgresSessionStore(pg_url, **options)
    pings: list[int] = []
    original = store.engine.dialect.do_ping

    def counting_ping(dbapi_connection: object) -> bool:
        pings.append(1)
        return original(dbapi_connection)

    monkeypatch.setattr(store.engine.dialect, "do_ping", counting_ping)
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")
    try:
        session = store.get_or_create("idle", Agent(name="Bot", instructions=""))
        session.add_message(Message(role=Role.USER, content="one"))
        assert store.record_processed_message("idle-1")
        assert pings == []  # connections used moments ago are not pinged
        assert _terminate_backends(dsn, app) >= 1
        time.sleep(0.3)  # let the server finish closing them
        clock.now += 2 * dialect.IDLE_PING_SECONDS
        session.add_message(Message(role=Role.MODEL, content="two"))
        assert store.record_processed_message("idle-2")
        assert pings, "an idle connection was used without a ping"
    finally:
        store.close()
    with PostgresSessionStore(pg_url, **options) as fresh:
        reloaded = fresh.get("idle")
        assert reloaded is not None
        assert [m.content for m in reloaded.history] == ["one", "two"]
        assert fresh.is_message_processed("idle-2")
