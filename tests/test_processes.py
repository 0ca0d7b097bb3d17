"""Real OS processes: killed mid-turn, and several workers on one conversation.

These prove the crash-safety and cross-process guarantees of DESIGN.md
(behaviours 3 and 4) against a real SQLite file and a real PostgreSQL server.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Role

from chatflow_sqlalchemy import SQLiteSessionStore
from chatflow_sqlalchemy.testing import StoreSpec
from chatflow_sqlalchemy.testing.harness import Worker, start_process

from . import _workers, pg_util
from ._workers import postgres_spec, sqlite_spec


def kill_when_ready(worker: Worker) -> None:
    try:
        event = worker.next_event()
        assert event[0] == "ready", f"worker did not reach its blocking point: {event!r}"
    finally:
        worker.kill()
    assert worker.process.exitcode == -signal.SIGKILL


def open_spec(spec: StoreSpec, **kwargs: Any) -> Any:
    return spec.open(**kwargs)


@pytest.fixture
def postgres_url() -> str:
    return pg_util.postgres_url()


@pytest.fixture
def postgres_schema_factory(postgres_url: str) -> Iterator[Any]:
    with contextlib.ExitStack() as stack:
        yield lambda: stack.enter_context(pg_util.fresh_schema(postgres_url))


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def spec(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreSpec]:
    if request.param == "sqlite":
        yield sqlite_spec(tmp_path / "chat.db")
        return
    url = request.getfixturevalue("postgres_url")
    yield postgres_spec(url, request.getfixturevalue("postgres_schema_factory")())


def assert_clean_window(history: list[Any]) -> None:
    """No dangling tool call, no orphan result, first non-system message is USER."""
    body = [m for m in history if m.role != Role.SYSTEM]
    assert not body or body[0].role == Role.USER
    open_calls: set[str] = set()
    for message in body:
        if message.role == Role.USER:
            assert not open_calls, f"turn ended with unanswered tool calls {open_calls}"
        for call in message.tool_calls or []:
            open_calls.add(call.id)
        for result in message.tool_results or []:
            assert result.tool_call_id in open_calls, "tool result without its call"
            open_calls.discard(result.tool_call_id)
    assert not open_calls, f"history ends with unanswered tool calls {open_calls}"


def test_killed_mid_turn_keeps_only_whole_turns(spec: StoreSpec) -> None:
    kill_when_ready(start_process(_workers.kill_mid_turn, spec))
    store = open_spec(spec)
    try:
        session = store.get("s1")
        assert session is not None
        history = session.history
        assert [m.content for m in history if m.role == Role.USER] == ["q1", "q2"]
        assert len(history) == 8  # two turns: USER, MODEL(call), TOOL, MODEL
        assert_clean_window(history)
    finally:
        store.close()


def test_killed_inside_the_lock_between_tool_call_and_result_leaves_no_trace(
    spec: StoreSpec,
) -> None:
    kill_when_ready(start_process(_workers.turn_lock_then_hang, spec))
    store = open_spec(spec)
    try:
        session = store.get("s1")
        assert session is not None
        assert [m.content for m in session.history] == ["q1", "a1"]
        assert_clean_window(session.history)
    finally:
        store.close()


def stored_rows(store: Any, session_id: str) -> int:
    from sqlalchemy import text

    with store.engine.connect() as conn:
        query = text("SELECT COUNT(*) FROM chatflow_messages WHERE session_id = :sid")
        return int(conn.execute(query, {"sid": session_id}).scalar())


def test_writes_outside_the_lock_are_each_durable(spec: StoreSpec) -> None:
    """Without the lock every message is its own unit: a killed writer loses none,
    and the tool call it never answered is not shown (providers reject it)."""
    kill_when_ready(start_process(_workers.direct_writes_then_hang, spec))
    store = open_spec(spec)
    try:
        session = store.get("s1")
        assert session is not None
        assert [m.content for m in session.history] == ["q1", "a1", "q2"]
        assert stored_rows(store, "s1") == 4, "the call's row stays until a message follows"
        session.metadata["seen"] = True  # writes that add no message keep it
        assert stored_rows(store, "s1") == 4
        session.add_message(Message(role=Role.MODEL, content="sorry, the lookup failed"))
        assert stored_rows(store, "s1") == 4, "the next message replaces the dead call"
    finally:
        store.close()
    again = open_spec(spec)
    try:
        session = again.get("s1")
        assert session is not None
        assert [m.content for m in session.history] == [
            "q1", "a1", "q2", "sorry, the lookup failed"
        ]
        assert_clean_window(session.history)
    finally:
        again.close()


@dataclass
class CampaignCounts:
    """What a kill -9 campaign did and found."""

    kills: int = 0
    acknowledged: int = 0
    survived: int = 0
    lost: int = 0
    duplicated: int = 0
    malformed: int = 0
    problems: list[str] = field(default_factory=list)


def kill_campaign(spec: StoreSpec, mode: str, kills: int, seed: int) -> CampaignCounts:
    """Start a writer, kill -9 it at a random point, reload, check; ``kills`` times.

    Every round continues the same session, so each writer also repairs what
    the previous one left. Acknowledged turns must be stored exactly once and
    whole; the reload must be a clean window (no dangling call, no orphan result).
    """
    rng = random.Random(seed)
    counts = CampaignCounts()
    acked: list[str] = []
    for round_no in range(kills):
        worker = start_process(
            _workers.campaign_writer, spec, "s", f"{mode}{seed}r{round_no}", mode,
            rng.randrange(1 << 30),
        )
        try:
            for _ in range(rng.randint(1, 4)):
                event = worker.next_event()
                assert event[0] == "ack", f"campaign writer sent {event!r}"
                acked.append(event[1])
            time.sleep(rng.uniform(0, 0.01))  # land the kill anywhere in the next turn
        finally:
            left = worker.kill()
        acked.extend(event[1] for event in left if event[0] == "ack")
        counts.kills += 1
        check_campaign_round(spec, acked, counts)
    counts.acknowledged = len(acked)
    return counts


def check_campaign_round(spec: StoreSpec, acked: list[str], counts: CampaignCounts) -> None:
    store = open_spec(spec, default_max_turns=10_000)
    store.set_agent_resolver(lambda name: Agent(name=name, instructions=""))
    try:
        session = store.get("s")
        history = [] if session is None else session.history
    finally:
        store.close()
    try:
        assert_clean_window(history)
    except AssertionError as exc:
        counts.malformed += 1
        counts.problems.append(str(exc))
    questions = Counter(m.content for m in history if m.role == Role.USER)
    counts.survived = sum(1 for q in acked if questions[q] == 1)
    counts.lost = sum(1 for q in acked if questions[q] == 0)
    counts.duplicated = sum(n - 1 for n in questions.values() if n > 1)
    for index, message in enumerate(history):  # an acknowledged turn is whole
        if message.role == Role.USER and message.content in acked:
            turn = history[index : index + 4]
            if [m.role for m in turn] != [Role.USER, Role.MODEL, Role.TOOL, Role.MODEL]:
                counts.problems.append(f"turn {message.content} not whole")


@pytest.mark.parametrize("mode", ["direct", "locked"])
def test_kill_campaign_loses_and_duplicates_nothing(spec: StoreSpec, mode: str) -> None:
    kills = int(os.environ.get("CHATFLOW_CAMPAIGN_KILLS", "4"))
    counts = kill_campaign(spec, mode, kills, seed=1234)
    assert counts.kills == kills
    assert (counts.lost, counts.duplicated, counts.malformed) == (0, 0, 0), counts
    assert counts.survived == counts.acknowledged
    assert not counts.problems, counts.problems


def run_fleet(spec: StoreSpec, tmp_path: Path, workers: int, turns: int,
              sessions: list[str], delay: float) -> list[dict[str, Any]]:
    started = [
        start_process(_workers.fleet, spec, f"w{i}", turns, sessions, delay)
        for i in range(workers)
    ]
    try:
        return [entry for worker in started for entry in worker.result(timeout=240)]
    finally:
        for worker in started:
            worker.stop()


def check_fleet_histories(spec: StoreSpec, sessions: list[str], expected: int) -> None:
    store = open_spec(spec, default_max_turns=10_000)
    try:
        for session_id in sessions:
            session = store.get(session_id)
            assert session is not None
            history = session.history
            assert len(history) == expected
            for question, answer in zip(history[::2], history[1::2], strict=True):
                assert question.role == Role.USER
                assert answer.role == Role.MODEL
                assert answer.content == f"Bot re: {question.content}"
    finally:
        store.close()


@pytest.mark.slow
def test_processes_on_one_sqlite_session_never_interleave_turns(tmp_path: Path) -> None:
    """SQLite has no turn lock across processes: turns are rebased, whole and in order."""
    spec = sqlite_spec(tmp_path / "fleet.db")
    open_spec(spec).close()  # create the schema once, like a deploy step would
    run_fleet(spec, tmp_path, workers=2, turns=15, sessions=["a", "b"], delay=0.005)
    check_fleet_histories(spec, ["a", "b"], expected=2 * 15 * 2)


@pytest.mark.slow
@pytest.mark.postgres
def test_postgres_fleet_serialises_turns_across_processes(
    tmp_path: Path, postgres_url: str, postgres_schema_factory: Any
) -> None:
    """Two workers x 25 turns on the same two sessions through the real Runner."""
    spec = postgres_spec(postgres_url, postgres_schema_factory())
    open_spec(spec).close()
    log = run_fleet(spec, tmp_path, workers=2, turns=25, sessions=["a", "b"], delay=0.02)
    check_fleet_histories(spec, ["a", "b"], expected=100)
    store = open_spec(spec, default_max_turns=10_000)
    try:
        position = {}
        for session_id in ("a", "b"):
            session = store.get(session_id)
            assert session is not None
            for index, message in enumerate(session.history):
                if message.role == Role.USER:
                    position[message.content] = index
    finally:
        store.close()
    assert len(log) == 100
    for call in log:
        # The engine saw every message committed before its question, and nothing else.
        assert call["seen"] == position[call["question"]] + 1, call


def test_sqlite_store_accepts_only_the_documented_keywords(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        SQLiteSessionStore(db_path=str(tmp_path / "x.db"), busy_timeout=5000)  # type: ignore[call-arg]
