"""chatflow-sqlalchemy schema: per-session seq, session version, UTC timestamps

* ``chatflow_messages.seq``: per-session position (backfilled from ``id``),
  unique with ``session_id``; replaces the (session_id, id) index.
* ``chatflow_sessions.version``: bumped by every write, for cross-process
  change detection.
* Bounded VARCHAR ids, JSON (JSONB on PostgreSQL) metadata, timezone-aware
  NOT NULL timestamps, named constraints, and indexes for list/purge.

SQLite cannot alter columns, so its tables are rebuilt and copied (messages
whose session no longer exists, which upstream could leave behind, are not
copied); other dialects are altered in place. MySQL/MariaDB get DATETIME(6)
timestamps, and every altered column names its existing type and nullability
because MySQL rewrites a column whole (``MODIFY``).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql, postgresql

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_MYSQL = ("mysql", "mariadb")
_ID = sa.String(255)
_TS = sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), *_MYSQL)
# What revision 0001 created (see there), for downgrades.
_OLD_KEY = sa.Text().with_variant(sa.String(255), *_MYSQL)
_OLD_BODY = sa.Text().with_variant(mysql.LONGTEXT(), *_MYSQL)
_OLD_STAMP = sa.TIMESTAMP().with_variant(mysql.DATETIME(), *_MYSQL)
_JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
_MSG_PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _new_tables(suffix: str) -> None:
    op.create_table(
        f"chatflow_sessions{suffix}",
        sa.Column("session_id", _ID, nullable=False),
        sa.Column("active_agent_name", _ID, nullable=False),
        sa.Column("metadata_json", _JSON, nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("updated_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("session_id", name="pk_chatflow_sessions"),
    )
    op.create_table(
        f"chatflow_messages{suffix}",
        sa.Column("id", _MSG_PK, autoincrement=True, nullable=False),
        sa.Column("session_id", _ID, nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("content", sa.Text()),
        sa.Column("message_json", sa.Text(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_chatflow_messages"),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["chatflow_sessions.session_id"],
            name="fk_chatflow_messages_session_id_chatflow_sessions",
            ondelete="CASCADE",
        ),
        sa.UniqueConstraint("session_id", "seq", name="uq_chatflow_messages_session_id_seq"),
    )
    op.create_table(
        f"chatflow_processed_messages{suffix}",
        sa.Column("message_id", _ID, nullable=False),
        sa.Column("processed_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("message_id", name="pk_chatflow_processed_messages"),
    )


def _new_indexes() -> None:
    op.create_index("ix_chatflow_sessions_updated_at", "chatflow_sessions", ["updated_at"])
    op.create_index(
        "ix_chatflow_processed_messages_processed_at",
        "chatflow_processed_messages",
        ["processed_at"],
    )


def _swap(suffix: str) -> None:
    for table in ("chatflow_messages", "chatflow_processed_messages", "chatflow_sessions"):
        op.drop_table(table)
    for table in ("chatflow_sessions", "chatflow_messages", "chatflow_processed_messages"):
        op.rename_table(f"{table}{suffix}", table)


_NOW = "strftime('%Y-%m-%d %H:%M:%S', 'now')"


def _upgrade_sqlite() -> None:
    _new_tables("__new")
    op.execute(
        "INSERT INTO chatflow_sessions__new "
        "(session_id, active_agent_name, metadata_json, version, created_at, updated_at) "
        "SELECT session_id, active_agent_name, COALESCE(NULLIF(metadata_json, ''), '{}'), 0, "
        f"COALESCE(created_at, {_NOW}), COALESCE(updated_at, created_at, {_NOW}) "
        "FROM chatflow_sessions"
    )
    op.execute(
        "INSERT INTO chatflow_messages__new "
        "(id, session_id, seq, role, content, message_json, created_at) "
        f"SELECT id, session_id, id, role, content, message_json, COALESCE(created_at, {_NOW}) "
        "FROM chatflow_messages WHERE session_id IN (SELECT session_id FROM chatflow_sessions)"
    )
    op.execute(
        "INSERT INTO chatflow_processed_messages__new (message_id, processed_at) "
        f"SELECT message_id, COALESCE(processed_at, {_NOW}) FROM chatflow_processed_messages"
    )
    _swap("__new")
    _new_indexes()


def _keep_auto_increment(dialect: str) -> dict[str, bool]:
    # MySQL's MODIFY rewrites the whole column: AUTO_INCREMENT must be restated.
    return {"autoincrement": True} if dialect in _MYSQL else {}


def _upgrade_altering() -> None:
    dialect = op.get_bind().dialect.name
    pg = dialect == "postgresql"
    op.add_column(
        "chatflow_sessions",
        sa.Column("version", sa.BigInteger(), nullable=False, server_default="0"),
    )
    op.add_column("chatflow_messages", sa.Column("seq", sa.BigInteger(), nullable=True))
    op.execute("UPDATE chatflow_messages SET seq = id")
    op.execute("UPDATE chatflow_sessions SET metadata_json = '{}' WHERE metadata_json IS NULL")
    for table, columns in {
        "chatflow_sessions": ("created_at", "updated_at"),
        "chatflow_messages": ("created_at",),
        "chatflow_processed_messages": ("processed_at",),
    }.items():
        for column in columns:
            op.execute(f"UPDATE {table} SET {column} = CURRENT_TIMESTAMP WHERE {column} IS NULL")
            # PostgreSQL changes a column's type before its default; the old
            # default must go first or it may not cast to the new type.
            op.alter_column(table, column, server_default=None)
            op.alter_column(
                table, column, type_=_TS, nullable=False,
                postgresql_using=f"{column} AT TIME ZONE 'UTC'",
            )
    op.alter_column("chatflow_sessions", "session_id", type_=_ID, existing_nullable=False)
    op.alter_column(
        "chatflow_sessions", "active_agent_name", type_=_ID, existing_nullable=False
    )
    op.alter_column("chatflow_sessions", "metadata_json", server_default=None)
    op.alter_column(
        "chatflow_sessions", "metadata_json", type_=_JSON, existing_nullable=False,
        postgresql_using="metadata_json::jsonb",
    )
    op.drop_constraint("chatflow_messages_session_id_fkey", "chatflow_messages", "foreignkey")
    op.drop_index("idx_chatflow_messages_session", "chatflow_messages")
    op.alter_column(
        "chatflow_messages", "id", type_=sa.BigInteger(), existing_nullable=False,
        **_keep_auto_increment(dialect),
    )
    if pg:
        op.execute("ALTER SEQUENCE chatflow_messages_id_seq AS BIGINT")
    op.alter_column("chatflow_messages", "seq", nullable=False, existing_type=sa.BigInteger())
    op.alter_column("chatflow_messages", "session_id", type_=_ID, existing_nullable=False)
    op.alter_column("chatflow_messages", "role", type_=sa.String(16), existing_nullable=False)
    op.create_foreign_key(
        "fk_chatflow_messages_session_id_chatflow_sessions", "chatflow_messages",
        "chatflow_sessions", ["session_id"], ["session_id"], ondelete="CASCADE",
    )
    op.create_unique_constraint(
        "uq_chatflow_messages_session_id_seq", "chatflow_messages", ["session_id", "seq"]
    )
    op.alter_column(
        "chatflow_processed_messages", "message_id", type_=_ID, existing_nullable=False
    )
    op.drop_index("idx_chatflow_processed_at", "chatflow_processed_messages")
    if pg:
        for table in ("chatflow_sessions", "chatflow_messages", "chatflow_processed_messages"):
            op.execute(f"ALTER TABLE {table} RENAME CONSTRAINT {table}_pkey TO pk_{table}")
    _new_indexes()


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _upgrade_sqlite()
    else:
        _upgrade_altering()


def _old_tables(suffix: str) -> None:
    op.create_table(
        f"chatflow_sessions{suffix}",
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("active_agent_name", sa.Text(), nullable=False),
        sa.Column("metadata_json", sa.Text(), nullable=False, server_default="{}"),
        sa.Column("created_at", sa.TIMESTAMP(), server_default=sa.text("CURRENT_TIMESTAMP")),
        sa.Column("updated_at", sa.TIMESTAMP(), server_default=sa.text("CURRENT_TIMESTAMP")),
        sa.PrimaryKeyConstraint("session_id", name="chatflow_sessions_pkey"),
    )
    op.create_table(
        f"chatflow_messages{suffix}",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("role", sa.Text(), nullable=False),
        sa.Column("content", sa.Text()),
        sa.Column("message_json", sa.Text(), nullable=False),
        sa.Column("created_at", sa.TIMESTAMP(), server_default=sa.text("CURRENT_TIMESTAMP")),
        sa.PrimaryKeyConstraint("id", name="chatflow_messages_pkey"),
        sa.ForeignKeyConstraint(
            ["session_id"], ["chatflow_sessions.session_id"],
            name="chatflow_messages_session_id_fkey", ondelete="CASCADE",
        ),
        sqlite_autoincrement=True,
    )
    op.create_table(
        f"chatflow_processed_messages{suffix}",
        sa.Column("message_id", sa.Text(), nullable=False),
        sa.Column("processed_at", sa.TIMESTAMP(), server_default=sa.text("CURRENT_TIMESTAMP")),
        sa.PrimaryKeyConstraint("message_id", name="chatflow_processed_messages_pkey"),
    )


def _downgrade_sqlite() -> None:
    _old_tables("__old")
    op.execute(
        "INSERT INTO chatflow_sessions__old "
        "(session_id, active_agent_name, metadata_json, created_at, updated_at) "
        "SELECT session_id, active_agent_name, metadata_json, "
        "substr(created_at, 1, 19), substr(updated_at, 1, 19) FROM chatflow_sessions"
    )
    # Upstream orders a history by id: insert in our order (SYSTEM first, then seq).
    op.execute(
        "INSERT INTO chatflow_messages__old (session_id, role, content, message_json, created_at) "
        "SELECT session_id, role, content, message_json, substr(created_at, 1, 19) "
        "FROM chatflow_messages ORDER BY session_id, role != 'system', seq"
    )
    op.execute(
        "INSERT INTO chatflow_processed_messages__old (message_id, processed_at) "
        "SELECT message_id, substr(processed_at, 1, 19) FROM chatflow_processed_messages"
    )
    _swap("__old")
    op.create_index("idx_chatflow_messages_session", "chatflow_messages", ["session_id", "id"])
    op.create_index("idx_chatflow_processed_at", "chatflow_processed_messages", ["processed_at"])


def _downgrade_altering() -> None:
    dialect = op.get_bind().dialect.name
    pg = dialect == "postgresql"
    text_default = {} if dialect in _MYSQL else {"server_default": "{}"}
    op.drop_index("ix_chatflow_sessions_updated_at", "chatflow_sessions")
    op.drop_index("ix_chatflow_processed_messages_processed_at", "chatflow_processed_messages")
    if pg:
        for table in ("chatflow_sessions", "chatflow_messages", "chatflow_processed_messages"):
            op.execute(f"ALTER TABLE {table} RENAME CONSTRAINT pk_{table} TO {table}_pkey")
    # The foreign key first: MySQL enforces it with the unique index below.
    op.drop_constraint(
        "fk_chatflow_messages_session_id_chatflow_sessions", "chatflow_messages", "foreignkey"
    )
    op.drop_constraint("uq_chatflow_messages_session_id_seq", "chatflow_messages", "unique")
    op.drop_column("chatflow_messages", "seq")
    op.drop_column("chatflow_sessions", "version")
    op.alter_column("chatflow_sessions", "metadata_json", type_=_OLD_BODY, existing_nullable=False,
                    postgresql_using="metadata_json::text", **text_default)
    for table, columns in {
        "chatflow_sessions": ("session_id", "active_agent_name"),
        "chatflow_messages": ("session_id", "role"),
        "chatflow_processed_messages": ("message_id",),
    }.items():
        for column in columns:
            op.alter_column(table, column, type_=_OLD_KEY, existing_nullable=False)
    for table, columns in {
        "chatflow_sessions": ("created_at", "updated_at"),
        "chatflow_messages": ("created_at",),
        "chatflow_processed_messages": ("processed_at",),
    }.items():
        for column in columns:
            op.alter_column(
                table, column, type_=_OLD_STAMP, nullable=True,
                server_default=sa.text("CURRENT_TIMESTAMP"),
                postgresql_using=f"{column} AT TIME ZONE 'UTC'",
            )
    op.alter_column(
        "chatflow_messages", "id", type_=sa.Integer(), existing_nullable=False,
        **_keep_auto_increment(dialect),
    )
    if pg:
        op.execute("ALTER SEQUENCE chatflow_messages_id_seq AS INTEGER")
    # The index first: MySQL would otherwise create one of its own for the foreign key.
    op.create_index("idx_chatflow_messages_session", "chatflow_messages", ["session_id", "id"])
    op.create_foreign_key(
        "chatflow_messages_session_id_fkey", "chatflow_messages", "chatflow_sessions",
        ["session_id"], ["session_id"], ondelete="CASCADE",
    )
    op.create_index("idx_chatflow_processed_at", "chatflow_processed_messages", ["processed_at"])


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _downgrade_sqlite()
    else:
        _downgrade_altering()
