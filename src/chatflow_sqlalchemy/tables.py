"""The chatflow tables in SQLAlchemy Core: the schema, declared once, without the ORM.

``models.py`` maps its classes onto these ``Table`` objects (and explains the columns).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Date,
    DateTime,
    Dialect,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Sequence,
    String,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects import mysql, postgresql
from sqlalchemy.types import TypeDecorator

from chatflow_sqlalchemy.values import CLAIM_DONE, SESSION_ID_MAX_LENGTH

__all__ = [
    "BACKEND_SHAPED", "CLAIM_TICKETS", "LEASE_OWNER_MAX_LENGTH", "NAMING_CONVENTION",
    "UTCDateTime", "inbox", "message_archive", "messages", "metadata", "processed_messages",
    "sessions",
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

    Dialects without zones store naive UTC (MySQL in ``DATETIME(6)``, so
    writes within one second keep their order).
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
        """On SQLite, one function (cheaper) for what ``process_bind_param`` and ``DATETIME`` do.

        It writes exactly SQLAlchemy's SQLite text, which tests compare value by value.
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


metadata = MetaData(naming_convention=NAMING_CONVENTION)
"""The chatflow tables (and the claim ticket sequence), with the constraint naming convention."""

_ID = SESSION_ID_MAX_LENGTH


def _session_ref() -> ForeignKey:
    return ForeignKey("chatflow_sessions.session_id", ondelete="CASCADE")


sessions = Table(
    "chatflow_sessions",
    metadata,
    Column("session_id", String(_ID), primary_key=True),
    Column("active_agent_name", String(_ID), nullable=False),
    Column("metadata_json", JSONDocument, nullable=False),
    Column("version", BigInteger, nullable=False, server_default="0"),
    Column("created_at", UTCDateTime, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
    Column("user_id", String(_ID), nullable=True),
    Column("lease_owner", String(LEASE_OWNER_MAX_LENGTH), nullable=True),
    Column("lease_fence", BigInteger, nullable=False, server_default="0"),
    Column("lease_expires_at", UTCDateTime, nullable=True),
    Column("summary", LongText, nullable=True),
    Column("summary_through", BigInteger, nullable=False, server_default="0"),
    Column("summary_claimed_until", UTCDateTime, nullable=True),
    Column("forked_from", String(_ID), nullable=True),
    Column("forked_at_turn", Integer, nullable=True),
    Index(None, "updated_at"),
    Index(None, "user_id"),
    Index(None, "forked_from"),
)

def _message_columns() -> list[Column[Any]]:
    """The columns of a message row, in the window and in the archive alike."""
    return [
        Column("id", MessageId, primary_key=True, autoincrement=True),
        Column("session_id", String(_ID), _session_ref(), nullable=False),
        Column("seq", BigInteger, nullable=False),
        Column("role", String(16), nullable=False),
        Column("content", LongText, nullable=True),
        Column("message_json", LongText, nullable=False),
        Column("created_at", UTCDateTime, nullable=False),
    ]


messages = Table(
    "chatflow_messages",
    metadata,
    *_message_columns(),
    UniqueConstraint("session_id", "seq"),
)

message_archive = Table(
    "chatflow_message_archive",
    metadata,
    *_message_columns(),
    Column("archived_at", UTCDateTime, nullable=False),
    Column("pending_summary", Boolean, nullable=False, server_default="0"),
    Index(None, "session_id", "seq"),
)

BACKEND_SHAPED = "chatflow_backend_shaped"
"""``Column.info`` key: the dialects whose migrations shape this column their own way
(on PostgreSQL ``partition_day`` is a NOT NULL partition key); schema checks skip it there."""

CLAIM_TICKETS = Sequence("chatflow_claim_ticket_seq", metadata=metadata)
"""Database-assigned claim order (FIFO per session) where the dialect has sequences."""

processed_messages = Table(
    "chatflow_processed_messages",
    metadata,
    Column("message_id", String(_ID), primary_key=True),
    Column("processed_at", UTCDateTime, nullable=False),
    Column("state", String(16), nullable=False, server_default=CLAIM_DONE),
    Column("token", String(32), nullable=True),
    Column("session_id", String(_ID), nullable=True),
    Column("ticket", BigInteger, nullable=True),
    Column("lease_expires_at", UTCDateTime, nullable=True),
    Column("claimed_at", UTCDateTime, nullable=True),
    Column("response", LongText, nullable=True),
    Column("partition_day", Date, nullable=True, info={BACKEND_SHAPED: ("postgresql",)}),
    Index(None, "processed_at"),
    Index(None, "session_id", "ticket"),
)

inbox = Table(
    "chatflow_inbox",
    metadata,
    Column("id", MessageId, primary_key=True, autoincrement=True),
    Column("message_id", String(_ID), nullable=False, unique=True),
    Column("session_id", String(_ID), nullable=False),
    Column("text", LongText, nullable=False),
    Column("payload", JSONDocument, nullable=True),
    Column("sent_at", UTCDateTime, nullable=True),
    Column("received_at", UTCDateTime, nullable=False),
    Column("state", String(16), nullable=False),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("not_before", UTCDateTime, nullable=True),
    Column("batch_token", String(LEASE_OWNER_MAX_LENGTH), nullable=True),
    Column("answered_at", UTCDateTime, nullable=True),
    Column("reply", LongText, nullable=True),
    Column("error", LongText, nullable=True),
    Column("updated_at", UTCDateTime, nullable=False),
    Index(None, "session_id", "state"),
    Index(None, "state", "updated_at"),
    Index(None, "batch_token"),
)
