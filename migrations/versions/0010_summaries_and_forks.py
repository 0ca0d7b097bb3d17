"""summaries, rewind and forks: what a session remembers past its window, and where it came from

``chatflow_sessions`` gains

* ``summary``: the summary of the turns pruning dropped (text; sealed like
  metadata on an encrypting store), NULL before the first one;
* ``summary_through``: the highest message ``seq`` folded into it, NOT NULL
  with the server default ``0``; a summary is applied only over the one it
  was written from, so concurrent workers never lose one or fold a turn twice;
* ``summary_claimed_until``: until when one worker summarizes the session, by
  the database's clock (NULL while no one does);
* ``forked_from`` and ``forked_at_turn``: the session a fork was copied from,
  and how many of its turns it took (NULL for a session that is not a fork),
  indexed for ``list_sessions(forked_from=...)``.

``chatflow_message_archive`` gains ``pending_summary`` (NOT NULL, server
default false): a pruned message not yet folded into the session's summary.
Every row existing before this revision is not pending.

SQLite runs in batch mode (columns added in place; the downgrade rebuilds the
tables); PostgreSQL and MySQL/MariaDB alter in place, and on MySQL/MariaDB
``forked_from`` takes the table's binary collation, like the ids. The
downgrade drops the columns: summaries and fork origins are forgotten.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SESSIONS = "chatflow_sessions"
_ARCHIVE = "chatflow_message_archive"
_MYSQL = ("mysql", "mariadb")
_TS = sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), *_MYSQL)
_BODY = sa.Text().with_variant(mysql.LONGTEXT(), *_MYSQL)
_ID_LENGTH = 255
_FORKS_INDEX = "ix_chatflow_sessions_forked_from"


def upgrade() -> None:
    with op.batch_alter_table(_SESSIONS) as batch:
        batch.add_column(sa.Column("summary", _BODY, nullable=True))
        batch.add_column(
            sa.Column("summary_through", sa.BigInteger(), nullable=False, server_default="0")
        )
        batch.add_column(sa.Column("summary_claimed_until", _TS, nullable=True))
        batch.add_column(sa.Column("forked_from", sa.String(_ID_LENGTH), nullable=True))
        batch.add_column(sa.Column("forked_at_turn", sa.Integer(), nullable=True))
        batch.create_index(_FORKS_INDEX, ["forked_from"])
    with op.batch_alter_table(_ARCHIVE) as batch:
        batch.add_column(
            sa.Column(
                "pending_summary", sa.Boolean(), nullable=False, server_default="0"
            )
        )


def downgrade() -> None:
    with op.batch_alter_table(_ARCHIVE) as batch:
        batch.drop_column("pending_summary")
    with op.batch_alter_table(_SESSIONS) as batch:
        batch.drop_index(_FORKS_INDEX)
        for column in (
            "forked_at_turn", "forked_from", "summary_claimed_until", "summary_through", "summary"
        ):
            batch.drop_column(column)
