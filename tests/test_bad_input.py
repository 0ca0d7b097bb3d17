"""Bad input gets a clear error naming the fix, on every store alike, with nothing written.

Each test runs on a real SQLite file, the in-memory ``SessionStore``, a real
PostgreSQL and (when ``CHATFLOW_TEST_MARIADB_URL`` is set) a real MariaDB:
the faults this covers were found where one backend stored what another
refused, or where the database's own error came out after part of the work
was committed.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Role
from sqlalchemy import create_engine, make_url, text

from chatflow_sqlalchemy import SessionStore, SQLiteSessionStore
from chatflow_sqlalchemy.claims import list_claims
from chatflow_sqlalchemy.context import METADATA_MAX_DEPTH

from . import pg_util

MARIADB_ENV = "CHATFLOW_TEST_MARIADB_URL"
BOT = Agent(name="Bot", instructions="")


def _mariadb_database(stack: ExitStack) -> str:
    """A new MariaDB database (dropped with ``stack``), as a URL string."""
    raw = os.environ.get(MARIADB_ENV)
    if not raw:
        pytest.skip(f"MariaDB tests skipped: set {MARIADB_ENV} to run them")
    from chatflow_sqlalchemy_mariadb.dialect import MariaDBDialectSupport

    url = MariaDBDialectSupport().sync_url(make_url(raw))
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    stack.callback(admin.dispose)
    name = f"t_{uuid.uuid4().hex}"
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))

    stack.callback(drop)
    return url.set(database=name).render_as_string(hide_password=False)


@pytest.fixture(
    params=[
        "sqlite",
        "memory",
        pytest.param("postgresql", marks=pytest.mark.postgres),
        "mariadb",
    ]
)
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], Any]]:
    """Opens a store on one database per call (the in-memory store: the same one)."""
    with ExitStack() as stack:
        if request.param == "sqlite":
            def open_one() -> Any:
                return stack.enter_context(SQLiteSessionStore(tmp_path / "x.db"))
        elif request.param == "memory":
            memory = SessionStore()

            def open_one() -> Any:
                return memory
        elif request.param == "postgresql":
            url = pg_util.postgres_url()
            schema = stack.enter_context(pg_util.fresh_schema(url))

            def open_one() -> Any:
                return stack.enter_context(pg_util.schema_store(url, schema))
        else:
            plugin = pytest.importorskip(
                "chatflow_sqlalchemy_mariadb", reason="the MariaDB plugin is not installed"
            )
            database = _mariadb_database(stack)
            MariaDBSessionStore = plugin.MariaDBSessionStore

            def open_one() -> Any:
                return stack.enter_context(MariaDBSessionStore(database))
        yield open_one


def _claimed_turn(store: Any, mid: str, reply: str) -> Any:
    """A Runner-like claimed turn that answers ``reply`` and stores it with the claim."""

    async def main() -> Any:
        ctx = await store.aget_or_create("s", BOT)
        async with store.claim(mid, session_id="s") as claim:
            async with ctx.lock:
                ctx.add_message(Message(role=Role.USER, content="hi"))
                ctx.add_message(Message(role=Role.MODEL, content=reply))
            claim.response = reply
        return claim

    return asyncio.run(main())


# ------------------------------------------------------------------ NUL replies


def test_a_claimed_turn_whose_reply_holds_nul_is_refused_before_it_commits(
    opener: Callable[[], Any],
) -> None:
    """A claim stores its reply as text (PostgreSQL's cannot hold NUL): such a reply
    is refused before the turn is written, so nothing is committed without its reply
    and the redelivery runs the turn again."""
    store = opener()
    with pytest.raises(ValueError, match="NUL") as caught:
        _claimed_turn(store, "m1", "a\x00b")
    assert "store.claim" in str(caught.value)
    again = opener()
    assert again.get("s") is None  # nothing written: a failed first turn leaves none
    with again.claim("m1", session_id="s") as claim:
        assert claim.acquired  # released, not done without its reply
    # The same turn outside a claim keeps the NUL (messages are JSON text).
    ctx = again.get_or_create("s", BOT)
    ctx.add_message(Message(role=Role.USER, content="a\x00b"))
    assert [m.content for m in opener().get("s").history] == ["a\x00b"]


def test_a_claimed_turn_with_a_plain_reply_stores_it(opener: Callable[[], Any]) -> None:
    store = opener()
    _claimed_turn(store, "m1", "fine")
    with opener().claim("m1", session_id="s") as claim:
        assert (claim.status, claim.response) == ("done", "fine")


@pytest.mark.parametrize(
    ("value", "kind"),
    [(42, "int"), (b"\x72\x65", "bytes"), ({"a": 1}, "dict")],
)
def test_claim_response_takes_str_or_none_only(
    opener: Callable[[], Any], value: object, kind: str
) -> None:
    store = opener()
    with store.claim("m1") as claim:
        with pytest.raises(TypeError, match=f"str or None, got {kind}: .*json.dumps"):
            claim.response = value  # type: ignore[assignment]
        assert claim.response is None
        with pytest.raises(ValueError, match="NUL"):
            claim.response = "a\x00b"
        claim.response = "ok"
    with opener().claim("m1") as again:
        assert (again.status, again.response) == ("done", "ok")


# ------------------------------------------------------------------ ids


def _nothing_stored(store: Any) -> None:
    assert store.list_sessions() == []


def test_a_lone_surrogate_session_id_is_refused_up_front(opener: Callable[[], Any]) -> None:
    store = opener()
    bad = "a\ud800"
    for call in (
        lambda: store.get_or_create(bad, BOT),
        lambda: store.get(bad),
        lambda: store.delete(bad),
        lambda: store.transcript(bad),
        lambda: store.get_or_create("ok", BOT, user_id=bad),
        lambda: store.claim(bad),
    ):
        with pytest.raises(ValueError, match=r"surrogate.*decode"):
            call()
    _nothing_stored(opener())


# ------------------------------------------------------------------ metadata


def test_metadata_keys_must_be_str(opener: Callable[[], Any]) -> None:
    """JSON has only str keys: ``{1: "a"}`` would come back as ``{"1": "a"}``."""
    store = opener()
    with pytest.raises(TypeError, match=r"keys must be str, got 1 \(int\).*str\(1\)"):
        store.get_or_create("s", BOT, metadata={1: "a"})
    _nothing_stored(opener())
    ctx = store.get_or_create("s", BOT, metadata={"k": "v"})
    with pytest.raises(TypeError, match="keys must be str"):
        ctx.metadata[2] = "b"  # type: ignore[index]
    with pytest.raises(TypeError, match="keys must be str"):
        ctx.metadata["nested"] = {None: 1}
    with pytest.raises(TypeError, match="keys must be str"):
        ctx.metadata = {"k": [{True: 1}]}
    assert opener().get("s").metadata == {"k": "v"}
    if isinstance(store, SessionStore):
        return  # nothing below is written anywhere in memory
    ctx.metadata["k"] = {}  # a nested change made in place, then a write
    ctx.metadata["k"][3] = "c"
    with pytest.raises(TypeError, match="keys must be str"):
        ctx.add_message(Message(role=Role.USER, content="hi"))
    assert ctx.history == []
    assert opener().get("s").metadata == {"k": {}}


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def test_over_deep_metadata_is_refused_before_anything_is_written(
    opener: Callable[[], Any],
) -> None:
    store = opener()
    with pytest.raises(ValueError, match=f"more than {METADATA_MAX_DEPTH} .* deep"):
        store.get_or_create("s", BOT, metadata=_nested(5000))
    _nothing_stored(opener())
    ctx = store.get_or_create("s", BOT, metadata={"deep": _nested(METADATA_MAX_DEPTH - 1)})
    with pytest.raises(ValueError, match="deep"):
        ctx.metadata["deeper"] = _nested(METADATA_MAX_DEPTH)
    looped: dict[str, Any] = {}
    looped["self"] = looped
    with pytest.raises(ValueError, match="holds itself"):
        ctx.metadata["loop"] = looped
    assert opener().get("s").metadata == {"deep": _nested(METADATA_MAX_DEPTH - 1)}


# ------------------------------------------------------------------ limits


def test_a_huge_limit_reads_every_row_and_a_bad_one_is_refused(
    opener: Callable[[], Any],
) -> None:
    store = opener()
    for sid in ("a", "b"):
        store.get_or_create(sid, BOT)
    assert store.list_sessions(limit=10**30) == ["a", "b"]
    assert store.list_sessions(limit=2**63) == ["a", "b"]
    with store.claim("m1"):
        pass
    assert [info.message_id for info in list_claims(store, limit=10**30)] == ["m1"]
    for bad in (0, -1, 1.5, True, "10"):
        with pytest.raises(ValueError, match="limit must be a positive int or None"):
            store.list_sessions(limit=bad)
        with pytest.raises(ValueError, match="limit must be a positive int or None"):
            list_claims(store, limit=bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------ agent names


def test_an_agent_name_the_column_cannot_hold_is_refused_up_front(
    opener: Callable[[], Any],
) -> None:
    store = opener()
    long = Agent(name="x" * 256, instructions="")
    with pytest.raises(ValueError, match=r"agent name is 256 characters.*rename the agent"):
        store.get_or_create("s", long)
    _nothing_stored(opener())
    ctx = store.get_or_create("s", BOT)
    with pytest.raises(ValueError, match="rename the agent"):
        ctx.set_active_agent(long)
    with pytest.raises(ValueError, match="NUL"):
        ctx.set_active_agent(Agent(name="a\x00b", instructions=""))
    assert ctx.active_agent.name == "Bot"
    longest = Agent(name="y" * 255, instructions="")
    ctx.set_active_agent(longest)
    assert opener().get("s").active_agent.name == "y" * 255


def test_metadata_stored_deeper_than_the_limit_by_an_earlier_release_stays_writable(
    tmp_path: Path,
) -> None:
    """The depth limit refuses new deep metadata, never what is already stored."""
    import json

    bot = Agent(name="Bot", instructions="")
    deep: object = "leaf"
    for _ in range(METADATA_MAX_DEPTH + 9):
        deep = {"d": deep}
    path = tmp_path / "old.db"
    with SQLiteSessionStore(path) as store:
        store.get_or_create("s", bot).add_message(Message(role=Role.USER, content="hello"))
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:  # what a release without the limit stored
        conn.execute(
            text("UPDATE chatflow_sessions SET metadata_json = :m WHERE session_id = 's'"),
            {"m": json.dumps({"profile": deep})},
        )
    engine.dispose()
    with SQLiteSessionStore(path) as store:
        ctx = store.get_or_create("s", bot)
        ctx.metadata["plan"] = "pro"
        ctx.add_message(Message(role=Role.USER, content="again"))
    with SQLiteSessionStore(path) as store:
        ctx = store.get("s")
        assert ctx is not None and ctx.metadata["plan"] == "pro"
        assert ctx.history[-1].content == "again"


@pytest.mark.parametrize("value", [0, -1, 0.1, float("inf"), float("nan"), 1e12, "30", True])
def test_turn_lease_seconds_outside_its_bounds_is_refused_before_anything_opens(
    tmp_path: Path, value: object
) -> None:
    """An infinite lease would overflow at the first turn; a tiny one would be all renewals."""

    with pytest.raises(ValueError, match="turn_lease_seconds"):
        SQLiteSessionStore(tmp_path / "x.db", turn_lease_seconds=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="turn_lease_seconds"):
        SessionStore(turn_lease_seconds=value)  # type: ignore[arg-type]
    assert not (tmp_path / "x.db").exists()
