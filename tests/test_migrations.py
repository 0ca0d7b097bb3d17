"""The migration chain on real SQLite files and a real PostgreSQL server.

What is proven here (DESIGN.md "Behaviour" 8 and 9, "Tooling"):

* the models and the chain agree (no drift) on a fresh database, after adopting
  a file written by the real ``chatflow_agent.SQLiteSessionStore``, and after a
  downgrade/upgrade round trip;
* adopting upstream's file keeps every session, message, agent, metadata and
  dedup id, and a downgraded database is readable by upstream again;
* a database that is ahead, behind with ``CHATFLOW_AUTO_MIGRATE=0``, or holds a
  foreign same-named table gets a clear error and is left exactly as it was;
* a migration that fails, or whose process is killed, half-way changes nothing;
* eight processes starting at once migrate exactly once;
* ``alembic`` from the repo root and the built wheel both carry the chain;
* the turn lease (0008) keeps every session of a 0007 database, free (fence 0,
  no owner, no expiry), and round-trips through 0007 on SQLite, PostgreSQL and
  MariaDB; on PostgreSQL it drops 0007's ``chatflow_turn_lock`` and the
  downgrade gives it back.

PostgreSQL tests run in a fresh schema each (see ``pg_util``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import uuid
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import chatflow_agent
import pytest
import sqlalchemy as sa
from chatflow_agent import Agent, Message, Role, Runner

from chatflow_sqlalchemy import SchemaAheadError, SchemaError, migrate
from chatflow_sqlalchemy.backends.postgresql import PostgresSessionStore
from chatflow_sqlalchemy.backends.sqlite import SQLiteSessionStore
from chatflow_sqlalchemy.models import ChatflowMessage, ChatflowSession, metadata
from chatflow_sqlalchemy.testing import StoreSpec
from chatflow_sqlalchemy.testing.harness import run_process, run_workers
from tests import _workers
from tests.fakes import Playback, calls, say
from tests.pg_util import fresh_schema, postgres_url, schema_connect_args, schema_engine

REPO = Path(__file__).resolve().parents[1]
HEAD = migrate.head_revision()
BASELINE = migrate.BASELINE_REVISION
TABLES = ("chatflow_sessions", "chatflow_messages", "chatflow_processed_messages")
CHAIN = [rev.revision for rev in migrate.history()]

# --------------------------------------------------------------------------- a real conversation


def lookup_order(order_id: str) -> dict[str, Any]:
    """Look an order up."""
    return {"order_id": order_id, "status": "shipped", "items": [{"sku": "X1", "qty": 2}]}


def make_agents() -> dict[str, Agent]:
    billing = Agent(name="billing", instructions="Billing specialist.", tools=[lookup_order])
    triage = Agent(name="triage", instructions="Route the customer.", handoffs=[billing])
    return {"triage": triage, "billing": billing}


HANDOFF = "wa:5511999990001"  # system prompt, handoff, tool call + result, two turns
TOOL_ERROR = "tg:1001"  # a tool the agent lacks: an is_error tool result
PRUNED = "web:pruned"  # written with max_turns=2, so ids have gaps
EMPTY = "web:empty"  # a session without messages
SESSIONS = (HANDOFF, TOOL_ERROR, PRUNED, EMPTY)
DEDUP_IDS = ("wamid.HBgMNTUxMTk5OTk5MDAwMRUCABIYFjNFQjA", "tg-update-42", "web-7f3a")

StoreFactory = Callable[[int], Any]
"""``default_max_turns -> store`` (upstream's or ours)."""


def close(store: Any) -> None:
    closer = getattr(store, "close", None)
    if closer is not None:
        closer()


def write_conversations(make_store: StoreFactory) -> None:
    """Drive the real Runner with the scripted engine through ``make_store``'s stores."""
    agents = make_agents()
    engine = Playback(
        [
            calls(("c1", "transfer_to_billing", {"reason": "invoice question"})),
            calls(("c2", "lookup_order", {"order_id": "A-17"})),
            say("Order A-17 has shipped."),
            say("You're welcome!"),
            calls(("c3", "lookup_order", {"order_id": "B-2"})),
            say("Sorry, I cannot look orders up."),
            say("Tchau!"),
            *(say(f"answer {n}") for n in range(4)),
        ]
    )
    store, small = make_store(40), make_store(2)
    try:
        ctx = store.get_or_create(
            HANDOFF,
            agents["triage"],
            metadata={"channel": "whatsapp", "profile": {"name": "Ana", "tags": ["vip"]}},
        )
        ctx.add_message(Message(role=Role.SYSTEM, content="You are Acme's support bot."))
        store.get_or_create(EMPTY, agents["triage"], metadata={})

        async def conversations() -> None:
            runner = Runner(starting_agent=agents["triage"], session_store=store, engine=engine)
            await runner.run_async(HANDOFF, "Where is my invoice for order A-17?")
            await runner.run_async(HANDOFF, "Thanks!")
            meta = {"channel": "telegram", "lang": "pt-BR", "greeting": "olá 👋"}
            await runner.run_async(TOOL_ERROR, "Cadê meu pedido B-2?", metadata=meta)
            await runner.run_async(TOOL_ERROR, "Ok, obrigado")
            runner = Runner(starting_agent=agents["triage"], session_store=small, engine=engine)
            for n in range(4):
                await runner.run_async(PRUNED, f"question {n}")

        asyncio.run(conversations())
        for message_id in DEDUP_IDS:
            assert store.record_processed_message(message_id) is True
    finally:
        close(store)
        close(small)
    assert engine.script == [], "every scripted model turn was used"


def snapshot(store: Any) -> dict[str, Any]:
    """Everything a store gives back: sessions, histories, agents, metadata, dedup ids."""
    agents = make_agents()
    store.set_agent_resolver(agents.get)
    try:
        sessions: dict[str, Any] = {}
        for session_id in sorted(store.list_sessions()):
            ctx = store.get(session_id)
            assert ctx is not None, session_id
            sessions[session_id] = {
                "agent": ctx.active_agent.name,
                "metadata": ctx.metadata,
                "history": [m.model_dump(mode="json") for m in ctx.history],
            }
        dedup = {mid: store.is_message_processed(mid) for mid in (*DEDUP_IDS, "never-seen")}
        return {"sessions": sessions, "dedup": dedup}
    finally:
        close(store)


def check_conversations(snap: dict[str, Any]) -> None:
    """The snapshot holds what write_conversations wrote (so comparisons are not vacuous)."""
    sessions = snap["sessions"]
    assert sorted(sessions) == sorted(SESSIONS)
    handoff = sessions[HANDOFF]
    assert handoff["agent"] == "billing", "the handoff moved the session off the starting agent"
    assert handoff["metadata"] == {
        "channel": "whatsapp",
        "profile": {"name": "Ana", "tags": ["vip"]},
    }
    roles = [m["role"] for m in handoff["history"]]
    assert roles == ["system", "user", "model", "tool", "model", "tool", "model", "user", "model"]
    assert handoff["history"][2]["tool_calls"][0]["name"] == "transfer_to_billing"
    results = handoff["history"][5]["tool_results"]
    assert results[0]["content"]["items"] == [{"sku": "X1", "qty": 2}]
    tool_error = sessions[TOOL_ERROR]
    assert tool_error["agent"] == "triage"
    assert tool_error["metadata"]["greeting"] == "olá 👋"
    assert tool_error["history"][2]["tool_results"][0]["is_error"] is True
    pruned = [m["content"] for m in sessions[PRUNED]["history"]]
    assert pruned == ["question 2", "answer 2", "question 3", "answer 3"]
    assert sessions[EMPTY] == {"agent": "triage", "metadata": {}, "history": []}
    assert snap["dedup"] == {**dict.fromkeys(DEDUP_IDS, True), "never-seen": False}


# --------------------------------------------------------------------------- SQLite helpers


def sqlite_uri(db: Path) -> str:
    return f"sqlite:///{db}"


def dump(db: Path) -> str:
    """The whole database (schema and rows) as SQL text, to prove it did not change."""
    conn = sqlite3.connect(db)
    try:
        return "\n".join(conn.iterdump())
    finally:
        conn.close()


def sqlite_tables(db: Path) -> set[str]:
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    finally:
        conn.close()
    return {name for (name,) in rows} - {"sqlite_sequence"}


def version_rows(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        if not sa.inspect(conn).has_table(migrate.VERSION_TABLE):
            return []
        rows = conn.execute(sa.text(f"SELECT version_num FROM {migrate.VERSION_TABLE}"))
        return [row[0] for row in rows]


@pytest.fixture
def engines() -> Iterator[Callable[[sa.Engine], sa.Engine]]:
    """Register engines to be disposed at teardown."""
    opened: list[sa.Engine] = []

    def track(engine: sa.Engine) -> sa.Engine:
        opened.append(engine)
        return engine

    yield track
    for engine in opened:
        engine.dispose()


def upstream_file(path: Path) -> Path:
    """A database written by chatflow-agent 0.3.4 itself, through its Runner."""
    write_conversations(lambda turns: chatflow_agent.SQLiteSessionStore(str(path), turns))
    return path


# --------------------------------------------------------------------------- PostgreSQL helpers


@dataclass
class PG:
    """One fresh schema on the test server; stores and engines opened in it."""

    url: str
    schema: str
    _opened: list[Any] = field(default_factory=list)

    def store(self, max_turns: int = 40) -> PostgresSessionStore:
        store = PostgresSessionStore(
            self.url, default_max_turns=max_turns, connect_args=schema_connect_args(self.schema)
        )
        self._opened.append(store)
        return store

    def engine(self) -> sa.Engine:
        engine = schema_engine(self.url, self.schema)
        self._opened.append(engine)
        return engine

    def close(self) -> None:
        for item in self._opened:
            if isinstance(item, sa.Engine):
                item.dispose()
            else:
                item.close()


@pytest.fixture
def pg() -> Iterator[PG]:
    url = postgres_url()
    with fresh_schema(url) as schema:
        handle = PG(url, schema)
        try:
            yield handle
        finally:
            handle.close()


def pg_state(engine: sa.Engine) -> dict[str, Any]:
    """Tables, columns, indexes and every row of the schema, to prove it did not change."""
    with engine.connect() as conn:
        inspector = sa.inspect(conn)
        state: dict[str, Any] = {}
        for table in sorted(inspector.get_table_names()):
            columns = [
                (c["name"], str(c["type"]), c["nullable"]) for c in inspector.get_columns(table)
            ]
            indexes = sorted(i["name"] or "" for i in inspector.get_indexes(table))
            rows = conn.execute(sa.text(f'SELECT * FROM "{table}"')).all()
            state[table] = (columns, indexes, sorted(map(repr, rows)))
        return state


# =========================================================================== 1. no drift


def test_fresh_sqlite_upgrade_has_no_drift(tmp_path: Path, engines: Any) -> None:
    engine = engines(migrate.open_engine(sqlite_uri(tmp_path / "fresh.db")))
    migrate.upgrade(engine)
    assert version_rows(engine) == [HEAD]
    assert migrate.drift(engine) == []
    assert CHAIN[0] == BASELINE and CHAIN[-1] == HEAD


def test_drift_sees_a_real_difference(tmp_path: Path, engines: Any) -> None:
    """drift() is not blind: a missing index and an extra column are reported."""
    engine = engines(migrate.open_engine(sqlite_uri(tmp_path / "drift.db")))
    migrate.upgrade(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP INDEX ix_chatflow_sessions_updated_at")
        conn.exec_driver_sql("ALTER TABLE chatflow_messages ADD COLUMN extra TEXT")
    found = " | ".join(migrate.drift(engine))
    assert "add_index" in found and "ix_chatflow_sessions_updated_at" in found
    assert "remove_column" in found and "extra" in found


def test_drift_ignores_an_applications_own_tables(tmp_path: Path, engines: Any) -> None:
    """The chain shares databases with apps: their tables are not drift (nor dropped)."""
    engine = engines(migrate.open_engine(sqlite_uri(tmp_path / "shared.db")))
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE app_orders (id INTEGER PRIMARY KEY, total REAL)")
        conn.exec_driver_sql("CREATE TABLE alembic_version (version_num VARCHAR(32))")
        conn.exec_driver_sql("INSERT INTO alembic_version VALUES ('app_rev_1')")
    migrate.upgrade(engine)
    assert migrate.drift(engine) == []
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT version_num FROM alembic_version").all() == [
            ("app_rev_1",)
        ]


@pytest.mark.postgres
def test_fresh_postgres_upgrade_has_no_drift(pg: PG) -> None:
    store = pg.store()
    assert migrate.drift(store.engine) == []
    assert version_rows(store.engine) == [HEAD]
    with store.engine.connect() as conn:
        schema = conn.exec_driver_sql("SELECT current_schema()").scalar()
        types = dict(
            conn.exec_driver_sql(
                "SELECT column_name, data_type FROM information_schema.columns "
                "WHERE table_schema = current_schema() AND table_name = 'chatflow_sessions'"
            ).all()
        )
    assert schema == pg.schema, "the test really runs in its own schema"
    assert types["metadata_json"] == "jsonb"
    assert types["updated_at"] == "timestamp with time zone"


# =========================================================================== 2. adopting upstream


@pytest.mark.parametrize("how", ["open_store", "migrate_upgrade"])
def test_adopts_a_file_written_by_chatflow_agent(tmp_path: Path, engines: Any, how: str) -> None:
    db = upstream_file(tmp_path / "upstream.db")
    expected = snapshot(chatflow_agent.SQLiteSessionStore(str(db)))
    check_conversations(expected)

    raw = sqlite3.connect(db)
    try:
        assert raw.execute("PRAGMA user_version").fetchone() == (1,)
        upstream_rows = raw.execute(
            "SELECT id, session_id, message_json FROM chatflow_messages ORDER BY id"
        ).fetchall()
        raw.execute("CREATE TABLE app_orders (id INTEGER PRIMARY KEY, total REAL)")
        raw.execute("INSERT INTO app_orders VALUES (1, 9.5)")
        raw.commit()
    finally:
        raw.close()
    assert migrate.VERSION_TABLE not in sqlite_tables(db)
    ids = [row[0] for row in upstream_rows]
    assert ids != list(range(ids[0], ids[0] + len(ids))), "pruning left gaps for seq to keep"

    if how == "migrate_upgrade":
        engine = engines(migrate.open_engine(sqlite_uri(db)))
        migrate.upgrade(engine)
        assert migrate.drift(engine) == []
    store = SQLiteSessionStore(db)
    try:
        assert migrate.drift(store.engine) == []
        assert version_rows(store.engine) == [HEAD]
    finally:
        store.close()
    assert snapshot(SQLiteSessionStore(db)) == expected

    raw = sqlite3.connect(db)
    try:
        rows = raw.execute(
            "SELECT id, session_id, message_json, seq FROM chatflow_messages ORDER BY id"
        ).fetchall()
        versions = raw.execute("SELECT DISTINCT version FROM chatflow_sessions").fetchall()
        app = raw.execute("SELECT * FROM app_orders").fetchall()
    finally:
        raw.close()
    assert [row[:3] for row in rows] == upstream_rows, "every row kept, byte for byte"
    assert all(seq == row_id for row_id, _, _, seq in rows), "seq backfilled from the id"
    assert versions == [(0,)]
    assert app == [(1, 9.5)], "an application's table in the same file is untouched"

    # The adopted database keeps working: dedup ids stay claimed, turns append after old rows.
    store = SQLiteSessionStore(db)
    try:
        assert store.record_processed_message(DEDUP_IDS[0]) is False
        agents = make_agents()
        runner = Runner(agents["triage"], session_store=store, engine=Playback([say("Hi!")]))
        asyncio.run(runner.run_async(HANDOFF, "One more thing"))
    finally:
        store.close()
    after = snapshot(SQLiteSessionStore(db))["sessions"][HANDOFF]
    assert after["history"][:-2] == expected["sessions"][HANDOFF]["history"]
    assert [m["content"] for m in after["history"][-2:]] == ["One more thing", "Hi!"]
    assert after["agent"] == "billing"


def test_upstream_orphan_messages_do_not_block_adoption(tmp_path: Path) -> None:
    """Upstream never enforced its foreign key; rows of a vanished session are not copied."""
    db = upstream_file(tmp_path / "orphans.db")
    expected = snapshot(chatflow_agent.SQLiteSessionStore(str(db)))
    raw = sqlite3.connect(db)
    try:
        raw.execute(
            "INSERT INTO chatflow_messages (session_id, role, content, message_json) "
            "VALUES ('gone', 'user', 'x', ?)",
            (Message(role=Role.USER, content="x").model_dump_json(),),
        )
        raw.commit()
    finally:
        raw.close()
    assert snapshot(SQLiteSessionStore(db)) == expected
    raw = sqlite3.connect(db)
    try:
        assert raw.execute("PRAGMA foreign_key_check").fetchall() == []
    finally:
        raw.close()


# =========================================================================== 3. round trips


def test_sqlite_downgrade_is_readable_by_upstream_and_upgrades_again(
    tmp_path: Path, engines: Any
) -> None:
    db = tmp_path / "ours.db"
    write_conversations(lambda turns: SQLiteSessionStore(db, default_max_turns=turns))
    expected = snapshot(SQLiteSessionStore(db))
    check_conversations(expected)
    engine = engines(migrate.open_engine(sqlite_uri(db)))

    migrate.downgrade(engine, BASELINE)
    assert version_rows(engine) == [BASELINE]
    assert snapshot(chatflow_agent.SQLiteSessionStore(str(db))) == expected

    migrate.upgrade(engine)
    assert version_rows(engine) == [HEAD]
    assert migrate.drift(engine) == []
    assert snapshot(SQLiteSessionStore(db)) == expected

    migrate.downgrade(engine, "base")
    assert version_rows(engine) == []
    assert sqlite_tables(db) & set(TABLES) == set()


@pytest.mark.postgres
def test_postgres_downgrade_upgrade_round_trip(pg: PG) -> None:
    write_conversations(pg.store)
    expected = snapshot(pg.store())
    check_conversations(expected)
    engine = pg.engine()

    migrate.downgrade(engine, BASELINE)
    assert version_rows(engine) == [BASELINE]
    with engine.connect() as conn:
        columns = {c["name"] for c in sa.inspect(conn).get_columns("chatflow_messages")}
        rows = conn.exec_driver_sql(
            "SELECT session_id, message_json FROM chatflow_messages ORDER BY id"
        ).all()
        processed = conn.exec_driver_sql("SELECT message_id FROM chatflow_processed_messages")
        processed_ids = {row[0] for row in processed}
        meta = conn.exec_driver_sql(
            "SELECT metadata_json FROM chatflow_sessions WHERE session_id = %(sid)s",
            {"sid": HANDOFF},
        ).scalar()
    assert "seq" not in columns
    for session_id, session in expected["sessions"].items():
        stored = [
            Message.model_validate_json(m).model_dump(mode="json")
            for sid, m in rows
            if sid == session_id
        ]
        assert stored == session["history"], session_id
    assert processed_ids == set(DEDUP_IDS)
    assert isinstance(meta, str) and json.loads(meta) == expected["sessions"][HANDOFF]["metadata"]

    migrate.upgrade(engine)
    assert version_rows(engine) == [HEAD]
    assert migrate.drift(engine) == []
    assert snapshot(pg.store()) == expected

    migrate.downgrade(engine, "base")
    assert version_rows(engine) == []
    assert set(sa.inspect(engine).get_table_names()) & set(TABLES) == set()


# =========================================================================== 4. schema ahead


def test_schema_ahead_is_refused_and_untouched(tmp_path: Path, engines: Any) -> None:
    db = tmp_path / "ahead.db"
    write_conversations(lambda turns: SQLiteSessionStore(db, default_max_turns=turns))
    raw = sqlite3.connect(db)
    raw.execute(f"UPDATE {migrate.VERSION_TABLE} SET version_num = 'f00dfeed9999'")
    raw.commit()
    raw.close()
    before = dump(db)

    with pytest.raises(SchemaAheadError) as caught:
        SQLiteSessionStore(db)
    message = str(caught.value)
    assert "f00dfeed9999" in message and HEAD in message
    assert (caught.value.found, caught.value.expected) == ("f00dfeed9999", HEAD)
    engine = engines(migrate.open_engine(sqlite_uri(db)))
    with pytest.raises(SchemaAheadError):
        migrate.upgrade(engine)
    with pytest.raises(SchemaAheadError):
        migrate.downgrade(engine, BASELINE)
    assert dump(db) == before


@pytest.mark.postgres
def test_postgres_schema_ahead_is_refused_and_untouched(pg: PG) -> None:
    engine = pg.store().engine
    with engine.begin() as conn:
        conn.exec_driver_sql(f"UPDATE {migrate.VERSION_TABLE} SET version_num = 'f00dfeed9999'")
    before = pg_state(engine)
    with pytest.raises(SchemaAheadError, match=f"f00dfeed9999.*{HEAD}"):
        pg.store()
    assert pg_state(engine) == before


# =========================================================================== 5. auto-migrate off


def test_auto_migrate_off_refuses_an_empty_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHATFLOW_AUTO_MIGRATE", "0")
    db = tmp_path / "empty.db"
    db.touch()
    with pytest.raises(SchemaError, match="chatflow-sqlalchemy db upgrade") as caught:
        SQLiteSessionStore(db)
    assert not isinstance(caught.value, SchemaAheadError)
    assert (caught.value.found, caught.value.expected) == (None, HEAD)
    assert sqlite_tables(db) == set()


@pytest.mark.parametrize("start", ["upstream", BASELINE])
def test_auto_migrate_off_refuses_an_old_database_untouched(
    tmp_path: Path, engines: Any, monkeypatch: pytest.MonkeyPatch, start: str
) -> None:
    db = upstream_file(tmp_path / "old.db")
    if start == BASELINE:
        migrate.upgrade(engines(migrate.open_engine(sqlite_uri(db))), BASELINE)
    before = dump(db)
    monkeypatch.setenv("CHATFLOW_AUTO_MIGRATE", "0")
    with pytest.raises(SchemaError, match="run: chatflow-sqlalchemy db upgrade") as caught:
        SQLiteSessionStore(db)
    assert caught.value.found == (None if start == "upstream" else BASELINE)
    assert (caught.value.found or migrate.UPSTREAM_TABLES) in str(caught.value)
    assert dump(db) == before

    monkeypatch.setenv("CHATFLOW_AUTO_MIGRATE", "1")
    SQLiteSessionStore(db).close()
    monkeypatch.setenv("CHATFLOW_AUTO_MIGRATE", "0")
    SQLiteSessionStore(db).close()  # at head: nothing to refuse


@pytest.mark.postgres
def test_postgres_auto_migrate_off_refuses_an_empty_schema(
    pg: PG, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHATFLOW_AUTO_MIGRATE", "0")
    with pytest.raises(SchemaError, match="chatflow-sqlalchemy db upgrade"):
        pg.store()
    assert sa.inspect(pg.engine()).get_table_names() == []


# =========================================================================== 6. foreign tables


@pytest.mark.parametrize("table", TABLES)
def test_foreign_same_named_table_is_refused_untouched(tmp_path: Path, table: str) -> None:
    db = tmp_path / "foreign.db"
    raw = sqlite3.connect(db)
    raw.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, payload TEXT)")
    raw.execute(f"INSERT INTO {table} VALUES (1, 'not chatflow')")
    raw.commit()
    raw.close()
    before = dump(db)

    with pytest.raises(SchemaError, match=f"table {table} exists but lacks columns"):
        SQLiteSessionStore(db)
    assert dump(db) == before, "nothing half-written: no other table, no version row"
    assert sqlite_tables(db) == {table}


def test_tables_created_without_the_chain_are_refused_until_stamped(
    tmp_path: Path, engines: Any
) -> None:
    """Tables made by metadata.create_all() already have seq/version: never re-backfill them."""
    engine = engines(migrate.open_engine(sqlite_uri(tmp_path / "create_all.db")))
    metadata.create_all(engine)
    with pytest.raises(SchemaError, match="stamp head"):
        migrate.upgrade(engine)
    assert version_rows(engine) == []
    migrate.stamp(engine, "head")
    store = SQLiteSessionStore(tmp_path / "create_all.db")
    store.close()
    assert migrate.drift(engine) == []


@pytest.mark.postgres
def test_postgres_foreign_table_is_refused_untouched(pg: PG) -> None:
    engine = pg.engine()
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE chatflow_processed_messages (id int, payload text)")
    before = pg_state(engine)
    with pytest.raises(SchemaError, match="chatflow_processed_messages exists but lacks"):
        pg.store()
    assert pg_state(engine) == before


# =========================================================================== 7. concurrent start

def start_together(spec: StoreSpec, count: int) -> list[list[str]]:
    """``count`` worker processes open a store at the same instant; what each migrated."""
    return run_workers(_workers.open_counting_migrations, [(spec,)] * count, timeout=120)


@pytest.mark.slow
def test_eight_processes_open_one_empty_sqlite_file_at_once(tmp_path: Path, engines: Any) -> None:
    db = tmp_path / "race.db"
    db.touch()
    ran = start_together(_workers.sqlite_spec(db), 8)
    migrations = [line for lines in ran for line in lines]
    assert len(migrations) == len(CHAIN), f"the chain ran exactly once in all: {migrations}"
    assert sum(1 for lines in ran if lines) == 1, "one process migrated, seven found it done"
    engine = engines(migrate.open_engine(sqlite_uri(db)))
    assert version_rows(engine) == [HEAD]
    assert migrate.drift(engine) == []


@pytest.mark.slow
@pytest.mark.postgres
def test_eight_processes_open_one_empty_postgres_schema_at_once(pg: PG, tmp_path: Path) -> None:
    ran = start_together(_workers.postgres_spec(pg.url, pg.schema), 8)
    migrations = [line for lines in ran for line in lines]
    assert len(migrations) == len(CHAIN), f"the chain ran exactly once in all: {migrations}"
    assert sum(1 for lines in ran if lines) == 1, "one process migrated, seven found it done"
    engine = pg.engine()
    assert version_rows(engine) == [HEAD]
    assert migrate.drift(engine) == []


# =========================================================================== 8. alembic CLI


def run_alembic(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CHATFLOW_DATABASE_URL": url}
    return subprocess.run(
        [sys.executable, "-m", "alembic", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_alembic_upgrade_head_from_the_repo_root(tmp_path: Path, engines: Any) -> None:
    db = tmp_path / "x.db"
    ini_default = REPO / "chatflow.db"
    existed = ini_default.exists()

    done = run_alembic("upgrade", "head", url=sqlite_uri(db))
    assert done.returncode == 0, done.stderr
    assert f"Running upgrade {CHAIN[-2]} -> {HEAD}" in done.stderr
    check = run_alembic("check", url=sqlite_uri(db))
    assert check.returncode == 0, check.stderr + check.stdout
    assert "No new upgrade operations detected" in check.stdout + check.stderr

    engine = engines(migrate.open_engine(sqlite_uri(db)))
    assert version_rows(engine) == [HEAD]
    assert migrate.drift(engine) == []
    assert ini_default.exists() == existed, "CHATFLOW_DATABASE_URL wins over alembic.ini"


def test_alembic_offline_sql_builds_the_same_schema(tmp_path: Path, engines: Any) -> None:
    """``alembic upgrade head --sql`` renders SQL that adopts or creates, without a database."""
    db = tmp_path / "offline.db"
    done = run_alembic("upgrade", "head", "--sql", url=sqlite_uri(db))
    assert done.returncode == 0, done.stderr
    assert not db.exists(), "offline mode never connects"
    upstream = upstream_file(tmp_path / "upstream.db")
    expected = snapshot(chatflow_agent.SQLiteSessionStore(str(upstream)))
    for target in (db, upstream):
        raw = sqlite3.connect(target)
        try:
            raw.executescript(done.stdout)
        finally:
            raw.close()
        engine = engines(migrate.open_engine(sqlite_uri(target)))
        assert version_rows(engine) == [HEAD]
        assert migrate.drift(engine) == []
    assert snapshot(SQLiteSessionStore(upstream)) == expected


# =========================================================================== 9. the wheel

_COPY_IGNORE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.db", "*.db-*", ".*_cache"
)


def test_wheel_ships_the_migrations(tmp_path: Path) -> None:
    source = tmp_path / "src-copy"
    shutil.copytree(REPO, source, ignore=_COPY_IGNORE)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("chatflow_sqlalchemy-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        for name in (
            "chatflow_sqlalchemy/_migrations/env.py",
            "chatflow_sqlalchemy/_migrations/script.py.mako",
            "chatflow_sqlalchemy/_migrations/versions/0001_upstream_schema.py",
            "chatflow_sqlalchemy/_migrations/versions/0002_sequence_version_utc.py",
            "chatflow_sqlalchemy/py.typed",
        ):
            assert name in names, f"{name} missing from {wheel.name}: {sorted(names)}"
        site = tmp_path / "site"
        archive.extractall(site, [n for n in names if n.startswith("chatflow_sqlalchemy/")])

    # The installed copy migrates on its own: no repo, no alembic.ini, another cwd.
    db = tmp_path / "installed.db"
    code = (
        "import sys, chatflow_sqlalchemy\n"
        "from chatflow_sqlalchemy import migrate\n"
        "where = chatflow_sqlalchemy.__file__\n"
        "assert where.startswith(sys.argv[1]), where\n"
        "assert migrate.script_location().startswith(sys.argv[1]), migrate.script_location()\n"
        "engine = migrate.open_engine('sqlite:///' + sys.argv[2])\n"
        "migrate.upgrade(engine)\n"
        "assert migrate.drift(engine) == [], migrate.drift(engine)\n"
        "import json; print(json.dumps([r.revision for r in migrate.history()]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    ran = subprocess.run(
        [sys.executable, "-c", code, str(site), str(db)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout) == CHAIN


# =========================================================================== 10. crash safety


def test_failing_migration_leaves_upstream_file_exactly_as_before(tmp_path: Path) -> None:
    db = upstream_file(tmp_path / "conflict.db")
    raw = sqlite3.connect(db)
    raw.execute("CREATE TABLE app_audit (id INTEGER PRIMARY KEY, at TEXT)")
    # 0002 creates this index name last, after rebuilding every table.
    raw.execute("CREATE INDEX ix_chatflow_sessions_updated_at ON app_audit (at)")
    raw.commit()
    raw.close()
    expected = snapshot(chatflow_agent.SQLiteSessionStore(str(db)))
    before = dump(db)

    with pytest.raises(sa.exc.OperationalError, match="ix_chatflow_sessions_updated_at"):
        SQLiteSessionStore(db)
    assert dump(db) == before
    assert migrate.VERSION_TABLE not in sqlite_tables(db)
    assert snapshot(chatflow_agent.SQLiteSessionStore(str(db))) == expected

    raw = sqlite3.connect(db)
    raw.execute("DROP INDEX ix_chatflow_sessions_updated_at")
    raw.commit()
    raw.close()
    assert snapshot(SQLiteSessionStore(db)) == expected


def crash_upgrade(url: str, step: str, schema: str | None = None) -> None:
    exit_code = run_process(_workers.crash_mid_migration, (url, step, schema), timeout=120)
    assert exit_code == _workers.CRASH_EXIT, f"the upgrade exited with {exit_code}"


def test_process_killed_mid_migration_leaves_sqlite_file_as_before(tmp_path: Path) -> None:
    db = upstream_file(tmp_path / "killed.db")
    expected = snapshot(chatflow_agent.SQLiteSessionStore(str(db)))
    before = dump(db)
    # After 0002 has dropped upstream's tables, before it renames the new ones in.
    crash_upgrade(sqlite_uri(db), "rename_table")
    assert dump(db) == before
    assert snapshot(chatflow_agent.SQLiteSessionStore(str(db))) == expected
    assert snapshot(SQLiteSessionStore(db)) == expected


@pytest.mark.postgres
def test_process_killed_mid_migration_leaves_postgres_as_before(pg: PG) -> None:
    write_conversations(pg.store)
    expected = snapshot(pg.store())
    engine = pg.engine()
    migrate.downgrade(engine, BASELINE)
    before = pg_state(engine)
    # After 0002 has added seq/version and retyped the timestamps.
    crash_upgrade(pg.url, "create_unique_constraint", pg.schema)
    assert pg_state(engine) == before
    assert snapshot(pg.store()) == expected


# ======================================================================= 11. the turn lease (0008)

BEFORE_LEASE = "0007"
LEASE_COLUMNS = ("lease_owner", "lease_fence", "lease_expires_at")
FREE_LEASE = (None, 0, None)
SESSION_FIELDS = (
    ChatflowSession.session_id,
    ChatflowSession.active_agent_name,
    ChatflowSession.metadata_json,
    ChatflowSession.version,
    ChatflowSession.created_at,
    ChatflowSession.updated_at,
    ChatflowSession.user_id,
)
LEASE_FIELDS = (
    ChatflowSession.lease_owner,
    ChatflowSession.lease_fence,
    ChatflowSession.lease_expires_at,
)


@pytest.fixture
def mariadb_engine() -> Iterator[sa.Engine]:
    """A new, empty MariaDB database (dropped afterwards), opened as the store opens it."""
    pytest.importorskip("chatflow_sqlalchemy_mariadb", reason="the MariaDB plugin is not installed")
    raw = os.environ.get("CHATFLOW_TEST_MARIADB_URL")
    if not raw:
        pytest.skip("set CHATFLOW_TEST_MARIADB_URL=mysql+pymysql://user@host:3306/db to run it")
    server = sa.make_url(raw)
    name = f"t_{uuid.uuid4().hex}"
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
        engine = migrate.open_engine(server.set(database=name))
        try:
            yield engine
        finally:
            engine.dispose()
            with admin.connect() as conn:
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{name}`")
    finally:
        admin.dispose()


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param("postgresql", marks=pytest.mark.postgres),
        pytest.param("mariadb", marks=pytest.mark.mariadb),
    ]
)
def lease_engine(request: pytest.FixtureRequest, tmp_path: Path, engines: Any) -> sa.Engine:
    """An empty database of each dialect the core chain runs on."""
    if request.param == "postgresql":
        return request.getfixturevalue("pg").engine()
    if request.param == "mariadb":
        return request.getfixturevalue("mariadb_engine")
    return engines(migrate.open_engine(sqlite_uri(tmp_path / "lease.db")))


def seed_sessions(engine: sa.Engine) -> None:
    """Sessions and messages as a store left them before the lease, by plain inserts."""
    at = datetime(2026, 12, 1, 9, 30, 15, 123456, tzinfo=timezone.utc)
    sessions = [
        {
            "session_id": session_id,
            "active_agent_name": "triage",
            "metadata_json": {"n": n, "greeting": "olá 👋"},
            "version": 7 * n,
            "created_at": at,
            "updated_at": at + timedelta(minutes=n),
            "user_id": f"user-{n % 2}" if n else None,
        }
        for n, session_id in enumerate(SESSIONS)
    ]
    messages = [
        {
            "session_id": session["session_id"],
            "seq": seq,
            "role": "user",
            "content": f"hello {seq}",
            "message_json": json.dumps({"role": "user", "content": f"hello {seq}"}),
            "created_at": at,
        }
        for session in sessions[:-1]
        for seq in (1, 2)
    ]
    with engine.begin() as conn:
        # Only the columns named here are inserted: 0007 has no lease columns yet.
        conn.execute(sa.insert(ChatflowSession), sessions)
        conn.execute(sa.insert(ChatflowMessage), messages)


def session_rows(engine: sa.Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        query = sa.select(*SESSION_FIELDS).order_by(ChatflowSession.session_id)
        return [tuple(row) for row in conn.execute(query)]


def message_rows(engine: sa.Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        query = sa.select(
            ChatflowMessage.session_id, ChatflowMessage.seq, ChatflowMessage.message_json
        ).order_by(ChatflowMessage.session_id, ChatflowMessage.seq)
        return [tuple(row) for row in conn.execute(query)]


def leases(engine: sa.Engine) -> dict[str, tuple[Any, ...]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.select(ChatflowSession.session_id, *LEASE_FIELDS))
        return {row[0]: tuple(row[1:]) for row in rows}


def session_columns(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return {c["name"] for c in sa.inspect(conn).get_columns("chatflow_sessions")}


def assert_lease_columns_as_the_model_renders(engine: sa.Engine) -> None:
    """The lease columns are typed as the model's columns of the same types already are.

    ``drift`` does not see every difference (a MariaDB ``DATETIME`` without
    microseconds passes it), so each column is compared, as the database
    reports it, with a column the earlier revisions made from the same type.
    """
    with engine.connect() as conn:
        columns = {
            c["name"]: (c["type"].compile(dialect=conn.dialect), c["nullable"], c["default"])
            for c in sa.inspect(conn).get_columns("chatflow_sessions")
        }
        owner = ChatflowSession.__table__.c.lease_owner.type.compile(dialect=conn.dialect)
    assert columns["lease_owner"] == (owner, True, None)
    assert columns["lease_fence"] == columns["version"], "BIGINT NOT NULL DEFAULT 0"
    timestamp, _, _ = columns["updated_at"]
    assert columns["lease_expires_at"] == (timestamp, True, None)


def has_turn_lock_function(engine: sa.Engine) -> bool:
    """Whether revision 0007's function exists in the schema (PostgreSQL only)."""
    with engine.connect() as conn:
        count = conn.exec_driver_sql(
            "SELECT count(*) FROM pg_proc WHERE proname = 'chatflow_turn_lock' "
            "AND pronamespace = current_schema()::regnamespace"
        ).scalar()
    return bool(count)


def test_lease_upgrade_from_0007_keeps_every_session(lease_engine: sa.Engine) -> None:
    engine = lease_engine
    migrate.upgrade(engine, BEFORE_LEASE)
    postgres = engine.dialect.name == "postgresql"
    if postgres:
        assert has_turn_lock_function(engine), "0007 created it"
    seed_sessions(engine)
    sessions, messages = session_rows(engine), message_rows(engine)
    assert [row[0] for row in sessions] == sorted(SESSIONS) and len(messages) == 6

    migrate.upgrade(engine)
    assert version_rows(engine) == [HEAD]
    assert migrate.drift(engine) == []
    assert_lease_columns_as_the_model_renders(engine)
    assert session_rows(engine) == sessions, "every session kept, value for value"
    assert message_rows(engine) == messages
    assert leases(engine) == dict.fromkeys(SESSIONS, FREE_LEASE), "every session is free"
    assert not (postgres and has_turn_lock_function(engine)), "0008 drops the function"

    # The fence's server default serves the sessions created after the upgrade too.
    new = {"session_id": "web:new", "active_agent_name": "triage", "metadata_json": {}}
    stamp = {"created_at": datetime.now(timezone.utc), "updated_at": datetime.now(timezone.utc)}
    with engine.begin() as conn:
        conn.execute(sa.insert(ChatflowSession).values(**new, **stamp))
    assert leases(engine)["web:new"] == FREE_LEASE


def test_lease_downgrade_to_0007_and_upgrade_again(lease_engine: sa.Engine) -> None:
    engine = lease_engine
    postgres = engine.dialect.name == "postgresql"
    migrate.upgrade(engine)
    seed_sessions(engine)
    held_until = datetime.now(timezone.utc) + timedelta(seconds=30)
    with engine.begin() as conn:
        conn.execute(
            sa.update(ChatflowSession)
            .where(ChatflowSession.session_id == HANDOFF)
            .values(lease_owner="f" * 64, lease_fence=3, lease_expires_at=held_until)
        )
    sessions, messages = session_rows(engine), message_rows(engine)

    migrate.downgrade(engine, BEFORE_LEASE)
    assert version_rows(engine) == [BEFORE_LEASE]
    assert session_columns(engine).isdisjoint(LEASE_COLUMNS)
    assert message_rows(engine) == messages
    if postgres:
        assert has_turn_lock_function(engine), "the downgrade gives 0007's function back"
        with engine.begin() as conn:
            taken, version = conn.exec_driver_sql(
                "SELECT lock_taken, session_version FROM chatflow_turn_lock(42, %(sid)s, '5000')",
                {"sid": TOOL_ERROR},
            ).one()
        assert (taken, version) == (True, 7), "and it works as 0007's did"

    migrate.upgrade(engine)
    assert version_rows(engine) == [HEAD]
    assert migrate.drift(engine) == []
    assert_lease_columns_as_the_model_renders(engine)
    assert session_rows(engine) == sessions
    assert message_rows(engine) == messages
    assert leases(engine) == dict.fromkeys(SESSIONS, FREE_LEASE), "a downgrade forgets leases"
    assert not (postgres and has_turn_lock_function(engine))
