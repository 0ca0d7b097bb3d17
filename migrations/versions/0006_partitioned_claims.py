"""claims by day: ``chatflow_processed_messages`` partitioned on PostgreSQL

Every database gains ``partition_day`` (a ``DATE``). On PostgreSQL the table
becomes ``PARTITION BY RANGE (partition_day)`` with the primary key
``(message_id, partition_day)``: one partition per UTC day
(``chatflow_processed_messages_pYYYYMMDD``, today and a week ahead are
created here, the purge keeps them coming) and a ``DEFAULT`` partition. Three
functions serve the claim statement (see
:mod:`chatflow_sqlalchemy.backends.postgresql_claims`): ``chatflow_claim_day(id)``
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

from chatflow_sqlalchemy.backends import postgresql_claims as pg_claims

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TABLE = pg_claims.PARENT
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
    op.execute(f"CREATE TABLE {pg_claims.DEFAULT_PARTITION} PARTITION OF {_TABLE} DEFAULT")
    pg_claims.create_day_partitions(bind, today, today + timedelta(pg_claims.DAYS_AHEAD))
    op.execute(
        sa.text(
            f"INSERT INTO {_TABLE} ({_COLUMNS}, partition_day) "
            f"SELECT {_COLUMNS}, :today FROM {_OLD}"
        ).bindparams(today=today)
    )
    op.drop_table(_OLD)
    _keys_and_indexes(["message_id", "partition_day"])
    pg_claims.create_claim_functions(bind)


def downgrade() -> None:
    if not _is_postgresql():
        with op.batch_alter_table(_TABLE) as batch:
            batch.drop_column("partition_day")
        return
    for signature in pg_claims.CLAIM_FUNCTION_SIGNATURES:
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
