"""The durable inbox of the in-memory store: the same states and rules, in dicts.

Nothing survives the process, so "durable" means: until the store closes.
Leases are per session, in the process, with the store's
``turn_lease_seconds`` and the monotonic clock; they let several ``serve``
loops of one store share its sessions exactly as workers of a SQL store do.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Collection
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
from chatflow_sqlalchemy.values import Lease, utcnow

__all__ = ["MemoryInbox"]

_T = TypeVar("_T")
_ABANDONED = "the worker handling it stopped (its lease expired)"


@dataclass
class _Row:
    """One message, mutable, as the SQL stores' row."""

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

    def entry(self) -> InboxEntry:
        return InboxEntry(
            self.message_id, self.session_id, self.state, self.attempts, self.received_at,
            self.updated_at, self.sent_at, self.error,
        )

    def set(self, state: str, now: datetime) -> None:
        self.state = state
        self.updated_at = now


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
        self._lock = threading.Lock()

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run the call here: nothing blocks."""
        return fn(*args)

    def clear(self) -> None:
        """Forget every message and lease (the store was cleared or closed)."""
        with self._lock:
            self._rows.clear()
            self._leases.clear()

    def forget_sessions(self, session_ids: Collection[str]) -> None:
        """Drop the messages of these sessions (their user was erased)."""
        with self._lock:
            for key in [k for k, row in self._rows.items() if row.session_id in session_ids]:
                del self._rows[key]

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
        """Sessions with a due batch (or a dead holder's messages) and a free lease."""
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

    def _free(self, session_id: str) -> bool:
        held = self._leases.get(session_id)
        return held is None or held[2] <= time.monotonic()

    def take(self, session_id: str) -> Lease | None:
        """The session's lease, if free or expired."""
        with self._lock:
            if not self._free(session_id):
                return None
            fence = self._fences.get(session_id, 0) + 1
            self._fences[session_id] = fence
            owner = secrets.token_hex(16)
            self._leases[session_id] = (owner, fence, time.monotonic() + self._lease_seconds)
        return Lease(session_id, owner, fence, 0)

    def _holds(self, lease: Lease) -> bool:
        held = self._leases.get(lease.session_id)
        return (
            held is not None and held[0] == lease.owner and held[1] == lease.fence
            and held[2] > time.monotonic()
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

    def _of_session(self, session_id: str) -> list[_Row]:
        return sorted(
            (row for row in self._rows.values() if row.session_id == session_id),
            key=lambda row: row.id,
        )

    def open_batch(
        self, lease: Lease, token: str, max_attempts: int
    ) -> tuple[list[Unsent], list[InboxItem]]:
        """Recover a dead holder's messages, gather unsent replies, take the pending batch."""
        now = utcnow()
        with self._lock:
            self._check(lease)
            rows = self._of_session(lease.session_id)
            for row in rows:
                if row.state == IN_FLIGHT and row.answered_at is None:
                    dead = row.attempts >= max_attempts
                    row.set(DEAD if dead else PENDING, now)
                    row.error = _ABANDONED
                    row.batch_token = row.batch_token if dead else None
            unsent = self._answered(rows, token, now)
            pending = [row for row in rows if row.state == PENDING and row.answered_at is None]
            pending.sort(key=lambda row: (row.sent_at or row.received_at, row.id))
            items = []
            for row in pending[:BATCH_LIMIT]:
                row.set(IN_FLIGHT, now)
                row.batch_token, row.not_before = token, None
                row.attempts += 1
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
            if reply is None:
                for row in group:
                    row.set(DONE, now)
                continue
            resumed = resumed_token(token, len(unsent))
            for row in group:
                row.set(IN_FLIGHT, now)
                row.batch_token = resumed
            ids = tuple(row.message_id for row in group)
            unsent.append(Unsent(resumed, InboxReply(group[0].session_id, reply, ids)))
        return unsent

    def _batch(self, token: str) -> list[_Row]:
        return [
            row for row in self._rows.values()
            if row.batch_token == token and row.state == IN_FLIGHT
        ]

    def answer(self, batch: BatchFence, reply: str | None) -> None:
        """A batch's turn committed: record its reply (under the store's turn).

        Raises:
            LeaseLostError: The batch no longer holds its lease or its items.

        """
        now = utcnow()
        with self._lock:
            rows = self._batch(batch.token)
            if not self._holds(batch.lease) or len(rows) != batch.size:
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
                row.reply = reply
                row.answered_at = row.answered_at or now
                row.set(IN_FLIGHT if to_send else DONE, now)
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
        """Back to pending after ``retry_in`` seconds, or dead after ``max_attempts``."""
        now = utcnow()
        with self._lock:
            self._check(lease)
            for row in self._batch(token):
                # Dead at once if its turn committed: running it again would repeat it.
                dead = row.attempts >= max_attempts or row.answered_at is not None
                row.set(DEAD if dead else PENDING, now)
                row.error = error
                row.not_before = now + timedelta(seconds=retry_in)
                if not dead:
                    row.batch_token = None

    def undeliverable(self, lease: Lease, token: str, error: str) -> None:
        """``send`` kept failing: dead, the reply kept."""
        now = utcnow()
        with self._lock:
            self._check(lease)
            for row in self._batch(token):
                row.set(DEAD, now)
                row.error = error

    def abandon(self, lease: Lease, token: str) -> None:
        """``serve`` stopped during ``handle``: unanswered items pending again, uncounted."""
        now = utcnow()
        with self._lock:
            self._check(lease)
            for row in self._batch(token):
                if row.answered_at is None:
                    row.set(PENDING, now)
                    row.attempts -= 1
                    row.batch_token = None

    def entries(self, state: str | None, limit: int | None) -> list[InboxEntry]:
        """Messages in arrival order, optionally of one state."""
        with self._lock:
            rows = sorted(self._rows.values(), key=lambda row: row.id)
            found = [row.entry() for row in rows if state is None or row.state == state]
        return found if limit is None else found[:limit]

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
                    other.set(PENDING, now)
                    other.attempts, other.not_before = 0, None
        return True

    def stats(self) -> InboxStats:
        """Counts per state, oldest pending age, dead in the last hour."""
        now = utcnow()
        hour_ago = now - timedelta(hours=1)
        with self._lock:
            counts = dict.fromkeys(INBOX_STATES, 0)
            oldest: datetime | None = None
            dead = 0
            for row in self._rows.values():
                counts[row.state] += 1
                if row.state == PENDING and (oldest is None or row.received_at < oldest):
                    oldest = row.received_at
                dead += row.state == DEAD and row.updated_at > hour_ago
        age = None if oldest is None else max(0.0, (now - oldest).total_seconds())
        return InboxStats(counts, age, dead)

    def purge(self, older_than_seconds: float) -> int:
        """Forget done and sent messages older than the dedup window."""
        cutoff = utcnow() - timedelta(seconds=older_than_seconds)
        with self._lock:
            old = [
                key for key, row in self._rows.items()
                if row.state in (DONE, SENT) and row.updated_at < cutoff
            ]
            for key in old:
                del self._rows[key]
        return len(old)


def _due(rows: list[_Row], now: datetime, coalesced: datetime, waited: datetime) -> bool:
    if any(row.state == IN_FLIGHT for row in rows):
        return True
    if any(row.not_before is not None and row.not_before > now for row in rows):
        return False
    received = [row.received_at for row in rows]
    return max(received) <= coalesced or min(received) <= waited
