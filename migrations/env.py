"""Alembic environment: shared by `alembic` (repo root) and chatflow_sqlalchemy.migrate.

When migrate.py runs the chain it passes its own connection (already inside a
locked transaction) in ``config.attributes["connection"]``. From the command
line this file opens the URL itself and takes the same lock.
"""

import os

from alembic import context

from chatflow_sqlalchemy.migrate import VERSION_TABLE, configure_context, run_locked
from chatflow_sqlalchemy.models import metadata

config = context.config
connection = config.attributes.get("connection")

if context.is_offline_mode():
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()
elif connection is not None:
    configure_context(context, connection, metadata)
    with context.begin_transaction():
        context.run_migrations()
else:
    def _migrate(conn):  # type: ignore[no-untyped-def]
        configure_context(context, conn, metadata)
        with context.begin_transaction():
            context.run_migrations()

    run_locked(
        os.environ.get("CHATFLOW_DATABASE_URL") or config.get_main_option("sqlalchemy.url"),
        _migrate,
    )
