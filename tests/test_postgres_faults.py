"""PostgreSQL faults: a server restart under a live store, bad credentials, no server,
and, through a TCP fault proxy (``faultproxy.py``), a server that never answers, a
network freeze mid-turn, a partitioned lease holder and connections cut at COMMIT."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import pytest
from chatflow_agent import Agent, Message, Role, Runner
from sqlalchemy import make_url

from chatflow_sqlalchemy import (
    DatabaseUnavailableError,
    LeaseLostError,
    PostgresSessionStore,
    dialect,
    open_store,
)
from chatflow_sqlalchemy.testing import ScriptedEngine

from . import pg_util
from .faultproxy import FaultProxy, Mode
from .pg_private import PrivateCluster, private_cluster_problem

pytestmark = pytest.mark.postgres
BOT = Agent(name="Bot", instructions="")


@pytest.fixture
def schema(pg_schema: str) -> str:
    """A fresh schema on the shared test server."""
    return pg_schema


@pytest.fixture(scope="module")
def cluster() -> Iterator[PrivateCluster]:
    """A PostgreSQL server of this module's own: restarting it disturbs nobody, and
    nobody else's restart disturbs the fault tests."""
    problem = private_cluster_problem()
    if problem is not None:
        pytest.skip(f"no private PostgreSQL cluster: {problem}")
    server = PrivateCluster().start()
    try:
        yield server
    finally:
        server.destroy()


@pytest.fixture
def fault_url(request: pytest.FixtureRequest) -> str:
    """The private cluster's URL, else (no server binaries here) the shared test server's."""
    if private_cluster_problem() is None:
        return cast(PrivateCluster, request.getfixturevalue("cluster")).url
    return cast(str, request.getfixturevalue("pg_url"))


@pytest.fixture
def fault_schema(fault_url: str) -> Iterator[str]:
    """A fresh schema on ``fault_url``, dropped after the test."""
    with pg_util.fresh_schema(fault_url) as name:
        yield name


def test_store_survives_server_restart_and_fails_cleanly_while_down(
    cluster: PrivateCluster,
) -> None:
    url = cluster.url
    options = {"connect_args": {"connect_timeout": 3}}
    store = PostgresSessionStore(url, **options)
    try:
        session = store.get_or_create("s", Agent(name="Bot", instructions=""))
        session.add_message(Message(role=Role.USER, content="before restart"))

        cluster.ctl("restart")
        cluster.wait_until_ready()
        time.sleep(dialect.IDLE_PING_SECONDS)  # a restart takes longer elsewhere: pings apply
        session.add_message(Message(role=Role.MODEL, content="after restart"))
        assert store.record_processed_message("m-after-restart")

        cluster.ctl("stop")
        try:
            with pytest.raises(DatabaseUnavailableError) as caught:
                session.add_message(Message(role=Role.USER, content="while down"))
            assert "'postgres'" in str(caught.value) and str(cluster.port) in str(caught.value)
            assert [m.content for m in session.history] == ["before restart", "after restart"]
        finally:
            cluster.ctl("start")
            cluster.wait_until_ready()

        session.add_message(Message(role=Role.USER, content="back again"))
    finally:
        store.close()
    fresh = PostgresSessionStore(url, **options)
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
    from chatflow_sqlalchemy import dialect

    class SteppedClock:  # idle time moves only when told: no race with a loaded machine
        now = time.monotonic()

        def monotonic(self) -> float:
            return self.now

    clock = SteppedClock()
    monkeypatch.setattr(dialect, "time", clock)
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


# ===================================================== through the TCP fault proxy
# Hangs are guarded by a generous thread join (HANG_GUARD); nothing asserts a duration.

HANG_GUARD = 90.0
"""Seconds after which a test that should have failed cleanly is declared hung."""

_T = TypeVar("_T")


def _within(fn: Callable[[], _T], seconds: float = HANG_GUARD) -> _T:
    """``fn()`` in a daemon thread: its result or its exception, or a failure if it hangs."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed to the test below
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still blocked after {seconds:g} s: a bound is missing")
    if "error" in outcome:
        raise outcome["error"]
    return cast(_T, outcome["value"])


@pytest.fixture
def proxy(fault_url: str) -> Iterator[FaultProxy]:
    """A fault proxy in front of the test server, passing traffic through."""
    with FaultProxy.for_url(fault_url) as running:
        yield running


def _user(text: str) -> Message:
    return Message(role=Role.USER, content=text)


def _model(text: str) -> Message:
    return Message(role=Role.MODEL, content=text)


def _contents(store: PostgresSessionStore, session_id: str) -> list[str | None]:
    session = store.get(session_id)
    assert session is not None
    return [m.content for m in session.history]


def test_proxy_passes_and_delays_traffic(
    fault_url: str, fault_schema: str, proxy: FaultProxy
) -> None:
    with pg_util.schema_store(proxy.url(fault_url), fault_schema) as store:
        session = store.get_or_create("s", BOT)
        session.add_message(_user("through the proxy"))
        proxy.set_mode(Mode.DELAY, delay_ms=20)

        async def turn() -> None:
            async with session.lock:
                session.add_message(_user("delayed"))
                session.add_message(_model("answer"))

        asyncio.run(turn())
        assert proxy.connections >= 1
    with pg_util.schema_store(fault_url, fault_schema) as direct:
        assert _contents(direct, "s") == ["through the proxy", "delayed", "answer"]


def test_opening_a_store_on_a_server_that_never_answers_fails_cleanly(
    fault_url: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 7: TCP accepted, no answer: DatabaseUnavailableError (libpq connect_timeout,
    CONNECT_TIMEOUT_SECONDS by default, shortened here) naming host and database, never
    the password."""
    from chatflow_sqlalchemy.backends import postgresql_dialect

    monkeypatch.setattr(postgresql_dialect, "CONNECT_TIMEOUT_SECONDS", 1)
    proxy.set_mode(Mode.BLACK_HOLE)
    url = make_url(proxy.url(fault_url)).set(password="pw-n3ver-shown")
    rendered = url.render_as_string(hide_password=False)
    with pytest.raises(DatabaseUnavailableError) as caught:
        _within(lambda: PostgresSessionStore(rendered))
    message = str(caught.value)
    assert f"127.0.0.1:{proxy.port}" in message and repr(url.database) in message
    assert "pw-n3ver-shown" not in message and "pw-n3ver-shown" not in repr(caught.value.args)
    # The user's own connect_timeout (URL query) wins over the default.
    quick = url.update_query_dict({"connect_timeout": "2"}).render_as_string(hide_password=False)
    with pytest.raises(DatabaseUnavailableError):
        _within(lambda: open_store(quick))


def test_default_connect_arguments_yield_to_the_users() -> None:
    from chatflow_sqlalchemy.backends.postgresql import default_connect_args

    url = make_url("postgresql+psycopg://u@h/db?connect_timeout=3&keepalives=0")
    chosen = default_connect_args(url, {"tcp_user_timeout": 1000, "application_name": "x"})
    assert "connect_timeout" not in chosen and "keepalives" not in chosen
    assert chosen["tcp_user_timeout"] == 1000 and chosen["application_name"] == "x"
    assert default_connect_args(make_url("postgresql+psycopg://u@h/db"))["connect_timeout"] == 10


def _freezable_store(
    proxy: FaultProxy, fault_url: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> PostgresSessionStore:
    """A store through ``proxy`` whose waits on a frozen network are short.

    ``operation_timeout`` bounds each async operation; ``connect_timeout`` bounds the
    connection psycopg opens to cancel the timed-out query (through the frozen proxy
    too); a short turn lease frees the session of a turn whose release was frozen.
    """
    monkeypatch.setattr(PostgresSessionStore, "operation_timeout", 2.0, raising=False)
    url = make_url(proxy.url(fault_url)).update_query_dict({"connect_timeout": "2"})
    return cast(PostgresSessionStore, pg_util.schema_store(
        url.render_as_string(hide_password=False), schema, turn_lease_seconds=2.0
    ))


def test_network_freeze_while_loading_a_session_fails_with_database_unavailable(
    fault_url: str,
    fault_schema: str,
    proxy: FaultProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Item 7: a freeze (the proxy black-holes every byte, as a hung middlebox would; the
    client's kernel keeps getting ACKs, so TCP timeouts cannot fire) fails the async
    operation with DatabaseUnavailableError once operation_timeout runs out.

    A freeze as a turn starts (taking its lease) or ends (its write) is the Runner test
    below ("cached session", "at the write"), which also checks the loop kept running.
    """
    store = _freezable_store(proxy, fault_url, fault_schema, monkeypatch)
    store.get_or_create("s", BOT).add_message(_user("before the freeze"))

    async def scenario() -> None:
        await store.aget_or_create("s", BOT)
        store._forget("s")  # the next load must read the rows
        proxy.set_mode(Mode.BLACK_HOLE)
        await store.aget_or_create("s", BOT)

    try:
        with pytest.raises(DatabaseUnavailableError) as caught:
            _within(lambda: asyncio.run(scenario()))
        assert repr(make_url(fault_url).database) in str(caught.value)
    finally:
        proxy.cut_all()
        proxy.set_mode(Mode.PASS)
        store.close()
    with pg_util.schema_store(fault_url, fault_schema) as direct:
        assert _contents(direct, "s") == ["before the freeze"]


def test_a_worker_cut_off_by_a_partition_loses_its_lease_and_writes_nothing(
    fault_url: str, fault_schema: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 8: worker A holds a session's turn through the proxy, which then
    black-holes everything (A is cut off: its lease renewals never arrive). Worker B,
    connected directly, takes the session once A's lease expired (``turn_lease_seconds``
    of the database's clock) and writes its turn. A's write, once the partition heals,
    finds its lease lost: ``LeaseLostError``, and nothing of A's turn is stored."""
    # A's renewals into the black hole fail soon (each is one bounded operation).
    monkeypatch.setattr(PostgresSessionStore, "operation_timeout", 2.0, raising=False)
    a = pg_util.schema_store(proxy.url(fault_url), fault_schema, turn_lease_seconds=2.0)
    b = pg_util.schema_store(fault_url, fault_schema)
    a.get_or_create("s", BOT).add_message(_user("first"))
    a_leased, a_may_finish = threading.Event(), threading.Event()
    a_outcome: dict[str, str] = {}

    async def worker_a() -> None:
        session = await a.aget_or_create("s", BOT)
        async with session.lock:
            session.add_message(_user("A's turn"))
            session.add_message(_model("A's answer"))
            proxy.set_mode(Mode.BLACK_HOLE)
            a_leased.set()
            await asyncio.get_running_loop().run_in_executor(None, a_may_finish.wait)
            proxy.set_mode(Mode.PASS)  # the partition heals before A's write

    def run_a() -> None:
        try:
            asyncio.run(worker_a())
            a_outcome["a"] = "written"
        except LeaseLostError:
            a_outcome["a"] = "lease lost"

    thread_a = threading.Thread(target=run_a, daemon=True)
    thread_a.start()
    try:
        assert a_leased.wait(HANG_GUARD), "worker A never took its turn"

        async def worker_b() -> None:
            session = await b.aget_or_create("s", BOT)
            async with session.lock:
                session.add_message(_user("B's turn"))
                session.add_message(_model("B's answer"))

        _within(lambda: asyncio.run(worker_b()))
    finally:
        a_may_finish.set()
        thread_a.join(HANG_GUARD)
        a.close()
        b.close()
    assert not thread_a.is_alive()
    assert a_outcome.get("a") == "lease lost", a_outcome
    with pg_util.schema_store(fault_url, fault_schema) as direct:
        assert _contents(direct, "s") == ["first", "B's turn", "B's answer"]


@pytest.mark.parametrize("mode", [Mode.CUT_BEFORE_COMMIT, Mode.CUT_AFTER_COMMIT])
@pytest.mark.parametrize("api", ["sync", "async turn"])
def test_connection_cut_at_commit_fails_cleanly_and_leaves_whole_turns(
    fault_url: str, fault_schema: str, proxy: FaultProxy, mode: Mode, api: str
) -> None:
    """A cut right before COMMIT rolls the write back; right after it the write is
    committed but unacknowledged. Either way the caller gets DatabaseUnavailableError,
    the database holds the turn whole or not at all, and the store keeps working.
    (Whether a retry then stores it twice is the dedup claim's business, issue 10.)"""
    store = pg_util.schema_store(proxy.url(fault_url), fault_schema)
    try:
        session = store.get_or_create("s", BOT)
        session.add_message(_user("q1"))
        session.add_message(_model("a1"))
        proxy.set_mode(mode, cuts=1)

        def write() -> None:
            if api == "sync":
                session.add_message(_user("q2"))
                return

            async def turn() -> None:
                async with session.lock:
                    session.add_message(_user("q2"))
                    session.add_message(_model("a2"))

            asyncio.run(turn())

        with pytest.raises(DatabaseUnavailableError):
            _within(write)
        assert proxy.cuts == 1
        with pg_util.schema_store(fault_url, fault_schema) as direct:
            stored = _contents(direct, "s")
        turn = ["q2"] if api == "sync" else ["q2", "a2"]
        expected = ["q1", "a1", *turn] if mode is Mode.CUT_AFTER_COMMIT else ["q1", "a1"]
        assert stored == expected
        fresh = store.get_or_create("later", BOT)  # the pool replaced the cut connection
        fresh.add_message(_user("still works"))
        assert _contents(store, "later") == ["still works"]
    finally:
        store.close()


def test_lost_commit_acknowledgement_of_a_claimed_turn_is_not_run_twice(
    fault_url: str, fault_schema: str, proxy: FaultProxy
) -> None:
    """Issue 13 item 9: the proxy cuts the connection right after the turn's COMMIT
    reached the server. The worker gets DatabaseUnavailableError although the turn (and
    with it the claim, fenced in the same transaction) committed; the platform's retry
    of the webhook must see the claim done and must not store the turn a second time."""
    store = pg_util.schema_store(proxy.url(fault_url), fault_schema)

    async def deliver() -> str:
        async with store.claim("wamid.cut", session_id="s") as claim:
            if not claim.acquired:
                return claim.status
            session = await store.aget_or_create("s", BOT)
            proxy.set_mode(Mode.CUT_AFTER_COMMIT, cuts=1)  # the claim itself is durable
            async with session.lock:
                session.add_message(_user("where is my order?"))
                session.add_message(_model("on its way"))
            claim.response = "on its way"
            return claim.status

    try:
        with pytest.raises(DatabaseUnavailableError):
            _within(lambda: asyncio.run(deliver()))
        assert proxy.cuts == 1
        assert _within(lambda: asyncio.run(deliver())) == "done", "the retry must see it done"
    finally:
        store.close()
    with pg_util.schema_store(fault_url, fault_schema) as direct:
        assert _contents(direct, "s") == ["where is my order?", "on its way"]


# ============================================ never block the loop (issue 26, outcome 6)


class _FreezeAtModel(ScriptedEngine):
    """Answers as :class:`ScriptedEngine`, freezing the proxy first: the turn's write and
    the release of its lease then meet a network that stops relaying."""

    def __init__(self, proxy: FaultProxy) -> None:
        super().__init__()
        self.proxy = proxy

    async def generate_turn_async(self, agent: Agent, history: list[Message]) -> Any:
        self.proxy.set_mode(Mode.BLACK_HOLE)
        return await super().generate_turn_async(agent, history)


@pytest.mark.parametrize(
    "frozen", ["cached session", "new session", "stored, not cached", "at the write"]
)
def test_a_runner_turn_on_a_frozen_network_never_blocks_the_loop(
    fault_url: str,
    fault_schema: str,
    proxy: FaultProxy,
    monkeypatch: pytest.MonkeyPatch,
    frozen: str,
) -> None:
    """Issue 26 outcome 6: ``Runner.run_async`` calls the sync ``get_or_create`` on the
    loop. With the network frozen (the proxy stops relaying and closes nothing), a
    heartbeat task on the same loop keeps ticking while the turn waits, and the turn
    fails with DatabaseUnavailableError (operation_timeout) instead of hanging. Before
    the fix the sync call sat in libpq with the loop blocked: the guard fails."""
    store = _freezable_store(proxy, fault_url, fault_schema, monkeypatch)
    freezing = _FreezeAtModel(proxy) if frozen == "at the write" else ScriptedEngine()
    runner = Runner(starting_agent=BOT, session_store=store, engine=freezing)
    session_id = "new" if frozen == "new session" else "s"

    async def scenario() -> int:
        await Runner(starting_agent=BOT, session_store=store, engine=ScriptedEngine()).run_async(
            "s", "before the freeze"
        )
        if frozen == "stored, not cached":
            store._forget("s")
        ticks = 0

        async def heartbeat() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        beating = asyncio.get_running_loop().create_task(heartbeat())
        if frozen != "at the write":
            proxy.set_mode(Mode.BLACK_HOLE)
        turn = asyncio.get_running_loop().create_task(runner.run_async(session_id, "frozen"))
        start = ticks
        while ticks - start < 20 and not turn.done():
            await asyncio.sleep(0.005)
        assert not turn.done(), "the turn ended before the loop ran: it held the loop"
        waited = ticks - start
        try:
            await turn
        finally:
            beating.cancel()
        return waited

    try:
        with pytest.raises(DatabaseUnavailableError) as caught:
            _within(lambda: asyncio.run(scenario()))
        assert repr(make_url(fault_url).database) in str(caught.value)
        with pg_util.schema_store(fault_url, fault_schema) as direct:
            assert "frozen" not in _contents(direct, "s")
            assert direct.get("new") is None
        proxy.cut_all()
        proxy.set_mode(Mode.PASS)
        # The network is back: the same store (and context) serves the next turn.
        again = Runner(starting_agent=BOT, session_store=store, engine=ScriptedEngine())
        _within(lambda: asyncio.run(again.run_async(session_id, "thawed")))
    finally:
        proxy.cut_all()
        proxy.set_mode(Mode.PASS)
        store.close()
    with pg_util.schema_store(fault_url, fault_schema) as direct:
        assert _contents(direct, "s")[:2] == ["before the freeze", "Bot re: before the freeze"]
        assert _contents(direct, session_id)[-2:] == ["thawed", "Bot re: thawed"]
        assert "frozen" not in _contents(direct, session_id)
