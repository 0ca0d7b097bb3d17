"""PostgreSQL: every session write as one statement in autocommit (one round trip, one commit).

The store's write (a :class:`~chatflow_sqlalchemy.dialect.SessionWrite`) is
a compare-and-swap of the session row (which also checks the turn's lease
and gives it back or moves it on, and sets a new summary), then the archive,
the message diff, the claim's fence (``FENCE_CLAIM``, as the portable write
sends it) and the inbox batch's answer. PostgreSQL runs data-modifying
``WITH`` clauses as one atomic statement, so all of it goes in one: every
part after the swap reads the swap's ``RETURNING``, and the swap itself needs
the claim's and the batch's row locks, so a missed swap, a lost claim or a
lost batch changes nothing. Locks are taken in the order of every other
writer (the session row, then its claim and inbox rows: the portable write,
``erase_user`` and ``sweep`` do the same), so none of them can deadlock with
it.

All parts read the snapshot the statement began with: the archive copies the
rows the same statement deletes, and a seq deleted and written again (a
rewound turn) is left out of the delete and overwritten by an upsert. The
summary's settling sees none of the rows archived by the same statement,
which the write value accounts for already. The messages travel as one JSON
text (``json_to_recordset``): one statement text whatever the number of rows,
so SQLAlchemy's compiled cache holds a handful, and one parameter for the
driver to send, where arrays of text make it scan and escape every element.
A claim's row is looked for in its day partitions only (``claim_day``, read
with the claim): for every partition, PostgreSQL would plan the fence's
lookup and update once per turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from functools import cache
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Connection,
    Date,
    Select,
    Text,
    all_,
    any_,
    bindparam,
    column,
    delete,
    exists,
    func,
    insert,
    select,
    true,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.dialects.postgresql import ARRAY, JSON
from sqlalchemy.dialects.postgresql import insert as pg_insert

from chatflow_sqlalchemy import tables
from chatflow_sqlalchemy.backends.postgresql_claims import utc_day
from chatflow_sqlalchemy.dialect import SessionWrite
from chatflow_sqlalchemy.sql_claims import CLAIM_IS_MINE, FENCE_CLAIM
from chatflow_sqlalchemy.sql_inbox import ANSWER_BATCH
from chatflow_sqlalchemy.sql_write import (
    ARCHIVE_COLUMNS,
    settle_statement,
    swap_params,
    swap_statement,
)
from chatflow_sqlalchemy.tables import UTCDateTime

__all__ = ["execute_write"]

_sessions = tables.sessions
_messages = tables.messages
_inbox = tables.inbox
_processed = tables.processed_messages
_NOW = bindparam("now", type_=UTCDateTime())


_CLAIM_DAYS = _processed.c.partition_day.between(
    bindparam("claim_day", type_=Date), bindparam("claim_day_until", type_=Date)
)
"""Where the claim's row can be: its day when taken, up to a day past now or past
that day (see :func:`execute_write`)."""


@dataclass(frozen=True)
class _Shape:
    """What a write holds, which picks its statement text (each is compiled once)."""

    metadata: bool
    lease: bool
    keep: bool
    summary: bool
    settle_keep: bool
    archive: bool
    clear: bool
    prune: bool
    upsert: bool
    fence: bool
    by_day: bool
    batch: bool


def _locks(shape: _Shape) -> tuple[Any, Any]:
    """The claim's and the batch's rows, locked after the session row (None where not held)."""
    if not (shape.fence or shape.batch):
        return None, None
    locked = (
        select(_sessions.c.session_id)
        .where(_sessions.c.session_id == bindparam("sid"))
        .with_for_update(key_share=True)
        .cte("locked")
    )
    fenced = batched = None
    if shape.fence:
        mine = (CLAIM_IS_MINE & _CLAIM_DAYS) if shape.by_day else CLAIM_IS_MINE
        fenced = (
            select(_processed.c.message_id)
            .where(mine, exists(select(locked.c.session_id)))
            .with_for_update()
            .cte("fenced")
        )
    if shape.batch:
        of_batch = ANSWER_BATCH.whereclause
        assert of_batch is not None
        batched = (
            select(_inbox.c.id)
            .where(of_batch, exists(select(locked.c.session_id)))
            .with_for_update()
            .cte("batched")
        )
    return fenced, batched


def _swap(shape: _Shape, fenced: Any, batched: Any) -> Any:
    """The compare-and-swap, also conditional on the claim and the batch, as a CTE."""
    swap = swap_statement(
        metadata=shape.metadata, lease=shape.lease, keep=shape.keep, summary=shape.summary
    )
    if fenced is not None:
        swap = swap.where(exists(select(fenced.c.message_id)))
    if batched is not None:
        in_flight = select(func.count()).select_from(batched).scalar_subquery()
        swap = swap.where(in_flight == bindparam("batch_size"))
    return swap.returning(_sessions.c.session_id).cte("swapped")


def _archive(swapped: Any) -> Any:
    """Copy the rows leaving the window into the archive, as the statement's snapshot holds them."""
    waiting = _messages.c.seq == any_(bindparam("waiting", type_=ARRAY(BigInteger)))
    kept = _messages.c.seq == any_(bindparam("archived", type_=ARRAY(BigInteger)))
    source = select(
        _messages.c.session_id, _messages.c.seq, _messages.c.role, _messages.c.content,
        _messages.c.message_json, _messages.c.created_at, _NOW, waiting,
    ).where(_messages.c.session_id.in_(select(swapped.c.session_id)), kept | waiting)
    return insert(tables.message_archive).from_select(ARCHIVE_COLUMNS, source).cte("archived")


def _messages_diff(shape: _Shape, swapped: Any) -> list[Any]:
    """Delete the rows leaving the window; insert (or, for a seq written again, replace) the new."""
    mine: list[ColumnElement[bool]] = [_messages.c.session_id.in_(select(swapped.c.session_id))]
    if not shape.clear:
        mine.append(_messages.c.seq == any_(bindparam("gone", type_=ARRAY(BigInteger))))
    if shape.upsert:
        mine.append(_messages.c.seq != all_(bindparam("again", type_=ARRAY(BigInteger))))
    rows = (
        func.json_to_recordset(sql_cast(bindparam("rows", type_=Text), JSON))
        .table_valued(
            column("seq", BigInteger), column("role", Text), column("content", Text),
            column("message_json", Text),
        )
        .render_derived(name="new_rows", with_types=True)
    )
    added = pg_insert(_messages).from_select(
        ["session_id", "seq", "role", "content", "message_json", "created_at"],
        select(
            swapped.c.session_id, rows.c.seq, rows.c.role, rows.c.content,
            rows.c.message_json, _NOW,
        ).select_from(swapped.join(rows, true())),
    )
    if shape.upsert:
        new = added.excluded
        added = added.on_conflict_do_update(
            index_elements=[_messages.c.session_id, _messages.c.seq],
            set_={name: new[name] for name in ("role", "content", "message_json", "created_at")},
        )
    if not (shape.clear or shape.prune):  # most turns delete nothing: nothing to plan
        return [added.cte("added")]
    return [delete(_messages).where(*mine).cte("pruned"), added.cte("added")]


@cache
def _statement(shape: _Shape) -> Select[Any]:
    """The write's statement; it returns one row: how many session rows it swapped."""
    fenced, batched = _locks(shape)
    swapped = _swap(shape, fenced, batched)
    has_swapped = exists(select(swapped.c.session_id))
    parts = _messages_diff(shape, swapped)
    if shape.archive:
        parts.append(_archive(swapped))
    if shape.summary:
        settle = settle_statement(keep=shape.settle_keep).where(has_swapped)
        parts.append(settle.cte("settled"))
    if fenced is not None:
        done = FENCE_CLAIM.where(has_swapped)
        parts.append((done.where(_CLAIM_DAYS) if shape.by_day else done).cte("done"))
    if batched is not None:
        answer = ANSWER_BATCH.where(_inbox.c.id.in_(select(batched.c.id)), has_swapped)
        parts.append(answer.cte("answered"))
    return select(func.count()).select_from(swapped).add_cte(*parts)


def execute_write(connection: Connection, write: SessionWrite) -> bool:
    """Run ``write`` as one statement; True if it stood (else it changed nothing)."""
    again = sorted(set(write.gone).intersection(row["seq"] for row in write.rows))
    params: dict[str, Any] = {
        **swap_params(write),
        "gone": list(write.gone),
        "again": again,
        "archived": list(write.archived),
        "waiting": list(write.waiting),
        "rows": json.dumps(
            [
                {key: row[key] for key in ("seq", "role", "content", "message_json")}
                for row in write.rows
            ],
            ensure_ascii=False,
        ),
    }
    fence, batch = write.fence, write.batch
    by_day = fence is not None and fence.get("claim_day") is not None
    if fence is not None:
        params.update(fence)  # the parameters of FENCE_CLAIM
    if fence is not None and by_day:
        # Rows only move to a later day: the purge moves the live rows of a
        # dropped day to its own today (a day of slack for its clock). A row
        # of a day ahead of this clock (left by a clock that ran ahead) is
        # looked for in its own day; one moved past both is not found, and
        # the writer looks for it in every day.
        params["claim_day_until"] = max(
            fence["claim_day"], utc_day(fence["claim_now"])
        ) + timedelta(days=1)
    if batch is not None:
        params.update(batch, batch_size=batch["size"])  # and those of ANSWER_BATCH
    shape = _Shape(
        metadata="metadata" in write.swap, lease=write.lease is not None,
        keep=write.keep_lease, summary=write.summary is not None,
        settle_keep=bool(write.summary and write.summary["keep"]),
        archive=bool(write.archived or write.waiting), clear=write.clear,
        prune=bool(write.gone), upsert=bool(again),
        fence=fence is not None, by_day=by_day, batch=batch is not None,
    )
    return bool(connection.execute(_statement(shape), params).scalar_one() == 1)
