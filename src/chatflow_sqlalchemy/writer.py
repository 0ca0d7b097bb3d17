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
from chatflow_sqlalchemy.context import (
    DurableState,
    SessionContext,
    check_metadata,
    dump_metadata,
)
from chatflow_sqlalchemy.contexts import AgentResolver
from chatflow_sqlalchemy.dialect import DialectSupport, SessionWrite
from chatflow_sqlalchemy.exceptions import ClaimLostError, LeaseLostError, SessionDeletedError
from chatflow_sqlalchemy.inbox import BatchFence
from chatflow_sqlalchemy.lease import KEEP_HELD, RELEASE_HELD, SessionLeases, lease_params
from chatflow_sqlalchemy.lifecycle import pruned_seqs
from chatflow_sqlalchemy.reconcile import (
    install,
    orphaned_tool_call,
    other_incarnation,
    summary_changed,
)
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
        fence: ClaimFence | None = None,
        lease: Lease | None = None,
        batch: BatchFence | None = None,
    ) -> int:
        """Write ``ctx``'s changes; return how many message rows it deleted (pruned or cleared).

        Call it under ``ctx._mutex``, with changes to write. ``lease``: the
        turn's lease, checked and given back by the same transaction.
        ``batch``: the inbox batch the turn runs for; the transaction records
        its reply. A lease an inbox batch holds (``lease.kept``) is checked and
        kept, not given back.

        Raises:
            SessionDeletedError: The session is gone (or is another one now).
            LeaseLostError: ``lease`` is no longer held; nothing was written.
            ClaimLostError: ``fence``'s claim is no longer held; nothing was written.

        """
        reply = None if fence is None else self._reply(ctx)
        deleted = None
        to_summarize = False
        kept = lease is not None and lease.kept
        if (
            self._writes_at_once and not kept and ctx._seqs and not self._archives_now(ctx)
            and not summary_changed(ctx)
        ):
            deleted = self._write_at_once(ctx, fence, reply, lease)
        if deleted is None:
            answer = None if batch is None else (batch, self._answer(ctx))
            keep = self._leases.until_params() if lease is not None and lease.kept else None
            with self._runtime.transaction(write=True) as conn:
                if lease is not None:
                    incarnation = ctx._durable.incarnation if ctx._durable else None
                    give_back(conn, lease, incarnation, keep=keep)
                deleted, to_summarize = self._write_changes(conn, ctx, fence, reply, answer)
        if fence is not None:
            fence.reply = reply
        if to_summarize and self._summaries is not None:
            self._summaries.due(ctx.session_id)
        if lease is not None and not lease.kept:
            lease.released = True
        elif lease is not None and ctx._durable is not None:
            lease.version = ctx._durable.version  # the batch's next turn need not read it
        return deleted

    def _reply(self, ctx: SessionContext) -> str | None:
        """What a claimed turn stores as its claim's reply (see :func:`reply_of`).

        The model answer this turn added, if it is the window's last message.
        None on a store that encrypts: the claim's reply column holds only
        what the block itself stores there (an answer it could not store is
        refused all the same, before the turn is written).
        """
        reply = self._answer(ctx)
        return None if self._sealer.active else reply

    def _answer(self, ctx: SessionContext) -> str | None:
        """The model answer this turn added, if it is the window's last message."""
        durable = ctx._durable
        if durable is None or not ctx._seqs or ctx._seqs[-1] in durable.seqs:
            return None
        return reply_of(ctx._history[-1])

    def _write_at_once(
        self,
        ctx: SessionContext,
        fence: ClaimFence | None,
        reply: str | None,
        lease: Lease | None,
    ) -> int | None:
        """:meth:`DialectSupport.write_at_once` in autocommit; None if it changed nothing.

        Nothing is written when the swap missed: the session moved or is
        gone, or the lease or the claim was lost, which the step-by-step
        write then tells apart (it raises what applies, or rebases).
        """
        now = utcnow()
        gone, new_rows = self._message_diff(ctx, now)
        if gone.intersection(row["seq"] for row in new_rows):
            return None  # one statement cannot delete a row and insert its seq again
        metadata_json, swap = self._bump_params(ctx, now)
        write = SessionWrite(
            swap=swap,
            gone=sorted(gone),
            rows=new_rows,
            fence=None if fence is None else fence.params(now, reply),
            lease=None if lease is None else lease_params(lease),
        )
        with self._runtime.transaction(single=True) as conn:
            outcome = self._support.write_at_once(conn, write)
        if outcome is None or not outcome[0]:
            return None
        _mark_written(ctx, gone, new_rows, metadata_json)
        return len(gone)

    def _write_changes(
        self,
        conn: Connection,
        ctx: SessionContext,
        fence: ClaimFence | None,
        reply: str | None,
        answer: tuple[BatchFence, str | None] | None = None,
    ) -> tuple[int, bool]:
        """Compare-and-swap the session's version, then write the message diff.

        The conditional UPDATE both detects concurrent writers and takes the
        row's write lock; only when it misses does the writer read the row
        (locked) to tell a deleted session from a moved one and rebase.
        Returns how many rows left the window, and whether some of them
        wait for a summary.
        """
        session_id = ctx.session_id
        now = utcnow()
        bumped, metadata_json = self._bump_version(conn, ctx, now)
        if not bumped:
            version = conn.execute(self._lock_version, {"session_id": session_id}).scalar()
            if version is None:
                raise SessionDeletedError(session_id)
            self._rebase(conn, ctx)
            bumped, metadata_json = self._bump_version(conn, ctx, now)
            if not bumped:
                raise RuntimeError(f"session {session_id!r} changed while its row was locked")
        gone, new_rows = self._message_diff(ctx, now)
        to_summarize = bool(gone) and self._archive(conn, ctx, gone, now)
        if summary_changed(ctx):
            self._write_summary(conn, ctx)
        if gone and not ctx._seqs:
            conn.execute(DELETE_ALL_MESSAGES, {"session_id": session_id})
        elif gone:
            conn.execute(DELETE_SOME_MESSAGES, {"session_id": session_id, "seqs": sorted(gone)})
        if new_rows:
            conn.execute(INSERT_MESSAGES, new_rows)
        if fence is not None:
            claim = fence.params(now, reply)
            if conn.execute(FENCE_CLAIM, claim).rowcount != 1:
                raise ClaimLostError(fence.message_id)
        if answer is not None:
            answer_batch(conn, answer[0], answer[1], self._sealer)
        _mark_written(ctx, gone, new_rows, metadata_json)
        return len(gone), to_summarize

    def _archives_now(self, ctx: SessionContext) -> bool:
        """True if this write archives rows (it then takes the step-by-step path)."""
        if not self._archive_pruned and self._summaries is None:
            return False
        durable = ctx._durable
        assert durable is not None
        return any(self._to_archive(ctx, durable.seqs.difference(ctx._seqs)))

    def _to_archive(self, ctx: SessionContext, gone: set[int]) -> tuple[list[int], list[int]]:
        """Of the rows leaving the window: (those archived as they are, those pending a summary).

        Pruned rows wait for the summary on a store with a summarizer (also
        without ``archive_pruned``: they are deleted once summarized); with
        ``archive_pruned`` the others are archived too (rewound or rolled
        back), except what a clear removes and hidden rows (a tool call no
        result can follow).
        """
        durable = ctx._durable
        assert durable is not None
        pruned = pruned_seqs(gone, ctx._seqs, ctx._n_system)
        pending = pruned if self._summaries is not None and not ctx._cleared else []
        if not self._archive_pruned:
            return [], pending
        if ctx._cleared:
            return pruned, []
        pending_set = set(pending)
        others = gone.difference(pending_set, durable.hidden)
        return sorted(others), pending

    def _archive(
        self, conn: Connection, ctx: SessionContext, gone: set[int], now: datetime
    ) -> bool:
        """Archive what leaves the window; True if some of it waits for a summary."""
        kept, pending = self._to_archive(ctx, gone)
        if kept:
            archive_rows(conn, ctx.session_id, kept, now)
        if pending:
            archive_rows(conn, ctx.session_id, pending, now, pending=True)
        return bool(pending)

    def _write_summary(self, conn: Connection, ctx: SessionContext) -> None:
        """Store ``ctx``'s new summary; the archived rows it covers no longer wait for one."""
        summary = ctx.summary
        conn.execute(SET_SUMMARY, {
            "sid": ctx.session_id,
            "summary": None if summary is None else self._sealer.seal_text(ctx.session_id, summary),
            "through": ctx.summary_through,
        })
        settle_summarized(conn, ctx.session_id, ctx.summary_through, keep=self._archive_pruned)

    def _message_diff(
        self, ctx: SessionContext, now: datetime
    ) -> tuple[set[int], list[dict[str, Any]]]:
        """The seqs of rows to delete and the rows to insert since ``ctx`` was last written."""
        durable = ctx._durable
        assert durable is not None
        gone = durable.seqs.difference(ctx._seqs)
        pending = ctx._pending_messages()
        if durable.hidden and (pending or ctx._cleared):
            gone.update(durable.hidden)  # a call no result can follow any more
        session_id = ctx.session_id
        return gone, [
            message_row(self._sealer, session_id, seq, message, now) for seq, message in pending
        ]

    def _bump_version(
        self, conn: Connection, ctx: SessionContext, now: datetime
    ) -> tuple[bool, str | None]:
        """UPDATE the session row if its version is still the one ``ctx`` knows.

        Returns whether it did, and the metadata JSON it wrote (None: unchanged).
        """
        metadata_json, params = self._bump_params(ctx, now)
        statement = BUMP_SESSION if metadata_json is None else BUMP_SESSION_AND_METADATA
        return conn.execute(statement, params).rowcount == 1, metadata_json

    def _bump_params(
        self, ctx: SessionContext, now: datetime
    ) -> tuple[str | None, dict[str, Any]]:
        """Parameters of the compare-and-swap UPDATE, after the metadata's JSON if it changed."""
        durable = ctx._durable
        assert durable is not None
        params: dict[str, Any] = {
            "sid": ctx.session_id,
            "expected": durable.version,
            "new_version": durable.version + 1,
            "agent_name": ctx.active_agent.name,
            "now": now,
        }
        metadata_json = dump_metadata(ctx._metadata)
        if metadata_json == durable.metadata_json:
            return None, params
        # A nested change made in place is checked here.
        check_metadata(ctx._metadata, stored_json=durable.metadata_json)
        params["metadata"] = self._sealer.seal_metadata(ctx.session_id, dict(ctx._metadata))
        return metadata_json, params

    def _rebase(self, conn: Connection, ctx: SessionContext) -> None:
        """Another writer moved the session: replay our unsaved changes on its rows.

        A session deleted meanwhile, or deleted and created anew under the same
        id, raises :class:`SessionDeletedError`: nothing of ``ctx`` is written
        into another conversation. An unsaved clear (or a replaced history)
        also drops what the other writer added before it.
        """
        durable = ctx._durable
        assert durable is not None
        pending = [message for _, message in ctx._pending_messages()]
        cleared = ctx._cleared
        our_agent = ctx.active_agent if ctx.active_agent.name != durable.agent_name else None
        our_metadata = dict(ctx._metadata)
        metadata_changed = dump_metadata(our_metadata) != durable.metadata_json
        our_summary = (ctx.summary, ctx.summary_through) if summary_changed(ctx) else None
        stored = read_session(conn, self._sealer, ctx.session_id)
        if stored is None or other_incarnation(ctx, stored):
            raise SessionDeletedError(ctx.session_id)
        telemetry.count("chatflow.version_conflicts", 1, self._runtime.system)
        carried = None if cleared else orphaned_tool_call(ctx, stored)
        agent = our_agent or self._agents(stored.agent_name, ctx.active_agent)
        install(ctx, stored, agent, set(ctx._seqs))
        if metadata_changed:
            ctx._replace_metadata(our_metadata)
        if cleared:
            ctx._history, ctx._seqs, ctx._cleared = [], [], True
            ctx._reindex()
            if our_summary is None:  # a replaced history (history = ...) keeps the summary
                ctx._set_summary(ctx.summary, ctx.summary_through)
            else:  # clear_history forgot it: the other's summary goes too
                ctx._set_summary(None, ctx._next_seq - 1)
        elif our_summary is not None and stored.summary_through == durable.summary_through:
            ctx._set_summary(*our_summary)  # else another summary was written first: it stands
        for message in pending if carried is None else [carried, *pending]:
            ctx._append(message)
        logger.info(
            "session %r changed in another process; %d new message(s) appended after its rows",
            ctx.session_id,
            len(pending),
        )


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


def _mark_written(
    ctx: SessionContext,
    gone: set[int],
    new_rows: list[dict[str, Any]],
    metadata_json: str | None,
) -> None:
    """Record what the database now holds: ``ctx`` as it is, one version up.

    ``metadata_json`` is the metadata just written, None if it was unchanged.
    """
    durable = ctx._durable
    assert durable is not None
    seqs = durable.seqs - gone
    seqs.update(row["seq"] for row in new_rows)
    ctx._durable = DurableState(
        version=durable.version + 1,
        seqs=seqs,
        agent_name=ctx.active_agent.name,
        metadata_json=durable.metadata_json if metadata_json is None else metadata_json,
        incarnation=durable.incarnation,
        hidden=durable.hidden.difference(gone),
        summary=ctx.summary,
        summary_through=ctx.summary_through,
    )
    ctx._cleared = False

