"""per-user scope: ``chatflow_sessions.user_id``, indexed

``store.get_or_create(..., user_id=...)`` records whose session it is, so that
``list_sessions(user_id=...)``, ``erase_user`` and ``export_user`` find a
user's sessions through an index instead of scanning metadata. The column is
nullable: sessions created before this revision (or without a user) have none.
SQLite runs in batch mode (the column is added in place; the downgrade
rebuilds the table); PostgreSQL and MySQL/MariaDB alter in place, and on
MySQL/MariaDB the column takes the table's binary collation, like the ids.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TABLE = "chatflow_sessions"
_INDEX = "ix_chatflow_sessions_user_id"


def upgrade() -> None:
    with op.batch_alter_table(_TABLE) as batch:
        batch.add_column(sa.Column("user_id", sa.String(255), nullable=True))
    op.create_index(_INDEX, _TABLE, ["user_id"])


def downgrade() -> None:
    op.drop_index(_INDEX, _TABLE)
    with op.batch_alter_table(_TABLE) as batch:
        batch.drop_column("user_id")
