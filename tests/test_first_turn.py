"""A failed first turn leaves no session behind (issue 28), beyond the conformance kit.

The kit (``chatflow_sqlalchemy.testing.first_turn_suite``) checks it on every
backend within one event loop. Here: a waiting turn on another thread's loop,
the CLI, and an inbox batch, whose session the inbox made before the turn.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Runner

from chatflow_sqlalchemy.cli import main
from chatflow_sqlalchemy.testing import ScriptedEngine

from .stores import Opener

AGENT = Agent(name="support", instructions="help")


class Held(ScriptedEngine):
    """:class:`ScriptedEngine` whose turns wait for :meth:`release` of their text.

    :meth:`entered` tells when such a turn holds the session (it runs its
    model call). A turn whose text is ``fail`` raises once released.
    """

    def __init__(self, *texts: str) -> None:
        super().__init__()
        self._entered = {text: threading.Event() for text in texts}
        self._go = {text: threading.Event() for text in texts}

    def entered(self, text: str) -> bool:
        return self._entered[text].is_set()

    async def wait_entered(self, text: str) -> None:
        while not self.entered(text):
            await asyncio.sleep(0.01)

    def release(self, text: str) -> None:
        self._go[text].set()

    def release_all(self) -> None:
        for go in self._go.values():
            go.set()

    async def generate_turn_async(self, agent: Agent, history: list[Message]) -> Any:
        text = history[-1].content or ""
        if text in self._go:
            self._entered[text].set()
            while not self._go[text].is_set():
                await asyncio.sleep(0.01)
        return await super().generate_turn_async(agent, history)


def _runner(store: Any, engine: ScriptedEngine | None = None, agent: Agent = AGENT) -> Runner:
    return Runner(starting_agent=agent, engine=engine or ScriptedEngine(), session_store=store)


def _contents(ctx: Any) -> list[str | None]:
    return [m.content for m in ctx.history]


def _fail(runner: Runner, session_id: str, **kwargs: Any) -> None:
    with pytest.raises(RuntimeError, match="scripted engine failure"):
        asyncio.run(runner.run_async(session_id, "fail", **kwargs))


def test_a_turn_of_another_store_waiting_for_the_lease_runs_with_its_agent(
    any_store: Opener,
) -> None:
    """The waiter read the session before the first turn failed, on another thread.

    It catches up with the unborn session, keeps its agent (not the unborn
    one's empty name), and its write makes the session again.
    """
    first_store, second_store = any_store(), any_store()
    engine = Held("fail", "two")
    first_runner, second_runner = _runner(first_store, engine), _runner(second_store, engine)
    outcome: list[Any] = []

    def failing() -> None:
        try:
            asyncio.run(first_runner.run_async("wa:5", "fail", metadata={"channel": "wa"}))
        except RuntimeError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=failing)
    thread.start()
    asyncio.run(asyncio.wait_for(engine.wait_entered("fail"), 60))

    async def waiting() -> Any:
        ctx = second_store.get_or_create("wa:5", AGENT)
        assert ctx.active_agent.name == "support"  # read now, before the first turn fails
        turn = asyncio.ensure_future(second_runner.run_async("wa:5", "two"))
        await asyncio.sleep(0)  # its turn starts, and waits for the lease
        engine.release("fail")
        await engine.wait_entered("two")
        assert any_store().get("wa:5") is None  # the first failed; the second runs
        engine.release("two")
        return await turn

    try:
        reply = asyncio.run(asyncio.wait_for(waiting(), 60))
    finally:
        engine.release_all()
        thread.join(60)
    assert isinstance(outcome[0], RuntimeError)
    assert reply.content == "support re: two"
    fresh = any_store().get("wa:5")
    assert fresh is not None
    assert _contents(fresh) == ["two", "support re: two"]
    assert fresh.active_agent.name == "support"
    assert fresh.metadata == {"channel": "wa"}
    assert first_store.get("wa:5") is not None
    assert first_store.list_sessions() == ["wa:5"]


def test_the_cli_does_not_list_a_session_whose_first_turn_failed(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from chatflow_sqlalchemy import open_store

    url = f"sqlite:///{tmp_path / 'cli.db'}"
    with open_store(url) as store:
        runner = _runner(store)
        asyncio.run(runner.run_async("kept", "hi"))
        _fail(runner, "gone")
    assert main(["--url", url, "sessions", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["sessions"]
    assert [row["session_id"] for row in listed] == ["kept"]
    assert main(["--url", url, "sessions", "show", "gone"]) != 0
    capsys.readouterr()


def test_an_inbox_batch_whose_first_turn_fails_leaves_its_session_unborn(
    sql_store: Opener,
) -> None:
    """The inbox made the session for its lease; a failed first turn gives it back as it was."""
    store = sql_store()
    runner = _runner(store)
    store.inbox.put("m1", session_id="wa:6", text="fail")

    async def handle(batch: Any) -> str | None:
        result = await runner.run_async(session_id=batch.session_id, user_message=batch.text)
        return result.content

    async def serve_once() -> None:
        task = asyncio.ensure_future(store.inbox.serve(handle, coalesce_seconds=0.0))
        try:
            while not [e for e in store.inbox.entries() if e.error]:
                await asyncio.sleep(0.02)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(serve_once(), 60))
    assert store.get("wa:6") is None
    assert sql_store().list_sessions() == []
