"""The in-memory store's lifecycle matches the SQL stores': ``with``, ``async with``, ``clear``."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Role

from chatflow_sqlalchemy import SessionStore, SQLiteSessionStore

BOT = Agent(name="Bot", instructions="")


def test_with_returns_the_store_and_closes_it() -> None:
    with SessionStore() as store:
        ctx = store.get_or_create("s", BOT)
        ctx.add_message(Message(role=Role.USER, content="hi"))
        assert store.list_sessions() == ["s"]
    with pytest.raises(RuntimeError, match="closed"):
        store.list_sessions()
    with pytest.raises(RuntimeError, match="closed"):
        ctx.add_message(Message(role=Role.USER, content="after close"))
    store.close()  # twice is harmless


async def test_async_with_returns_the_store_and_closes_it() -> None:
    async with SessionStore() as store:
        ctx = await store.aget_or_create("s", BOT)
        await ctx.aadd_message(Message(role=Role.USER, content="hi"))
        assert await store.arecord_processed_message("m1")
        assert await store.alist_sessions() == ["s"]
    with pytest.raises(RuntimeError, match="closed"):
        await store.arecord_processed_message("m2")
    with pytest.raises(RuntimeError, match="closed"):
        await store.aget_or_create("t", BOT)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_same_lifecycle_as_the_sql_store(kind: str, tmp_path: object) -> None:
    store = SessionStore() if kind == "memory" else SQLiteSessionStore(":memory:")
    async with store as entered:
        assert entered is store
        assert store.list_sessions() == []
    for call in (store.list_sessions, lambda: store.get("s"), lambda: store.delete("s")):
        with pytest.raises(RuntimeError, match="this session store is closed"):
            call()


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_clear_forgets_what_waited_for_the_summary(kind: str) -> None:
    # Turns a failed summarizer left waiting belong to the cleared session: a new
    # session under the same id must never have them summarized into its own.
    seen: list[list[str]] = []
    failing = [True]

    async def summarizer(previous: str | None, dropped: list[Any]) -> str:
        seen.append([m.content for m in dropped])
        if failing[0]:
            raise RuntimeError("summarizer down")
        return "summary"

    options: dict[str, Any] = {"default_max_turns": 1, "summarizer": summarizer}
    store = SessionStore(**options) if kind == "memory" else SQLiteSessionStore(
        ":memory:", **options
    )
    with store:
        ctx = store.get_or_create("s", BOT)
        for i in range(4):
            ctx.add_message(Message(role=Role.USER, content=f"old-{i}"))
            ctx.add_message(Message(role=Role.MODEL, content=f"old-reply-{i}"))
        assert store.wait_for_summaries(30)
        store.clear()
        failing[0] = False
        seen.clear()
        ctx = store.get_or_create("s", BOT)
        for i in range(2):
            ctx.add_message(Message(role=Role.USER, content=f"new-{i}"))
            ctx.add_message(Message(role=Role.MODEL, content=f"new-reply-{i}"))
        assert store.wait_for_summaries(30)
        assert seen == [["new-0", "new-reply-0"]]
        assert ctx.summary == "summary"


def test_sweep_keeps_a_session_whose_batch_starts_as_the_sweep_looks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch that starts on another thread while a sweep runs must not lose its session.

    The SQL stores check the lease and delete the session in one locked
    statement. Here another thread's batch starts right after the sweep has
    looked at the leases: either it waits for the sweep (and finds nothing
    left to answer), or the sweep leaves its session and messages.
    """
    from chatflow_sqlalchemy.memory_inbox import MemoryInbox
    from chatflow_sqlalchemy.testing.lifecycle_suite import SHORT_EXPIRE_SECONDS, SHORT_TTL_HOURS

    batches: list[tuple[MemoryInbox, Any, list[Any]]] = []
    workers: list[threading.Thread] = []
    look = MemoryInbox.leased

    def start_batch(rows: MemoryInbox) -> None:
        lease = rows.take("s")
        assert lease is not None
        batches.append((rows, lease, rows.open_batch(lease, "token", 3)[1]))

    def leased_as_a_batch_starts(rows: MemoryInbox, session_ids: Any) -> set[str]:
        held = look(rows, session_ids)
        if not workers:
            workers.append(threading.Thread(target=start_batch, args=(rows,)))
            workers[0].start()
            workers[0].join(1.0)  # it may wait for the sweep: then it starts after it
        return held

    with SessionStore(session_ttl_hours=SHORT_TTL_HOURS) as store:
        store.get_or_create("s", BOT).add_message(Message(role=Role.USER, content="hi"))
        store.inbox.put("m1", session_id="s", text="hi")
        time.sleep(SHORT_EXPIRE_SECONDS)  # the session expires
        monkeypatch.setattr(MemoryInbox, "leased", leased_as_a_batch_starts)
        swept = store.sweep()
        workers[0].join(60)
        assert not workers[0].is_alive()
        rows, lease, items = batches[0]
        if items:  # the batch has a message to answer: its session and lease stay
            assert (swept, store.list_sessions()) == (0, ["s"])
            assert rows.renew(lease)
        else:
            assert (swept, store.list_sessions()) == (1, [])


def _store(kind: str, tmp_path: Path, **options: Any) -> Any:
    """The in-memory store, or a SQLite file store: what the in-memory one should agree with."""
    return SessionStore(**options) if kind == "memory" else SQLiteSessionStore(
        tmp_path / "s.db", **options
    )


def _all_end(targets: tuple[Any, ...], timeout: float) -> bool:
    """Run each target on a thread of its own; False if one is still running after ``timeout``."""
    threads = [threading.Thread(target=target, daemon=True) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    return not any(thread.is_alive() for thread in threads)


def _texts(messages: list[Any]) -> list[str]:
    return [m["content"] if isinstance(m, dict) else m.content for m in messages]


@pytest.mark.parametrize("archive_pruned", [False, True])
@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_reads_show_the_last_write_while_history_is_edited_in_place(
    kind: str, archive_pruned: bool, tmp_path: Path
) -> None:
    """A ``history`` edited in place is written by the next write; reads show the last write.

    As a SQL store reads its rows. The in-memory store raised ValueError
    reading a window its seqs no longer matched, and with ``archive_pruned``
    failed the turn that edited it.
    """
    with _store(kind, tmp_path, archive_pruned=archive_pruned) as store:
        ctx = store.get_or_create("s", BOT, user_id="u")
        ctx.add_message(Message(role=Role.USER, content="hi"))
        ctx.add_message(Message(role=Role.MODEL, content="yo"))
        ctx.history.append(Message(role=Role.USER, content="sneak"))  # as upstream allows

        def exported() -> list[str]:
            return _texts(store.export_user("u")["sessions"][0]["messages"])

        assert (_texts(store.transcript("s")), exported()) == (["hi", "yo"], ["hi", "yo"])

        async def turn() -> None:
            async with ctx.lock:
                ctx.history.append(Message(role=Role.MODEL, content="edited in a turn"))

        asyncio.run(turn())
        written = ["hi", "yo", "sneak", "edited in a turn"]
        assert _texts(ctx.history) == written
        # (The regroup gives the edited window new seqs: archive_pruned keeps the old too.)
        assert (_texts(store.transcript("s"))[-4:], exported()) == (written, written)


@pytest.mark.parametrize("change", ["agent", "clear"])
@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_rollback_undoes_a_change_made_after_history_was_edited_in_place(
    kind: str, change: str, tmp_path: Path
) -> None:
    """The undo state a change keeps re-derives an edited ``history`` first, as a write does.

    Before, a first change that was not ``add_message`` kept the edited
    history with seqs it no longer matched, and ``rollback_to`` raised ValueError.
    """
    with _store(kind, tmp_path) as store:
        ctx = store.get_or_create("s", BOT)
        ctx.add_message(Message(role=Role.USER, content="a"))
        ctx.history.append(Message(role=Role.MODEL, content="sneak"))  # as upstream allows
        if change == "agent":
            ctx.set_active_agent(Agent(name="Other", instructions=""))
        else:
            ctx.clear_history()
        ctx.rollback_to(2)
        assert (_texts(ctx.history), ctx.active_agent.name) == (["a", "sneak"], "Bot")
        assert _texts(store.transcript("s")) == ["a", "sneak"]


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_rollback_writes_an_edited_history_its_regroup_pruned(kind: str, tmp_path: Path) -> None:
    """``rollback_to`` cuts at the length the user saw, not the length re-derived from it.

    Before, pruning the edited history first made a cut inside the user's view
    look like nothing to do: memory changed and nothing was written.
    """
    with _store(kind, tmp_path, default_max_turns=2) as store:
        ctx = store.get_or_create("s", BOT)
        for text in "abcd":
            ctx.add_message(Message(role=Role.USER if text in "ac" else Role.MODEL, content=text))
        ctx.history.append(Message(role=Role.USER, content="sneak"))  # a third turn: one pruned
        ctx.rollback_to(4)
        assert _texts(ctx.history) == ["c", "d", "sneak"]
        assert _texts(store.transcript("s")) == ["c", "d", "sneak"]


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_a_summary_takes_what_was_written_while_history_is_edited_in_place(
    kind: str, tmp_path: Path
) -> None:
    """The summaries' worker reads the window last written (the in-memory store's raised)."""
    called, go = threading.Event(), threading.Event()
    seen: list[list[str]] = []

    async def summarizer(previous: str | None, dropped: list[Any]) -> str:
        seen.append(_texts(dropped))
        if len(seen) == 1:  # fails once the window is edited in place: its turns wait
            called.set()
            await asyncio.to_thread(go.wait, 60)
            raise RuntimeError("summarizer down")
        return "summary"

    with _store(kind, tmp_path, default_max_turns=1, summarizer=summarizer) as store:
        ctx = store.get_or_create("s", BOT)
        for i, text in enumerate(["u0", "m0", "u1", "m1", "u2"]):
            ctx.add_message(Message(role=(Role.USER, Role.MODEL)[i % 2], content=text))
            if text == "u1":  # turn 0 pruned: its summary is being made
                assert called.wait(60)
        ctx.history.append(Message(role=Role.MODEL, content="sneak"))
        go.set()  # the failed summary's worker claims again: turns 0 and 1 wait
        assert store.wait_for_summaries(60)
        assert seen[:2] == [["u0", "m0"], ["u0", "m0", "u1", "m1"]]


def test_reads_beside_writes_neither_deadlock_nor_raise() -> None:
    """Reads take the store's lock, never a context's mutex (a write takes both, mutex first).

    The first read comes while ``history`` is edited in place; then writes,
    turns, summaries and reads run at once.
    """

    async def summarizer(previous: str | None, dropped: list[Any]) -> str:
        return "summary"

    errors: list[BaseException] = []
    first_read = threading.Event()
    with SessionStore(archive_pruned=True, default_max_turns=2, summarizer=summarizer) as store:
        ctx = store.get_or_create("s", BOT, user_id="u")
        ctx.add_message(Message(role=Role.USER, content="hi"))
        ctx.history.append(Message(role=Role.MODEL, content="sneak"))

        def read() -> None:
            try:
                for _ in range(300):
                    store.transcript("s")
                    store.export_user("u")
                    first_read.set()
            except BaseException as exc:
                errors.append(exc)
            finally:
                first_read.set()

        async def turn(i: int) -> None:
            async with ctx.lock:
                ctx.add_message(Message(role=Role.USER, content=f"turn-{i}"))
                ctx.add_message(Message(role=Role.MODEL, content=f"reply-{i}"))

        def write() -> None:
            first_read.wait(60)
            try:
                for i in range(150):
                    ctx.add_message(Message(role=Role.USER, content=f"user-{i}"))
                    asyncio.run(turn(i))
            except BaseException as exc:
                errors.append(exc)

        assert _all_end((read, write), 120), "reads and writes deadlocked"
        assert errors == []
        assert store.wait_for_summaries(60)


@pytest.mark.parametrize("write", ["turn", "add_message"])
def test_a_write_beside_get_or_create_remaking_the_session_does_not_deadlock(write: str) -> None:
    """A write holds the context's mutex, then takes the store's lock; get_or_create too.

    Remaking a session whose first turn failed writes its metadata: under the
    store's lock it waited for the mutex a write held while waiting for the lock.
    """
    store = SessionStore()
    ctx = store.get_or_create("s", BOT)

    async def turn(fail: bool) -> None:
        async with ctx.lock:
            ctx.add_message(Message(role=Role.USER, content="hi"))
            if fail:
                raise RuntimeError("the model is down")

    with pytest.raises(RuntimeError, match="down"):
        asyncio.run(turn(True))  # the first turn failed: the session is unborn
    writer, remaking = threading.Event(), threading.Event()
    original = store._flush_context

    def flush(flushed: Any) -> None:  # the writer holds the mutex: it waits for the remake
        if threading.current_thread() is not threads[0]:
            return original(flushed)
        writer.set()
        assert remaking.wait(60)
        for _ in range(2000):  # until the remake holds the lock (or is done)
            if not store._lock.acquire(blocking=False):
                break
            store._lock.release()
            if not threads[1].is_alive():
                break
            time.sleep(0.001)
        return original(flushed)

    store._flush_context = flush  # type: ignore[method-assign]

    def remake() -> None:
        assert writer.wait(60)
        remaking.set()
        store.get_or_create("s", BOT, {"made": "again"})

    def write_once() -> None:
        if write == "turn":
            asyncio.run(turn(False))
        else:
            ctx.add_message(Message(role=Role.USER, content="hi"))

    threads = [threading.Thread(target=f, daemon=True) for f in (write_once, remake)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads), "the write and the remake deadlocked"
    assert (store.get("s") is ctx, store.transcript("s")[-1].content) == (True, "hi")


def test_close_lets_go_of_every_message() -> None:
    """A closed store drops its sessions: it holds none of their messages any more."""
    store = SessionStore()
    message = Message(role=Role.USER, content="hi")
    store.get_or_create("s", BOT).add_message(message)
    kept = weakref.ref(message)
    del message
    store.close()
    gc.collect()
    assert kept() is None
