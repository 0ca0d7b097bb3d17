"""PostgreSQL's claims table by day (revision 0006): one row per id, whole days purged."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date, datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from chatflow_agent import Agent, Message, Role

from chatflow_sqlalchemy import DEFAULT_DEDUP_TTL_HOURS, PostgresSessionStore, migrate
from chatflow_sqlalchemy.backends import postgresql_claims as pg_claims
from chatflow_sqlalchemy.cli import main as cli_main
from chatflow_sqlalchemy.rows import processed
from chatflow_sqlalchemy.values import utcnow

from . import pg_util
from .pg_util import writes_session as _writes_session

pytestmark = pytest.mark.postgres



def _today() -> date:
    """Today as the claims code reckons it: the UTC day of the clock it stamps rows with.

    Read when needed, never once per module: a run that crosses midnight
    (CI near 00:00 UTC) must compare with the day the code saw.
    """
    return pg_claims.utc_day(utcnow())


@contextmanager
def _days_spanned() -> Iterator[set[date]]:
    """The UTC days the block ran on: one, or both sides of a midnight it crossed."""
    days = {_today()}
    yield days
    days.add(_today())


@pytest.fixture
def schema() -> Iterator[str]:
    with pg_util.fresh_schema(pg_util.postgres_url()) as name:
        yield name


@pytest.fixture
def store(schema: str) -> Iterator[Any]:
    with pg_util.schema_store(pg_util.postgres_url(), schema) as opened:
        yield opened


def _rows(engine: sa.Engine, message_id: str) -> list[tuple[str, date]]:
    with engine.connect() as conn:
        return [
            (row[0], row[1])
            for row in conn.execute(
                sa.text(
                    "SELECT tableoid::regclass::text, partition_day "
                    "FROM chatflow_processed_messages WHERE message_id = :m"
                ),
                {"m": message_id},
            )
        ]


def _put(
    engine: sa.Engine, message_id: str, day: date, processed_at: datetime, state: str = "done"
) -> None:
    """A row as an earlier day left it (written straight, as that day's claim would have)."""
    with engine.begin() as conn:
        pg_claims.create_day_partitions(conn, day, day)
        conn.execute(
            sa.text(
                "INSERT INTO chatflow_processed_messages "
                "(message_id, processed_at, state, partition_day) VALUES (:m, :at, :state, :day)"
            ),
            {"m": message_id, "at": processed_at, "state": state, "day": day},
        )


def _days(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return {
            row[0]
            for row in conn.execute(
                sa.text(
                    "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                    "WHERE i.inhparent = 'chatflow_processed_messages'::regclass"
                )
            )
        }


def test_the_table_is_partitioned_by_day_a_week_ahead(schema: str) -> None:
    with _days_spanned() as opened:  # the migration creates the days from its today on
        store = pg_util.schema_store(pg_util.postgres_url(), schema)
    with store, store.engine.connect() as conn:
        strategy = conn.execute(
            sa.text(
                "SELECT partstrat FROM pg_partitioned_table "
                "WHERE partrelid = 'chatflow_processed_messages'::regclass"
            )
        ).scalar()
        assert strategy == "r"
        days = _days(store.engine)
        assert any(
            {pg_claims.partition_name(first + timedelta(n)) for n in range(8)}
            | {pg_claims.DEFAULT_PARTITION} <= days
            for first in opened
        ), days
        with _days_spanned() as written:
            assert store.record_processed_message("m-today") is True
            with store.claim("c-today", session_id="s") as claim:
                assert claim.acquired
                claim.response = "ok"
        for mid in ("m-today", "c-today"):
            (where, day), = _rows(store.engine, mid)
            assert day in written and where.endswith(pg_claims.partition_name(day))
        assert migrate.drift(store.engine) == []


def test_an_id_in_an_earlier_days_partition_is_still_one_row(store: Any) -> None:
    engine = store.engine
    three_days_ago = _today() - timedelta(3)
    recently = datetime.now(timezone.utc) - timedelta(hours=1)
    _put(engine, "done-before", three_days_ago, recently)
    _put(engine, "released-before", three_days_ago, recently, state="released")

    assert store.is_message_processed("done-before")
    assert store.record_processed_message("done-before") is False
    store.mark_message_processed("done-before")
    with store.claim("done-before") as claim:
        assert not claim.acquired and claim.status == "done"
    with store.claim("released-before", session_id="s") as claim:
        assert claim.acquired
        claim.response = "second try"
    with store.claim("released-before") as claim:
        assert not claim.acquired and claim.response == "second try"
    for mid in ("done-before", "released-before"):
        assert [day for _, day in _rows(engine, mid)] == [three_days_ago]


def test_a_claims_row_moved_to_today_by_the_purge_mid_turn_still_fences_the_turns_write(
    store: Any,
) -> None:
    """The turn's write looks for its claim's row from the day it was taken in, on.

    A taken-over id whose row sits in an expired day's partition is moved to
    today's by a purge while its turn runs; the one-statement write still
    finds it there (rows only move to a later day), commits the claim and
    stores the reply, with no step-by-step write after it.
    """
    engine = store.engine
    session_updates: list[str] = []
    for seen in store.engines:
        sa.event.listen(
            seen, "before_cursor_execute",
            lambda *a: session_updates.append(a[2]) if _writes_session(a[2]) else None,
        )
    old_day = _today() - timedelta(20)
    _put(engine, "moved", old_day, datetime.now(timezone.utc) - timedelta(hours=2), "released")
    bot = Agent(name="Bot", instructions="")

    async def turn() -> None:
        async with store.claim("moved", session_id="s-moved") as claim:
            assert claim.acquired
            assert [day for _, day in _rows(engine, "moved")] == [old_day]
            with _days_spanned() as purged:
                store.purge_processed_messages()  # another worker's purge, mid-turn
            (_, day), = _rows(engine, "moved")
            assert day in purged
            ctx = store.get_or_create("s-moved", bot)
            async with ctx.lock:
                ctx.add_message(Message(role=Role.USER, content="hello"))
                ctx.add_message(Message(role=Role.MODEL, content="answer"))
            claim.response = "answer"

    asyncio.run(turn())
    with store.claim("moved") as again:
        assert not again.acquired and again.status == "done" and again.response == "answer"
    assert [m.content for m in store.get("s-moved").history] == ["hello", "answer"]
    assert len(session_updates) == 1, "the write was one statement"


def test_racing_first_claims_on_either_side_of_midnight_make_one_row(store: Any) -> None:
    """The second claim waits on the id's lock and then sees the first one's row.

    Without the lock (or with the lookup in the insert's own snapshot) the
    later claim would insert a second row into the next day's partition.
    """
    statement = store.support.acquire_claim(processed)
    first_day = _today()  # the claims below give their own clock, either side of a midnight
    midnight = datetime.combine(first_day + timedelta(1), datetime.min.time(), timezone.utc)
    mid = f"midnight-{uuid.uuid4().hex}"

    def params(now: datetime) -> dict[str, Any]:  # no session: only the id's lock is taken
        return {
            "message_id": mid, "now": now, "cutoff": now - timedelta(days=8),
            "token": uuid.uuid4().hex, "lease": now + timedelta(seconds=30), "session_id": None,
            "horizon": now - timedelta(seconds=30), "lease_seconds": 30.0,
            "ttl_seconds": 8 * 86400.0,  # leases and TTL use the database's clock
            "holder_token": uuid.uuid4().hex, "lease_now": now, "lease_until": now,
            "turn_lease_seconds": 30.0,  # the session's lease (none here: no session)
        }

    engine = pg_util.schema_engine(pg_util.postgres_url(), _schema_of(store))
    results: dict[str, Any] = {}
    try:
        with engine.connect() as first:
            results["first"] = first.execute(
                statement, params(midnight - timedelta(milliseconds=5))
            ).first()

            def second() -> None:
                with engine.connect() as conn, conn.begin():
                    results["second"] = conn.execute(
                        statement, params(midnight + timedelta(milliseconds=5))
                    ).first()

            racer = threading.Thread(target=second)
            racer.start()
            _wait_until_blocked(engine, racer, mid)
            first.commit()
            racer.join(30)
    finally:
        engine.dispose()
    assert results["first"] is not None, "the first claim takes the id"
    assert results["second"] is None, "the second one finds it taken"
    assert [day for _, day in _rows(store.engine, mid)] == [first_day]


def _schema_of(store: Any) -> str:
    with store.engine.connect() as conn:
        return str(conn.execute(sa.text("SELECT current_schema()")).scalar())


def _wait_until_blocked(engine: sa.Engine, racer: threading.Thread, message_id: str) -> None:
    deadline = time.monotonic() + 20
    with engine.connect() as probe:
        while time.monotonic() < deadline:
            waiting = probe.execute(
                sa.text(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                    "AND classid = :cls "
                    "AND objid::text::bigint = (hashtext(:m)::bigint & 4294967295)"
                ),
                {"cls": pg_claims.CLAIM_LOCK_CLASS, "m": message_id},
            ).scalar()
            probe.rollback()
            if waiting:
                return
            assert racer.is_alive(), "the second claim did not wait for the first"
            time.sleep(0.02)
    pytest.fail("the second claim never waited on the id's lock")


def test_the_purge_drops_expired_days_and_keeps_their_live_ids(store: Any) -> None:
    engine = store.engine
    now = datetime.now(timezone.utc)
    old_day = _today() - timedelta(20)
    _put(engine, "expired", old_day, now - timedelta(days=20))
    _put(engine, "expired-too", old_day, now - timedelta(days=19))
    _put(engine, "taken-over-lately", old_day, now - timedelta(hours=2))
    with engine.begin() as conn:  # a day without a partition: its rows are in the default one
        conn.execute(
            sa.text(
                "INSERT INTO chatflow_processed_messages (message_id, processed_at, partition_day) "
                "VALUES ('in-default', :at, :day)"
            ),
            {"at": now - timedelta(days=15), "day": _today() - timedelta(15)},
        )
    assert store.record_processed_message("fresh") is True

    with _days_spanned() as purged:
        assert store.purge_processed_messages() == 3
    days = _days(engine)
    assert pg_claims.partition_name(old_day) not in days
    last = max(purged) + timedelta(pg_claims.DAYS_AHEAD)
    assert pg_claims.partition_name(last) in days
    (_, day), = _rows(engine, "taken-over-lately")
    assert day in purged
    assert store.record_processed_message("taken-over-lately") is False
    assert store.record_processed_message("fresh") is False
    for gone in ("expired", "expired-too", "in-default"):
        assert _rows(engine, gone) == []
    assert store.purge_processed_messages() == 0


def test_the_stores_own_upkeep_drops_days_but_deletes_no_rows(schema: str) -> None:
    """What claims do every five minutes on PostgreSQL: DROP whole days, no row-by-row DELETE."""
    url = pg_util.postgres_url()
    with pg_util.schema_store(url, schema, dedup_ttl_hours=0.0002) as store:
        old_day = _today() - timedelta(2)
        _put(store.engine, "old", old_day, datetime.now(timezone.utc) - timedelta(days=2))
        assert store.record_processed_message("expires-soon") is True
        time.sleep(1)  # past the 0.72 s TTL: expired, but its day is today
        store._last_purge -= timedelta(minutes=10)  # the five-minute upkeep is due
        assert store.record_processed_message("another") is True
        assert pg_claims.partition_name(old_day) not in _days(store.engine)
        assert len(_rows(store.engine, "expires-soon")) == 1
        assert store.is_message_processed("expires-soon") is False
        assert store.record_processed_message("expires-soon") is True  # taken over in place
        time.sleep(1)
        assert store.purge_processed_messages() == 2  # an explicit purge removes every one


def test_the_purge_gives_up_its_table_lock_rather_than_stall_claims(store: Any) -> None:
    engine = store.engine
    old_day = _today() - timedelta(20)
    _put(engine, "expired", old_day, datetime.now(timezone.utc) - timedelta(days=20))
    with engine.connect() as holder:
        holder.execute(sa.text("LOCK TABLE chatflow_processed_messages IN ROW EXCLUSIVE MODE"))
        assert store._drop_expired(datetime.now(timezone.utc) - timedelta(days=8),
                                   datetime.now(timezone.utc)) == 0
        holder.rollback()
    assert pg_claims.partition_name(old_day) in _days(engine)
    assert store.purge_processed_messages() == 1
    assert pg_claims.partition_name(old_day) not in _days(engine)


def test_dedup_purge_on_the_command_line_drops_whole_days(
    store: Any, schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = store.engine
    old_day = _today() - timedelta(20)
    _put(engine, "expired", old_day, datetime.now(timezone.utc) - timedelta(days=20))
    store.record_processed_message("live")
    url = sa.make_url(pg_util.postgres_url()).update_query_dict(
        {"options": f"-csearch_path={schema}"}
    )
    code = cli_main(["dedup", "purge", "--url", url.render_as_string(hide_password=False)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "removed 1 expired" in out.out
    assert pg_claims.partition_name(old_day) not in _days(engine)
    assert store.is_message_processed("live")


def test_upgrading_keeps_every_id_and_downgrading_unpartitions(schema: str) -> None:
    url = pg_util.postgres_url()
    engine = pg_util.schema_engine(url, schema)
    try:
        migrate.upgrade(engine, "0005")
        now = datetime.now(timezone.utc)
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO chatflow_processed_messages (message_id, processed_at, state) "
                    "VALUES ('kept', :now, 'done'), ('held', :now, 'acquired'), "
                    "('long-ago', :old, 'done')"
                ),
                {"now": now, "old": now - timedelta(days=30)},
            )
        with _days_spanned() as upgraded:
            migrate.upgrade(engine)
        assert migrate.drift(engine) == []
        for mid in ("kept", "held", "long-ago"):
            (_, day), = _rows(engine, mid)
            assert day in upgraded
        with pg_util.schema_store(url, schema) as store:
            assert store.record_processed_message("kept") is False
            assert store.record_processed_message("long-ago") is True  # expired: taken again

        migrate.downgrade(engine, "0005")
        with engine.connect() as conn:
            partitioned = conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_partitioned_table "
                    "WHERE partrelid = 'chatflow_processed_messages'::regclass"
                )
            ).scalar()
            ids = {row[0] for row in conn.execute(
                sa.text("SELECT message_id FROM chatflow_processed_messages")
            )}
            function = conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_proc WHERE proname = 'chatflow_claim_day' "
                    "AND pronamespace = current_schema()::regnamespace"
                )
            ).scalar()
            keys = sa.inspect(conn).get_pk_constraint("chatflow_processed_messages")
        assert partitioned == 0 and function == 0
        assert ids == {"kept", "held", "long-ago"}
        assert keys["constrained_columns"] == ["message_id"]
        with _days_spanned() as upgraded:
            migrate.upgrade(engine)
        (_, day), = _rows(engine, "held")
        assert day in upgraded
    finally:
        engine.dispose()


def test_claims_of_one_session_taken_at_once_run_one_after_the_other(schema: str) -> None:
    """Two workers claim two deliveries of one session at the same instant, forty times.

    The later ticket must see the earlier claim and wait for it. Drawn outside
    the session's lock, a ticket could be smaller than one already committed
    without its claim being visible yet, and both turns ran at once.
    """
    url = pg_util.postgres_url()
    with pg_util.schema_store(url, schema) as one, pg_util.schema_store(url, schema) as two:
        for round_ in range(40):
            log: list[tuple[str, int]] = []
            start = threading.Barrier(2)

            def deliver(store: Any, message_id: str, log: list[tuple[str, int]] = log,
                        start: threading.Barrier = start, user: str = f"user-{round_}") -> None:
                start.wait()
                with store.claim(message_id, session_id=user) as claim:
                    assert claim.acquired
                    log.append(("enter", claim.ticket))
                    time.sleep(0.02)
                    log.append(("exit", claim.ticket))

            workers = [
                threading.Thread(target=deliver, args=(store, f"wamid-{round_}-{k}"))
                for k, store in enumerate((one, two))
            ]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join(30)
            first, second = sorted(ticket for kind, ticket in log if kind == "enter")
            assert log == [("enter", first), ("exit", first), ("enter", second),
                           ("exit", second)], f"round {round_}: {log}"


def _echo_runner(store: Any) -> Any:
    from chatflow_agent import Agent, BaseEngine, Runner
    from chatflow_agent.core.engines.base import EngineTurnResult

    class Echo(BaseEngine):
        async def generate_turn_async(self, agent: Agent, history: list[Message]) -> Any:
            seen = [m.content for m in history if m.role.value == "user"]
            return EngineTurnResult(text=f"re: {history[-1].content} (saw {len(seen)})")

    return Runner(starting_agent=Agent(name="Bot", instructions=""), session_store=store,
                  engine=Echo())


async def _claimed_turn(store: Any, mid: str, text: str, between: Any = None) -> str | None:
    runner = _echo_runner(store)
    async with store.claim(mid, session_id="s") as claim:
        assert claim.acquired
        if between is not None:
            done = between()
            if inspect.isawaitable(done):
                await done
        result = await runner.run_async(session_id="s", user_message=text)
        claim.response = result.content
        return claim.response


def test_a_session_written_elsewhere_after_the_claim_is_caught_up_with(schema: str) -> None:
    """The claim's read of the version serves get_or_create; the turn lock reads it again.

    The claim's acquire took the session's lease, so the other store's turn waits for
    it to lapse: ``mine`` holds a short one.
    """
    import asyncio

    url = pg_util.postgres_url()
    with pg_util.schema_store(url, schema, turn_lease_seconds=2.0) as mine, \
            pg_util.schema_store(url, schema) as other:
        asyncio.run(_claimed_turn(mine, "w1", "one"))  # mine holds the context now
        reply = asyncio.run(_claimed_turn(
            mine, "w3", "three",
            between=lambda: _echo_runner(other).run_async(session_id="s", user_message="two"),
        ))
        assert reply == "re: three (saw 3)"
        texts = [m.content for m in other.get("s").history]
        assert texts == ["one", "re: one (saw 1)", "two", "re: two (saw 2)", "three", reply]


def test_a_session_deleted_after_the_claim_fails_the_turn_and_its_redelivery_runs(
    schema: str,
) -> None:
    import asyncio

    from chatflow_sqlalchemy import SessionDeletedError

    url = pg_util.postgres_url()
    with pg_util.schema_store(url, schema) as mine, pg_util.schema_store(url, schema) as other:
        asyncio.run(_claimed_turn(mine, "d1", "one"))
        with pytest.raises(SessionDeletedError):
            asyncio.run(_claimed_turn(mine, "d2", "two", between=lambda: other.delete("s")))
        assert other.get("s") is None, "nothing of the failed turn was written"
        assert asyncio.run(_claimed_turn(mine, "d2", "two")) == "re: two (saw 1)"
        assert [m.content for m in other.get("s").history] == ["two", "re: two (saw 1)"]


def _upkeep_due(store: Any) -> None:
    store._last_purge -= timedelta(minutes=10)  # the five-minute upkeep runs on the next claim


def test_the_upkeep_drains_the_default_partition_and_one_purge_runs_at_a_time(
    store: Any,
) -> None:
    engine = store.engine
    now = datetime.now(timezone.utc)
    old_day = _today() - timedelta(20)
    _put(engine, "expired", old_day, now - timedelta(days=20))
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO chatflow_processed_messages (message_id, processed_at, partition_day) "
                "VALUES ('in-default', :at, :day)"
            ),
            {"at": now - timedelta(days=15), "day": _today() - timedelta(15)},
        )
    with engine.connect() as other:  # another purge is at work
        other.execute(sa.text(f"SELECT pg_advisory_xact_lock({pg_claims.PURGE_LOCK_KEYS})"))
        _upkeep_due(store)
        assert store.record_processed_message("first") is True
        assert pg_claims.partition_name(old_day) in _days(engine)
        assert _rows(engine, "in-default") != []
        other.rollback()
    _upkeep_due(store)
    assert store.record_processed_message("second") is True
    assert pg_claims.partition_name(old_day) not in _days(engine)
    assert _rows(engine, "in-default") == []


def test_the_purge_puts_lock_timeout_back(store: Any) -> None:
    now = datetime.now(timezone.utc)
    _put(store.engine, "expired", _today() - timedelta(20), now - timedelta(days=20))
    with store.engine.begin() as conn:
        conn.execute(sa.text("SET LOCAL lock_timeout = '7s'"))
        assert store.support.drop_expired_processed(conn, now - timedelta(days=8), now) == 1
        assert conn.execute(sa.text("SHOW lock_timeout")).scalar() == "7s"


def test_a_role_that_may_not_change_the_table_still_claims(
    store: Any, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The upkeep needs the table's owner; without, it logs, and claims carry on."""
    role = f"app_{uuid.uuid4().hex[:12]}"
    now = datetime.now(timezone.utc)
    old_day = _today() - timedelta(20)
    _put(store.engine, "expired", old_day, now - timedelta(days=20))
    with store.engine.begin() as conn:
        conn.execute(sa.text(f'CREATE ROLE "{role}"'))
        conn.execute(sa.text(f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"'))
        conn.execute(sa.text(
            f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "{schema}" TO "{role}"'
        ))
        conn.execute(sa.text(f'GRANT USAGE ON ALL SEQUENCES IN SCHEMA "{schema}" TO "{role}"'))
    try:
        url = pg_util.postgres_url()
        options = f"-csearch_path={schema} -crole={role}"
        with PostgresSessionStore(url, connect_args={"options": options}) as app:
            _upkeep_due(app)
            with caplog.at_level("WARNING"):
                assert app.record_processed_message("as-the-app") is True
            assert "does not own" in caplog.text
            with app.claim("claimed-as-the-app", session_id="s") as claim:
                assert claim.acquired
            assert _rows(store.engine, "expired") == []  # deleted row by row instead
        _put(store.engine, "expired-too", old_day, now - timedelta(days=19))
        with PostgresSessionStore(url, connect_args={"options": options}) as app:
            assert app.purge_processed_messages() == 1
        assert pg_claims.partition_name(old_day) in _days(store.engine)
    finally:
        with store.engine.begin() as conn:
            conn.execute(sa.text(f'DROP OWNED BY "{role}"'))
            conn.execute(sa.text(f'DROP ROLE "{role}"'))


def test_claims_refuse_an_isolation_level_other_than_read_committed(schema: str) -> None:
    url = pg_util.postgres_url()
    with (
        pg_util.schema_store(url, schema, isolation_level="REPEATABLE READ") as store,
        pytest.raises(sa.exc.DBAPIError, match="READ COMMITTED"),
    ):
        store.mark_message_processed("in-a-snapshot")


def test_the_claims_version_serves_only_its_blocks_first_get_or_create(schema: str) -> None:
    """A new session (nothing cached), a turn, then ``get``: the same live context."""
    import asyncio

    url = pg_util.postgres_url()
    with pg_util.schema_store(url, schema) as store:
        runner = _echo_runner(store)

        async def block() -> None:
            async with store.claim("first-ever", session_id="new") as claim:
                assert claim.acquired
                await runner.run_async(session_id="new", user_message="hello")
                ctx = store.get("new")
                assert ctx is store.get_or_create("new", runner.starting_agent)
                assert [m.content for m in ctx.history] == ["hello", "re: hello (saw 1)"]

        asyncio.run(block())


def test_a_claim_of_one_store_does_not_speak_for_another(schema: str) -> None:
    import asyncio

    url = pg_util.postgres_url()
    with pg_util.fresh_schema(url) as other_schema, \
            pg_util.schema_store(url, schema) as mine, \
            pg_util.schema_store(url, other_schema) as other:
        asyncio.run(_echo_runner(other).run_async(session_id="shared", user_message="hi"))
        cached = other.get("shared")

        async def block() -> None:  # "shared" does not exist in mine's schema
            async with mine.claim("m-x", session_id="shared") as claim:
                assert claim.acquired
                assert other.get("shared") is cached
                assert cached.history[0].content == "hi"

        asyncio.run(block())


def test_the_upkeep_with_nothing_to_drop_takes_no_table_lock(
    store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A day whose rows sit in the default partition gets no partition: no lock for it."""
    later = _today() + timedelta(pg_claims.DAYS_AHEAD)
    with store.engine.begin() as conn:
        conn.execute(sa.text(f'DROP TABLE "{pg_claims.partition_name(later)}"'))
        conn.execute(
            sa.text(
                "INSERT INTO chatflow_processed_messages (message_id, processed_at, partition_day) "
                "VALUES ('ahead', now(), :day)"
            ),
            {"day": later},
        )
    with store.engine.connect() as holder:
        holder.execute(sa.text("LOCK TABLE chatflow_processed_messages IN ROW EXCLUSIVE MODE"))
        with caplog.at_level("INFO"):
            for _ in range(2):
                _upkeep_due(store)
                assert store.record_processed_message(uuid.uuid4().hex) is True
        holder.rollback()
    assert "left as they are" not in caplog.text


def _claimed_reply(store: Any, mid: str, sid: str, between: Any = None) -> None:
    """A claimed turn of ``sid`` that stores its reply with the claim; ``between`` runs mid-turn."""
    bot = Agent(name="Bot", instructions="")

    async def turn() -> None:
        async with store.claim(mid, session_id=sid) as claim:
            assert claim.acquired
            if between is not None:
                between()
            ctx = store.get_or_create(sid, bot)
            async with ctx.lock:
                ctx.add_message(Message(role=Role.USER, content="hello"))
                ctx.add_message(Message(role=Role.MODEL, content="answer"))
            claim.response = "answer"

    asyncio.run(turn())


def test_a_claim_row_of_a_day_ahead_of_the_workers_clock_still_fences_the_turns_write(
    store: Any,
) -> None:
    """A row left days ahead (a worker whose clock ran ahead released it) is taken over and kept.

    The id's row stays in its own day's partition, ahead of this worker's
    today; the turn's write still finds it there, commits the claim with the
    reply and stores the turn, in one statement.
    """
    engine = store.engine
    session_updates: list[str] = []
    for seen in store.engines:
        sa.event.listen(
            seen, "before_cursor_execute",
            lambda *a: session_updates.append(a[2]) if _writes_session(a[2]) else None,
        )
    ahead = _today() + timedelta(5)
    _put(engine, "ahead", ahead, datetime.now(timezone.utc) + timedelta(days=5), "released")
    _claimed_reply(store, "ahead", "s-ahead")
    assert len(session_updates) == 1, "the write was one statement"
    with store.claim("ahead") as again:
        assert not again.acquired and again.status == "done" and again.response == "answer"
    assert [m.content for m in store.get("s-ahead").history] == ["hello", "answer"]
    assert [day for _, day in _rows(engine, "ahead")] == [ahead]


def test_a_claim_row_moved_past_the_writers_tomorrow_by_another_clocks_purge_still_fences(
    store: Any,
) -> None:
    """A purge on a worker whose clock runs days ahead moves the claim's row past this one's day.

    The turn's write misses the row in the days it looks in first, then
    finds it wherever it is: the claim is committed with the reply, the turn
    stored, the row kept in the day the purge moved it to.
    """
    engine = store.engine
    old_day = _today() - timedelta(20)
    _put(engine, "far", old_day, datetime.now(timezone.utc) - timedelta(hours=2), "released")
    later = datetime.now(timezone.utc) + timedelta(days=3)  # within the dedup window
    cutoff = later - timedelta(hours=DEFAULT_DEDUP_TTL_HOURS)

    def purge_with_a_clock_ahead() -> None:
        with engine.begin() as conn:
            pg_claims.drop_expired_days(conn, cutoff, later)

    _claimed_reply(store, "far", "s-far", between=purge_with_a_clock_ahead)
    with store.claim("far") as again:
        assert not again.acquired and again.status == "done" and again.response == "answer"
    assert [m.content for m in store.get("s-far").history] == ["hello", "answer"]
    assert [day for _, day in _rows(engine, "far")] == [pg_claims.utc_day(later)]
