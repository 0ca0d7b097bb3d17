"""The conformance kit's durable-inbox section (DESIGN "Durable inbox").

Every store has ``store.inbox``: these tests run on each harness, in one
process, and across worker processes where the harness can
(``CROSS_PROCESS``). They drive ``serve`` with real ``Runner`` turns and
observe only what users can: what ``handle`` and ``send`` are given, the
history the turns wrote, and ``inbox.entries()`` / ``inbox.stats()``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from chatflow_agent import Agent, Role, Runner

from chatflow_sqlalchemy.exceptions import ChatflowStoreError
from chatflow_sqlalchemy.inbox import InboxBatch, InboxReply
from chatflow_sqlalchemy.testing.claim_workers import ReplyModel, reply_to
from chatflow_sqlalchemy.testing.harness import (
    Capability,
    StoreHarness,
    StoreSpec,
    requires,
    start_process,
)

__all__ = ["InboxAcrossProcessesTests", "InboxTests", "inbox_worker"]

_HANG_GUARD = 60.0
"""Seconds a test waits for the inbox to reach a state before it fails (never a timing)."""

_FAST = {"coalesce_seconds": 0.0, "retry_seconds": 0.0}
"""``serve`` options for tests: no coalescing wait, no backoff."""

_BURST_WINDOW = 3.0
"""A coalescing window far longer than a put on a loaded machine, so a burst stays one."""

_T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _ids(prefix: str = "m", n: int = 1) -> list[str]:
    base = uuid.uuid4().hex[:10]
    return [f"{prefix}-{base}-{i}" for i in range(n)]


def _sid() -> str:
    return f"s-{uuid.uuid4().hex[:12]}"


def _runner(store: Any, engine: Any = None) -> Runner:
    bot = Agent(name="Bot", instructions="")
    return Runner(starting_agent=bot, session_store=store, engine=engine or ReplyModel())


def _turn_handle(runner: Runner, seen: list[InboxBatch]) -> Callable[[InboxBatch], Awaitable[str]]:
    async def handle(batch: InboxBatch) -> str:
        seen.append(batch)
        result = await runner.run_async(session_id=batch.session_id, user_message=batch.text)
        return str(result.content)

    return handle


async def _serve_until(
    store: Any, handle: Any, done: Callable[[], bool], **options: Any
) -> None:
    """Run ``store.inbox.serve`` until ``done()`` holds (checked every 20 ms), then stop it.

    ``done`` runs in a thread: a store's blocking calls never run on the
    loop its workers need.
    """
    serving = asyncio.ensure_future(store.inbox.serve(handle, **{**_FAST, **options}))
    deadline = time.monotonic() + _HANG_GUARD
    try:
        while not await asyncio.to_thread(done):
            if serving.done():
                serving.result()  # raises what serve raised
                raise AssertionError("serve returned on its own")
            if time.monotonic() > deadline:
                raise AssertionError(f"the inbox did not get there within {_HANG_GUARD}s")
            await asyncio.sleep(0.02)
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


def _states(store: Any, ids: list[str]) -> dict[str, str]:
    return {e.message_id: e.state for e in store.inbox.entries(limit=None) if e.message_id in ids}


def _user_texts(store: Any, session_id: str) -> list[str | None]:
    ctx = store.get(session_id)
    return [] if ctx is None else [m.content for m in ctx.history if m.role == Role.USER]


class InboxTests:
    """``store.inbox`` in one process: put, batches, replies, retries, dead messages."""

    def test_put_is_durable_and_idempotent_by_id(self, store: Any) -> None:
        (mid,) = _ids()
        assert store.inbox.put(mid, session_id=_sid(), text="hi") is True
        assert store.inbox.put(mid, session_id=_sid(), text="again") is False
        (entry,) = [e for e in store.inbox.entries(limit=None) if e.message_id == mid]
        assert (entry.state, entry.attempts, entry.error) == ("pending", 0, None)
        assert asyncio.run(store.inbox.aput(mid, session_id=_sid(), text="x")) is False

    @pytest.mark.parametrize(
        ("sent_at", "problem"),
        [
            (datetime(2026, 1, 1), "timezone-aware"),
            ("yesterday", "epoch seconds"),
            (True, "epoch seconds"),
            (float("nan"), "epoch seconds"),
        ],
    )
    def test_bad_sent_at_is_refused_and_nothing_is_stored(
        self, store: Any, sent_at: Any, problem: str
    ) -> None:
        (mid,) = _ids()
        with pytest.raises(ValueError, match=problem):
            store.inbox.put(mid, session_id=_sid(), text="hi", sent_at=sent_at)
        assert store.inbox.put(mid, session_id=_sid(), text="hi") is True

    def test_bad_arguments_name_what_to_fix(self, store: Any) -> None:
        with pytest.raises(ValueError, match="message_id"):
            store.inbox.put("", session_id="s", text="hi")
        with pytest.raises(ValueError, match="session_id"):
            store.inbox.put("m", session_id="", text="hi")
        with pytest.raises(ValueError, match="text must be a str"):
            store.inbox.put("m", session_id="s", text=None)
        with pytest.raises(ValueError, match="JSON"):
            store.inbox.put("m", session_id="s", text="hi", payload={"x": object()})
        with pytest.raises(ValueError, match="unknown inbox state"):
            store.inbox.entries(state="lost")
        with pytest.raises(ValueError, match="concurrency"):
            asyncio.run(store.inbox.serve(_never, concurrency=0))
        with pytest.raises(ValueError, match="coalesce_seconds"):
            asyncio.run(store.inbox.serve(_never, coalesce_seconds=-1))
        assert "m" not in _states(store, ["m"])

    def test_sent_at_accepts_what_platforms_send(self, store: Any) -> None:
        sid = _sid()
        stamps = [1767225600, "1767225601", 1767225602.5, _T0 + timedelta(seconds=3)]
        ids = _ids(n=len(stamps))
        for mid, stamp in zip(ids, stamps, strict=True):
            assert store.inbox.put(mid, session_id=sid, text=mid, sent_at=stamp)
        seen: list[InboxBatch] = []

        async def handle(batch: InboxBatch) -> None:
            seen.append(batch)

        asyncio.run(_serve_until(store, handle, lambda: bool(seen)))
        (batch,) = seen
        assert [item.sent_at for item in batch.items] == [
            _T0, _T0 + timedelta(seconds=1), _T0 + timedelta(seconds=2.5),
            _T0 + timedelta(seconds=3),
        ]

    def test_a_burst_is_one_turn_in_sent_at_order_and_its_reply_is_sent_once(
        self, store: Any
    ) -> None:
        sid, ids = _sid(), _ids(n=3)
        # Arrival order differs from the platform's order.
        for mid, text, second in zip(ids, ("second", "first", "third"), (2, 1, 3), strict=True):
            store.inbox.put(mid, session_id=sid, text=text, sent_at=_T0 + timedelta(seconds=second),
                            payload={"n": second})
        seen: list[InboxBatch] = []
        sent: list[InboxReply] = []

        async def send(reply: InboxReply) -> None:
            sent.append(reply)

        handle = _turn_handle(_runner(store), seen)
        asyncio.run(_serve_until(store, handle, lambda: bool(sent), send=send))
        (batch,) = seen
        assert batch.session_id == sid
        assert batch.text == "first\nsecond\nthird"
        assert [item.payload for item in batch.items] == [{"n": 1}, {"n": 2}, {"n": 3}]
        assert [item.attempts for item in batch.items] == [1, 1, 1]
        assert sent == [InboxReply(sid, reply_to(batch.text), batch.message_ids)]
        assert _states(store, ids) == dict.fromkeys(ids, "sent")
        assert _user_texts(store, sid) == ["first\nsecond\nthird"]

    def test_without_send_the_messages_are_done(self, store: Any) -> None:
        sid, ids = _sid(), _ids(n=2)
        for mid in ids:
            store.inbox.put(mid, session_id=sid, text=mid)
        seen: list[InboxBatch] = []
        handle = _turn_handle(_runner(store), seen)
        asyncio.run(_serve_until(
            store, handle, lambda: set(_states(store, ids).values()) == {"done"}
        ))
        assert len(seen) == 1

    def test_messages_put_during_a_turn_go_to_the_next_batch(self, store: Any) -> None:
        sid, (first, second, third) = _ids("s")[0], _ids(n=3)
        store.inbox.put(first, session_id=sid, text="one")
        seen: list[InboxBatch] = []
        runner = _runner(store)

        async def handle(batch: InboxBatch) -> str:
            seen.append(batch)
            if len(seen) == 1:  # the user writes twice more while the first turn runs
                await store.inbox.aput(second, session_id=sid, text="two")
                await store.inbox.aput(third, session_id=sid, text="three")
            result = await runner.run_async(session_id=sid, user_message=batch.text)
            return str(result.content)

        asyncio.run(_serve_until(store, handle, lambda: len(seen) == 2 and all(
            state == "done" for state in _states(store, [first, second, third]).values())))
        assert [batch.text for batch in seen] == ["one", "two\nthree"]
        assert _user_texts(store, sid) == ["one", "two\nthree"]

    def test_a_failing_handle_is_retried_then_dead_with_its_error(self, store: Any) -> None:
        sid, (mid,) = _sid(), _ids()
        store.inbox.put(mid, session_id=sid, text="boom")
        attempts: list[int] = []

        async def handle(batch: InboxBatch) -> str:
            attempts.append(batch.items[0].attempts)
            raise RuntimeError("the model is down")

        asyncio.run(_serve_until(
            store, handle, lambda: _states(store, [mid]) == {mid: "dead"}, max_attempts=3
        ))
        assert attempts == [1, 2, 3]
        (entry,) = [e for e in store.inbox.entries(state="dead", limit=None) if e.message_id == mid]
        assert "RuntimeError: the model is down" in (entry.error or "")
        assert store.inbox.stats().counts["dead"] >= 1
        assert store.inbox.stats().dead_last_hour >= 1
        assert _user_texts(store, sid) == []  # a failed turn writes nothing

        assert store.inbox.retry(mid) is True
        assert store.inbox.retry(mid) is False  # pending now, not dead
        seen: list[InboxBatch] = []
        asyncio.run(_serve_until(
            store, _turn_handle(_runner(store), seen),
            lambda: _states(store, [mid]) == {mid: "done"},
        ))
        assert [item.attempts for item in seen[0].items] == [1]
        assert _user_texts(store, sid) == ["boom"]

    def test_a_failed_send_is_retried_without_running_the_turn_again(self, store: Any) -> None:
        sid, (mid,) = _sid(), _ids()
        store.inbox.put(mid, session_id=sid, text="hello")
        seen: list[InboxBatch] = []
        calls: list[InboxReply] = []

        async def flaky_send(reply: InboxReply) -> None:
            calls.append(reply)
            if len(calls) < 3:
                raise ConnectionError("Graph API 503")

        asyncio.run(_serve_until(
            store, _turn_handle(_runner(store), seen),
            lambda: _states(store, [mid]) == {mid: "sent"}, send=flaky_send,
        ))
        assert len(seen) == 1 and len(calls) == 3
        assert _user_texts(store, sid) == ["hello"]

    def test_an_undeliverable_reply_dies_and_a_retry_sends_it_without_a_turn(
        self, store: Any
    ) -> None:
        sid, (mid,) = _sid(), _ids()
        store.inbox.put(mid, session_id=sid, text="hello")
        seen: list[InboxBatch] = []

        async def down(reply: InboxReply) -> None:
            raise ConnectionError("Graph API down")

        handle = _turn_handle(_runner(store), seen)
        asyncio.run(_serve_until(
            store, handle, lambda: _states(store, [mid]) == {mid: "dead"}, send=down,
            max_attempts=2,
        ))
        (entry,) = [e for e in store.inbox.entries(state="dead", limit=None) if e.message_id == mid]
        assert "send failed" in (entry.error or "")
        assert store.inbox.retry(mid)
        sent: list[InboxReply] = []

        async def up(reply: InboxReply) -> None:
            sent.append(reply)

        asyncio.run(_serve_until(store, handle, lambda: bool(sent), send=up))
        assert len(seen) == 1, "the turn ran once; the retry only sent its stored reply"
        assert sent == [InboxReply(sid, reply_to("hello"), (mid,))]
        assert _user_texts(store, sid) == ["hello"]

    def test_one_batch_per_session_at_a_time_across_serve_loops(self, store: Any) -> None:
        sessions = [_sid() for _ in range(4)]
        ids = {sid: _ids(n=3) for sid in sessions}
        in_turn: dict[str, int] = {}
        overlaps: list[str] = []
        runner = _runner(store)

        async def handle(batch: InboxBatch) -> str:
            in_turn[batch.session_id] = in_turn.get(batch.session_id, 0) + 1
            if in_turn[batch.session_id] > 1:
                overlaps.append(batch.session_id)
            try:
                await asyncio.sleep(0.01)
                result = await runner.run_async(session_id=batch.session_id,
                                                user_message=batch.text)
                return str(result.content)
            finally:
                in_turn[batch.session_id] -= 1

        for sid in sessions:  # known sessions: each worker reads them off the event loop
            store.get_or_create(sid, Agent(name="Bot", instructions=""))

        async def scenario() -> None:
            for n in range(3):
                for sid in sessions:
                    await store.inbox.aput(ids[sid][n], session_id=sid, text=f"{sid}:{n}",
                                           sent_at=_T0 + timedelta(seconds=n))
                await asyncio.sleep(0.005)
            all_ids = [mid for group in ids.values() for mid in group]
            await asyncio.gather(*(
                _serve_until(store, handle, lambda: set(
                    _states(store, all_ids).values()) == {"done"}, concurrency=2)
                for _ in range(2)
            ))

        asyncio.run(scenario())
        assert overlaps == []
        for sid in sessions:
            joined = "\n".join(_user_texts(store, sid))  # type: ignore[arg-type]
            assert joined.split("\n") == [f"{sid}:{n}" for n in range(3)]

    def test_coalescing_waits_for_a_burst_to_end(self, store: Any) -> None:
        sid, ids = _sid(), _ids(n=3)
        seen: list[InboxBatch] = []

        async def handle(batch: InboxBatch) -> None:
            seen.append(batch)

        async def scenario() -> None:
            serving = asyncio.ensure_future(
                store.inbox.serve(handle, coalesce_seconds=_BURST_WINDOW, retry_seconds=0.0)
            )
            try:
                for mid in ids:  # each well within the window of the one before
                    await store.inbox.aput(mid, session_id=sid, text=mid)
                    await asyncio.sleep(0.05)
                deadline = time.monotonic() + _HANG_GUARD
                while not seen and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
            finally:
                serving.cancel()
                await asyncio.gather(serving, return_exceptions=True)

        asyncio.run(scenario())
        assert [batch.message_ids for batch in seen] == [tuple(ids)]

    def test_stats_and_entries_for_operators(self, store: Any) -> None:
        sid, ids = _sid(), _ids(n=2)
        for mid in ids:
            store.inbox.put(mid, session_id=sid, text="x")
        stats = store.inbox.stats()
        assert set(stats.counts) == {"pending", "in_flight", "done", "sent", "dead"}
        assert stats.counts["pending"] >= 2
        assert stats.oldest_pending_seconds is not None and stats.oldest_pending_seconds >= 0
        assert stats.as_dict()["counts"] == stats.counts
        pending = store.inbox.entries(state="pending", limit=None)
        listed = [e for e in pending if e.session_id == sid]
        assert [e.message_id for e in listed] == ids
        assert listed[0].as_dict()["state"] == "pending"
        assert store.inbox.retry(ids[0]) is False  # only dead messages are retried

    def test_stopping_serve_during_a_turn_gives_the_batch_back_uncounted(
        self, store: Any
    ) -> None:
        sid, (mid,) = _sid(), _ids()
        store.inbox.put(mid, session_id=sid, text="hello")

        async def stop_during_handle() -> None:
            entered = asyncio.Event()

            async def handle(batch: InboxBatch) -> None:
                entered.set()
                await asyncio.sleep(3600)

            serving = asyncio.ensure_future(store.inbox.serve(handle, **_FAST))
            await asyncio.wait_for(entered.wait(), _HANG_GUARD)
            serving.cancel()  # a deploy stops the worker
            await asyncio.gather(serving, return_exceptions=True)

        asyncio.run(stop_during_handle())
        (entry,) = [e for e in store.inbox.entries(limit=None) if e.message_id == mid]
        assert (entry.state, entry.attempts) == ("pending", 0)
        seen: list[InboxBatch] = []
        asyncio.run(_serve_until(
            store, _turn_handle(_runner(store), seen),
            lambda: _states(store, [mid]) == {mid: "done"},
        ))
        assert [item.attempts for item in seen[0].items] == [1]

    def test_stopping_serve_right_after_a_send_does_not_send_it_again(
        self, store: Any
    ) -> None:
        sid, (mid,) = _sid(), _ids()
        store.inbox.put(mid, session_id=sid, text="hello")
        sent: list[InboxReply] = []

        async def reply(batch: InboxBatch) -> str:
            return "hi"

        async def stop_after_send() -> None:
            serving: asyncio.Future[None] | None = None

            async def send_then_stop(answer: InboxReply) -> None:
                sent.append(answer)
                assert serving is not None
                serving.cancel()  # a deploy stops the worker as the send returns

            serving = asyncio.ensure_future(
                store.inbox.serve(reply, send=send_then_stop, **_FAST)
            )
            await asyncio.wait_for(asyncio.gather(serving, return_exceptions=True), _HANG_GUARD)

        asyncio.run(stop_after_send())

        async def send(answer: InboxReply) -> None:
            sent.append(answer)

        asyncio.run(_serve_until(
            store, reply, lambda: _states(store, [mid]) == {mid: "sent"}, send=send
        ))
        assert sent == [InboxReply(sid, "hi", (mid,))]

    @pytest.mark.parametrize("when", ["before the turn", "after the turn"])
    def test_deleting_the_session_of_a_batch_in_flight_keeps_and_sends_nothing_of_it(
        self, store: Any, when: str
    ) -> None:
        """``store.delete`` during ``handle``: the batch fails cleanly; the session starts over.

        Its inbox messages go with the session; its turn, if it ran, is not
        kept and its reply is not sent. A message the user sends afterwards
        is a new batch, on a new session.
        """
        sid, (first, later) = _sid(), _ids(n=2)
        store.inbox.put(first, session_id=sid, text="forget me")
        runner = _runner(store)
        seen: list[InboxBatch] = []
        failures: list[BaseException] = []
        sent: list[InboxReply] = []

        async def handle(batch: InboxBatch) -> str:
            seen.append(batch)
            if len(seen) > 1:
                return str((await runner.run_async(sid, batch.text)).content)
            if when == "after the turn":
                await runner.run_async(sid, batch.text)
            await store.adelete(sid)  # (before the turn, only a SQL store's lease made it)
            await store.inbox.aput(later, session_id=sid, text="hello again")
            if when == "before the turn":
                try:
                    await runner.run_async(sid, batch.text)
                except Exception as exc:
                    failures.append(exc)
                    raise
            return "a reply to a deleted session"

        async def send(reply: InboxReply) -> None:
            sent.append(reply)

        asyncio.run(_serve_until(store, handle, lambda: bool(sent), send=send))
        assert [batch.text for batch in seen] == ["forget me", "hello again"]
        assert sent == [InboxReply(sid, reply_to("hello again"), (later,))]
        assert [e.message_id for e in store.inbox.entries(limit=None)
                if e.session_id == sid] == [later], "the deleted session's message stayed"
        assert _user_texts(store, sid) == ["hello again"]
        if when == "before the turn":
            (failure,) = failures
            assert isinstance(failure, ChatflowStoreError), failure

    def test_handle_returning_a_non_string_fails_the_batch(self, store: Any) -> None:
        sid, (mid,) = _sid(), _ids()
        store.inbox.put(mid, session_id=sid, text="x")

        async def handle(batch: InboxBatch) -> Any:
            return 42

        asyncio.run(_serve_until(
            store, handle, lambda: _states(store, [mid]) == {mid: "dead"}, max_attempts=1
        ))
        (entry,) = [e for e in store.inbox.entries(state="dead", limit=None) if e.message_id == mid]
        assert "handle must return the reply as str or None" in (entry.error or "")


async def _never(batch: InboxBatch) -> None:
    raise AssertionError("not called")


@requires(Capability.CROSS_PROCESS, Capability.PERSISTENT)
class InboxAcrossProcessesTests:
    """Workers in other processes: a killed worker's batch is taken over, answered once."""

    def test_a_killed_workers_batch_is_taken_over_and_answered_once(
        self, harness: StoreHarness
    ) -> None:
        sid, ids = _sid(), _ids(n=2)
        store: Any = harness.open(turn_lease_seconds=1.0)
        for mid in ids:
            store.inbox.put(mid, session_id=sid, text=mid)
        worker = start_process(inbox_worker, harness.spec(), "hang")
        try:
            assert worker.next_event()[0] == "ready"  # inside handle, holding the lease
            worker.kill()
        finally:
            worker.stop()
        assert set(_states(store, ids).values()) == {"in_flight"}
        seen: list[InboxBatch] = []
        sent: list[InboxReply] = []

        async def send(reply: InboxReply) -> None:
            sent.append(reply)

        asyncio.run(_serve_until(
            store, _turn_handle(_runner(store), seen), lambda: bool(sent), send=send
        ))
        assert [item.attempts for item in seen[0].items] == [2, 2]
        assert sent == [InboxReply(sid, reply_to("\n".join(ids)), tuple(ids))]
        assert _user_texts(store, sid) == ["\n".join(ids)]

    def test_a_reply_committed_by_a_killed_worker_is_sent_not_rerun(
        self, harness: StoreHarness
    ) -> None:
        sid, (mid,) = _sid(), _ids()
        store: Any = harness.open(turn_lease_seconds=1.0)
        store.inbox.put(mid, session_id=sid, text="hello")
        worker = start_process(inbox_worker, harness.spec(), "die_before_send")
        try:
            assert worker.next_event()[0] == "ready"  # the turn committed, send not called
            worker.kill()
        finally:
            worker.stop()
        seen: list[InboxBatch] = []
        sent: list[InboxReply] = []

        async def send(reply: InboxReply) -> None:
            sent.append(reply)

        asyncio.run(_serve_until(
            store, _turn_handle(_runner(store), seen), lambda: bool(sent), send=send
        ))
        assert seen == [], "the committed turn is not run again"
        assert sent == [InboxReply(sid, reply_to("hello"), (mid,))]
        assert _user_texts(store, sid) == ["hello"]


def inbox_worker(spec: StoreSpec, mode: str, events: Any) -> None:
    """Serve the inbox in a worker process until killed.

    ``mode``: ``hang`` reports ``ready`` inside ``handle`` and waits there;
    ``die_before_send`` runs the turn, then reports ``ready`` from ``send``
    and waits there (the test kills it either way).
    """
    store: Any = spec.open(turn_lease_seconds=1.0)
    runner = _runner(store)

    async def hang() -> None:
        events.put(("ready", os.getpid()))
        await asyncio.sleep(3600)

    async def handle(batch: InboxBatch) -> str:
        if mode == "hang":
            await hang()
        result = await runner.run_async(session_id=batch.session_id, user_message=batch.text)
        return str(result.content)

    async def send(reply: InboxReply) -> None:
        await hang()

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    asyncio.run(store.inbox.serve(handle, send=send, **_FAST))
