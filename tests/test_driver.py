"""The driver path (``driver.py``): per-turn statements run on the DBAPI cursor.

They must send what SQLAlchemy would send, raise what it would raise, recover
from lost connections as it would, and write values that read back unchanged;
a dialect without driver statements must still work through Core.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
import warnings
from collections.abc import Callable
from contextlib import suppress
from dataclasses import fields
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, cast

import psycopg
import pytest
from chatflow_agent import Agent, Message, Role, ToolCall, ToolResult
from sqlalchemy import Engine, Table, create_engine, event, make_url, select, text
from sqlalchemy import exc as sa_exc

from chatflow_sqlalchemy import (
    DatabaseUnavailableError,
    SessionDeletedError,
    SQLAlchemySessionStore,
    SQLiteSessionStore,
)
from chatflow_sqlalchemy import driver as driver_module
from chatflow_sqlalchemy import store as store_module
from chatflow_sqlalchemy.backends.sqlite import SQLiteDialectSupport
from chatflow_sqlalchemy.driver import DriverConnection, translate_driver_errors
from chatflow_sqlalchemy.models import ChatflowMessage, ChatflowProcessedMessage, ChatflowSession

from . import pg_util

Opener = Callable[[], SQLAlchemySessionStore]

TRIAGE = Agent(name="Triage", instructions="")
BILLING = Agent(name="Billing", instructions="")
NOW = datetime(2024, 5, 17, 14, 3, 9, 123456, tzinfo=timezone(timedelta(hours=2)))  # not UTC
CART = {"items": [1, 2.5, None, True], "note": "olá ✓"}
HOT = [field.name for field in fields(store_module._HotStatements)]


def _message_row(seq: int, content: str | None) -> dict[str, Any]:
    message_json = Message(role=Role.USER, content=content).model_dump_json()
    return {"session_id": "s", "seq": seq, "role": "user", "content": content,
            "message_json": message_json, "created_at": NOW}


def _cases(store: SQLAlchemySessionStore) -> dict[str, tuple[Any, Any]]:
    """Each hot statement's Core statement and parameters (a list runs as executemany).

    A hot statement added to the store without a case here fails its parity test.
    """
    cutoff, st = NOW - timedelta(hours=192), store_module
    bump = {"sid": "s", "expected": 0, "new_version": 1, "agent_name": "Billing", "now": NOW}
    return {
        "claim": (store._claim, {"message_id": "m-1", "processed_at": NOW, "cutoff": cutoff}),
        "version": (st._SELECT_VERSION, {"session_id": "s"}),
        "is_processed": (st._IS_PROCESSED, {"message_id": "m-1", "cutoff": cutoff}),
        "bump": (st._BUMP_SESSION, bump),
        "bump_metadata": (st._BUMP_SESSION_AND_METADATA, {**bump, "metadata": {"cart": CART}}),
        "delete_message": (st._DELETE_ONE_MESSAGE, [{"session_id": "s", "seq": s} for s in (1, 2)]),
        "insert_messages": (st._INSERT_MESSAGES, [_message_row(1, "oi"), _message_row(2, None)]),
        "fence": (st.FENCE_CLAIM, {"claim_id": "m-1", "claim_token": "t", "claim_now": NOW}),
    }


def _plain(value: Any) -> Any:
    """Comparable DBAPI parameters: psycopg's Json wrappers unwrapped, datetimes with zone."""
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(item) for item in value)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, datetime):
        return value, value.tzinfo
    if hasattr(value, "obj") and hasattr(value, "dumps"):
        return type(value).__name__, _plain(value.obj), value.dumps
    return value


@pytest.mark.parametrize("name", HOT)
def test_driver_statement_sends_what_sqlalchemy_sends(store_opener: Opener, name: str) -> None:
    """Same SQL and DBAPI parameters as SQLAlchemy executing the Core statement, same dialect."""
    store = store_opener()
    store.get_or_create("s", TRIAGE)
    statement, params = _cases(store)[name]
    sent: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, sql: str, parameters: Any, *_: Any) -> None:
        sent.append((sql, parameters))

    event.listen(store.engine, "before_cursor_execute", capture)
    try:
        with store.engine.connect() as conn:
            conn.execute(statement, params)
            conn.rollback()
    finally:
        event.remove(store.engine, "before_cursor_execute", capture)
    assert store._hot is not None and sent
    driver = getattr(store._hot, name)
    mine = ([driver.parameters(row) for row in params] if isinstance(params, list)
            else driver.parameters(params))
    assert driver.sql == sent[-1][0]
    assert _plain(mine) == _plain(sent[-1][1])


def _write_turns(store: SQLAlchemySessionStore) -> list[Message]:
    """A turn outside the lock, then a pruning one inside it (handoff, metadata); its messages."""
    session = store.get_or_create("chat", TRIAGE, metadata={"lang": "pt-BR"})
    session.add_message(Message(role=Role.USER, content="oi"))
    session.add_message(Message(role=Role.MODEL, content="olá"))
    session.max_turns = 1  # the next turn prunes the first one (its rows are deleted)
    turn = [
        Message(role=Role.USER, content="meu pedido?", timestamp=NOW),
        Message(role=Role.MODEL, tool_calls=[ToolCall(id="c1", name="lookup", args={"n": 7})]),
        Message(role=Role.TOOL, tool_results=[ToolResult(tool_call_id="c1", name="lookup",
                                                         content={"status": "paid"})]),
        Message(role=Role.MODEL, content="pago ✓"),
    ]

    async def run() -> None:
        async with session.lock:
            for message in turn:
                session.add_message(message)
            session.metadata["cart"] = CART
            session.set_active_agent(BILLING)

    asyncio.run(run())
    session.metadata["stage"] = "paid"  # outside the lock: a metadata-only write
    return turn


def _check_reloaded(store: SQLAlchemySessionStore, turn: list[Message]) -> None:
    store.set_agent_resolver({"Billing": BILLING}.get)
    reloaded = store.get("chat")
    assert reloaded is not None
    assert [m.model_dump_json() for m in reloaded.history] == [m.model_dump_json() for m in turn]
    assert reloaded.active_agent.name == "Billing"
    assert reloaded.metadata == {"lang": "pt-BR", "cart": CART, "stage": "paid"}
    assert store.is_message_processed("wamid-1")
    assert not store.record_processed_message("wamid-1")


def test_turn_round_trips_through_a_fresh_store(store_opener: Opener) -> None:
    """What the driver path writes reads back identically: messages, NULL, agent, JSON, UTC."""
    store = store_opener()
    assert store._hot is not None
    core_sql: list[str] = []
    event.listen(store.engine, "before_cursor_execute", lambda *args: core_sql.append(args[2]))
    before = datetime.now(timezone.utc)
    turn = _write_turns(store)
    assert store.record_processed_message("wamid-1")
    after = datetime.now(timezone.utc)
    hot = store._hot
    driver_sql = {hot.claim.sql, hot.bump.sql, hot.bump_metadata.sql, hot.insert_messages.sql}
    assert not driver_sql & set(core_sql), "the writes went through Core, not the driver"

    fresh = store_opener()
    _check_reloaded(fresh, turn)
    sessions, messages, processed = (cast(Table, model.__table__) for model in (
        ChatflowSession, ChatflowMessage, ChatflowProcessedMessage))
    with fresh.engine.connect() as conn:
        row = conn.execute(select(sessions)).one()
        rows = conn.execute(select(messages).order_by(messages.c.seq)).all()
        claimed = conn.execute(select(processed.c.processed_at)).scalar_one()
    assert row.metadata_json == {"lang": "pt-BR", "cart": CART, "stage": "paid"}
    assert [r.seq for r in rows] == [3, 4, 5, 6]  # the pruned turn's rows are gone
    assert [r.content for r in rows] == [m.content for m in turn]  # None stays NULL
    for stamp in [row.created_at, row.updated_at, claimed, *(r.created_at for r in rows)]:
        assert stamp.utcoffset() == timedelta(0)
        assert before <= stamp <= after


def test_stale_context_write_rebases(store_opener: Opener) -> None:
    """A context another store wrote behind: its write misses the CAS and rebases; it must not
    collide with the other writer's rows (seq) and fail."""
    mine = store_opener().get_or_create("s", TRIAGE)
    theirs = store_opener().get_or_create("s", TRIAGE)
    theirs.add_message(Message(role=Role.USER, content="theirs"))
    mine.add_message(Message(role=Role.USER, content="mine"))
    reloaded = store_opener().get("s")
    assert reloaded is not None and [m.content for m in reloaded.history] == ["theirs", "mine"]


def test_integrity_error_is_the_one_sqlalchemy_raises(store_opener: Opener) -> None:
    """A constraint violation on the driver: SQLAlchemy's IntegrityError, ``.orig`` the driver's."""
    store = store_opener()
    store.get_or_create("s", TRIAGE)
    assert store._hot is not None
    insert, rows = store._hot.insert_messages, [_message_row(1, "oi")]
    with store.engine.begin() as conn:
        conn.execute(store_module._INSERT_MESSAGES, rows)
    with pytest.raises(sa_exc.DBAPIError) as core, store.engine.begin() as conn:
        conn.execute(store_module._INSERT_MESSAGES, rows)
    connection = DriverConnection.checkout(store.engine)
    try:
        with (
            pytest.raises(sa_exc.DBAPIError) as driver,
            translate_driver_errors(connection, insert.sql),
        ):
            insert.executemany(connection.cursor(), rows)
    finally:
        connection.dbapi_connection.rollback()
        connection.close()
    assert type(driver.value) is type(core.value) is sa_exc.IntegrityError
    assert type(driver.value.orig) is type(core.value.orig)
    assert isinstance(driver.value.orig, store.engine.dialect.loaded_dbapi.IntegrityError)
    assert driver.value.__cause__ is driver.value.orig
    assert driver.value.statement == insert.sql and not driver.value.connection_invalidated
    reloaded = store_opener().get("s")  # one row, and the store's connections are still good
    assert reloaded is not None and [m.content for m in reloaded.history] == ["oi"]


def _admin(pg_url: str) -> psycopg.Connection[Any]:
    """A psycopg connection outside the store's pool, to kill the store's backends."""
    dsn = make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
    return psycopg.connect(dsn, autocommit=True)


def _terminate(admin: psycopg.Connection[Any], schema: str, pid: int | None = None) -> int:
    """pg_terminate_backend the store's backends (or only ``pid``), waiting for them to exit."""
    row = admin.execute(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 5000)) FROM pg_stat_activity"
        " WHERE application_name = %s AND (%s::int IS NULL OR pid = %s::int)",
        (schema, pid, pid),
    ).fetchone()
    return int(row[0]) if row else 0


def _driver_call(store: SQLAlchemySessionStore, path: str) -> Callable[[str], object]:
    if path == "claim":  # one autocommit statement on a raw pooled connection
        return store.record_processed_message
    session = store.get_or_create("s", TRIAGE)  # a write transaction of driver statements
    return lambda text: session.add_message(Message(role=Role.USER, content=text))


@pytest.mark.postgres
@pytest.mark.parametrize("path", ["claim", "write"])
def test_killed_pool_fails_at_most_one_driver_call(pg_url: str, pg_schema: str, path: str) -> None:
    """A restart kills every pooled connection: one driver-path call may fail with
    DatabaseUnavailableError, the next succeeds (as after a disconnect in Core)."""
    with pg_util.schema_store(pg_url, pg_schema) as store, _admin(pg_url) as admin:
        call = _driver_call(store, path)
        held = [store.engine.connect() for _ in range(3)]  # three pooled connections
        for conn in held:
            conn.close()
        assert _terminate(admin, pg_schema) >= 3
        with suppress(DatabaseUnavailableError):
            call("first")
        call("second")


@pytest.mark.postgres
@pytest.mark.parametrize("path", ["claim", "write"])
def test_connection_lost_mid_call_is_invalidated(pg_url: str, pg_schema: str, path: str) -> None:
    """Backend killed between checkout and statement: DatabaseUnavailableError from an
    invalidated OperationalError, nothing written, the next call on a new connection."""
    with pg_util.schema_store(pg_url, pg_schema) as store, _admin(pg_url) as admin:
        call, armed = _driver_call(store, path), [True]

        def kill_on_checkout(dbapi_connection: Any, record: Any, proxy: Any) -> None:
            if armed:
                armed.clear()
                _terminate(admin, pg_schema, dbapi_connection.info.backend_pid)

        event.listen(store.engine, "checkout", kill_on_checkout)
        with pytest.raises(DatabaseUnavailableError) as caught:
            call("lost")
        cause = caught.value.__cause__
        assert isinstance(cause, sa_exc.OperationalError) and cause.connection_invalidated
        assert isinstance(cause.orig, psycopg.OperationalError)
        call("kept")
    with pg_util.schema_store(pg_url, pg_schema) as fresh:
        if path == "claim":
            assert not fresh.is_message_processed("lost") and fresh.is_message_processed("kept")
        else:
            assert [m.content for m in fresh.get("s").history] == ["kept"]  # type: ignore[union-attr]


_REFUSE_EVIL = """
CREATE FUNCTION refuse_evil() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF to_jsonb(NEW)::text LIKE '%evil%' THEN
        RAISE EXCEPTION 'refused by the test';
    END IF;
    RETURN NEW;
END $$
"""


@pytest.mark.postgres
def test_driver_error_leaves_no_autocommit_connection(pg_url: str, pg_schema: str) -> None:
    """A failed autocommit driver statement must not put its connection back in autocommit:
    the next write transaction on it must still roll back as a whole."""
    engine = pg_util.schema_engine(pg_url, pg_schema)
    versions = select(cast(Table, ChatflowSession.__table__).c.version)
    try:
        with pg_util.schema_store(pg_url, pg_schema, pool_size=1, max_overflow=0) as store:
            session = store.get_or_create("s", TRIAGE)
            with engine.connect() as conn:
                before = list(conn.execute(versions).scalars())
            with engine.begin() as conn:  # the server refuses rows marked "evil"
                conn.execute(text(_REFUSE_EVIL))
                for table in ("chatflow_processed_messages", "chatflow_messages"):
                    conn.execute(text(
                        f"CREATE TRIGGER refuse_evil BEFORE INSERT ON {table} "
                        "FOR EACH ROW EXECUTE FUNCTION refuse_evil()"
                    ))
            with pytest.raises(sa_exc.DBAPIError) as caught:
                store.record_processed_message("wamid-evil")
            assert isinstance(caught.value.orig, psycopg.errors.RaiseException)
            with pytest.raises(sa_exc.DBAPIError):  # the CAS bump is sent, then the insert fails
                session.add_message(Message(role=Role.USER, content="evil inside"))
        with engine.connect() as conn:
            after = list(conn.execute(versions).scalars())
        assert after == before, "half a failed write transaction committed"
    finally:
        engine.dispose()


class _CoreOnlySupport(SQLiteDialectSupport):
    driver_statements = False


class _CoreOnlySQLiteStore(SQLiteSessionStore):
    dialect_support = _CoreOnlySupport()


def test_dialect_without_driver_statements_runs_through_core(tmp_path: Path) -> None:
    """driver_statements=False: no hot statements; turn, claim and check all run in Core."""
    core_sql: list[str] = []
    with _CoreOnlySQLiteStore(tmp_path / "x.db") as store:
        assert store._hot is None
        event.listen(store.engine, "before_cursor_execute", lambda *args: core_sql.append(args[2]))
        turn = _write_turns(store)
        assert store.record_processed_message("wamid-1")
        assert store.is_message_processed("wamid-1")
    assert any(sql.startswith("UPDATE chatflow_sessions") for sql in core_sql)
    assert any(sql.startswith("INSERT INTO chatflow_processed_messages") for sql in core_sql)
    with SQLiteSessionStore(tmp_path / "x.db") as fresh:  # a driver-path store reads it back
        _check_reloaded(fresh, turn)


@pytest.mark.parametrize("call", ["claim", "is_processed", "version_check", "write"])
def test_a_connection_that_cannot_be_opened_is_database_unavailable(
    tmp_path: Path, call: str
) -> None:
    """The driver path opens connections itself; a failure there is the store's clear error."""
    folder = tmp_path / "gone"
    folder.mkdir()
    store = SQLiteSessionStore(folder / "x.db")
    try:
        ctx = store.get_or_create("s", TRIAGE)
        ctx.add_message(Message(role=Role.USER, content="before"))
        store.engine.dispose()  # nothing pooled: the next call opens a connection
        for child in folder.iterdir():
            child.unlink()
        folder.rmdir()
        calls: dict[str, Callable[[], object]] = {
            "claim": lambda: store.record_processed_message("m"),
            "is_processed": lambda: store.is_message_processed("m"),
            "version_check": lambda: store.get_or_create("s", TRIAGE),
            "write": lambda: ctx.add_message(Message(role=Role.USER, content="after")),
        }
        with pytest.raises(DatabaseUnavailableError, match="unable to open database"):
            calls[call]()
    finally:
        store.close()


def _count_checkouts(engine: Engine) -> list[object]:
    """Every pool checkout on ``engine`` from now on appends to the returned list."""
    checkouts: list[object] = []
    event.listen(engine, "checkout", lambda dbapi_conn, *_: checkouts.append(dbapi_conn))
    return checkouts


def test_back_to_back_units_reuse_a_kept_connection(store_opener: Opener) -> None:
    """Claims and writes in quick succession skip the pool: no checkout after the first."""
    store = store_opener()
    session = store.get_or_create("s", TRIAGE)
    store.record_processed_message("warm-up")
    checkouts = _count_checkouts(store.engine)
    for index in range(5):
        assert store.record_processed_message(f"m-{index}")
        session.add_message(Message(role=Role.USER, content=f"turn {index}"))
        assert store.is_message_processed(f"m-{index}")
    assert checkouts == []
    assert [m.content for m in store_opener().get("s").history] == [  # type: ignore[union-attr]
        f"turn {index}" for index in range(5)
    ]


class SteppedClock:
    """Stands in for the ``time`` module of ``dialect``/``driver``: time moves only when told."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now


def test_a_connection_idle_past_the_ping_window_goes_back_through_the_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After IDLE_PING_SECONDS unused, a kept connection is checked out again (pings apply).

    The idle time is a stepped clock, not a sleep: a loaded machine cannot make "soon" late.
    """
    from chatflow_sqlalchemy import dialect

    clock = SteppedClock()
    monkeypatch.setattr(dialect, "time", clock)
    monkeypatch.setattr(driver_module, "time", clock)
    with SQLiteSessionStore(tmp_path / "x.db") as store:
        store.record_processed_message("warm-up")
        checkouts = _count_checkouts(store.engine)
        store.record_processed_message("soon")
        assert checkouts == []
        clock.now += 2 * dialect.IDLE_PING_SECONDS
        store.record_processed_message("later")
        assert len(checkouts) == 1


def test_kept_connections_of_a_disposed_pool_are_not_reused(tmp_path: Path) -> None:
    """engine.dispose() replaces the pool: what was kept from the old one is retired."""
    with SQLiteSessionStore(tmp_path / "x.db") as store:
        store.record_processed_message("warm-up")
        (old,) = [kept.dbapi_connection for kept in store._kept._kept]
        store.engine.dispose()
        checkouts = _count_checkouts(store.engine)
        store.record_processed_message("after")
        assert len(checkouts) == 1 and checkouts[0] is not old


def test_a_failed_unit_does_not_keep_its_connection(store_opener: Opener) -> None:
    """The write that found its session deleted hands its connection back to the pool."""
    store, other = store_opener(), store_opener()
    session = store.get_or_create("s", TRIAGE)
    store.record_processed_message("warm-up")
    assert len(store._kept._kept) == 1
    assert other.delete("s")
    with pytest.raises(SessionDeletedError):
        session.add_message(Message(role=Role.USER, content="too late"))
    assert store._kept._kept == []


def test_close_and_collection_return_kept_connections_to_the_pool(tmp_path: Path) -> None:
    """Nothing a store kept aside stays checked out once it is closed or dropped."""
    store = SQLiteSessionStore(tmp_path / "x.db")
    engine = store.engine
    store.get_or_create("s", TRIAGE).add_message(Message(role=Role.USER, content="hi"))
    assert engine.pool.checkedout() >= 1  # type: ignore[attr-defined]
    store.close()
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    dropped = SQLiteSessionStore(tmp_path / "x.db")
    engine = dropped.engine
    dropped.record_processed_message("m")
    assert engine.pool.checkedout() >= 1  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # SQLAlchemy warns about collected checkouts
        del dropped
        gc.collect()
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    engine.dispose()


def test_a_callers_engine_keeps_no_connection_aside(tmp_path: Path) -> None:
    """Its pool settings (pre-ping, recycle) are the caller's: every unit checks out."""
    engine = create_engine(f"sqlite:///{tmp_path / 'x.db'}")
    try:
        with SQLAlchemySessionStore(engine=engine) as store:
            store.record_processed_message("warm-up")
            assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
            checkouts = _count_checkouts(engine)
            store.get_or_create("s", TRIAGE).add_message(Message(role=Role.USER, content="hi"))
            store.record_processed_message("again")
            assert len(checkouts) >= 2
            assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    finally:
        engine.dispose()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_never_uses_the_parents_kept_connections(tmp_path: Path) -> None:
    """The child must not run statements on (or close) connections the parent still uses."""
    with SQLiteSessionStore(tmp_path / "x.db") as store:
        store.record_processed_message("parent")
        (parents,) = store._kept._kept
        pid = os.fork()
        if pid == 0:  # the child: report through the exit code only
            inherited = any(kept is parents for kept in driver_module._INHERITED)
            fine = not store._kept._kept and inherited
            fine = fine and store.record_processed_message("child")
            os._exit(0 if fine else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert store.is_message_processed("child")
        assert store._kept._kept[0] is parents


@pytest.mark.parametrize(
    "value",
    [
        NOW,
        NOW.replace(microsecond=0),
        datetime(999, 1, 2, 23, 4, 5, 6, tzinfo=timezone(timedelta(hours=-3))),  # next day in UTC
        datetime(2024, 12, 31, 23, 59, 59, 999999, tzinfo=timezone.utc),
        datetime.now(timezone.utc),
    ],
)
def test_sqlite_timestamps_are_the_text_sqlalchemy_writes(value: datetime) -> None:
    """UTCDateTime's one-step SQLite processor equals process_bind_param then DATETIME."""
    from sqlalchemy.dialects import sqlite
    from sqlalchemy.types import TypeDecorator

    from chatflow_sqlalchemy.models import UTCDateTime

    dialect = sqlite.dialect()
    column_type = UTCDateTime().dialect_impl(dialect)
    fast = column_type.bind_processor(dialect)
    composed = TypeDecorator.bind_processor(column_type, dialect)  # SQLAlchemy's own chain
    assert fast is not None and composed is not None
    assert fast(value) == composed(value)
    assert fast(None) is None
    with pytest.raises(ValueError, match="timezone-aware"):
        fast(value.replace(tzinfo=None))


def test_kept_connections_never_starve_a_small_pool(tmp_path: Path) -> None:
    """pool_size=1, no overflow: nothing is kept, every unit still gets the connection."""
    engine = create_engine(
        f"sqlite:///{tmp_path / 'x.db'}", pool_size=1, max_overflow=0, pool_timeout=2
    )
    try:
        with SQLAlchemySessionStore(engine=engine) as store:
            assert store.record_processed_message("m")
            session = store.get_or_create("s", TRIAGE)  # a Core read after a driver unit
            session.add_message(Message(role=Role.USER, content="hi"))
            assert store._kept._kept == []
            assert [m.content for m in store.get("s").history] == ["hi"]  # type: ignore[union-attr]
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_small_postgres_pool_is_not_starved(pg_url: str, pg_schema: str) -> None:
    with pg_util.schema_store(pg_url, pg_schema, pool_size=1, max_overflow=0,
                              pool_timeout=2) as store:
        assert store.record_processed_message("m")
        store.get_or_create("s", TRIAGE).add_message(Message(role=Role.USER, content="hi"))
        assert store.is_message_processed("m")


@pytest.mark.postgres
def test_a_store_asked_for_pool_pre_ping_keeps_nothing(pg_url: str, pg_schema: str) -> None:
    """pool_pre_ping asks for a ping on every use: no connection skips the checkout."""
    with pg_util.schema_store(pg_url, pg_schema, pool_pre_ping=True) as store:
        store.record_processed_message("warm-up")
        checkouts = _count_checkouts(store.engine)
        store.record_processed_message("again")
        assert len(checkouts) == 1
        assert store.engine.pool.checkedout() == 0


@pytest.mark.postgres
def test_kept_connections_go_back_before_pool_recycle(
    pg_url: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection opened ``pool_recycle`` ago is not reused from aside: the pool recycles it.

    Its age counts from when it was opened, not from its last checkout.
    """
    clock = SteppedClock()
    monkeypatch.setattr(driver_module, "time", clock)
    with pg_util.schema_store(pg_url, pg_schema, pool_recycle=5) as store:
        store.record_processed_message("warm-up")  # opened now
        checkouts = _count_checkouts(store.engine)
        clock.now += 1.5  # idle: back through the pool, out again (1.5 s old)
        store.record_processed_message("after a pause")
        assert len(checkouts) == 1
        for step in range(7):  # used every half second, never idle: 5 s old at the end
            clock.now += 0.5
            store.record_processed_message(f"m-{step}")
        assert len(checkouts) == 2  # out again once 5 s old (the pool's clock recycles it)


@pytest.mark.postgres
def test_a_lost_connection_found_by_core_retires_kept_ones(pg_url: str, pg_schema: str) -> None:
    """Core finds the server gone: the next driver unit must not reuse a dead kept one."""
    with pg_util.schema_store(pg_url, pg_schema) as store, _admin(pg_url) as admin:
        held = [store.engine.connect() for _ in range(3)]
        for conn in held:
            conn.close()
        store.record_processed_message("warm-up")
        assert store._kept._kept
        assert _terminate(admin, pg_schema) >= 3
        with suppress(DatabaseUnavailableError):
            store.purge_processed_messages()  # Core: fails once, invalidates
        assert store.record_processed_message("after")  # a driver unit, on a live connection
