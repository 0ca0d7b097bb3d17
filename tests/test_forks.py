"""Forks beyond the conformance kit (``testing/forks_suite.py``), on real databases.

On a SQLite file, PostgreSQL, MariaDB (through its plugin) and the in-memory
store: what the kit cannot say for every backend. Key rotation re-seals
summaries (the fork's under its own id), two forks racing for one new id
leave exactly one whole fork, a corrupt or unborn source writes nothing, and
``export_user`` shows the summary beside the window on every store alike.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Role
from sqlalchemy import text

from chatflow_sqlalchemy.crypto import AESGCMCipher
from chatflow_sqlalchemy.exceptions import CorruptRowError

from .stores import Opener

_HANG_GUARD = 60.0
_K1, _K2 = os.urandom(32), os.urandom(32)



def _agent() -> Agent:
    return Agent(name="bot", instructions="")


def _turns(ctx: Any, first: int, last: int) -> None:
    for n in range(first, last):
        ctx.add_message(Message(role=Role.USER, content=f"u{n}"))
        ctx.add_message(Message(role=Role.MODEL, content=f"m{n}"))


async def _summarize(previous: str | None, dropped: list[Message]) -> str:
    return ",".join([*([previous] if previous else []), *(str(m.content) for m in dropped)])


def _summarized(store: Any, session_id: str, **kwargs: Any) -> Any:
    """A session of four turns whose first two were pruned and summarized (window: 2)."""
    ctx = store.get_or_create(session_id, _agent(), **kwargs)
    _turns(ctx, 0, 4)
    assert store.wait_for_summaries(_HANG_GUARD)
    assert ctx.summary == "u0,m0,u1,m1"
    return ctx


def _raw(store: Any, sql: str, **params: Any) -> list[Any]:
    with store.engine.connect() as conn:
        return list(conn.execute(text(sql), params))


def _cipher(*ids: str) -> AESGCMCipher:
    keys = {"k1": _K1, "k2": _K2}
    return AESGCMCipher({i: keys[i] for i in ids}, ids[0])


def test_rotation_reseals_summaries_each_under_its_own_session(sql_store: Opener) -> None:
    store = sql_store(cipher=_cipher("k1"), summarizer=_summarize, default_max_turns=2)
    _summarized(store, "src")
    fork = store.fork("src", "fork", at_turn=1)
    assert fork.summary == "u0,m0,u1,m1"
    plain = sql_store(summarizer=_summarize, default_max_turns=2)
    _summarized(plain, "plain")  # written without a cipher: rotation encrypts it
    sealed = dict(_raw(store, "SELECT session_id, summary FROM chatflow_sessions"))
    assert sealed["src"].startswith("cfenc:1:k1:") and sealed["fork"].startswith("cfenc:1:k1:")
    assert "u0,m0" not in sealed["fork"] and not sealed["plain"].startswith("cfenc:")
    assert _cipher("k1").decrypt(sealed["fork"], "fork") == "u0,m0,u1,m1", "sealed for the fork"
    rotating = sql_store(cipher=_cipher("k2", "k1"))
    assert rotating.rotate_keys(batch=1) > 0
    resealed = dict(_raw(store, "SELECT session_id, summary FROM chatflow_sessions"))
    assert all(value.startswith("cfenc:1:k2:") for value in resealed.values()), resealed
    assert rotating.rotate_keys() == 0, "nothing is left under the old key"
    only_k2 = sql_store(cipher=_cipher("k2"), require_encryption=True)
    for session_id in ("src", "fork", "plain"):
        again = only_k2.get(session_id)
        assert again.summary == "u0,m0,u1,m1"
        assert again.history[0].role == Role.SYSTEM
    assert only_k2.get("fork").forked_from == "src"


def test_two_forks_racing_for_one_id_leave_one_whole_fork(sql_store: Opener) -> None:
    first, second = sql_store(), sql_store()
    _turns(first.get_or_create("a", _agent()), 0, 3)
    _turns(first.get_or_create("b", _agent()), 10, 12)
    barrier = threading.Barrier(2)
    outcomes: dict[str, Any] = {}

    def fork(store: Any, source: str) -> None:
        barrier.wait(_HANG_GUARD)
        try:
            outcomes[source] = store.fork(source, "target")
        except ValueError as exc:
            outcomes[source] = exc

    threads = [threading.Thread(target=fork, args=(s, src)) for s, src in ((first, "a"),
                                                                           (second, "b"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(_HANG_GUARD)
        assert not thread.is_alive(), "a fork hung"
    won = [src for src, got in outcomes.items() if not isinstance(got, Exception)]
    lost = [got for got in outcomes.values() if isinstance(got, Exception)]
    assert len(won) == 1 and len(lost) == 1, outcomes
    assert "exists" in str(lost[0])
    fresh = sql_store()
    target = fresh.get("target")
    assert target.forked_from == won[0]
    expected = fresh.get(won[0]).history
    assert [m.content for m in target.history] == [m.content for m in expected]
    rows = _raw(fresh, "SELECT COUNT(*) FROM chatflow_messages WHERE session_id = 'target'")
    assert rows[0][0] == len(expected), "no row of the other fork is left"


def test_a_corrupt_source_writes_nothing(sql_store: Opener) -> None:
    store = sql_store()
    _turns(store.get_or_create("src", _agent()), 0, 2)
    with store.engine.begin() as conn:
        conn.execute(text(
            "UPDATE chatflow_messages SET message_json = 'not json' "
            "WHERE session_id = 'src' AND content = 'm1'"
        ))
    with pytest.raises(CorruptRowError):
        store.fork("src", "copy")
    assert _raw(store, "SELECT session_id FROM chatflow_sessions") == [("src",)]
    assert _raw(store, "SELECT COUNT(*) FROM chatflow_messages WHERE session_id = 'copy'") == [
        (0,)
    ]


def test_a_session_the_inbox_made_before_its_first_turn_is_no_source(
    sql_store: Opener,
) -> None:
    store = sql_store()
    store.get_or_create("real", _agent())
    with store.engine.begin() as conn:  # as the inbox leaves it: no agent chosen yet
        conn.execute(text(
            "INSERT INTO chatflow_sessions (session_id, active_agent_name, metadata_json, "
            "version, created_at, updated_at) SELECT 'unborn', '', metadata_json, 1, "
            "created_at, updated_at FROM chatflow_sessions WHERE session_id = 'real'"
        ))
    with pytest.raises(ValueError, match="no such session"):
        store.fork("unborn", "copy")
    with pytest.raises(ValueError, match="exists"):
        store.fork("real", "unborn")  # its id is taken all the same
    assert store.get("copy") is None


def test_export_shows_the_summary_beside_the_window_on_every_store(any_store: Opener) -> None:
    store = any_store(summarizer=_summarize, default_max_turns=2)
    source = _summarized(store, "src", user_id="ann")
    fork = store.fork("src", "fork", at_turn=1)
    document = store.export_user("ann")
    by_id = {s["session_id"]: s for s in document["sessions"]}
    assert sorted(by_id) == ["fork", "src"]
    for ctx in (source, fork):
        exported = by_id[ctx.session_id]
        assert exported["summary"] == "u0,m0,u1,m1"
        window = [m for m in ctx.history if m.role != Role.SYSTEM]  # the summary is no message
        assert exported["messages"] == [m.model_dump(mode="json") for m in window]
    assert (by_id["fork"]["forked_from"], by_id["fork"]["forked_at_turn"]) == ("src", 1)
    assert (by_id["src"]["forked_from"], by_id["src"]["forked_at_turn"]) == (None, None)
    assert [m["content"] for m in by_id["fork"]["messages"]] == ["u2", "m2"]


def test_a_fork_made_while_its_source_waits_for_a_summary_gets_that_summary_too(
    any_store: Opener,
) -> None:
    """Turns pruned but not yet summarized when the fork is made reach the fork's summary."""
    gate = threading.Event()

    async def summarizer(previous: str | None, dropped: list[Message]) -> str:
        await asyncio.to_thread(gate.wait, _HANG_GUARD)
        said = [m.content or "" for m in dropped if m.role == Role.USER]
        return " | ".join([previous, *said] if previous else said)

    store = any_store(default_max_turns=1, summarizer=summarizer)
    source = store.get_or_create("src", _agent())
    for said in ("order 4711", "hello"):
        source.add_message(Message(role=Role.USER, content=said))
        source.add_message(Message(role=Role.MODEL, content="ok"))
    assert source.summary is None  # its summary waits at the gate
    fork = store.fork("src", "dst")
    assert fork.summary is None
    gate.set()
    assert store.wait_for_summaries(_HANG_GUARD)
    assert store.get("dst").summary == "order 4711"
    assert store.get("src").summary == "order 4711"
