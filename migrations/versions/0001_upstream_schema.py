"""chatflow-agent 0.3.4 schema: adopt it as it is, or create it

The baseline is upstream's own SQLite schema (``chatflow_agent.SQLiteSessionStore``
0.3.4). On a database that upstream wrote, the tables exist already and are
adopted in place (after checking their columns); on an empty database they are
created. Revision 0002 then brings them to chatflow-sqlalchemy's schema.

MySQL/MariaDB (never written by upstream) get the same tables in the closest
shape they can index: VARCHAR(255) keys (TEXT cannot be a key there),
LONGTEXT bodies, DATETIME timestamps, and the backend's table options
(utf8mb4 with a binary collation, so ids compare exactly as elsewhere).

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import mysql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _table_options(dialect: sa.engine.Dialect) -> dict[str, str]:
    """utf8mb4 with a binary no-pad collation on MySQL/MariaDB, so ids compare byte-wise.

    Frozen with this revision: what it creates never follows the runtime's code.
    """
    if dialect.name not in ("mysql", "mariadb"):
        return {}
    version = tuple(getattr(dialect, "server_version_info", None) or ())
    if getattr(dialect, "is_mariadb", False) or dialect.name == "mariadb":
        collation = "utf8mb4_nopad_bin"
    elif version >= (8, 0, 17):
        collation = "utf8mb4_0900_bin"
    else:
        collation = "utf8mb4_bin"
    return {"mysql_charset": "utf8mb4", "mysql_collate": collation}

_UPSTREAM_COLUMNS = {
    "chatflow_sessions": {"session_id", "active_agent_name", "metadata_json"},
    "chatflow_messages": {"id", "session_id", "role", "content", "message_json"},
    "chatflow_processed_messages": {"message_id", "processed_at"},
}
# Columns only chatflow-sqlalchemy's own schema (revision 0002) has.
_OUR_COLUMNS = {
    "chatflow_sessions": {"version"},
    "chatflow_messages": {"seq"},
}

_MYSQL = ("mysql", "mariadb")
_KEY = sa.Text().with_variant(sa.String(255), *_MYSQL)
_BODY = sa.Text().with_variant(mysql.LONGTEXT(), *_MYSQL)
_STAMP = sa.TIMESTAMP().with_variant(mysql.DATETIME(), *_MYSQL)


def _options(**kw: bool) -> dict[str, object]:
    return {**_table_options(op.get_context().dialect), **kw}


def _text_default() -> dict[str, object]:
    # MySQL accepts no literal default on a TEXT column (and 0002 drops it anyway).
    return {} if op.get_context().dialect.name in _MYSQL else {"server_default": "{}"}


def _create_sessions(**kw: bool) -> None:
    op.create_table(
        "chatflow_sessions",
        sa.Column("session_id", _KEY, nullable=False),
        sa.Column("active_agent_name", _KEY, nullable=False),
        sa.Column("metadata_json", _BODY, nullable=False, **_text_default()),
        sa.Column("created_at", _STAMP, server_default=sa.text("CURRENT_TIMESTAMP")),
        sa.Column("updated_at", _STAMP, server_default=sa.text("CURRENT_TIMESTAMP")),
        sa.PrimaryKeyConstraint("session_id", name="chatflow_sessions_pkey"),
        **_options(**kw),
    )


def _create_messages(**kw: bool) -> None:
    op.create_table(
        "chatflow_messages",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("session_id", _KEY, nullable=False),
        sa.Column("role", _KEY, nullable=False),
        sa.Column("content", _BODY),
        sa.Column("message_json", _BODY, nullable=False),
        sa.Column("created_at", _STAMP, server_default=sa.text("CURRENT_TIMESTAMP")),
        sa.PrimaryKeyConstraint("id", name="chatflow_messages_pkey"),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["chatflow_sessions.session_id"],
            name="chatflow_messages_session_id_fkey",
            ondelete="CASCADE",
        ),
        sqlite_autoincrement=True,
        **_options(**kw),
    )
    op.create_index(
        "idx_chatflow_messages_session", "chatflow_messages", ["session_id", "id"], **kw
    )


def _create_processed(**kw: bool) -> None:
    op.create_table(
        "chatflow_processed_messages",
        sa.Column("message_id", _KEY, nullable=False),
        sa.Column("processed_at", _STAMP, server_default=sa.text("CURRENT_TIMESTAMP")),
        sa.PrimaryKeyConstraint("message_id", name="chatflow_processed_messages_pkey"),
        **_options(**kw),
    )
    op.create_index(
        "idx_chatflow_processed_at", "chatflow_processed_messages", ["processed_at"], **kw
    )


_CREATORS = {
    "chatflow_sessions": _create_sessions,
    "chatflow_messages": _create_messages,
    "chatflow_processed_messages": _create_processed,
}


def _check_adoptable(inspector: sa.Inspector, table: str) -> None:
    """Refuse a same-named table that chatflow-agent 0.3.4 did not write."""
    from chatflow_sqlalchemy.exceptions import SchemaError

    columns = {column["name"] for column in inspector.get_columns(table)}
    missing = _UPSTREAM_COLUMNS[table] - columns
    if missing:
        raise SchemaError(
            f"table {table} exists but lacks columns {sorted(missing)} (it has "
            f"{sorted(columns)}): it was not written by chatflow-agent 0.3.4, so it cannot be "
            "adopted; nothing was changed. Rename or drop that table, or point "
            "CHATFLOW_DATABASE_URL at another database",
            found=None,
            expected=revision,
        )
    ours = _OUR_COLUMNS.get(table, set()) & columns
    if ours:
        raise SchemaError(
            f"table {table} already has chatflow-sqlalchemy's columns {sorted(ours)} but the "
            "database records no chatflow_alembic_version; it was not created by these "
            "migrations (e.g. by metadata.create_all), so it cannot be upgraded safely; "
            "nothing was changed. If it matches the current models exactly, record that with "
            "`alembic stamp head` (chatflow_sqlalchemy.migrate.stamp), else move it aside",
            found=None,
            expected=revision,
        )


def upgrade() -> None:
    if context.is_offline_mode():
        # No database to look at: emit SQL that adopts existing tables or creates them.
        for create in _CREATORS.values():
            create(if_not_exists=True)
        return
    inspector = sa.inspect(op.get_bind())
    existing = set(inspector.get_table_names())
    # Check every existing table before creating anything.
    for table in _CREATORS:
        if table in existing:
            _check_adoptable(inspector, table)
    for table, create in _CREATORS.items():
        if table not in existing:
            create()


def downgrade() -> None:
    op.drop_table("chatflow_messages")
    op.drop_table("chatflow_processed_messages")
    op.drop_table("chatflow_sessions")
