"""The inbox under kill -9 (DESIGN.md "Durable inbox: nothing lost after the 200").

On a SQLite file and on PostgreSQL (a schema of its own), three worker
processes serve ``store.inbox`` (``tests/_inbox_workers.py``: a real
``Runner`` turn per batch, ``send`` appending each reply to a file on disk)
while this process puts 20 sessions x 5 messages in bursts, as a webhook
would, and kills workers with ``SIGKILL``:

* deliberately, once each, at named points: right after a put (this process
  kills a worker), and in the workers themselves when ``handle`` is called
  (``taken``), inside the turn (``mid_turn``), after the turn's commit
  before ``send`` (``after_commit``), and after ``send`` before the inbox
  records it (``after_send``);
* at random moments while the messages come in.

Every killed worker is restarted. Once every message is ``sent`` (a hang
guard bounds the wait), a fresh store and the send files must show: every
message answered exactly once and in its session's order (the USER messages
of the histories, split into the batches' lines), every message covered by
exactly one sent reply whose text is the answer to exactly its messages, and
nothing left in another state.

One double send is expected and allowed, and counted apart: ``send`` is
at-least-once. A worker killed after its ``send`` returned and before the
inbox recorded it sent leaves a reply that the worker taking the session
over sends again (the turn does not run again: its stored reply is
resent). Such a resend is attributed to that window only if the first
sender was killed after that send and before the resend, and had not seen
the inbox record it (the workers log that too); any other duplicate counts
as doubled and fails the test.
"""

from __future__ import annotations

import contextlib
import itertools
import json
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

from chatflow_sqlalchemy.testing import StoreSpec
from chatflow_sqlalchemy.testing.harness import Worker, start_process

from . import _inbox_workers, pg_util
from ._inbox_workers import KILL_POINTS, SENDS_GLOB, point_file
from ._workers import postgres_spec, sqlite_spec

pytestmark = pytest.mark.slow

SESSIONS, MESSAGES, WORKERS = 20, 5, 3
SERVE_OPTIONS = {"concurrency": 4, "coalesce_seconds": 0.2, "retry_seconds": 0.1}
STORE_OPTIONS = {"turn_lease_seconds": 1.0}

SESSION_SPACING = 0.3
"""Seconds between the first messages of consecutive sessions."""

BURST_GAP = 0.03
"""Seconds between the messages of one burst (well inside the coalesce window)."""

PAUSE = (0.6, 1.5)
"""Seconds between a session's two bursts (past the coalesce window)."""

RANDOM_KILL_EVERY = (0.7, 2.0)
"""Seconds between random kills, while messages come in and a little after."""

KILLING_AFTER_LAST_PUT = 2.0
"""Random kills go on this long after the last put."""

ANSWERED_BOUND = 120.0
"""Hang guard: every message sent within this many seconds of the first put."""

SENT_AT_BASE = 1_767_225_600
"""The platform's timestamps (epoch seconds) start here, one second apart along a session."""

SEED = int(os.environ.get("CHATFLOW_CAMPAIGN_SEED", "27"))


@dataclass(frozen=True)
class Inbound:
    """One message of the campaign, as the platform sends it."""

    message_id: str
    session_id: str
    text: str
    sent_at: int


@dataclass
class Counts:
    """What the campaign did and found."""

    messages: int = 0
    batches: int = 0
    kills: Counter[str] = field(default_factory=Counter)
    redeliveries_refused: int = 0
    lost: int = 0
    doubled: int = 0
    out_of_order: int = 0
    resent: int = 0
    problems: list[str] = field(default_factory=list)

    def summary(self, backend: str) -> str:
        """The one line the test prints."""
        points = ", ".join(f"{p} {self.kills[p]}" for p in ("after_put", *KILL_POINTS, "random"))
        return (
            f"inbox campaign {backend} (seed {SEED}): messages {self.messages}, batches "
            f"{self.batches}, kills {sum(self.kills.values())} ({points}), lost {self.lost}, "
            f"doubled {self.doubled}, out of order {self.out_of_order}, resent after a kill "
            f"between send and its record (at-least-once) {self.resent}, redeliveries refused "
            f"{self.redeliveries_refused}"
        )


def plan(rng: random.Random) -> list[tuple[float, Inbound]]:
    """When each message is put (seconds from the start), in order.

    Per session: a burst of 2 or 3 messages, a pause past the coalesce
    window, then the rest; ``sent_at`` increases along the session.
    """
    timeline: list[tuple[float, Inbound]] = []
    for s in range(SESSIONS):
        session_id = f"inbox-{s:02d}"
        first = rng.choice((2, 3))
        at = s * SESSION_SPACING
        for k in range(MESSAGES):
            if k == first:
                at += rng.uniform(*PAUSE)
            inbound = Inbound(f"wamid.{s:02d}.{k}", session_id, f"s{s:02d}-m{k}",
                              SENT_AT_BASE + s * 10 + k)
            timeline.append((at, inbound))
            at += BURST_GAP
    timeline.sort(key=lambda entry: entry[0])
    return timeline


def marked(rng: random.Random) -> tuple[dict[str, str], str]:
    """The message whose batch dies at each worker kill point, and the one after whose put
    this process kills a worker."""
    sessions = rng.sample(range(SESSIONS), len(KILL_POINTS) + 1)
    ids = [f"wamid.{s:02d}.{k}" for s, k in zip(sessions, (0, 2, 3, 4, 1), strict=True)]
    return dict(zip(KILL_POINTS, ids[:-1], strict=True)), ids[-1]


class Fleet:
    """The worker processes, by slot: started, killed, restarted, and who died when."""

    def __init__(self, spec: StoreSpec, log_dir: Path, marks: dict[str, str],
                 texts: dict[str, str], rng: random.Random) -> None:
        self._args = (spec, str(log_dir), marks, texts, SERVE_OPTIONS, STORE_OPTIONS)
        self._rng = rng
        self.workers: dict[int, Worker] = {}
        self.killed: dict[int, float] = {}
        """pid -> when this process killed it (wall clock, as the send files)."""
        self.died: list[int] = []
        """pids of the workers that killed themselves."""

    def start(self, slot: int) -> Worker:
        worker = start_process(_inbox_workers.inbox_worker, self._args[0], slot, *self._args[1:],
                               self._rng.randrange(1 << 30))
        self.workers[slot] = worker
        return worker

    def kill(self, slot: int) -> None:
        """SIGKILL the worker in ``slot`` and start another (after restarting the dead)."""
        self.restart_the_dead()
        worker = self.workers[slot]
        self.killed[worker.pid] = time.time()
        worker.kill()
        assert worker.process.exitcode == -signal.SIGKILL
        self.start(slot)

    def restart_the_dead(self) -> None:
        """Start a new worker in place of each one that died (killed itself) on its own."""
        for slot, worker in list(self.workers.items()):
            if worker.process.is_alive() or worker.pid in self.killed:
                continue
            worker.process.join(10)
            assert worker.process.exitcode == -signal.SIGKILL, (
                f"worker {worker.pid} exited with {worker.process.exitcode}: "
                f"{worker.kill() or 'no event'}"
            )
            self.died.append(worker.pid)
            self.start(slot)

    def stop(self) -> None:
        for worker in self.workers.values():
            worker.stop()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def spec(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreSpec]:
    """A fresh database of each backend, its schema created before the workers start."""
    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            made = sqlite_spec(tmp_path / "inbox.db")
        else:
            url = pg_util.postgres_url()
            made = postgres_spec(url, stack.enter_context(pg_util.fresh_schema(url)))
        store: Any = made.open()
        store.close()
        yield made


def test_inbox_kill_campaign(spec: StoreSpec, tmp_path: Path,
                             request: pytest.FixtureRequest) -> None:
    """Nothing lost, answered once, in order, sent once (but the at-least-once window)."""
    backend = request.node.callspec.params["spec"]
    rng = random.Random(SEED)
    timeline = plan(rng)
    inbound = {message.message_id: message for _, message in timeline}
    marks, kill_after_put = marked(rng)
    texts = {mid: message.text for mid, message in inbound.items()}
    fleet = Fleet(spec, tmp_path, marks, texts, rng)
    counts = Counts(messages=len(inbound))
    store: Any = spec.open(**STORE_OPTIONS)
    try:
        for slot in range(WORKERS):
            assert fleet.start(slot).next_event()[0] == "ready"
        run(store, fleet, timeline, kill_after_put, rng, counts)
    finally:
        fleet.stop()
        states = Counter(entry.state for entry in store.inbox.entries(limit=None))
        store.close()
    check(spec, tmp_path, inbound, fleet, counts)
    print(counts.summary(backend))
    assert states == {"sent": len(inbound)}, f"inbox states at the end: {dict(states)}"
    assert not counts.problems, counts.problems
    assert (counts.lost, counts.doubled, counts.out_of_order) == (0, 0, 0), counts.summary(backend)
    assert counts.redeliveries_refused == SESSIONS
    for point in ("after_put", *KILL_POINTS, "random"):
        assert counts.kills[point] >= 1, f"no worker was killed at {point}"
    assert counts.resent >= 1, "the worker killed after send was not taken over by a resend"


def run(store: Any, fleet: Fleet, timeline: list[tuple[float, Inbound]], kill_after_put: str,
        rng: random.Random, counts: Counts) -> None:
    """Put the messages on time, kill workers, restart the dead, until every message is sent."""
    start = time.monotonic()
    last_put = start + timeline[-1][0]
    next_kill = start + rng.uniform(*RANDOM_KILL_EVERY)
    next_look = start
    pending = list(timeline)
    while True:
        now = time.monotonic()
        while pending and start + pending[0][0] <= now:
            message = pending.pop(0)[1]
            put(store, message, counts)
            if message.message_id == kill_after_put:
                fleet.kill(rng.randrange(WORKERS))
                counts.kills["after_put"] += 1
        if now >= next_kill and now <= last_put + KILLING_AFTER_LAST_PUT:
            fleet.kill(rng.randrange(WORKERS))
            counts.kills["random"] += 1
            next_kill = now + rng.uniform(*RANDOM_KILL_EVERY)
        fleet.restart_the_dead()
        if not pending and now >= next_look:
            stats = store.inbox.stats()
            if stats.counts["sent"] == len(timeline):
                return
            if stats.counts["dead"]:
                pytest.fail(f"messages died: {store.inbox.entries(state='dead')}")
            if now - start > ANSWERED_BOUND:
                pytest.fail(f"not every message was sent within {ANSWERED_BOUND:g} s: "
                            f"{stats.counts}")
            next_look = now + 0.2
        time.sleep(0.005)


def put(store: Any, message: Inbound, counts: Counts) -> None:
    """The webhook: put the message; after a session's last one, redeliver its first."""
    accepted = store.inbox.put(message.message_id, session_id=message.session_id,
                               text=message.text, sent_at=message.sent_at)
    assert accepted, f"{message.message_id} was refused on its first delivery"
    if message.message_id.endswith(f".{MESSAGES - 1}"):
        first = message.message_id.rsplit(".", 1)[0] + ".0"
        if not store.inbox.put(first, session_id=message.session_id, text="redelivered"):
            counts.redeliveries_refused += 1


def check(spec: StoreSpec, log_dir: Path, inbound: dict[str, Inbound], fleet: Fleet,
          counts: Counts) -> None:
    """Count kills by point; then lost, doubled, out of order and resent, from the records."""
    for point in KILL_POINTS:
        path = point_file(log_dir, point)
        if path.exists():
            words = path.read_text().split()
            pid, died = int(words[0]), float(words[1])
            # It killed itself, or this process's random kill landed right there.
            assert pid in fleet.died or pid in fleet.killed, f"{point}'s worker did not die"
            counts.kills[point] += 1
            fleet.killed[pid] = min(died, fleet.killed.get(pid, died))
    histories = read_histories(spec, sorted({m.session_id for m in inbound.values()}))
    unanswered = check_histories(histories, inbound, counts)
    unsent = check_sends(*read_sends(log_dir), inbound, fleet.killed, counts)
    counts.lost = len(unanswered | unsent)


def read_histories(spec: StoreSpec, sessions: list[str]) -> dict[str, list[str]]:
    """Each session's USER messages, through a fresh store."""
    store: Any = spec.open(default_max_turns=10_000)
    try:
        histories = {}
        for session_id in sessions:
            session = store.get(session_id)
            history = [] if session is None else session.history
            histories[session_id] = [m.content or "" for m in history if m.role.value == "user"]
        return histories
    finally:
        store.close()


def check_histories(histories: dict[str, list[str]], inbound: dict[str, Inbound],
                    counts: Counts) -> set[str]:
    """Each message's text once, in its session's sent_at order; return the ids missing."""
    by_text = {m.text: m for m in inbound.values()}
    seen: Counter[str] = Counter()
    for session_id, users in histories.items():
        counts.batches += len(users)
        lines = [line for user in users for line in user.split("\n")]
        seen.update(lines)
        strangers = [line for line in lines
                     if line not in by_text or by_text[line].session_id != session_id]
        if strangers:
            counts.problems.append(f"{session_id}: lines of no message of it: {strangers}")
        order = [by_text[line].sent_at for line in lines if line in by_text]
        counts.out_of_order += sum(1 for a, b in itertools.pairwise(order) if b < a)
    counts.doubled += sum(n - 1 for n in seen.values() if n > 1)
    return {m.message_id for text, m in by_text.items() if seen[text] == 0}


def read_sends(log_dir: Path) -> tuple[list[dict[str, Any]], set[tuple[int, tuple[str, ...]]]]:
    """Every reply the workers sent, in the order they sent them; and the (pid, message
    ids) of those the inbox recorded as sent before their worker died."""
    records = sorted((json.loads(line) for path in sorted(log_dir.glob(SENDS_GLOB))
                      for line in path.read_text().splitlines()), key=lambda r: r["at"])
    recorded = {(r["pid"], tuple(r["message_ids"])) for r in records if r["event"] == "recorded"}
    return [r for r in records if r["event"] == "sent"], recorded


def check_sends(sends: list[dict[str, Any]], recorded: set[tuple[int, tuple[str, ...]]],
                inbound: dict[str, Inbound], killed: dict[int, float],
                counts: Counts) -> set[str]:
    """Every message covered by one reply (its answer); the same reply again only if its
    first sender died after sending it and before the inbox recorded it. Return the ids
    no reply covered."""
    if not recorded:
        counts.problems.append("no worker logged a reply recorded as sent: the log is broken")
    first_send: dict[str, dict[str, Any]] = {}
    for record in sends:
        ids = record["message_ids"]
        expected = "Bot re: " + "\n".join(inbound[mid].text for mid in ids)
        if record["text"] != expected:
            counts.problems.append(f"reply {record['text']!r} is not the answer to {ids}")
        earlier = [first_send[mid] for mid in ids if mid in first_send]
        if not earlier:
            first_send.update(dict.fromkeys(ids, record))
            continue
        first = earlier[0]
        died = killed.get(first["pid"])
        if (all(e is first for e in earlier) and first["message_ids"] == ids
                and first["text"] == record["text"] and died is not None
                and first["at"] <= died <= record["at"]
                and (first["pid"], tuple(ids)) not in recorded):
            counts.resent += 1
        else:
            counts.doubled += 1
            counts.problems.append(f"sent twice, not after a kill in between: {first} {record}")
    return {mid for mid in inbound if mid not in first_send}
