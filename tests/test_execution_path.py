"""One execution path: every statement the store sends runs on a SQLAlchemy ``Connection``.

So the engine's events see each one, errors are SQLAlchemy's own (its wrapping,
its invalidation of lost connections), and what a turn writes reads back
unchanged on every backend.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import suppress
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest
from chatflow_agent import Agent, Message, Role, ToolCall, ToolResult
from sqlalchemy import Engine, ExceptionContext, Table, event, make_url, select, text
from sqlalchemy import exc as sa_exc

from chatflow_sqlalchemy import (
    DatabaseUnavailableError,
    SQLAlchemySessionStore,
    SQLiteSessionStore,
)
from chatflow_sqlalchemy.models import ChatflowMessage, ChatflowProcessedMessage, ChatflowSession

from . import pg_util

if TYPE_CHECKING:
    import psycopg

Opener = Callable[[], SQLAlchemySessionStore]

TRIAGE = Agent(name="Triage", instructions="")
BILLING = Agent(name="Billing", instructions="")
NOW = datetime(2024, 5, 17, 14, 3, 9, 123456, tzinfo=timezone(timedelta(hours=2)))  # not UTC
CART = {"items": [1, 2.5, None, True], "note": "olá ✓"}


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


def test_every_statement_of_a_turn_is_seen_by_the_engines_events(store_opener: Opener) -> None:
    """The claim, the version check and the write reach ``before_cursor_execute``, and
    what they wrote reads back identically: messages, NULL, agent, JSON, UTC."""
    store = store_opener()
    sent: list[str] = []

    def record(*args: Any) -> None:  # (conn, cursor, statement, ...)
        sent.append(" ".join(args[2].split()))

    # Every Engine: native-async work runs on the AsyncEngine's own (sync) Engine.
    event.listen(Engine, "before_cursor_execute", record)
    try:
        before = datetime.now(timezone.utc)
        turn = _write_turns(store)
        assert store.record_processed_message("wamid-1")
        after = datetime.now(timezone.utc)
    finally:
        event.remove(Engine, "before_cursor_execute", record)
    assert any("UPDATE chatflow_sessions" in sql for sql in sent), sent
    assert any("INSERT INTO chatflow_messages" in sql for sql in sent), sent
    assert any("DELETE FROM chatflow_messages" in sql for sql in sent), sent
    assert any("INSERT INTO chatflow_processed_messages" in sql for sql in sent), sent

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


def test_sqlite_transactions_begin_where_the_events_see_it(tmp_path: Path) -> None:
    """SQLite's own BEGIN (IMMEDIATE for a write) is sent through the connection, not
    around it: a turn's write shows ``BEGIN IMMEDIATE`` before its statements."""
    store = SQLiteSessionStore(tmp_path / "begin.db")
    sent: list[str] = []
    session = store.get_or_create("chat", TRIAGE)

    def record(*args: Any) -> None:
        sent.append(" ".join(args[2].split()))

    event.listen(store.engine, "before_cursor_execute", record)
    try:
        session.add_message(Message(role=Role.USER, content="oi"))
    finally:
        event.remove(store.engine, "before_cursor_execute", record)
        store.close()
    begin = sent.index("BEGIN IMMEDIATE")
    assert any(sql.startswith("INSERT INTO chatflow_messages") for sql in sent[begin:]), sent


def test_stale_context_write_rebases(store_opener: Opener) -> None:
    """A context another store wrote behind: its write misses the CAS and rebases; it must not
    collide with the other writer's rows (seq) and fail."""
    mine = store_opener().get_or_create("s", TRIAGE)
    theirs = store_opener().get_or_create("s", TRIAGE)
    theirs.add_message(Message(role=Role.USER, content="theirs"))
    mine.add_message(Message(role=Role.USER, content="mine"))
    reloaded = store_opener().get("s")
    assert reloaded is not None and [m.content for m in reloaded.history] == ["theirs", "mine"]


def _psycopg() -> Any:
    """psycopg, imported by the PostgreSQL tests only (collection needs no extra)."""
    return pytest.importorskip("psycopg", reason="the postgres extra is not installed")


def _admin(pg_url: str) -> psycopg.Connection[Any]:
    """A psycopg connection outside the store's pool, to kill the store's backends."""
    dsn = make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
    return _psycopg().connect(dsn, autocommit=True)  # type: ignore[no-any-return]


def _terminate(admin: psycopg.Connection[Any], schema: str, pid: int | None = None) -> int:
    """pg_terminate_backend the store's backends (or only ``pid``), waiting for them to exit."""
    row = admin.execute(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 5000)) FROM pg_stat_activity"
        " WHERE application_name = %s AND (%s::int IS NULL OR pid = %s::int)",
        (schema, pid, pid),
    ).fetchone()
    return int(row[0]) if row else 0


def _call(store: SQLAlchemySessionStore, path: str) -> Callable[[str], object]:
    if path == "claim":  # one autocommit statement
        return store.record_processed_message
    session = store.get_or_create("s", TRIAGE)  # a turn's write
    return lambda text: session.add_message(Message(role=Role.USER, content=text))


@pytest.mark.postgres
@pytest.mark.parametrize("path", ["claim", "write"])
def test_killed_pool_fails_at_most_one_call(pg_url: str, pg_schema: str, path: str) -> None:
    """A restart kills every pooled connection: one driver-path call may fail with
    DatabaseUnavailableError, the next succeeds (as after a disconnect in Core)."""
    with pg_util.schema_store(pg_url, pg_schema) as store, _admin(pg_url) as admin:
        call = _call(store, path)
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
        call, armed = _call(store, path), [True]

        def kill_on_checkout(dbapi_connection: Any, record: Any, proxy: Any) -> None:
            if armed:
                armed.clear()
                _terminate(admin, pg_schema, dbapi_connection.info.backend_pid)

        event.listen(store.engine, "checkout", kill_on_checkout)
        with pytest.raises(DatabaseUnavailableError) as caught:
            call("lost")
        cause = caught.value.__cause__
        assert isinstance(cause, sa_exc.OperationalError) and cause.connection_invalidated
        assert isinstance(cause.orig, _psycopg().OperationalError)
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
def test_a_failed_statement_leaves_no_autocommit_connection(pg_url: str, pg_schema: str) -> None:
    """A failed autocommit statement must not put its connection back in autocommit:
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
            assert isinstance(caught.value.orig, _psycopg().errors.RaiseException)
            with pytest.raises(sa_exc.DBAPIError):  # the write's insert fails: nothing stands
                session.add_message(Message(role=Role.USER, content="evil inside"))
        with engine.connect() as conn:
            after = list(conn.execute(versions).scalars())
        assert after == before, "half a failed write transaction committed"
    finally:
        engine.dispose()


@pytest.mark.parametrize("call", ["claim", "is_processed", "version_check", "write"])
def test_a_connection_that_cannot_be_opened_is_database_unavailable(
    tmp_path: Path, call: str
) -> None:
    """A connection that cannot be opened is the store's clear error, whatever the call."""
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


@pytest.mark.postgres
def test_small_postgres_pool_is_not_starved(pg_url: str, pg_schema: str) -> None:
    with pg_util.schema_store(pg_url, pg_schema, pool_size=1, max_overflow=0,
                              pool_timeout=2) as store:
        assert store.record_processed_message("m")
        store.get_or_create("s", TRIAGE).add_message(Message(role=Role.USER, content="hi"))
        assert store.is_message_processed("m")




_REFUSE_EVIL_SQLITE = """
CREATE TRIGGER refuse_evil BEFORE INSERT ON chatflow_messages
WHEN NEW.message_json LIKE '%evil%'
BEGIN SELECT RAISE(ABORT, 'refused by the test'); END
"""


def test_a_failed_write_goes_through_sqlalchemys_error_handling(store_opener: Opener) -> None:
    """The server refuses a turn's insert: ``handle_error`` sees it, SQLAlchemy's exception
    (the driver's as ``.orig``) reaches the caller, and nothing of the turn is written."""
    store = store_opener()
    session = store.get_or_create("s", TRIAGE)
    session.add_message(Message(role=Role.USER, content="fine"))
    with store.engine.begin() as conn:
        if conn.dialect.name == "sqlite":
            conn.execute(text(_REFUSE_EVIL_SQLITE))
        else:
            conn.execute(text(_REFUSE_EVIL))
            conn.execute(text("CREATE TRIGGER refuse_evil BEFORE INSERT ON chatflow_messages "
                              "FOR EACH ROW EXECUTE FUNCTION refuse_evil()"))
    seen: list[ExceptionContext] = []

    def record(context: ExceptionContext) -> None:
        seen.append(context)

    event.listen(Engine, "handle_error", record)
    try:
        with pytest.raises(sa_exc.DBAPIError) as caught:
            session.add_message(Message(role=Role.USER, content="evil"))
    finally:
        event.remove(Engine, "handle_error", record)
    assert seen, "handle_error did not see the failed statement"
    assert seen[-1].sqlalchemy_exception is caught.value
    assert seen[-1].original_exception is caught.value.orig
    assert "refused by the test" in str(caught.value.orig)
    reloaded = store_opener().get("s")
    assert reloaded is not None and [m.content for m in reloaded.history] == ["fine"]


@pytest.mark.postgres
def test_a_missing_table_is_the_databases_error_not_an_unreachable_database(
    pg_url: str, pg_schema: str
) -> None:
    """Only a lost connection (SQLAlchemy's ``connection_invalidated``) or one that
    cannot be opened is ``DatabaseUnavailableError``; a statement the server refuses
    (``relation ... does not exist``, a phrase the store once matched in error texts)
    is SQLAlchemy's error, and the store keeps working once the cause is gone."""
    with pg_util.schema_store(pg_url, pg_schema) as store:
        store.get_or_create("s", TRIAGE).add_message(Message(role=Role.USER, content="hi"))
        with store.engine.begin() as conn:
            conn.execute(text("ALTER TABLE chatflow_messages RENAME TO kept_aside"))
        try:
            with pytest.raises(sa_exc.ProgrammingError) as caught:
                store.transcript("s")
            assert isinstance(caught.value.orig, _psycopg().errors.UndefinedTable)
            assert not caught.value.connection_invalidated
        finally:
            with store.engine.begin() as conn:
                conn.execute(text("ALTER TABLE kept_aside RENAME TO chatflow_messages"))
        assert [m.content for m in store.transcript("s")] == ["hi"]


def test_the_stores_engines_are_where_its_statements_run(store_opener: Opener) -> None:
    """``store.engines``: a listener on each sees the sync and the async API's statements
    (on PostgreSQL the async API runs on the AsyncEngine's facade, there before first use)."""
    store = store_opener()
    seen: list[tuple[int, str]] = []
    listeners = []
    for index, engine in enumerate(store.engines):
        def record(*args: Any, index: int = index) -> None:
            seen.append((index, " ".join(args[2].split())))

        event.listen(engine, "before_cursor_execute", record)
        listeners.append((engine, record))
    assert store.engines[0] is store.engine

    async def turn() -> None:
        ctx = await store.aget_or_create("s", TRIAGE)
        async with ctx.lock:
            ctx.add_message(Message(role=Role.USER, content="async"))

    try:
        store.get_or_create("s", TRIAGE).add_message(Message(role=Role.USER, content="sync"))
        asyncio.run(turn())
    finally:
        for engine, record in listeners:
            event.remove(engine, "before_cursor_execute", record)
    inserts = [index for index, sql in seen if "INSERT INTO chatflow_messages" in sql]
    assert len(inserts) == 2, seen
    assert len(store.engines) == (2 if store.runtime.native_async else 1)
    assert inserts == ([0, 1] if store.runtime.native_async else [0, 0])
    # The turn's lease: taken on the engine of the async API, given back by its write.
    leased = [index for index, sql in seen if "lease_owner" in sql]
    assert leased and set(leased) == {inserts[1]}, seen
    if store.runtime.native_async:  # the version check, the lease, the write (with the release)
        async_api = [sql for index, sql in seen if index == 1]
        assert len(async_api) == 3, async_api
        assert async_api[1].startswith("UPDATE chatflow_sessions SET lease_owner="), async_api
        assert "lease_owner=NULL" in async_api[2], async_api


def test_a_file_that_is_not_a_database_is_not_an_unreachable_database(tmp_path: Path) -> None:
    """Opening it fails with the driver's own error (a retry cannot help), not with
    ``DatabaseUnavailableError``, which says the database is out of reach."""
    path = tmp_path / "x.db"
    path.write_bytes(b"this is not a database " * 200)
    with pytest.raises(sa_exc.DatabaseError) as caught:
        SQLiteSessionStore(path)
    assert not isinstance(caught.value, DatabaseUnavailableError)
    assert "not a database" in str(caught.value)
