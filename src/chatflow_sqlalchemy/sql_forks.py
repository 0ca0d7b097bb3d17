"""Forks on the SQL stores: a session's rows copied to a new id, in the caller's transaction.

The source row is locked while read, so one committed state is copied; messages
are sealed again under the new id (a token names its session).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Connection, bindparam, insert, select

from chatflow_sqlalchemy import tables
from chatflow_sqlalchemy.context import repair_window
from chatflow_sqlalchemy.crypto import is_encrypted
from chatflow_sqlalchemy.forks import ForkedWindow, fork_window, no_such_session, session_exists
from chatflow_sqlalchemy.rows import (
    INSERT_MESSAGES,
    first_version,
    message_row,
    read_session,
    sessions,
)
from chatflow_sqlalchemy.sealing import Sealer
from chatflow_sqlalchemy.values import UNBORN_AGENT, utcnow

__all__ = ["copy_session"]

_LOCK_SOURCE = (
    select(sessions.c.user_id, sessions.c.active_agent_name)
    .where(sessions.c.session_id == bindparam("session_id"))
    .with_for_update()
)
_EXISTS = select(sessions.c.session_id).where(sessions.c.session_id == bindparam("session_id"))
_INSERT_SESSION = insert(sessions)
_archive = tables.message_archive
_WAITING = select(
    _archive.c.id, _archive.c.seq, _archive.c.role, _archive.c.content,
    _archive.c.message_json, _archive.c.created_at,
).where(
    _archive.c.session_id == bindparam("session_id"),
    _archive.c.pending_summary,
    _archive.c.seq > bindparam("through"),
)


def copy_session(
    conn: Connection, sealer: Sealer, session_id: str, new_session_id: str, at_turn: int | None
) -> ForkedWindow:
    """Insert the fork ``new_session_id`` of ``session_id`` (in the caller's transaction).

    Raises:
        ValueError: No such source (or one the inbox created before its first
            turn), ``new_session_id`` exists, or ``at_turn`` is more than the
            source's turns.
        CorruptRowError: A row of the source cannot be decoded (or opened).

    """
    source = conn.execute(_LOCK_SOURCE, {"session_id": session_id}).first()
    if source is None or source.active_agent_name == UNBORN_AGENT:
        raise no_such_session(session_id)
    stored = read_session(conn, sealer, session_id)
    assert stored is not None  # its row is locked
    if conn.execute(_EXISTS, {"session_id": new_session_id}).first() is not None:
        raise session_exists(new_session_id)
    window, seqs, _hidden = repair_window(stored.messages, stored.seqs)
    forked = fork_window(session_id, window, seqs, at_turn)
    now = utcnow()
    summary = stored.summary  # the source's agent, metadata, owner and summary
    conn.execute(_INSERT_SESSION, {
        "session_id": new_session_id,
        "active_agent_name": stored.agent_name,
        "metadata_json": sealer.seal_metadata(new_session_id, stored.metadata),
        "version": first_version(),
        "created_at": now,
        "updated_at": now,
        "user_id": source.user_id,
        "summary": None if summary is None else sealer.seal_text(new_session_id, summary),
        "summary_through": stored.summary_through,
        "forked_from": session_id,
        "forked_at_turn": forked.turns,
    })
    if forked.messages:
        conn.execute(INSERT_MESSAGES, [
            message_row(sealer, new_session_id, seq, message, now)
            for seq, message in zip(forked.seqs, forked.messages, strict=True)
        ])
    _copy_waiting(conn, sealer, stored.summary_through, session_id, new_session_id, now)
    return forked


def _copy_waiting(
    conn: Connection,
    sealer: Sealer,
    through: int,
    session_id: str,
    new_session_id: str,
    now: datetime,
) -> None:
    """Pruned messages still waiting for the source's summary wait for the fork's too."""
    rows = conn.execute(_WAITING, {"session_id": session_id, "through": through}).all()
    copies = []
    for row in rows:
        text = row.message_json
        if sealer.active or is_encrypted(text):
            text = sealer.open_text(session_id, row.id, text, _archive.name)
        copies.append({
            "session_id": new_session_id, "seq": row.seq, "role": row.role,
            "content": row.content, "message_json": sealer.seal_text(new_session_id, text),
            "created_at": row.created_at, "archived_at": now, "pending_summary": True,
        })
    if copies:
        conn.execute(insert(_archive), copies)

