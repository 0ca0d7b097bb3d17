"""A session's rows: the statements that read and write them, and their codecs.

The SQL of the session and message tables, written once against SQLAlchemy
Core (a dialect adds only what :class:`~chatflow_sqlalchemy.dialect.DialectSupport`
builds), and the conversion between rows and :class:`chatflow_agent.Message`.
"""

from __future__ import annotations

import json
import secrets
from datetime import datetime
from typing import Any

from chatflow_agent import Message, Role
from pydantic import ValidationError
from pydantic_core import PydanticSerializationError
from sqlalchemy import (
    Connection,
    bindparam,
    case,
    delete,
    func,
    insert,
    select,
    update,
)

from chatflow_sqlalchemy import tables
from chatflow_sqlalchemy.context import StoredSession, dump_message
from chatflow_sqlalchemy.crypto import is_encrypted
from chatflow_sqlalchemy.exceptions import CorruptRowError
from chatflow_sqlalchemy.sealing import Sealer
from chatflow_sqlalchemy.sql_lifecycle import invalid_metadata

__all__ = [
    "BUMP_SESSION",
    "DELETE_ALL_MESSAGES",
    "DELETE_SOME_MESSAGES",
    "INSERT_MESSAGES",
    "IS_PROCESSED",
    "SELECT_VERSION",
    "StoredSession",
    "first_version",
    "message_row",
    "messages",
    "parse_message",
    "processed",
    "read_session",
    "sessions",
]

FIRST_VERSION_BITS = 52
"""New sessions start at a random version below 2**52 (still exact as a float in JSON)."""

sessions = tables.sessions
messages = tables.messages
processed = tables.processed_messages
_archive = tables.message_archive

SELECT_VERSION = select(sessions.c.version).where(sessions.c.session_id == bindparam("session_id"))
_SELECT_SESSION = select(
    sessions.c.version,
    sessions.c.active_agent_name,
    sessions.c.metadata_json,
    sessions.c.created_at,
    sessions.c.updated_at,
    sessions.c.summary,
    sessions.c.summary_through,
    sessions.c.forked_from,
    sessions.c.forked_at_turn,
    select(func.max(_archive.c.seq))
    .where(_archive.c.session_id == sessions.c.session_id)
    .scalar_subquery()
    .label("archived_through"),
).where(sessions.c.session_id == bindparam("session_id"))
_SELECT_MESSAGES = (
    select(messages.c.id, messages.c.seq, messages.c.message_json)
    .where(messages.c.session_id == bindparam("session_id"))
    .order_by(case((messages.c.role == Role.SYSTEM.value, 0), else_=1), messages.c.seq)
)
INSERT_MESSAGES = insert(messages)
DELETE_ALL_MESSAGES = delete(messages).where(messages.c.session_id == bindparam("session_id"))
DELETE_SOME_MESSAGES = DELETE_ALL_MESSAGES.where(
    messages.c.seq.in_(bindparam("seqs", expanding=True))
)
BUMP_SESSION = (
    update(sessions)
    .where(
        sessions.c.session_id == bindparam("sid"),
        sessions.c.version == bindparam("expected"),
    )
    .values(
        version=bindparam("new_version"),
        active_agent_name=bindparam("agent_name"),
        updated_at=bindparam("now"),
    )
)
"""The compare-and-swap of a session row: rowcount 1 only at the version the writer knows."""
IS_PROCESSED = select(processed.c.message_id).where(
    processed.c.message_id == bindparam("message_id"),
    processed.c.processed_at >= bindparam("cutoff"),
)


def read_session(conn: Connection, sealer: Sealer, session_id: str) -> StoredSession | None:
    """The session's row and window in ``conn``'s snapshot; None if there is no such session.

    Raises:
        CorruptRowError: A row cannot be decoded (it names the table and row).

    """
    try:  # SQLite keeps metadata as text, which a hand edit or a damaged file can leave invalid
        row = conn.execute(_SELECT_SESSION, {"session_id": session_id}).first()
    except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
        raise invalid_metadata(session_id, exc) from exc
    if row is None:
        return None
    metadata = sealer.open_metadata(session_id, row.metadata_json)
    if not isinstance(metadata, dict):
        kind = type(metadata).__name__
        raise CorruptRowError(
            session_id, None, f"metadata_json is not a JSON object (found {kind})",
            table="chatflow_sessions",
        )
    window: list[Message] = []
    seqs: list[int] = []
    opens = sealer.active or sealer.require
    for msg_row in conn.execute(_SELECT_MESSAGES, {"session_id": session_id}):
        text = msg_row.message_json
        if opens or is_encrypted(text):
            text = sealer.open_text(session_id, msg_row.id, text, "chatflow_messages")
        window.append(parse_message(session_id, msg_row.id, text))
        seqs.append(msg_row.seq)
    summary = row.summary
    if summary is not None and (opens or is_encrypted(summary)):
        summary = sealer.open_text(session_id, None, summary, "chatflow_sessions")
    return StoredSession(
        row.version, row.active_agent_name, metadata, window, seqs, row.created_at,
        row.updated_at, summary, int(row.summary_through or 0), row.forked_from,
        row.forked_at_turn, int(row.archived_through or 0),
    )


def message_row(
    sealer: Sealer, session_id: str, seq: int, message: Message, now: datetime
) -> dict[str, Any]:
    """``message``'s ``chatflow_messages`` row at ``seq`` (sealed if the store encrypts).

    ``content`` is a readable copy of ``message_json``'s content. PostgreSQL text
    cannot hold NUL, so NUL becomes U+FFFD in it (on every backend, alike); the
    message is read back from ``message_json``, where JSON escapes it, so it
    round-trips exactly. A message that cannot be stored raises ``ValueError``.
    """
    try:
        text = dump_message(message)
    except PydanticSerializationError as exc:
        raise ValueError(
            f"a {message.role.value} message of session {session_id!r} cannot be stored: "
            f"{exc}. Tool results and arguments must be JSON-serialisable and nested at "
            "most 250 levels deep; flatten or stringify the value (the turn was not stored)"
        ) from None
    content = None if sealer.active else message.content
    if content is not None and "\x00" in content:
        content = content.replace("\x00", "\ufffd")
    return {
        "session_id": session_id,
        "seq": seq,
        "role": message.role.value,
        "content": content,
        "message_json": sealer.seal_text(session_id, text),
        "created_at": now,
    }


def parse_message(session_id: str, row_id: object, text: str) -> Message:
    """A message from its row's JSON, or :class:`CorruptRowError` naming the row.

    pydantic writes JSON nested deeper than its own parser reads back (a tool
    result ~200 levels deep): such a row is valid, and read with the stdlib's parser.
    """
    try:
        return Message.model_validate_json(text)
    except ValidationError as exc:
        if not _too_deep_for_pydantic_json(exc):
            raise CorruptRowError(session_id, row_id, str(exc).splitlines()[0]) from exc
    except (ValueError, TypeError) as exc:
        raise CorruptRowError(session_id, row_id, str(exc).splitlines()[0]) from exc
    try:
        return Message.model_validate(json.loads(text))
    except (ValidationError, ValueError, TypeError, RecursionError) as exc:
        raise CorruptRowError(session_id, row_id, str(exc).splitlines()[0]) from exc


def _too_deep_for_pydantic_json(exc: ValidationError) -> bool:
    """True if pydantic's JSON parser gave up on nesting depth, not on the content."""
    errors = exc.errors()
    return (
        len(errors) == 1
        and errors[0]["type"] == "json_invalid"
        and "recursion limit" in str(errors[0].get("ctx", {}).get("error", ""))
    )


def first_version() -> int:
    """A random starting version for a new session row.

    Contexts trust a session whose version equals the one they know. Were
    every session to start at 0, one deleted and re-created elsewhere would,
    after as many writes, show a cached context the version it expects
    (ABA) and be taken for the old one.
    """
    return secrets.randbits(FIRST_VERSION_BITS)
