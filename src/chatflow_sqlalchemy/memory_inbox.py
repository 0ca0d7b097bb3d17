"""The durable inbox of the in-memory store: the same states and rules, in dicts.

"Durable" means: until the store closes. Leases are per session, in the
process, with the store's ``turn_lease_seconds`` and the monotonic clock; they
let several ``serve`` loops of one store share its sessions as workers of a
SQL store do.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from chatflow_sqlalchemy.exceptions import LeaseLostError
from chatflow_sqlalchemy.inbox import (
    BATCH_LIMIT,
    DEAD,
    DONE,
    IN_FLIGHT,
    INBOX_STATES,
    MAX_COALESCE_FACTOR,
    PENDING,
    SENT,
    BatchFence,
    InboxEntry,
    InboxItem,
    InboxReply,
    InboxStats,
    Unsent,
    resumed_token,
)
from chatflow_sqlalchemy.lifecycle import ExportedInboxMessage
from chatflow_sqlalchemy.values import Lease, utcnow

__all__ = ["MemoryInbox"]

_T = TypeVar("_T")


@dataclass
class _Row:
    """One message, as the SQL stores' row."""

    id: int
    message_id: str
    session_id: str
    text: str
    sent_at: datetime | None
    payload: Any
    received_at: datetime
    updated_at: datetime
    state: str = PENDING
    attempts: int = 0
    not_before: datetime | None = None
    batch_token: str | None = None
    answered_at: datetime | None = None
    reply: str | None = None
    error: str | None = None

    def set(self, state: str, now: datetime, **changes: Any) -> None:
        self.state, self.updated_at = state, now
        for name, value in changes.items():
            setattr(self, name, value)

    def dead_or_pending(self, dead: bool, now: datetime, error: str) -> None:
        """Dead (its batch token kept, for ``retry``), or pending without a batch."""
        self.set(DEAD if dead else PENDING, now, error=error,
                 batch_token=self.batch_token if dead else None)


class MemoryInbox:
    """:class:`~chatflow_sqlalchemy.inbox.InboxRows` of the in-memory store.

    Args:
        lease_seconds: How long a batch's lease lasts without renewal.

    """

    def __init__(self, lease_seconds: float) -> None:
        self._lease_seconds = lease_seconds
        self._rows: dict[str, _Row] = {}
        self._leases: dict[str, tuple[str, int, float]] = {}  # owner, fence, expiry
        self._fences: dict[str, int] = {}
        self._next_id = 1
        self._lock = threading.RLock()

    @contextmanager
    def held(self) -> Iterator[None]:
        """No lease is taken or given back meanwhile (this thread's own calls still run).

        A store that reads :meth:`leased` and then forgets sessions holds the inbox
        across both, as a SQL store checks and deletes in one statement.
        """
        with self._lock:
            yield

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run the call here: nothing blocks."""
        return fn(*args)

    def clear(self) -> None:
        """Forget every message and lease (the store was cleared or closed)."""
        with self._lock:
            self._rows.clear()
            self._leases.clear()

    def forget_sessions(self, session_ids: Collection[str]) -> None:
        """Drop the messages and leases of these sessions (deleted, erased or swept).

        A lease goes with its session, as on the SQL stores (it is kept on the
        session's row): a batch in flight then finds it lost and records,
        answers and sends nothing.
        """
        with self._lock:
            self._rows = {k: r for k, r in self._rows.items() if r.session_id not in session_ids}
            for session_id in session_ids:
                self._leases.pop(session_id, None)

    def exported(self, session_ids: Collection[str]) -> list[ExportedInboxMessage]:
        """The messages of these sessions (their user's export), in arrival order."""
        with self._lock:
            rows = sorted((r for r in self._rows.values() if r.session_id in session_ids),
                          key=lambda row: row.id)
            return [
                ExportedInboxMessage(
                    row.message_id, row.session_id, row.state, row.text, row.payload, row.sent_at,
                    row.received_at, row.updated_at, row.attempts, row.reply, row.error,
                )
                for row in rows
            ]

    def put(
        self, message_id: str, session_id: str, text: str, sent_at: datetime | None, payload: Any
    ) -> bool:
        """Keep a pending message; False if its id is in the inbox."""
        now = utcnow()
        with self._lock:
            if message_id in self._rows:
                return False
            self._rows[message_id] = _Row(
                self._next_id, message_id, session_id, text, sent_at, payload, now, now
            )
            self._next_id += 1
        return True

    def ready(self, coalesce_seconds: float, limit: int, busy: Collection[str]) -> list[str]:
        """Sessions whose batch is due and whose lease is free."""
        now = utcnow()
        coalesced = now - timedelta(seconds=coalesce_seconds)
        waited = now - timedelta(seconds=coalesce_seconds * MAX_COALESCE_FACTOR)
        sessions: dict[str, list[_Row]] = {}
        with self._lock:
            for row in self._rows.values():
                if row.state in (PENDING, IN_FLIGHT) and row.session_id not in busy:
                    sessions.setdefault(row.session_id, []).append(row)
            due = [
                (min(row.id for row in rows), sid) for sid, rows in sessions.items()
                if self._free(sid) and _due(rows, now, coalesced, waited)
            ]
        return [sid for _, sid in sorted(due)[:limit]]

    def leased(self, session_ids: Collection[str]) -> set[str]:
        """Those of ``session_ids`` a batch holds now (a sweep leaves them)."""
        with self._lock:
            return {sid for sid in session_ids if not self._free(sid)}

    def _free(self, session_id: str) -> bool:
        held = self._leases.get(session_id)
        return held is None or held[2] <= time.monotonic()

    def take(self, session_id: str) -> Lease | None:
        """The session's lease, if free or expired."""
        with self._lock:
            if not self._free(session_id):
                return None
            fence = self._fences[session_id] = self._fences.get(session_id, 0) + 1
            owner = secrets.token_hex(16)
            self._leases[session_id] = (owner, fence, time.monotonic() + self._lease_seconds)
        return Lease(session_id, owner, fence, 0)

    def _holds(self, lease: Lease) -> bool:
        held = self._leases.get(lease.session_id)
        return held is not None and held[:2] == (lease.owner, lease.fence) and (
            held[2] > time.monotonic()
        )

    def warm(self, lease: Lease) -> None:
        """Nothing to read: the in-memory store's contexts are its sessions."""

    def renew(self, lease: Lease) -> bool:
        """Move the lease on; False if lost."""
        with self._lock:
            if not self._holds(lease):
                return False
            expiry = time.monotonic() + self._lease_seconds
            self._leases[lease.session_id] = (lease.owner, lease.fence, expiry)
            return True

    def release(self, lease: Lease) -> None:
        """Give the lease back, if still this holder's."""
        with self._lock:
            held = self._leases.get(lease.session_id)
            if held is not None and held[:2] == (lease.owner, lease.fence):
                del self._leases[lease.session_id]
        lease.released = True

    def _check(self, lease: Lease) -> None:
        if not self._holds(lease):
            raise LeaseLostError(lease.session_id)

    def _batch(self, token: str, lease: Lease | None = None) -> list[_Row]:
        """The rows of a batch (under ``_lock``), once its ``lease`` is checked."""
        if lease is not None:
            self._check(lease)
        return [
            row for row in self._rows.values()
            if row.batch_token == token and row.state == IN_FLIGHT
        ]

    def open_batch(
        self, lease: Lease, token: str, max_attempts: int
    ) -> tuple[list[Unsent], list[InboxItem]]:
        """Recover a dead holder's messages, gather unsent replies, take the pending batch."""
        now = utcnow()
        with self._lock:
            self._check(lease)
            rows = sorted(
                (row for row in self._rows.values() if row.session_id == lease.session_id),
                key=lambda row: row.id,
            )
            for row in rows:
                if row.state == IN_FLIGHT and row.answered_at is None:
                    row.dead_or_pending(row.attempts >= max_attempts, now,
                                        "the worker handling it stopped (its lease expired)")
            unsent = self._answered(rows, token, now)
            pending = [row for row in rows if row.state == PENDING and row.answered_at is None]
            pending.sort(key=lambda row: (row.sent_at or row.received_at, row.id))
            items = []
            for row in pending[:BATCH_LIMIT]:
                row.set(IN_FLIGHT, now, batch_token=token, not_before=None,
                        attempts=row.attempts + 1)
                items.append(InboxItem(
                    row.message_id, row.session_id, row.text, row.sent_at, row.received_at,
                    row.payload, row.attempts,
                ))
        return unsent, items

    def _answered(self, rows: list[_Row], token: str, now: datetime) -> list[Unsent]:
        groups: dict[str | None, list[_Row]] = {}
        for row in rows:
            if row.answered_at is not None and row.state in (PENDING, IN_FLIGHT):
                groups.setdefault(row.batch_token, []).append(row)
        unsent: list[Unsent] = []
        for group in groups.values():
            reply = group[-1].reply
            resumed = resumed_token(token, len(unsent))
            for row in group:
                if reply is None:
                    row.set(DONE, now)
                else:
                    row.set(IN_FLIGHT, now, batch_token=resumed)
            if reply is not None:
                ids = tuple(row.message_id for row in group)
                unsent.append(Unsent(resumed, InboxReply(group[0].session_id, reply, ids)))
        return unsent

    def answer(self, batch: BatchFence, reply: str | None) -> None:
        """A batch's turn committed: record its reply (under the store's turn).

        Raises:
            LeaseLostError: The batch no longer holds its lease or its items.

        """
        now = utcnow()
        with self._lock:
            rows = self._batch(batch.token, batch.lease)
            if len(rows) != batch.size:
                raise LeaseLostError(batch.session_id)
            for row in rows:
                row.answered_at, row.reply, row.updated_at = now, reply, now

    def finish(self, lease: Lease, token: str, reply: str | None, to_send: bool) -> bool:
        """Store the reply; the items are done, or in flight until sent."""
        now = utcnow()
        with self._lock:
            if not self._holds(lease):
                return False
            for row in self._batch(token):
                row.set(IN_FLIGHT if to_send else DONE, now, reply=reply,
                        answered_at=row.answered_at or now)
        return True

    def sent(self, token: str) -> None:
        """The reply was sent."""
        now = utcnow()
        with self._lock:
            for row in self._batch(token):
                row.set(SENT, now)

    def failed(
        self, lease: Lease, token: str, error: str, retry_in: float, max_attempts: int
    ) -> None:
        """Back to pending after ``retry_in`` seconds, or dead."""
        now = utcnow()
        with self._lock:
            for row in self._batch(token, lease):
                dead = row.attempts >= max_attempts or row.answered_at is not None
                row.dead_or_pending(dead, now, error)
                row.not_before = now + timedelta(seconds=retry_in)

    def undeliverable(self, lease: Lease, token: str, error: str) -> None:
        """``send`` kept failing: dead, the reply kept."""
        now = utcnow()
        with self._lock:
            for row in self._batch(token, lease):
                row.set(DEAD, now, error=error)

    def abandon(self, lease: Lease, token: str) -> None:
        """``serve`` stopped during ``handle``: unanswered items pending again, uncounted."""
        now = utcnow()
        with self._lock:
            for row in self._batch(token, lease):
                if row.answered_at is None:
                    row.set(PENDING, now, attempts=row.attempts - 1, batch_token=None)

    def entries(self, state: str | None, limit: int | None) -> list[InboxEntry]:
        """Messages in arrival order, optionally of one state."""
        with self._lock:
            found = [
                InboxEntry(row.message_id, row.session_id, row.state, row.attempts,
                           row.received_at, row.updated_at, row.sent_at, row.error)
                for row in sorted(self._rows.values(), key=lambda row: row.id)
                if state is None or row.state == state
            ]
        return found[:limit]

    def retry(self, message_id: str) -> bool:
        """A dead message, with the rest of its dead batch, back to pending."""
        now = utcnow()
        with self._lock:
            row = self._rows.get(message_id)
            if row is None or row.state != DEAD:
                return False
            token = row.batch_token
            for other in self._rows.values():
                if other.state == DEAD and (
                    other is row or (token is not None and other.batch_token == token)
                ):
                    other.set(PENDING, now, attempts=0, not_before=None)
        return True

    def stats(self) -> InboxStats:
        """Counts per state, oldest pending age, dead in the last hour."""
        now = utcnow()
        hour_ago = now - timedelta(hours=1)
        counts = dict.fromkeys(INBOX_STATES, 0)
        with self._lock:
            rows = self._rows.values()
            for row in rows:
                counts[row.state] += 1
            oldest = min((row.received_at for row in rows if row.state == PENDING), default=None)
            dead = sum(row.state == DEAD and row.updated_at > hour_ago for row in rows)
        age = None if oldest is None else max(0.0, (now - oldest).total_seconds())
        return InboxStats(counts, age, dead)

    def purge(self, older_than_seconds: float) -> int:
        """Forget done and sent messages older than the dedup window."""
        cutoff = utcnow() - timedelta(seconds=older_than_seconds)
        with self._lock:
            kept = {
                key: row for key, row in self._rows.items()
                if row.state not in (DONE, SENT) or row.updated_at >= cutoff
            }
            purged = len(self._rows) - len(kept)
            self._rows = kept
        return purged


def _due(rows: list[_Row], now: datetime, coalesced: datetime, waited: datetime) -> bool:
    if any(row.state == IN_FLIGHT for row in rows):
        return True
    if any(row.not_before is not None and row.not_before > now for row in rows):
        return False
    received = [row.received_at for row in rows]
    return max(received) <= coalesced or min(received) <= waited
