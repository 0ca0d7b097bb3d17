"""Conformance tests of forks: ``store.fork`` / ``afork`` and ``list_sessions(forked_from=)``.

:class:`ForkTests` is a mixin without fixtures; :mod:`chatflow_sqlalchemy.testing.suite`
combines it with its ``StoreTestBase`` as ``TestForks``, which its ``*`` import
brings to a backend's tests. Every test requires
:attr:`~chatflow_sqlalchemy.testing.harness.Capability.FORKS`; a backend that
has not implemented forks leaves it out and the tests are skipped with that
reason. Tests that also need a restart, a user scope or encryption require
those capabilities too.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Role, ToolCall, ToolResult

from chatflow_sqlalchemy.testing.harness import Capability, StoreHarness, requires

__all__ = ["ForkTests"]

SUMMARY_WAIT_SECONDS = 60.0
"""A hang guard for the background summaries (they take milliseconds)."""


def _agent(name: str = "support") -> Agent:
    return Agent(name=name, instructions="help", model="gemini-2.5-flash")


def _uid() -> str:
    return f"f{uuid.uuid4().hex[:12]}"


def _add_turns(ctx: Any, first: int, last: int) -> None:
    """Add turns ``first..last-1`` (USER + MODEL; every third with a tool call and its result)."""
    for n in range(first, last):
        ctx.add_message(Message(role=Role.USER, content=f"u{n}"))
        if n % 3 == 0:
            call = ToolCall(id=f"call-{n}", name="lookup", args={"n": n})
            ctx.add_message(Message(role=Role.MODEL, content=None, tool_calls=[call]))
            result = ToolResult(tool_call_id=call.id, name=call.name, content={"n": n})
            ctx.add_message(Message(role=Role.TOOL, tool_results=[result]))
        ctx.add_message(Message(role=Role.MODEL, content=f"m{n}"))


def _source(store: Any, turns: int = 3, **kwargs: Any) -> Any:
    """A session with a SYSTEM message, ``turns`` turns, metadata and a handed-off agent."""
    ctx = store.get_or_create(_uid(), _agent(), {"tier": "gold", "tags": ["a"]}, **kwargs)
    ctx.add_message(Message(role=Role.SYSTEM, content="be brief"))
    _add_turns(ctx, 0, turns)
    ctx.set_active_agent(_agent("billing"))
    return ctx


def _shape(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages without their timestamps (a copy is compared with its original)."""
    return [m.model_dump(mode="json", exclude={"timestamp"}) for m in messages]


def _contents(messages: list[Message]) -> list[str | None]:
    return [m.content for m in messages]


def _user_turns(messages: list[Message]) -> int:
    return sum(1 for m in messages if m.role == Role.USER)


async def _summarize(previous: str | None, dropped: list[Message]) -> str:
    """A summarizer any test can predict: the previous summary, then the dropped contents."""
    return ",".join([*([previous] if previous else []), *(str(m.content) for m in dropped)])


@requires(Capability.FORKS)
class ForkTests:
    """A fork is a new session holding a copy of another's first turns; the source stays."""

    def test_fork_takes_every_turn_and_leaves_the_source_as_it_was(self, store: Any) -> None:
        source = _source(store)
        before = _shape(source.history)
        fork = store.fork(source.session_id, f"{source.session_id}-b")
        assert _shape(fork.history) == before
        assert fork.session_id == f"{source.session_id}-b"
        assert fork.active_agent.name == "billing"
        assert fork.metadata == {"tier": "gold", "tags": ["a"]}
        assert (fork.forked_from, fork.forked_at_turn) == (source.session_id, 3)
        assert (source.forked_from, source.forked_at_turn) == (None, None)
        fork.metadata["tier"] = "basic"
        _add_turns(fork, 10, 11)
        assert _shape(source.history) == before, "the source never changes"
        assert source.metadata == {"tier": "gold", "tags": ["a"]}
        assert _contents(fork.history)[-2:] == ["u10", "m10"]
        assert store.get(fork.session_id) is fork

    def test_fork_at_turn_takes_the_system_messages_and_the_first_turns(
        self, store: Any
    ) -> None:
        source = _source(store, turns=4)
        none = store.fork(source.session_id, _uid(), at_turn=0)
        assert _contents(none.history) == ["be brief"]
        assert none.forked_at_turn == 0
        two = store.fork(source.session_id, _uid(), at_turn=2)
        assert _contents(two.history) == ["be brief", "u0", None, None, "m0", "u1", "m1"]
        assert (two.forked_from, two.forked_at_turn) == (source.session_id, 2)
        _add_turns(two, 7, 8)
        assert _contents(two.history)[-2:] == ["u7", "m7"]
        assert _user_turns(source.history) == 4
        every = store.fork(source.session_id, _uid(), at_turn=4)
        assert _shape(every.history) == _shape(source.history)

    def test_fork_of_a_fork_and_list_sessions_forked_from(self, store: Any) -> None:
        source = _source(store)
        first = store.fork(source.session_id, f"{source.session_id}-1", at_turn=2)
        second = store.fork(source.session_id, f"{source.session_id}-2")
        grandchild = store.fork(first.session_id, f"{source.session_id}-1a", at_turn=1)
        assert (grandchild.forked_from, grandchild.forked_at_turn) == (first.session_id, 1)
        assert _contents(grandchild.history) == ["be brief", "u0", None, None, "m0"]
        assert sorted(store.list_sessions(forked_from=source.session_id)) == sorted(
            [first.session_id, second.session_id]
        )
        assert store.list_sessions(forked_from=first.session_id) == [grandchild.session_id]
        assert store.list_sessions(forked_from=grandchild.session_id) == []
        paged = store.list_sessions(forked_from=source.session_id, limit=1)
        assert paged == [first.session_id], "paged by session id, as every listing"
        with pytest.raises(ValueError, match="forked_from"):
            store.list_sessions(forked_from="")

    @requires(Capability.PERSISTENT)
    def test_a_fork_reloads_with_where_it_came_from(self, harness: StoreHarness) -> None:
        store: Any = harness.open()
        try:
            source = _source(store)
            fork = store.fork(source.session_id, _uid(), at_turn=1)
            expected = _shape(fork.history)
        finally:
            store.close()
        fresh: Any = harness.open()
        try:
            again = fresh.get(fork.session_id)
            assert again is not None
            assert (again.forked_from, again.forked_at_turn) == (source.session_id, 1)
            assert _shape(again.history) == expected
            assert again.active_agent.name == "billing"
            assert again.metadata == {"tier": "gold", "tags": ["a"]}
            assert fresh.list_sessions(forked_from=source.session_id) == [fork.session_id]
            _add_turns(again, 5, 6)
            assert _user_turns(fresh.get(source.session_id).history) == 3
        finally:
            fresh.close()

    def test_an_existing_id_is_refused_and_nothing_is_written(self, store: Any) -> None:
        source = _source(store)
        taken = store.get_or_create(_uid(), _agent())
        taken.add_message(Message(role=Role.USER, content="mine"))
        before = sorted(store.list_sessions())
        with pytest.raises(ValueError, match="exists"):
            store.fork(source.session_id, taken.session_id)
        assert sorted(store.list_sessions()) == before
        assert _contents(store.get(taken.session_id).history) == ["mine"]
        assert taken.forked_from is None
        assert store.list_sessions(forked_from=source.session_id) == []

    def test_bad_arguments_say_what_to_pass(self, store: Any) -> None:
        source = _source(store, turns=2)
        before = sorted(store.list_sessions())
        cases: list[tuple[dict[str, Any], str]] = [
            ({"at_turn": -1}, "at_turn"),
            ({"at_turn": True}, "at_turn"),
            ({"at_turn": 1.0}, "at_turn"),
            ({"at_turn": "1"}, "at_turn"),
            ({"at_turn": 3}, "pass at_turn from 0 to 2"),
        ]
        for kwargs, needle in cases:
            with pytest.raises(ValueError, match=needle):
                store.fork(source.session_id, _uid(), **kwargs)
        with pytest.raises(ValueError, match="no such session"):
            store.fork(_uid(), _uid())
        with pytest.raises(ValueError, match="a fork is a new session"):
            store.fork(source.session_id, source.session_id)
        with pytest.raises(ValueError, match="new_session_id"):
            store.fork(source.session_id, "")
        assert sorted(store.list_sessions()) == before, "a refused fork writes nothing"

    def test_a_turn_running_on_the_source_is_not_in_the_fork(self, store: Any) -> None:
        source = _source(store, turns=1)

        async def turn() -> Any:
            async with source.lock:
                source.add_message(Message(role=Role.USER, content="in flight"))
                return store.fork(source.session_id, _uid())

        fork = asyncio.run(turn())
        assert "in flight" not in _contents(fork.history)
        assert _contents(source.history)[-1] == "in flight", "the source's turn was written"

    def test_a_tool_call_still_waiting_for_its_result_is_not_copied(self, store: Any) -> None:
        source = _source(store, turns=1)
        source.add_message(Message(role=Role.USER, content="check"))
        call = ToolCall(id="call-waiting", name="lookup", args={})
        source.add_message(Message(role=Role.MODEL, content=None, tool_calls=[call]))
        fork = store.fork(source.session_id, _uid())
        assert _contents(fork.history)[-1] == "check", "its result would never reach the fork"
        assert fork.forked_at_turn == 2
        assert source.history[-1].tool_calls, "the source keeps it: its result comes there"

    def test_afork_and_alist_sessions(self, store: Any) -> None:
        source = _source(store, turns=2)

        async def main() -> tuple[Any, list[str]]:
            fork = await store.afork(source.session_id, _uid(), at_turn=1)
            return fork, await store.alist_sessions(forked_from=source.session_id)

        fork, listed = asyncio.run(main())
        assert listed == [fork.session_id]
        assert fork.forked_at_turn == 1

    def test_the_summary_is_carried(self, harness: StoreHarness) -> None:
        store: Any = harness.open(summarizer=_summarize, default_max_turns=2)
        try:
            source = store.get_or_create(_uid(), _agent())
            source.add_message(Message(role=Role.SYSTEM, content="be brief"))
            _add_turns(source, 1, 5)  # four turns: two pruned, then summarized
            assert store.wait_for_summaries(SUMMARY_WAIT_SECONDS)
            assert source.summary == "u1,m1,u2,m2"
            fork = store.fork(source.session_id, _uid(), at_turn=1)
            assert (fork.summary, fork.summary_through) == (
                source.summary, source.summary_through
            )
            assert _contents(fork.history)[0] == "be brief"
            assert fork.history[1].role == Role.SYSTEM and "u1,m1,u2,m2" in str(
                fork.history[1].content
            )
            assert _contents(fork.history)[2:] == ["u3", None, None, "m3"]
            _add_turns(fork, 7, 9)  # prunes the fork's own first turn: its summary grows
            assert store.wait_for_summaries(SUMMARY_WAIT_SECONDS)
            assert fork.summary is not None and fork.summary.startswith("u1,m1,u2,m2,u3")
            assert source.summary == "u1,m1,u2,m2", "the source's summary is its own"
            expected = (fork.summary, _shape(fork.history))
        finally:
            store.close()
        if harness.has(Capability.PERSISTENT):
            fresh: Any = harness.open()
            try:
                again = fresh.get(fork.session_id)
                assert (again.summary, _shape(again.history)) == expected
            finally:
                fresh.close()

    @requires(Capability.USER_SCOPE)
    def test_forks_belong_to_the_user_export_and_erase(self, store: Any) -> None:
        user = _uid()
        source = _source(store, turns=2, user_id=user)
        fork = store.fork(source.session_id, _uid(), at_turn=1)
        assert sorted(store.list_sessions(user_id=user)) == sorted(
            [source.session_id, fork.session_id]
        )
        exported = store.export_user(user)
        assert json.loads(json.dumps(exported)) == exported
        by_id = {s["session_id"]: s for s in exported["sessions"]}
        assert by_id[fork.session_id]["forked_from"] == source.session_id
        assert by_id[fork.session_id]["forked_at_turn"] == 1
        assert by_id[fork.session_id]["summary"] is None
        assert by_id[fork.session_id]["messages"] == [
            m.model_dump(mode="json") for m in fork.history
        ]
        assert by_id[source.session_id]["forked_from"] is None
        assert store.erase_user(user) == 2
        assert store.get(fork.session_id) is None
        assert store.list_sessions(forked_from=source.session_id) == []

    @requires(Capability.ENCRYPTION, Capability.SQL)
    def test_an_encrypted_fork_is_sealed_for_its_own_id(self, harness: StoreHarness) -> None:
        from sqlalchemy import text

        from chatflow_sqlalchemy.crypto import AESGCMCipher

        cipher = AESGCMCipher({"k1": os.urandom(32)}, "k1")
        store: Any = harness.open(cipher=cipher, require_encryption=True)
        try:
            source = _source(store, turns=2)
            fork = store.fork(source.session_id, _uid())
            expected = _shape(fork.history)
            with store.engine.connect() as conn:
                rows = conn.execute(text(
                    "SELECT message_json FROM chatflow_messages WHERE session_id = :s"
                ), {"s": fork.session_id}).scalars().all()
            assert rows and all(row.startswith("cfenc:1:k1:") for row in rows)
            opened = [cipher.decrypt(row, fork.session_id) for row in rows]  # its own id
            decoded = [Message.model_validate_json(text) for text in opened]
            assert {m.content for m in decoded} == {m.content for m in fork.history}
        finally:
            store.close()
        if harness.has(Capability.PERSISTENT):
            fresh: Any = harness.open(cipher=cipher, require_encryption=True)
            try:
                again = fresh.get(fork.session_id)
                assert _shape(again.history) == expected
                assert again.metadata == {"tier": "gold", "tags": ["a"]}
            finally:
                fresh.close()
