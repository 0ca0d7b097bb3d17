"""PostgreSQL: a stale writer's pipelined write meets a writer rebasing under its row lock.

A writer whose compare-and-swap missed has already sent its inserts (one
pipeline); their foreign-key check takes ``KEY SHARE`` on the session row.
The rebasing writer holds that row with the store's ``lock_session_row``
lock and inserts the same seq. With ``FOR UPDATE`` the two wait on each
other and PostgreSQL kills one (the turn is lost); the store's lock must let
the stale writer finish, roll back and rebase.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Role
from sqlalchemy import make_url

from chatflow_sqlalchemy.backends.postgresql import PostgresDialectSupport
from chatflow_sqlalchemy.rows import SELECT_VERSION as _SELECT_VERSION

from . import pg_util

pytestmark = pytest.mark.postgres
psycopg = pytest.importorskip("psycopg", reason="the postgres extra is not installed")
BOT = Agent(name="Bot", instructions="")


def _locking_select(dialect: Any) -> str:
    """The store's row-locking version read, as it sends it (psycopg placeholders)."""
    statement = PostgresDialectSupport().lock_session_row(_SELECT_VERSION)
    return str(statement.compile(dialect=dialect))


@pytest.mark.parametrize("deadlock_timeout_ms", [50, 1000])
def test_stale_pipelined_write_and_rebasing_writer_both_succeed(
    pg_url: str, pg_schema: str, deadlock_timeout_ms: int
) -> None:
    a = pg_util.schema_store(pg_url, pg_schema)
    b = pg_util.schema_store(pg_url, pg_schema)
    c = pg_util.schema_store(pg_url, pg_schema)
    dsn = make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
    try:
        a.get_or_create("s", BOT).add_message(Message(role=Role.USER, content="q1"))
        stale = b.get("s")
        assert stale is not None
        c.get("s").metadata["k"] = 1  # the version moves; no row is added  # type: ignore[union-attr]
        rebasing = psycopg.connect(dsn, options=f"-csearch_path={pg_schema}")
        rebasing.execute(f"SET deadlock_timeout = '{deadlock_timeout_ms}ms'")
        rebasing.execute(_locking_select(b.engine.dialect), {"session_id": "s"})
        rebasing.execute(
            "UPDATE chatflow_sessions SET version = version + 1 WHERE session_id = 's'"
        )
        outcome: dict[str, str] = {}

        def stale_write() -> None:
            try:
                stale.add_message(Message(role=Role.USER, content="from the stale writer"))
                outcome["stale"] = "ok"
            except Exception as exc:  # the assertion below names it
                outcome["stale"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"

        thread = threading.Thread(target=stale_write)
        thread.start()
        _wait_until_blocked_by(dsn, rebasing.info.backend_pid)  # its swap waits on our lock
        json = Message(role=Role.USER, content="rebased").model_dump_json()
        try:
            rebasing.execute(
                "INSERT INTO chatflow_messages (session_id, seq, role, content, message_json, "
                "created_at) VALUES ('s', 2, 'user', 'rebased', %s, now())",
                (json,),
            )
            rebasing.commit()
            outcome["rebasing"] = "ok"
        except psycopg.Error as exc:
            rebasing.rollback()
            outcome["rebasing"] = type(exc).__name__
        thread.join(30)
        rebasing.close()
        assert outcome == {"stale": "ok", "rebasing": "ok"}
        with pg_util.schema_store(pg_url, pg_schema) as fresh:
            history = fresh.get("s")
            assert history is not None
            assert [m.content for m in history.history] == [
                "q1", "rebased", "from the stale writer",
            ]
    finally:
        for store in (a, b, c):
            store.close()


def _wait_until_blocked_by(dsn: str, holder_pid: int) -> None:
    """Wait until some backend waits on a lock held by ``holder_pid`` (hang guard: 60 s)."""
    deadline = time.monotonic() + 60
    with psycopg.connect(dsn, autocommit=True) as admin:
        while time.monotonic() < deadline:
            row = admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
                (holder_pid,),
            ).fetchone()
            if row and row[0]:
                return
            time.sleep(0.01)
    raise AssertionError("the stale writer never waited on the rebasing writer's row lock")


def _lease_held(admin: psycopg.Connection[Any], schema: str, session_id: str) -> bool:
    """Whether the session's row holds a lease (given back or never taken: NULL)."""
    row = admin.execute(
        f'SELECT lease_owner FROM "{schema}".chatflow_sessions WHERE session_id = %s',
        (session_id,),
    ).fetchone()
    return bool(row and row[0] is not None)


def test_a_turn_cancelled_while_taking_its_lease_never_leaves_it_held(
    pg_url: str, pg_schema: str
) -> None:
    """Cancelling a task inside ``async with session.lock`` (a timeout, a shutdown) must not
    leave the session's lease held: every other process would wait for it to expire."""
    import asyncio
    import random

    dsn = make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
    rng = random.Random(5)
    sid = "cancelled"

    async def scenario(admin: psycopg.Connection[Any]) -> int:
        # A lease far longer than the wait below: only a release can free it in time.
        store = pg_util.schema_store(pg_url, pg_schema, turn_lease_seconds=600.0)
        try:
            session = await store.aget_or_create(sid, BOT)
            for index in range(150):
                async def turn(index: int = index) -> None:
                    async with session.lock:
                        session.add_message(Message(role=Role.USER, content=f"q{index}"))

                task = asyncio.create_task(turn())
                await asyncio.sleep(rng.uniform(0, 0.002))
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                # A lease taken as the cancellation came is given back by a call still in
                # flight; it must go, not stay (a hang guard, not a timing).
                deadline = time.monotonic() + 10
                while _lease_held(admin, pg_schema, sid):
                    if time.monotonic() > deadline:
                        return index
                    await asyncio.sleep(0.01)
            return -1
        finally:
            await store.aclose()

    with psycopg.connect(dsn, autocommit=True) as admin:
        leaked_at = asyncio.run(scenario(admin))
    assert leaked_at == -1, f"the turn's lease stayed held after cancellation #{leaked_at + 1}"
