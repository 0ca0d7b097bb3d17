"""the turn lock as one function on PostgreSQL: ``chatflow_turn_lock``

A turn's lock is taken and the session's version read by one statement of
the lock engine, ``SELECT ... FROM chatflow_turn_lock(key, session, lease);
BEGIN`` (see :mod:`chatflow_sqlalchemy.backends.postgresql_locks`), so that
SQLAlchemy's events see it. The function sets the lease
(``idle_in_transaction_session_timeout``, local to the transaction), tries
the transaction-scoped advisory lock and, if it was taken, reads the
session's version; being volatile, that read takes a snapshot of its own,
after the lock. Nothing changes on other databases.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""
from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_FUNCTION = """
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


def _is_postgresql() -> bool:
    return bool(op.get_bind().dialect.name == "postgresql")


def upgrade() -> None:
    if _is_postgresql():
        op.execute(_FUNCTION)


def downgrade() -> None:
    if _is_postgresql():
        op.execute("DROP FUNCTION IF EXISTS chatflow_turn_lock(bigint, text, text)")
