"""The store options: one dataclass, built by every constructor, checked once (issue 26).

The constructors keep DESIGN's signatures; what they take besides the two
positional options is :class:`StoreOptions`, and a keyword that is none of
them is a ``TypeError`` that says which there are.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest

from chatflow_sqlalchemy import (
    PostgresSessionStore,
    SessionStore,
    SQLAlchemySessionStore,
    SQLiteSessionStore,
)
from chatflow_sqlalchemy.options import SQL_ONLY, SQLStoreKeywords, StoreKeywords, StoreOptions
from chatflow_sqlalchemy.server_store import ServerSessionStore

POSITIONAL = {"default_max_turns", "dedup_ttl_hours"}


def _fields() -> set[str]:
    return {f.name for f in dataclasses.fields(StoreOptions)}


def test_the_keywords_type_checkers_see_are_the_options() -> None:
    """A new option is a field and a keyword in the same module: this keeps them together."""
    assert set(SQLStoreKeywords.__annotations__) | POSITIONAL == _fields()
    assert set(StoreKeywords.__annotations__) | POSITIONAL == _fields() - SQL_ONLY


@pytest.mark.parametrize(
    ("store", "positional"),
    [
        (SQLiteSessionStore, ["db_path", "default_max_turns", "dedup_ttl_hours"]),
        (PostgresSessionStore, ["url", "default_max_turns", "dedup_ttl_hours"]),
        (SessionStore, ["default_max_turns", "dedup_ttl_hours"]),
        (SQLAlchemySessionStore, ["url"]),
    ],
)
def test_the_signatures_are_designs(store: type[Any], positional: list[str]) -> None:
    params = list(inspect.signature(store).parameters.values())
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD,)
    assert [p.name for p in params if p.kind in kinds] == positional
    defaults = {p.name: p.default for p in params}
    assert defaults.get("default_max_turns", 40) == 40
    assert defaults.get("dedup_ttl_hours", 192) == 192


def test_sqlite_refuses_an_unknown_keyword_naming_the_options(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"'busy_timeout'; its options are .*turn_lease_seconds"):
        SQLiteSessionStore(tmp_path / "x.db", busy_timeout=5)  # type: ignore[call-arg]
    assert not (tmp_path / "x.db").exists()


def test_the_generic_store_sends_engine_options_to_engine_options(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"'pool_size'.*engine options go in engine_options="):
        SQLAlchemySessionStore(f"sqlite:///{tmp_path}/x.db", pool_size=5)  # type: ignore[call-arg]


def test_the_memory_store_refuses_what_is_at_rest() -> None:
    with pytest.raises(TypeError, match="'cipher': cipher is an option of the SQL stores"):
        SessionStore(cipher=None)  # type: ignore[call-arg]


def test_options_are_checked_once_whichever_store(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="turn_lease_seconds"):
        StoreOptions(turn_lease_seconds=0)
    with pytest.raises(ValueError, match="turn_lease_seconds"):
        SessionStore(turn_lease_seconds=0)
    with pytest.raises(ValueError, match="require_encryption=True needs a cipher"):
        SQLiteSessionStore(tmp_path / "x.db", require_encryption=True)
    with pytest.raises(TypeError, match="auto_migrate must be"):
        StoreOptions(auto_migrate="no")  # type: ignore[arg-type]
    assert not (tmp_path / "x.db").exists()


def test_a_store_shows_its_options(tmp_path: Path) -> None:
    with SQLiteSessionStore(tmp_path / "x.db", 7, session_ttl_hours=2, archive_pruned=True) as s:
        assert s.options == StoreOptions(
            default_max_turns=7, session_ttl_hours=2.0, archive_pruned=True
        )
        assert (s.default_max_turns, s.session_ttl_hours, s.archive_pruned) == (7, 2.0, True)
        with pytest.raises(dataclasses.FrozenInstanceError):
            s.options.default_max_turns = 8  # type: ignore[misc]
    memory = SessionStore(3, 1, turn_lease_seconds=5)
    assert memory.options == StoreOptions(3, 1.0, turn_lease_seconds=5.0)


def test_a_server_store_splits_store_and_engine_options(pg_url: str) -> None:
    """Store options go to StoreOptions, every other keyword to ``create_engine``."""
    store = PostgresSessionStore(
        pg_url,
        5,
        turn_lease_seconds=9,
        pool_size=3,
        engine_options={"execution_options": {"chatflow_test": 1}},
    )
    try:
        assert isinstance(store, ServerSessionStore)
        assert store.options == StoreOptions(default_max_turns=5, turn_lease_seconds=9.0)
        assert store.engine.pool.size() == 3  # type: ignore[attr-defined]
        assert store.engine.get_execution_options()["chatflow_test"] == 1
        assert store.url.drivername == "postgresql+psycopg"
    finally:
        store.close()


def test_default_max_turns_stays_assignable_as_upstream_s(tmp_path: Path) -> None:
    """Upstream's stores keep it as a plain attribute; code that sets it keeps working."""
    from chatflow_agent import Agent, Message, Role

    with SQLiteSessionStore(str(tmp_path / "a.db"), default_max_turns=5) as store:
        store.default_max_turns = 2
        assert store.options.default_max_turns == 2
        with pytest.raises(ValueError, match="default_max_turns"):
            store.default_max_turns = 0
        ctx = store.get_or_create("s", Agent(name="a", instructions="i"))
        assert ctx.max_turns == 2
        for n in range(4):
            ctx.add_message(Message(role=Role.USER, content=f"u{n}"))
        assert [m.content for m in ctx.history] == ["u2", "u3"]
    memory = SessionStore()
    memory.default_max_turns = 3
    assert memory.get_or_create("s", Agent(name="a", instructions="i")).max_turns == 3
