"""chatflow_mariadb_info: what the MariaDB backend chose for this schema

Revision ID: 0001
Revises:
Create Date: 2026-12-01
"""
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _table_options(dialect: sa.engine.Dialect) -> dict[str, Any]:
    """utf8mb4 with the binary no-pad collation (frozen with this revision)."""
    version = tuple(getattr(dialect, "server_version_info", None) or ())
    if getattr(dialect, "is_mariadb", False) or dialect.name == "mariadb":
        collation = "utf8mb4_nopad_bin"
    elif version >= (8, 0, 17):
        collation = "utf8mb4_0900_bin"
    else:
        collation = "utf8mb4_bin"
    return {"mysql_charset": "utf8mb4", "mysql_collate": collation}


def upgrade() -> None:
    bind = op.get_bind()
    options = _table_options(bind.dialect)
    info = op.create_table(
        "chatflow_mariadb_info",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("value", sa.String(255), nullable=False),
        sa.Column("recorded_at", mysql.DATETIME(fsp=6), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_chatflow_mariadb_info"),
        **options,
    )
    server = bind.execute(sa.text("SELECT VERSION()")).scalar()
    now = datetime.now(timezone.utc).replace(tzinfo=None)  # naive UTC, as the store keeps it
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
