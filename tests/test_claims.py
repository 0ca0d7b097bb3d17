"""Webhook claims beyond the conformance kit: revision 0003 and where the fence runs.

The behaviour of ``store.claim`` on every backend is in the shipped suite
(``TestWebhookClaims*``); these tests cover what only the SQL stores have.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Role
from sqlalchemy import Engine, create_engine, event, text

from chatflow_sqlalchemy import ClaimLostError, SQLiteSessionStore, migrate
from chatflow_sqlalchemy.claims import _SYNC_RENEWALS, list_claims, release_claim
from chatflow_sqlalchemy.sql_claims import free_claim, read_claims

from .fakes import Recording
from .pg_util import writes_session as _writes_session


def _engine_at(url: str, revision: str) -> Any:
    engine = create_engine(url)
    migrate.upgrade(engine, revision)
    return engine


def _ids_recorded_before_0003(engine: Any) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO chatflow_processed_messages (message_id, processed_at) "
                "VALUES ('old-1', CURRENT_TIMESTAMP), ('old-2', CURRENT_TIMESTAMP)"
            )
        )


def _check_old_ids_are_done(store: Any) -> None:
    for old in ("old-1", "old-2"):
        with store.claim(old, session_id="s") as claim:
            assert (claim.acquired, claim.status, claim.response) == (False, "done", None)
        assert store.record_processed_message(old) is False
    assert {info.message_id: info.state for info in list_claims(store)} == {
        "old-1": "done", "old-2": "done"
    }


def test_sqlite_ids_recorded_before_0003_stay_claimed(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    engine = _engine_at(url, "0002")
    _ids_recorded_before_0003(engine)
    engine.dispose()
    with SQLiteSessionStore(tmp_path / "x.db") as store:  # opening upgrades to 0003
        assert migrate.drift(store.engine) == []
        _check_old_ids_are_done(store)


def test_sqlite_0003_downgrades_and_upgrades_again(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    with SQLiteSessionStore(tmp_path / "x.db") as store, store.claim("m", session_id="s") as claim:
        claim.response = "hi"
    engine = create_engine(url)
    migrate.downgrade(engine, "0002")
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT * FROM chatflow_processed_messages")).all()
    assert [row.message_id for row in rows] == ["m"]
    migrate.upgrade(engine)
    assert migrate.drift(engine) == []
    engine.dispose()


@pytest.mark.postgres
def test_postgres_ids_recorded_before_0003_stay_claimed(pg_url: str, pg_schema: str) -> None:
    from . import pg_util

    engine = create_engine(pg_url, connect_args={"options": f"-csearch_path={pg_schema}"})
    migrate.upgrade(engine, "0002")
    _ids_recorded_before_0003(engine)
    engine.dispose()
    with pg_util.schema_store(pg_url, pg_schema) as store:
        assert migrate.drift(store.engine) == []
        _check_old_ids_are_done(store)
        engine = store.engine
        migrate.downgrade(engine, "0002")
        migrate.upgrade(engine)
        assert migrate.drift(engine) == []


@pytest.mark.postgres
def test_postgres_fence_rides_in_the_turns_one_statement(pg_url: str, pg_schema: str) -> None:
    """No extra round trip: the fenced UPDATE is part of the turn's one write statement."""
    from . import pg_util

    statements: list[str] = []

    def record(*args: Any) -> None:
        statements.append(" ".join(args[2].split()))  # (conn, cursor, statement, ...)

    with pg_util.schema_store(pg_url, pg_schema) as store:
        event.listen(Engine, "before_cursor_execute", record)
        try:
            asyncio.run(_claimed_turn(store))
            first, statements[:] = list(statements), []
            taken = asyncio.run(_claimed_turn_taken_over(store))
        finally:
            event.remove(Engine, "before_cursor_execute", record)
    writes = [sql for sql in first if _writes_session(sql)]
    assert len(writes) == 1, first
    assert "UPDATE chatflow_processed_messages" in writes[0]
    assert "INSERT INTO chatflow_messages" in writes[0]
    # Taken over: the one statement changes nothing; the step-by-step write says why.
    writes = [sql for sql in statements if _writes_session(sql)]
    assert "UPDATE chatflow_processed_messages" in writes[0], statements
    assert taken == ["first"]


async def _claimed_turn(store: Any) -> None:
    ctx = await store.aget_or_create("s", Agent(name="Bot", instructions=""))
    async with store.claim("m1", session_id="s"), ctx.lock:
        ctx.add_message(Message(role=Role.USER, content="first"))


async def _claimed_turn_taken_over(store: Any) -> list[str | None]:
    ctx = await store.aget_or_create("s", Agent(name="Bot", instructions=""))

    async def redelivery() -> None:  # its own task and context, as another handler
        async with store.claim("m2", session_id="s") as thief:
            assert thief.acquired

    with pytest.raises(ClaimLostError):
        async with store.claim("m2", session_id="s", lease_seconds=30):
            assert release_claim(store, "m2")
            await asyncio.create_task(redelivery())
            async with ctx.lock:
                ctx.add_message(Message(role=Role.USER, content="lost"))
    return [m.content for m in ctx.history]


def test_operator_functions_on_a_plain_connection(tmp_path: Path) -> None:
    """What a CLI can call with its own (read-only, or write) connection, without a store."""
    with SQLiteSessionStore(tmp_path / "x.db") as store:
        with store.claim("done-id", session_id="s") as claim:
            claim.response = "hi"

        async def hold_and_inspect() -> None:
            async with store.claim("held-id", session_id="s") as held:
                with store.engine.connect() as conn:
                    states = {info.message_id: info for info in read_claims(conn, limit=None)}
                assert states["held-id"].state == "in_flight"
                assert states["done-id"].state == "done" and states["done-id"].has_response
                with store.engine.begin() as conn:
                    assert free_claim(conn, "held-id") is True
                    assert free_claim(conn, "done-id") is False
                held.response = "too late"

        with pytest.raises(ClaimLostError):
            asyncio.run(hold_and_inspect())
        with store.engine.connect() as conn:
            assert {i.message_id: i.state for i in read_claims(conn)} == {
                "held-id": "released", "done-id": "done"
            }


def test_sqlite_0003_downgrade_keeps_unprocessed_ids_retryable(tmp_path: Path) -> None:
    """A released (failed) or still-acquired claim was never processed: after a
    downgrade to 0002 (where any row means "processed forever") and back, its next
    delivery must still do the work, or the user's message is lost."""
    url = f"sqlite:///{tmp_path / 'x.db'}"
    with SQLiteSessionStore(tmp_path / "x.db") as store:
        with store.claim("done", session_id="s") as claim:
            claim.response = "hi"
        with pytest.raises(ValueError), store.claim("failed", session_id="s"):
            raise ValueError("turn failed")
        held = store.claim("held", session_id="s")
        held.__enter__()  # its worker dies here
        held._stop.set()  # and nothing of it stays behind in this thread:
        _SYNC_RENEWALS.discard(held)
        held._reset_var()
    engine = create_engine(url)
    migrate.downgrade(engine, "0002")
    migrate.upgrade(engine)
    engine.dispose()
    with SQLiteSessionStore(tmp_path / "x.db") as store:
        assert store.record_processed_message("done") is False
        for retried in ("failed", "held"):
            with store.claim(retried, session_id="s", lease_seconds=0.001) as claim:
                assert claim.acquired, retried


def test_a_committed_claim_is_not_reported_lost_by_its_renewal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After the turn committed the claim (state done) the renewal finds nothing to
    extend; that is not a lost lease, and the log must not say the turn was dropped."""

    async def main(store: Any) -> Any:
        ctx = await store.aget_or_create("s", Agent(name="Bot", instructions=""))
        claim = store.claim("m", session_id="s", lease_seconds=0.3)
        renewals: list[bool] = []
        renew = claim._backend.renew
        claim._backend.renew = lambda c: renewals.append(renew(c)) or renewals[-1]
        async with claim:
            async with ctx.lock:
                ctx.add_message(Message(role=Role.USER, content="hi"))
            for _ in range(600):  # until a renewal ran after the commit (a guard, no bound)
                if False in renewals:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.05)
            claim.response = "sent"
        return claim, [m.content for m in ctx.history]

    with SQLiteSessionStore(tmp_path / "x.db") as store:
        claim, history = asyncio.run(main(store))
        assert history == ["hi"]
        assert not claim.lost
        assert "lost its lease" not in caplog.text
        with store.claim("m", session_id="s") as again:
            assert (again.status, again.response) == ("done", "sent")


def test_a_handler_cancelled_while_acquiring_does_not_leave_the_id_held(tmp_path: Path) -> None:
    """A webhook handler cancelled (client gone) while its acquire runs on the I/O
    thread: the acquire still completes there; the claim it took must be given back,
    not left "in_flight" for a whole lease (holding the session's later claims too)."""
    import threading

    async def main(store: Any) -> Any:
        claim = store.claim("m", session_id="s", lease_seconds=600)
        started, go_on = threading.Event(), threading.Event()
        acquire = claim._backend.acquire

        def slow_acquire(c: Any) -> Any:
            started.set()
            go_on.wait(60)
            return acquire(c)

        claim._backend.acquire = slow_acquire
        entered: list[bool] = []

        async def handler() -> None:
            async with claim:
                entered.append(True)

        task = asyncio.create_task(handler())
        await asyncio.to_thread(started.wait, 60)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        go_on.set()
        del claim._backend.acquire
        for _ in range(600):  # until the late acquire was given back (a guard, no bound)
            if [i.state for i in list_claims(store)] == ["released"]:
                break
            await asyncio.sleep(0.05)
        async with store.claim("m", session_id="s") as retry:
            return entered, retry.acquired

    with SQLiteSessionStore(tmp_path / "x.db") as store:
        assert asyncio.run(main(store)) == ([], True)


@pytest.mark.postgres
def test_a_claimed_turn_on_a_session_erased_meanwhile_reports_the_deletion(
    pg_url: str, pg_schema: str
) -> None:
    """erase_user deletes the session and its claims while a claimed turn runs: its
    write changes nothing and says the session was deleted (not that the claim was
    taken over by another delivery)."""
    from chatflow_sqlalchemy import SessionDeletedError

    from . import pg_util

    bot = Agent(name="Bot", instructions="")
    with pg_util.schema_store(pg_url, pg_schema) as mine, \
            pg_util.schema_store(pg_url, pg_schema) as other:
        mine.get_or_create("s", bot, user_id="u")

        async def turn() -> None:
            ctx = await mine.aget_or_create("s", bot)
            async with mine.claim("m1", session_id="s"), ctx.lock:
                ctx.add_message(Message(role=Role.USER, content="hi"))
                assert other.erase_user("u") == 1

        with pytest.raises(SessionDeletedError):
            asyncio.run(turn())
        assert other.get("s") is None


def _echo_runner(store: Any) -> Any:
    """A Runner whose model answers ``"Bot re: <text>"``."""
    from chatflow_agent import Runner

    from chatflow_sqlalchemy.testing import ScriptedEngine

    return Runner(starting_agent=Agent(name="Bot", instructions=""), session_store=store,
                  engine=ScriptedEngine())


class _Statements:
    """Every statement any engine runs (the store's sync engine and its AsyncEngine)."""

    def __init__(self) -> None:
        self.sql: list[str] = []

    def __enter__(self) -> _Statements:
        event.listen(Engine, "before_cursor_execute", self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(Engine, "before_cursor_execute", self._record)

    def _record(self, _conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        self.sql.append(" ".join(statement.split()))

    def touching(self, table: str) -> list[str]:
        return [sql for sql in self.sql if table in sql]


async def _webhook(store: Any, runner: Any, mid: str, text: str) -> str | None:
    async with store.claim(mid, session_id="s") as claim:
        assert claim.acquired
        result = await runner.run_async(session_id="s", user_message=text)
        claim.response = result.content
        return claim.response


def test_a_claimed_runner_turns_reply_rides_in_its_write(store_opener: Any) -> None:
    """claim -> run_async -> ``claim.response = result.content``: the turn's write stores
    the reply with the claim, and the block's exit sends nothing after it."""
    store = store_opener()
    runner = _echo_runner(store)
    asyncio.run(_webhook(store, runner, "warm-up", "hello"))
    with _Statements() as seen:
        assert asyncio.run(_webhook(store, runner, "m1", "again")) == "Bot re: again"
    claim_rows = seen.touching("chatflow_processed_messages")
    assert "INSERT INTO chatflow_processed_messages" in claim_rows[0].split(")")[0], seen.sql
    fence = [n for n, sql in enumerate(seen.sql) if "UPDATE chatflow_processed_messages" in sql]
    assert len(fence) == 1, seen.sql  # the fence in the turn's write, no UPDATE at the exit
    assert "chatflow_processed_messages" not in " ".join(seen.sql[fence[0] + 1:]), seen.sql
    fresh = store_opener()
    with fresh.claim("m1", session_id="s") as again:
        assert (again.status, again.response) == ("done", "Bot re: again")
    assert [m.content for m in fresh.get("s").history][-2:] == ["again", "Bot re: again"]


def _claimed_turn_then(store: Any, mid: str, turn: Any, reply: Any = None) -> None:
    """A claimed turn that ``turn(ctx)`` fills, then the block fails (the send, say)."""

    async def main() -> None:
        ctx = await store.aget_or_create("s", Agent(name="Bot", instructions=""))
        with pytest.raises(RuntimeError, match="the send failed"):
            async with store.claim(mid, session_id="s"):
                async with ctx.lock:
                    turn(ctx)
                raise RuntimeError("the send failed")

    asyncio.run(main())


def _stored_reply(store: Any, mid: str) -> tuple[str, str | None]:
    with store.claim(mid, session_id="s") as again:
        return again.status, again.response


def test_a_turn_without_an_answer_of_its_own_stores_no_reply(store_opener: Any) -> None:
    """Only a model answer the turn added is its reply: a turn that only changed
    metadata (after an answered turn) must not store the earlier answer."""
    store = store_opener()

    def answered(ctx: Any) -> None:
        ctx.add_message(Message(role=Role.USER, content="balance?"))
        ctx.add_message(Message(role=Role.MODEL, content="Your balance is $10"))

    _claimed_turn_then(store, "m1", answered)
    _claimed_turn_then(store, "m2", lambda ctx: ctx.metadata.update(read=True))
    assert _stored_reply(store, "m1") == ("done", "Your balance is $10")
    assert _stored_reply(store, "m2") == ("done", None)


def test_a_claimed_turn_whose_reply_holds_nul_is_not_written(store_opener: Any) -> None:
    """PostgreSQL text cannot hold NUL, so no claim can store such a reply: the turn
    is refused before it is written (on every backend alike), rather than committed
    with its claim done and the reply lost (more in ``test_bad_input.py``)."""
    store = store_opener()

    async def main() -> None:
        ctx = await store.aget_or_create("s", Agent(name="Bot", instructions=""))
        with pytest.raises(ValueError, match="NUL"):
            async with store.claim("m1", session_id="s"), ctx.lock:
                ctx.add_message(Message(role=Role.USER, content="hi"))
                ctx.add_message(Message(role=Role.MODEL, content="a\x00b"))

    asyncio.run(main())
    assert store_opener().get("s") is None  # nothing written: a failed first turn leaves none
    with store.claim("m1", session_id="s") as again:
        assert again.acquired


def test_an_encrypting_store_keeps_the_turns_reply_out_of_the_claim_row(tmp_path: Path) -> None:
    """With ``cipher=`` the model's answer is stored encrypted only: the claim row's
    reply is what the block itself stores there (none here)."""
    from chatflow_sqlalchemy.crypto import AESGCMCipher

    cipher = AESGCMCipher(keys={"k1": bytes(range(32))}, primary="k1")
    with SQLiteSessionStore(tmp_path / "x.db", cipher=cipher, require_encryption=True) as store:
        def answered(ctx: Any) -> None:
            ctx.add_message(Message(role=Role.USER, content="card?"))
            ctx.add_message(Message(role=Role.MODEL, content="SECRET card 4111"))

        _claimed_turn_then(store, "m1", answered)
        with store.engine.connect() as conn:
            row = conn.execute(text(
                "SELECT state, response FROM chatflow_processed_messages WHERE message_id = 'm1'"
            )).one()
        assert tuple(row) == ("done", None)


def test_a_claim_that_waited_for_an_earlier_one_catches_up_with_its_turn(
    store_opener: Any,
) -> None:
    """Another worker's earlier claim of the session held this one back: the version read
    with the acquire is old by then, so the lookup checks again and the turn sees the
    earlier turn's messages."""
    first_store, second_store = store_opener(), store_opener()
    first_runner, second_runner = _echo_runner(first_store), _echo_runner(second_store)
    asyncio.run(_webhook(second_store, second_runner, "warm-up", "hello"))
    second_runner.engine = recording = Recording()

    async def both() -> None:
        entered = asyncio.Event()

        async def earlier() -> None:
            async with first_store.claim("a", session_id="s") as claim:
                entered.set()
                await asyncio.sleep(0.02)  # the later claim is taken meanwhile, and waits
                result = await first_runner.run_async(session_id="s", user_message="first")
                claim.response = result.content

        async def later() -> None:
            await entered.wait()
            async with second_store.claim("b", session_id="s") as claim:
                result = await second_runner.run_async(session_id="s", user_message="second")
                claim.response = result.content

        await asyncio.gather(earlier(), later())

    asyncio.run(both())
    assert recording.seen[-1][-3:] == ["first", "Bot re: first", "second"]


def _lease_owner(store: Any, session_id: str) -> Any:
    with store.engine.connect() as conn:
        return conn.execute(
            text("SELECT lease_owner FROM chatflow_sessions WHERE session_id = :s"),
            {"s": session_id},
        ).scalar()


@pytest.mark.postgres
def test_a_claimed_turn_takes_its_lease_with_the_claim_on_postgres(
    pg_url: str, pg_schema: str
) -> None:
    """Claim, lease and catch-up are one statement; the write gives the lease back."""
    from . import pg_util

    with pg_util.schema_store(pg_url, pg_schema) as store:
        runner = _echo_runner(store)
        asyncio.run(_webhook(store, runner, "warm-up", "hello"))
        with _Statements() as seen:
            assert asyncio.run(_webhook(store, runner, "m1", "again")) == "Bot re: again"
        takes = [sql for sql in seen.sql if "lease_fence=(chatflow_sessions.lease_fence" in sql]
        assert len(takes) == 1 and takes[0].startswith("WITH acquired AS"), seen.sql
        assert _lease_owner(store, "s") is None


@pytest.mark.parametrize("fails", [False, True])
def test_a_claim_block_without_a_turn_leaves_the_session_free(
    store_opener: Any, fails: bool
) -> None:
    """The lease a claim took for its session goes back with the claim, turn or not."""
    store, other = store_opener(), store_opener()
    store.get_or_create("s", Agent(name="Bot", instructions=""))

    async def block() -> None:
        async with store.claim("m-free", session_id="s") as claim:
            assert claim.acquired
            if fails:
                raise RuntimeError("the handler failed before its turn")

    if fails:
        with pytest.raises(RuntimeError):
            asyncio.run(block())
    else:
        asyncio.run(block())
    assert _lease_owner(store, "s") is None

    async def other_turn() -> None:
        async with other.get_or_create("s", Agent(name="Bot", instructions="")).lock:
            pass

    asyncio.run(asyncio.wait_for(other_turn(), 10))


def test_a_claimed_turn_waits_for_another_stores_turn_and_sees_it(store_opener: Any) -> None:
    """The claim cannot take a held lease: its turn takes it after the other turn ends."""
    holder, store = store_opener(), store_opener()
    bot = Agent(name="Bot", instructions="")
    holder.get_or_create("s", bot)

    async def both() -> list[str | None]:
        entered, seen = asyncio.Event(), []

        async def hold() -> None:
            async with (ctx := holder.get_or_create("s", bot)).lock:
                ctx.add_message(Message(role=Role.USER, content="first"))
                entered.set()
                await asyncio.sleep(0.5)

        async def claimed() -> None:
            await entered.wait()
            async with store.claim("m-wait", session_id="s") as claim:
                assert claim.acquired
                async with (ctx := store.get_or_create("s", bot)).lock:
                    seen.extend(m.content for m in ctx.history)
                    ctx.add_message(Message(role=Role.USER, content="second"))

        await asyncio.gather(hold(), claimed())
        return seen

    assert asyncio.run(asyncio.wait_for(both(), 30)) == ["first"]
    assert [m.content for m in store_opener().get("s").history] == ["first", "second"]
    assert _lease_owner(store, "s") is None


@pytest.mark.postgres
def test_a_claims_lease_gone_stale_before_its_turn_is_renewed_first(
    pg_url: str, pg_schema: str
) -> None:
    """A block that runs a third of a lease before its turn: the lease is renewed, kept."""
    from . import pg_util

    store = pg_util.schema_store(pg_url, pg_schema, turn_lease_seconds=0.6)
    bot = Agent(name="Bot", instructions="")
    store.get_or_create("s", bot)

    async def block() -> None:
        async with store.claim("m-stale", session_id="s"):
            await asyncio.sleep(0.4)
            async with (ctx := store.get_or_create("s", bot)).lock:
                ctx.add_message(Message(role=Role.USER, content="late"))

    with _Statements() as seen:
        asyncio.run(block())
    takes = [sql for sql in seen.sql if "lease_fence=(chatflow_sessions.lease_fence" in sql]
    renewals = [
        sql for sql in seen.sql if sql.startswith("UPDATE chatflow_sessions SET lease_expires_at")
    ]
    assert len(takes) == 1 and len(renewals) == 1, seen.sql  # taken with the claim, renewed
    assert [m.content for m in store.get("s").history] == ["late"]
    assert _lease_owner(store, "s") is None
    store.close()


@pytest.mark.postgres
def test_the_claims_statement_sets_only_the_leases_columns_of_the_session(
    pg_url: str, pg_schema: str
) -> None:
    """Execution parameters named like a session column must not join the lease's SET.

    SQLAlchemy adds a DML's SET columns from the execution's parameter names,
    also inside a ``WITH``: the acquire's ``session_id`` would rewrite the key.
    """
    import re

    from . import pg_util

    with pg_util.schema_store(pg_url, pg_schema) as store:
        store.get_or_create("s", Agent(name="Bot", instructions=""))

        async def block() -> None:
            async with store.claim("m-set", session_id="s"):
                pass

        with _Statements() as seen:
            asyncio.run(block())
    (acquire,) = [sql for sql in seen.sql if sql.startswith("WITH acquired AS")]
    update = acquire[acquire.index("UPDATE chatflow_sessions SET") :]
    sets = re.findall(r"(\w+)=", update[: update.index(" WHERE ")])
    assert sets == ["session_id", "lease_owner", "lease_fence", "lease_expires_at"], update


def test_another_tasks_turn_uses_the_lease_a_claim_took(store_opener: Any) -> None:
    """A claim holds its session's lease before its turn: another task's turn on the
    session (or the claim's turn run where the claim is not in context) takes it over
    rather than wait for it to expire."""
    store = store_opener()
    bot = Agent(name="Bot", instructions="")
    store.get_or_create("s", bot)
    store.turns.leases.lease_seconds = 600.0  # waiting it out would outlast the test

    async def both() -> None:
        claimed = asyncio.Event()

        async def block() -> None:
            async with store.claim("m-inv", session_id="s") as claim:
                assert claim.acquired
                claimed.set()
                await asyncio.sleep(0.3)  # the handler fetches media first, say
                async with (ctx := store.get_or_create("s", bot)).lock:
                    ctx.add_message(Message(role=Role.USER, content="claimed"))

        async def other() -> None:
            await claimed.wait()
            async with (ctx := store.get_or_create("s", bot)).lock:
                ctx.add_message(Message(role=Role.USER, content="other"))

        await asyncio.gather(block(), other())

    asyncio.run(asyncio.wait_for(both(), 30))
    assert sorted(m.content or "" for m in store_opener().get("s").history) == [
        "claimed", "other",
    ]
    assert _lease_owner(store, "s") is None


@pytest.mark.postgres
def test_a_claim_never_waits_for_a_session_row_locked_elsewhere(
    pg_url: str, pg_schema: str
) -> None:
    """``erase_user`` and ``sweep`` lock the session row before its claims; the claim's
    acquire, which locks its claim row first, must not wait for the session's (a deadlock)."""
    import threading

    from . import pg_util

    with pg_util.schema_store(pg_url, pg_schema) as store:
        store.get_or_create("s", Agent(name="Bot", instructions=""))
        outcome: list[Any] = []

        def claim_it() -> None:
            with store.claim("m-locked", session_id="s") as claim:
                outcome.append(claim.acquired)

        with store.engine.connect() as locker, locker.begin():
            locker.execute(
                text("SELECT 1 FROM chatflow_sessions WHERE session_id = 's' FOR UPDATE")
            )
            thread = threading.Thread(target=claim_it)
            thread.start()
            thread.join(20)
            assert outcome == [True], "the acquire waited on the locked session row"


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_turn_ending_after_its_claim_block_stores_no_reply_with_it(kind: str) -> None:
    """A turn begun in a claim block and ended after it is a turn of no claim.

    Its answer is not a claim's reply, so text a claim could not store does
    not fail it: every store keeps the turn, the in-memory one as the SQL ones.
    """
    from chatflow_sqlalchemy import SessionStore

    store: Any = SessionStore() if kind == "memory" else SQLiteSessionStore(":memory:")
    try:
        ctx = await store.aget_or_create("s", Agent(name="Bot", instructions=""))
        lock = ctx.lock
        async with store.claim("m1", session_id="s"):
            await lock.__aenter__()
            await ctx.aadd_message(Message(role=Role.USER, content="hi"))
            await ctx.aadd_message(Message(role=Role.MODEL, content="no\x00reply for a claim"))
        await lock.__aexit__(None, None, None)
        assert [m.role for m in store.get("s").history] == [Role.USER, Role.MODEL]
    finally:
        await store.aclose()
