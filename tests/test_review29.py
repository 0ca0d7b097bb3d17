"""Review of issue 29 (summaries, rewind, forks): cases that broke, on real databases.

Each test names the guarantee it checks. They run on a SQLite file,
PostgreSQL and MariaDB (through its plugin) and, where the in-memory store
promises the same, on it too.
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Role
from sqlalchemy import text

from chatflow_sqlalchemy import SessionStore

from .stores import SQL_KINDS, Opener, open_on

_HANG_GUARD = 60.0



def _agent() -> Agent:
    return Agent(name="bot", instructions="")


def _turn(ctx: Any, name: str) -> None:
    ctx.add_message(Message(role=Role.USER, content=f"u{name}"))
    ctx.add_message(Message(role=Role.MODEL, content=f"m{name}"))


def _turns(ctx: Any, first: int, last: int) -> None:
    for n in range(first, last):
        _turn(ctx, str(n))


def _contents(messages: list[Message]) -> list[str | None]:
    return [m.content for m in messages]


def _raw(store: Any, sql: str, **params: Any) -> list[Any]:
    with store.engine.connect() as conn:
        return list(conn.execute(text(sql), params))


async def _summarize(previous: str | None, dropped: list[Message]) -> str:
    return ",".join([*([previous] if previous else []), *(str(m.content) for m in dropped)])


class _Gate:
    """A summarizer that waits for ``open()`` before it answers (as ``_summarize``)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.started = threading.Event()

    async def __call__(self, previous: str | None, dropped: list[Message]) -> str:
        self.started.set()
        assert await asyncio.to_thread(self.event.wait, _HANG_GUARD), "gate never opened"
        return await _summarize(previous, dropped)


# ------------------------------------------------------------------ summaries


@pytest.mark.parametrize("how", ["delete", "erase_user"])
def test_a_summary_of_a_deleted_session_never_reaches_a_new_session_of_its_id(
    any_store: Opener, how: str
) -> None:
    """Delete (or erase) and recreate while a summary is made: the new session stays clean."""
    gate = _Gate()
    store = any_store(default_max_turns=1, summarizer=gate)
    old = store.get_or_create("s", _agent(), user_id="ann")
    _turn(old, "secret")
    _turn(old, "1")  # prunes "secret": its summary is being made
    assert gate.started.wait(_HANG_GUARD)
    assert store.delete("s") if how == "delete" else store.erase_user("ann") == 1
    new = store.get_or_create("s", _agent(), user_id="bob")
    _turn(new, "fresh")
    gate.event.set()
    assert store.wait_for_summaries(_HANG_GUARD)
    assert store.get("s").summary is None
    assert all("secret" not in (m.content or "") for m in store.get("s").history)


def test_a_session_deleted_while_summarized_is_summarized_again_once_recreated(
    any_store: Opener,
) -> None:
    """The claim of a summary whose session went is not kept: the id's next prune summarizes."""
    gate = _Gate()
    store = any_store(default_max_turns=1, summarizer=gate)
    _turns(store.get_or_create("s", _agent()), 0, 2)
    assert gate.started.wait(_HANG_GUARD)
    assert store.delete("s")
    gate.event.set()
    assert store.wait_for_summaries(_HANG_GUARD)
    new = store.get_or_create("s", _agent())
    _turns(new, 10, 12)
    assert store.wait_for_summaries(_HANG_GUARD)
    assert store.get("s").summary == "u10,m10"


class _Interrupt(BaseException):
    """Not an Exception: as KeyboardInterrupt or SystemExit, for a summarizer to raise."""


@pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit, _Interrupt])
def test_a_summarizer_raising_a_base_exception_does_not_stop_later_summaries(
    any_store: Opener, raised: type[BaseException]
) -> None:
    """A summarizer is the user's code: whatever it raises, the next prune is summarized."""
    calls = []

    async def summarizer(previous: str | None, dropped: list[Message]) -> str:
        calls.append(len(dropped))
        if len(calls) == 1:
            raise raised()
        return await _summarize(previous, dropped)

    store = any_store(default_max_turns=1, summarizer=summarizer)
    ctx = store.get_or_create("s", _agent())
    _turns(ctx, 0, 2)
    assert store.wait_for_summaries(_HANG_GUARD), "the summaries' thread died"
    _turn(ctx, "2")
    assert store.wait_for_summaries(_HANG_GUARD), "the summaries' thread died"
    assert store.get("s").summary == "u0,m0,u1,m1"


def test_close_while_a_summarizer_waits_gives_the_claim_back(sql_store: Opener) -> None:
    """close() does not hang on a summarizer that never answers; another store summarizes."""
    never = asyncio.Event()

    async def stuck(previous: str | None, dropped: list[Message]) -> str:
        await never.wait()
        return "never"

    first = sql_store(default_max_turns=1, summarizer=stuck)
    _turns(first.get_or_create("s", _agent()), 0, 2)
    assert not first.wait_for_summaries(0.5)
    first.close()
    second = sql_store(default_max_turns=1, summarizer=_summarize)
    _turn(second.get("s"), "2")
    assert second.wait_for_summaries(_HANG_GUARD)
    assert second.get("s").summary == "u0,m0,u1,m1"


def test_a_copied_history_never_stores_the_summary_as_a_message(any_store: Opener) -> None:
    """``history = [copies]`` (a redaction pass, a JSON round trip) keeps one summary, no row."""
    store = any_store(default_max_turns=1, summarizer=_summarize)
    ctx = store.get_or_create("s", _agent())
    _turns(ctx, 0, 2)
    assert store.wait_for_summaries(_HANG_GUARD)
    ctx = store.get("s")
    ctx.history = [m.model_copy() for m in ctx.history]
    systems = [m for m in ctx.history if m.role == Role.SYSTEM]
    assert len(systems) == 1, _contents(systems)
    if not isinstance(store, SessionStore):
        rows = _raw(store, "SELECT content FROM chatflow_messages")
        assert all("u0" not in (content or "") for (content,) in rows), rows
    assert all("u0" not in (m.content or "") for m in store.transcript("s"))


def _script(store: Any) -> None:
    """Turns, a rewind, a SYSTEM message after the summary, a fork and its rewind."""
    ctx = store.get_or_create("s", _agent())
    ctx.add_message(Message(role=Role.SYSTEM, content="sys"))
    _turns(ctx, 0, 4)
    assert store.wait_for_summaries(_HANG_GUARD)
    ctx = store.get("s")
    ctx.rewind()
    _turn(ctx, "x")
    ctx.add_message(Message(role=Role.SYSTEM, content="sys2"))
    _turns(ctx, 5, 7)
    assert store.wait_for_summaries(_HANG_GUARD)
    fork = store.fork("s", "f", at_turn=1)
    _turn(fork, "f")
    fork.rewind()
    assert store.wait_for_summaries(_HANG_GUARD)


@pytest.mark.parametrize("kind", [*SQL_KINDS])
def test_memory_and_sql_stores_agree_on_history_summary_and_transcript(
    kind: str, tmp_path: Path
) -> None:
    """One script on the in-memory store and a SQL one: the same outcome, also after a reload."""
    options = {"default_max_turns": 2, "summarizer": _summarize, "archive_pruned": True}
    outcomes = []
    with ExitStack() as stack:
        for opener in (open_on("memory", stack, tmp_path), open_on(kind, stack, tmp_path)):
            _script(opener(**options))
            shown = opener(**options)  # on SQL a fresh store: what a restart reloads
            outcomes.append({
                sid: (
                    _contents(shown.get(sid).history), shown.get(sid).summary,
                    _contents(shown.transcript(sid)),
                )
                for sid in ("s", "f")
            })
    assert outcomes[0] == outcomes[1]


# --------------------------------------------------------------------- rewind


def test_rewound_messages_stay_in_the_transcript_after_a_restart(any_store: Opener) -> None:
    """``archive_pruned``: a rewound turn is kept, also once a new store wrote after it."""
    store = any_store(archive_pruned=True)
    ctx = store.get_or_create("s", _agent())
    _turns(ctx, 0, 3)
    ctx.rewind()
    again = any_store(archive_pruned=True)  # another process (the same store in memory)
    if again is not store:
        store.close()
    _turn(again.get("s"), "new")
    assert _contents(again.transcript("s")) == ["u0", "m0", "u1", "m1", "u2", "m2", "unew", "mnew"]


# ---------------------------------------------------------------------- forks


def test_a_fork_at_turn_0_keeps_every_waiting_turn_in_its_summary(any_store: Opener) -> None:
    """Waiting messages copied to a fork with no turn are never confused with its new ones."""
    failing = {"on": True}

    async def summarizer(previous: str | None, dropped: list[Message]) -> str:
        if failing["on"]:
            raise RuntimeError("the model is down")
        return await _summarize(previous, dropped)

    store = any_store(default_max_turns=1, summarizer=summarizer)
    _turns(store.get_or_create("src", _agent()), 0, 2)  # u0 waits: its summary failed
    assert store.wait_for_summaries(_HANG_GUARD)
    fork = store.fork("src", "f", at_turn=0)
    assert store.wait_for_summaries(_HANG_GUARD)
    _turns(fork, 10, 12)  # u10 is pruned: it waits too
    assert store.wait_for_summaries(_HANG_GUARD)
    failing["on"] = False
    _turn(fork, "12")
    assert store.wait_for_summaries(_HANG_GUARD)
    assert store.get("f").summary == "u0,m0,u10,m10,u11,m11"


def test_rewind_edge_arguments_change_nothing(any_store: Opener) -> None:
    """turns=0, more turns than the window, a running loop: errors that write nothing."""
    store = any_store(default_max_turns=2)
    ctx = store.get_or_create("s", _agent())
    _turns(ctx, 0, 3)
    before = _contents(ctx.history)
    for bad in (0, -1, True, 1.0, "1"):
        with pytest.raises(ValueError):
            ctx.rewind(bad)
    with pytest.raises(ValueError, match="window holds 2"):
        ctx.rewind(3)

    async def inside_a_loop() -> None:
        with pytest.raises(RuntimeError, match="arewind"):
            ctx.rewind()
        async with ctx.lock:
            with pytest.raises(RuntimeError, match="inside a turn"):
                await ctx.arewind()

    asyncio.run(inside_a_loop())
    assert _contents(ctx.history) == before
    fresh = any_store(default_max_turns=2)
    assert _contents(fresh.get("s").history) == before
    ctx.rewind(2)
    assert _contents(ctx.history) == []
    assert _contents(any_store(default_max_turns=2).get("s").history) == []


def test_rewind_of_a_session_deleted_meanwhile_raises_and_writes_nothing(
    sql_store: Opener,
) -> None:
    from chatflow_sqlalchemy.exceptions import SessionDeletedError

    store = sql_store()
    ctx = store.get_or_create("s", _agent())
    _turns(ctx, 0, 2)
    other = sql_store()
    assert other.delete("s")
    with pytest.raises(SessionDeletedError):
        ctx.rewind()
    assert store.get("s") is None


def test_rewind_inside_a_claim_block_then_a_turn_commits_the_claim_once(
    sql_store: Opener,
) -> None:
    """Edit-and-regenerate in a webhook handler: rewind, then the new turn, in one claim."""
    store = sql_store()
    ctx = store.get_or_create("s", _agent())
    _turns(ctx, 0, 2)

    async def handler() -> None:
        async with store.claim("wamid.1", session_id="s") as claim:
            assert claim.acquired
            await ctx.arewind()
            async with ctx.lock:
                ctx.add_message(Message(role=Role.USER, content="u1 edited"))
                ctx.add_message(Message(role=Role.MODEL, content="m1 again"))
            claim.response = "m1 again"

    asyncio.run(handler())
    fresh = sql_store()
    assert _contents(fresh.get("s").history) == ["u0", "m0", "u1 edited", "m1 again"]

    async def redelivered() -> Any:
        async with fresh.claim("wamid.1", session_id="s") as claim:
            return claim.acquired, claim.response

    assert asyncio.run(redelivered()) == (False, "m1 again")


def test_rewind_leaves_no_dangling_tool_call_of_the_rewound_turn(sql_store: Opener) -> None:
    """A rewound turn's trailing tool call (held back from memory) does not come back."""
    from chatflow_agent import ToolCall

    store = sql_store(archive_pruned=True)
    ctx = store.get_or_create("s", _agent())
    _turn(ctx, "0")
    ctx.add_message(Message(role=Role.USER, content="u1"))
    call = ToolCall(id="c1", name="lookup", args={})
    ctx.add_message(Message(role=Role.MODEL, tool_calls=[call]))  # its result never came
    fresh = sql_store(archive_pruned=True)
    again = fresh.get("s")
    assert _contents(again.history) == ["u0", "m0", "u1"]  # the call is held back
    again.rewind()
    assert _contents(again.history) == ["u0", "m0"]
    _turn(again, "2")
    third = sql_store(archive_pruned=True).get("s")
    assert _contents(third.history) == ["u0", "m0", "u2", "m2"]
    transcript = sql_store(archive_pruned=True).transcript("s")
    assert [m.content for m in transcript if m.role != Role.MODEL or not m.tool_calls] == [
        "u0", "m0", "u1", "u2", "m2"
    ]


# ----------------------------------------------------------- summary content


def test_a_summary_is_sealed_at_rest_and_reloads(sql_store: Opener) -> None:
    import os

    from chatflow_sqlalchemy.crypto import AESGCMCipher

    cipher = AESGCMCipher({"k": os.urandom(32)}, "k")
    store = sql_store(default_max_turns=1, summarizer=_summarize, cipher=cipher,
                      require_encryption=True)
    _turns(store.get_or_create("s", _agent()), 0, 3)
    assert store.wait_for_summaries(_HANG_GUARD)
    (stored,) = _raw(store, "SELECT summary FROM chatflow_sessions")
    assert stored[0].startswith("cfenc:") and "u0,m0" not in stored[0]
    assert cipher.decrypt(stored[0], "s") == "u0,m0,u1,m1"
    archived = _raw(store, "SELECT message_json FROM chatflow_message_archive")
    assert all(row[0].startswith("cfenc:") for row in archived)
    assert sql_store(cipher=cipher, require_encryption=True).get("s").summary == "u0,m0,u1,m1"


@pytest.mark.parametrize("bad", ["has\x00nul", "\ud800", 42, None])
def test_an_unstorable_summary_fails_and_is_retried(any_store: Opener, bad: Any) -> None:
    answers = [bad]

    async def summarizer(previous: str | None, dropped: list[Message]) -> Any:
        if answers:
            return answers.pop()
        return await _summarize(previous, dropped)

    store = any_store(default_max_turns=1, summarizer=summarizer)
    ctx = store.get_or_create("s", _agent())
    _turns(ctx, 0, 2)
    assert store.wait_for_summaries(_HANG_GUARD)
    assert store.get("s").summary is None
    _turn(ctx, "2")
    assert store.wait_for_summaries(_HANG_GUARD)
    assert store.get("s").summary == "u0,m0,u1,m1"


@pytest.mark.parametrize("answer", ["", "x" * 300_000])
def test_an_empty_or_huge_summary_reloads_the_same(any_store: Opener, answer: str) -> None:
    async def summarizer(previous: str | None, dropped: list[Message]) -> str:
        return answer

    store = any_store(default_max_turns=1, summarizer=summarizer)
    ctx = store.get_or_create("s", _agent())
    _turns(ctx, 0, 2)
    assert store.wait_for_summaries(_HANG_GUARD)
    shown = store.get("s")
    assert shown.summary == answer
    fresh = any_store(default_max_turns=1)
    assert fresh.get("s").summary == answer
    assert fresh.get("s").history == shown.history


def test_two_stores_summarizing_one_session_fold_every_turn_once(sql_store: Opener) -> None:
    """Turns alternate between two stores (two workers); the summary has each turn once."""
    stores = [sql_store(default_max_turns=1, summarizer=_summarize) for _ in range(2)]
    stores[0].get_or_create("s", _agent())
    for n in range(12):
        _turn(stores[n % 2].get("s"), str(n))
    for store in stores:
        assert store.wait_for_summaries(_HANG_GUARD)
    _turn(stores[0].get("s"), "12")  # the last prune: whatever waited is folded in now
    for store in stores:
        assert store.wait_for_summaries(_HANG_GUARD)
    summary = sql_store().get("s").summary
    assert summary == ",".join(f"u{n},m{n}" for n in range(12))


def test_a_summary_applied_while_a_runner_turn_runs_in_another_thread(
    any_store: Opener,
) -> None:
    """The summary waits for the turn; the turn's rollback restores exactly its start."""
    gate = _Gate()
    store = any_store(default_max_turns=1, summarizer=gate)
    ctx = store.get_or_create("s", _agent())
    _turns(ctx, 0, 2)  # u0 pruned: its summary waits at the gate
    assert gate.started.wait(_HANG_GUARD)
    in_turn, release = threading.Event(), threading.Event()

    async def failing_turn() -> None:  # what Runner.run_async does when its engine fails
        async with ctx.lock:
            checkpoint = len(ctx.history)
            ctx.add_message(Message(role=Role.USER, content="u2"))
            in_turn.set()
            await asyncio.to_thread(release.wait, _HANG_GUARD)
            ctx.rollback_to(checkpoint)  # as the Runner does on an engine error

    thread = threading.Thread(target=asyncio.run, args=(failing_turn(),))
    thread.start()
    assert in_turn.wait(_HANG_GUARD)
    gate.event.set()
    release.set()
    thread.join(_HANG_GUARD)
    assert store.wait_for_summaries(_HANG_GUARD)
    assert store.get("s").summary == "u0,m0"
    assert _contents(store.get("s").history)[1:] == ["u1", "m1"]


# ------------------------------------------------------------- inbox and turns


def test_a_summary_made_during_an_inbox_batch_uses_its_lease_and_keeps_its_reply(
    any_store: Opener,
) -> None:
    """The summary's turn on a batch's session neither waits for the batch nor takes its reply."""
    from chatflow_agent import Runner

    from chatflow_sqlalchemy.inbox import InboxBatch
    from chatflow_sqlalchemy.testing.claim_workers import ReplyModel

    gate = _Gate()
    store = any_store(default_max_turns=1, summarizer=gate)
    _turn(store.get_or_create("alice", Agent(name="Bot", instructions="")), "0")
    store.inbox.put("m1", session_id="alice", text="hello")
    runner = Runner(starting_agent=Agent(name="Bot", instructions=""), session_store=store,
                    engine=ReplyModel())

    async def handle(batch: InboxBatch) -> str:
        result = await runner.run_async(session_id=batch.session_id, user_message=batch.text)
        gate.event.set()  # the turn pruned u0: its summary is made now, the batch still open
        assert await asyncio.to_thread(store.wait_for_summaries, _HANG_GUARD)
        assert store.get("alice").summary == "u0,m0"
        return str(result.content)

    async def scenario() -> None:
        serving = asyncio.ensure_future(
            store.inbox.serve(handle, coalesce_seconds=0.0, retry_seconds=0.0))
        try:
            for _ in range(int(_HANG_GUARD / 0.02)):
                entries = {e.message_id: e for e in await store.inbox.aentries(limit=None)}
                if entries["m1"].state in ("done", "dead"):
                    break
                await asyncio.sleep(0.02)
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
        assert entries["m1"].state == "done", entries["m1"]

    asyncio.run(scenario())
    ctx = store.get("alice")
    assert ctx.summary == "u0,m0"
    assert [m.role for m in ctx.history] == [Role.SYSTEM, Role.USER, Role.MODEL]
    assert ctx.history[1].content == "hello"


def test_arewind_from_another_task_waits_for_the_running_turn(any_store: Opener) -> None:
    """A rewind asked while another task's turn runs is a turn of its own: it waits."""
    store = any_store()
    ctx = store.get_or_create("s", _agent())
    _turns(ctx, 0, 2)

    async def scenario() -> None:
        in_turn, finish = asyncio.Event(), asyncio.Event()

        async def turn() -> None:
            async with ctx.lock:
                ctx.add_message(Message(role=Role.USER, content="u2"))
                in_turn.set()
                await finish.wait()
                ctx.add_message(Message(role=Role.MODEL, content="m2"))

        running = asyncio.ensure_future(turn())
        await asyncio.wait_for(in_turn.wait(), _HANG_GUARD)
        rewinding = asyncio.ensure_future(ctx.arewind())  # e.g. an admin endpoint
        await asyncio.sleep(0)
        finish.set()
        await asyncio.wait_for(asyncio.gather(running, rewinding), _HANG_GUARD)

    asyncio.run(scenario())
    assert _contents(ctx.history) == ["u0", "m0", "u1", "m1"]


def test_close_returns_while_a_summarizer_blocks_its_thread(
    any_store: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A summarizer stuck in blocking code (a sync SDK call) does not hang ``close()``."""
    from chatflow_sqlalchemy import summaries

    monkeypatch.setattr(summaries, "CLOSE_GRACE_SECONDS", 0.2)
    release, started = threading.Event(), threading.Event()

    async def blocking(previous: str | None, dropped: list[Message]) -> str:
        started.set()
        release.wait(_HANG_GUARD)  # blocks the summaries' event loop itself
        return "late"

    store = any_store(default_max_turns=1, summarizer=blocking)
    _turns(store.get_or_create("s", _agent()), 0, 2)
    assert started.wait(_HANG_GUARD)
    closing = threading.Thread(target=store.close)
    closing.start()
    closing.join(_HANG_GUARD / 2)
    hung = closing.is_alive()
    release.set()
    closing.join(_HANG_GUARD)
    assert not hung, "close() waited for the blocked summarizer"


def test_messages_waiting_for_a_summary_show_alike_on_every_store(any_store: Opener) -> None:
    """Without archive_pruned, pruned messages waiting for a summary: exported, not transcript."""

    async def down(previous: str | None, dropped: list[Message]) -> str:
        raise RuntimeError("the model is down")

    store = any_store(default_max_turns=1, summarizer=down)
    _turns(store.get_or_create("s", _agent(), user_id="ann"), 0, 2)
    assert store.wait_for_summaries(_HANG_GUARD)
    (exported,) = store.export_user("ann")["sessions"]
    assert _contents(store.transcript("s")) == ["u1", "m1"]  # the window: nothing is archived
    assert [m["content"] for m in exported["archived_messages"]] == ["u0", "m0"]


def test_a_fork_made_mid_turn_copies_what_was_committed(any_store: Opener) -> None:
    store = any_store()
    ctx = store.get_or_create("src", _agent())
    _turns(ctx, 0, 2)

    async def scenario() -> Any:
        async with ctx.lock:
            ctx.add_message(Message(role=Role.USER, content="u2"))
            return await store.afork("src", "f")

    fork = asyncio.run(scenario())
    assert _contents(fork.history) == ["u0", "m0", "u1", "m1"]
    assert _contents(any_store().get("f").history) == ["u0", "m0", "u1", "m1"]
    assert _contents(any_store().get("src").history) == ["u0", "m0", "u1", "m1", "u2"]


def test_a_fork_racing_a_get_or_create_of_its_id_leaves_one_whole_session(
    sql_store: Opener,
) -> None:
    first, second = sql_store(), sql_store()
    _turns(first.get_or_create("src", _agent()), 0, 2)
    barrier = threading.Barrier(2)
    outcome: dict[str, Any] = {}

    def fork() -> None:
        barrier.wait(_HANG_GUARD)
        try:
            outcome["fork"] = first.fork("src", "new")
        except ValueError as exc:
            outcome["fork"] = exc

    def create() -> None:
        barrier.wait(_HANG_GUARD)
        outcome["create"] = second.get_or_create("new", _agent())

    threads = [threading.Thread(target=fork), threading.Thread(target=create)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(_HANG_GUARD)
    fresh = sql_store().get("new")
    if isinstance(outcome["fork"], Exception):
        assert "exists" in str(outcome["fork"])
        assert fresh.history == [] and fresh.forked_from is None
    else:
        assert _contents(fresh.history) == ["u0", "m0", "u1", "m1"]
        assert fresh.forked_from == "src"
        assert _contents(outcome["create"].history) == _contents(fresh.history)


def test_a_replaced_history_keeps_the_summary_when_another_worker_wrote_first(
    sql_store: Opener,
) -> None:
    """``history = ...`` is no clear: rebased on another worker's write, the summary stays."""
    first = sql_store(default_max_turns=1, summarizer=_summarize)
    ctx = first.get_or_create("s", _agent())
    _turns(ctx, 0, 2)
    assert first.wait_for_summaries(_HANG_GUARD)
    ctx = first.get("s")
    assert ctx.summary == "u0,m0"
    _turn(sql_store(default_max_turns=1).get("s"), "2")  # another worker: ctx is behind
    ctx.history = [m for m in ctx.history if m.role != Role.MODEL]  # e.g. a redaction
    assert ctx.summary == "u0,m0"
    fresh = sql_store(default_max_turns=1).get("s")
    assert fresh.summary == "u0,m0"
    assert _contents(fresh.history) == [ctx.history[0].content, "u1"]


def test_a_clear_rebased_on_another_workers_summary_drops_it(sql_store: Opener) -> None:
    first = sql_store(default_max_turns=1)
    ctx = first.get_or_create("s", _agent())
    _turn(ctx, "0")
    other = sql_store(default_max_turns=1, summarizer=_summarize)
    _turn(other.get("s"), "1")
    assert other.wait_for_summaries(_HANG_GUARD)
    assert other.get("s").summary == "u0,m0"
    ctx.clear_history()  # behind the other worker's turn and summary
    assert ctx.summary is None and ctx.history == []
    fresh = sql_store(default_max_turns=1).get("s")
    assert fresh.summary is None and fresh.history == []


def test_a_rollback_that_restores_pruned_messages_keeps_them_out_of_the_summary(
    any_store: Opener,
) -> None:
    """Outside a turn, rollback_to undoes a prune: the restored turn is not summarized too."""
    gate = _Gate()
    store = any_store(default_max_turns=1, summarizer=gate)
    ctx = store.get_or_create("s", _agent())
    _turn(ctx, "0")
    checkpoint = len(ctx.history)
    ctx.add_message(Message(role=Role.USER, content="u1"))  # prunes u0, m0 (written at once)
    assert gate.started.wait(_HANG_GUARD)
    ctx.rollback_to(checkpoint)  # u0, m0 are back in the window
    assert _contents(ctx.history) == ["u0", "m0"]
    gate.event.set()
    assert store.wait_for_summaries(_HANG_GUARD)
    shown = store.get("s")
    assert shown.summary is None, "u0 and m0 are in the window and in the summary"
    assert _contents(shown.history) == ["u0", "m0"]
    _turn(store.get("s"), "2")  # u0 and m0 pruned again: now they are summarized, once
    assert store.wait_for_summaries(_HANG_GUARD)
    _turn(store.get("s"), "3")
    assert store.wait_for_summaries(_HANG_GUARD)
    assert store.get("s").summary == "u0,m0,u2,m2"
