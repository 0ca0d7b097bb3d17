"""The conformance kit's section on summaries and rewind (DESIGN "Summaries, rewind and forks").

Every store takes ``summarizer=`` and has ``wait_for_summaries``; every
context has ``summary``, ``summary_through``, ``rewind`` and ``arewind``.
These tests run on each harness; those that reopen the database need
``PERSISTENT``, those that read the transcript ``ARCHIVE``, and the race of
worker processes ``CROSS_PROCESS``. They observe only what users can: what a
model is given, ``ctx.history``, ``ctx.summary``, the transcript, what a
fresh store reloads, and what the summarizer is asked to fold.

The scripted summarizer (:class:`FoldingSummarizer`, :func:`fold_user_texts`)
writes the previous summary followed by the text of every USER message it
is given, so a test reads back from the summary itself which turns it
covers and how many times: every pruned turn exactly once is what "never
lose a summary nor fold a turn twice" means.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Role, Runner, ToolCall, ToolResult

from chatflow_sqlalchemy.exceptions import SessionDeletedError
from chatflow_sqlalchemy.testing.engines import ScriptedEngine
from chatflow_sqlalchemy.testing.harness import (
    Capability,
    StoreHarness,
    StoreSpec,
    requires,
    run_workers,
)

__all__ = [
    "SEPARATOR",
    "FoldingSummarizer",
    "RecordingEngine",
    "RewindTests",
    "SummariesAcrossProcessesTests",
    "SummaryTests",
    "fold",
    "fold_user_texts",
    "folded",
    "summarizing_turns_worker",
]

_HANG_GUARD = 60.0
"""Seconds a test waits for summaries, a thread or a gate before it fails (never a timing)."""

SEPARATOR = " | "
"""What the scripted summarizer puts between the texts it folds."""

_LOGGER = "chatflow_sqlalchemy"


# ============================================================== helpers


def fold(previous: str | None, dropped: Sequence[Message]) -> str:
    """The scripted summary: ``previous``, then the text of each USER message of ``dropped``."""
    texts = [m.content or "" for m in dropped if m.role == Role.USER]
    return SEPARATOR.join([*([previous] if previous else []), *texts])


async def fold_user_texts(previous: str | None, dropped: list[Message]) -> str:
    """:func:`fold` as a summarizer (module-level, so a worker process can be given it)."""
    return fold(previous, dropped)


def folded(summary: str | None) -> list[str]:
    """The USER texts a scripted summary covers, in the order they were folded."""
    return summary.split(SEPARATOR) if summary else []


class FoldingSummarizer:
    """A scripted summarizer that records what it is asked and can fail or wait.

    Args:
        fail: Given the call's number (from 1), True to raise instead of answering.
        answer: Given the folded summary, what to return instead (a wrong type, say).
        gate: A ``threading.Event`` every call waits for before answering.

    Attributes:
        calls: ``(previous, dropped)`` of every call, in the order they came.
        started: Set when the first call arrives.

    """

    def __init__(
        self,
        *,
        fail: Callable[[int], bool] | None = None,
        answer: Callable[[str], Any] | None = None,
        gate: threading.Event | None = None,
    ) -> None:
        self.fail = fail
        self.answer = answer
        self.gate = gate
        self.calls: list[tuple[str | None, list[Message]]] = []
        self.started = threading.Event()
        self._mutex = threading.Lock()

    async def __call__(self, previous: str | None, dropped: list[Message]) -> Any:
        with self._mutex:
            self.calls.append((previous, list(dropped)))
            number = len(self.calls)
        self.started.set()
        if self.gate is not None:
            opened = await asyncio.to_thread(self.gate.wait, _HANG_GUARD)
            assert opened, "the test never opened the summarizer's gate"
        if self.fail is not None and self.fail(number):
            raise RuntimeError(f"scripted summarizer failure (call {number})")
        summary = fold(previous, dropped)
        return summary if self.answer is None else self.answer(summary)

    def failed(self, number: int) -> bool:
        """True if call ``number`` (from 1) raised."""
        return self.fail is not None and self.fail(number)


class RecordingEngine(ScriptedEngine):
    """A :class:`ScriptedEngine` that keeps a copy of each history it is given.

    Attributes:
        seen: What the model was shown, one list per model call, oldest first.

    """

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[Message]] = []

    async def generate_turn_async(self, agent: Agent, history: list[Message]) -> Any:
        """Record ``history`` (a copy: the Runner passes the live list), then answer."""
        self.seen.append(list(history))
        return await super().generate_turn_async(agent, history)


def _sid() -> str:
    return f"h-{uuid.uuid4().hex[:12]}"


def _agent() -> Agent:
    return Agent(name="Bot", instructions="")


def _user(text: str) -> Message:
    return Message(role=Role.USER, content=text)


def _system(text: str) -> Message:
    return Message(role=Role.SYSTEM, content=text)


def _turn_messages(text: str, *, tool: bool = False) -> list[Message]:
    """One turn: USER ``text``, a tool call and its result if ``tool``, a MODEL answer."""
    messages = [_user(text)]
    if tool:
        call = ToolCall(id=f"call-{uuid.uuid4().hex[:12]}", name="lookup", args={"q": text})
        result = ToolResult(tool_call_id=call.id, name=call.name, content={"q": text})
        messages += [
            Message(role=Role.MODEL, content=None, tool_calls=[call]),
            Message(role=Role.TOOL, tool_results=[result]),
        ]
    return [*messages, Message(role=Role.MODEL, content=f"re: {text}")]


async def _aturn(ctx: Any, text: str, *, tool: bool = False) -> list[Message]:
    """Run one turn under ``ctx.lock`` (as the Runner does); return its messages."""
    messages = _turn_messages(text, tool=tool)
    async with ctx.lock:
        for message in messages:
            ctx.add_message(message)
    return messages


def _turn(ctx: Any, text: str, *, tool: bool = False) -> list[Message]:
    """:func:`_aturn` on a new event loop (as ``Runner.run`` does)."""
    return asyncio.run(_aturn(ctx, text, tool=tool))


def _dump(messages: Iterable[Message]) -> list[dict[str, Any]]:
    return [m.model_dump(mode="json") for m in messages]


def _outline(messages: Iterable[Message]) -> list[str]:
    return [f"{m.role.value}:{m.content}" for m in messages]


def _users(messages: Iterable[Message]) -> list[str]:
    return [m.content or "" for m in messages if m.role == Role.USER]


def _shaped(messages: Iterable[Message]) -> list[dict[str, Any]]:
    """Messages without their timestamps (to compare two sessions fed alike)."""
    return [m.model_dump(mode="json", exclude={"timestamp"}) for m in messages]


def _warnings(caplog: pytest.LogCaptureFixture, session_id: str) -> list[logging.LogRecord]:
    """The warnings logged about ``session_id``."""
    return [
        r for r in caplog.records
        if r.levelno == logging.WARNING and session_id in r.getMessage()
    ]


def _in_threads(work: Callable[[str], None], labels: Sequence[str]) -> None:
    """Run ``work(label)`` in one thread per label at once; re-raise the first failure."""
    errors: list[BaseException] = []

    def run(label: str) -> None:
        try:
            work(label)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(label,)) for label in labels]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(_HANG_GUARD)
    assert not any(t.is_alive() for t in threads), "turns hung"
    if errors:
        raise errors[0]


def _waited(*stores: Any) -> None:
    """Wait until none of ``stores`` is making a summary (failing after the hang guard)."""
    for store in stores:
        assert store.wait_for_summaries(_HANG_GUARD), "a summary was still being made after 60 s"


def _summary_at_head(ctx: Any, own_systems: int) -> Message:
    """The SYSTEM message carrying ``ctx.summary``, checked to follow the session's own.

    The history starts with the session's ``own_systems`` SYSTEM messages,
    then exactly one SYSTEM message that carries the summary, then turns.
    """
    history = ctx.history
    assert ctx.summary, f"no summary: {_outline(history)}"
    systems = [i for i, m in enumerate(history) if m.role == Role.SYSTEM]
    assert systems == list(range(own_systems + 1)), (
        f"expected {own_systems} SYSTEM message(s) and the summary first: {_outline(history)}"
    )
    carrying = [i for i in systems if ctx.summary in (history[i].content or "")]
    assert carrying == [own_systems], f"the summary is not after the session's own: {carrying}"
    return history[own_systems]  # type: ignore[no-any-return]


def _assert_each_once(summary: str | None, expected: Sequence[str]) -> None:
    """``summary`` folds exactly ``expected``: each text once, in order."""
    parts = folded(summary)
    twice = sorted(t for t, n in Counter(parts).items() if n > 1)
    assert not twice, f"turns folded twice: {twice}"
    missing = [t for t in expected if t not in parts]
    assert not missing, f"turns lost from the summary: {missing}"
    extra = [t for t in parts if t not in expected]
    assert not extra, f"the summary covers turns still in the window (or never sent): {extra}"
    assert parts == list(expected), "the summary folds the turns out of order"


def _reopen(harness: StoreHarness, session_id: str, **store_kwargs: Any) -> tuple[Any, Any]:
    """A fresh store on the same database (a restart) and its load of ``session_id``."""
    fresh: Any = harness.open(**store_kwargs)
    fresh.set_agent_resolver(lambda name: Agent(name=name, instructions=""))
    ctx = fresh.get(session_id)
    assert ctx is not None, f"a fresh store does not find session {session_id!r}"
    return fresh, ctx


def _as_shown(ctx: Any) -> list[dict[str, Any]]:
    """``ctx.history`` to compare with a reload: all of it, bar the summary message's time.

    When the summary's SYSTEM message was made is compared by
    ``test_the_summary_message_reloads_exactly`` alone, so that one
    difference there does not hide what the other tests check.
    """
    summary = ctx.summary
    return [
        m.model_dump(
            mode="json",
            exclude={"timestamp"} if summary and m.role == Role.SYSTEM and summary in (
                m.content or ""
            ) else None,
        )
        for m in ctx.history
    ]


def _assert_reloads(harness: StoreHarness, ctx: Any, **store_kwargs: Any) -> None:
    """With PERSISTENT, a fresh store shows ``ctx``'s history, summary and agent."""
    if not harness.has(Capability.PERSISTENT):
        return
    fresh, again = _reopen(harness, ctx.session_id, **store_kwargs)
    try:
        assert _as_shown(again) == _as_shown(ctx), (
            f"reloaded {_outline(again.history)}, memory holds {_outline(ctx.history)}"
        )
        assert (again.summary, again.summary_through) == (ctx.summary, ctx.summary_through)
        assert again.active_agent.name == ctx.active_agent.name
    finally:
        fresh.close()


def _keys() -> dict[str, bytes]:
    return {"k1": os.urandom(32), "k2": os.urandom(32)}


def _cipher(keys: dict[str, bytes], primary: str, *others: str) -> Any:
    from chatflow_sqlalchemy.crypto import AESGCMCipher

    return AESGCMCipher({name: keys[name] for name in (primary, *others)}, primary)


def _secret_turns(store: Any, ctx: Any) -> None:
    """Three turns on a one-turn window: the first two end up in the summary."""
    for word in ("secret-alpha", "secret-beta", "secret-gamma"):
        _turn(ctx, word)
        _waited(store)
    assert folded(ctx.summary) == ["secret-alpha", "secret-beta"]


def _stored_summary(store: Any, session_id: str) -> str | None:
    """The ``summary`` column of the session's row, as stored (SQL stores)."""
    from sqlalchemy import text

    query = text("SELECT summary FROM chatflow_sessions WHERE session_id = :sid")
    with store.engine.connect() as conn:
        value = conn.execute(query, {"sid": session_id}).scalar_one()
    return None if value is None else str(value)


# ============================================================ summaries


class SummaryTests:
    """``summarizer=``: pruned turns folded into one SYSTEM message the model sees, kept."""

    def test_a_fact_from_turn_one_is_what_the_model_sees_at_turn_200(
        self, harness: StoreHarness
    ) -> None:
        summarizer = FoldingSummarizer()
        store: Any = harness.open(default_max_turns=10, summarizer=summarizer)
        engine = RecordingEngine()
        runner = Runner(starting_agent=_agent(), session_store=store, engine=engine)
        sid = _sid()
        store.get_or_create(sid, _agent()).add_message(_system("be kind"))
        fact = "remember: my locker code is 4711"
        texts = [fact, *(f"message {n}" for n in range(2, 201))]
        for text in texts:
            assert runner.run(sid, text).content == f"Bot re: {text}"
        shown = engine.seen[-1]  # what the model was given at turn 200
        assert _users(shown) == texts[-10:], "turn 200 shows the last ten turns"
        assert shown[0].content == "be kind"
        carrying = [m for m in shown if m.role == Role.SYSTEM and "4711" in (m.content or "")]
        assert len(carrying) == 1 and shown[1] is carrying[0], (
            f"the fact of turn 1 is not in one SYSTEM message after the session's own: "
            f"{_outline(shown[:3])}"
        )
        _waited(store)
        ctx = store.get(sid)
        _summary_at_head(ctx, own_systems=1)
        _assert_each_once(ctx.summary, texts[:-10])
        for _previous, dropped in summarizer.calls:
            assert dropped and dropped[0].role == Role.USER, "a summary is asked of whole turns"
            assert Role.SYSTEM not in {m.role for m in dropped}
        _assert_reloads(harness, ctx, summarizer=summarizer)

    def test_a_summarizer_that_fails_every_other_call_loses_nothing(
        self, harness: StoreHarness, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.WARNING, logger=_LOGGER)
        summarizer = FoldingSummarizer(fail=lambda number: number % 2 == 1)
        store: Any = harness.open(default_max_turns=3, summarizer=summarizer)
        sid = _sid()
        ctx = store.get_or_create(sid, _agent())
        texts: list[str] = []

        async def conversation() -> None:  # one event loop for every turn, as a server has
            for n in range(40):
                texts.append(f"t{n}")
                await _aturn(ctx, texts[-1], tool=n % 4 == 0)
                await asyncio.to_thread(_waited, store)
            while summarizer.failed(len(summarizer.calls)):  # the retry comes at the next prune
                texts.append(f"t{len(texts)}")
                await _aturn(ctx, texts[-1])
                await asyncio.to_thread(_waited, store)

        asyncio.run(conversation())
        assert _users(ctx.history) == texts[-3:], "failures never change a turn"
        _summary_at_head(ctx, own_systems=0)
        _assert_each_once(ctx.summary, texts[:-3])
        failures = [n for n in range(1, len(summarizer.calls) + 1) if summarizer.failed(n)]
        assert failures, "the scripted failures never happened"
        for number in failures:  # what a failed call was given is folded by the next
            failed_texts = set(_users(summarizer.calls[number - 1][1]))
            assert failed_texts <= set(_users(summarizer.calls[number][1])), number
        assert len(_warnings(caplog, sid)) == len(failures), "one warning per failed summary"
        _assert_reloads(harness, ctx)

    @requires(Capability.PERSISTENT)
    def test_the_summary_reloads_identically_and_goes_on_after_a_restart(
        self, harness: StoreHarness
    ) -> None:
        first = FoldingSummarizer()
        store: Any = harness.open(default_max_turns=2, summarizer=first)
        sid = _sid()
        ctx = store.get_or_create(sid, _agent())
        ctx.add_message(_system("rule one"))
        texts = [f"t{n}" for n in range(6)]
        for text in texts:
            _turn(ctx, text, tool=text == "t1")
        _waited(store)
        ctx.add_message(_system("rule two"))  # a SYSTEM message added later: before the summary
        summary_message = _summary_at_head(ctx, own_systems=2)
        assert [m.content for m in ctx.history[:2]] == ["rule one", "rule two"]
        _assert_each_once(ctx.summary, texts[:-2])
        assert ctx.summary_through > 0
        _assert_reloads(harness, ctx, summarizer=first)
        _assert_reloads(harness, ctx)  # a store without a summarizer shows it too
        store.close()

        second = FoldingSummarizer()
        restarted, again = _reopen(harness, sid, default_max_turns=2, summarizer=second)
        assert _as_shown(again) == _as_shown(ctx)
        assert again.history[2].content == summary_message.content
        _turn(again, "t6")
        _waited(restarted)
        assert [previous for previous, _ in second.calls] == [ctx.summary]
        _summary_at_head(again, own_systems=2)
        _assert_each_once(again.summary, texts[:-1])
        _assert_reloads(harness, again)

    @requires(Capability.PERSISTENT)
    def test_the_summary_message_reloads_exactly(self, harness: StoreHarness) -> None:
        """The history a fresh store shows is the one memory holds, to the last field."""
        store: Any = harness.open(default_max_turns=1, summarizer=FoldingSummarizer())
        ctx = store.get_or_create(_sid(), _agent())
        for text in ("t0", "t1"):
            _turn(ctx, text)
        _waited(store)
        _summary_at_head(ctx, own_systems=0)
        fresh, again = _reopen(harness, ctx.session_id)
        try:
            assert _dump(again.history) == _dump(ctx.history)
        finally:
            fresh.close()

    @requires(Capability.ARCHIVE)
    def test_the_transcript_keeps_every_original_message(self, harness: StoreHarness) -> None:
        store: Any = harness.open(default_max_turns=2, archive_pruned=True,
                                  summarizer=FoldingSummarizer())
        sid = _sid()
        ctx = store.get_or_create(sid, _agent())
        ctx.add_message(_system("be brief"))
        everything = [_system("be brief")]
        for n in range(7):
            everything += _turn(ctx, f"t{n}", tool=n % 3 == 0)
            _waited(store)
        _summary_at_head(ctx, own_systems=1)
        _assert_each_once(ctx.summary, [f"t{n}" for n in range(5)])
        expected = _shaped(everything)
        assert _shaped(store.transcript(sid)) == expected
        if harness.has(Capability.PERSISTENT):
            fresh: Any = harness.open()
            try:
                assert _shaped(fresh.transcript(sid)) == expected
            finally:
                fresh.close()

    @requires(Capability.ARCHIVE)
    def test_without_archive_pruned_the_transcript_is_the_window(
        self, harness: StoreHarness
    ) -> None:
        """Pruned turns waiting for a summary are no archive: the transcript does not show them.

        The summarizer always fails here, so the pruned turns keep waiting.
        """
        store: Any = harness.open(default_max_turns=2,
                                  summarizer=FoldingSummarizer(fail=lambda n: True))
        sid = _sid()
        ctx = store.get_or_create(sid, _agent())
        for n in range(4):
            _turn(ctx, f"t{n}")
            _waited(store)
        assert _users(ctx.history) == ["t2", "t3"]
        assert _shaped(store.transcript(sid)) == _shaped(ctx.history), (
            "a store without archive_pruned shows pruned turns in its transcript"
        )

    def test_a_slow_summarizer_never_delays_a_turn(self, harness: StoreHarness) -> None:
        gate = threading.Event()
        summarizer = FoldingSummarizer(gate=gate)
        store: Any = harness.open(default_max_turns=2, summarizer=summarizer)
        sid = _sid()
        ctx = store.get_or_create(sid, _agent())
        texts = [f"t{n}" for n in range(12)]
        try:
            for text in texts[:3]:
                _turn(ctx, text)  # the third prunes: the summarizer is called, and waits
            assert summarizer.started.wait(_HANG_GUARD), "no summary was asked for"
            assert not store.wait_for_summaries(0), "a summary is being made: wait says so"
            later = threading.Thread(target=lambda: [_turn(ctx, t) for t in texts[3:]])
            later.start()
            later.join(_HANG_GUARD)
            assert not later.is_alive(), "turns waited for a summarizer that had not answered"
            assert _users(ctx.history) == texts[-2:]
            assert ctx.summary is None, "no summary before the summarizer answered"
        finally:
            gate.set()
        _waited(store)
        _summary_at_head(ctx, own_systems=0)
        _assert_each_once(ctx.summary, texts[:-2])
        _assert_reloads(harness, ctx)

    @pytest.mark.parametrize(
        "answer",
        [
            pytest.param(None, id="raises"),
            pytest.param(lambda summary: None, id="returns-None"),
            pytest.param(lambda summary: summary.encode(), id="returns-bytes"),
            pytest.param(lambda summary: summary + "\x00", id="returns-NUL"),
        ],
    )
    def test_a_summarizer_that_fails_logs_a_warning_and_leaves_the_turn_alone(
        self, harness: StoreHarness, caplog: pytest.LogCaptureFixture,
        answer: Callable[[str], Any] | None,
    ) -> None:
        caplog.set_level(logging.WARNING, logger=_LOGGER)
        summarizer = FoldingSummarizer(fail=(lambda n: True) if answer is None else None,
                                       answer=answer)
        store: Any = harness.open(default_max_turns=2, summarizer=summarizer)
        runner = Runner(starting_agent=_agent(), session_store=store, engine=ScriptedEngine())
        sid = _sid()
        for n in range(5):
            assert runner.run(sid, f"t{n}").content == f"Bot re: t{n}"
            _waited(store)
        ctx = store.get(sid)
        assert len(summarizer.calls) == 3, "asked again at every prune"
        assert (ctx.summary, ctx.summary_through) == (None, 0)
        assert _outline(ctx.history) == [
            "user:t3", "model:Bot re: t3", "user:t4", "model:Bot re: t4"
        ], "a failed summary leaves the window as pruning made it"
        assert len(_warnings(caplog, sid)) == 3, [r.getMessage() for r in caplog.records]
        _assert_reloads(harness, ctx)

    def test_a_failed_turn_asks_for_no_summary(self, harness: StoreHarness) -> None:
        summarizer = FoldingSummarizer()
        store: Any = harness.open(default_max_turns=2, summarizer=summarizer)
        runner = Runner(starting_agent=_agent(), session_store=store, engine=ScriptedEngine())
        sid = _sid()
        runner.run(sid, "one")
        runner.run(sid, "two")
        with pytest.raises(RuntimeError, match="scripted engine failure"):
            runner.run(sid, "fail")  # pruned "one" in memory, then rolled back
        _waited(store)
        assert summarizer.calls == [], "a rolled-back turn pruned nothing"
        assert _users(store.get(sid).history) == ["one", "two"]
        runner.run(sid, "three")
        _waited(store)
        assert [_outline(dropped) for _, dropped in summarizer.calls] == [
            ["user:one", "model:Bot re: one"]
        ]
        ctx = store.get(sid)
        _assert_each_once(ctx.summary, ["one"])
        _assert_reloads(harness, ctx)

    def test_turns_from_many_threads_fold_each_turn_once(self, harness: StoreHarness) -> None:
        store: Any = harness.open(default_max_turns=3, summarizer=FoldingSummarizer())
        sid = _sid()
        ctx = store.get_or_create(sid, _agent())
        labels = ("a", "b", "c")

        def turns(label: str) -> None:
            for k in range(12):
                _turn(ctx, f"{label}{k}")

        _in_threads(turns, labels)
        _turn(ctx, "last")  # folds what waited for a summary being made then
        _waited(store)
        window = _users(ctx.history)
        pruned = [f"{label}{k}" for label in labels for k in range(12)]
        pruned = [text for text in pruned if text not in window]
        parts = folded(ctx.summary)
        assert sorted(parts) == sorted(pruned), "each pruned turn folded exactly once"
        for label in labels:  # each thread's turns in the order they were taken
            mine = [p for p in parts if p.startswith(label)]
            assert mine == sorted(mine, key=lambda p: int(p[1:]))
        _assert_reloads(harness, ctx)

    @requires(Capability.PERSISTENT, Capability.CROSS_PROCESS)  # stores writing at once
    def test_two_stores_on_one_database_never_lose_a_summary_nor_fold_a_turn_twice(
        self, harness: StoreHarness
    ) -> None:
        first: Any = harness.open(default_max_turns=3, summarizer=FoldingSummarizer())
        second: Any = harness.open(default_max_turns=3, summarizer=FoldingSummarizer())
        sid = _sid()
        contexts = {
            "a": first.get_or_create(sid, _agent()), "b": second.get_or_create(sid, _agent())
        }

        def turns(label: str) -> None:
            for k in range(15):
                _turn(contexts[label], f"{label}{k}")

        _in_threads(turns, list(contexts))
        _waited(first, second)
        _turn(contexts["a"], "last")  # folds what waited while the other store summarized
        _waited(first)
        made_by_first = contexts["a"].summary
        ctx = contexts["b"]
        _turn(ctx, "seen")  # the other store shows that summary at its next turn
        assert made_by_first and (ctx.summary or "").startswith(made_by_first)
        _waited(second)
        window = _users(ctx.history)
        assert window[-1] == "seen"
        sent = [f"{label}{k}" for label in contexts for k in range(15)] + ["last"]
        parts = folded(ctx.summary)
        assert sorted(parts) == sorted(t for t in sent if t not in window), (
            "each pruned turn folded exactly once"
        )
        for label in contexts:
            mine = [p for p in parts if p.startswith(label)]
            assert mine == sorted(mine, key=lambda p: int(p[1:]))
        _summary_at_head(ctx, own_systems=0)
        _assert_reloads(harness, ctx)

    def test_clear_history_drops_the_summary(self, harness: StoreHarness) -> None:
        summarizer = FoldingSummarizer()
        store: Any = harness.open(default_max_turns=1, summarizer=summarizer)
        sid = _sid()
        ctx = store.get_or_create(sid, _agent())
        for text in ("t0", "t1", "t2"):
            _turn(ctx, text)
        _waited(store)
        assert folded(ctx.summary) == ["t0", "t1"]
        ctx.clear_history()
        assert (ctx.history, ctx.summary) == ([], None)
        _assert_reloads(harness, ctx)
        calls = len(summarizer.calls)
        for text in ("n0", "n1", "n2"):
            _turn(ctx, text)
        _waited(store)
        assert [previous for previous, _ in summarizer.calls[calls:]][:1] == [None]
        _assert_each_once(ctx.summary, ["n0", "n1"])
        _assert_reloads(harness, ctx)

    def test_a_session_deleted_while_summarized_stays_deleted_and_its_id_starts_over(
        self, harness: StoreHarness
    ) -> None:
        gate = threading.Event()
        summarizer = FoldingSummarizer(gate=gate)
        store: Any = harness.open(default_max_turns=1, summarizer=summarizer)
        sid = _sid()
        ctx = store.get_or_create(sid, _agent())
        try:
            _turn(ctx, "old0")
            _turn(ctx, "old1")
            assert summarizer.started.wait(_HANG_GUARD)
            assert store.delete(sid)
        finally:
            gate.set()
        _waited(store)
        assert store.get(sid) is None, "the summary brought a deleted session back"
        with pytest.raises(SessionDeletedError):
            ctx.history  # noqa: B018 - the old context is dead
        again = store.get_or_create(sid, _agent())
        for text in ("new0", "new1", "new2"):
            _turn(again, text)
            _waited(store)
        _assert_each_once(again.summary, ["new0", "new1"])
        _assert_reloads(harness, again)

    def test_a_summary_made_before_a_clear_is_dropped(self, harness: StoreHarness) -> None:
        gate = threading.Event()
        summarizer = FoldingSummarizer(gate=gate)
        store: Any = harness.open(default_max_turns=1, summarizer=summarizer)
        ctx = store.get_or_create(_sid(), _agent())
        try:
            _turn(ctx, "t0")
            _turn(ctx, "t1")  # prunes t0: its summary is being made
            assert summarizer.started.wait(_HANG_GUARD)
            ctx.clear_history()
        finally:
            gate.set()
        _waited(store)
        assert (ctx.history, ctx.summary) == ([], None), "what was cleared came back"
        _assert_reloads(harness, ctx)

    def test_a_rewind_while_a_summary_is_made_keeps_both(self, harness: StoreHarness) -> None:
        gate = threading.Event()
        summarizer = FoldingSummarizer(gate=gate)
        store: Any = harness.open(default_max_turns=2, summarizer=summarizer)
        ctx = store.get_or_create(_sid(), _agent())
        try:
            for text in ("t0", "t1", "t2", "t3"):
                _turn(ctx, text)  # t2 prunes t0: its summary is being made
            assert summarizer.started.wait(_HANG_GUARD)
            ctx.rewind()
        finally:
            gate.set()
        _waited(store)
        assert _users(ctx.history) == ["t2"]
        _summary_at_head(ctx, own_systems=0)
        _assert_each_once(ctx.summary, ["t0", "t1"])
        _assert_reloads(harness, ctx)

    @requires(Capability.PERSISTENT)
    def test_a_store_closed_while_summarizing_leaves_the_turns_to_the_next_prune(
        self, harness: StoreHarness
    ) -> None:
        gate = threading.Event()
        summarizer = FoldingSummarizer(gate=gate)
        store: Any = harness.open(default_max_turns=1, summarizer=summarizer)
        sid = _sid()
        ctx = store.get_or_create(sid, _agent())
        try:
            _turn(ctx, "t0")
            _turn(ctx, "t1")  # prunes t0: its summary is being made when the store closes
            assert summarizer.started.wait(_HANG_GUARD)
            store.close()
        finally:
            gate.set()
        restarted, again = _reopen(harness, sid, default_max_turns=1,
                                   summarizer=FoldingSummarizer())
        _turn(again, "t2")  # the next prune, in the next process
        _waited(restarted)
        _assert_each_once(again.summary, ["t0", "t1"])
        restarted.close()

    def test_a_summary_of_a_deleted_session_never_reaches_a_new_one_of_its_id(
        self, harness: StoreHarness
    ) -> None:
        gate = threading.Event()
        summarizer = FoldingSummarizer(gate=gate)
        store: Any = harness.open(default_max_turns=1, summarizer=summarizer)
        sid = _sid()
        try:
            old = store.get_or_create(sid, _agent())
            _turn(old, "old0")
            _turn(old, "old1")  # prunes old0: its summary is being made
            assert summarizer.started.wait(_HANG_GUARD)
            assert store.delete(sid)  # (erase_user does so too)
            again = store.get_or_create(sid, _agent())
            _turn(again, "new0")
        finally:
            gate.set()
        _waited(store)
        assert again.summary is None, f"the deleted session's summary came back: {again.summary}"
        assert _users(again.history) == ["new0"]
        _assert_reloads(harness, again)
        for text in ("new1", "new2"):
            _turn(again, text)
            _waited(store)
        _assert_each_once(again.summary, ["new0", "new1"])
        _assert_reloads(harness, again)

    @requires(Capability.ENCRYPTION)
    def test_the_summary_is_sealed_at_rest(self, harness: StoreHarness) -> None:
        cipher = _cipher(_keys(), "k1")
        store: Any = harness.open(default_max_turns=1, cipher=cipher,
                                  summarizer=FoldingSummarizer())
        sid = _sid()
        ctx = store.get_or_create(sid, _agent())
        _secret_turns(store, ctx)
        stored = _stored_summary(store, sid)
        assert stored and "secret" not in stored, "the summary is stored in clear"
        _assert_reloads(harness, ctx, cipher=cipher)

    @requires(Capability.ENCRYPTION, Capability.PERSISTENT)
    def test_key_rotation_reseals_the_summary(self, harness: StoreHarness) -> None:
        keys, sid = _keys(), _sid()
        store: Any = harness.open(default_max_turns=1, summarizer=FoldingSummarizer(),
                                  cipher=_cipher(keys, "k1"))
        ctx = store.get_or_create(sid, _agent())
        _secret_turns(store, ctx)
        summary = ctx.summary
        store.close()
        rotating: Any = harness.open(cipher=_cipher(keys, "k2", "k1"))
        rotating.rotate_keys()
        assert (_stored_summary(rotating, sid) or "").startswith("cfenc:1:k2:"), (
            "rotate_keys left the summary sealed with the old key"
        )
        rotating.close()
        fresh, again = _reopen(harness, sid, cipher=_cipher(keys, "k2"))  # the old key dropped
        assert again.summary == summary
        fresh.close()

    @requires(Capability.ENCRYPTION, Capability.PERSISTENT)
    def test_encrypting_a_database_seals_its_summaries(self, harness: StoreHarness) -> None:
        keys, sid = _keys(), _sid()
        store: Any = harness.open(default_max_turns=1, summarizer=FoldingSummarizer())
        ctx = store.get_or_create(sid, _agent())
        _secret_turns(store, ctx)
        summary = ctx.summary
        store.close()
        sealing: Any = harness.open(cipher=_cipher(keys, "k1"))
        sealing.rotate_keys()  # how an existing database is encrypted
        assert "secret" not in (_stored_summary(sealing, sid) or "secret"), (
            "the summary stays in clear after the database was encrypted"
        )
        sealing.close()
        fresh, again = _reopen(harness, sid, cipher=_cipher(keys, "k1"), require_encryption=True)
        assert again.summary == summary
        fresh.close()

    @requires(Capability.USER_SCOPE)
    def test_export_user_holds_the_summary(self, harness: StoreHarness) -> None:
        store: Any = harness.open(default_max_turns=1, summarizer=FoldingSummarizer())
        user = f"u-{uuid.uuid4().hex[:10]}"
        ctx = store.get_or_create(_sid(), _agent(), user_id=user)
        _secret_turns(store, ctx)
        exported = store.export_user(user)
        assert ctx.summary in json.dumps(exported), (
            "export_user leaves out the summary, which holds what the user said"
        )

    def test_a_store_without_a_summarizer_is_what_it_was(self, harness: StoreHarness) -> None:
        store: Any = harness.open(default_max_turns=2)
        sid = _sid()
        ctx = store.get_or_create(sid, _agent())
        rules = _system("rules")
        ctx.add_message(rules)
        turns = [_turn(ctx, f"t{n}") for n in range(6)]
        assert store.wait_for_summaries(0) is True, "nothing to wait for"
        assert (ctx.summary, ctx.summary_through) == (None, 0)
        assert _dump(ctx.history) == _dump([rules, *turns[-2], *turns[-1]])
        _assert_reloads(harness, ctx)


# ======================================================== across processes


def summarizing_turns_worker(
    spec: StoreSpec, session_id: str, label: str, n_turns: int, max_turns: int,
    barrier: Any, results: Any,
) -> None:
    """Run ``n_turns`` turns (USER ``f"{label}{k}"``) with :func:`fold_user_texts`; report.

    The store is closed only when it makes no summary any more, as a job that
    ends after its last turn does (``wait_for_summaries``).
    """
    try:
        store: Any = spec.open(default_max_turns=max_turns, summarizer=fold_user_texts)
        try:
            ctx = store.get_or_create(session_id, _agent())
            barrier.wait(30)
            for k in range(n_turns):
                _turn(ctx, f"{label}{k}")
            _waited(store)
        finally:
            store.close()
        results.put(("ok", label))
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))


@requires(Capability.CROSS_PROCESS, Capability.PERSISTENT)
class SummariesAcrossProcessesTests:
    """Workers in several processes summarize one session: no turn lost, none folded twice."""

    def test_processes_never_lose_a_summary_nor_fold_a_turn_twice(
        self, harness: StoreHarness
    ) -> None:
        sid, labels, n_turns = _sid(), ("a", "b", "c"), 15
        store: Any = harness.open(default_max_turns=3, summarizer=fold_user_texts)
        store.get_or_create(sid, _agent())
        args = [(harness.spec(), sid, label, n_turns, 3) for label in labels]
        assert sorted(run_workers(summarizing_turns_worker, args, timeout=180)) == [
            ("ok", label) for label in labels
        ]
        ctx = store.get(sid)
        _turn(ctx, "last")  # folds what waited while another process summarized
        _waited(store)
        window = _users(ctx.history)
        sent = [f"{label}{k}" for label in labels for k in range(n_turns)] + ["last"]
        parts = folded(ctx.summary)
        assert sorted(parts) == sorted(t for t in sent if t not in window), (
            "each pruned turn folded exactly once"
        )
        for label in labels:
            mine = [p for p in parts if p.startswith(label)]
            assert mine == sorted(mine, key=lambda p: int(p[1:]))
        _summary_at_head(ctx, own_systems=0)
        _assert_reloads(harness, ctx)


# =============================================================== rewind


class RewindTests:
    """``ctx.rewind`` / ``arewind``: the last turns removed, in memory and the database alike."""

    def test_rewind_removes_the_last_turns_everywhere(self, harness: StoreHarness) -> None:
        store: Any = harness.open()
        ctx = store.get_or_create(_sid(), _agent())
        ctx.add_message(_system("rules"))
        turns = [_turn(ctx, f"t{n}", tool=n == 3) for n in range(5)]
        rules = ctx.history[0]
        ctx.rewind()
        assert _dump(ctx.history) == _dump([rules, *(m for turn in turns[:4] for m in turn)])
        ctx.rewind(2)  # a turn with a tool call goes whole
        assert _outline(ctx.history) == ["system:rules", *_outline(turns[0] + turns[1])]
        assert store.get(ctx.session_id) is ctx
        _assert_reloads(harness, ctx)
        asyncio.run(ctx.arewind(2))
        assert _outline(ctx.history) == ["system:rules"], "SYSTEM messages stay"
        _assert_reloads(harness, ctx)
        with pytest.raises(ValueError, match="window holds 0"):
            ctx.rewind()

    @pytest.mark.parametrize("turns", [0, -1, True, 1.5, "1", None, 4])
    def test_bad_turns_are_value_errors_and_change_nothing(
        self, harness: StoreHarness, turns: Any
    ) -> None:
        store: Any = harness.open()
        ctx = store.get_or_create(_sid(), _agent())
        for n in range(3):
            _turn(ctx, f"t{n}")
        before = _dump(ctx.history)
        with pytest.raises(ValueError, match="turns"):
            ctx.rewind(turns)
        with pytest.raises(ValueError, match="turns"):
            asyncio.run(ctx.arewind(turns))
        assert _dump(ctx.history) == before
        _assert_reloads(harness, ctx)

    def test_rewind_inside_a_turn_is_refused_and_changes_nothing(
        self, harness: StoreHarness
    ) -> None:
        store: Any = harness.open()
        ctx = store.get_or_create(_sid(), _agent())
        for n in range(3):
            _turn(ctx, f"t{n}")
        refused: list[str] = []

        async def turn() -> None:
            async with ctx.lock:
                ctx.add_message(_user("t3"))
                before = _dump(ctx.history)
                for count in (1, 2):
                    with pytest.raises(RuntimeError) as info:
                        await ctx.arewind(count)
                    refused.append(str(info.value))
                with pytest.raises(RuntimeError):
                    ctx.rewind()  # also: a running event loop
                assert _dump(ctx.history) == before, "a refused rewind changed the turn"
                ctx.add_message(Message(role=Role.MODEL, content="re: t3"))

        asyncio.run(turn())
        assert all("turn" in reason for reason in refused), refused
        assert _users(ctx.history) == ["t0", "t1", "t2", "t3"], "the turn was written whole"
        _assert_reloads(harness, ctx)

        async def outside_a_turn() -> None:
            with pytest.raises(RuntimeError, match="arewind"):
                ctx.rewind()  # a running loop: the sync call says to await arewind

        asyncio.run(outside_a_turn())
        assert _users(ctx.history) == ["t0", "t1", "t2", "t3"]

    @requires(Capability.ARCHIVE)
    def test_rewound_turns_are_archived_with_archive_pruned(self, harness: StoreHarness) -> None:
        store: Any = harness.open(default_max_turns=3, archive_pruned=True)
        plain: Any = harness.open(default_max_turns=3)
        sid, other = _sid(), _sid()
        ctx, same = store.get_or_create(sid, _agent()), plain.get_or_create(other, _agent())
        everything: list[Message] = []
        for n in range(5):
            everything += _turn(ctx, f"t{n}", tool=n == 4)
            _turn(same, f"t{n}", tool=n == 4)
        ctx.rewind(2)
        same.rewind(2)
        assert _users(ctx.history) == ["t2"]
        assert _shaped(store.transcript(sid)) == _shaped(everything), "rewound turns are archived"
        assert _shaped(plain.transcript(other)) == _shaped(same.history), "no archive: the window"
        everything += _turn(ctx, "t5")
        assert _shaped(store.transcript(sid)) == _shaped(everything)
        if harness.has(Capability.PERSISTENT):
            fresh: Any = harness.open()
            try:
                assert _shaped(fresh.transcript(sid)) == _shaped(everything)
            finally:
                fresh.close()
        _assert_reloads(harness, ctx)

    @requires(Capability.PERSISTENT)
    def test_rewind_round_trips_through_restarts(self, harness: StoreHarness) -> None:
        store: Any = harness.open()
        sid = _sid()
        ctx = store.get_or_create(sid, _agent())
        for n in range(4):
            _turn(ctx, f"t{n}", tool=n == 1)
        ctx.rewind()
        expected = _dump(ctx.history)
        store.close()
        restarted, again = _reopen(harness, sid)
        assert _dump(again.history) == expected
        _turn(again, "t4")
        asyncio.run(again.arewind(2))
        assert _users(again.history) == ["t0", "t1"]
        expected = _dump(again.history)
        restarted.close()
        last, third = _reopen(harness, sid)
        assert _dump(third.history) == expected
        _turn(third, "t5")
        assert _users(third.history) == ["t0", "t1", "t5"]
        _assert_reloads(harness, third)
        last.close()

    def test_rewind_then_a_new_turn_is_edit_and_regenerate(self, harness: StoreHarness) -> None:
        store: Any = harness.open()
        engine = RecordingEngine()
        runner = Runner(starting_agent=_agent(), session_store=store, engine=engine)
        sid = _sid()
        runner.run(sid, "hello")
        runner.run(sid, "what is 2+2?")
        store.get(sid).rewind()
        assert runner.run(sid, "what is 3+3?").content == "Bot re: what is 3+3?"
        assert _users(engine.seen[-1]) == ["hello", "what is 3+3?"], "the model saw the edit only"
        ctx = store.get(sid)
        assert _outline(ctx.history) == [
            "user:hello", "model:Bot re: hello", "user:what is 3+3?", "model:Bot re: what is 3+3?"
        ]
        _assert_reloads(harness, ctx)

    def test_rewind_keeps_the_summary(self, harness: StoreHarness) -> None:
        store: Any = harness.open(default_max_turns=2, summarizer=FoldingSummarizer())
        ctx = store.get_or_create(_sid(), _agent())
        ctx.add_message(_system("rules"))
        for n in range(5):
            _turn(ctx, f"t{n}")
            _waited(store)
        summary, through = ctx.summary, ctx.summary_through
        _assert_each_once(summary, ["t0", "t1", "t2"])
        ctx.rewind()
        assert (ctx.summary, ctx.summary_through) == (summary, through)
        _summary_at_head(ctx, own_systems=1)
        assert _users(ctx.history) == ["t3"]
        _assert_reloads(harness, ctx)
        ctx.rewind()
        _summary_at_head(ctx, own_systems=1)
        assert len(ctx.history) == 2, "the session's SYSTEM message and the summary stay"
        with pytest.raises(ValueError):
            ctx.rewind()  # pruned turns are in the summary, not in the window
        _assert_reloads(harness, ctx)
        _turn(ctx, "t5")
        _waited(store)
        assert (ctx.summary, _users(ctx.history)) == (summary, ["t5"])
        _assert_reloads(harness, ctx)

    @requires(Capability.PERSISTENT)
    def test_rewind_takes_the_turn_that_another_store_wrote_last(
        self, harness: StoreHarness
    ) -> None:
        first: Any = harness.open()
        second: Any = harness.open()
        sid = _sid()
        ctx = first.get_or_create(sid, _agent())
        for n in range(3):
            _turn(ctx, f"t{n}")
        _turn(second.get(sid), "from the other store")
        ctx.rewind()  # fenced like a turn: catches up first, then removes the latest turn
        assert _users(ctx.history) == ["t0", "t1", "t2"]
        _assert_reloads(harness, ctx)
        _turn(second.get(sid), "next")
        assert _users(second.get(sid).history) == ["t0", "t1", "t2", "next"]

    @requires(Capability.PERSISTENT, Capability.CROSS_PROCESS)  # stores writing at once
    def test_rewind_waits_for_another_stores_turn(self, harness: StoreHarness) -> None:
        first: Any = harness.open()
        second: Any = harness.open()
        sid = _sid()
        ctx = first.get_or_create(sid, _agent())
        for n in range(3):
            _turn(ctx, f"t{n}")
        other = second.get(sid)
        inside, finish = threading.Event(), threading.Event()

        async def long_turn() -> None:
            async with other.lock:
                other.add_message(_user("long"))
                inside.set()
                await asyncio.to_thread(finish.wait, _HANG_GUARD)
                other.add_message(Message(role=Role.MODEL, content="re: long"))

        holder = threading.Thread(target=asyncio.run, args=(long_turn(),))
        holder.start()
        assert inside.wait(_HANG_GUARD)
        rewinder = threading.Thread(target=ctx.rewind)
        rewinder.start()
        rewinder.join(0.5)  # a chance to start; it must wait for the other store's turn
        finish.set()
        holder.join(_HANG_GUARD)
        rewinder.join(_HANG_GUARD)
        assert not holder.is_alive() and not rewinder.is_alive()
        assert _users(ctx.history) == ["t0", "t1", "t2"], "the rewind removed the turn before it"
        _assert_reloads(harness, ctx)

    def test_rewind_from_another_thread_waits_for_the_running_turn(
        self, harness: StoreHarness
    ) -> None:
        """A rewind is fenced like a turn: one asked for meanwhile (another request) waits.

        Only a rewind from inside the running turn is refused; a rewind from
        another thread of the same process takes its turn after it, as one
        from another store or process does.
        """
        store: Any = harness.open()
        ctx = store.get_or_create(_sid(), _agent())
        for n in range(3):
            _turn(ctx, f"t{n}")
        inside, finish = threading.Event(), threading.Event()
        errors: list[BaseException] = []

        async def long_turn() -> None:
            async with ctx.lock:
                ctx.add_message(_user("long"))
                inside.set()
                await asyncio.to_thread(finish.wait, _HANG_GUARD)
                ctx.add_message(Message(role=Role.MODEL, content="re: long"))

        def rewind() -> None:
            try:
                ctx.rewind()
            except BaseException as exc:
                errors.append(exc)

        holder = threading.Thread(target=asyncio.run, args=(long_turn(),))
        holder.start()
        assert inside.wait(_HANG_GUARD)
        rewinder = threading.Thread(target=rewind)
        rewinder.start()
        rewinder.join(0.5)  # a chance to start; it must wait for the turn
        finish.set()
        holder.join(_HANG_GUARD)
        rewinder.join(_HANG_GUARD)
        assert not holder.is_alive() and not rewinder.is_alive()
        assert not errors, f"a rewind from another thread was refused: {errors[0]!r}"
        assert _users(ctx.history) == ["t0", "t1", "t2"], "the rewind removed the turn before it"
        _assert_reloads(harness, ctx)

    def test_rewind_of_a_deleted_session_says_so(self, harness: StoreHarness) -> None:
        store: Any = harness.open()
        sid = _sid()
        ctx = store.get_or_create(sid, _agent())
        _turn(ctx, "t0")
        store.delete(sid)
        with pytest.raises(SessionDeletedError):
            ctx.rewind()
        assert store.get(sid) is None
