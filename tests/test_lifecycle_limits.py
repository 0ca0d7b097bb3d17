"""Edges of sweep ``limit``, ``require_encryption`` and ``delete`` the conformance kit leaves open.

On a real SQLite file: ``sweep(limit=N)`` removes exactly N of more expired
sessions, a plaintext message row under sealed metadata is refused, and a
``delete`` one part of which fails removes nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from chatflow_agent import Agent, Message, Role
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from chatflow_sqlalchemy import open_store
from chatflow_sqlalchemy.crypto import AESGCMCipher
from chatflow_sqlalchemy.exceptions import CorruptRowError

TTL_HOURS = 0.0002
"""Sessions expire 0.72 s after their last write."""

EXPIRED_AFTER = 1.0
"""Seconds after which sessions last written now are expired under :data:`TTL_HOURS`."""


def _agent() -> Agent:
    return Agent(name="a", instructions="", model="gemini-2.5-flash")


def test_sweep_limit_removes_exactly_that_many(tmp_path: Path) -> None:
    with open_store(f"sqlite:///{tmp_path / 's.db'}", session_ttl_hours=TTL_HOURS) as store:
        for n in range(5):
            store.get_or_create(f"s{n}", _agent())
        time.sleep(EXPIRED_AFTER)
        assert store.sweep(limit=2) == 2
        assert len(store.list_sessions()) == 3
        assert store.sweep(limit=1) == 1
        assert store.sweep() == 2


def test_a_delete_that_fails_in_part_removes_nothing(tmp_path: Path) -> None:
    """``delete`` removes a session, its messages, claims and inbox messages in one transaction.

    A trigger refuses to delete inbox rows (the last part deleted): the session
    keeps its messages and its claim too, and the store keeps serving it.
    """
    with open_store(f"sqlite:///{tmp_path / 'd.db'}") as store:
        store.get_or_create("d", _agent()).add_message(Message(role=Role.USER, content="hi"))
        with store.claim("wamid.d", session_id="d") as claim:
            claim.response = "hello"
        store.inbox.put("in.d", session_id="d", text="my address")
        refuse = ("CREATE TRIGGER keep BEFORE DELETE ON chatflow_inbox "
                  "BEGIN SELECT RAISE(ABORT, 'kept'); END")
        with store.engine.begin() as conn:
            conn.execute(text(refuse))
        with pytest.raises(DBAPIError, match="kept"):
            store.delete("d")
        ctx = store.get("d")
        assert ctx is not None and [m.content for m in ctx.history] == ["hi"]
        assert store.is_message_processed("wamid.d")
        assert [e.message_id for e in store.inbox.entries(limit=None)] == ["in.d"]
        with store.engine.begin() as conn:
            conn.execute(text("DROP TRIGGER keep"))
        assert store.delete("d") is True
        assert store.get("d") is None and not store.is_message_processed("wamid.d")
        assert store.inbox.entries(limit=None) == []


def test_require_encryption_refuses_a_plaintext_message_row(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'e.db'}"
    cipher = AESGCMCipher({"k1": os.urandom(32)}, "k1")
    plain = Message(role=Role.USER, content="in clear").model_dump_json()
    with open_store(url, cipher=cipher) as store:
        store.get_or_create("e", _agent(), {"a": 1}).add_message(
            Message(role=Role.USER, content="sealed")
        )
        with store.engine.begin() as conn:  # sealed metadata, one message row in clear
            conn.execute(text("UPDATE chatflow_messages SET message_json = :p"), {"p": plain})
    with open_store(url, cipher=cipher, require_encryption=True) as strict:
        with pytest.raises(CorruptRowError, match="require_encryption") as info:
            strict.get("e")
        assert info.value.table == "chatflow_messages"


def test_keys_rotate_seals_metadata_holding_json_null_and_strict_stores_name_the_fix(
    tmp_path: Path,
) -> None:
    """Metadata in clear is sealed by ``keys rotate`` whatever JSON it holds, ``null`` too.

    A store with ``require_encryption`` refuses it until then, naming ``keys rotate``.
    """
    url = f"sqlite:///{tmp_path / 'n.db'}"
    k1 = AESGCMCipher({"k1": os.urandom(32)}, "k1")
    with open_store(url, cipher=k1) as store:
        store.get_or_create("n", _agent(), {"a": 1})
        with store.engine.begin() as conn:  # metadata written in clear by something else
            conn.execute(text("UPDATE chatflow_sessions SET metadata_json = 'null'"))
    with (
        open_store(url, cipher=k1, require_encryption=True) as strict,
        pytest.raises(CorruptRowError, match="keys rotate"),
    ):
        strict.get("n")
    with open_store(url, cipher=k1) as store:
        assert store.rotate_keys() == 1
        assert store.rotate_keys() == 0, "the row was left in clear"
        with store.engine.connect() as conn:
            stored = conn.execute(text("SELECT metadata_json FROM chatflow_sessions")).scalar()
        assert "null" not in str(stored) and "cfenc:" in str(stored)


def test_a_turn_on_a_session_swept_elsewhere_fails_at_its_start(tmp_path: Path) -> None:
    # SQLite has no turn locks: the turn's first statement moves updated_at. When that
    # touch finds no row (another store swept the session since get_or_create checked
    # it), the turn must not run on a removed session and fail only at its write.
    import asyncio

    from chatflow_sqlalchemy.exceptions import SessionDeletedError

    url = f"sqlite:///{tmp_path / 't.db'}"
    with open_store(url, session_ttl_hours=TTL_HOURS) as sweeper, open_store(
        url, session_ttl_hours=TTL_HOURS
    ) as worker:
        sweeper.get_or_create("s", _agent()).add_message(Message(role=Role.USER, content="q"))
        ctx = worker.get_or_create("s", _agent())
        time.sleep(EXPIRED_AFTER)
        assert worker.get_or_create("s", _agent()) is ctx  # verified again: it exists
        assert sweeper.sweep() == 1
        ran: list[bool] = []

        async def turn() -> None:
            async with ctx.lock:
                ran.append(True)
                ctx.add_message(Message(role=Role.USER, content="lost"))

        with pytest.raises(SessionDeletedError):
            asyncio.run(turn())
        assert ran == [], "the turn ran on a session removed before it started"
