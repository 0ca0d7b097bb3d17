"""What the MariaDB backend adds beyond the conformance suite.

Each test that needs the server gets an empty database of its own
(``mariadb_database``, see conftest.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
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

pytest.importorskip("chatflow_sqlalchemy_mariadb", reason="the MariaDB plugin is not installed")
from chatflow_sqlalchemy_mariadb import MariaDBSessionStore
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

    from chatflow_sqlalchemy_mariadb.dialect import MariaDBDialectSupport

    dialect: Any = mysql.dialect()
    dialect.is_mariadb = mariadb
    dialect.server_version_info = version
    sessions: Any = ChatflowSessionTable
    connection: Any = SimpleNamespace(dialect=dialect)
    locked = MariaDBDialectSupport().lock_batch(select(sessions.c.session_id), connection)
    sql = str(locked.compile(dialect=dialect))
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


_SET_LEASE_OWNER = "UPDATE chatflow_sessions SET lease_owner="


def _lease(probe: Any, session_id: str) -> tuple[str | None, int]:
    """The session row's ``(lease_owner, lease_fence)``, read in a transaction of its own."""
    sessions: Any = ChatflowSessionTable
    with probe.connect() as conn:
        query = select(sessions.c.lease_owner, sessions.c.lease_fence).where(
            sessions.c.session_id == session_id
        )
        owner, fence = conn.execute(query).one()
        return owner, int(fence)


def _lease_owner(probe: Any, session_id: str) -> str | None:
    """The session row's ``lease_owner`` (None: the session is free)."""
    return _lease(probe, session_id)[0]


def _blocked_lease_updates(probe: Any, released: bool) -> int:
    """Statements of this server now running a lease take (or release), e.g. waiting on a row."""
    start = _SET_LEASE_OWNER + ("NULL" if released else "%")
    with probe.connect() as conn:
        return int(conn.execute(
            text("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE INFO LIKE :start"),
            {"start": start + "%"},
        ).scalar_one())


def test_a_turn_holds_its_sessions_lease_for_the_whole_turn(mariadb_database: URL) -> None:
    """The lease is in the session row while the turn runs: another store cannot take it
    (it can take another session's), and the turn's write gives it back."""
    probe = create_engine(mariadb_database)

    async def scenario(store: Any, other: Any) -> None:
        # On the loop get_or_create reads and creates nothing until first use: the rows
        # must exist before the other store's takes.
        ctx = await store.aget_or_create("locked", BOT)
        await store.aget_or_create("unlocked", BOT)
        leases = other.turns.leases
        async with ctx.lock:
            assert _lease_owner(probe, "locked") is not None, "the turn holds the lease"
            assert leases.take("locked") is None
            lease = leases.take("unlocked")
            assert lease is not None, "another session is free"
            leases.release(lease)
            ctx.add_message(Message(role=Role.USER, content="in turn"))
        assert _lease_owner(probe, "locked") is None, "the lease is given back when the turn ends"
        lease = leases.take("locked")
        assert lease is not None
        leases.release(lease)

    try:
        with MariaDBSessionStore(mariadb_database) as store, MariaDBSessionStore(
            mariadb_database
        ) as other:
            asyncio.run(scenario(store, other))
    finally:
        probe.dispose()


def test_a_turn_cancelled_while_taking_its_lease_never_leaves_it_held(
    mariadb_database: URL,
) -> None:
    """A timeout that cancels ``ctx.lock.acquire()`` while the I/O thread's take waits on
    the session row (another transaction holds it): the take then succeeds for nobody,
    and the lease must be given back, long before it would expire."""
    probe = create_engine(mariadb_database)

    async def scenario(store: Any) -> None:
        ctx = await store.aget_or_create("cancelled", BOT)  # the row exists before it is locked
        sessions: Any = ChatflowSessionTable
        with probe.connect() as blocker:
            blocker.execute(select(sessions.c.version)
                            .where(sessions.c.session_id == "cancelled").with_for_update())
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(ctx.lock.acquire(), 0.5)
            deadline = time.monotonic() + 30  # the take is on its way (a hang guard)
            while not await asyncio.to_thread(_blocked_lease_updates, probe, False):
                assert time.monotonic() < deadline, "the take never reached the server"
                await asyncio.sleep(0.05)
            blocker.rollback()  # the take goes through, for a caller that left
        deadline = time.monotonic() + 30
        while await asyncio.to_thread(_lease, probe, "cancelled") != (None, 1):
            assert time.monotonic() < deadline, (
                "the lease taken for a cancelled caller is held: "
                f"{await asyncio.to_thread(_lease, probe, 'cancelled')}"
            )
            await asyncio.sleep(0.05)
        async with ctx.lock:  # the next turn gets it
            assert _lease_owner(probe, "cancelled") is not None

    try:
        with MariaDBSessionStore(mariadb_database, turn_lease_seconds=600.0) as store:
            asyncio.run(scenario(store))
    finally:
        probe.dispose()


def test_turns_cancelled_while_giving_their_leases_back_still_give_them_back(
    mariadb_database: URL,
) -> None:
    """A shutdown cancels turns while they give their leases back (the session rows are
    held by another transaction meanwhile, so each release waits or is queued): every
    lease is given back once the rows are free, long before it would expire."""
    sessions_n = 6
    session_ids = [f"s{i}" for i in range(sessions_n)]
    probe = create_engine(mariadb_database)

    async def scenario(store: Any) -> None:
        contexts = [store.get_or_create(sid, BOT) for sid in session_ids]
        inside, go = asyncio.Semaphore(0), asyncio.Event()

        async def turn(ctx: Any) -> None:
            async with ctx.lock:  # nothing to write: the turn's end only gives back
                inside.release()
                await go.wait()

        tasks = [asyncio.ensure_future(turn(ctx)) for ctx in contexts]
        for _ in tasks:
            await inside.acquire()
        sessions: Any = ChatflowSessionTable
        with probe.connect() as blocker:
            blocker.execute(select(sessions.c.version)
                            .where(sessions.c.session_id.in_(session_ids)).with_for_update())
            go.set()
            # Every I/O thread is busy with a release waiting on a row, the rest are queued.
            busy = min(sessions_n, MariaDBSessionStore._blocking_io_workers)
            deadline = time.monotonic() + 30
            while await asyncio.to_thread(_blocked_lease_updates, probe, True) < busy:
                assert time.monotonic() < deadline, "the releases never reached the server"
                await asyncio.sleep(0.05)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            blocker.rollback()
        deadline = time.monotonic() + 30
        while held := [sid for sid in session_ids
                       if await asyncio.to_thread(_lease_owner, probe, sid) is not None]:
            assert time.monotonic() < deadline, f"cancelled releases left leases held: {held}"
            await asyncio.sleep(0.05)

    try:
        with MariaDBSessionStore(mariadb_database, turn_lease_seconds=600.0) as store:
            asyncio.run(scenario(store))
    finally:
        probe.dispose()


def test_lease_statements_are_seen_by_the_store_engines_events(mariadb_database: URL) -> None:
    """Issue 12: the turn's lease (taken, then given back by the write's version swap)
    goes through SQLAlchemy on the store's engines, where listeners see it before and after."""
    seen: list[tuple[str, str]] = []

    def before(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(("before", " ".join(statement.split())))

    def after(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(("after", " ".join(statement.split())))

    with MariaDBSessionStore(mariadb_database) as store:
        assert store.engines == (store.engine,), "no engine of the store's own for turns"
        event.listen(store.engine, "before_cursor_execute", before)
        event.listen(store.engine, "after_cursor_execute", after)
        runner = Runner(starting_agent=BOT, session_store=store, engine=ScriptedEngine())
        reply = asyncio.run(runner.run_async("observed", "hello"))
        assert reply.content == "Bot re: hello"
    for hook in ("before", "after"):
        statements = [s for h, s in seen if h == hook]
        taken = [s for s in statements if s.startswith(f"{_SET_LEASE_OWNER}%(")]
        given_back = [
            s for s in statements
            if s.startswith("UPDATE chatflow_sessions SET") and "lease_owner=NULL" in s
        ]
        assert len(taken) == 1 and len(given_back) == 1, (hook, seen)


def _migration_lock_name(database: str | None) -> str:
    """The named lock every version of the plugin takes to migrate ``database``."""
    digest = hashlib.blake2b(f"{database or ''}\0".encode(), digest_size=16, person=b"chatflow")
    return f"chatflow:migrate:{digest.hexdigest()}"


def test_the_migration_lock_is_released_through_the_connection(mariadb_database: URL) -> None:
    from chatflow_sqlalchemy_mariadb.dialect import MariaDBDialectSupport

    name = _migration_lock_name(mariadb_database.database)
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


def test_migrations_wait_for_the_migration_lock(mariadb_database: URL) -> None:
    name = _migration_lock_name(mariadb_database.database)
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


def test_generic_store_on_a_mariadb_engine_runs_runner_turns_under_the_lease(
    mariadb_database: URL,
) -> None:
    """``SQLAlchemySessionStore(engine=...)``: its turns hold the session's lease like the
    plugin's own store's, so another store is kept out of them."""
    engine = create_engine(mariadb_database)
    bot = Agent(name="Bot", instructions="")
    try:
        with SQLAlchemySessionStore(engine=engine) as store, MariaDBSessionStore(
            mariadb_database
        ) as other:
            runner = Runner(starting_agent=bot, session_store=store, engine=ScriptedEngine())

            async def scenario() -> None:
                for turn in range(3):
                    reply = await runner.run_async("s1", f"hello {turn}")
                    assert reply.content == f"Bot re: hello {turn}"
                ctx = await store.aget_or_create("s1", bot)
                async with ctx.lock:
                    held = other.turns.leases.take("s1")
                    assert held is None, "the generic store's turn holds the lease"

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
    # A sweep once took the turn locks on a second connection of the store's pool while
    # its transaction held the first: with pool_size=1, max_overflow=0 every sweep waited
    # out pool_timeout and failed. Its own query now skips sessions under a live lease.
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
