"""chatflow-agent 0.3.4 schema: adopt it as it is, or create it

The baseline is upstream's own SQLite schema (``chatflow_agent.SQLiteSessionStore``
0.3.4). On a database that upstream wrote, the tables exist already and are
adopted in place (after checking their columns); on an empty database they are
created. Revision 0002 then brings them to chatflow-sqlalchemy's schema.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_UPSTREAM_COLUMNS = {
    "chatflow_sessions": {"session_id", "active_agent_name", "metadata_json"},
    "chatflow_messages": {"id", "session_id", "role", "content", "message_json"},
    "chatflow_processed_messages": {"message_id", "processed_at"},
}


def _create_sessions() -> None:
    op.create_table(
        "chatflow_sessions",
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("active_agent_name", sa.Text(), nullable=False),
        sa.Column("metadata_json", sa.Text(), nullable=False, server_default="{}"),
        sa.Column("created_at", sa.TIMESTAMP(), server_default=sa.text("CURRENT_TIMESTAMP")),
        sa.Column("updated_at", sa.TIMESTAMP(), server_default=sa.text("CURRENT_TIMESTAMP")),
        sa.PrimaryKeyConstraint("session_id", name="chatflow_sessions_pkey"),
    )


def _create_messages() -> None:
    op.create_table(
        "chatflow_messages",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("role", sa.Text(), nullable=False),
        sa.Column("content", sa.Text()),
        sa.Column("message_json", sa.Text(), nullable=False),
        sa.Column("created_at", sa.TIMESTAMP(), server_default=sa.text("CURRENT_TIMESTAMP")),
        sa.PrimaryKeyConstraint("id", name="chatflow_messages_pkey"),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["chatflow_sessions.session_id"],
            name="chatflow_messages_session_id_fkey",
            ondelete="CASCADE",
        ),
        sqlite_autoincrement=True,
    )
    op.create_index("idx_chatflow_messages_session", "chatflow_messages", ["session_id", "id"])


def _create_processed() -> None:
    op.create_table(
        "chatflow_processed_messages",
        sa.Column("message_id", sa.Text(), nullable=False),
        sa.Column("processed_at", sa.TIMESTAMP(), server_default=sa.text("CURRENT_TIMESTAMP")),
        sa.PrimaryKeyConstraint("message_id", name="chatflow_processed_messages_pkey"),
    )
    op.create_index("idx_chatflow_processed_at", "chatflow_processed_messages", ["processed_at"])


def upgrade() -> None:
    inspector = sa.inspect(op.get_bind())
    existing = set(inspector.get_table_names())
    creators = {
        "chatflow_sessions": _create_sessions,
        "chatflow_messages": _create_messages,
        "chatflow_processed_messages": _create_processed,
    }
    for table, create in creators.items():
        if table not in existing:
            create()
            continue
        columns = {column["name"] for column in inspector.get_columns(table)}
        missing = _UPSTREAM_COLUMNS[table] - columns
        if missing:
            raise RuntimeError(
                f"table {table} exists but lacks columns {sorted(missing)}: it was not written by "
                "chatflow-agent 0.3.4; move it aside or point CHATFLOW_DATABASE_URL elsewhere"
            )


def downgrade() -> None:
    op.drop_table("chatflow_messages")
    op.drop_table("chatflow_processed_messages")
    op.drop_table("chatflow_sessions")
