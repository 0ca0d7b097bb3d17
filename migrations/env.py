"""Alembic environment: shared by `alembic` (repo root) and chatflow_sqlalchemy.migrate.

When migrate.py runs a chain it passes its own connection (already inside a
locked transaction) in ``config.attributes["connection"]`` and the chain in
``config.attributes["chatflow_chain"]``: the core chain, or a plugin's, whose
``versions/`` folder is then the only version location. From the command
line this file opens the URL itself ($CHATFLOW_DATABASE_URL, else
``sqlalchemy.url`` of alembic.ini) and takes the same lock.
"""

import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import make_url

from chatflow_sqlalchemy.migrate import (
    VERSION_TABLE,
    configure_context,
    include_name_for,
    run_locked,
)
from chatflow_sqlalchemy.models import metadata

config = context.config
connection = config.attributes.get("connection")
chain = config.attributes.get("chatflow_chain")

if connection is None and config.config_file_name is not None:
    # The `alembic` command line: log "Running upgrade ..." as alembic.ini says.
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _cli_url() -> str | None:
    return os.environ.get("CHATFLOW_DATABASE_URL") or config.get_main_option("sqlalchemy.url")


if context.is_offline_mode():
    # `alembic upgrade head --sql`: render SQL for the same database the online run uses.
    url = _cli_url()
    if url and make_url(url).get_backend_name() in ("postgresql", "postgres"):
        from chatflow_sqlalchemy.backends.postgresql import psycopg_url

        url = psycopg_url(url).render_as_string(hide_password=False)
    context.configure(
        url=url,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        literal_binds=True,
        include_name=include_name_for(metadata),
    )
    with context.begin_transaction():
        context.run_migrations()
elif connection is not None:
    if chain is None:
        configure_context(context, connection, metadata, VERSION_TABLE)
    else:
        configure_context(context, connection, chain.target_metadata, chain.version_table)
    with context.begin_transaction():
        context.run_migrations()
else:

    def _migrate(conn):  # type: ignore[no-untyped-def]
        configure_context(context, conn, metadata)
        with context.begin_transaction():
            context.run_migrations()

    run_locked(_cli_url(), _migrate)
