"""SQLAlchemy 2.x ORM models of the chatflow tables.

Each model maps one ``Table`` of :mod:`chatflow_sqlalchemy.tables`, where the
schema is declared (once, in Core: the CLI's read commands use it without the
ORM). The table and column names mirror what ``chatflow_agent.SQLiteSessionStore``
creates, so a database written by upstream can be adopted in place (see
``migrate.py``). The columns added on top of upstream's are there for
correctness, each explained on its model.
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
    "BACKEND_SHAPED",
    "CLAIM_ACQUIRED",
    "CLAIM_DONE",
    "CLAIM_RELEASED",
    "CLAIM_TICKETS",
    "LEASE_OWNER_MAX_LENGTH",
    "NAMING_CONVENTION",
    "SESSION_ID_MAX_LENGTH",
    "Base",
    "ChatflowInboxItem",
    "ChatflowMessage",
    "ChatflowMessageArchive",
    "ChatflowProcessedMessage",
    "ChatflowSession",
    "UTCDateTime",
    "metadata",
    "utcnow",
]


class Base(DeclarativeBase):
    """Declarative base carrying the constraint naming convention."""

    metadata = tables.metadata


metadata = Base.metadata


class ChatflowSession(Base):
    """One conversation: its active agent, metadata and a version counter.

    ``version`` is not in upstream's schema. It is bumped by every write to the
    session (history, active agent, metadata) in the same transaction, so a
    context can tell in one indexed read whether another process changed the
    session since it loaded it, and writers can detect concurrent changes
    instead of silently merging them.

    ``user_id`` (revision 0004) records whose session it is, for
    ``list_sessions(user_id=...)``, ``erase_user`` and ``export_user``.

    ``lease_*`` (revision 0008) are the turn's lease (see
    :mod:`chatflow_sqlalchemy.lease`): who holds the session for a turn
    (``lease_owner``, None when free), until when by the database's clock
    (``lease_expires_at``), and a counter bumped by every take
    (``lease_fence``), so a holder that lost the lease cannot write.

    ``summary*`` (revision 0010): the summary of the turns pruning dropped,
    the highest ``seq`` folded into it, and until when a worker is writing the
    next one (see :mod:`chatflow_sqlalchemy.summaries`). ``forked_from`` and
    ``forked_at_turn``: where a fork was copied from (``store.fork``).
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
    """One message of a session's history window, serialised as pydantic JSON.

    ``seq`` is not in upstream's schema: a per-session, monotonically growing
    position. It orders the history independently of the global id, lets the
    store delete exactly the rows pruning dropped (``seq IN (...)``) and
    restore rows on rollback, and ``(session_id, seq)`` is unique so two
    writers can never interleave a message into the same slot.
    ``message_json`` stays text: it is an opaque pydantic document that is
    only ever decoded whole, and text avoids a JSON round trip on the hot path.
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
    """A message pruning dropped from a window, kept for ``store.transcript`` (revision 0005).

    Written only by stores opened with ``archive_pruned=True``, in the prune's
    transaction. ``seq`` orders the transcript; ``(session_id, seq)`` is not
    unique (a row restored by a rollback and pruned again is archived again;
    the transcript keeps one copy per ``seq``).
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
    """Pruned and not yet folded into the session's summary (revision 0010)."""



class ChatflowProcessedMessage(Base):
    """An inbound webhook message id already claimed, for idempotent processing.

    The primary key makes the claim one atomic ``INSERT ... ON CONFLICT``; the
    index on ``processed_at`` keeps the TTL purge a range scan.

    The columns after ``processed_at`` (revision 0003) serve ``store.claim``
    (:mod:`chatflow_sqlalchemy.claims`): ``state`` is ``done`` for every id
    recorded the 0.3.4 way, so those stay claimed; ``token`` fences a lease
    holder (a takeover draws a new one); ``ticket`` orders the claims of one
    ``session_id`` (assigned by the database on first insert, kept on
    takeover); ``response`` is the stored reply replayed to later deliveries.
    ``processed_at`` stays the TTL anchor: it moves with every state change.

    ``partition_day`` (revision 0006) is the partition key on PostgreSQL, where
    the table is partitioned by day and its primary key is ``(message_id,
    partition_day)`` (:mod:`chatflow_sqlalchemy.backends.postgresql_claims`);
    elsewhere it stays NULL.
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
    """An inbound message in the durable inbox (revision 0009), kept until sent and past dedup.

    ``store.inbox.put`` inserts it ``pending``; a worker of ``inbox.serve``
    holding its session's lease takes the session's pending items as one
    batch (``in_flight``, ``batch_token`` set, ``attempts`` bumped). The
    batch's turn records the reply and ``answered_at`` in its own
    transaction; then the items become ``done`` (no ``send``) or ``sent``.
    A failed batch goes back to ``pending`` until ``not_before``, or ends
    ``dead`` with its ``error`` (:mod:`chatflow_sqlalchemy.inbox`).

    ``id`` is the arrival order; ``received_at`` and ``not_before`` are the
    database's clock. ``text`` and ``reply`` are sealed on a store with a
    cipher, like message content.
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

