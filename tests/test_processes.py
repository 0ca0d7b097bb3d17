"""Real OS processes: killed mid-turn, and several workers on one conversation.

These prove the crash-safety and cross-process guarantees of DESIGN.md
(behaviours 3 and 4) against a real SQLite file and a real PostgreSQL server.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Role

from chatflow_sqlalchemy import SQLiteSessionStore

from . import pg_util

WORKERS = str(Path(__file__).with_name("_workers.py"))


def start_worker(name: str, *args: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, WORKERS, name, *(json.dumps(a) for a in args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def kill_when_ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "READY" not in line:
        proc.kill()
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"worker did not reach its blocking point: {line!r}\n{err}")
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def open_spec(spec: dict[str, Any], **kwargs: Any) -> Any:
    sys.path.insert(0, str(Path(WORKERS).parent))
    try:
        from _workers import open_store
    finally:
        sys.path.pop(0)
    return open_store(spec, **kwargs)


@pytest.fixture
def postgres_url() -> str:
    return pg_util.postgres_url()


@pytest.fixture
def postgres_schema_factory(postgres_url: str) -> Iterator[Any]:
    with contextlib.ExitStack() as stack:
        yield lambda: stack.enter_context(pg_util.fresh_schema(postgres_url))


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def spec(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    if request.param == "sqlite":
        yield {"kind": "sqlite", "path": str(tmp_path / "chat.db")}
        return
    url = request.getfixturevalue("postgres_url")
    schema = request.getfixturevalue("postgres_schema_factory")()
    yield {"kind": "postgresql", "url": url, "schema": schema}


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


def test_killed_mid_turn_keeps_only_whole_turns(spec: dict[str, Any]) -> None:
    kill_when_ready(start_worker("kill_mid_turn", spec))
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
    spec: dict[str, Any],
) -> None:
    kill_when_ready(start_worker("turn_lock_then_hang", spec))
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


def test_writes_outside_the_lock_are_each_durable(spec: dict[str, Any]) -> None:
    """Without the lock every message is its own unit: a killed writer loses none,
    and the tool call it never answered is not shown (providers reject it)."""
    kill_when_ready(start_worker("direct_writes_then_hang", spec))
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


def kill_campaign(spec: dict[str, Any], mode: str, kills: int, seed: int) -> CampaignCounts:
    """Start a writer, kill -9 it at a random point, reload, check; ``kills`` times.

    Every round continues the same session, so each writer also repairs what
    the previous one left. Acknowledged turns must be stored exactly once and
    whole; the reload must be a clean window (no dangling call, no orphan result).
    """
    rng = random.Random(seed)
    counts = CampaignCounts()
    acked: list[str] = []
    for round_no in range(kills):
        proc = start_worker(
            "campaign_writer", spec, "s", f"{mode}{seed}r{round_no}", mode, rng.randrange(1 << 30)
        )
        assert proc.stdout is not None
        for _ in range(rng.randint(1, 4)):
            line = proc.stdout.readline()
            if not line.startswith("ACK "):
                proc.kill()
                _, err = proc.communicate(timeout=30)
                pytest.fail(f"campaign writer failed: {line!r}\n{err}")
            acked.append(line.split()[1])
        time.sleep(rng.uniform(0, 0.01))  # land the kill anywhere in the next turn
        os.kill(proc.pid, signal.SIGKILL)
        for line in proc.communicate(timeout=30)[0].splitlines():
            if line.startswith("ACK "):
                acked.append(line.split()[1])
        counts.kills += 1
        check_campaign_round(spec, acked, counts)
    counts.acknowledged = len(acked)
    return counts


def check_campaign_round(spec: dict[str, Any], acked: list[str], counts: CampaignCounts) -> None:
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
def test_kill_campaign_loses_and_duplicates_nothing(spec: dict[str, Any], mode: str) -> None:
    kills = int(os.environ.get("CHATFLOW_CAMPAIGN_KILLS", "4"))
    counts = kill_campaign(spec, mode, kills, seed=1234)
    assert counts.kills == kills
    assert (counts.lost, counts.duplicated, counts.malformed) == (0, 0, 0), counts
    assert counts.survived == counts.acknowledged
    assert not counts.problems, counts.problems


def run_fleet(spec: dict[str, Any], tmp_path: Path, workers: int, turns: int,
              sessions: list[str], delay: float) -> list[dict[str, Any]]:
    logs = [tmp_path / f"log-{i}.json" for i in range(workers)]
    procs = [
        start_worker("fleet", spec, f"w{i}", turns, sessions, delay, str(logs[i]))
        for i in range(workers)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
    return [entry for log in logs for entry in json.loads(log.read_text())]


def check_fleet_histories(spec: dict[str, Any], sessions: list[str], expected: int) -> None:
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
                assert answer.content == f"answer to {question.content}"
    finally:
        store.close()


@pytest.mark.slow
def test_processes_on_one_sqlite_session_never_interleave_turns(tmp_path: Path) -> None:
    """SQLite has no turn lock across processes: turns are rebased, whole and in order."""
    spec = {"kind": "sqlite", "path": str(tmp_path / "fleet.db")}
    open_spec(spec).close()  # create the schema once, like a deploy step would
    run_fleet(spec, tmp_path, workers=2, turns=15, sessions=["a", "b"], delay=0.005)
    check_fleet_histories(spec, ["a", "b"], expected=2 * 15 * 2)


@pytest.mark.slow
@pytest.mark.postgres
def test_postgres_fleet_serialises_turns_across_processes(
    tmp_path: Path, postgres_url: str, postgres_schema_factory: Any
) -> None:
    """Two workers x 25 turns on the same two sessions through the real Runner."""
    spec = {"kind": "postgresql", "url": postgres_url, "schema": postgres_schema_factory()}
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
