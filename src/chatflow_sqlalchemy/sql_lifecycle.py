"""Lifecycle and data governance on the SQL stores: scope, filters, pages, sweep, GDPR.

The rules are in :mod:`chatflow_sqlalchemy.lifecycle`; this module is their
SQL, in Core on the shared tables, so every SQL backend gets it.

Listing order: without ``limit`` and ``after``, most recently updated first
(0.3.4's order); when paging, ``session_id`` ascending with ``after`` the last
id of the previous page: a session's key never changes, so a walk over all
pages returns every session exactly once whatever is written meanwhile.
Metadata filters are narrowed in SQL (JSONB containment on PostgreSQL, the
unquoted JSON value of string filters elsewhere) and every candidate is then
checked exactly, so no dialect's loose JSON comparison lets a wrong row through.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    ScalarSelect,
    Select,
    Table,
    Text,
    bindparam,
    case,
    cast,
    delete,
    func,
    literal,
    select,
    tuple_,
    type_coerce,
    update,
)
from sqlalchemy.dialects import postgresql

from chatflow_sqlalchemy import tables
from chatflow_sqlalchemy.clock import DatabaseNow
from chatflow_sqlalchemy.lifecycle import (
    ExportedInboxMessage,
    ListFilters,
    export_document,
    matches_metadata,
)
from chatflow_sqlalchemy.tables import UTCDateTime
from chatflow_sqlalchemy.values import CLAIM_ACQUIRED, UNBORN_AGENT

if TYPE_CHECKING:
    from chatflow_agent import Message

    from chatflow_sqlalchemy.exceptions import CorruptRowError
    from chatflow_sqlalchemy.sealing import Sealer

# chatflow-agent, the errors and the lease load the store's machinery: each is imported
# where it is used, so that the CLI's read commands (users export) run without them.

__all__ = [
    "SweepCursor", "count_expired", "decode_transcript", "delete_session", "erase_sessions",
    "erase_user_rows", "expired_query", "export_sessions", "export_user_document",
    "invalid_metadata", "owned_sessions", "parser_for", "session_page", "sweep_candidates",
    "transcript_sources", "user_session_ids",
]

_ID_CHUNK = 500  # ids per IN (...) list: far below every dialect's bound-parameter limit
# Metadata keys whose JSON path every dialect quotes alike (others are checked in Python).
_SIMPLE_KEY = re.compile(r"^[A-Za-z0-9_\-]+$")
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


def session_page(conn: Connection, filters: ListFilters) -> list[str]:
    """Session ids matching ``filters``, in listing order."""
    s = _sessions.c
    query = select(s.session_id, *([s.metadata_json] if filters.metadata else [])).where(
        s.active_agent_name != UNBORN_AGENT
    )
    if filters.user_id is not None:
        query = query.where(s.user_id == filters.user_id)
    if filters.updated_after is not None:
        query = query.where(s.updated_at > filters.updated_after)
    if filters.forked_from is not None:
        query = query.where(s.forked_from == filters.forked_from)
    if filters.metadata:
        query = query.where(*_narrowing(conn.dialect.name, filters.metadata))
    if not filters.paged:
        query = query.order_by(s.updated_at.desc(), s.session_id)
        return [row.session_id for row in conn.execute(query) if _keep(row, filters)]
    query = query.order_by(s.session_id)
    found: list[str] = []
    cursor = filters.after
    batch = None if filters.limit is None else max(filters.limit, 100 if filters.metadata else 0)
    while True:
        page = query if cursor is None else query.where(s.session_id > cursor)
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


def owned_sessions(user_id: str) -> Select[Any]:
    """The ids of every session row of ``user_id``'s (unborn ones too): what erasure removes.

    The one predicate of ``user_id``'s data: erasure and export both select
    the user's sessions, and what is stored with them, through it.
    """
    return select(_sessions.c.session_id).where(_sessions.c.user_id == user_id)


def user_session_ids(conn: Connection, user_id: str, *, lock: bool = False) -> list[str]:
    """The ids of ``user_id``'s sessions, in id order (``lock``: row-locked until commit)."""
    query = owned_sessions(user_id).order_by(_sessions.c.session_id)
    if lock:
        query = query.with_for_update()
    return list(conn.execute(query).scalars())


def _chunks(ids: list[str]) -> Iterator[list[str]]:
    for start in range(0, len(ids), _ID_CHUNK):
        yield ids[start : start + _ID_CHUNK]


def erase_sessions(conn: Connection, ids: Iterable[str]) -> int:
    """Delete sessions with their messages, archive, claims and inbox.

    In the caller's transaction, so everything about them goes or nothing
    does. Returns how many session rows were deleted.
    """
    erased = 0
    for chunk in _chunks(list(ids)):
        _erase_stored_with(conn, chunk)
        erased += conn.execute(
            delete(_sessions).where(_sessions.c.session_id.in_(chunk))
        ).rowcount
    return int(erased)


def _erase_stored_with(conn: Connection, ids: list[str] | ScalarSelect[Any]) -> None:
    """Delete the messages, archive, claims and inbox messages of these ids (or subquery's)."""
    for table in (_messages, _processed, _archive, _inbox):
        conn.execute(delete(table).where(table.c.session_id.in_(ids)))


def delete_session(conn: Connection, session_id: str) -> bool:
    """Delete one session with everything stored for it; True if its row existed.

    ``store.delete`` and ``sessions delete``, in the caller's transaction: the
    session row, then what :func:`erase_sessions` removes (messages, archive,
    claims, inbox), so everything goes or nothing does. The row goes first,
    so it is locked before any of its claim or inbox rows, in the order every
    writer of the session takes them (a turn's write, an inbox batch's
    fence): the two cannot deadlock. And no read precedes the first write,
    so a caller without the store's up-front write lock (the CLI on SQLite)
    never upgrades a read snapshot. The claims and inbox messages of the id
    go even when it has no session row (a message no worker has taken yet).
    The row is not deleted a second time: one that appeared after the first
    DELETE (a claimed turn's first write, waiting for the claim locked here)
    would be locked after the claim, and the two would deadlock; that turn
    finds its claim gone and writes nothing.
    """
    existed = conn.execute(delete(_sessions).where(_sessions.c.session_id == session_id))
    _erase_stored_with(conn, [session_id])
    return bool(existed.rowcount)


def erase_user_rows(conn: Connection, user_id: str) -> int:
    """Delete everything of ``user_id``'s sessions by subquery; return how many sessions.

    The same rows as :func:`erase_sessions` (the inbox too). The session rows
    are locked first, by an update that changes nothing, in the order every
    writer of a session takes its rows (a turn's write, a delete): taken last,
    they deadlocked with a turn's write holding one and waiting for its claim.
    No read precedes the first write, so a caller without the store's up-front
    write lock (the CLI on SQLite) never upgrades a read snapshot.
    """
    mine = _sessions.c.user_id == user_id
    conn.execute(update(_sessions).where(mine).values(user_id=_sessions.c.user_id))
    _erase_stored_with(conn, owned_sessions(user_id).scalar_subquery())
    return int(conn.execute(delete(_sessions).where(mine)).rowcount)


def expired_query(cutoff: datetime, now: datetime) -> Select[Any]:
    """Sessions last written before ``cutoff``, under no live lease or claim, oldest first.

    Live by the database's clock, as leases and claims are judged: a sweeper
    whose clock runs ahead never removes a session whose turn may be running.
    """
    from chatflow_sqlalchemy.lease import free_at

    database_now = DatabaseNow(bindparam(None, now, type_=UTCDateTime()))
    claimed = select(_processed.c.message_id).where(
        _processed.c.session_id == _sessions.c.session_id,
        _processed.c.state == CLAIM_ACQUIRED,
        _processed.c.lease_expires_at > database_now,
    )
    return (
        select(_sessions.c.session_id, _sessions.c.updated_at)
        .where(_sessions.c.updated_at < cutoff, free_at(database_now), ~claimed.exists())
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

    ``lock`` is the dialect's ``lock_batch``: with ``SKIP LOCKED`` concurrent
    sweepers take disjoint batches and pass over rows writers hold (on
    SQLite the caller's ``BEGIN IMMEDIATE`` serialises them instead).
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
    """``parse`` (a window-row decoder) for ``table``: a ``CorruptRowError`` names that table."""
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
    by_seq: dict[int, tuple[str, int, str]] = {}
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
            by_seq[row.seq] = (table.name, row.id, row.message_json)
    return [by_seq[seq] for seq in sorted(by_seq)]


def decode_transcript(
    session_id: str, rows: list[tuple[str, int, str]], parse: Callable[..., Message]
) -> list[Message]:
    """The messages of :func:`transcript_sources` rows, decoded by ``parse`` (the store's)."""
    parsers = {table.name: parser_for(table, parse) for table in (_archive, _messages)}
    return [parsers[table](session_id, row_id, text) for table, row_id, text in rows]


_SESSION_COLUMNS = [column for column in _sessions.c if column.name != "metadata_json"]
_METADATA_TEXT = cast(_sessions.c.metadata_json, Text).label("metadata_json")
"""Read as text, so metadata that is not JSON names its session instead of failing the fetch."""


def invalid_metadata(session_id: str, exc: ValueError) -> CorruptRowError:
    """The error for a session row whose ``metadata_json`` does not decode (SQLite keeps text)."""
    from chatflow_sqlalchemy.exceptions import CorruptRowError

    reason = f"metadata_json is not valid JSON ({str(exc).splitlines()[0]})"
    return CorruptRowError(session_id, None, reason, table=_sessions.name)


def _metadata_of(session_id: str, text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise invalid_metadata(session_id, exc) from exc


def export_sessions(
    conn: Connection,
    ids: list[str],
    parse: Callable[..., Message],
    open_metadata: Callable[[str, Any], Any],
    open_summary: Callable[[str, str | None], str | None],
) -> list[dict[str, Any]]:
    """Everything stored about the sessions ``ids``, as JSON-ready dicts.

    ``parse`` is the store's row decoder (a corrupt row raises, never is left
    out); ``open_metadata`` and ``open_summary`` open what a cipher sealed.
    """
    def decoded(table: Table, sid: str, *order: Any) -> list[dict[str, Any]]:
        query = select(table.c.id, table.c.message_json).where(table.c.session_id == sid)
        parse_row = parser_for(table, parse)
        return [parse_row(sid, row.id, row.message_json).model_dump(mode="json")
                for row in conn.execute(query.order_by(*order))]

    exported: list[dict[str, Any]] = []
    for chunk in _chunks(ids):
        query = select(*_SESSION_COLUMNS, _METADATA_TEXT).where(_sessions.c.session_id.in_(chunk))
        for row in conn.execute(query.order_by(_sessions.c.session_id)).mappings():
            sid = row["session_id"]
            exported.append({
                "session_id": sid,
                "user_id": row["user_id"],
                "active_agent_name": row["active_agent_name"],
                "metadata": open_metadata(sid, _metadata_of(sid, row["metadata_json"])),
                "created_at": _iso(row["created_at"]),
                "updated_at": _iso(row["updated_at"]),
                "summary": open_summary(sid, row["summary"]),
                "forked_from": row["forked_from"],
                "forked_at_turn": row["forked_at_turn"],
                "messages": decoded(  # system messages first (Role.SYSTEM), then by seq
                    _messages, sid, case((_messages.c.role == "system", 0), else_=1),
                    _messages.c.seq,
                ),
                "archived_messages": decoded(_archive, sid, _archive.c.seq, _archive.c.id),
                "webhook_claims": _claims_of(conn, sid),
            })
    return exported


def export_user_document(
    conn: Connection, user_id: str, sealer: Sealer, parse: Callable[..., Message]
) -> dict[str, Any]:
    """``export_user``'s document: the user's sessions and inbox messages, opened by ``sealer``.

    ``parse`` decodes a message row (the store's, or the CLI's lighter one).
    Raises ``CorruptRowError`` for a row that cannot be decoded or opened.
    """
    sessions = export_sessions(
        conn, user_session_ids(conn, user_id), sealer.parser(parse),
        sealer.open_metadata, sealer.open_summary,
    )
    return export_document(user_id, sessions, _inbox_of(conn, user_id, sealer))


def _inbox_of(conn: Connection, user_id: str, sealer: Sealer) -> list[ExportedInboxMessage]:
    """The inbox messages of ``user_id``'s sessions (those erasure deletes), in arrival order."""
    i = _inbox.c
    query = (
        select(i.id, i.message_id, i.session_id, i.state, i.text, i.payload, i.sent_at,
               i.received_at, i.updated_at, i.attempts, i.reply, i.error)
        .where(i.session_id.in_(owned_sessions(user_id).scalar_subquery()))
        .order_by(i.id)
    )
    found = []
    for row in conn.execute(query):
        sid, name = row.session_id, _inbox.name
        reply = None if row.reply is None else sealer.open_text(sid, row.id, row.reply, name)
        found.append(ExportedInboxMessage(
            row.message_id, sid, row.state, sealer.open_text(sid, row.id, row.text, name),
            sealer.open_json(sid, row.id, row.payload, name), row.sent_at, row.received_at,
            row.updated_at, row.attempts, reply, row.error,
        ))
    return found


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _claims_of(conn: Connection, session_id: str) -> list[dict[str, Any]]:
    c = _processed.c
    query = (
        select(c.message_id, c.state, c.processed_at, c.response)
        .where(c.session_id == session_id)
        .order_by(c.ticket, c.message_id)
    )
    rows = conn.execute(query).mappings()
    return [{**row, "processed_at": _iso(row["processed_at"])} for row in rows]
