"""The durable inbox under faults and edge cases, on real databases.

Each test states the guarantee it checks (DESIGN "Durable inbox", docs/inbox.md):
stops and lost leases at awkward moments, key rotation, erasure, handles that
misbehave, and turns that meet a batch. Generic cases run on the in-memory store too.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from chatflow_agent import Agent, Role, Runner
from sqlalchemy import create_engine, make_url, text

from chatflow_sqlalchemy import SessionStore, SQLiteSessionStore
from chatflow_sqlalchemy import open_store as open_url
from chatflow_sqlalchemy.crypto import AESGCMCipher
from chatflow_sqlalchemy.inbox import InboxBatch, InboxReply
from chatflow_sqlalchemy.testing.claim_workers import ReplyModel, reply_to

from . import pg_util

_FAST = {"coalesce_seconds": 0.0, "retry_seconds": 0.0}
_HANG_GUARD = 60.0
_K1 = bytes(range(32))
_K2 = bytes(range(32, 64))


def _mariadb_database(stack: ExitStack) -> str:
    """A new MariaDB database for this test (dropped after it); skip if none is configured."""
    pytest.importorskip("chatflow_sqlalchemy_mariadb")  # the lowest-versions run has no plugin
    raw = os.environ.get("CHATFLOW_TEST_MARIADB_URL")
    if not raw:
        pytest.skip("CHATFLOW_TEST_MARIADB_URL is unset")
    name = f"t_{uuid.uuid4().hex}"
    admin = create_engine(raw, isolation_level="AUTOCOMMIT")
    stack.callback(admin.dispose)
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))

    stack.callback(drop)
    return make_url(raw).set(database=name).render_as_string(hide_password=False)


_SQL = [
    "sqlite",
    pytest.param("postgresql", marks=pytest.mark.postgres),
    pytest.param("mariadb", marks=pytest.mark.mariadb),
]


def _opener(kind: str, stack: ExitStack, tmp_path: Path) -> Callable[..., Any]:
    """Opens stores with the given options on this test's one database of ``kind``."""
    if kind == "memory":
        memory = stack.enter_context(SessionStore())
        return lambda: memory
    if kind == "sqlite":
        return lambda **options: stack.enter_context(
            SQLiteSessionStore(tmp_path / "x.db", **options))
    if kind == "mariadb":
        url = _mariadb_database(stack)
        return lambda **options: stack.enter_context(open_url(url, **options))
    pg = pg_util.postgres_url()
    schema = stack.enter_context(pg_util.fresh_schema(pg))
    return lambda **options: stack.enter_context(pg_util.schema_store(pg, schema, **options))


@pytest.fixture(params=_SQL)
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """Opens SQL stores with the given options on one database per test."""
    with ExitStack() as stack:
        yield _opener(request.param, stack, tmp_path)


@pytest.fixture(params=[*_SQL, "memory"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """Like ``open_store`` for a single store, the in-memory store too (generic inbox code)."""
    with ExitStack() as stack:
        yield _opener(request.param, stack, tmp_path)


def _runner(store: Any) -> Runner:
    return Runner(starting_agent=Agent(name="Bot", instructions=""), session_store=store,
                  engine=ReplyModel())


def _turn(runner: Runner) -> Callable[[InboxBatch], Any]:
    async def handle(batch: InboxBatch) -> str:
        result = await runner.run_async(session_id=batch.session_id, user_message=batch.text)
        return str(result.content)

    return handle


async def _states(store: Any) -> dict[str, str]:
    return {e.message_id: e.state for e in await store.inbox.aentries(limit=None)}


async def _until(check: Callable[[], Any], what: str, guard: float = _HANG_GUARD) -> None:
    """Wait until the awaitable ``check()`` is truthy (a hang guard, never a timing)."""
    deadline = time.monotonic() + guard
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"hang guard: {what} did not happen within {guard}s")
        await asyncio.sleep(0.02)


async def _reached(store: Any, states: dict[str, str]) -> bool:
    found = await _states(store)
    return all(found.get(mid) == state for mid, state in states.items())


async def _settled(store: Any, ids: list[str]) -> bool:
    """Every message of ``ids`` is in a final state (done, sent or dead)."""
    found = await _states(store)
    return all(found.get(mid) in ("done", "sent", "dead") for mid in ids)


async def _serve_until(store: Any, handle: Any, states: dict[str, str], **options: Any) -> None:
    serving = asyncio.ensure_future(store.inbox.serve(handle, **{**_FAST, **options}))
    try:
        await _until(lambda: _reached(store, states), f"states {states}")
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


async def _stop(*tasks: asyncio.Future[Any]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _user_texts(store: Any, session_id: str) -> list[Any]:
    ctx = store.get(session_id)
    return [] if ctx is None else [m.content for m in ctx.history if m.role == Role.USER]


# --------------------------------------------------------------------------- deadlock


def test_a_local_turn_queued_on_the_session_does_not_deadlock_the_batch(
    any_store: Any,
) -> None:
    """A turn of another task on a session a batch holds runs, and so does the batch's.

    A proactive message or an admin endpoint may start a turn while ``handle`` is busy.
    That turn uses the batch's lease instead of waiting for it while holding the
    session's lock, which the batch's own turn would then wait for: a deadlock."""
    store = any_store()
    store.inbox.put("m1", session_id="alice", text="hello")
    runner = _runner(store)

    async def scenario() -> None:
        in_handle, go = asyncio.Event(), asyncio.Event()

        async def handle(batch: InboxBatch) -> str:
            in_handle.set()
            await go.wait()  # e.g. downloading the message's media before the turn
            result = await runner.run_async(session_id=batch.session_id,
                                            user_message=batch.text)
            return str(result.content)

        serving = asyncio.ensure_future(store.inbox.serve(handle, **_FAST))
        other: asyncio.Future[Any] | None = None
        try:
            await asyncio.wait_for(in_handle.wait(), _HANG_GUARD)
            other = asyncio.ensure_future(
                runner.run_async(session_id="alice", user_message="proactive"))
            await asyncio.sleep(0.3)  # the other turn is in session.lock, polling the lease
            go.set()
            await _until(lambda: _reached(store, {"m1": "done"}), "the batch's answer")
            await asyncio.wait_for(asyncio.shield(other), _HANG_GUARD)
        finally:
            await _stop(serving, *([other] if other is not None else []))

    asyncio.run(scenario())
    assert sorted(_user_texts(store, "alice")) == ["hello", "proactive"]


# --------------------------------------------------------------------------- key rotation


def _cipher(*keys: str) -> AESGCMCipher:
    known = {"k1": _K1, "k2": _K2}
    return AESGCMCipher(keys={key: known[key] for key in keys}, primary=keys[0])


def test_rotating_keys_then_dropping_the_old_one_keeps_pending_messages(
    open_store: Any,
) -> None:
    """A message pending across a key rotation is answered after the old key is dropped.

    ``rotate_keys`` re-seals the inbox like the rest of the store, so the documented
    rotation (add the new key, rotate, drop the old one) never turns a waiting message
    into an unreadable one that dies unanswered."""
    before = open_store(cipher=_cipher("k1"))
    before.inbox.put("m1", session_id="alice", text="hello")
    rotated = open_store(cipher=_cipher("k2", "k1"))
    rotated.rotate_keys()
    after = open_store(cipher=_cipher("k2"))
    seen: list[InboxBatch] = []

    async def handle(batch: InboxBatch) -> None:
        seen.append(batch)

    async def scenario() -> None:
        serving = asyncio.ensure_future(after.inbox.serve(handle, **_FAST))
        try:
            await _until(lambda: _settled(after, ["m1"]), "m1 settled")
        finally:
            await _stop(serving)

    asyncio.run(scenario())
    (entry,) = after.inbox.entries(limit=None)
    assert (entry.state, entry.error) == ("done", None)
    assert [b.text for b in seen] == ["hello"]


async def _leave_reply_unsent(store: Any, message_id: str) -> None:
    """Serve until ``send`` is called for ``message_id``, then stop serve (a deploy):
    the turn committed its reply, and the reply was never sent."""
    runner, sending = _runner(store), asyncio.Event()

    async def send(reply: InboxReply) -> None:
        sending.set()
        await asyncio.sleep(3600)

    serving = asyncio.ensure_future(store.inbox.serve(_turn(runner), send=send, **_FAST))
    try:
        await asyncio.wait_for(sending.wait(), _HANG_GUARD)
    finally:
        await _stop(serving)
    assert (await _states(store))[message_id] == "in_flight"


def test_an_unsent_reply_under_a_retired_key_does_not_stall_its_session(
    open_store: Any,
) -> None:
    """A reply left unsent across a key rotation does not stall its session.

    The session's stored, unsent reply must stay readable or die with its reason; it
    must never make every new batch of the session fail, or the session's new messages
    would be retried for ever and never answered."""
    before = open_store(cipher=_cipher("k1"))
    before.inbox.put("m1", session_id="alice", text="hello")
    asyncio.run(_leave_reply_unsent(before, "m1"))
    open_store(cipher=_cipher("k2", "k1")).rotate_keys()
    after = open_store(cipher=_cipher("k2"))
    after.inbox.put("m2", session_id="alice", text="are you there?")
    sent: list[InboxReply] = []

    async def send(reply: InboxReply) -> None:
        sent.append(reply)

    async def scenario() -> None:
        serving = asyncio.ensure_future(
            after.inbox.serve(_turn(_runner(after)), send=send, **_FAST))
        try:
            await _until(lambda: _settled(after, ["m2"]), "m2 settled")
        finally:
            await _stop(serving)

    asyncio.run(scenario())
    assert [reply.message_ids for reply in sent][-1] == ("m2",)


# --------------------------------------------------------------------------- cancellation


def test_stopping_serve_while_it_sends_a_recovered_reply_does_not_count_new_messages(
    any_store: Any,
) -> None:
    """A stop while a recovered reply is sent does not count the session's new messages.

    A batch first sends what a previous holder answered and left unsent. If ``serve``
    stops there (a deploy), the new messages taken with it go back uncounted, as for a
    stop during ``handle``, so even with ``max_attempts=1`` they are answered later."""
    store = any_store()
    store.inbox.put("m1", session_id="alice", text="first")
    asyncio.run(_leave_reply_unsent(store, "m1"))
    store.inbox.put("m2", session_id="alice", text="second")
    seen: list[InboxBatch] = []

    async def scenario() -> None:
        sending = asyncio.Event()

        async def slow_send(reply: InboxReply) -> None:
            sending.set()
            await asyncio.sleep(3600)

        async def handle(batch: InboxBatch) -> None:
            seen.append(batch)

        serving = asyncio.ensure_future(
            store.inbox.serve(handle, send=slow_send, max_attempts=1, **_FAST))
        try:
            await asyncio.wait_for(sending.wait(), _HANG_GUARD)  # m1's reply, recovered
        finally:
            await _stop(serving)  # a deploy
        assert seen == []

        async def send(reply: InboxReply) -> None:
            pass

        serving = asyncio.ensure_future(
            store.inbox.serve(handle, send=send, max_attempts=1, **_FAST))
        try:
            await _until(lambda: _settled(store, ["m1", "m2"]), "m1 and m2 settled")
        finally:
            await _stop(serving)

    asyncio.run(scenario())
    states = {e.message_id: (e.state, e.error) for e in store.inbox.entries(limit=None)}
    assert states["m2"] == ("done", None)
    assert [b.message_ids for b in seen] == [("m2",)]


def test_stopping_serve_while_it_gives_a_lease_back_waits_for_the_give_back(
    tmp_path: Path,
) -> None:
    """serve returns only once the work it shields from its stop is done: no task of
    the inbox outlives it (an app's lifespan checks that its workers left nothing).

    The lease's give-back runs on a pool thread held at a gate; serve is stopped
    meanwhile. The gate opens only after serve had many loop iterations to return."""
    store = SQLiteSessionStore(tmp_path / "x.db")
    store.inbox.put("m1", session_id="alice", text="hello")
    rows = store.inbox.rows
    original, entered, gate, given_back = rows.release, threading.Event(), threading.Event(), []

    def gated_release(lease: Any) -> None:
        entered.set()
        gate.wait(_HANG_GUARD)
        original(lease)
        given_back.append(lease.session_id)

    rows.release = gated_release

    async def handle(batch: InboxBatch) -> str:
        return "hi"

    async def open_gate_later() -> None:
        for _ in range(200):  # loop iterations, not time: serve, if it does not wait, is done
            await asyncio.sleep(0)
        gate.set()

    async def scenario() -> None:
        before = asyncio.all_tasks()
        serving = asyncio.ensure_future(store.inbox.serve(handle, **_FAST))
        try:
            await _until(lambda: asyncio.sleep(0, entered.is_set()), "the give-back")
            opener = asyncio.ensure_future(open_gate_later())
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            assert given_back == ["alice"], "serve returned before the lease was given back"
            await opener
            assert asyncio.all_tasks() == before, "a task of serve outlived it"
        finally:
            gate.set()
            await _stop(serving)

    try:
        asyncio.run(scenario())
    finally:
        store.close()


# --------------------------------------------------------------------------- data governance


def _inbox_texts(store: Any, session_id: str) -> list[str]:
    with store.engine.connect() as conn:
        return list(conn.execute(
            text("SELECT text FROM chatflow_inbox WHERE session_id = :s ORDER BY id"),
            {"s": session_id},
        ).scalars())


def test_erase_user_erases_the_users_inbox_messages(open_store: Any) -> None:
    """``erase_user`` erases the user's inbox messages along with their sessions.

    The inbox keeps the user's own words (a dead message until retried, an answered one
    for the dedup window); erasure that left them behind would not be erasure."""
    store = open_store()
    bot = Agent(name="Bot", instructions="")
    runner = _runner(store)
    store.inbox.put("m1", session_id="alice", text="my address is 1 Main St")

    async def handle(batch: InboxBatch) -> str:
        await store.aget_or_create(batch.session_id, bot, user_id="u-alice")
        if "card" in batch.text:
            raise RuntimeError("the model is down")
        result = await runner.run_async(session_id=batch.session_id, user_message=batch.text)
        return str(result.content)

    async def scenario() -> None:
        await _serve_until(store, handle, {"m1": "done"})
        await store.inbox.aput("m2", session_id="alice", text="and my card is 4111")
        await _serve_until(store, handle, {"m2": "dead"}, max_attempts=1)

    asyncio.run(scenario())
    assert store.erase_user("u-alice") == 1
    assert store.get("alice") is None
    assert _inbox_texts(store, "alice") == []


# --------------------------------------------------------------------------- retry


def test_retry_of_a_batch_that_died_with_its_worker_brings_its_whole_batch_back(
    open_store: Any,
) -> None:
    """Retrying a message whose batch died with its stalled worker brings the whole batch back.

    A batch whose worker lapsed on its last attempt is made dead by the next holder.
    That is the poison-message case an operator retries after a fix, so ``retry`` must
    restore the rest of the batch too, as docs/inbox.md promises."""
    stalled = open_store(turn_lease_seconds=0.5)
    taker = open_store(turn_lease_seconds=0.5)
    for mid in ("m1", "m2"):
        stalled.inbox.put(mid, session_id="alice", text=mid)
    entered, stop = threading.Event(), threading.Event()

    async def freeze(batch: InboxBatch) -> None:
        entered.set()
        time.sleep(1.5)  # a blocking call freezes this worker's loop: its lease lapses

    def run_stalled_worker() -> None:
        async def main() -> None:
            serving = asyncio.ensure_future(stalled.inbox.serve(freeze, max_attempts=1, **_FAST))
            while not stop.is_set():
                await asyncio.sleep(0.02)
            await _stop(serving)

        asyncio.run(main())

    worker = threading.Thread(target=run_stalled_worker)
    worker.start()
    try:
        assert entered.wait(_HANG_GUARD)

        async def never(batch: InboxBatch) -> None:
            raise AssertionError("the batch was on its last attempt")

        asyncio.run(_serve_until(taker, never, {"m1": "dead", "m2": "dead"}, max_attempts=1))
    finally:
        stop.set()
        worker.join(_HANG_GUARD)
    assert taker.inbox.retry("m1") is True
    assert {e.message_id: e.state for e in taker.inbox.entries(limit=None)} == {
        "m1": "pending", "m2": "pending"}


# --------------------------------------------------------------------------- parity


def test_clear_treats_the_inbox_alike_on_sql_and_in_memory(tmp_path: Path) -> None:
    """``clear()`` treats the inbox alike on the SQL and in-memory stores.

    Both keep it (as they keep the processed webhook ids); only ``close()`` forgets the
    in-memory store's inbox. Code tested on one store then behaves the same on the other."""
    left = {}
    with SQLiteSessionStore(tmp_path / "x.db") as sql, SessionStore() as memory:
        for name, store in (("sql", sql), ("memory", memory)):
            store.inbox.put("m1", session_id="alice", text="hello")
            store.clear()
            left[name] = [e.message_id for e in store.inbox.entries(limit=None)]
    assert left["sql"] == left["memory"]


def test_a_stop_landing_as_send_returns_does_not_send_the_reply_again(tmp_path: Path) -> None:
    """A stop of ``serve`` landing just as ``send`` returns does not send the reply again.

    The record that the reply was sent is shielded from the stop, even while it waits
    for a busy pool. A deploy is not a crash: only a killed worker may send twice."""
    store = SQLiteSessionStore(tmp_path / "x.db")
    store.inbox.put("m1", session_id="alice", text="hello")
    sent: list[InboxReply] = []
    gate = threading.Event()
    blockers: list[asyncio.Future[Any]] = []

    async def scenario() -> None:
        serving: asyncio.Future[None]

        async def send(reply: InboxReply) -> None:
            sent.append(reply)
            if len(sent) == 1:  # the store's pool is busy (other batches' statements) ...
                for _ in range(8):
                    blockers.append(asyncio.ensure_future(
                        store.inbox.rows.run(gate.wait, _HANG_GUARD)))
                await asyncio.sleep(0.2)
                asyncio.get_running_loop().call_later(0.5, gate.set)
                serving.cancel()  # ... as the deploy stops serve

        serving = asyncio.ensure_future(
            store.inbox.serve(_turn(_runner(store)), send=send, **_FAST))
        await asyncio.gather(serving, *blockers, return_exceptions=True)
        await _serve_until(store, _turn(_runner(store)), {"m1": "sent"}, send=send)

    with store:
        asyncio.run(scenario())
        assert [reply.message_ids for reply in sent] == [("m1",)]


# --------------------------------------------------------------------------- the batch's context


def test_a_task_handle_spawned_runs_its_later_turn_under_its_own_lease(any_store: Any) -> None:
    """A task started in ``handle`` that outlives the batch runs its turn on its own lease.

    Tasks copy the context that lets turns find their batch. A later turn of such a
    task (a delayed follow-up) must take the session's lease as any turn does, not reuse
    the batch's released one and be lost with ``LeaseLostError``."""
    store = any_store()
    store.inbox.put("m1", session_id="alice", text="hello")
    runner = _runner(store)
    follow_ups: list[asyncio.Task[Any]] = []

    async def scenario() -> None:
        later = asyncio.Event()

        async def follow_up(session_id: str) -> Any:
            await later.wait()
            return await runner.run_async(session_id=session_id, user_message="follow-up")

        async def handle(batch: InboxBatch) -> str:
            result = await runner.run_async(session_id=batch.session_id,
                                            user_message=batch.text)
            follow_ups.append(asyncio.ensure_future(follow_up(batch.session_id)))
            return str(result.content)

        await _serve_until(store, handle, {"m1": "done"})
        later.set()
        await asyncio.wait_for(follow_ups[0], _HANG_GUARD)

    asyncio.run(scenario())
    assert _user_texts(store, "alice") == ["hello", "follow-up"]


def test_a_turn_begun_while_the_batch_sends_its_reply_takes_its_own_lease(
    any_store: Any,
) -> None:
    """A turn begun after ``handle`` returned, while the batch still sends, waits for the lease.

    The batch keeps the session's lease until its reply is sent. A turn of another task
    begun then (here from ``send``) must wait for the batch to give the lease back and
    take its own, not use the batch's: the batch's release would take it from under the
    turn, whose write would then be lost with ``LeaseLostError``."""
    store = any_store()
    store.inbox.put("m1", session_id="alice", text="hello")
    follow_ups: list[asyncio.Task[Any]] = []

    async def scenario() -> None:
        serve_over = asyncio.Event()

        async def after_the_batch() -> None:
            if follow_ups:  # the follow-up's model call outlasts the batch's release
                await serve_over.wait()
                await asyncio.sleep(0.3)

        runner = Runner(starting_agent=Agent(name="Bot", instructions=""), session_store=store,
                        engine=ReplyModel(before_reply=after_the_batch))

        async def send(reply: InboxReply) -> None:
            follow_ups.append(asyncio.ensure_future(
                runner.run_async(session_id="alice", user_message="follow-up")))
            await asyncio.sleep(0.1)  # the follow-up's turn begins while the batch sends

        await _serve_until(store, _turn(runner), {"m1": "sent"}, send=send)
        serve_over.set()
        await asyncio.wait_for(follow_ups[0], _HANG_GUARD)

    asyncio.run(scenario())
    assert _user_texts(store, "alice") == ["hello", "follow-up"]


def test_one_stalled_session_does_not_starve_the_others(open_store: Any) -> None:
    """A session with an unsent reply from before a key rotation does not starve the others.

    With ``concurrency=1`` the oldest ready session is tried first. If its batch could
    not be opened it would take the only slot at every poll, and another user's message
    (here bob's) would never be answered."""
    before = open_store(cipher=_cipher("k1"))
    before.inbox.put("a1", session_id="alice", text="hello")
    asyncio.run(_leave_reply_unsent(before, "a1"))
    open_store(cipher=_cipher("k2", "k1")).rotate_keys()
    after = open_store(cipher=_cipher("k2"))
    after.inbox.put("b1", session_id="bob", text="hi, I am bob")

    async def send(reply: InboxReply) -> None:
        pass

    async def scenario() -> None:
        serving = asyncio.ensure_future(after.inbox.serve(
            _turn(_runner(after)), send=send, concurrency=1, **_FAST))
        try:
            await _until(lambda: _settled(after, ["b1"]), "b1 settled")
        finally:
            await _stop(serving)

    asyncio.run(scenario())
    assert _user_texts(after, "bob") == ["hi, I am bob"]


def test_an_empty_reply_is_not_sent(any_store: Any) -> None:
    """An empty reply is recorded as done and not sent.

    A model that answers with no text yields ``""``; a platform refuses an empty
    message, so sending it would only be retried until dead (docs/inbox.md, States)."""
    store = any_store()
    store.inbox.put("m1", session_id="alice", text="hello")
    sent: list[InboxReply] = []

    async def send(reply: InboxReply) -> None:
        sent.append(reply)

    async def handle(batch: InboxBatch) -> str:
        return ""

    async def scenario() -> None:
        serving = asyncio.ensure_future(store.inbox.serve(handle, send=send, **_FAST))
        try:
            await _until(lambda: _settled(store, ["m1"]), "m1 settled")
        finally:
            await _stop(serving)

    asyncio.run(scenario())
    assert [(reply.text, reply.message_ids) for reply in sent] == []
    assert [e.state for e in store.inbox.entries(limit=None)] == ["done"]


def test_a_handle_that_raises_cancelled_error_is_not_retried_for_ever(any_store: Any) -> None:
    """A ``CancelledError`` raised by ``handle`` itself counts as a failed attempt.

    Only a stop of ``serve`` gives a batch back uncounted. A ``handle`` whose own await
    was cancelled must not be retried for ever at the fastest poll: it dies after
    ``max_attempts``."""
    store = any_store()
    store.inbox.put("m1", session_id="alice", text="hello")
    calls: list[int] = []

    async def handle(batch: InboxBatch) -> None:
        calls.append(batch.items[0].attempts)
        raise asyncio.CancelledError  # e.g. the media download it awaited was cancelled

    async def scenario() -> None:
        serving = asyncio.ensure_future(store.inbox.serve(handle, max_attempts=2, **_FAST))

        async def settled_or_looping() -> bool:
            return len(calls) > 20 or await _settled(store, ["m1"])

        try:
            await _until(settled_or_looping, "m1 settled or retried 20 times")
        finally:
            await _stop(serving)

    asyncio.run(scenario())
    assert [e.state for e in store.inbox.entries(limit=None)] == ["dead"]
    assert calls == [1, 2]


def test_a_reply_handle_rejected_after_its_turn_is_not_sent(any_store: Any) -> None:
    """A reply ``handle`` refuses after its turn committed is never sent.

    The turn stores its answer as the batch's reply; ``handle`` may then raise (say, the
    answer failed moderation). The batch fails as docs/inbox.md says, and the withheld
    answer is not later sent as "answered and not sent"."""
    store = any_store()
    store.inbox.put("m1", session_id="alice", text="hello")
    runner = _runner(store)
    calls: list[int] = []
    sent: list[InboxReply] = []

    async def handle(batch: InboxBatch) -> str:
        calls.append(batch.items[0].attempts)
        await runner.run_async(session_id=batch.session_id, user_message=batch.text)
        raise ValueError("the answer failed moderation")

    async def send(reply: InboxReply) -> None:
        sent.append(reply)

    async def scenario() -> None:
        serving = asyncio.ensure_future(
            store.inbox.serve(handle, send=send, max_attempts=3, **_FAST))

        async def over() -> bool:
            return bool(sent) or await _settled(store, ["m1"])

        try:
            await _until(over, "m1 sent or dead")
        finally:
            await _stop(serving)

    asyncio.run(scenario())
    assert [reply.text for reply in sent] == []


# --------------------------------------------------------------------------- encryption


def test_the_payload_is_sealed_at_rest_like_the_text(open_store: Any) -> None:
    """With a cipher, the message's ``payload`` is sealed at rest like its text.

    docs/inbox.md suggests keeping the raw webhook entry as ``payload``, and that entry
    holds the message body: left in clear it would expose what the cipher protects."""
    store = open_store(cipher=_cipher("k1"), require_encryption=True)
    entry = {"from": "15550001", "type": "text", "text": {"body": "my card is 4111"}}
    store.inbox.put("m1", session_id="alice", text="my card is 4111", payload=entry)
    with store.engine.connect() as conn:
        stored_text, stored_payload = conn.execute(
            text("SELECT text, payload FROM chatflow_inbox WHERE message_id = 'm1'")).one()
    assert "card is 4111" not in str(stored_text)
    assert "card is 4111" not in str(stored_payload)


# --------------------------------------------------------------------------- clock


@pytest.mark.parametrize("seconds", [-3600.0, -1.5, 0.0, 2.25])
def test_the_database_clock_moves_by_negative_seconds_too(
    open_store: Any, seconds: float
) -> None:
    """``DatabaseNow`` shifted by a negated bind parameter is the database's now minus it.

    The inbox writes its coalescing and dedup horizons this way, and readiness, purge
    and stats rely on them, on every backend and to the millisecond SQLite keeps."""
    from datetime import timedelta

    from sqlalchemy import Float, bindparam, select

    from chatflow_sqlalchemy.clock import DatabaseNow
    from chatflow_sqlalchemy.models import UTCDateTime, utcnow

    store = open_store()
    now = DatabaseNow(bindparam("a", type_=UTCDateTime()))
    moved = DatabaseNow(bindparam("b", type_=UTCDateTime()), -bindparam("s", type_=Float()))
    worker = utcnow()
    with store.engine.connect() as conn:
        base, shifted = conn.execute(select(now, moved), {
            "a": worker, "b": worker + timedelta(seconds=seconds), "s": -seconds}).one()
    difference = (shifted - base).total_seconds()
    assert abs(difference - seconds) < 0.01


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("session_id", ["a\x00b", "lone \ud800 surrogate"])
def test_a_session_id_no_session_can_have_is_refused_at_put(
    open_store: Any, session_id: str
) -> None:
    """``put`` refuses a session id that no session can have, with a ``ValueError``.

    Otherwise the webhook would answer 200 for a message that can only die (no turn can
    open its session), or the driver's own error would escape instead of one naming
    ``session_id``."""
    store = open_store()
    with pytest.raises(ValueError, match="session_id"):
        store.inbox.put("m1", session_id=session_id, text="hello")


# --------------------------------------------------------------------------- pins


def test_two_turns_in_one_handle_both_commit_and_the_last_answer_is_the_stored_reply(
    any_store: Any,
) -> None:
    """Two turns in one ``handle`` both commit, and the last answer is the stored reply.

    The second turn reuses the batch's kept lease and records the reply again (on
    MariaDB too, where matched rows are counted). After a stop, the recovered reply is
    the last turn's, sent once, and neither turn runs again."""
    store = any_store()
    store.inbox.put("m1", session_id="alice", text="hello")
    runner = _runner(store)
    turns: list[str] = []

    async def scenario() -> None:
        both = asyncio.Event()

        async def handle(batch: InboxBatch) -> str:
            turns.append(batch.text)
            await runner.run_async(session_id=batch.session_id, user_message=batch.text)
            await runner.run_async(session_id=batch.session_id, user_message="and again")
            both.set()
            await asyncio.sleep(3600)  # post-processing when the deploy stops serve
            return "never"

        serving = asyncio.ensure_future(store.inbox.serve(handle, **_FAST))
        try:
            await asyncio.wait_for(both.wait(), _HANG_GUARD)
        finally:
            await _stop(serving)
        sent: list[InboxReply] = []

        async def send(reply: InboxReply) -> None:
            sent.append(reply)

        await _serve_until(store, handle, {"m1": "sent"}, send=send)
        assert sent == [InboxReply("alice", reply_to("and again"), ("m1",))]

    asyncio.run(scenario())
    assert turns == ["hello"]
    assert _user_texts(store, "alice") == ["hello", "and again"]


def test_a_session_deleted_under_a_running_batch_takes_the_batch_with_it(
    open_store: Any,
) -> None:
    """A session deleted under a running batch takes the batch's messages with it.

    ``delete`` removes the session's inbox messages too ("delete my data"): the
    batch's turn fails its fenced write instead of writing into a new session,
    nothing of it is answered or sent, and a message put afterwards is answered
    once, on the session made anew."""
    store = open_store()
    store.inbox.put("m1", session_id="alice", text="hello")
    runner = _runner(store)
    attempts: list[tuple[str, int]] = []
    sent: list[InboxReply] = []

    async def handle(batch: InboxBatch) -> str:
        attempts.append((batch.text, batch.items[0].attempts))
        if len(attempts) == 1:
            await asyncio.to_thread(store.delete, batch.session_id)  # "delete my data"
            await store.inbox.aput("m2", session_id="alice", text="again")
        result = await runner.run_async(session_id=batch.session_id, user_message=batch.text)
        return str(result.content)

    async def send(reply: InboxReply) -> None:
        sent.append(reply)

    asyncio.run(_serve_until(store, handle, {"m2": "sent"}, send=send))
    assert attempts == [("hello", 1), ("again", 1)]
    assert [reply.message_ids for reply in sent] == [("m2",)]
    assert "m1" not in asyncio.run(_states(store))
    assert _user_texts(store, "alice") == ["again"]


@pytest.mark.parametrize("hop", ["to_thread", "run_in_executor"])
def test_a_sync_turn_handle_runs_in_a_thread_uses_the_batch(open_store: Any, hop: str) -> None:
    """A sync turn that ``handle`` runs in a thread completes on the batch's session.

    ``asyncio.to_thread`` copies the caller's context but ``run_in_executor`` does not;
    either way the turn uses the batch's lease instead of waiting for it for ever."""
    store = open_store()
    store.inbox.put("m1", session_id="alice", text="hello")
    runner = _runner(store)

    async def handle(batch: InboxBatch) -> str:
        args = (runner.run, batch.session_id, batch.text)
        if hop == "to_thread":
            result = await asyncio.to_thread(*args)
        else:
            result = await asyncio.get_running_loop().run_in_executor(None, *args)
        return str(result.content)

    asyncio.run(_serve_until(store, handle, {"m1": "done"}))
    assert _user_texts(store, "alice") == ["hello"]
