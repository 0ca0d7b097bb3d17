"""The store's one write algorithm: a context's changes, compare-and-swapped onto its session.

A write is built once from what a context changed (a
:class:`~chatflow_sqlalchemy.dialect.SessionWrite`: the compare-and-swap of
the session's ``version``, the turn's lease check and release, the summary,
the archive, the message diff, the claim's fence, the inbox batch's answer)
and handed to the backend's
:meth:`~chatflow_sqlalchemy.dialect.DialectSupport.execute_write`, which
makes all of it stand or none of it (PostgreSQL sends it as one statement,
other databases as the portable statements in one transaction). When it did
not stand, one read tells why: the session is gone, the lease or the claim
or the inbox batch was lost (the matching error is raised), or another writer
moved the session; the context is then rebased on the fresh rows, its new
messages appended after them as whole turns, and the write is built and
executed again, the same way. A claim's row looked for by its day (see
:attr:`~chatflow_sqlalchemy.claims.ClaimFence.partition_day`) and not found
there while still held is looked for in every day once.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import Connection, Row

from chatflow_sqlalchemy import telemetry
from chatflow_sqlalchemy.claims import ClaimFence, reply_of
from chatflow_sqlalchemy.context import PendingWrite, SessionContext
from chatflow_sqlalchemy.contexts import AgentResolver
from chatflow_sqlalchemy.dialect import DialectSupport, SessionWrite
from chatflow_sqlalchemy.exceptions import ClaimLostError, LeaseLostError, SessionDeletedError
from chatflow_sqlalchemy.inbox import BatchFence
from chatflow_sqlalchemy.lease import SessionLeases, lease_params
from chatflow_sqlalchemy.rows import message_row, read_session
from chatflow_sqlalchemy.runtime import StoreRuntime
from chatflow_sqlalchemy.sealing import Sealer
from chatflow_sqlalchemy.sql_write import portable_steps, probe
from chatflow_sqlalchemy.summaries import Summaries
from chatflow_sqlalchemy.values import Lease, utcnow

__all__ = ["SessionWriter"]

logger = logging.getLogger("chatflow_sqlalchemy")


class _Missed(Exception):
    """The write did not stand: its transaction rolls back."""


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
        the turn's lease, checked and given back by the write. ``batch``:
        the inbox batch the turn runs for; the write records its reply. A
        lease an inbox batch holds (``lease.kept``) is checked and kept, not
        given back.

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
        answer = None if batch is None else self._answer(batch, reply_of(pending.tail))
        write = self._build(pending, fence, reply, lease, answer)
        while not self._execute(write):
            pending = self._explain(ctx, write, pending, fence)
            write = self._build(pending, fence, reply, lease, answer)
        ctx.applied(pending)
        if fence is not None:
            fence.reply = reply
        if write.waiting and self._summaries is not None:
            self._summaries.due(ctx.session_id)
        if lease is not None and not lease.kept:
            lease.released = True
        elif lease is not None:
            lease.version = pending.version + 1  # the batch's next turn need not read it
        return len(pending.gone)

    def _build(
        self,
        pending: PendingWrite,
        fence: ClaimFence | None,
        reply: str | None,
        lease: Lease | None,
        answer: dict[str, Any] | None,
    ) -> SessionWrite:
        """The write of ``pending`` (with its portable statements, where the backend runs them)."""
        now = utcnow()
        archived, waiting = self._to_archive(pending)
        summary = None
        if pending.summary is not None:
            summary, archived, waiting = self._summary(pending, archived, waiting)
        held = None if lease is None else lease_params(lease)
        if lease is not None and lease.kept:
            held = {**lease_params(lease), **self._leases.until_params()}
        sid = pending.session_id
        swap: dict[str, Any] = {  # the compare-and-swap's; the metadata only if it changed
            "sid": sid,
            "expected": pending.version,
            "new_version": pending.version + 1,
            "agent_name": pending.agent_name,
            "now": now,
        }
        if pending.metadata is not None:
            swap["metadata"] = self._sealer.seal_metadata(sid, pending.metadata)
        fields: dict[str, Any] = {
            "swap": swap,
            "gone": sorted(pending.gone),
            "clear": bool(pending.gone) and pending.empty,
            "rows": [
                message_row(self._sealer, sid, seq, message, now)
                for seq, message in pending.messages
            ],
            "archived": archived,
            "waiting": waiting,
            "summary": summary,
            "fence": None if fence is None else fence.params(now, reply),
            "lease": held,
            "keep_lease": lease is not None and lease.kept,
            "batch": None if answer is None else {**answer, "now": now},
        }
        write = SessionWrite(**fields)
        if self._support.one_statement_write:
            return write  # its one statement is built from the fields, not the steps
        # Made again with its steps: cheaper than dataclasses.replace, which reads every field.
        return SessionWrite(**fields, steps=portable_steps(write))

    def _execute(self, write: SessionWrite) -> bool:
        """:meth:`DialectSupport.execute_write`; False (rolled back) if the write did not stand."""
        single = self._support.one_statement_write
        try:
            with self._runtime.transaction(write=True, single=single) as conn:
                if not self._support.execute_write(conn, write):
                    raise _Missed
        except _Missed:
            return False
        return True

    def _explain(
        self,
        ctx: SessionContext,
        write: SessionWrite,
        pending: PendingWrite,
        fence: ClaimFence | None,
    ) -> PendingWrite:
        """Tell why ``write`` of ``pending`` missed: raise what was lost; else what to write now.

        One read, under the session row's write lock, of what the write was
        checked against: what was lost is raised; when the version moved, the
        context is rebased on the rows read in the same transaction. When
        nothing moved, ``fence``'s row was not in the days the backend looked
        in (a clock that ran ahead moved it later): the write looks for it in
        every day.
        """
        statement, params = probe(write)
        sid = write.swap["sid"]
        with self._runtime.transaction(write=True) as conn:
            row = conn.execute(self._support.lock_session_row(statement), params).first()
            _raise_lost(write, row, pending.incarnation)
            assert row is not None
            if row.version != write.swap["expected"]:
                return self._rebase(conn, ctx)
        if fence is None or fence.partition_day is None:
            raise RuntimeError(f"a write of session {sid!r} did not stand, for no reason")
        fence.partition_day = None
        return pending

    def _answer(self, batch: BatchFence, reply: str | None) -> dict[str, Any]:
        """The inbox batch's answer: its token and size, the reply (sealed)."""
        sealed = None if reply is None else self._sealer.seal_text(batch.session_id, reply)
        return {"token": batch.token, "reply": sealed, "size": batch.size}

    def _summary(
        self, pending: PendingWrite, archived: list[int], waiting: list[int]
    ) -> tuple[dict[str, Any], list[int], list[int]]:
        """The new summary's parameters, and the rows to archive once it covers what it covers.

        Rows this write would archive as waiting for a summary that already
        covers them are archived as settled (``archive_pruned``) or not at all.
        """
        assert pending.summary is not None
        text, through = pending.summary
        sid = pending.session_id
        summary = {
            "summary": None if text is None else self._sealer.seal_text(sid, text),
            "through": through,
            "keep": self._archive_pruned,
        }
        settled = [seq for seq in waiting if seq <= through]
        waiting = [seq for seq in waiting if seq > through]
        if self._archive_pruned:
            archived = sorted(archived + settled)
        return summary, archived, waiting

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

    def _rebase(self, conn: Connection, ctx: SessionContext) -> PendingWrite:
        """Another writer moved the session: replay our unsaved changes on its rows."""
        pending = ctx.rebase(read_session(conn, self._sealer, ctx.session_id), self._agents)
        telemetry.count("chatflow.version_conflicts", 1, self._runtime.system)
        logger.info(
            "session %r changed in another process; %d new message(s) appended after its rows",
            ctx.session_id,
            len(pending.messages),
        )
        return pending


def _raise_lost(write: SessionWrite, row: Row[Any] | None, incarnation: object) -> None:
    """Raise what the write lost, as :func:`~chatflow_sqlalchemy.sql_write.probe` read it.

    ``incarnation`` is the ``created_at`` of the session the write began on.

    Raises:
        SessionDeletedError: The session is gone (or is another one now).
        LeaseLostError: The lease expired or was taken over, or the inbox
            batch's items are no longer in flight under its token.
        ClaimLostError: The claim is no longer held.

    """
    sid = write.swap["sid"]
    if row is None or (incarnation is not None and row.created_at != incarnation):
        raise SessionDeletedError(sid)
    if write.lease is not None and not row.held:
        raise LeaseLostError(sid)
    if write.fence is not None and not row.claimed:
        raise ClaimLostError(write.fence["claim_id"])
    if write.batch is not None and row.in_flight != write.batch["size"]:
        raise LeaseLostError(sid)
