"""PostgreSQL: a session write as one statement, sent in autocommit (one round trip, one commit).

The store's write is a compare-and-swap of the session row (checking the
turn's lease and giving it back), then the message diff, then (for a
claimed turn) the claim's fence (``FENCE_CLAIM``, the same statement the
step-by-step write sends). PostgreSQL runs
data-modifying ``WITH`` clauses as one atomic statement, so all of it goes
in one: every part after the swap reads the swap's ``RETURNING``, and the
swap itself needs the fence's row lock, so a missed swap or a lost claim
changes nothing. Locks are taken in the order of every other writer (the
session row, then its claim row: the step-by-step write, ``erase_user`` and
``sweep`` do the same), so none of them can deadlock with it. The messages
travel as one JSON text (``json_to_recordset``): one statement text whatever
the number of rows, so SQLAlchemy's compiled cache holds a handful (metadata
changed or not, claim or not), and one parameter for the driver to send,
where arrays of text make it scan and escape every element. A claim's row is
looked for in its day partitions only (``claim_day``, read with the claim):
for every partition, PostgreSQL would plan the fence's lookup and update
once per turn.
"""

from __future__ import annotations

import json
from datetime import timedelta
from functools import cache
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Date,
    Select,
    Text,
    any_,
    bindparam,
    column,
    delete,
    exists,
    func,
    insert,
    null,
    select,
    true,
    update,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.dialects.postgresql import ARRAY, JSON

from chatflow_sqlalchemy import tables
from chatflow_sqlalchemy.backends.postgresql_claims import utc_day
from chatflow_sqlalchemy.dialect import SessionWrite
from chatflow_sqlalchemy.lease import LEASE_HELD
from chatflow_sqlalchemy.sql_claims import CLAIM_IS_MINE, FENCE_CLAIM
from chatflow_sqlalchemy.tables import UTCDateTime

__all__ = ["write_at_once"]

_sessions = tables.sessions
_messages = tables.messages
_processed = tables.processed_messages
_NOW = bindparam("now", type_=UTCDateTime())


_CLAIM_DAYS = _processed.c.partition_day.between(
    bindparam("claim_day", type_=Date), bindparam("claim_day_until", type_=Date)
)
"""Where the claim's row can be: its day when taken, up to a day past now (see
:func:`write_at_once`)."""


@cache
def _statement(
    *, metadata: bool, fence: bool, by_day: bool = False, lease: bool = False
) -> Select[Any]:
    """The write's statement; it returns one row: ``(swapped, fenced)`` as counts.

    ``by_day``: the claim's row is looked for in its day partitions only.
    ``lease``: the swap also checks the turn's lease and gives it back.
    """
    swap_where = [
        _sessions.c.session_id == bindparam("sid"),
        _sessions.c.version == bindparam("expected"),
    ]
    if lease:
        swap_where.append(LEASE_HELD)
    fenced = None
    if fence:
        locked = (
            select(_sessions.c.session_id)
            .where(_sessions.c.session_id == bindparam("sid"))
            .with_for_update(key_share=True)
            .cte("locked")
        )
        mine = (CLAIM_IS_MINE & _CLAIM_DAYS) if by_day else CLAIM_IS_MINE
        fenced = (
            select(_processed.c.message_id)
            .where(mine, exists(select(locked.c.session_id)))
            .with_for_update()
            .cte("fenced")
        )
        swap_where.append(exists(select(fenced.c.message_id)))
    values: dict[str, Any] = {
        "version": bindparam("new_version"),
        "active_agent_name": bindparam("agent_name"),
        "updated_at": _NOW,
    }
    if metadata:
        values["metadata_json"] = bindparam("metadata")
    if lease:
        values.update(lease_owner=null(), lease_expires_at=null())
    swapped = (
        update(_sessions)
        .where(*swap_where)
        .values(**values)
        .returning(_sessions.c.session_id)
        .cte("swapped")
    )
    pruned = delete(_messages).where(
        _messages.c.session_id.in_(select(swapped.c.session_id)),
        _messages.c.seq == any_(bindparam("gone", type_=ARRAY(BigInteger))),
    ).cte("pruned")
    rows = (
        func.json_to_recordset(sql_cast(bindparam("rows", type_=Text), JSON))
        .table_valued(
            column("seq", BigInteger), column("role", Text), column("content", Text),
            column("message_json", Text),
        )
        .render_derived(name="new_rows", with_types=True)
    )
    added = insert(_messages).from_select(
        ["session_id", "seq", "role", "content", "message_json", "created_at"],
        select(
            swapped.c.session_id, rows.c.seq, rows.c.role, rows.c.content,
            rows.c.message_json, _NOW,
        ).select_from(swapped.join(rows, true())),
    ).cte("added")
    parts = [pruned, added]
    counts = [select(func.count()).select_from(swapped).scalar_subquery()]
    if fenced is not None:
        fence_claim = FENCE_CLAIM.where(exists(select(swapped.c.session_id)))
        if by_day:
            fence_claim = fence_claim.where(_CLAIM_DAYS)
        parts.append(fence_claim.cte("done"))
        counts.append(select(func.count()).select_from(fenced).scalar_subquery())
    return select(*counts).add_cte(*parts)


def write_at_once(connection: Connection, write: SessionWrite) -> tuple[bool, bool]:
    """Run ``write`` as one statement; ``(swapped, fenced)``."""
    params: dict[str, Any] = {
        **write.swap,
        "gone": list(write.gone),
        "rows": json.dumps(
            [
                {key: row[key] for key in ("seq", "role", "content", "message_json")}
                for row in write.rows
            ],
            ensure_ascii=False,
        ),
    }
    fence = write.fence
    by_day = False
    if fence is not None:
        params.update(fence)  # the parameters of FENCE_CLAIM
        by_day = fence.get("claim_day") is not None
        if by_day:
            # Rows only move to a later day: the purge moves the live rows of a
            # dropped day to its own today (a day of slack for its clock).
            params["claim_day_until"] = utc_day(fence["claim_now"]) + timedelta(days=1)
    if write.lease is not None:
        params.update(write.lease)
    statement = _statement(
        metadata="metadata" in write.swap, fence=fence is not None, by_day=by_day,
        lease=write.lease is not None,
    )
    row = connection.execute(statement, params).one()
    return row[0] == 1, fence is None or row[1] == 1
