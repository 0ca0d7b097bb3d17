"""webhook claims: leased, fenced, ordered dedup rows with a stored reply

``chatflow_processed_messages`` gains what ``store.claim`` needs:

* ``state`` (``acquired`` / ``done`` / ``released``), NOT NULL with the server
  default ``done``: every id recorded before this revision (and every id
  ``record_processed_message`` records) stays claimed;
* ``token`` (the lease holder's fencing token), ``lease_expires_at`` and
  ``claimed_at``;
* ``session_id`` and ``ticket`` (claim order per session, indexed together);
* ``response`` (the reply replayed to later deliveries).

The ticket comes from the sequence ``chatflow_claim_ticket_seq`` on
PostgreSQL and MariaDB (MySQL has none: it and SQLite assign ``MAX + 1``
under their write lock). SQLite runs in batch mode (columns are added in
place; the downgrade rebuilds the table).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TABLE = "chatflow_processed_messages"
_INDEX = "ix_chatflow_processed_messages_session_id_ticket"
_SEQUENCE = "chatflow_claim_ticket_seq"
_MYSQL = ("mysql", "mariadb")
_TS = sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), *_MYSQL)
_BODY = sa.Text().with_variant(mysql.LONGTEXT(), *_MYSQL)


def _has_sequences() -> bool:
    dialect = op.get_bind().dialect
    return bool(getattr(dialect, "supports_sequences", False))


def upgrade() -> None:
    if _has_sequences():
        op.execute(sa.schema.CreateSequence(sa.Sequence(_SEQUENCE)))
    with op.batch_alter_table(_TABLE) as batch:
        batch.add_column(sa.Column("state", sa.String(16), nullable=False, server_default="done"))
        batch.add_column(sa.Column("token", sa.String(32), nullable=True))
        batch.add_column(sa.Column("session_id", sa.String(255), nullable=True))
        batch.add_column(sa.Column("ticket", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("lease_expires_at", _TS, nullable=True))
        batch.add_column(sa.Column("claimed_at", _TS, nullable=True))
        batch.add_column(sa.Column("response", _BODY, nullable=True))
    op.create_index(_INDEX, _TABLE, ["session_id", "ticket"])


def downgrade() -> None:
    # Revision 0002 reads any row as "processed forever": a released or still-acquired
    # claim never committed its turn, so drop it and its next delivery does the work.
    op.execute(sa.text(f"DELETE FROM {_TABLE} WHERE state <> 'done'"))
    op.drop_index(_INDEX, _TABLE)
    with op.batch_alter_table(_TABLE) as batch:
        for column in (
            "response", "claimed_at", "lease_expires_at", "ticket", "session_id", "token", "state"
        ):
            batch.drop_column(column)
    if _has_sequences():
        op.execute(sa.schema.DropSequence(sa.Sequence(_SEQUENCE)))
