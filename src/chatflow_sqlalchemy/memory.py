"""Thread-safe in-memory session store with the same contract as the SQL stores (for tests)."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import nullcontext
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from chatflow_agent import Agent, Message

from chatflow_sqlalchemy.aio import AsyncStoreAPI
from chatflow_sqlalchemy.claims import (
    DEFAULT_DEDUP_TTL_HOURS,
    DEFAULT_LEASE_SECONDS,
    MemoryClaims,
    WebhookClaim,
    active_fence,
    reply_of,
    validate_message_id,
)
from chatflow_sqlalchemy.context import (
    SUMMARY_SEQ,
    Checkpoint,
    ContextOwner,
    SessionContext,
    check_metadata,
    dump_metadata,
    validate_agent,
    validate_session_id,
)
from chatflow_sqlalchemy.exceptions import ClaimLostError, LeaseLostError, SessionDeletedError
from chatflow_sqlalchemy.forks import (
    fork_window,
    no_such_session,
    session_exists,
    validate_fork,
)
from chatflow_sqlalchemy.inbox import Inbox, active_batch
from chatflow_sqlalchemy.lifecycle import (
    ListFilters,
    export_document,
    matches_metadata,
    validate_sweep_limit,
    validate_user_id,
)
from chatflow_sqlalchemy.memory_inbox import MemoryInbox
from chatflow_sqlalchemy.options import OptionsOwner, StoreKeywords, StoreOptions
from chatflow_sqlalchemy.summaries import (
    PendingSummary,
    Summaries,
)
from chatflow_sqlalchemy.values import CLAIM_ACQUIRED, utcnow

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["SessionStore"]

_T = TypeVar("_T")


def _window(written: Checkpoint | None) -> dict[int, Message]:
    """The window of a session as written (None: never), by seq, without the summary's."""
    window = {} if written is None else dict(zip(written.seqs, written.history, strict=True))
    window.pop(SUMMARY_SEQ, None)
    return window


class _MemorySummaryRows:
    """The in-memory store's :class:`~chatflow_sqlalchemy.summaries.SummaryRows`."""

    def __init__(self, store: SessionStore) -> None:
        self._store = store
        self.waiting: dict[str, dict[int, Message]] = {}
        """Pruned messages not yet in their session's summary, by session and seq."""
        self._claimed: set[str] = set()

    def claim(self, session_id: str) -> PendingSummary | None:
        with self._store._lock:
            ctx = self._store._sessions.get(session_id)
            if ctx is None or session_id in self._claimed:
                return None
            through, shown = ctx.summary_through, _window(self._store._written.get(session_id))
            dropped = sorted(  # not what is back in the window (a rollback undid the prune)
                (seq, m) for seq, m in self.waiting.get(session_id, {}).items()
                if seq > through and seq not in shown
            )
            if not dropped:
                return None
            self._claimed.add(session_id)
            return PendingSummary(
                ctx.summary, through, [m for _, m in dropped], dropped[-1][0], incarnation=ctx
            )

    def give_up(self, session_id: str) -> None:
        with self._store._lock:
            self._claimed.discard(session_id)

    def forget(self, session_id: str) -> None:
        """The session is gone: nothing of it waits, and its claim goes (under the lock)."""
        self.waiting.pop(session_id, None)
        self._claimed.discard(session_id)

    def incarnation(self, ctx: SessionContext) -> object:
        """``ctx`` itself: a session created anew under an id has a context of its own."""
        return ctx

    def settle(self, session_id: str, through: int) -> None:
        """A write of the session: what its summary covers waits no more (under the lock)."""
        waiting = self.waiting.get(session_id)
        if waiting is not None and any(seq <= through for seq in waiting):
            for seq in [seq for seq in waiting if seq <= through]:
                del waiting[seq]
            self._claimed.discard(session_id)


class SessionStore(OptionsOwner, AsyncStoreAPI):
    """In-memory session registry; nothing survives the process.

    Args:
        default_max_turns: History window of new contexts, in complete turns.
        dedup_ttl_hours: How long a processed webhook id stays claimed.
        **options: The other :class:`~chatflow_sqlalchemy.options.StoreOptions`
            (those of what is at rest, ``cipher``, ``require_encryption`` and
            ``auto_migrate``, are a ``TypeError`` here).

    A context manager (``with`` and ``async with``) like the SQL stores; once
    closed it refuses further use with ``RuntimeError``.

    """

    dedup_max_entries = 100_000
    """Oldest claims are evicted beyond this many, bounding memory."""

    def __init__(
        self,
        default_max_turns: int = 40,
        dedup_ttl_hours: float = DEFAULT_DEDUP_TTL_HOURS,
        **options: Unpack[StoreKeywords],
    ) -> None:
        given = {"default_max_turns": default_max_turns, "dedup_ttl_hours": dedup_ttl_hours}
        self.options = StoreOptions.of(type(self).__name__, {**given, **options}, sql=False)
        self._archive: dict[str, dict[int, Message]] = {}
        # Each session as last written: what reads show, as the SQL stores show their rows.
        self._written: dict[str, Checkpoint] = {}
        self._ttl_seconds = self.dedup_ttl_hours * 3600.0
        self._sessions: dict[str, SessionContext] = {}
        self._updated: dict[str, float] = {}
        self._updated_at: dict[str, datetime] = {}
        self._created_at: dict[str, datetime] = {}
        self._users: dict[str, str] = {}
        # Sessions get_or_create made that nothing was written to yet, and those of
        # them whose turn failed since (unborn: get and list_sessions do not show them).
        self._made: set[str] = set()
        self._unborn: set[str] = set()
        self._processed: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.RLock()
        self._agent_resolver: Callable[[str], Agent | None] | None = None
        self._closed = False
        self._context_owner = ContextOwner(  # flush and run_blocking: looked up at each call,
            lambda ctx: self._flush_context(ctx),  # as a test or benchmark may wrap them
            self._start_turn, self._finish_turn, self._drop_turn,
            lambda fn, *args: self._run_blocking(fn, *args),
        )
        self._claim_rows = MemoryClaims(
            self._lock, self._processed, self._ttl_seconds, self._remember
        )
        self._summary_rows = _MemorySummaryRows(self)
        self._summaries = None if self.summarizer is None else Summaries(
            self.summarizer, self._summary_rows, self.get, "memory"
        )
        self._turn_starts: dict[int, Checkpoint] = {}
        self._inbox_rows = MemoryInbox(self.turn_lease_seconds)
        self.inbox = Inbox(
            self._inbox_rows,
            lease_seconds=self.turn_lease_seconds,
            dedup_seconds=self._ttl_seconds,
            system="memory",
        )
        """The durable inbox (:mod:`chatflow_sqlalchemy.inbox`), kept until the store closes."""

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this session store is closed; open a new one")

    def set_agent_resolver(self, resolver: Callable[[str], Agent | None]) -> None:
        """Accepted for API parity; in-memory contexts keep their Agent objects."""
        self._agent_resolver = resolver

    def get_or_create(
        self,
        session_id: str,
        default_agent: Agent,
        metadata: dict[str, Any] | None = None,
        *,
        user_id: str | None = None,
    ) -> SessionContext:
        """Return the session's context, creating it (with ``metadata`` and ``user_id``) if needed.

        Raises:
            ValueError: Invalid arguments, or a ``user_id`` other than the session's own.

        """
        validate_session_id(session_id)
        validate_agent(default_agent)
        if user_id is not None:
            validate_user_id(user_id)
        check_metadata(metadata or {})
        with self._lock:  # an unborn session is remade by a write: its context's mutex first
            peeked = self._sessions.get(session_id)
            peeked = peeked if session_id in self._unborn else None
        with nullcontext() if peeked is None else peeked.writing(), self._lock:
            ctx = self._sessions.get(session_id)
            remade = ctx is not None and session_id in self._unborn and not ctx.in_turn
            remade = remade and ctx is peeked  # (its mutex held)
            owner = None if remade else self._users.get(session_id)
            if user_id is not None and owner is not None and owner != user_id:
                raise ValueError(
                    f"session {session_id!r} belongs to another user_id; a session has one "
                    "owner (use a session id of this user's, or erase_user the other one first)"
                )
            self._check_open()
            if ctx is None:
                ctx = SessionContext(
                    session_id, default_agent, max_turns=self.default_max_turns,
                    metadata=dict(metadata or {}),
                )
                ctx.attach(self._context_owner)
                self._sessions[session_id] = ctx
                self._touch(session_id)
                self._made.add(session_id)
            elif remade:  # made again, as if new: its agent, metadata and owner
                ctx.active_agent = default_agent
                ctx.metadata = dict(metadata or {})  # a write: no longer unborn
                self._made.add(session_id)
                self._users.pop(session_id, None)
            if user_id is not None:
                self._users[session_id] = user_id
            return ctx

    def _touch(self, session_id: str) -> None:
        now = utcnow()
        self._updated[session_id] = time.monotonic()
        self._updated_at[session_id] = now
        self._created_at.setdefault(session_id, now)

    def _keep_what_left(self, ctx: SessionContext, written: Checkpoint) -> None:
        """Archive (or queue for the summary) what left the window since the last write."""
        window = _window(written)
        before = _window(self._written.get(ctx.session_id))
        gone = before.keys() - window.keys()
        pruned, cleared = ctx.settle_window(gone)
        if self.archive_pruned:
            kept = self._archive.setdefault(ctx.session_id, {})
            for seq in pruned if cleared else gone:
                kept[seq] = before[seq]
        if self._summaries is not None and pruned and not cleared:
            waiting = self._summary_rows.waiting.setdefault(ctx.session_id, {})
            waiting.update((seq, before[seq]) for seq in pruned)
            self._summaries.due(ctx.session_id)
        self._summary_rows.settle(ctx.session_id, ctx.summary_through)

    def transcript(self, session_id: str) -> list[Message]:
        """Archived messages, then the window as last written, in order ([] if no such session)."""
        validate_session_id(session_id)
        with self._lock:
            self._check_open()
            merged = {**self._archive.get(session_id, {}), **_window(self._written.get(session_id))}
            return [merged[seq] for seq in sorted(merged)]

    def _drop(self, session_id: str) -> SessionContext | None:
        """Forget a session (under ``_lock``); the caller marks its context deleted."""
        self._updated.pop(session_id, None)
        self._updated_at.pop(session_id, None)
        self._created_at.pop(session_id, None)
        self._users.pop(session_id, None)
        self._made.discard(session_id)
        self._unborn.discard(session_id)
        self._archive.pop(session_id, None)
        self._written.pop(session_id, None)
        self._summary_rows.forget(session_id)
        return self._sessions.pop(session_id, None)

    def _flush_context(self, ctx: SessionContext) -> None:
        """Note the session as written (no I/O): its window, and what left it (kept or summarized).

        The caller holds the context's mutex (a write does) or alone has the
        context (a fork): no other write comes between the window read and kept.
        """
        written = ctx.checkpoint()  # takes the mutex: never under the lock
        with self._lock:
            self._check_open()
            if self._sessions.get(ctx.session_id) is ctx:
                self._touch(ctx.session_id)
                self._made.discard(ctx.session_id)
                self._unborn.discard(ctx.session_id)  # written: born, with its agent
                if self.archive_pruned or self._summaries is not None:
                    self._keep_what_left(ctx, written)
                self._written[ctx.session_id] = written

    async def _start_turn(self, ctx: SessionContext) -> None:
        """Keep the turn's start, to discard a fenced-out turn."""
        self._check_open()
        fenced = active_fence(ctx.session_id) or active_batch(ctx.session_id)
        if fenced is not None:
            self._turn_starts[id(ctx)] = ctx.checkpoint()

    async def _finish_turn(self, ctx: SessionContext) -> None:
        """Keep the turn, with its claim or inbox batch; a turn that fails is not kept.

        As on the SQL stores: a turn that changed something commits its claim
        and records its inbox batch's reply, or is undone.
        """
        try:
            if ctx.deleted:  # a turn of a session deleted meanwhile is not kept
                raise SessionDeletedError(ctx.session_id)
            start = self._turn_starts.pop(id(ctx), None)
            if start is not None and ctx.changed_since(start):
                self._answer(ctx, start)
            with ctx.writing():  # holds the context as add_message does (see _flush_context)
                self._flush_context(ctx)
        except BaseException:
            await self._drop_turn(ctx)
            raise

    def _answer(self, ctx: SessionContext, start: Checkpoint) -> None:
        """Commit the turn's claim and record its batch's reply, or undo the turn to ``start``."""
        fence, batch = active_fence(ctx.session_id), active_batch(ctx.session_id)
        if fence is None and batch is None:
            return  # the turn outlived its block: its answer is no claim's or batch's reply
        reply = reply_of(ctx.added_since(start))
        if fence is not None:
            fence.reply = reply
            if not self._claim_rows.commit_turn(fence):
                ctx.restore(start)
                raise ClaimLostError(fence.message_id)
        if batch is not None:
            try:
                self._inbox_rows.answer(batch, reply)
            except LeaseLostError:
                ctx.restore(start)
                raise

    async def _drop_turn(self, ctx: SessionContext) -> None:
        """A failed turn: forget its start; a session it alone made is unborn (as on SQL)."""
        self._turn_starts.pop(id(ctx), None)
        with self._lock:
            if ctx.session_id in self._made and self._sessions.get(ctx.session_id) is ctx:
                self._made.discard(ctx.session_id)
                self._unborn.add(ctx.session_id)

    async def _run_blocking(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` directly: the in-memory store does no I/O."""
        return fn(*args)

    def get(self, session_id: str) -> SessionContext | None:
        """Return the session's context, or None."""
        validate_session_id(session_id)
        with self._lock:
            self._check_open()
            return None if session_id in self._unborn else self._sessions.get(session_id)

    def delete(self, session_id: str) -> bool:
        """Delete the session with its claims and inbox messages (as the SQL stores).

        Its live contexts then raise SessionDeletedError. Returns whether the
        session existed (its claims and inbox messages go either way).
        """
        validate_session_id(session_id)
        return self._erase(lambda: {session_id}) == 1

    def list_sessions(
        self,
        *,
        user_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        updated_after: datetime | None = None,
        limit: int | None = None,
        after: str | None = None,
        forked_from: str | None = None,
    ) -> list[str]:
        """Session ids: most recently updated first, or filtered and paged as the SQL stores."""
        filters = ListFilters.build(
            user_id=user_id, metadata=metadata, updated_after=updated_after,
            limit=limit, after=after, forked_from=forked_from,
        )
        with self._lock:
            self._check_open()
            born = [sid for sid in self._updated if sid not in self._unborn]
            if filters.paged:
                ids = sorted(sid for sid in born if after is None or sid > after)
            else:
                ids = sorted(born, key=self._updated.__getitem__, reverse=True)
            found = [sid for sid in ids if self._matches(sid, filters)]
        return found if limit is None else found[:limit]

    def _matches(self, session_id: str, filters: ListFilters) -> bool:
        if filters.user_id is not None and self._users.get(session_id) != filters.user_id:
            return False
        ctx = self._sessions[session_id]
        if filters.forked_from is not None and ctx.forked_from != filters.forked_from:
            return False
        stamp = self._updated_at[session_id]
        if filters.updated_after is not None and not stamp > filters.updated_after:
            return False
        return matches_metadata(ctx.metadata, filters.metadata)

    def fork(
        self, session_id: str, new_session_id: str, *, at_turn: int | None = None
    ) -> SessionContext:
        """A new session that starts as a copy of ``session_id``'s first turns (as the SQL stores).

        Raises:
            ValueError: An invalid argument, no session ``session_id``, an existing
                ``new_session_id`` (nothing changes), or ``at_turn`` negative or
                more than the window's turns.

        """
        validate_fork(session_id, new_session_id, at_turn)
        source = self.get(session_id)
        if source is None:
            raise no_such_session(session_id)
        # Under the source's mutex, not the store's lock (a write takes the mutex first).
        ctx = source.copy_for_fork(
            new_session_id,
            lambda messages, seqs: fork_window(session_id, messages, seqs, at_turn),
            max_turns=self.default_max_turns,
        )
        with self._lock:
            self._check_open()
            if self._sessions.get(session_id) is not source:
                raise no_such_session(session_id)  # deleted meanwhile
            if new_session_id in self._sessions:
                raise session_exists(new_session_id)
            ctx.attach(self._context_owner)
            self._sessions[new_session_id] = ctx
            owner = self._users.get(session_id)
            if owner is not None:
                self._users[new_session_id] = owner
            self._flush_context(ctx)  # its mutex under the lock: no other thread has it yet
            waiting = self._summary_rows.waiting.get(session_id)
            if waiting:  # what waited for the source's summary waits for the fork's too
                self._summary_rows.waiting[new_session_id] = dict(waiting)
        if waiting and self._summaries is not None:
            self._summaries.due(new_session_id)
        return ctx

    def erase_user(self, user_id: str) -> int:
        """Erase ``user_id``'s sessions, claims and inbox messages at once; return how many."""
        validate_user_id(user_id)
        return self._erase(lambda: self._owned(user_id))

    def _owned(self, user_id: str) -> set[str]:
        """Every session of ``user_id``'s, unborn ones too: what erasure removes (hold the lock)."""
        return {sid for sid, uid in self._users.items() if uid == user_id}

    def sweep(self, limit: int | None = None) -> int:
        """Remove expired sessions (and their claims), never one in a turn, a claim or a batch."""
        validate_sweep_limit(limit)
        if self.session_ttl_hours is None:
            raise ValueError(
                "this store keeps sessions forever: open it with session_ttl_hours=H to sweep "
                "sessions not updated for H hours"
            )
        cutoff = utcnow() - timedelta(hours=self.session_ttl_hours)
        now = time.monotonic()

        def expired() -> set[str]:
            held = {
                row.session_id for row in self._claim_rows.rows.values()
                if row.state == CLAIM_ACQUIRED and row.lease_until >= now
            }
            held |= self._inbox_rows.leased(self._updated_at.keys())
            return {sid for _, sid in sorted(
                (stamp, sid) for sid, stamp in self._updated_at.items()
                if stamp < cutoff and sid not in held and not self._sessions[sid].in_turn
            )[:limit]}

        return self._erase(expired)

    def _erase(self, pick: Callable[[], set[str]]) -> int:
        """Delete the sessions ``pick`` names (under the lock), their claims and inbox messages.

        Returns how many of them existed; the claims and inbox messages of the
        others go too.
        """
        with self._lock, self._inbox_rows.held():  # no batch starts between pick and forget
            self._check_open()
            ids = pick()
            contexts = [self._drop(sid) for sid in ids]
            for message_id, row in list(self._claim_rows.rows.items()):
                if row.session_id in ids:
                    del self._claim_rows.rows[message_id]
                    self._processed.pop(message_id, None)
            self._inbox_rows.forget_sessions(ids)
        erased = [ctx for ctx in contexts if ctx is not None]
        for ctx in erased:
            ctx.mark_deleted()
        return len(erased)

    def export_user(self, user_id: str) -> dict[str, Any]:
        """Everything held about ``user_id`` (the SQL stores' document): what erasure removes."""
        validate_user_id(user_id)
        with self._lock:
            self._check_open()
            owned = self._owned(user_id)
            sessions = [self._export_session(sid, user_id) for sid in sorted(owned)]
            inbox = self._inbox_rows.exported(owned)
        return export_document(user_id, sessions, inbox)

    def _export_session(self, session_id: str, user_id: str) -> dict[str, Any]:
        ctx = self._sessions[session_id]
        # What the SQL stores' archive would hold (with rows waiting for the summary), by seq.
        archived = {
            **self._summary_rows.waiting.get(session_id, {}), **self._archive.get(session_id, {})
        }
        claims = sorted(
            (row.ticket, message_id, row)
            for message_id, row in self._claim_rows.rows.items()
            if row.session_id == session_id
        )
        return {
            "session_id": session_id,
            "user_id": user_id,
            "active_agent_name": ctx.active_agent.name,
            "metadata": json.loads(dump_metadata(ctx.metadata)),
            "created_at": self._created_at[session_id].isoformat(),
            "updated_at": self._updated_at[session_id].isoformat(),
            "summary": ctx.summary,
            "forked_from": ctx.forked_from,
            "forked_at_turn": ctx.forked_at_turn,
            "messages": [
                m.model_dump(mode="json") for m in _window(self._written.get(session_id)).values()
            ],
            "archived_messages": [
                message.model_dump(mode="json")
                for _, message in sorted(archived.items())
            ],
            "webhook_claims": [
                {
                    "message_id": message_id,
                    "state": row.state,
                    "processed_at": row.updated_at.isoformat(),
                    "response": row.response,
                }
                for _, message_id, row in claims
            ],
        }

    def clear(self) -> None:
        """Delete every session (processed webhook ids are kept)."""
        with self._lock:
            self._check_open()
            contexts = [self._drop(sid) for sid in list(self._sessions)]
        for ctx in contexts:
            if ctx is not None:
                ctx.mark_deleted()

    def is_message_processed(self, message_id: str) -> bool:
        """True if ``message_id`` was claimed within the TTL."""
        validate_message_id(message_id)
        with self._lock:
            self._check_open()
            return self._fresh(message_id, time.monotonic())

    def _fresh(self, message_id: str, now: float) -> bool:
        stamp = self._processed.get(message_id)
        return stamp is not None and now - stamp <= self._ttl_seconds

    def mark_message_processed(self, message_id: str) -> None:
        """Record ``message_id`` as processed now."""
        validate_message_id(message_id)
        with self._lock:
            self._check_open()
            self._remember(message_id, time.monotonic())

    def record_processed_message(self, message_id: str) -> bool:
        """Atomically claim ``message_id``: True only for its first caller within the TTL."""
        validate_message_id(message_id)
        now = time.monotonic()
        with self._lock:
            self._check_open()
            fresh = self._fresh(message_id, now)
            if not fresh:
                self._remember(message_id, now)
            return not fresh

    def _remember(self, message_id: str, now: float) -> None:
        self._processed.pop(message_id, None)
        self._processed[message_id] = now  # insertion order == age order
        while len(self._processed) > self.dedup_max_entries:
            evicted, _ = self._processed.popitem(last=False)
            self._claim_rows.rows.pop(evicted, None)

    def claim(
        self,
        message_id: str,
        *,
        session_id: str | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ) -> WebhookClaim:
        """Claim a webhook delivery (see :mod:`chatflow_sqlalchemy.claims`), in this process."""
        validate_message_id(message_id)
        if session_id is not None:
            validate_session_id(session_id)
        return WebhookClaim(
            self._claim_rows, message_id, session_id=session_id, lease_seconds=lease_seconds
        )

    def _claims(self) -> MemoryClaims:
        return self._claim_rows

    def purge_processed_messages(self) -> int:
        """Drop expired claims; return how many went."""
        cutoff = time.monotonic() - self._ttl_seconds
        removed = 0
        with self._lock:
            self._check_open()
            while self._processed:
                message_id, stamp = next(iter(self._processed.items()))
                if stamp >= cutoff:
                    break
                del self._processed[message_id]
                self._claim_rows.rows.pop(message_id, None)
                removed += 1
        return removed

    def wait_for_summaries(self, timeout: float | None = None) -> bool:
        """Wait until no summary is being made; False if ``timeout`` seconds passed first."""
        return True if self._summaries is None else self._summaries.wait(timeout)

    def close(self) -> None:
        """Drop every session, claim and summary in the making; later calls raise RuntimeError."""
        if self._summaries is not None:
            self._summaries.close()
        with self._lock:
            self._closed = True
            self._sessions.clear()
            self._written.clear()
            self._updated.clear()
            self._processed.clear()
        self._inbox_rows.clear()

    async def aclose(self) -> None:
        """Async :meth:`close`."""
        self.close()
