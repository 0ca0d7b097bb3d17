"""the turn's lease on the session row; PostgreSQL's turn-lock function goes

A turn no longer holds a lock (and a connection) while the model runs: it
takes a lease kept on its session's row, so ``chatflow_sessions`` gains

* ``lease_owner``: the holder's token, NULL while the session is free;
* ``lease_fence``: NOT NULL with the server default ``0``, bumped by every
  take, so a holder that lost the lease cannot write;
* ``lease_expires_at``: until when the lease holds, by the database's clock.

Every session existing before this revision is free (no owner, no expiry,
fence ``0``). On PostgreSQL the function ``chatflow_turn_lock`` of revision
0007 is dropped: nothing calls it any more. The downgrade drops the columns
(any lease held then is forgotten) and creates the function again, as 0007
did. SQLite runs in batch mode (the columns are added in place; the downgrade
rebuilds the table); PostgreSQL and MySQL/MariaDB alter in place, and on
MySQL/MariaDB ``lease_owner`` takes the table's binary collation, like the ids.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TABLE = "chatflow_sessions"
_MYSQL = ("mysql", "mariadb")
_TS = sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), *_MYSQL)
_OWNER_LENGTH = 64

# Revision 0007's function, word for word: the downgrade gives it back.
_TURN_LOCK_FUNCTION = """
CREATE OR REPLACE FUNCTION chatflow_turn_lock(
    lock_key bigint, lock_session text, lease_ms text,
    OUT lock_taken boolean, OUT session_version bigint
)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'chatflow turn locks need READ COMMITTED, not %',
            current_setting('transaction_isolation')
            USING HINT = 'set default_transaction_isolation to ''read committed'' '
                         'for the store''s role (ALTER ROLE ... SET ...)';
    END IF;
    PERFORM set_config('idle_in_transaction_session_timeout', lease_ms, true);
    lock_taken := pg_try_advisory_xact_lock(lock_key);
    IF lock_taken THEN
        SELECT version INTO session_version FROM chatflow_sessions
         WHERE session_id = lock_session;
    END IF;
END
$$
"""
_DROP_TURN_LOCK_FUNCTION = "DROP FUNCTION IF EXISTS chatflow_turn_lock(bigint, text, text)"


def _is_postgresql() -> bool:
    """Whether the chain runs on PostgreSQL (online or rendering SQL offline)."""
    return bool(op.get_context().dialect.name == "postgresql")


def upgrade() -> None:
    with op.batch_alter_table(_TABLE) as batch:
        batch.add_column(sa.Column("lease_owner", sa.String(_OWNER_LENGTH), nullable=True))
        batch.add_column(
            sa.Column("lease_fence", sa.BigInteger(), nullable=False, server_default="0")
        )
        batch.add_column(sa.Column("lease_expires_at", _TS, nullable=True))
    if _is_postgresql():
        op.execute(_DROP_TURN_LOCK_FUNCTION)


def downgrade() -> None:
    if _is_postgresql():
        op.execute(_TURN_LOCK_FUNCTION)
    with op.batch_alter_table(_TABLE) as batch:
        for column in ("lease_expires_at", "lease_fence", "lease_owner"):
            batch.drop_column(column)
