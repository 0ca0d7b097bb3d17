"""transcript archive: ``chatflow_message_archive``

With ``archive_pruned=True`` the messages that pruning drops from a session's
window are moved here, in the same transaction as the prune, so that
``store.transcript(session_id)`` returns the whole conversation while the
window (what the model sees) stays as it was. Rows keep their ``seq`` (the
transcript's order) and the message's original ``created_at``;
``archived_at`` says when the prune happened. ``(session_id, seq)`` is
indexed but not unique: a row restored by a rollback and pruned again is
archived again, and the transcript keeps one copy per ``seq``. Deleting a
session deletes its archive (foreign key with ``ON DELETE CASCADE``, and the
store deletes it explicitly as well). MySQL/MariaDB: the table takes the
backend's binary collation for ids, like the other tables.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision: str = "0005"
down_revision: str | None = "0004"
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

_TABLE = "chatflow_message_archive"
_INDEX = "ix_chatflow_message_archive_session_id_seq"
_MYSQL = ("mysql", "mariadb")
_TS = sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), *_MYSQL)
_BODY = sa.Text().with_variant(mysql.LONGTEXT(), *_MYSQL)


def upgrade() -> None:
    op.create_table(
        _TABLE,
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True, nullable=False,
        ),
        sa.Column("session_id", sa.String(255), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("content", _BODY, nullable=True),
        sa.Column("message_json", _BODY, nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("archived_at", _TS, nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"], ["chatflow_sessions.session_id"],
            name="fk_chatflow_message_archive_session_id_chatflow_sessions",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_chatflow_message_archive"),
        **_table_options(op.get_context().dialect),
    )
    op.create_index(_INDEX, _TABLE, ["session_id", "seq"])


def downgrade() -> None:
    # Dropping the table drops its index too; MySQL/MariaDB refuse to drop the index
    # alone while the foreign key relies on it.
    op.drop_table(_TABLE)
