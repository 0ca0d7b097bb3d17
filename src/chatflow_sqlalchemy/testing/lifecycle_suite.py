"""Conformance tests of "Lifecycle and data governance": per-user scope, filters, pages, GDPR.

The classes here are mixins without fixtures; :mod:`chatflow_sqlalchemy.testing.suite`
combines them with its ``StoreTestBase`` as ``TestUserScope`` and
``TestErasureAndExport``, which its ``*`` import brings to a backend's tests. Every test requires
:attr:`~chatflow_sqlalchemy.testing.harness.Capability.USER_SCOPE`; a backend
that has not implemented ``list_sessions`` filters, ``user_id``,
``erase_user`` and ``export_user`` leaves it out and the tests are skipped
with that reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Role, Runner, ToolCall, ToolResult

from chatflow_sqlalchemy.claims import list_claims
from chatflow_sqlalchemy.exceptions import (
    ClaimLostError,
    CorruptRowError,
    LeaseLostError,
    SessionDeletedError,
)
from chatflow_sqlalchemy.testing.engines import ScriptedEngine
from chatflow_sqlalchemy.testing.harness import (
    Capability,
    StoreHarness,
    StoreSpec,
    requires,
    run_workers,
    worker_context,
    worker_process,
)

__all__ = [
    "ArchiveTests",
    "EncryptionTests",
    "ErasureAndExportTests",
    "RetentionTests",
    "UserScopeTests",
    "encrypted_turns_worker",
    "sweep_worker",
    "turn_holder",
]

TINY_TTL_HOURS = 0.001
"""3.6 seconds: sessions created before a ``time.sleep(EXPIRE_SECONDS)`` are expired."""
EXPIRE_SECONDS = 4.0

SHORT_TTL_HOURS = 0.0001
"""0.36 seconds, for tests where no session has to stay fresh (live turns and claims
protect theirs): sessions created before a ``time.sleep(SHORT_EXPIRE_SECONDS)`` are
expired, with a second to spare for timestamps stored to the second."""
SHORT_EXPIRE_SECONDS = 1.5


def _agent() -> Agent:
    return Agent(name="support", instructions="help", model="gemini-2.5-flash")


def _uid() -> str:
    return f"u{uuid.uuid4().hex[:12]}"


def _sid(prefix: str, n: int) -> str:
    return f"{prefix}{n:04d}"


@requires(Capability.USER_SCOPE)
class UserScopeTests:
    """``get_or_create(..., user_id=)`` and ``list_sessions`` filters and keyset pages."""

    def test_no_arguments_is_the_old_call(self, store: Any) -> None:
        user = _uid()
        first = store.get_or_create(f"{user}a", _agent(), user_id=user)
        time.sleep(0.02)
        store.get_or_create(f"{user}b", _agent())
        time.sleep(0.02)
        first.add_message(Message(role=Role.USER, content="hi"))
        listed = store.list_sessions()
        assert listed.index(f"{user}a") < listed.index(f"{user}b"), "most recent first"

    def test_user_id_filters_and_is_recorded_once(self, harness: StoreHarness, store: Any) -> None:
        alice, bob = _uid(), _uid()
        for n in range(3):
            store.get_or_create(_sid(alice, n), _agent(), user_id=alice)
            time.sleep(0.01)
        store.get_or_create(_sid(bob, 0), _agent(), user_id=bob)
        store.get_or_create(_sid(bob, 1), _agent())  # no owner yet
        assert store.list_sessions(user_id=alice) == [_sid(alice, n) for n in (2, 1, 0)]
        assert store.list_sessions(user_id=bob) == [_sid(bob, 0)]
        store.get_or_create(_sid(bob, 1), _agent(), user_id=bob)  # recorded on an ownerless one
        assert sorted(store.list_sessions(user_id=bob)) == [_sid(bob, 0), _sid(bob, 1)]
        with pytest.raises(ValueError, match="another user_id"):
            store.get_or_create(_sid(bob, 1), _agent(), user_id=alice)
        store.get_or_create(_sid(bob, 1), _agent(), user_id=bob)  # its own owner: fine
        if harness.has(Capability.PERSISTENT):
            fresh: Any = harness.open()
            try:
                assert sorted(fresh.list_sessions(user_id=bob)) == [_sid(bob, 0), _sid(bob, 1)]
            finally:
                fresh.close()

    def test_metadata_values_compare_by_json_type(self, store: Any) -> None:
        user = _uid()
        rows = {
            "a": {"channel": "whatsapp", "n": 1, "flag": True, "tags": [1, 2], "obj": {"a": 1}},
            "b": {"channel": "web", "n": "1", "flag": 1, "tags": [1], "x": None},
            "c": {"n": 1.0, "obj": {"a": 1, "b": 2}, "quote": 'say "hi"'},
        }
        for suffix, meta in rows.items():
            store.get_or_create(f"{user}{suffix}", _agent(), meta, user_id=user)

        def found(**wanted: Any) -> list[str]:
            ids = store.list_sessions(user_id=user, metadata=wanted, limit=50)
            return [sid.removeprefix(user) for sid in ids]

        assert found(channel="whatsapp") == ["a"]
        assert found(n=1) == ["a", "c"]
        assert found(n="1") == ["b"]
        assert found(flag=True) == ["a"]
        assert found(flag=1) == ["b"]
        assert found(tags=[1]) == ["b"], "arrays must be equal, not merely contain"
        assert found(obj={"a": 1}) == ["a"], "objects must be equal, not merely contain"
        assert found(x=None) == ["b"], "null matches null, not a missing key"
        assert found(quote='say "hi"') == ["c"]
        assert found(channel="whatsapp", n=2) == []
        assert found(missing="x") == []
        unpaged = store.list_sessions(user_id=user, metadata={"n": 1})
        assert sorted(unpaged) == [f"{user}a", f"{user}c"]

    def test_updated_after(self, store: Any) -> None:
        user = _uid()
        old = store.get_or_create(f"{user}old", _agent(), user_id=user)
        time.sleep(0.05)
        cut = datetime.now(timezone.utc)
        time.sleep(0.05)
        store.get_or_create(f"{user}new", _agent(), user_id=user)
        assert store.list_sessions(user_id=user, updated_after=cut) == [f"{user}new"]
        old.add_message(Message(role=Role.USER, content="back"))
        assert store.list_sessions(user_id=user, updated_after=cut) == [f"{user}old", f"{user}new"]
        later = cut + timedelta(days=1)
        assert store.list_sessions(user_id=user, updated_after=later) == []

    def test_keyset_pages_are_stable_under_concurrent_writes(self, store: Any) -> None:
        user = _uid()
        contexts = {
            _sid(user, n): store.get_or_create(_sid(user, n), _agent(), user_id=user)
            for n in range(0, 50, 2)
        }
        everything = store.list_sessions(user_id=user, limit=1000)
        assert everything == sorted(contexts), "paged order is session_id ascending"
        seen: list[str] = []
        after = None
        page_no = 0
        while True:
            page = store.list_sessions(user_id=user, limit=7, after=after)
            if not page:
                break
            seen.extend(page)
            after = page[-1]
            page_no += 1
            # writes between pages: sessions already seen and not yet seen move to
            # the front of the recency order, and new sessions appear on both sides
            for sid in list(contexts)[page_no :: 5]:
                contexts[sid].add_message(Message(role=Role.USER, content=f"p{page_no}"))
            store.get_or_create(_sid(user, 2 * page_no + 1), _agent(), user_id=user)
        assert len(seen) == len(set(seen)), "no session may appear on two pages"
        assert set(contexts) <= set(seen), "every session present all along must be listed"
        assert seen == sorted(seen)

    def test_metadata_filtered_pages_are_full(self, store: Any) -> None:
        user = _uid()
        for n in range(40):
            meta = {"tier": "gold" if n % 3 == 0 else "basic"}
            store.get_or_create(_sid(user, n), _agent(), meta, user_id=user)
        gold = [_sid(user, n) for n in range(0, 40, 3)]
        pages: list[list[str]] = []
        after = None
        while True:
            page = store.list_sessions(
                user_id=user, metadata={"tier": "gold"}, limit=4, after=after
            )
            if not page:
                break
            pages.append(page)
            after = page[-1]
        assert [len(p) for p in pages] == [4, 4, 4, 2]
        assert [sid for p in pages for sid in p] == gold

    @pytest.mark.parametrize(
        "kwargs",
        [
            {"limit": 0},
            {"limit": True},
            {"limit": "5"},
            {"after": ""},
            {"user_id": ""},
            {"user_id": 7},
            {"metadata": {"k": float("nan")}},
            {"metadata": ["k"]},
            {"updated_after": datetime(2026, 1, 1)},  # naive
            {"updated_after": "2026-01-01"},
        ],
    )
    def test_bad_arguments_say_what_to_pass(self, store: Any, kwargs: dict[str, Any]) -> None:
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            store.list_sessions(**kwargs)

    def test_bad_user_id_on_get_or_create(self, store: Any) -> None:
        with pytest.raises(ValueError, match="user_id"):
            store.get_or_create(_uid(), _agent(), user_id="")
        with pytest.raises(ValueError, match="user_id"):
            store.get_or_create(_uid(), _agent(), user_id="x" * 256)

    def test_async_twins(self, store: Any) -> None:
        user = _uid()

        async def scenario() -> None:
            await store.aget_or_create(f"{user}1", _agent(), {"k": "v"}, user_id=user)
            await store.aget_or_create(f"{user}2", _agent(), user_id=user)
            assert await store.alist_sessions(user_id=user, limit=1) == [f"{user}1"]
            assert await store.alist_sessions(user_id=user, limit=1, after=f"{user}1") == [
                f"{user}2"
            ]
            assert await store.alist_sessions(user_id=user, metadata={"k": "v"}) == [f"{user}1"]
            exported = await store.aexport_user(user)
            assert [s["session_id"] for s in exported["sessions"]] == [f"{user}1", f"{user}2"]
            assert await store.aerase_user(user) == 2
            assert await store.alist_sessions(user_id=user) == []

        asyncio.run(scenario())


@requires(Capability.USER_SCOPE)
class ErasureAndExportTests:
    """``erase_user`` / ``export_user`` (+ async twins): everything of one user, nothing else.

    And ``delete``, which removes one session the way erasure does: nothing of
    it is left for its owner's or a later owner's export or erasure to find.
    """

    def _populate(self, store: Any, user: str) -> dict[str, Any]:
        call = ToolCall(id=f"call-{user}", name="lookup", args={"order": 5, "note": "ünï"})
        ctx = store.get_or_create(f"{user}-chat", _agent(), {"phone": "+5511"}, user_id=user)
        ctx.add_message(Message(role=Role.SYSTEM, content="be nice"))
        ctx.add_message(Message(role=Role.USER, content="where is my order?"))
        ctx.add_message(Message(role=Role.MODEL, content=None, tool_calls=[call]))
        result = ToolResult(tool_call_id=call.id, name=call.name, content={"eta": "today"})
        ctx.add_message(Message(role=Role.TOOL, tool_results=[result]))
        ctx.add_message(Message(role=Role.MODEL, content="on its way"))
        second = store.get_or_create(f"{user}-mail", _agent(), user_id=user)
        second.add_message(Message(role=Role.USER, content="hello"))
        with store.claim(f"{user}-wamid", session_id=f"{user}-chat") as claim:
            assert claim.acquired
            claim.response = "on its way"
        return {f"{user}-chat": ctx, f"{user}-mail": second}

    def test_export_is_complete_and_json_serialisable(self, store: Any) -> None:
        user, other = _uid(), _uid()
        contexts = self._populate(store, user)
        self._populate(store, other)
        exported = store.export_user(user)
        text = json.dumps(exported)  # JSON-serialisable as is
        assert json.loads(text) == exported
        assert exported["user_id"] == user
        assert exported["format"] == "chatflow-user-export/1"
        by_id = {s["session_id"]: s for s in exported["sessions"]}
        assert sorted(by_id) == sorted(contexts)
        for sid, ctx in contexts.items():
            got = by_id[sid]
            assert got["user_id"] == user
            assert got["active_agent_name"] == "support"
            assert got["messages"] == [m.model_dump(mode="json") for m in ctx.history]
            assert got["created_at"] and got["updated_at"]
        assert by_id[f"{user}-chat"]["metadata"] == {"phone": "+5511"}
        claims = by_id[f"{user}-chat"]["webhook_claims"]
        assert [(c["message_id"], c["state"], c["response"]) for c in claims] == [
            (f"{user}-wamid", "done", "on its way")
        ]
        assert other not in text
        assert store.export_user(_uid())["sessions"] == []

    def test_erase_removes_the_user_and_nothing_else(
        self, harness: StoreHarness, store: Any
    ) -> None:
        user, other = _uid(), _uid()
        contexts = self._populate(store, user)
        kept = self._populate(store, other)
        unowned = store.get_or_create(f"{user}-unowned", _agent())
        before = store.export_user(other)
        assert store.erase_user(user) == 2
        assert store.list_sessions(user_id=user) == []
        assert store.export_user(user)["sessions"] == []
        for sid, ctx in contexts.items():
            assert store.get(sid) is None
            assert sid not in store.list_sessions()
            with pytest.raises(SessionDeletedError):
                ctx.add_message(Message(role=Role.USER, content="still there?"))
        assert not store.is_message_processed(f"{user}-wamid"), "the user's claims go too"
        assert store.is_message_processed(f"{other}-wamid")
        after = store.export_user(other)
        assert [s["messages"] for s in after["sessions"]] == [
            s["messages"] for s in before["sessions"]
        ]
        assert sorted(store.list_sessions(user_id=other)) == sorted(kept)
        assert store.get(unowned.session_id) is not None
        assert store.erase_user(user) == 0
        if harness.has(Capability.SQL):
            from sqlalchemy import text

            with store.engine.connect() as conn:
                for table in ("chatflow_messages", "chatflow_processed_messages"):
                    left = conn.execute(
                        text(f"SELECT COUNT(*) FROM {table} WHERE session_id LIKE :p"),
                        {"p": f"{user}-%"},
                    ).scalar()
                    assert left == 0, f"{table} still holds rows of the erased user"

    def _unborn(self, store: Any, session_id: str, user: str) -> None:
        """A session of ``user``'s made for a first turn that failed: unborn again."""
        store.get_or_create(session_id, _agent(), {"phone": "+5511"}, user_id=user)
        runner = Runner(starting_agent=_agent(), session_store=store, engine=ScriptedEngine())
        with pytest.raises(RuntimeError, match="scripted engine failure"):
            asyncio.run(runner.run_async(session_id, "fail"))
        assert store.get(session_id) is None

    def test_export_holds_the_inbox_messages_erase_removes(self, store: Any) -> None:
        """The user's own words waiting in the inbox are theirs: exported, then erased."""
        user, other = _uid(), _uid()
        self._populate(store, user)
        self._populate(store, other)
        self._unborn(store, f"{user}-new", user)  # its message waits for a retry
        store.inbox.put(f"{user}-in1", session_id=f"{user}-chat", text="my address is 1 Main St",
                        sent_at=1_700_000_000, payload={"from": "+5511"})
        store.inbox.put(f"{user}-in2", session_id=f"{user}-new", text="my card is 4111")
        store.inbox.put(f"{other}-in", session_id=f"{other}-chat", text="not the user's")
        store.inbox.put(f"{user}-stray", session_id=f"{user}-none", text="no session yet")
        exported = store.export_user(user)
        assert json.loads(json.dumps(exported)) == exported
        inbox = {m["message_id"]: m for m in exported.get("inbox", [])}
        assert sorted(inbox) == [f"{user}-in1", f"{user}-in2"], (
            "export_user must hold the inbox messages erase_user deletes, and no others"
        )
        first = inbox[f"{user}-in1"]
        assert (first["session_id"], first["text"], first["payload"], first["state"]) == (
            f"{user}-chat", "my address is 1 Main St", {"from": "+5511"}, "pending"
        )
        assert datetime.fromisoformat(first["sent_at"]).timestamp() == 1_700_000_000
        assert first["received_at"] and first["attempts"] == 0
        assert inbox[f"{user}-in2"]["session_id"] == f"{user}-new"
        store.erase_user(user)
        assert store.export_user(user)["inbox"] == []
        left = {entry.message_id for entry in store.inbox.entries(limit=None)}
        assert not left & set(inbox), "erase_user left an exported inbox message behind"
        assert {f"{other}-in", f"{user}-stray"} <= left

    def _delete_populated(self, store: Any, user: str) -> str:
        """``user``'s sessions, claims and inbox messages; the chat deleted: its id."""
        self._populate(store, user)
        sid = f"{user}-chat"
        store.inbox.put(f"{user}-in", session_id=sid, text="my address is 1 Main St")
        store.inbox.put(f"{user}-kept", session_id=f"{user}-mail", text="kept")
        assert store.delete(sid) is True
        return sid

    def test_delete_leaves_nothing_of_the_session_to_its_owner_or_the_ids_next_owner(
        self, store: Any
    ) -> None:
        """What delete leaves of a session no owner's erase or export could find any more."""
        user, heir = _uid(), _uid()
        sid = self._delete_populated(store, user)
        exported = store.export_user(user)
        assert [s["session_id"] for s in exported["sessions"]] == [f"{user}-mail"]
        assert [m["message_id"] for m in exported["inbox"]] == [f"{user}-kept"], (
            "the deleted session's inbox messages outlived it"
        )
        store.get_or_create(sid, _agent(), user_id=heir)  # the id, owned by someone else now
        inherited = store.export_user(heir)
        (session,) = inherited["sessions"]
        assert (session["messages"], session["webhook_claims"]) == ([], []), (
            "a new owner of the id exports the deleted session's claims"
        )
        assert inherited["inbox"] == [], "a new owner of the id exports the deleted inbox messages"
        assert store.erase_user(heir) == 1
        assert [m["message_id"] for m in store.export_user(user)["inbox"]] == [f"{user}-kept"]
        assert store.erase_user(user) == 1
        left = store.export_user(user)
        assert (left["sessions"], left["inbox"]) == ([], [])

    def test_delete_removes_the_sessions_claims_and_inbox_messages(
        self, harness: StoreHarness, store: Any
    ) -> None:
        user, other = _uid(), _uid()
        self._populate(store, other)
        sid = self._delete_populated(store, user)
        assert store.delete(sid) is False
        assert not store.is_message_processed(f"{user}-wamid"), "its claim (and reply) stayed"
        assert store.is_message_processed(f"{other}-wamid")
        assert sid not in {c.session_id for c in list_claims(store, limit=None)}
        left = {e.message_id: e.session_id for e in store.inbox.entries(limit=None)}
        assert sid not in left.values(), "its inbox messages stayed"
        assert left[f"{user}-kept"] == f"{user}-mail"
        with store.claim(f"{user}-wamid", session_id=sid) as claim:
            assert claim.acquired, "a redelivery of the deleted session's id is new"
        if harness.has(Capability.SQL):
            tables = ("chatflow_messages", "chatflow_message_archive",
                      "chatflow_processed_messages", "chatflow_inbox")
            store.delete(sid)
            for table in tables:
                (count,) = _raw(
                    store, f"SELECT COUNT(*) FROM {table} WHERE session_id = :sid", sid=sid
                )[0]
                assert count == 0, f"{table} still holds rows of the deleted session"

    def test_a_claim_in_flight_for_a_deleted_session_fails_cleanly(self, store: Any) -> None:
        """Deleted under a claim: a clear error or a clean end, never a half-kept turn."""
        runner = Runner(starting_agent=_agent(), session_store=store, engine=ScriptedEngine())
        user, mid = _uid(), f"wamid-{uuid.uuid4().hex[:10]}"
        sid = f"{user}-chat"

        def gone() -> None:
            assert store.get(sid) is None and sid not in store.list_sessions()
            assert sid not in {c.session_id for c in list_claims(store, limit=None)}
            assert not store.is_message_processed(mid)

        store.get_or_create(sid, _agent(), user_id=user)
        # Deleted before the turn: the turn writes nothing (the claim, or the session's
        # lease taken with it, went with the session: ClaimLostError or LeaseLostError).
        with pytest.raises(LeaseLostError), store.claim(mid, session_id=sid) as claim:
            assert claim.acquired
            assert store.delete(sid) is True
            asyncio.run(runner.run_async(sid, "hello"))
        gone()
        # Deleted after the turn, which stored the reply with the claim: a clean end.
        with store.claim(mid, session_id=sid) as claim:
            assert claim.acquired, "the deleted session's claim was left behind"
            claim.response = asyncio.run(runner.run_async(sid, "hello")).content
            assert store.delete(sid) is True
        gone()
        # Deleted after the turn, with a reply other than the turn's to store: lost.
        with pytest.raises(ClaimLostError), store.claim(mid, session_id=sid) as claim:
            asyncio.run(runner.run_async(sid, "hello"))
            claim.response = "sent by hand"
            assert store.delete(sid) is True
        gone()
        assert store.export_user(user)["sessions"] == []

    @requires(Capability.PERSISTENT)
    def test_live_context_in_another_store_sees_the_erasure(self, harness: StoreHarness) -> None:
        user = _uid()
        first: Any = harness.open()
        second: Any = harness.open()
        try:
            ctx = first.get_or_create(f"{user}-x", _agent(), user_id=user)
            ctx.add_message(Message(role=Role.USER, content="hi"))
            assert second.erase_user(user) == 1
            with pytest.raises(SessionDeletedError):
                ctx.add_message(Message(role=Role.USER, content="again"))
            assert first.get(f"{user}-x") is None
        finally:
            first.close()
            second.close()


def sweep_worker(spec: StoreSpec, ttl_hours: float, barrier: Any, results: Any) -> None:
    """Open a store with ``session_ttl_hours``, sweep once with the others; report the count."""
    try:
        store: Any = spec.open(session_ttl_hours=ttl_hours)
        try:
            store.list_sessions(limit=1)  # connect before the race starts
            barrier.wait(30)
            results.put(("ok", store.sweep()))
        finally:
            store.close()
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def turn_holder(spec: StoreSpec, session_id: str, started: Any, finish: Any, results: Any) -> None:
    """Run one turn on ``session_id`` that lasts until ``finish`` is set; report its history."""
    try:
        store: Any = spec.open(session_ttl_hours=TINY_TTL_HOURS)
        try:
            ctx = store.get_or_create(session_id, _agent())

            async def turn() -> None:
                async with ctx.lock:
                    started.set()
                    await asyncio.to_thread(finish.wait, 60)
                    ctx.add_message(Message(role=Role.USER, content="written after the sweep"))

            asyncio.run(turn())
            results.put(("ok", [m.content for m in ctx.history]))
        finally:
            store.close()
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))


@requires(Capability.RETENTION)
class RetentionTests:
    """``session_ttl_hours`` and ``sweep()``: expired sessions go, busy and fresh ones stay."""

    def test_sweep_needs_a_ttl_and_checks_its_arguments(self, harness: StoreHarness) -> None:
        store: Any = harness.open()
        try:
            with pytest.raises(ValueError, match="session_ttl_hours"):
                store.sweep()
        finally:
            store.close()
        for bad in (0, -1, float("nan"), float("inf"), True, "24"):
            with pytest.raises(ValueError, match="session_ttl_hours"):
                harness.open(session_ttl_hours=bad)
        store = harness.open(session_ttl_hours=24)
        try:
            assert store.session_ttl_hours == 24.0
            for limit in (0, True, 1.5):
                with pytest.raises(ValueError, match="limit"):
                    store.sweep(limit)
        finally:
            store.close()

    def test_sweep_skips_sessions_in_a_turn_or_a_live_claim(self, harness: StoreHarness) -> None:
        store: Any = harness.open(session_ttl_hours=TINY_TTL_HOURS)
        try:
            self._scenario(store)
        finally:
            store.close()

    def _scenario(self, store: Any) -> None:
        tag = _uid()
        ids = {name: f"{tag}-{name}" for name in ("old", "old2", "turn", "claimed", "fresh")}
        contexts = {name: store.get_or_create(sid, _agent()) for name, sid in ids.items()
                    if name != "fresh"}
        contexts["old"].add_message(Message(role=Role.USER, content="bye"))
        with store.claim(f"{tag}-done", session_id=ids["old"]) as claim:
            claim.response = "ok"
        time.sleep(EXPIRE_SECONDS)
        contexts["fresh"] = store.get_or_create(ids["fresh"], _agent())
        fresh_at = time.monotonic()

        def fresh_may_be_gone() -> bool:  # a loaded machine can take the whole TTL from here
            return time.monotonic() - fresh_at >= TINY_TTL_HOURS * 3600

        async def sweep_during_a_turn() -> int:
            async with contexts["turn"].lock:
                with store.claim(f"{tag}-live", session_id=ids["claimed"]):
                    return int(await store.asweep(limit=1)) + int(store.sweep())

        assert asyncio.run(sweep_during_a_turn()) == 2, "only old and old2 were free to go"
        left = set(store.list_sessions())
        assert ids["old"] not in left and ids["old2"] not in left
        assert {ids["turn"], ids["claimed"]} <= left
        assert ids["fresh"] in left or fresh_may_be_gone()
        assert not store.is_message_processed(f"{tag}-done"), "a swept session's claims go too"
        with pytest.raises(SessionDeletedError):
            contexts["old"].add_message(Message(role=Role.USER, content="still there?"))
        # the claim is done now, so its session is expired (a store may count the
        # turn that just ended, without writing, as an update: that one may stay)
        assert store.sweep() in ((1, 2, 3) if fresh_may_be_gone() else (1, 2))
        left = set(store.list_sessions())
        assert ids["claimed"] not in left
        assert ids["fresh"] in left or fresh_may_be_gone()
        assert store.sweep() in ((0, 1) if fresh_may_be_gone() else (0,))

    def test_sweep_keeps_a_session_whose_inbox_batch_is_in_flight(
        self, harness: StoreHarness
    ) -> None:
        """A batch holds its session's lease: a sweep must not take the session from under it."""
        store: Any = harness.open(session_ttl_hours=SHORT_TTL_HOURS)
        sid, message_id = f"{_uid()}-inbox", f"{_uid()}-m"
        try:
            store.get_or_create(sid, _agent()).add_message(Message(role=Role.USER, content="x"))
            time.sleep(SHORT_EXPIRE_SECONDS)
            store.inbox.put(message_id, session_id=sid, text="hi")
            assert asyncio.run(self._sweep_during_a_batch(store)) == 0
            assert sid in store.list_sessions()
            entries = [(e.message_id, e.state) for e in store.inbox.entries(limit=None)]
            assert entries in ([(message_id, "done")], [(message_id, "sent")]), entries
        finally:
            store.close()

    @staticmethod
    async def _sweep_during_a_batch(store: Any) -> int:
        entered, answered, swept = asyncio.Event(), asyncio.Event(), []

        async def handle(_batch: Any) -> str:
            entered.set()
            swept.append(await store.asweep())
            return "answer"

        async def sent(_reply: Any) -> None:
            answered.set()

        serving = asyncio.ensure_future(
            store.inbox.serve(handle, send=sent, coalesce_seconds=0.0, retry_seconds=0.0)
        )
        try:
            await asyncio.wait_for(entered.wait(), 60)
            await asyncio.wait_for(asyncio.shield(answered.wait()), 60)
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
        return int(swept[0])

    @requires(Capability.CROSS_PROCESS)
    def test_sweep_keeps_a_session_whose_turn_runs_in_another_process(
        self, harness: StoreHarness
    ) -> None:
        store: Any = harness.open(session_ttl_hours=SHORT_TTL_HOURS)
        tag = _uid()
        busy, idle = f"{tag}-busy", f"{tag}-idle"
        workers = worker_context()
        started, finish, results = workers.Event(), workers.Event(), workers.Queue()
        try:
            for sid in (busy, idle):
                store.get_or_create(sid, _agent()).add_message(
                    Message(role=Role.USER, content="before")
                )
            time.sleep(SHORT_EXPIRE_SECONDS)
            worker = worker_process(
                workers, turn_holder, (harness.spec(), busy, started, finish, results)
            )
            worker.start()
            try:
                assert started.wait(120), "the other process never started its turn"
                assert store.sweep() == 1, "only the idle session may go"
                assert set(store.list_sessions()) >= {busy} and idle not in store.list_sessions()
            finally:
                finish.set()
                outcome = results.get(timeout=120)
                worker.join(30)
            assert outcome == ("ok", ["before", "written after the sweep"]), outcome
            assert [m.content for m in store.get(busy).history] == [
                "before", "written after the sweep"
            ]
        finally:
            store.close()

    @requires(Capability.CROSS_PROCESS)
    def test_four_processes_sweep_each_session_once(self, harness: StoreHarness) -> None:
        store: Any = harness.open(session_ttl_hours=SHORT_TTL_HOURS)
        tag = _uid()
        expired = [f"{tag}-x{n:04d}" for n in range(120)]  # one sweep batch, raced by all four
        held = [f"{tag}-h{n}" for n in range(4)]
        try:
            for sid in expired + held:
                ctx = store.get_or_create(sid, _agent())
                ctx.add_message(Message(role=Role.USER, content=sid))
            time.sleep(SHORT_EXPIRE_SECONDS)
            # (fresh sessions are tested in one process: starting the workers may take
            # longer than the tiny TTL here, so sessions held by live claims stand for
            # the live ones)
            claims = [store.claim(f"{sid}-m", session_id=sid) for sid in held]
            for claim in claims:
                claim.__enter__()
            try:
                results = run_workers(
                    sweep_worker, [(harness.spec(), SHORT_TTL_HOURS)] * 4, timeout=180
                )
            finally:
                for claim in claims:
                    claim.__exit__(None, None, None)
            errors = [r for r in results if r[0] != "ok"]
            assert not errors, errors
            counts = [count for _, count in results]
            assert sum(counts) == len(expired), f"each expired session once: {counts}"
            left = set(store.list_sessions())
            assert not left & set(expired)
            assert set(held) <= left, "no session held by a live claim may be swept"
        finally:
            store.close()


def _turns(ctx: Any, first: int, last: int) -> list[Message]:
    """Add turns ``first..last-1`` (USER + MODEL; every third with a tool call); return them."""
    added: list[Message] = []
    for n in range(first, last):
        turn = [Message(role=Role.USER, content=f"u{n}")]
        if n % 3 == 0:
            call = ToolCall(id=f"call-{n}", name="lookup", args={"n": n})
            result = ToolResult(tool_call_id=call.id, name=call.name, content={"n": n})
            turn += [
                Message(role=Role.MODEL, content=None, tool_calls=[call]),
                Message(role=Role.TOOL, tool_results=[result]),
            ]
        turn.append(Message(role=Role.MODEL, content=f"m{n}"))
        for message in turn:
            ctx.add_message(message)
        added += turn
    return added


def _dump(messages: list[Message]) -> list[dict[str, Any]]:
    return [m.model_dump(mode="json") for m in messages]


def _shape(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages without their timestamps (to compare two sessions fed alike)."""
    return [m.model_dump(mode="json", exclude={"timestamp"}) for m in messages]


@requires(Capability.ARCHIVE)
class ArchiveTests:
    """``archive_pruned`` and ``transcript()``: the whole conversation, the window unchanged."""

    def test_transcript_is_archive_plus_window_in_order(self, harness: StoreHarness) -> None:
        store: Any = harness.open(archive_pruned=True, default_max_turns=2)
        plain: Any = harness.open(default_max_turns=2)
        try:
            sid, other = _uid(), _uid()
            ctx, same = store.get_or_create(sid, _agent()), plain.get_or_create(other, _agent())
            everything = []
            for target in (ctx, same):
                target.add_message(Message(role=Role.SYSTEM, content="be brief"))
            everything.append(Message(role=Role.SYSTEM, content="be brief"))
            everything += _turns(ctx, 0, 7)
            _turns(same, 0, 7)
            assert _shape(ctx.history) == _shape(same.history), "the window is what it was"
            assert [m.content for m in ctx.history if m.role == Role.USER] == ["u5", "u6"]
            assert _shape(store.transcript(sid)) == _shape(everything)
            assert _shape(asyncio.run(store.atranscript(sid))) == _shape(everything)
            assert _shape(plain.transcript(other)) == _shape(same.history), "no archive: window"
            assert store.transcript(_uid()) == []
            if harness.has(Capability.PERSISTENT):
                fresh: Any = harness.open()
                try:
                    assert _shape(fresh.transcript(sid)) == _shape(everything)
                    assert _dump(fresh.get(sid).history) == _dump(ctx.history)
                finally:
                    fresh.close()
        finally:
            store.close()
            plain.close()

    def test_rollback_and_turns_archive_only_what_was_pruned(self, harness: StoreHarness) -> None:
        store: Any = harness.open(archive_pruned=True, default_max_turns=2)
        try:
            sid = _uid()
            ctx = store.get_or_create(sid, _agent())
            kept = _turns(ctx, 0, 2)

            async def failed_turn() -> None:  # what the Runner does when a turn fails
                async with ctx.lock:
                    checkpoint = len(ctx.history)
                    _turns(ctx, 2, 5)  # prunes turns 0 and 1 in memory
                    ctx.rollback_to(checkpoint)

            asyncio.run(failed_turn())
            assert _shape(ctx.history) == _shape(kept)
            assert _shape(store.transcript(sid)) == _shape(kept), "rolled back: nothing pruned"

            async def locked_turns() -> None:
                for n in range(5, 8):
                    async with ctx.lock:
                        _turns(ctx, n, n + 1)

            asyncio.run(locked_turns())
            messages = store.transcript(sid)
            assert [m.content for m in messages if m.role == Role.USER] == [
                "u0", "u1", "u5", "u6", "u7"
            ]
            exported = store.export_user(_uid())  # (no user: nothing)
            assert exported["sessions"] == []
        finally:
            store.close()

    def test_export_erase_and_sweep_cover_the_archive(self, harness: StoreHarness) -> None:
        store: Any = harness.open(archive_pruned=True, default_max_turns=1)
        try:
            user = _uid()
            ctx = store.get_or_create(f"{user}-a", _agent(), user_id=user)
            added = _turns(ctx, 0, 3)
            document = store.export_user(user)["sessions"][0]
            assert document["archived_messages"] + document["messages"] == _dump(added)
            assert store.erase_user(user) == 1
            assert store.transcript(f"{user}-a") == []
            if harness.has(Capability.SQL):
                from sqlalchemy import text

                with store.engine.connect() as conn:
                    left = conn.execute(
                        text("SELECT COUNT(*) FROM chatflow_message_archive "
                             "WHERE session_id = :s"), {"s": f"{user}-a"},
                    ).scalar()
                assert left == 0
        finally:
            store.close()

    @requires(Capability.SQL)
    def test_a_corrupt_archived_row_is_named_not_dropped(self, harness: StoreHarness) -> None:
        from sqlalchemy import text

        store: Any = harness.open(archive_pruned=True, default_max_turns=1)
        try:
            user = _uid()
            sid = f"{user}-c"
            _turns(store.get_or_create(sid, _agent(), user_id=user), 0, 3)
            with store.engine.begin() as conn:
                row_id = conn.execute(
                    text("SELECT MIN(id) FROM chatflow_message_archive WHERE session_id = :s"),
                    {"s": sid},
                ).scalar_one()
                conn.execute(
                    text("UPDATE chatflow_message_archive SET message_json = :bad WHERE id = :i"),
                    {"bad": '{"role": "nobody", "content": ', "i": row_id},
                )
            for read, key in ((store.transcript, sid), (store.export_user, user)):
                with pytest.raises(CorruptRowError) as info:
                    read(key)
                assert (info.value.table, info.value.row_id) == ("chatflow_message_archive", row_id)
                assert f"chatflow_message_archive (session {sid!r}, id {row_id})" in str(info.value)
        finally:
            store.close()


def _keys() -> dict[str, bytes]:
    return {"k1": os.urandom(32), "k2": os.urandom(32)}


def _cipher(keys: dict[str, bytes], primary: str, *ids: str) -> Any:
    from chatflow_sqlalchemy.crypto import AESGCMCipher

    return AESGCMCipher({i: keys[i] for i in (primary, *ids)}, primary)


def _raw(store: Any, sql: str, **params: Any) -> list[Any]:
    from sqlalchemy import text

    with store.engine.connect() as conn:
        return list(conn.execute(text(sql), params))


def encrypted_turns_worker(
    spec: StoreSpec, keys: dict[str, bytes], session_ids: list[str], n_turns: int,
    barrier: Any, results: Any,
) -> None:
    """Run ``n_turns`` locked turns per session with cipher (k2 primary, k1); report failures."""
    failures: list[str] = []
    try:
        store: Any = spec.open(cipher=_cipher(keys, "k2", "k1"))
        try:
            contexts = [store.get_or_create(sid, _agent()) for sid in session_ids]
            barrier.wait(30)

            async def turns() -> None:
                for k in range(n_turns):
                    for ctx in contexts:
                        try:
                            async with ctx.lock:
                                ctx.add_message(Message(role=Role.USER, content=f"q{k}"))
                                ctx.add_message(Message(role=Role.MODEL, content=f"a{k}"))
                        except Exception as exc:
                            failures.append(f"{type(exc).__name__}: {exc}")

            asyncio.run(turns())
        finally:
            store.close()
        results.put(("ok", failures))
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))


@requires(Capability.ENCRYPTION)
class EncryptionTests:
    """``cipher=`` / ``require_encryption=`` / ``rotate_keys``: sealed at rest, rotated online."""

    def test_content_and_metadata_are_sealed_at_rest(self, harness: StoreHarness) -> None:
        keys = _keys()
        store: Any = harness.open(cipher=_cipher(keys, "k1"), archive_pruned=True,
                                  default_max_turns=1)
        try:
            sid = f"{_uid()}-enc"
            ctx = store.get_or_create(sid, _agent(), {"phone": "+5511999"}, user_id="u-enc")
            added = _turns(ctx, 0, 4)
            rows = _raw(store, "SELECT role, content, message_json FROM chatflow_messages "
                        "WHERE session_id = :s", s=sid)
            archived = _raw(store, "SELECT content, message_json FROM chatflow_message_archive "
                            "WHERE session_id = :s", s=sid)
            assert rows and archived
            for row in rows + [(None, *a) for a in archived]:
                assert row[1] is None, "the readable content copy must not hold plaintext"
                assert row[2].startswith("cfenc:1:k1:"), "every row names its key"
                assert "\"" not in row[2], "no JSON (so no plaintext) in a sealed row"
            assert {r[0] for r in rows} <= {"user", "model", "tool"}, "roles stay clear"
            (meta,) = _raw(store, "SELECT metadata_json FROM chatflow_sessions "
                           "WHERE session_id = :s", s=sid)[0]
            assert "+5511999" not in str(meta) and "cfenc:1:k1:" in str(meta)
            assert _shape(store.transcript(sid)) == _shape(added)
            assert store.export_user("u-enc")["sessions"][0]["metadata"] == {"phone": "+5511999"}
            store.inbox.put(f"{sid}-in", session_id=sid, text="card 4111", payload={"n": "+55"})
            (raw,) = _raw(store, "SELECT text, payload FROM chatflow_inbox "
                          "WHERE message_id = :m", m=f"{sid}-in")
            assert "4111" not in raw[0] and "+55" not in str(raw[1]), "the inbox is sealed"
            (item,) = store.export_user("u-enc")["inbox"]
            assert (item["text"], item["payload"]) == ("card 4111", {"n": "+55"})
            with pytest.raises(ValueError, match="encrypted metadata"):
                store.list_sessions(metadata={"phone": "+5511999"})
            if harness.has(Capability.PERSISTENT):
                fresh: Any = harness.open(cipher=_cipher(keys, "k1"), require_encryption=True)
                try:
                    again = fresh.get(sid)
                    assert _shape(again.history) == _shape(ctx.history)
                    assert again.metadata == {"phone": "+5511999"}
                finally:
                    fresh.close()
        finally:
            store.close()

    @requires(Capability.PERSISTENT)
    def test_old_keys_read_rotation_reseals_and_plaintext_is_refused(
        self, harness: StoreHarness
    ) -> None:
        keys = _keys()
        plain, old = f"{_uid()}-plain", f"{_uid()}-old"
        with_k1: Any = harness.open(cipher=_cipher(keys, "k1"))
        without: Any = harness.open()
        try:
            _turns(with_k1.get_or_create(old, _agent(), {"a": 1}), 0, 2)
            _turns(without.get_or_create(plain, _agent(), {"b": 2}), 0, 2)
        finally:
            with_k1.close()
            without.close()
        strict: Any = harness.open(cipher=_cipher(keys, "k2", "k1"), require_encryption=True)
        lenient: Any = harness.open(cipher=_cipher(keys, "k2", "k1"))
        try:
            assert [m.content for m in strict.get(old).history][:1] == ["u0"], "k1 still reads"
            with pytest.raises(CorruptRowError, match="require_encryption"):
                strict.get(plain)
            assert lenient.get(plain).metadata == {"b": 2}, "without require: plaintext reads"
            assert strict.rotate_keys(batch=3) > 0
            for table in ("chatflow_messages", "chatflow_message_archive"):
                stale = _raw(strict, f"SELECT COUNT(*) FROM {table} WHERE session_id IN "
                             "(:a, :b) AND message_json NOT LIKE 'cfenc:1:k2:%'", a=plain, b=old)
                assert stale[0][0] == 0
        finally:
            strict.close()
            lenient.close()
        only_k2: Any = harness.open(cipher=_cipher(keys, "k2"), require_encryption=True)
        try:
            assert only_k2.get(plain).metadata == {"b": 2}
            assert only_k2.get(old).metadata == {"a": 1}
            assert only_k2.rotate_keys() == 0
        finally:
            only_k2.close()

    @requires(Capability.PERSISTENT)
    def test_bad_options_say_what_to_pass(self, harness: StoreHarness) -> None:
        with pytest.raises(ValueError, match="needs a cipher"):
            harness.open(require_encryption=True)
        with pytest.raises(ValueError, match="AESGCMCipher"):
            harness.open(cipher="k1")

    @requires(Capability.CROSS_PROCESS)
    def test_rotation_under_load_fails_no_turn(self, harness: StoreHarness) -> None:
        keys = _keys()
        tag = _uid()
        sessions = [f"{tag}-{n}" for n in range(3)]
        seeding: Any = harness.open(cipher=_cipher(keys, "k1"))
        try:
            for sid in sessions:
                _turns(seeding.get_or_create(sid, _agent(), {"n": sid}), 0, 8)
        finally:
            seeding.close()
        rotator: Any = harness.open(cipher=_cipher(keys, "k2", "k1"))
        stop = threading.Event()
        rotated: list[int] = []

        def rotate() -> None:
            while not stop.is_set():
                rotated.append(rotator.rotate_keys(batch=4))

        thread = threading.Thread(target=rotate)
        thread.start()
        try:
            results = run_workers(
                encrypted_turns_worker,
                [(harness.spec(), keys, [sid], 15) for sid in sessions],
                timeout=240,
            )
        finally:
            stop.set()
            thread.join(120)
        try:
            assert all(r[0] == "ok" for r in results), results
            failed = [f for _, fails in results for f in fails]
            assert failed == [], f"turns failed during rotation: {failed}"
            assert sum(rotated) > 0
            rotator.rotate_keys()
            stale = _raw(rotator, "SELECT COUNT(*) FROM chatflow_messages WHERE session_id "
                         "LIKE :p AND message_json NOT LIKE 'cfenc:1:k2:%'", p=f"{tag}-%")
            assert stale[0][0] == 0
        finally:
            rotator.close()
        reader: Any = harness.open(cipher=_cipher(keys, "k2"), require_encryption=True)
        try:
            for sid in sessions:
                ctx = reader.get(sid)
                assert ctx.metadata == {"n": sid}
                assert [m.content for m in ctx.history][-2:] == ["q14", "a14"]
        finally:
            reader.close()
