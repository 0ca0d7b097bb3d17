"""The store's one write algorithm: a context's changes, compare-and-swapped onto its session.

Each write starts with a compare-and-swap of the session's ``version``
(``UPDATE ... WHERE version = :known``), under the database's write lock (row
lock on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite), then deletes the rows that
left the window and inserts the new ones; a turn run inside a webhook claim
marks the claim done in the same transaction, only while it is still held.
If another writer moved the session since this context loaded, the context is
rebased on the fresh rows and its new messages are appended after them as
whole turns, never interleaved.

A backend may send a whole write as one statement
(:meth:`~chatflow_sqlalchemy.dialect.DialectSupport.write_at_once`); when that
statement's swap misses, the step-by-step write runs, which tells a moved
session from a deleted one and from a lost claim.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Executable

from chatflow_sqlalchemy import telemetry
from chatflow_sqlalchemy.claims import ClaimFence, reply_of
from chatflow_sqlalchemy.context import PendingWrite, SessionContext
from chatflow_sqlalchemy.contexts import AgentResolver
from chatflow_sqlalchemy.dialect import DialectSupport, SessionWrite
from chatflow_sqlalchemy.exceptions import ClaimLostError, LeaseLostError, SessionDeletedError
from chatflow_sqlalchemy.inbox import BatchFence
from chatflow_sqlalchemy.lease import KEEP_HELD, RELEASE_HELD, SessionLeases, lease_params
from chatflow_sqlalchemy.rows import (
    BUMP_SESSION,
    BUMP_SESSION_AND_METADATA,
    DELETE_ALL_MESSAGES,
    DELETE_SOME_MESSAGES,
    INSERT_MESSAGES,
    SELECT_CREATED,
    SELECT_VERSION,
    SET_SUMMARY,
    message_row,
    read_session,
)
from chatflow_sqlalchemy.runtime import StoreRuntime
from chatflow_sqlalchemy.sealing import Sealer
from chatflow_sqlalchemy.sql_claims import FENCE_CLAIM
from chatflow_sqlalchemy.sql_inbox import answer_batch
from chatflow_sqlalchemy.sql_lifecycle import archive_rows, settle_summarized
from chatflow_sqlalchemy.summaries import Summaries
from chatflow_sqlalchemy.values import Lease, utcnow

__all__ = ["SessionWriter"]

logger = logging.getLogger("chatflow_sqlalchemy")


class SessionWriter:
    """Writes contexts' changes to their sessions (see the module's description).

    Args:
        runtime: Where the statements run.
        sealer: Encrypts what the store encrypts at rest.
        agents: Resolves the agent of rows a rebase reads.
        archive_pruned: Keep pruned (and rewound) rows in the archive table.
        leases: The store's session leases (a turn of an inbox batch keeps its lease).
        summaries: Where a write that pruned reports it (the store's summaries),
            None on a store without a summarizer.

    """

    def __init__(
        self,
        runtime: StoreRuntime,
        sealer: Sealer,
        agents: AgentResolver,
        *,
        archive_pruned: bool,
        leases: SessionLeases,
        summaries: Summaries | None = None,
    ) -> None:
        self._runtime = runtime
        self._leases = leases
        self._support: DialectSupport = runtime.support
        self._sealer = sealer
        self._agents = agents
        self._archive_pruned = archive_pruned
        self._summaries = summaries
        self._lock_version: Executable = self._support.lock_session_row(SELECT_VERSION)
        # A backend that overrides the hook sends each write as one statement.
        self._writes_at_once = (
            type(self._support).write_at_once is not DialectSupport.write_at_once
        )

    def write(
        self,
        ctx: SessionContext,
        pending: PendingWrite,
        fence: ClaimFence | None = None,
        lease: Lease | None = None,
        batch: BatchFence | None = None,
    ) -> int:
        """Write ``pending`` (what ``ctx`` changed); return how many message rows it deleted.

        Call it inside ``ctx.writing()``, which gave ``pending``. ``lease``:
        the turn's lease, checked and given back by the same transaction.
        ``batch``: the inbox batch the turn runs for; the transaction records
        its reply. A lease an inbox batch holds (``lease.kept``) is checked and
        kept, not given back.

        Raises:
            SessionDeletedError: The session is gone (or is another one now).
            LeaseLostError: ``lease`` is no longer held; nothing was written.
            ClaimLostError: ``fence``'s claim is no longer held; nothing was written.

        """
        # A claim's reply, also refused before the turn is written if it cannot be
        # stored; an encrypting store keeps only what the block itself stores there.
        reply = None if fence is None else reply_of(pending.tail)
        if self._sealer.active:
            reply = None
        kept = lease is not None and lease.kept
        written, to_summarize = pending, False
        at_once = self._writes_at_once and not kept and not pending.empty
        at_once = at_once and pending.summary is None and not self._archives_now(pending)
        if not (at_once and self._write_at_once(pending, fence, reply, lease)):
            answer = None if batch is None else (batch, reply_of(pending.tail))
            keep = self._leases.until_params() if kept else None
            with self._runtime.transaction(write=True) as conn:
                if lease is not None:
                    give_back(conn, lease, pending.incarnation, keep=keep)
                written, to_summarize = self._write_changes(
                    conn, ctx, pending, fence, reply, answer
                )
        ctx.applied(written)
        if fence is not None:
            fence.reply = reply
        if to_summarize and self._summaries is not None:
            self._summaries.due(ctx.session_id)
        if lease is not None and not lease.kept:
            lease.released = True
        elif lease is not None:
            lease.version = written.version + 1  # the batch's next turn need not read it
        return len(written.gone)

    def _write_at_once(
        self,
        pending: PendingWrite,
        fence: ClaimFence | None,
        reply: str | None,
        lease: Lease | None,
    ) -> bool:
        """:meth:`DialectSupport.write_at_once` in autocommit; False if it changed nothing.

        Nothing is written when the swap missed: the session moved or is
        gone, or the lease or the claim was lost, which the step-by-step
        write then tells apart (it raises what applies, or rebases).
        """
        if pending.gone.intersection(seq for seq, _ in pending.messages):
            return False  # one statement cannot delete a row and insert its seq again
        now = utcnow()
        write = SessionWrite(
            swap=self._bump_params(pending, now),
            gone=sorted(pending.gone),
            rows=self._rows(pending, now),
            fence=None if fence is None else fence.params(now, reply),
            lease=None if lease is None else lease_params(lease),
        )
        with self._runtime.transaction(single=True) as conn:
            outcome = self._support.write_at_once(conn, write)
        return outcome is not None and outcome[0]

    def _write_changes(
        self,
        conn: Connection,
        ctx: SessionContext,
        pending: PendingWrite,
        fence: ClaimFence | None,
        reply: str | None,
        answer: tuple[BatchFence, str | None] | None = None,
    ) -> tuple[PendingWrite, bool]:
        """Compare-and-swap the session's version, then write the message diff.

        The conditional UPDATE both detects concurrent writers and takes the
        row's write lock; only when it misses does the writer read the row
        (locked) to tell a deleted session from a moved one and rebase.
        Returns what was written (rebased or not), and whether some of the
        rows that left the window wait for a summary.
        """
        session_id = pending.session_id
        now = utcnow()
        if not self._bump_version(conn, pending, now):
            version = conn.execute(self._lock_version, {"session_id": session_id}).scalar()
            if version is None:
                raise SessionDeletedError(session_id)
            pending = self._rebase(conn, ctx)
            if not self._bump_version(conn, pending, now):
                raise RuntimeError(f"session {session_id!r} changed while its row was locked")
        gone = pending.gone
        to_summarize = bool(gone) and self._archive(conn, pending, now)
        if pending.summary is not None:
            self._write_summary(conn, session_id, *pending.summary)
        if gone and pending.empty:
            conn.execute(DELETE_ALL_MESSAGES, {"session_id": session_id})
        elif gone:
            conn.execute(DELETE_SOME_MESSAGES, {"session_id": session_id, "seqs": sorted(gone)})
        if pending.messages:
            conn.execute(INSERT_MESSAGES, self._rows(pending, now))
        if fence is not None:
            claim = fence.params(now, reply)
            if conn.execute(FENCE_CLAIM, claim).rowcount != 1:
                raise ClaimLostError(fence.message_id)
        if answer is not None:
            answer_batch(conn, answer[0], answer[1], self._sealer)
        return pending, to_summarize

    def _archives_now(self, pending: PendingWrite) -> bool:
        """True if this write archives rows memory showed (it then takes the step-by-step path)."""
        if not self._archive_pruned and self._summaries is None:
            return False
        parts = self._to_archive(pending)
        return any(seq not in pending.hidden for part in parts for seq in part)

    def _to_archive(self, pending: PendingWrite) -> tuple[list[int], list[int]]:
        """Of the rows leaving the window: (those archived as they are, those pending a summary).

        Pruned rows wait for the summary on a store with a summarizer (also
        without ``archive_pruned``: they are deleted once summarized); with
        ``archive_pruned`` the others are archived too (rewound or rolled
        back), except what a clear removes and hidden rows (a tool call no
        result can follow).
        """
        pruned = list(pending.pruned)
        waiting = pruned if self._summaries is not None and not pending.cleared else []
        if not self._archive_pruned:
            return [], waiting
        if pending.cleared:
            return pruned, []
        others = pending.gone.difference(waiting, pending.hidden)
        return sorted(others), waiting

    def _archive(self, conn: Connection, pending: PendingWrite, now: datetime) -> bool:
        """Archive what leaves the window; True if some of it waits for a summary."""
        kept, waiting = self._to_archive(pending)
        if kept:
            archive_rows(conn, pending.session_id, kept, now)
        if waiting:
            archive_rows(conn, pending.session_id, waiting, now, pending=True)
        return bool(waiting)

    def _write_summary(
        self, conn: Connection, session_id: str, summary: str | None, through: int
    ) -> None:
        """Store the session's new summary; the archived rows it covers no longer wait for one."""
        conn.execute(SET_SUMMARY, {
            "sid": session_id,
            "summary": None if summary is None else self._sealer.seal_text(session_id, summary),
            "through": through,
        })
        settle_summarized(conn, session_id, through, keep=self._archive_pruned)

    def _rows(self, pending: PendingWrite, now: datetime) -> list[dict[str, Any]]:
        """The message rows ``pending`` inserts."""
        return [
            message_row(self._sealer, pending.session_id, seq, message, now)
            for seq, message in pending.messages
        ]

    def _bump_version(self, conn: Connection, pending: PendingWrite, now: datetime) -> bool:
        """UPDATE the session row if its version is still the one ``pending`` expects."""
        statement = BUMP_SESSION if pending.metadata is None else BUMP_SESSION_AND_METADATA
        return conn.execute(statement, self._bump_params(pending, now)).rowcount == 1

    def _bump_params(self, pending: PendingWrite, now: datetime) -> dict[str, Any]:
        """Parameters of the compare-and-swap UPDATE (with the metadata if it changed)."""
        params: dict[str, Any] = {
            "sid": pending.session_id,
            "expected": pending.version,
            "new_version": pending.version + 1,
            "agent_name": pending.agent_name,
            "now": now,
        }
        if pending.metadata is not None:
            params["metadata"] = self._sealer.seal_metadata(pending.session_id, pending.metadata)
        return params

    def _rebase(self, conn: Connection, ctx: SessionContext) -> PendingWrite:
        """Another writer moved the session: replay our unsaved changes on its rows.

        See :meth:`SessionContext.rebase`; it raises :class:`SessionDeletedError`
        for a session deleted meanwhile (or deleted and created anew).
        """
        pending = ctx.rebase(read_session(conn, self._sealer, ctx.session_id), self._agents)
        telemetry.count("chatflow.version_conflicts", 1, self._runtime.system)
        logger.info(
            "session %r changed in another process; %d new message(s) appended after its rows",
            ctx.session_id,
            len(pending.messages),
        )
        return pending


def give_back(
    conn: Connection, lease: Lease, incarnation: object, *, keep: dict[str, Any] | None = None
) -> None:
    """First statement of a turn's write transaction: check the lease and give it back.

    It also takes the session row's write lock, as the compare-and-swap
    after it would. The transaction rolls back whole if a later statement
    fails, the lease included. ``incarnation``: the ``created_at`` of the
    session the turn began on. ``keep``: the expiry's parameters of a
    lease the turn's inbox batch keeps (it is moved on, not given back).

    Raises:
        SessionDeletedError: The session is gone (or is another one now).
        LeaseLostError: The lease expired or was taken over.

    """
    if keep is None:
        held = conn.execute(RELEASE_HELD, lease_params(lease))
    else:
        held = conn.execute(KEEP_HELD, {**lease_params(lease), **keep})
    if held.rowcount == 1:
        return
    created = conn.execute(SELECT_CREATED, {"session_id": lease.session_id}).first()
    if created is None or (incarnation is not None and created[0] != incarnation):
        raise SessionDeletedError(lease.session_id)
    raise LeaseLostError(lease.session_id)

