"""Review of the durable inbox: scenarios that try to break it, on real databases.

Each test states the guarantee it checks (DESIGN "Durable inbox" / docs/inbox.md).
Tests marked ``FAILS`` in their docstring demonstrate a bug in the code as reviewed;
the others pin a subtle guarantee that held under a real attempt to break it.
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
    """FAILS. A turn of another task of this process (a proactive message, an admin
    endpoint) that starts on a session while an inbox batch holds its lease waits for
    the lease *inside* ``session.lock`` (turns.py ``begin`` under ``TurnLock``). The
    batch's own turn then queues on ``session.lock`` behind it: each waits for the other,
    and the batch renews its lease forever. Expected: both turns run (one after the
    other) and the message is answered, as on the in-memory store (whose turns take no
    lease: its variant passes)."""
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
    """FAILS. The documented rotation ("give them the same keys first, then rotate, then
    drop the old key", cli.py keys_rotate) re-seals messages, archive and metadata but
    not ``chatflow_inbox`` (sealing.py ``rotate_batch``). A message pending at rotation
    time is then unreadable once the old key is gone and dies at once, unanswered
    (sql_inbox.py ``_take_pending``). Expected: it is answered."""
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
    """FAILS. A reply stored with its turn and not sent yet is sealed with the key of the
    time; rotation does not re-seal it (sealing.py ``rotate_batch``). Once that key is
    dropped, every ``open_batch`` of the session raises in ``_answered``
    (sql_inbox.py: ``open_text`` of ``rows[-1].reply``) and rolls back: the session is
    retried at the fastest poll forever and none of its new messages is ever answered.
    (The same holds for an unsent reply stored in plaintext on a store then opened with
    ``require_encryption=True``.) Expected: the session's new message is answered
    (the unreadable reply dead with its reason, as an unreadable text is)."""
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
    """FAILS. ``open_batch`` takes the session's new messages (in flight, attempt counted)
    *before* ``_serve_session`` sends the replies a previous holder left unsent. A serve
    stopped during that send (a deploy; or a ``LeaseLostError`` / database error there)
    leaves the new messages in flight, counted, never given to ``handle`` and never given
    back (``abandon`` only runs inside ``_run_batch``). The next holder then counts the
    recovery as a failed attempt: with ``max_attempts=1`` the message is dead without any
    ``handle`` having seen it. Expected: as for a stop during ``handle`` (commit 1b9edfd),
    the attempt is not counted and the message is answered."""
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


# --------------------------------------------------------------------------- data governance


def _inbox_texts(store: Any, session_id: str) -> list[str]:
    with store.engine.connect() as conn:
        return list(conn.execute(
            text("SELECT text FROM chatflow_inbox WHERE session_id = :s ORDER BY id"),
            {"s": session_id},
        ).scalars())


def test_erase_user_erases_the_users_inbox_messages(open_store: Any) -> None:
    """FAILS. ``erase_user`` ("sessions erased, with their messages, archive and claims";
    DESIGN "Lifecycle and data governance") goes through ``erase_sessions``
    (sql_lifecycle.py), which does not know ``chatflow_inbox``: the user's words stay
    there (a dead message for ever: ``purge`` only removes done and sent ones; an
    answered one for the dedup window). ``delete(session_id)`` keeps them too, and
    ``export_user`` does not list them. Expected: nothing of the user's is left."""
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
    """FAILS. docs/inbox.md: "``inbox retry`` puts a dead message back to ``pending`` with
    the rest of its batch". A batch whose worker stalled or died on its last attempt is
    made dead by the next holder's recovery (sql_inbox.py ``_ABANDONED``), which clears
    ``batch_token``: ``retry`` then finds no batch (``_RETRY`` matches the token) and
    brings back only the one id. This is the poison-message case (the batch crashes its
    worker every time), exactly when an operator retries after a fix."""
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
    """Passes; pins parity: ``clear()`` keeps the inbox on both stores (as it keeps the
    processed webhook ids); only ``close()`` forgets the in-memory store's inbox."""
    left = {}
    with SQLiteSessionStore(tmp_path / "x.db") as sql, SessionStore() as memory:
        for name, store in (("sql", sql), ("memory", memory)):
            store.inbox.put("m1", session_id="alice", text="hello")
            store.clear()
            left[name] = [e.message_id for e in store.inbox.entries(limit=None)]
    assert left["sql"] == left["memory"]


def test_a_stop_landing_as_send_returns_does_not_send_the_reply_again(tmp_path: Path) -> None:
    """FAILS. After ``send`` returns, the 'sent' UPDATE (inbox.py ``_deliver``:
    ``await self._rows.run(self._rows.sent, token)``) is not shielded, unlike ``abandon``
    and ``release``: a stop of ``serve`` (a deploy, not a kill) that lands while that
    call waits for a pool thread cancels it before it runs (iopool.py: "a queued call is
    skipped"). The message stays answered-unsent and the next worker sends the reply a
    second time, although no process died (docs/inbox.md puts the at-least-once window
    at a *killed* worker). Expected: one send."""
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
    """FAILS. The batch is found through a ``contextvars`` variable (inbox.py ``_BATCH``),
    which every task created inside ``handle`` copies. A task that outlives the batch (a
    follow-up message sent a bit later) still finds the batch's fence in ``Turns.begin``
    and runs its turn on the batch's lease, long released: the turn is lost with
    ``LeaseLostError`` instead of taking the session's lease as any other turn does.
    Expected: the follow-up turn is written."""
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


def test_one_stalled_session_does_not_starve_the_others(open_store: Any) -> None:
    """FAILS. A session whose ``open_batch`` raises every time (here: the unsent reply
    under a retired key) is released and, having the lowest ``min(id)``, is first in
    ``_READY``'s ``ORDER BY`` again at the next look, which comes at the fastest poll
    since a batch "started" (inbox.py ``_start_ready``). With ``concurrency=1`` it takes
    the only slot for ever: another user's message is never answered. Expected: bob is
    answered."""
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
    """FAILS. docs/inbox.md, States: "``done``: answered, and ``serve`` was given no
    ``send`` (or the reply was empty)". inbox.py ``_run_batch`` only skips ``send`` for
    None, so ``""`` (what ``result.content`` is when the model answers with no text,
    ``final_text = turn_result.text or ""`` in the Runner) is sent as an empty message,
    which a platform refuses: retried, then dead. Expected: done, nothing sent."""
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
    """FAILS. inbox.py ``_run_batch`` takes any ``CancelledError`` out of ``handle`` for a
    stop of ``serve``: the batch is given back *uncounted* and the error re-raised, which
    ends only that batch's task; ``serve`` goes on and takes the batch again at once. A
    ``handle`` whose own await was cancelled (a cancelled shared future, ``gather`` over a
    task someone cancelled) raises ``CancelledError`` while ``serve`` is not stopping:
    the message is then tried for ever at the fastest poll, never counted, never dead.
    Expected: attempts are counted and the message dies after ``max_attempts``."""
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
    """FAILS. ``handle`` runs its turn (the turn's write stores the model's answer as the
    batch's reply: sql_inbox.py ``answer_batch``), then raises: e.g. a moderation check
    of the answer refuses it. docs/inbox.md: "``handle`` raising gives the batch back: its
    messages are retried after a backoff, and after ``max_attempts`` they are dead".
    Instead ``_FAILED`` puts the items back to pending *with* ``answered_at``, so the next
    ``open_batch`` takes them for "answered and not sent" (``_ANSWERED``) and sends the
    stored answer ``handle`` refused; ``handle`` is never called again. Expected: no
    reply the caller refused is ever sent."""
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
    """FAILS. docs/inbox.md suggests keeping "the raw webhook entry" as ``payload``; that
    entry holds the message's body. With ``cipher=`` (and even ``require_encryption=True``)
    ``text`` and ``reply`` are sealed, but ``payload`` is stored as plain JSON
    (sql_inbox.py ``put``: ``"payload": payload``), so the words the cipher protects in
    ``text`` sit next to it in clear. Expected: nothing of the message readable at rest."""
    store = open_store(cipher=_cipher("k1"), require_encryption=True)
    entry = {"from": "15550001", "type": "text", "text": {"body": "my card is 4111"}}
    store.inbox.put("m1", session_id="alice", text="my card is 4111", payload=entry)
    with store.engine.connect() as conn:
        stored_text, stored_payload = conn.execute(
            text("SELECT text, payload FROM chatflow_inbox WHERE message_id = 'm1'")).one()
    assert "4111" not in str(stored_text)
    assert "4111" not in str(stored_payload)


# --------------------------------------------------------------------------- clock


@pytest.mark.parametrize("seconds", [-3600.0, -1.5, 0.0, 2.25])
def test_the_database_clock_moves_by_negative_seconds_too(
    open_store: Any, seconds: float
) -> None:
    """Passes; pins what ``_READY``, ``_PURGE`` and ``stats`` rely on: ``DatabaseNow``
    shifted by a *negated* bind parameter (``-bindparam(...)``, as sql_inbox.py writes
    the coalescing and dedup horizons) is the database's now minus those seconds, to the
    millisecond SQLite keeps, on every backend."""
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
    """FAILS. inbox.py ``_checked`` checks the session id's type and length only, not
    ``check_storable_text`` as ``validate_session_id`` does for every other API. So
    ``put`` accepts (SQLite: True, and the webhook answers 200) a message whose session
    no turn can ever have (``get_or_create`` raises ``ValueError``): it can only die; on
    PostgreSQL/MariaDB the driver's own error escapes instead of a ``ValueError`` that
    names the fix. Expected: ``ValueError`` naming ``session_id``, nothing stored."""
    store = open_store()
    with pytest.raises(ValueError, match="session_id"):
        store.inbox.put("m1", session_id=session_id, text="hello")


# --------------------------------------------------------------------------- pins


def test_two_turns_in_one_handle_both_commit_and_the_last_answer_is_the_stored_reply(
    any_store: Any,
) -> None:
    """Passes; pins: a second turn in the same ``handle`` reuses the batch's kept lease
    (writer.py ``give_back(keep=)``; ``lease.version`` moved on by the first write) and
    re-records the batch's reply (``ANSWER_BATCH`` matches the same in-flight rows again:
    its rowcount is the batch size on MariaDB too, where PyMySQL counts found rows). A
    stop after both turns sends the *last* turn's answer, once, and runs neither again."""
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


def test_a_session_deleted_under_a_running_batch_is_answered_once_on_its_new_self(
    open_store: Any,
) -> None:
    """Passes; pins: ``delete(session_id)`` while a batch holds the session (before its
    turn) makes that turn fail its fenced write (the new row has no lease) instead of
    writing into the new incarnation; the batch is recovered by the next take (the
    session row the turn created is leased anew) and answered once. The cost is one
    attempt (the recovery counts it)."""
    store = open_store()
    store.inbox.put("m1", session_id="alice", text="hello")
    runner = _runner(store)
    attempts: list[int] = []
    sent: list[InboxReply] = []

    async def handle(batch: InboxBatch) -> str:
        attempts.append(batch.items[0].attempts)
        if len(attempts) == 1:
            await asyncio.to_thread(store.delete, batch.session_id)  # "delete my data"
        result = await runner.run_async(session_id=batch.session_id, user_message=batch.text)
        return str(result.content)

    async def send(reply: InboxReply) -> None:
        sent.append(reply)

    asyncio.run(_serve_until(store, handle, {"m1": "sent"}, send=send))
    assert attempts == [1, 2]
    assert [reply.message_ids for reply in sent] == [("m1",)]
    assert _user_texts(store, "alice") == ["hello"]


@pytest.mark.parametrize("hop", ["to_thread", "run_in_executor"])
def test_a_sync_turn_handle_runs_in_a_thread_uses_the_batch(open_store: Any, hop: str) -> None:
    """FAILS for ``run_in_executor``. ``handle`` running the sync ``Runner.run`` in a
    thread: ``asyncio.to_thread`` copies the caller's context (the batch is found), but
    ``loop.run_in_executor`` does not. The turn then does not see the batch
    (turns.py ``active_batch``), polls for the session's lease that the batch holds and
    renews for ever, and ``handle`` waits for the turn: a permanent deadlock, nothing
    logged. Expected: answered (or an error that says what to do)."""
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
