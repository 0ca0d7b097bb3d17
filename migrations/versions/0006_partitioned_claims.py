"""claims by day: ``chatflow_processed_messages`` partitioned on PostgreSQL

Every database gains ``partition_day`` (a ``DATE``). On PostgreSQL the table
becomes ``PARTITION BY RANGE (partition_day)`` with the primary key
``(message_id, partition_day)``: one partition per UTC day
(``chatflow_processed_messages_pYYYYMMDD``, today and a week ahead are
created here, the purge keeps them coming) and a ``DEFAULT`` partition. Three
functions serve the claim statement : ``chatflow_claim_day(id)``
keeps one row per id across partitions, ``chatflow_claim_ticket(session)`` draws
a claim's ticket under its session's lock and ``chatflow_claim_waits(...)``
tells the claim whether an earlier one of its session is in flight. Existing
rows are copied into today's partition, so they are dropped a day after the
dedup window ends (the live ones among them move on). Elsewhere the column
stays NULL: nothing reads it.

The copy rewrites the table under an exclusive lock: on a large table it
takes a while (claims wait).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TABLE = "chatflow_processed_messages"
_DEFAULT = f"{_TABLE}_default"
_DAYS_AHEAD = 7
# The claim functions as this revision made them (frozen: later revisions replace them).
_CLAIM_LOCK_CLASS = 0x63666C77
_SESSION_LOCK_CLASS = 0x63667373
_FUNCTIONS = (
    f"""
CREATE OR REPLACE FUNCTION chatflow_claim_day(claim_id text) RETURNS date
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    found_day date;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'chatflow claims need READ COMMITTED, not %',
            current_setting('transaction_isolation')
            USING HINT = 'remove isolation_level from the options of the store''s engine';
    END IF;
    PERFORM pg_advisory_xact_lock({_CLAIM_LOCK_CLASS}, hashtext(claim_id));
    SELECT partition_day INTO found_day FROM {_TABLE}
     WHERE message_id = claim_id ORDER BY partition_day DESC LIMIT 1;
    RETURN found_day;
END
$$
""",
    f"""
CREATE OR REPLACE FUNCTION chatflow_claim_ticket(claim_session text) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF claim_session IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock({_SESSION_LOCK_CLASS}, hashtext(claim_session));
    END IF;
    RETURN nextval('chatflow_claim_ticket_seq');
END
$$
""",
    f"""
CREATE OR REPLACE FUNCTION chatflow_claim_waits(
    claim_session text, claim_ticket bigint, claim_horizon timestamptz
) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN claim_session IS NOT NULL AND EXISTS (
        SELECT 1 FROM {_TABLE}
         WHERE session_id = claim_session AND ticket < claim_ticket
           AND state = 'acquired' AND lease_expires_at > claim_horizon);
END
$$
""",
)
_SIGNATURES = (
    "chatflow_claim_day(text)",
    "chatflow_claim_ticket(text)",
    "chatflow_claim_waits(text, bigint, timestamptz)",
)
_OLD = f"{_TABLE}__unpartitioned"
_COLUMNS = (
    "message_id, processed_at, state, token, session_id, ticket, "
    "lease_expires_at, claimed_at, response"
)
_TS = sa.DateTime(timezone=True)


def _is_postgresql() -> bool:
    return bool(op.get_bind().dialect.name == "postgresql")


def upgrade() -> None:
    if not _is_postgresql():
        with op.batch_alter_table(_TABLE) as batch:
            batch.add_column(sa.Column("partition_day", sa.Date(), nullable=True))
        return
    bind = op.get_bind()
    today = datetime.now(timezone.utc).date()
    op.rename_table(_TABLE, _OLD)
    op.create_table(
        _TABLE,
        *_claim_columns(),
        sa.Column("partition_day", sa.Date(), nullable=False),
        postgresql_partition_by="RANGE (partition_day)",
    )
    op.execute(f"CREATE TABLE {_DEFAULT} PARTITION OF {_TABLE} DEFAULT")
    for day in (today + timedelta(n) for n in range(_DAYS_AHEAD + 1)):
        bounds = f"FOR VALUES FROM ('{day}') TO ('{day + timedelta(1)}')"
        op.execute(f'CREATE TABLE "{_TABLE}_p{day:%Y%m%d}" PARTITION OF {_TABLE} {bounds}')
    op.execute(
        sa.text(
            f"INSERT INTO {_TABLE} ({_COLUMNS}, partition_day) "
            f"SELECT {_COLUMNS}, :today FROM {_OLD}"
        ).bindparams(today=today)
    )
    op.drop_table(_OLD)
    _keys_and_indexes(["message_id", "partition_day"])
    for ddl in _FUNCTIONS:
        op.execute(ddl)


def downgrade() -> None:
    if not _is_postgresql():
        with op.batch_alter_table(_TABLE) as batch:
            batch.drop_column("partition_day")
        return
    for signature in _SIGNATURES:
        op.execute(f"DROP FUNCTION IF EXISTS {signature}")
    op.rename_table(_TABLE, _OLD)
    op.create_table(_TABLE, *_claim_columns())
    # One row per id is what chatflow_claim_day kept; the newest day wins should two exist.
    op.execute(
        f"INSERT INTO {_TABLE} ({_COLUMNS}) "
        f"SELECT DISTINCT ON (message_id) {_COLUMNS} FROM {_OLD} "
        "ORDER BY message_id, partition_day DESC"
    )
    op.drop_table(_OLD)  # its partitions go with it
    _keys_and_indexes(["message_id"])


def _claim_columns() -> list[sa.Column[object]]:
    """The columns of revision 0005's table (new objects on every call)."""
    return [
        sa.Column("message_id", sa.String(255), nullable=False),
        sa.Column("processed_at", _TS, nullable=False),
        sa.Column("state", sa.String(16), nullable=False, server_default="done"),
        sa.Column("token", sa.String(32), nullable=True),
        sa.Column("session_id", sa.String(255), nullable=True),
        sa.Column("ticket", sa.BigInteger(), nullable=True),
        sa.Column("lease_expires_at", _TS, nullable=True),
        sa.Column("claimed_at", _TS, nullable=True),
        sa.Column("response", sa.Text(), nullable=True),
    ]


def _keys_and_indexes(primary_key: list[str]) -> None:
    op.create_primary_key(f"pk_{_TABLE}", _TABLE, primary_key)
    op.create_index(f"ix_{_TABLE}_processed_at", _TABLE, ["processed_at"])
    op.create_index(f"ix_{_TABLE}_session_id_ticket", _TABLE, ["session_id", "ticket"])
