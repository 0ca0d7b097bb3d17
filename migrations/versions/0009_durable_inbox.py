"""durable inbox: ``chatflow_inbox``

``store.inbox.put`` keeps each inbound message here before the webhook
answers 200; the workers of ``store.inbox.serve`` take a session's pending
messages as one batch under the session's turn lease, and the batch's turn
records the reply in its own transaction (see ``chatflow_sqlalchemy.inbox``).

* ``id``: the arrival order (autoincrement); ``message_id`` is unique, so a
  redelivered id is refused by the insert itself;
* ``state`` (``pending``, ``in_flight``, ``done``, ``sent``, ``dead``),
  ``attempts``, ``not_before`` (retry backoff), ``batch_token`` (the batch
  holding the item), ``answered_at`` and ``reply`` (the turn committed),
  ``error`` (why it was retried or died), ``updated_at`` (purge and stats);
* ``received_at`` and ``not_before`` are set by the database's clock.

Indexed by ``(session_id, state)`` (a session's batch), ``(state,
updated_at)`` (ready sessions, purge, stats) and ``batch_token`` (a batch's
items). No foreign key: a message is
kept before its session exists. MySQL/MariaDB: the table takes the
backend's binary collation for ids, like the other tables. The downgrade
drops the table, and with it every message not yet answered.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql, postgresql

revision: str = "0009"
down_revision: str | None = "0008"
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


_TABLE = "chatflow_inbox"
_MYSQL = ("mysql", "mariadb")
_TS = sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), *_MYSQL)
_BODY = sa.Text().with_variant(mysql.LONGTEXT(), *_MYSQL)
_JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
_ID = sa.String(255)
_TOKEN = sa.String(64)


def upgrade() -> None:
    op.create_table(
        _TABLE,
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True, nullable=False,
        ),
        sa.Column("message_id", _ID, nullable=False),
        sa.Column("session_id", _ID, nullable=False),
        sa.Column("text", _BODY, nullable=False),
        sa.Column("payload", _JSON, nullable=True),
        sa.Column("sent_at", _TS, nullable=True),
        sa.Column("received_at", _TS, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("not_before", _TS, nullable=True),
        sa.Column("batch_token", _TOKEN, nullable=True),
        sa.Column("answered_at", _TS, nullable=True),
        sa.Column("reply", _BODY, nullable=True),
        sa.Column("error", _BODY, nullable=True),
        sa.Column("updated_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_chatflow_inbox"),
        sa.UniqueConstraint("message_id", name="uq_chatflow_inbox_message_id"),
        **_table_options(op.get_context().dialect),
    )
    op.create_index("ix_chatflow_inbox_session_id_state", _TABLE, ["session_id", "state"])
    op.create_index("ix_chatflow_inbox_state_updated_at", _TABLE, ["state", "updated_at"])
    op.create_index("ix_chatflow_inbox_batch_token", _TABLE, ["batch_token"])


def downgrade() -> None:
    op.drop_table(_TABLE)
