"""What the MariaDB backend adds beyond the conformance suite.

Each test that needs the server gets an empty database of its own
(``mariadb_database``, see conftest.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Role, Runner
from chatflow_sqlalchemy import (
    DatabaseUnavailableError,
    SQLAlchemySessionStore,
    migrate,
    open_store,
)
from chatflow_sqlalchemy.cli import main
from chatflow_sqlalchemy.models import ChatflowProcessedMessage, ChatflowSession, utcnow
from chatflow_sqlalchemy.testing.suite import ScriptedEngine
from sqlalchemy import URL, create_engine, event, inspect, select, text

from chatflow_sqlalchemy_mariadb import MariaDBSessionStore
from chatflow_sqlalchemy_mariadb.dialect import lock_name
from chatflow_sqlalchemy_mariadb.schema import INFO_TABLE, VERSION_TABLE

pytestmark = pytest.mark.mariadb

CORE_TABLES = {"chatflow_sessions", "chatflow_messages", "chatflow_processed_messages"}
BOT = Agent(name="Bot", instructions="")


def plain(url: URL) -> str:
    return url.render_as_string(hide_password=False)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --------------------------------------------------------------------------- no server needed


def test_backends_lists_mysql_and_mariadb(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "backends")
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    for name in ("mysql", "mariadb"):
        assert "chatflow-sqlalchemy-mariadb" in rows[name]
        assert "chatflow_sqlalchemy_mariadb.store.MariaDBSessionStore" in rows[name]
    assert "sqlite" in rows and "postgresql" in rows


def test_plugin_chain_applies_to_mysql_only() -> None:
    assert [c.name for c in migrate.chains_for("mysql")] == ["core", "mariadb"]
    assert [c.name for c in migrate.chains_for("mariadb")] == ["core", "mariadb"]
    assert [c.name for c in migrate.chains_for("sqlite")] == ["core"]
    chain = migrate.find_chain("mariadb")
    assert chain.version_table == VERSION_TABLE
    assert chain.distribution.startswith("chatflow-sqlalchemy-mariadb")


def test_unreachable_server_is_one_clear_error() -> None:
    with pytest.raises(DatabaseUnavailableError) as info:
        open_store("mysql+pymysql://bot:sekret-pw@127.0.0.1:1/chat")
    assert "127.0.0.1:1" in str(info.value)
    assert "sekret-pw" not in str(info.value)


def test_purge_statement_is_a_bounded_delete() -> None:
    from sqlalchemy.dialects import mysql

    from chatflow_sqlalchemy_mariadb.dialect import MariaDBDialectSupport

    table: Any = ChatflowProcessedMessage.__table__
    sql = str(MariaDBDialectSupport().purge_processed(table, 1000).compile(dialect=mysql.dialect()))
    assert "LIMIT 1000" in sql and " IN " not in sql


@pytest.mark.parametrize(
    ("mariadb", "version", "skips"),
    [
        (True, (10, 5, 22), False),
        (True, (10, 6, 0), True),
        (True, (11, 4, 2), True),
        (False, (5, 7, 44), False),
        (False, (8, 0, 0), False),
        (False, (8, 0, 1), True),
        (True, None, True),  # not connected (offline SQL): assumed recent
    ],
)
def test_batch_jobs_skip_locked_rows_only_where_the_server_can(
    mariadb: bool, version: tuple[int, ...] | None, skips: bool
) -> None:
    from sqlalchemy.dialects import mysql

    from chatflow_sqlalchemy_mariadb.dialect import skips_locked_rows

    dialect: Any = mysql.dialect()
    dialect.is_mariadb = mariadb
    dialect.server_version_info = version
    assert skips_locked_rows(dialect) is skips
    sessions: Any = ChatflowSessionTable
    sql = str(
        select(sessions.c.session_id)
        .with_for_update(skip_locked=skips_locked_rows(dialect))
        .compile(dialect=dialect)
    )
    assert sql.endswith("FOR UPDATE SKIP LOCKED") is skips and sql.endswith(("UPDATE", "LOCKED"))


ChatflowSessionTable = ChatflowSession.__table__


# --------------------------------------------------------------------------- with a server


def test_sweep_locks_its_batch_as_this_server_allows(mariadb_database: URL) -> None:
    from chatflow_sqlalchemy_mariadb.dialect import MariaDBDialectSupport

    engine = create_engine(mariadb_database)
    try:
        with engine.connect() as conn:
            sessions: Any = ChatflowSessionTable
            query = MariaDBDialectSupport().lock_batch(select(sessions.c.session_id), conn)
            sql = str(query.compile(dialect=conn.dialect))
            version = conn.dialect.server_version_info
            assert ("SKIP LOCKED" in sql) is (tuple(version or ()) >= (10, 6)), (version, sql)
    finally:
        engine.dispose()


def test_every_url_form_opens_the_backend(mariadb_database: URL) -> None:
    for driver in ("mysql", "mysql+pymysql", "mariadb", "mariadb+pymysql"):
        store = open_store(mariadb_database.set(drivername=driver))
        try:
            assert isinstance(store, MariaDBSessionStore)
            assert store.engine.dialect.driver == "pymysql"
            assert migrate.drift(store.engine) == [], driver
        finally:
            store.close()


def test_schema_is_both_chains_at_head(mariadb_database: URL) -> None:
    with MariaDBSessionStore(mariadb_database) as store:
        statuses = {s.chain.name: s for s in migrate.chain_status(store.engine)}
        assert set(statuses) == {"core", "mariadb"}
        assert all(s.at_head for s in statuses.values())
        names = set(inspect(store.engine).get_table_names())
        assert names >= CORE_TABLES | {INFO_TABLE, VERSION_TABLE, migrate.VERSION_TABLE}
        assert "alembic_version" not in names
        info = store.backend_info()
        assert info["id_collation"] == "utf8mb4_nopad_bin"
        assert "MariaDB" in info["server_version"] or info["server_version"][0].isdigit()
        with store.engine.connect() as conn:
            collation = conn.execute(
                text(
                    "SELECT TABLE_COLLATION FROM information_schema.TABLES "
                    "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'chatflow_sessions'"
                )
            ).scalar()
        assert collation == info["id_collation"]


def test_db_commands_run_both_chains(
    mariadb_database: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    url = plain(mariadb_database)
    code, out, err = run_cli(capsys, "--url", url, "db", "upgrade")
    assert code == 0, err
    assert f"upgraded from none (empty database) to {migrate.head_revision()} (head)" in out
    assert "plugin mariadb: upgraded from none to 0001 (head)" in out
    code, out, _ = run_cli(capsys, "--url", url, "db", "check")
    assert code == 0, out
    assert "plugin mariadb at 0001 (head)" in out
    code, out, _ = run_cli(capsys, "--url", url, "db", "current")
    assert "plugin mariadb (chatflow-sqlalchemy-mariadb" in out and "0001 (head)" in out
    code, out, _ = run_cli(capsys, "--url", url, "db", "downgrade", "base", "--yes")
    assert code == 0, out
    engine = migrate.open_engine(url)
    try:
        assert not set(inspect(engine).get_table_names()) & (CORE_TABLES | {INFO_TABLE})
        migrate.upgrade(engine)
        assert migrate.drift(engine) == []
        migrate.downgrade(engine, migrate.BASELINE_REVISION)
        migrate.upgrade(engine)
        assert migrate.drift(engine) == []
    finally:
        engine.dispose()


def test_ids_compare_exactly(mariadb_database: URL) -> None:
    with MariaDBSessionStore(mariadb_database) as store:
        ids = ["Abc", "abc", "abc ", "ABC"]
        for sid in ids:
            store.get_or_create(sid, BOT).add_message(Message(role=Role.USER, content=repr(sid)))
        assert sorted(store.list_sessions()) == sorted(ids)
        for sid in ids:
            ctx = store.get(sid)
            assert ctx is not None and ctx.history[0].content == repr(sid)
        assert store.record_processed_message("wamid.HBgA") is True
        assert store.record_processed_message("wamid.hbga") is True
        assert store.record_processed_message("wamid.HBgA ") is True
        assert store.record_processed_message("wamid.HBgA") is False


def test_long_and_unicode_messages_round_trip(mariadb_database: URL) -> None:
    big = "🎉 olá, 你好 — " + "x" * 300_000  # beyond MySQL's 64 KiB TEXT
    with MariaDBSessionStore(mariadb_database) as store:
        ctx = store.get_or_create("unicode", BOT, metadata={"name": "José 🎉"})
        ctx.add_message(Message(role=Role.USER, content=big))
    with MariaDBSessionStore(mariadb_database) as fresh:
        again = fresh.get("unicode")
        assert again is not None
        assert again.history[0].content == big
        assert again.metadata == {"name": "José 🎉"}


def test_purge_deletes_every_expired_id_in_batches(mariadb_database: URL) -> None:
    with MariaDBSessionStore(mariadb_database, dedup_ttl_hours=1) as store:
        old = utcnow() - timedelta(hours=2)
        rows = [{"message_id": f"old-{n}", "processed_at": old} for n in range(2500)]
        with store.engine.begin() as conn:
            conn.execute(ChatflowProcessedMessage.__table__.insert(), rows)
        store.record_processed_message("fresh")
        assert store.purge_processed_messages() == 2500
        assert store.is_message_processed("fresh")
        assert store.purge_processed_messages() == 0


def test_turn_lock_is_a_named_lock_held_for_the_whole_turn(mariadb_database: URL) -> None:
    database = mariadb_database.database
    name = lock_name("turn", database, "locked")
    probe = create_engine(mariadb_database)

    def holder() -> Any:
        with probe.connect() as conn:
            return conn.execute(text("SELECT IS_USED_LOCK(:n)"), {"n": name}).scalar()

    async def scenario(store: Any, other: Any) -> None:
        ctx = store.get_or_create("locked", BOT)
        async with ctx.lock:
            assert holder() is not None, "the turn holds the named lock"
            assert (await other.turn_locks.try_acquire("locked"))[0] is False
            assert (await other.turn_locks.try_acquire("unlocked"))[0] is True
            await other.turn_locks.release("unlocked")
            ctx.add_message(Message(role=Role.USER, content="in turn"))
        assert holder() is None, "the lock is released when the turn ends"
        assert (await other.turn_locks.try_acquire("locked"))[0] is True
        await other.turn_locks.release("locked")

    try:
        with MariaDBSessionStore(mariadb_database) as store, MariaDBSessionStore(
            mariadb_database
        ) as other:
            asyncio.run(scenario(store, other))
    finally:
        probe.dispose()


def test_a_turn_cancelled_while_taking_its_lock_never_leaves_it_held(
    mariadb_database: URL,
) -> None:
    """A timeout that cancels ``async with session.lock`` while the worker thread is still
    taking the named lock: the thread takes it for nobody, and must give it back."""
    name = lock_name("turn", mariadb_database.database, "cancelled")
    probe = create_engine(mariadb_database)

    def holder() -> Any:
        with probe.connect() as conn:
            return conn.execute(text("SELECT IS_USED_LOCK(:n)"), {"n": name}).scalar()

    async def scenario(store: Any) -> None:
        locks = store.turn_locks
        taking = locks._try_acquire
        took = threading.Event()

        def slow_take(session_id: str) -> bool:  # the real GET_LOCK, after the caller left
            time.sleep(0.5)
            try:
                return bool(taking(session_id))
            finally:
                took.set()

        locks._try_acquire = slow_take
        ctx = store.get_or_create("cancelled", BOT)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(ctx.lock.acquire(), 0.1)
        locks._try_acquire = taking
        assert await asyncio.to_thread(took.wait, 30), "the worker thread never took the lock"
        deadline = time.monotonic() + 30  # given back right after it was taken
        while holder() is not None:
            assert time.monotonic() < deadline, "the lock taken for a cancelled caller is held"
            await asyncio.sleep(0.05)
        async with ctx.lock:  # the next turn gets it
            assert holder() is not None

    try:
        with MariaDBSessionStore(mariadb_database) as store:
            asyncio.run(scenario(store))
    finally:
        probe.dispose()


def test_releases_cancelled_while_queued_still_release(mariadb_database: URL) -> None:
    """A shutdown cancels turns while they give their locks back: the ``RELEASE_LOCK``
    of each still runs (the lock connection lives on, so a skipped one stays held)."""
    sessions = [f"s{i}" for i in range(6)]
    names = [lock_name("turn", mariadb_database.database, sid) for sid in sessions]
    probe = create_engine(mariadb_database)

    def held() -> list[str]:
        with probe.connect() as conn:
            return [n for n in names
                    if conn.execute(text("SELECT IS_USED_LOCK(:n)"), {"n": n}).scalar()]

    async def scenario(store: Any) -> None:
        locks = store.turn_locks
        for sid in sessions:
            assert (await locks.try_acquire(sid))[0]
        releases = [asyncio.ensure_future(locks.release(sid)) for sid in sessions]
        await asyncio.sleep(0)
        for release in releases:
            release.cancel()
        await asyncio.gather(*releases, return_exceptions=True)
        deadline = time.monotonic() + 30
        while await asyncio.to_thread(held):
            assert time.monotonic() < deadline, "a cancelled release left its lock held"
            await asyncio.sleep(0.05)

    try:
        with MariaDBSessionStore(mariadb_database) as store:
            asyncio.run(scenario(store))
    finally:
        probe.dispose()


def test_turn_lock_statements_are_seen_by_the_lock_engines_events(mariadb_database: URL) -> None:
    """Issue 12: ``GET_LOCK`` / ``RELEASE_LOCK`` go through SQLAlchemy, where listeners see them."""
    seen: list[tuple[str, str]] = []

    def before(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(("before", statement))

    def after(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(("after", statement))

    with MariaDBSessionStore(mariadb_database) as store:
        locks = store.turn_locks
        assert locks is not None
        engines = locks.engines
        assert engines and store.engine not in engines, "the locks run on an engine of their own"
        for engine in engines:
            event.listen(engine, "before_cursor_execute", before)
            event.listen(engine, "after_cursor_execute", after)
        runner = Runner(starting_agent=BOT, session_store=store, engine=ScriptedEngine())
        reply = asyncio.run(runner.run_async("observed", "hello"))
        assert reply.content == "Bot re: hello"
    for hook in ("before", "after"):
        statements = [s for h, s in seen if h == hook]
        assert any("GET_LOCK" in s for s in statements), (hook, seen)
        assert any("RELEASE_LOCK" in s for s in statements), (hook, seen)


def test_the_lock_engine_echoes_like_the_store(mariadb_database: URL) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("sqlalchemy.engine.Engine")
    logger.addHandler(handler)  # so echo adds no stdout handler of its own
    try:
        with MariaDBSessionStore(mariadb_database, echo=True) as store:
            locks = store.turn_locks
            assert locks is not None and all(e.echo is True for e in locks.engines)
            runner = Runner(starting_agent=BOT, session_store=store, engine=ScriptedEngine())
            asyncio.run(runner.run_async("echoed", "hello"))
    finally:
        logger.removeHandler(handler)
    logged = [r.getMessage() for r in records]
    assert any("GET_LOCK" in m for m in logged) and any("RELEASE_LOCK" in m for m in logged)


def test_the_migration_lock_is_released_through_the_connection(mariadb_database: URL) -> None:
    from chatflow_sqlalchemy_mariadb.dialect import MariaDBDialectSupport

    name = lock_name("migrate", mariadb_database.database)
    engine = migrate.open_engine(mariadb_database)
    statements: list[str] = []
    event.listen(
        engine, "before_cursor_execute", lambda _c, _k, statement, *_: statements.append(statement)
    )
    try:
        with migrate.locked_connection(engine, MariaDBDialectSupport()) as conn:
            assert conn.execute(text("SELECT IS_USED_LOCK(:n)"), {"n": name}).scalar() is not None
        assert any("RELEASE_LOCK" in s for s in statements), statements
        with engine.connect() as conn:  # the pooled connection is back, without the lock
            assert conn.execute(text("SELECT IS_USED_LOCK(:n)"), {"n": name}).scalar() is None
    finally:
        engine.dispose()


def test_a_killed_lock_connection_is_one_unavailable_error_then_a_new_one(
    mariadb_database: URL,
) -> None:
    """The server kills the lock connection (its locks die with it): the next try fails
    with ``DatabaseUnavailableError`` (``handle_error`` sees why), the one after reconnects."""
    name = lock_name("turn", mariadb_database.database, "first")
    probe = create_engine(mariadb_database, isolation_level="AUTOCOMMIT")
    errors: list[Any] = []

    def holder() -> Any:
        with probe.connect() as conn:
            return conn.execute(text("SELECT IS_USED_LOCK(:n)"), {"n": name}).scalar()

    async def scenario(store: Any) -> None:
        locks = store.turn_locks
        for engine in locks.engines:
            event.listen(engine, "handle_error", errors.append)
        assert (await locks.try_acquire("first"))[0] is True
        connection_id = holder()
        assert connection_id is not None
        with probe.connect() as conn:
            conn.execute(text(f"KILL {int(connection_id)}"))
        deadline = time.monotonic() + 30
        while holder() is not None:  # the server frees the killed connection's locks
            assert time.monotonic() < deadline, "the killed connection still holds its lock"
            await asyncio.sleep(0.05)
        with pytest.raises(
            DatabaseUnavailableError, match="cannot take the turn lock of session 'second'"
        ):
            await locks.try_acquire("second")
        assert errors and errors[-1].is_disconnect, "handle_error saw the lost connection"
        assert (await locks.try_acquire("first"))[0] is True, "a new connection takes it"
        assert holder() not in (None, connection_id)
        await locks.release("first")
        assert holder() is None

    try:
        with MariaDBSessionStore(mariadb_database) as store:
            asyncio.run(scenario(store))
    finally:
        probe.dispose()


def test_turn_locks_are_per_database(new_database: Callable[[], URL]) -> None:
    async def scenario(a: Any, b: Any) -> None:
        assert (await a.turn_locks.try_acquire("same-id"))[0] is True
        taken, _, _ = await b.turn_locks.try_acquire("same-id")
        assert taken is True, "another database is not blocked"
        await a.turn_locks.release("same-id")
        await b.turn_locks.release("same-id")

    with MariaDBSessionStore(new_database()) as a, MariaDBSessionStore(new_database()) as b:
        asyncio.run(scenario(a, b))


def test_migrations_wait_for_the_migration_lock(mariadb_database: URL) -> None:
    name = lock_name("migrate", mariadb_database.database)
    blocker = create_engine(mariadb_database)
    opened: list[Any] = []
    try:
        with blocker.connect() as conn:
            assert conn.execute(text("SELECT GET_LOCK(:n, 0)"), {"n": name}).scalar() == 1
            thread = threading.Thread(
                target=lambda: opened.append(MariaDBSessionStore(mariadb_database)), daemon=True
            )
            thread.start()
            time.sleep(1.0)
            assert thread.is_alive() and not opened, "it must wait for the other migrator"
            conn.execute(text("SELECT RELEASE_LOCK(:n)"), {"n": name})
            thread.join(60)
        assert opened, "it migrated once the lock was free"
        assert migrate.drift(opened[0].engine) == []
    finally:
        for store in opened:
            store.close()
        blocker.dispose()


_STARTER = r"""
import json, logging, os, sys, time

ran = []


class Capture(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("Running "):
            ran.append(record.getMessage())


log = logging.getLogger("alembic.runtime.migration")
log.setLevel(logging.DEBUG)  # the store passes Alembic's INFO lines on at DEBUG
log.addHandler(Capture())
from chatflow_sqlalchemy_mariadb import MariaDBSessionStore

print("READY", flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[2]):
    if time.monotonic() > deadline:
        sys.exit("never told to go")
    time.sleep(0.001)
MariaDBSessionStore(sys.argv[1]).close()
print(json.dumps(ran), flush=True)
"""


def test_processes_starting_at_once_migrate_once(mariadb_database: URL, tmp_path: Path) -> None:
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _STARTER, plain(mariadb_database), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "READY", proc.communicate()[1]
        go.touch()
        ran = []
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            ran.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    steps = [line for lines in ran for line in lines]
    core = int(migrate.head_revision())  # the core chain's revisions are 0001, 0002, ...
    assert len(steps) == core + 1, f"core 0001-{core:04d} and the plugin's 0001, once: {steps}"
    assert sum(1 for lines in ran if lines) == 1


def test_auto_migrate_off_refuses_an_empty_database_untouched(mariadb_database: URL) -> None:
    from chatflow_sqlalchemy.exceptions import SchemaError

    with pytest.raises(SchemaError, match="chatflow-sqlalchemy db upgrade") as caught:
        MariaDBSessionStore(mariadb_database, auto_migrate=False)
    assert migrate.EMPTY_DATABASE in str(caught.value)
    engine = create_engine(mariadb_database)
    try:
        assert inspect(engine).get_table_names() == []
    finally:
        engine.dispose()
    with MariaDBSessionStore(mariadb_database, auto_migrate=True) as store:
        assert store.list_sessions() == []
    with MariaDBSessionStore(mariadb_database, auto_migrate=False) as store:
        assert store.list_sessions() == []


def test_generic_store_on_a_mariadb_engine_runs_runner_turns_under_named_locks(
    mariadb_database: URL,
) -> None:
    """``SQLAlchemySessionStore(engine=...)``: the plugin's support brings the turn locks."""
    engine = create_engine(mariadb_database)
    bot = Agent(name="Bot", instructions="")
    try:
        with SQLAlchemySessionStore(engine=engine) as store, MariaDBSessionStore(
            mariadb_database
        ) as other:
            assert store.turn_locks is not None
            runner = Runner(starting_agent=bot, session_store=store, engine=ScriptedEngine())

            async def scenario() -> None:
                for turn in range(3):
                    reply = await runner.run_async("s1", f"hello {turn}")
                    assert reply.content == f"Bot re: hello {turn}"
                ctx = await store.aget_or_create("s1", bot)
                async with ctx.lock:
                    taken, _, _ = await other.turn_locks.try_acquire("s1")
                    assert taken is False, "the generic store's turn holds the named lock"

            asyncio.run(scenario())
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    "shared",
    [True, False],
    ids=["one-session", "own-sessions"],
)
def test_threads_with_their_own_loops_over_one_store(mariadb_database: URL, shared: bool) -> None:
    """4 threads x ``asyncio.run`` x 25 turns: no deadlock, no lost or interleaved turn."""
    threads_n, turns = 4, 25
    bot = Agent(name="Bot", instructions="")
    errors: list[BaseException] = []
    with MariaDBSessionStore(mariadb_database, default_max_turns=threads_n * turns) as store:
        runner = Runner(starting_agent=bot, session_store=store, engine=ScriptedEngine(0.001))

        def worker(index: int) -> None:
            try:
                for turn in range(turns):
                    session = "shared" if shared else f"own-{index}"
                    reply = asyncio.run(runner.run_async(session, f"t{index}-{turn}"))
                    assert reply.content == f"Bot re: t{index}-{turn}"
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
        assert not [t for t in threads if t.is_alive()], "a thread hung (deadlock)"
        assert not errors, errors
        sessions = ["shared"] if shared else [f"own-{i}" for i in range(threads_n)]
        for session in sessions:
            ctx = store.get(session)
            assert ctx is not None
            history = ctx.history
            assert len(history) == 2 * turns * (threads_n if shared else 1), "no turn lost"
            for question, answer in zip(history[::2], history[1::2], strict=True):
                assert answer.content == f"Bot re: {question.content}", "no interleaving"


def test_sweep_runs_on_a_store_whose_pool_has_one_connection(mariadb_database: URL) -> None:
    # hold_turns once took the turn locks on a second connection of the store's pool
    # while the sweep's transaction held the first: with pool_size=1, max_overflow=0
    # every sweep waited out pool_timeout and failed. Its locks now live outside the pool.
    store = MariaDBSessionStore(
        mariadb_database, session_ttl_hours=0.0005, pool_size=1, max_overflow=0, pool_timeout=3
    )
    try:
        store.get_or_create("idle", BOT).add_message(Message(role=Role.USER, content="hi"))
        with store.engine.begin() as conn:
            conn.execute(
                text("UPDATE chatflow_sessions SET updated_at = :old"),
                {"old": utcnow() - timedelta(hours=1)},
            )
        assert store.sweep() == 1
    finally:
        store.close()
