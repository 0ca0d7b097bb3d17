"""The README's promise about upstream's reader: what 0002 breaks, and the way back.

A file written by the real ``chatflow_agent.SQLiteSessionStore`` is adopted (opened
by this project's store, migrated to head) and used; upstream's store then cannot
open a session in it (``NOT NULL constraint failed: chatflow_sessions.created_at``).
``db downgrade 0001`` (``migrate.downgrade``, what the CLI runs) gives it back: the
real upstream store reads every session, writes new turns, sessions and dedup ids,
and this project's store adopts the result again.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import chatflow_agent
import pytest
from chatflow_agent import Agent, Message, Role, Runner

from chatflow_sqlalchemy import SQLiteSessionStore, migrate
from chatflow_sqlalchemy.testing import ScriptedEngine
from tests.test_migrations import (
    BASELINE,
    HANDOFF,
    HEAD,
    check_conversations,
    make_agents,
    snapshot,
    upstream_file,
    version_rows,
)


def history_of(store: Any, session_id: str) -> list[tuple[str, str | None]]:
    store.set_agent_resolver(make_agents().get)
    ctx = store.get(session_id)
    assert ctx is not None, session_id
    return [(m.role.value, m.content) for m in ctx.history]


def test_upstream_reads_and_writes_again_after_downgrade_to_0001(tmp_path: Path) -> None:
    db = upstream_file(tmp_path / "upstream.db")
    written_by_upstream = snapshot(chatflow_agent.SQLiteSessionStore(str(db)))
    check_conversations(written_by_upstream)

    # Adopted and used by this project: migrated to head on open, one more turn.
    with SQLiteSessionStore(db) as ours:
        ours.set_agent_resolver(make_agents().get)
        ctx = ours.get(HANDOFF)
        assert ctx is not None
        ctx.add_message(Message(role=Role.USER, content="written at 0002"))
        assert ours.record_processed_message("wamid.ours")
    engine = migrate.open_engine(f"sqlite:///{db}")
    try:
        assert version_rows(engine) == [HEAD]

        # What the README states: upstream's store cannot open a session any more.
        upstream = chatflow_agent.SQLiteSessionStore(str(db))
        with pytest.raises(sqlite3.IntegrityError,
                           match=r"NOT NULL constraint failed: chatflow_sessions\.created_at"):
            upstream.get(HANDOFF)
        with pytest.raises(sqlite3.IntegrityError, match=r"chatflow_sessions\.created_at"):
            upstream.get_or_create("brand-new", Agent(name="triage", instructions=""))

        migrate.downgrade(engine, BASELINE)  # chatflow-sqlalchemy db downgrade 0001
        assert version_rows(engine) == [BASELINE]
    finally:
        engine.dispose()

    # Upstream reads everything, including what this project wrote at 0002 ...
    upstream = chatflow_agent.SQLiteSessionStore(str(db))
    back = snapshot(upstream)
    assert back["sessions"].keys() == written_by_upstream["sessions"].keys()
    assert history_of(upstream, HANDOFF)[-1] == ("user", "written at 0002")
    assert upstream.is_message_processed("wamid.ours")

    # ... and writes: a Runner turn on an old session, a new session, a dedup id.
    agents = make_agents()
    runner = Runner(starting_agent=agents["triage"], session_store=upstream,
                    engine=ScriptedEngine())
    upstream.set_agent_resolver(agents.get)

    async def turns() -> None:
        await runner.run_async(HANDOFF, "back on upstream")
        await runner.run_async("after-downgrade", "hello from upstream")

    asyncio.run(turns())
    assert upstream.record_processed_message("wamid.upstream-again")

    reread = chatflow_agent.SQLiteSessionStore(str(db))
    assert ("user", "back on upstream") in history_of(reread, HANDOFF)
    assert history_of(reread, "after-downgrade")[0] == ("user", "hello from upstream")
    assert reread.is_message_processed("wamid.upstream-again")

    # This project adopts the file again, with everything upstream wrote.
    with SQLiteSessionStore(db) as ours:
        assert ("user", "back on upstream") in history_of(ours, HANDOFF)
        assert history_of(ours, "after-downgrade")[0] == ("user", "hello from upstream")
        assert ours.is_message_processed("wamid.upstream-again")
