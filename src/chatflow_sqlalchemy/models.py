"""SQLAlchemy 2.x models of the chatflow tables.

The table and column names mirror what ``chatflow_agent.SQLiteSessionStore``
creates, so a database written by upstream can be adopted in place (see
``migrate.py``). The columns added on top of upstream's are there for
correctness, each explained on its model.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import date, datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Date,
    DateTime,
    Dialect,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Sequence,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects import mysql, postgresql
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

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

LEASE_OWNER_MAX_LENGTH = 64
"""Room for a lease holder's token (a random hex string)."""

NAMING_CONVENTION: dict[str, str] = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}



class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is always timezone-aware UTC in Python.

    PostgreSQL stores ``timestamptz``; SQLite has no time zones, so values are
    stored as naive UTC text and given back their UTC zone on load. MySQL and
    MariaDB store naive UTC in ``DATETIME(6)`` (microseconds, so that
    ``list_sessions`` orders writes made within one second).
    """

    impl = DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
    cache_ok = True
    zone_aware_dialects = frozenset({"postgresql", "oracle", "mssql"})
    """Dialects whose timestamp type stores the zone; others get naive UTC."""

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        """Normalise to UTC; naive values are rejected to avoid silent local-time bugs."""
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("UTCDateTime needs a timezone-aware datetime (use utcnow())")
        value = value.astimezone(timezone.utc)
        if dialect.name in self.zone_aware_dialects:
            return value
        return value.replace(tzinfo=None)

    def bind_processor(self, dialect: Dialect) -> Callable[[Any], Any] | None:
        """On SQLite, one function for what ``process_bind_param`` and ``DATETIME`` do in turn.

        Every turn binds several timestamps, and the composed pair costs more
        per value. It writes exactly SQLAlchemy's SQLite text
        (``YYYY-MM-DD HH:MM:SS.ffffff``), which tests compare value by value.
        """
        if dialect.name == "sqlite":
            return _sqlite_utc_text
        return super().bind_processor(dialect)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        """Attach UTC to the naive values SQLite gives back."""
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value


def _sqlite_utc_text(value: datetime | None) -> str | None:
    if value is None:
        return None
    if value.tzinfo is None:
        raise ValueError("UTCDateTime needs a timezone-aware datetime (use utcnow())")
    if value.tzinfo is not timezone.utc:
        value = value.astimezone(timezone.utc)
    text = value.isoformat(" ")[:-6]  # without its "+00:00"
    return text if value.microsecond else f"{text}.000000"  # isoformat drops zero micros


JSONDocument = JSON().with_variant(postgresql.JSONB(), "postgresql")
"""Portable JSON: JSONB on PostgreSQL (indexable, compact), JSON text elsewhere."""

MessageId = BigInteger().with_variant(Integer(), "sqlite")
"""BIGINT primary key, but INTEGER on SQLite so that it stays the rowid alias."""

LongText = Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")
"""Unbounded text; MySQL's ``TEXT`` stops at 64 KiB, so it gets ``LONGTEXT``."""


class Base(DeclarativeBase):
    """Declarative base carrying the constraint naming convention."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


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

    __tablename__ = "chatflow_sessions"

    session_id: Mapped[str] = mapped_column(String(SESSION_ID_MAX_LENGTH), primary_key=True)
    active_agent_name: Mapped[str] = mapped_column(String(SESSION_ID_MAX_LENGTH))
    metadata_json: Mapped[dict[str, Any]] = mapped_column(JSONDocument)
    version: Mapped[int] = mapped_column(BigInteger, server_default="0")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    user_id: Mapped[str | None] = mapped_column(String(SESSION_ID_MAX_LENGTH), nullable=True)
    lease_owner: Mapped[str | None] = mapped_column(String(LEASE_OWNER_MAX_LENGTH), nullable=True)
    lease_fence: Mapped[int] = mapped_column(BigInteger, server_default="0")
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    summary: Mapped[str | None] = mapped_column(LongText, nullable=True)
    summary_through: Mapped[int] = mapped_column(BigInteger, server_default="0")
    summary_claimed_until: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    forked_from: Mapped[str | None] = mapped_column(
        String(SESSION_ID_MAX_LENGTH), nullable=True
    )
    forked_at_turn: Mapped[int | None] = mapped_column(Integer, nullable=True)

    __table_args__ = (
        Index(None, "updated_at"), Index(None, "user_id"), Index(None, "forked_from")
    )


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

    __tablename__ = "chatflow_messages"

    id: Mapped[int] = mapped_column(MessageId, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(
        String(SESSION_ID_MAX_LENGTH),
        ForeignKey("chatflow_sessions.session_id", ondelete="CASCADE"),
    )
    seq: Mapped[int] = mapped_column(BigInteger)
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[str | None] = mapped_column(LongText, nullable=True)
    message_json: Mapped[str] = mapped_column(LongText)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)

    __table_args__ = (UniqueConstraint("session_id", "seq"),)


class ChatflowMessageArchive(Base):
    """A message pruning dropped from a window, kept for ``store.transcript`` (revision 0005).

    Written only by stores opened with ``archive_pruned=True``, in the prune's
    transaction. ``seq`` orders the transcript; ``(session_id, seq)`` is not
    unique (a row restored by a rollback and pruned again is archived again;
    the transcript keeps one copy per ``seq``).
    """

    __tablename__ = "chatflow_message_archive"

    id: Mapped[int] = mapped_column(MessageId, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(
        String(SESSION_ID_MAX_LENGTH),
        ForeignKey("chatflow_sessions.session_id", ondelete="CASCADE"),
    )
    seq: Mapped[int] = mapped_column(BigInteger)
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[str | None] = mapped_column(LongText, nullable=True)
    message_json: Mapped[str] = mapped_column(LongText)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    archived_at: Mapped[datetime] = mapped_column(UTCDateTime)
    pending_summary: Mapped[bool] = mapped_column(Boolean, server_default="0")
    """Pruned and not yet folded into the session's summary (revision 0010)."""

    __table_args__ = (Index(None, "session_id", "seq"),)


BACKEND_SHAPED = "chatflow_backend_shaped"
"""``Column.info`` key: the dialects whose migrations shape this column their own way
(on PostgreSQL ``partition_day`` is a NOT NULL partition key); schema checks skip it there."""


CLAIM_TICKETS = Sequence("chatflow_claim_ticket_seq", metadata=metadata)
"""Database-assigned claim order (FIFO per session) where the dialect has sequences."""


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

    __tablename__ = "chatflow_processed_messages"

    message_id: Mapped[str] = mapped_column(String(SESSION_ID_MAX_LENGTH), primary_key=True)
    processed_at: Mapped[datetime] = mapped_column(UTCDateTime)
    state: Mapped[str] = mapped_column(String(16), server_default=CLAIM_DONE)
    token: Mapped[str | None] = mapped_column(String(32), nullable=True)
    session_id: Mapped[str | None] = mapped_column(
        String(SESSION_ID_MAX_LENGTH), nullable=True
    )
    ticket: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    claimed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    response: Mapped[str | None] = mapped_column(LongText, nullable=True)
    partition_day: Mapped[date | None] = mapped_column(
        Date, nullable=True, info={BACKEND_SHAPED: ("postgresql",)}
    )

    __table_args__ = (Index(None, "processed_at"), Index(None, "session_id", "ticket"))


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

    __tablename__ = "chatflow_inbox"

    id: Mapped[int] = mapped_column(MessageId, primary_key=True, autoincrement=True)
    message_id: Mapped[str] = mapped_column(String(SESSION_ID_MAX_LENGTH), unique=True)
    session_id: Mapped[str] = mapped_column(String(SESSION_ID_MAX_LENGTH))
    text: Mapped[str] = mapped_column(LongText)
    payload: Mapped[Any | None] = mapped_column(JSONDocument, nullable=True)
    sent_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    received_at: Mapped[datetime] = mapped_column(UTCDateTime)
    state: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    not_before: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    batch_token: Mapped[str | None] = mapped_column(
        String(LEASE_OWNER_MAX_LENGTH), nullable=True
    )
    answered_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    reply: Mapped[str | None] = mapped_column(LongText, nullable=True)
    error: Mapped[str | None] = mapped_column(LongText, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)

    __table_args__ = (
        Index(None, "session_id", "state"),
        Index(None, "state", "updated_at"),
        Index(None, "batch_token"),
    )
