"""Lifecycle and data governance on the SQL stores: per-user scope, filters, pages, GDPR.

The shared rules (argument checks, metadata matching, TTL arithmetic) are in
:mod:`chatflow_sqlalchemy.lifecycle`; this module is their SQL.

Kept apart from :mod:`chatflow_sqlalchemy.store` so that the store only
hooks in (``get_or_create(..., user_id=)``, ``list_sessions(...)``,
``erase_user``, ``export_user``); every query here is SQLAlchemy Core on the
shared models, so every SQL backend (and third-party ones) gets it.

Listing order, fixed here and documented:

* without ``limit`` and ``after``: most recently updated first (0.3.4's
  order, also when filters are given);
* with ``limit`` or ``after`` (paging): ``session_id`` ascending, and
  ``after`` is the last id of the previous page. The key of a session never
  changes, so a walk over all pages returns every session that exists
  throughout it exactly once, whatever is written meanwhile (an order by
  ``updated_at`` would move a session written during the walk from a later
  page to an earlier one, so that it is missed).

Metadata filters (``{key: value}``, all must match) compare values with
their JSON type: ``1`` matches ``1`` and ``1.0`` but neither ``"1"`` nor
``true``; objects and arrays must be equal, not merely contain the value. The
database narrows the rows first (JSONB containment on PostgreSQL, the
unquoted JSON value of string filters on SQLite and MySQL/MariaDB), and
every candidate is then checked exactly, so no dialect's loose JSON
comparison can let a wrong row through; pages are filled in batches until
``limit`` rows matched.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Select,
    Table,
    bindparam,
    case,
    delete,
    func,
    literal,
    select,
    tuple_,
    type_coerce,
)
from sqlalchemy.dialects import postgresql

from chatflow_sqlalchemy import tables
from chatflow_sqlalchemy.clock import DatabaseNow
from chatflow_sqlalchemy.lifecycle import (
    ListFilters,
    matches_metadata,
)
from chatflow_sqlalchemy.tables import UTCDateTime
from chatflow_sqlalchemy.values import CLAIM_ACQUIRED, UNBORN_AGENT

if TYPE_CHECKING:
    from chatflow_agent import Message

# chatflow-agent, the errors and the lease load the store's machinery: each is imported
# where it is used, so that the CLI's read commands (users export) run without them.

__all__ = [
    "SweepCursor",
    "count_expired",
    "decode_transcript",
    "erase_sessions",
    "erase_user_rows",
    "expired_query",
    "export_sessions",
    "parser_for",
    "session_page",
    "sweep_candidates",
    "transcript_sources",
    "user_session_ids",
]

_ID_CHUNK = 500
"""Ids per ``IN (...)`` list: far below every dialect's bound-parameter limit."""


_SIMPLE_KEY = re.compile(r"^[A-Za-z0-9_\-]+$")
"""Metadata keys whose JSON path every dialect quotes alike (others are checked in Python)."""


_sessions = tables.sessions


_messages = tables.messages


_processed = tables.processed_messages


_archive = tables.message_archive
_inbox = tables.inbox


def _narrowing(dialect_name: str, wanted: Mapping[str, Any]) -> list[ColumnElement[bool]]:
    """Conditions that keep every matching row (and drop most others) in SQL."""
    column = _sessions.c.metadata_json
    if dialect_name == "postgresql":  # JSONB containment: exact for scalars, a superset otherwise
        return [type_coerce(column, postgresql.JSONB).contains(dict(wanted))]
    return [
        column[key].as_string() == value
        for key, value in wanted.items()
        if isinstance(value, str) and _SIMPLE_KEY.match(key)
    ]


def _filtered(query: Select[Any], dialect_name: str, filters: ListFilters) -> Select[Any]:
    query = query.where(_sessions.c.active_agent_name != UNBORN_AGENT)
    if filters.user_id is not None:
        query = query.where(_sessions.c.user_id == filters.user_id)
    if filters.updated_after is not None:
        query = query.where(_sessions.c.updated_at > filters.updated_after)
    if filters.forked_from is not None:
        query = query.where(_sessions.c.forked_from == filters.forked_from)
    if filters.metadata:
        query = query.where(*_narrowing(dialect_name, filters.metadata))
    return query


def session_page(conn: Connection, filters: ListFilters) -> list[str]:
    """Session ids matching ``filters``, in the order the module docstring defines."""
    dialect_name = conn.dialect.name
    columns = [_sessions.c.session_id]
    if filters.metadata:
        columns.append(_sessions.c.metadata_json)
    query = _filtered(select(*columns), dialect_name, filters)
    if not filters.paged:
        query = query.order_by(_sessions.c.updated_at.desc(), _sessions.c.session_id)
        return [row.session_id for row in conn.execute(query) if _keep(row, filters)]
    query = query.order_by(_sessions.c.session_id)
    found: list[str] = []
    cursor = filters.after
    batch = None if filters.limit is None else max(filters.limit, 100 if filters.metadata else 0)
    while True:
        page = query if cursor is None else query.where(_sessions.c.session_id > cursor)
        rows = list(conn.execute(page if batch is None else page.limit(batch)))
        for row in rows:
            if _keep(row, filters):
                found.append(row.session_id)
                if filters.limit is not None and len(found) == filters.limit:
                    return found
        if batch is None or len(rows) < batch:
            return found
        cursor = rows[-1].session_id


def _keep(row: Any, filters: ListFilters) -> bool:
    return not filters.metadata or matches_metadata(row.metadata_json, filters.metadata)


def user_session_ids(conn: Connection, user_id: str, *, lock: bool = False) -> list[str]:
    """The ids of ``user_id``'s sessions, in id order (``lock``: row-locked until commit)."""
    query = (
        select(_sessions.c.session_id)
        .where(_sessions.c.user_id == user_id)
        .order_by(_sessions.c.session_id)
    )
    if lock:
        query = query.with_for_update()
    return list(conn.execute(query).scalars())


def _chunks(ids: list[str]) -> Iterator[list[str]]:
    for start in range(0, len(ids), _ID_CHUNK):
        yield ids[start : start + _ID_CHUNK]


def erase_sessions(conn: Connection, ids: Iterable[str], extra: Iterable[Table] = ()) -> int:
    """Delete the sessions ``ids`` with their messages, claims, inbox and rows in ``extra``.

    Runs in the caller's transaction: the caller commits once, so either
    everything about these sessions goes or nothing does. ``extra``: more
    tables with a ``session_id`` column (the transcript archive).
    Returns how many session rows were deleted.
    """
    erased = 0
    for chunk in _chunks(list(ids)):
        for table in (_messages, _processed, _archive, _inbox, *extra):
            conn.execute(delete(table).where(table.c.session_id.in_(chunk)))
        erased += conn.execute(
            delete(_sessions).where(_sessions.c.session_id.in_(chunk))
        ).rowcount
    return int(erased)


def erase_user_rows(conn: Connection, user_id: str, extra: Iterable[Table] = ()) -> int:
    """Delete everything of ``user_id``'s sessions in the caller's transaction, by subquery.

    For callers without the store's up-front write lock (the CLI on SQLite):
    no read precedes the first write, so the transaction never has to
    upgrade a read snapshot. Returns how many sessions were deleted.
    """
    owned = select(_sessions.c.session_id).where(_sessions.c.user_id == user_id)
    for table in (_messages, _processed, _archive, *extra):
        conn.execute(delete(table).where(table.c.session_id.in_(owned.scalar_subquery())))
    return int(conn.execute(delete(_sessions).where(_sessions.c.user_id == user_id)).rowcount)


def _not_claimed_now(now: datetime) -> ColumnElement[bool]:
    """No live acquired webhook claim names the session (its turn may be running).

    A lease is live by the database's clock, as the claims judge it: a sweeper
    whose clock runs ahead must not remove a session under a live claim.
    """
    database_now = DatabaseNow(bindparam(None, now, type_=UTCDateTime()))
    live = (
        select(_processed.c.message_id)
        .where(
            _processed.c.session_id == _sessions.c.session_id,
            _processed.c.state == CLAIM_ACQUIRED,
            _processed.c.lease_expires_at > database_now,
        )
        .exists()
    )
    return ~live


def _not_leased_now(now: datetime) -> ColumnElement[bool]:
    """No turn holds the session's lease (by the database's clock): none is running on it."""
    from chatflow_sqlalchemy.lease import free_at

    return free_at(DatabaseNow(bindparam(None, now, type_=UTCDateTime())))


def expired_query(cutoff: datetime, now: datetime) -> Select[Any]:
    """Sessions last written before ``cutoff``, under no live lease or claim, oldest first."""
    return (
        select(_sessions.c.session_id, _sessions.c.updated_at)
        .where(_sessions.c.updated_at < cutoff, _not_leased_now(now), _not_claimed_now(now))
        .order_by(_sessions.c.updated_at, _sessions.c.session_id)
    )


@dataclass
class SweepCursor:
    """Where the next batch of one ``sweep()`` call starts (past sessions it skipped)."""

    updated_at: datetime | None = None
    session_id: str | None = None


def sweep_candidates(
    conn: Connection,
    cutoff: datetime,
    now: datetime,
    batch: int,
    cursor: SweepCursor,
    lock: Callable[[Select[Any], Connection], Select[Any]],
) -> list[str]:
    """Lock and return up to ``batch`` expired sessions after ``cursor``, moving it.

    ``lock`` is the dialect's :meth:`~chatflow_sqlalchemy.dialect.DialectSupport.lock_batch`:
    with ``FOR UPDATE SKIP LOCKED`` concurrent sweepers take disjoint batches
    instead of waiting for one another and a session row locked by a writer
    is passed over. SQLite ignores row locks: there the caller's
    ``BEGIN IMMEDIATE`` serialises sweepers and writers.
    """
    query = expired_query(cutoff, now)
    if cursor.updated_at is not None:
        query = query.where(
            tuple_(_sessions.c.updated_at, _sessions.c.session_id)
            > tuple_(literal(cursor.updated_at, UTCDateTime()), literal(cursor.session_id))
        )
    rows = list(conn.execute(lock(query.limit(batch), conn)))
    if rows:
        cursor.updated_at, cursor.session_id = rows[-1].updated_at, rows[-1].session_id
    return [row.session_id for row in rows]


def count_expired(conn: Connection, cutoff: datetime, now: datetime) -> tuple[int, list[str]]:
    """``(how many, the oldest 20 ids)`` a sweep would remove now (for ``--dry-run``)."""
    query = expired_query(cutoff, now)
    total = conn.execute(select(func.count()).select_from(query.subquery())).scalar_one()
    return int(total), list(conn.execute(query.limit(20)).scalars())


def parser_for(table: Table, parse: Callable[..., Message]) -> Callable[..., Message]:
    """``parse`` (a window-row decoder) for the rows of ``table``.

    The store's decoder names ``chatflow_messages`` in a ``CorruptRowError``;
    for another table (the archive) the error names that table instead, so
    that its row id points at the right row.
    """
    if table is _messages:
        return parse

    def parse_row(session_id: str, row_id: object, text: str) -> Message:
        try:
            return parse(session_id, row_id, text)
        except Exception as exc:  # a CorruptRowError (imported only once one is raised)
            from chatflow_sqlalchemy.exceptions import CorruptRowError

            if not isinstance(exc, CorruptRowError) or exc.table != _messages.name:
                raise
            raise CorruptRowError(session_id, row_id, exc.reason, table=table.name) from exc

    return parse_row


def transcript_sources(
    conn: Connection, session_id: str, *, waiting: bool = True
) -> list[tuple[str, int, str]]:
    """``(table name, row id, message_json)`` of archive + window, one per seq, in seq order.

    ``waiting``: also the archived rows that wait for the session's summary.

    A seq both archived and in the window (restored by a rollback) is taken
    from the window; a seq archived twice, from its latest archive row.
    """
    rows = _by_seq(conn, session_id, waiting)
    return [(table, row_id, text) for table, row_id, _, text in rows]


def _by_seq(
    conn: Connection, session_id: str, waiting: bool
) -> list[tuple[str, int, Any, str]]:
    by_seq: dict[int, tuple[str, int, Any, str]] = {}
    archived = (
        select(_archive.c.id, _archive.c.seq, _archive.c.message_json)
        .where(_archive.c.session_id == session_id)
        .order_by(_archive.c.id)
    )
    if not waiting:
        archived = archived.where(~_archive.c.pending_summary)
    window = select(_messages.c.id, _messages.c.seq, _messages.c.message_json).where(
        _messages.c.session_id == session_id
    )
    for table, query in ((_archive, archived), (_messages, window)):
        for row in conn.execute(query):
            by_seq[row.seq] = (table.name, row.id, row.seq, row.message_json)
    return [by_seq[seq] for seq in sorted(by_seq)]


def decode_transcript(
    session_id: str, rows: list[tuple[str, int, str]], parse: Callable[..., Message]
) -> list[Message]:
    """The messages of :func:`transcript_sources` rows, in order.

    ``parse(session_id, row_id, message_json) -> Message`` decodes a window
    row (the store's decoder); a corrupt row raises ``CorruptRowError``
    naming its table (``chatflow_message_archive`` for an archived row) and id.
    """
    parsers = {table.name: parser_for(table, parse) for table in (_archive, _messages)}
    return [parsers[table](session_id, row_id, text) for table, row_id, text in rows]


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def export_sessions(
    conn: Connection,
    ids: list[str],
    parse: Any,
    open_metadata: Any = None,
    open_summary: Callable[[str, str | None], str | None] | None = None,
) -> list[dict[str, Any]]:
    """Everything stored about the sessions ``ids``, as JSON-ready dicts.

    ``parse(session_id, row_id, message_json) -> Message`` decodes a message
    row (the store's decoder: a corrupt row raises ``CorruptRowError``, naming
    ``chatflow_message_archive`` for an archived row). No corrupt row is
    left out silently. ``open_metadata(session_id, stored)`` and
    ``open_summary(session_id, stored)`` open what a cipher sealed (None:
    exported as stored).
    """
    parse_archived = parser_for(_archive, parse)
    exported: list[dict[str, Any]] = []
    for chunk in _chunks(ids):
        rows = conn.execute(
            select(_sessions).where(_sessions.c.session_id.in_(chunk)).order_by(
                _sessions.c.session_id
            )
        ).mappings()
        for row in rows:
            sid = row["session_id"]
            messages: list[Message] = [
                parse(sid, msg.id, msg.message_json)
                for msg in conn.execute(
                    select(_messages.c.id, _messages.c.message_json)
                    .where(_messages.c.session_id == sid)
                    .order_by(
                        case((_messages.c.role == "system", 0), else_=1),  # Role.SYSTEM
                        _messages.c.seq,
                    )
                )
            ]
            exported.append(
                {
                    "session_id": sid,
                    "user_id": row["user_id"],
                    "active_agent_name": row["active_agent_name"],
                    "metadata": row["metadata_json"]
                    if open_metadata is None
                    else open_metadata(sid, row["metadata_json"]),
                    "created_at": _iso(row["created_at"]),
                    "updated_at": _iso(row["updated_at"]),
                    "summary": row["summary"]
                    if open_summary is None
                    else open_summary(sid, row["summary"]),
                    "forked_from": row["forked_from"],
                    "forked_at_turn": row["forked_at_turn"],
                    "messages": [m.model_dump(mode="json") for m in messages],
                    "archived_messages": [
                        parse_archived(sid, row.id, row.message_json).model_dump(mode="json")
                        for row in conn.execute(
                            select(_archive.c.id, _archive.c.message_json)
                            .where(_archive.c.session_id == sid)
                            .order_by(_archive.c.seq, _archive.c.id)
                        )
                    ],
                    "webhook_claims": _claims_of(conn, sid),
                }
            )
    return exported


def _claims_of(conn: Connection, session_id: str) -> list[dict[str, Any]]:
    query = (
        select(
            _processed.c.message_id,
            _processed.c.state,
            _processed.c.processed_at,
            _processed.c.response,
        )
        .where(_processed.c.session_id == session_id)
        .order_by(_processed.c.ticket, _processed.c.message_id)
    )
    return [
        {
            "message_id": row.message_id,
            "state": row.state,
            "processed_at": _iso(row.processed_at),
            "response": row.response,
        }
        for row in conn.execute(query)
    ]
