"""Review of the StoreOptions change: what the old constructors did that must still hold."""

from __future__ import annotations

from pathlib import Path

import pytest
from chatflow_agent import Agent

from chatflow_sqlalchemy import SessionStore, SQLiteSessionStore
from chatflow_sqlalchemy.exceptions import DatabaseURLError
from chatflow_sqlalchemy.server_store import ServerSessionStore


def test_a_server_store_refuses_another_backend_s_url_as_it_was_written() -> None:
    """The error quotes the URL the caller gave, not one with the backend's driver added."""

    from chatflow_sqlalchemy.dialect import DialectSupport

    class _Support(DialectSupport):
        name = "mysql"
        default_driver = "pymysql"

    class _Store(ServerSessionStore):
        dialect_support = _Support()

    with pytest.raises(DatabaseURLError) as info:
        _Store("postgresql://bot@localhost/chat")
    assert "'postgresql://bot@localhost/chat'" in str(info.value)
    assert "pymysql" not in str(info.value)


def test_default_max_turns_can_still_be_set_on_the_store(tmp_path: Path) -> None:
    """As on chatflow-agent's stores (a drop-in), and as 0.3: new contexts take the new window."""
    agent = Agent(name="a", instructions="x")
    memory = SessionStore()
    memory.default_max_turns = 3
    assert memory.get_or_create("s", agent).max_turns == 3
    with pytest.raises(ValueError, match="default_max_turns"):
        memory.default_max_turns = 0
    with SQLiteSessionStore(tmp_path / "c.db") as store:
        store.default_max_turns = 5
        assert store.options.default_max_turns == 5
        assert store.get_or_create("s", agent).max_turns == 5
