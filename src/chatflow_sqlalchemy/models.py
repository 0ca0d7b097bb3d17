"""SQLAlchemy 2.x ORM models, each mapping one ``Table`` of :mod:`chatflow_sqlalchemy.tables`.

Names mirror ``chatflow_agent.SQLiteSessionStore``'s, so an upstream database
is adopted in place; each model explains the columns added on top.
"""

from __future__ import annotations

from datetime import date, datetime
from typing import Any

from sqlalchemy.orm import DeclarativeBase, Mapped

from chatflow_sqlalchemy import tables
from chatflow_sqlalchemy.tables import (
    BACKEND_SHAPED,
    CLAIM_TICKETS,
    LEASE_OWNER_MAX_LENGTH,
    NAMING_CONVENTION,
    UTCDateTime,
)
from chatflow_sqlalchemy.values import (
    CLAIM_ACQUIRED,
    CLAIM_DONE,
    CLAIM_RELEASED,
    SESSION_ID_MAX_LENGTH,
    utcnow,
)

__all__ = [
    "BACKEND_SHAPED", "CLAIM_ACQUIRED", "CLAIM_DONE", "CLAIM_RELEASED", "CLAIM_TICKETS",
    "LEASE_OWNER_MAX_LENGTH", "NAMING_CONVENTION", "SESSION_ID_MAX_LENGTH", "Base",
    "ChatflowInboxItem", "ChatflowMessage", "ChatflowMessageArchive", "ChatflowProcessedMessage",
    "ChatflowSession", "UTCDateTime", "metadata", "utcnow",
]


class Base(DeclarativeBase):
    """Declarative base carrying the constraint naming convention."""

    metadata = tables.metadata


metadata = Base.metadata


class ChatflowSession(Base):
    """One conversation: its active agent, metadata and a version counter.

    ``version`` is bumped by every write, so one indexed read tells whether
    another process changed the session, and concurrent writers are detected,
    not merged. ``user_id`` is the owner; ``lease_*`` the turn's lease
    (:mod:`chatflow_sqlalchemy.lease`; ``lease_fence`` stops a holder that lost
    it); ``summary*`` the summary of what pruning dropped; ``forked_*`` a fork's origin.
    """

    __table__ = tables.sessions

    session_id: Mapped[str]
    active_agent_name: Mapped[str]
    metadata_json: Mapped[dict[str, Any]]
    version: Mapped[int]
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    user_id: Mapped[str | None]
    lease_owner: Mapped[str | None]
    lease_fence: Mapped[int]
    lease_expires_at: Mapped[datetime | None]
    summary: Mapped[str | None]
    summary_through: Mapped[int]
    summary_claimed_until: Mapped[datetime | None]
    forked_from: Mapped[str | None]
    forked_at_turn: Mapped[int | None]


class ChatflowMessage(Base):
    """One message of a session's history window, serialised as pydantic JSON (text).

    ``seq``, a per-session growing position unique with ``session_id``, orders
    the history and names exactly the rows a prune or rollback touches.
    """

    __table__ = tables.messages

    id: Mapped[int]
    session_id: Mapped[str]
    seq: Mapped[int]
    role: Mapped[str]
    content: Mapped[str | None]
    message_json: Mapped[str]
    created_at: Mapped[datetime]


class ChatflowMessageArchive(Base):
    """A message pruning dropped, kept for ``store.transcript`` or the summary.

    ``(session_id, seq)`` is not unique: a row restored by a rollback and pruned
    again is archived again (the transcript keeps one per ``seq``).
    """

    __table__ = tables.message_archive

    id: Mapped[int]
    session_id: Mapped[str]
    seq: Mapped[int]
    role: Mapped[str]
    content: Mapped[str | None]
    message_json: Mapped[str]
    created_at: Mapped[datetime]
    archived_at: Mapped[datetime]
    pending_summary: Mapped[bool]
    """Pruned and not yet folded into the session's summary."""


class ChatflowProcessedMessage(Base):
    """An inbound webhook message id already claimed (one atomic upsert), for idempotence.

    ``processed_at`` is the TTL anchor. The claim columns serve ``store.claim``:
    ``token`` fences a lease holder, ``ticket`` orders a session's claims,
    ``response`` is replayed to later deliveries. ``partition_day`` is
    PostgreSQL's day-partition key (NULL elsewhere).
    """

    __table__ = tables.processed_messages

    message_id: Mapped[str]
    processed_at: Mapped[datetime]
    state: Mapped[str]
    token: Mapped[str | None]
    session_id: Mapped[str | None]
    ticket: Mapped[int | None]
    lease_expires_at: Mapped[datetime | None]
    claimed_at: Mapped[datetime | None]
    response: Mapped[str | None]
    partition_day: Mapped[date | None]


class ChatflowInboxItem(Base):
    """An inbound message in the durable inbox (:mod:`chatflow_sqlalchemy.inbox`).

    ``pending`` → ``in_flight`` (one batch per session, ``batch_token``) →
    ``done``/``sent``, or back to ``pending`` until ``not_before``, or ``dead``.
    ``id`` is the arrival order; ``text`` and ``reply`` are sealed with a cipher.
    """

    __table__ = tables.inbox

    id: Mapped[int]
    message_id: Mapped[str]
    session_id: Mapped[str]
    text: Mapped[str]
    payload: Mapped[Any | None]
    sent_at: Mapped[datetime | None]
    received_at: Mapped[datetime]
    state: Mapped[str]
    attempts: Mapped[int]
    not_before: Mapped[datetime | None]
    batch_token: Mapped[str | None]
    answered_at: Mapped[datetime | None]
    reply: Mapped[str | None]
    error: Mapped[str | None]
    updated_at: Mapped[datetime]

