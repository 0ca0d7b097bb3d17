"""The statements of a session write, portable, and the one read that explains a missed one.

A write is a :class:`~chatflow_sqlalchemy.dialect.SessionWrite`; its
portable form (:func:`portable_steps`) begins with the compare-and-swap of
the session row, which also checks the turn's lease and gives it back (or
moves it on), sets the summary, and takes the row's write lock; then the
archive, the message diff, the claim's fence and the inbox batch's answer.
:func:`swap_statement` is shared with backends that send the write their
own way, so the swap means the same everywhere. When a write did not stand,
:func:`probe` reads in one statement what can explain it.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import (
    Boolean,
    Select,
    Update,
    and_,
    bindparam,
    delete,
    exists,
    func,
    insert,
    literal,
    null,
    select,
    update,
)

from chatflow_sqlalchemy import tables
from chatflow_sqlalchemy.dialect import SessionWrite, WriteStep
from chatflow_sqlalchemy.lease import LEASE_HELD, TAKE_VALUES
from chatflow_sqlalchemy.rows import (
    BUMP_SESSION,
    DELETE_ALL_MESSAGES,
    DELETE_SOME_MESSAGES,
    INSERT_MESSAGES,
)
from chatflow_sqlalchemy.sql_claims import CLAIM_IS_MINE, FENCE_CLAIM
from chatflow_sqlalchemy.sql_inbox import ANSWER_BATCH
from chatflow_sqlalchemy.tables import UTCDateTime

__all__ = [
    "ARCHIVE_COLUMNS",
    "portable_steps",
    "probe",
    "settle_statement",
    "swap_params",
    "swap_statement",
]

_s = tables.sessions
_messages = tables.messages
_archive = tables.message_archive
_inbox = tables.inbox
_ID_CHUNK = 500
ARCHIVE_COLUMNS = [
    "session_id", "seq", "role", "content", "message_json", "created_at",
    "archived_at", "pending_summary",
]
"""The archive columns a write fills, in the order of :func:`_archive_step`'s SELECT."""


@cache
def swap_statement(*, metadata: bool, lease: bool, keep: bool, summary: bool) -> Update:
    """The compare-and-swap UPDATE of the session row (rowcount 1: it matched).

    ``lease``: it also checks the turn's lease and gives it back, or with
    ``keep`` moves it on. ``summary``: it sets the session's summary
    (parameters ``summary`` and ``through``).
    """
    swap = BUMP_SESSION
    if metadata:
        swap = swap.values(metadata_json=bindparam("metadata"))
    if lease and keep:
        swap = swap.where(LEASE_HELD).values(lease_expires_at=TAKE_VALUES["lease_expires_at"])
    elif lease:
        swap = swap.where(LEASE_HELD).values(lease_owner=null(), lease_expires_at=null())
    if summary:
        swap = swap.values(
            summary=bindparam("summary"),
            summary_through=bindparam("through"),
            summary_claimed_until=None,
        )
    return swap


def swap_params(write: SessionWrite) -> dict[str, Any]:
    """The parameters of :func:`swap_statement` for ``write``."""
    return {**write.swap, **(write.lease or {}), **(write.summary or {})}


@cache
def settle_statement(*, keep: bool) -> Update | Any:
    """Archived rows up to seq ``through`` are in the summary now: kept (``keep``) or deleted."""
    covered = and_(
        _archive.c.session_id == bindparam("sid"),
        _archive.c.pending_summary,
        _archive.c.seq <= bindparam("through"),
    )
    if keep:
        return update(_archive).where(covered).values(pending_summary=False)
    return delete(_archive).where(covered)


def _archive_step(write: SessionWrite, seqs: list[int], *, waiting: bool) -> WriteStep:
    """Copy the window rows ``seqs`` into the archive (before they are deleted)."""
    source = select(
        _messages.c.session_id, _messages.c.seq, _messages.c.role, _messages.c.content,
        _messages.c.message_json, _messages.c.created_at,
        literal(write.swap["now"], UTCDateTime()).label("archived_at"),
        literal(waiting, Boolean()).label("pending_summary"),
    ).where(_messages.c.session_id == write.swap["sid"], _messages.c.seq.in_(seqs))
    return WriteStep(insert(_archive).from_select(ARCHIVE_COLUMNS, source), {})


def portable_steps(write: SessionWrite) -> tuple[WriteStep, ...]:
    """``write`` as statements any database runs, in order; the swap comes first."""
    sid = write.swap["sid"]
    swap = swap_statement(
        metadata="metadata" in write.swap, lease=write.lease is not None,
        keep=write.keep_lease, summary=write.summary is not None,
    )
    steps = [WriteStep(swap, swap_params(write), rows=1)]
    for seqs, waiting in ((list(write.archived), False), (list(write.waiting), True)):
        steps += [
            _archive_step(write, seqs[start : start + _ID_CHUNK], waiting=waiting)
            for start in range(0, len(seqs), _ID_CHUNK)
        ]
    if write.summary is not None:
        keep = bool(write.summary["keep"])
        steps.append(WriteStep(settle_statement(keep=keep), {**write.summary, "sid": sid}))
    if write.clear:
        steps.append(WriteStep(DELETE_ALL_MESSAGES, {"session_id": sid}))
    elif write.gone:
        steps.append(WriteStep(DELETE_SOME_MESSAGES, {"session_id": sid, "seqs": write.gone}))
    if write.rows:
        steps.append(WriteStep(INSERT_MESSAGES, list(write.rows)))
    if write.fence is not None:
        steps.append(WriteStep(FENCE_CLAIM, write.fence, rows=1))
    if write.batch is not None:
        steps.append(WriteStep(ANSWER_BATCH, write.batch, rows=int(write.batch["size"])))
    return tuple(steps)


def probe(write: SessionWrite) -> tuple[Select[Any], dict[str, Any]]:
    """One read of what a write that did not stand was checked against, and its parameters.

    Its row (none: the session is gone): the session's ``version`` and
    ``created_at``, then ``held`` (the lease is still the writer's and
    unexpired), ``claimed`` (the claim is still held) and ``in_flight`` (the
    batch's items still in flight), each only where the write has one.
    """
    columns: list[Any] = [_s.c.version, _s.c.created_at]
    params: dict[str, Any] = {"sid": write.swap["sid"]}
    if write.lease is not None:
        columns.append(LEASE_HELD.label("held"))
        params.update(write.lease)
    if write.fence is not None:
        claims = tables.processed_messages
        columns.append(exists(select(claims.c.message_id).where(CLAIM_IS_MINE)).label("claimed"))
        params.update(write.fence)
    if write.batch is not None:
        of_batch = ANSWER_BATCH.whereclause
        assert of_batch is not None
        items = select(func.count()).select_from(_inbox).where(of_batch)
        columns.append(items.scalar_subquery().label("in_flight"))
        params.update(write.batch)
    return select(*columns).where(_s.c.session_id == bindparam("sid")), params
