"""What distributing the schema by ``session_id`` (Citus) requires, checked against the models.

Citus distributes a table by one column and requires every primary key and
unique constraint of a distributed table to include it (so each is checked
on one shard), and foreign keys between distributed tables to include it too.
docs/scaling.md explains the steps; this test pins the schema's state so that
the document and the models cannot drift apart silently.
"""

from __future__ import annotations

from sqlalchemy import Table, UniqueConstraint

from chatflow_sqlalchemy.models import metadata

DISTRIBUTION_COLUMN = "session_id"


def _keys(table: Table) -> list[list[str]]:
    keys = [[c.name for c in table.primary_key.columns]]
    keys += [[c.name for c in u.columns] for u in table.constraints
             if isinstance(u, UniqueConstraint)]
    return keys


def test_every_table_has_the_distribution_column() -> None:
    assert {t.name for t in metadata.sorted_tables if DISTRIBUTION_COLUMN not in t.c} == set()


def test_keys_without_session_id_are_the_ones_docs_scaling_lists() -> None:
    """Sessions are keyed by it; messages' surrogate ``id`` and the dedup ids are not."""
    lacking = {
        table.name: key
        for table in metadata.sorted_tables
        for key in _keys(table)
        if DISTRIBUTION_COLUMN not in key
    }
    assert lacking == {
        # Distributed, the primary key would become (session_id, id); (session_id, seq)
        # is already unique and is what every query of the store uses.
        "chatflow_messages": ["id"],
        # The transcript archive (issue 16) is keyed like the messages it keeps.
        "chatflow_message_archive": ["id"],
        # Webhook ids are global (a delivery names no session until it is claimed):
        # the claims table stays a local table on the coordinator, or is distributed
        # by message_id on its own.
        "chatflow_processed_messages": ["message_id"],
        # The durable inbox: its arrival id and its global message id (the dedup key);
        # the last key found is kept here.
        "chatflow_inbox": ["message_id"],
    }


def test_messages_reference_sessions_through_the_distribution_column() -> None:
    messages = metadata.tables["chatflow_messages"]
    (fk,) = messages.foreign_keys
    assert (fk.parent.name, fk.column.table.name, fk.column.name) == (
        "session_id", "chatflow_sessions", "session_id"
    )
    assert ["session_id", "seq"] in _keys(messages)
