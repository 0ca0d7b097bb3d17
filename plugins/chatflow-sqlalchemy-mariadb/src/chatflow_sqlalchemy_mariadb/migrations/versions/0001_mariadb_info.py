"""chatflow_mariadb_info: what the MariaDB backend chose for this schema

Revision ID: 0001
Revises:
Create Date: 2026-12-01
"""
from collections.abc import Sequence
from datetime import datetime, timezone

import sqlalchemy as sa
from alembic import op
from chatflow_sqlalchemy.migrate import table_options
from chatflow_sqlalchemy.models import UTCDateTime

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    bind = op.get_bind()
    options = table_options(bind.dialect)
    info = op.create_table(
        "chatflow_mariadb_info",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("value", sa.String(255), nullable=False),
        sa.Column("recorded_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_chatflow_mariadb_info"),
        **options,
    )
    server = bind.execute(sa.text("SELECT VERSION()")).scalar()
    now = datetime.now(timezone.utc)
    op.bulk_insert(
        info,
        [
            {"name": "server_version", "value": str(server)[:255], "recorded_at": now},
            {
                "name": "id_collation",
                "value": str(options.get("mysql_collate", "server default")),
                "recorded_at": now,
            },
        ],
    )


def downgrade() -> None:
    op.drop_table("chatflow_mariadb_info")
