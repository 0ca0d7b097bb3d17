"""DurableWhatsAppChannel: upstream's webhook, the durable inbox, upstream's sender.

The app is the real one chatflow-agent builds (driven through httpx's ASGI
transport, or served by uvicorn on loopback in a worker process); replies go
to a fake Graph API on loopback (tests/fake_graph.py), reached through the
channel's ``graph_api_url``. Stores are real: a SQLite file, a PostgreSQL
schema, and the in-memory store for the tests that need no second process.

Waits are hang guards (60 s), never timings: a test waits for what it
expects (a reply at the fake, an inbox state) and fails if it never comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx", reason="the whatsapp extra is not installed")
pytest.importorskip("fastapi", reason="the whatsapp extra is not installed")
pytest.importorskip("uvicorn", reason="the whatsapp extra is not installed")

from chatflow_agent.channels.whatsapp import WhatsAppChannel  # noqa: E402
from fastapi.routing import APIRoute  # noqa: E402

from chatflow_sqlalchemy.channels import DurableWhatsAppChannel  # noqa: E402
from chatflow_sqlalchemy.testing import ScriptedEngine, StoreSpec  # noqa: E402
from chatflow_sqlalchemy.testing.harness import start_process  # noqa: E402

from . import pg_util  # noqa: E402
from ._whatsapp import (  # noqa: E402
    LEASE_SECONDS,
    PHONE,
    SECRET,
    VERIFY_TOKEN,
    build_channel,
    free_port,
    gate_path,
    message,
    serve_whatsapp,
    signed,
    user_texts,
    webhook,
)
from ._workers import postgres_spec, sqlite_spec  # noqa: E402
from .fake_graph import DROP, FakeGraphAPI  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    # chatflow-agent 0.3.4's webhook reads this name as a fallback on newer Starlette
    "ignore:'HTTP_413_REQUEST_ENTITY_TOO_LARGE' is deprecated"
)

HANG_GUARD = 60.0
MEMORY = StoreSpec("chatflow_sqlalchemy.memory:SessionStore")


# ------------------------------------------------------------------ fixtures


@contextlib.contextmanager
def database(kind: str, tmp_path: Path) -> Iterator[StoreSpec]:
    """A fresh database of ``kind``, its schema created, as a spec worker processes open."""
    if kind == "memory":
        yield MEMORY
        return
    if kind == "sqlite":
        spec = sqlite_spec(tmp_path / "whatsapp.db")
        spec.open().close()
        yield spec
        return
    url = pg_util.postgres_url()
    with pg_util.fresh_schema(url) as schema:
        spec = postgres_spec(url, schema)
        spec.open().close()
        yield spec


SQL = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


@pytest.fixture(params=[*SQL, "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A store of each kind with a short turn lease."""
    with database(request.param, tmp_path) as spec:
        opened: Any = spec.open(turn_lease_seconds=LEASE_SECONDS)
        try:
            yield opened
        finally:
            opened.close()


@pytest.fixture(params=SQL)
def spec(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreSpec]:
    """A SQL database two processes share."""
    with database(request.param, tmp_path) as made:
        yield made


@pytest.fixture
def fake() -> Iterator[FakeGraphAPI]:
    with FakeGraphAPI() as api:
        yield api


@contextlib.asynccontextmanager
async def client_of(channel: Any) -> AsyncIterator[Any]:
    """An httpx client calling the channel's app in process (no lifespan: no workers)."""
    transport = httpx.ASGITransport(app=channel.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        yield client


async def deliver(client: Any, body: dict[str, Any], **kwargs: Any) -> Any:
    """POST a signed webhook; return the response."""
    raw, headers = signed(body, **kwargs)
    return await client.post("/webhook", content=raw, headers=headers)


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"never happened within {HANG_GUARD:g} s: {what}")
        await asyncio.sleep(0.02)


async def states(store: Any) -> dict[str, str]:
    return {entry.message_id: entry.state for entry in await store.inbox.aentries(limit=None)}


async def until_states(store: Any, expected: dict[str, str]) -> None:
    async def reached() -> bool:
        return await states(store) == expected

    await until(reached, f"inbox states {expected}")


# ------------------------------------------------------------------ upstream's seams


def test_the_upstream_seams_hold_on_the_installed_chatflow_agent() -> None:
    """What the channel uses of WhatsAppChannel that is not public, as installed."""
    assert list(inspect.signature(WhatsAppChannel._extract_messages).parameters) == [
        "self", "payload"]
    assert list(inspect.signature(WhatsAppChannel._send_single_outbound_whatsapp).parameters) == [
        "self", "to_phone", "text"]
    upstream = WhatsAppChannel(verify_token="v", app_secret=SECRET)
    assert upstream._httpx is httpx
    (route,) = [r for r in upstream.app.router.routes
                if isinstance(r, APIRoute) and r.path == "/webhook" and "POST" in r.methods]
    assert list(inspect.signature(route.endpoint).parameters) == ["request", "background_tasks"]
    body = webhook(message("wamid.a", "hi"), message("wamid.b", None, kind="image"))
    assert upstream._extract_messages(body) == [("wamid.a", PHONE, "hi"), ("wamid.b", PHONE, None)]


def test_the_channel_replaces_only_the_post_route(tmp_path: Path) -> None:
    with database("memory", tmp_path) as made:
        channel = build_channel(made.open(), "http://127.0.0.1:9")
    routes = [(r.path, sorted(r.methods)) for r in channel.app.router.routes
              if isinstance(r, APIRoute)]
    assert sorted(routes) == [("/health", ["GET"]), ("/webhook", ["GET"]), ("/webhook", ["POST"])]
    assert isinstance(channel, WhatsAppChannel)


# ------------------------------------------------------------------ the webhook


async def test_a_bad_signature_is_refused_and_nothing_is_put(
    store: Any, fake: FakeGraphAPI
) -> None:
    channel = build_channel(store, fake.url)
    body = webhook(message("wamid.1", "hello"))
    async with client_of(channel) as client:
        forged = await deliver(client, body, secret="not-the-app-secret")
        raw, _ = signed(body)
        unsigned = await client.post("/webhook", content=raw,
                                     headers={"Content-Type": "application/json"})
        too_big = await client.post("/webhook", content=b"{}",
                                    headers={"Content-Length": str(2 * 1024 * 1024)})
    assert (forged.status_code, unsigned.status_code, too_big.status_code) == (403, 403, 413)
    assert await states(store) == {}


async def test_a_200_means_the_message_is_in_the_inbox(store: Any, fake: FakeGraphAPI) -> None:
    channel = build_channel(store, fake.url)
    async with client_of(channel) as client:
        answer = await deliver(client, webhook(message("wamid.1", "hello", timestamp=1749416383)))
        generic = await deliver(client, {"from": "15550111", "id": "gen.1", "message": "hi",
                                         "timestamp": "1749416390"})
        statuses = await deliver(client, {"entry": [{"changes": [{"value": {
            "statuses": [{"id": "wamid.1", "status": "delivered"}]}}]}]})
        check = await client.get("/webhook", params={
            "hub.mode": "subscribe", "hub.verify_token": VERIFY_TOKEN, "hub.challenge": "42"})
    assert answer.status_code == 200
    assert answer.json() == {"status": "success", "sender": PHONE, "messages_queued": 1}
    assert generic.json()["messages_queued"] == 1
    assert statuses.json() == {"status": "ignored_or_status_update"}
    assert (check.status_code, check.text) == (200, "42")  # upstream's subscription check
    entries = {e.message_id: e for e in await store.inbox.aentries()}
    assert {m: (e.session_id, e.state) for m, e in entries.items()} == {
        "wamid.1": (PHONE, "pending"), "gen.1": ("15550111", "pending")}
    assert entries["wamid.1"].sent_at == datetime.fromtimestamp(1749416383, timezone.utc)
    assert entries["gen.1"].sent_at == datetime.fromtimestamp(1749416390, timezone.utc)
    assert not store.is_message_processed("wamid.1"), "upstream's at-most-once record was used"
    assert fake.requests == []


async def test_a_failed_put_answers_503_so_the_platform_retries(fake: FakeGraphAPI,
                                                                tmp_path: Path) -> None:
    with database("sqlite", tmp_path) as made:
        store: Any = made.open()
        channel = build_channel(store, fake.url)
        store.close()  # the database is gone for this process
        async with client_of(channel) as client:
            answer = await deliver(client, webhook(message("wamid.1", "hello")))
    assert answer.status_code == 503


# ------------------------------------------------------------------ the workers


async def test_a_burst_from_one_sender_is_one_turn(store: Any, fake: FakeGraphAPI) -> None:
    """Three webhooks of one phone are one turn, in WhatsApp's timestamp order."""
    channel = build_channel(store, fake.url)
    async with client_of(channel) as client:
        await deliver(client, webhook(message("wamid.2", "second", timestamp=1002)))
        await deliver(client, webhook(message("wamid.1", "first", timestamp=1001),
                                      message("wamid.3", "third", timestamp=1003)))
        await deliver(client, webhook(message("wamid.x", "other", sender="15550199")))
    async with channel.running():
        await fake.until_delivered(2)
        await until_states(store, dict.fromkeys(
            ["wamid.2", "wamid.1", "wamid.3", "wamid.x"], "sent"))
    replies = sorted((r.to, r.text) for r in fake.requests)
    assert replies == [("15550100", "Bot re: first\nsecond\nthird"),
                       ("15550199", "Bot re: other")]
    assert user_texts(store) == ["first\nsecond\nthird"]
    assert {r.path for r in fake.requests} == {"/v21.0/106540352242922/messages"}
    assert {r.authorization for r in fake.requests} == {"Bearer test-access-token"}


async def test_a_redelivered_message_is_not_answered_twice(store: Any, fake: FakeGraphAPI) -> None:
    channel = build_channel(store, fake.url)
    body = webhook(message("wamid.1", "hello"))
    async with client_of(channel) as client, channel.running():
        first = await deliver(client, body)
        again = await deliver(client, body)  # before it is answered
        await fake.until_delivered(1)
        await until_states(store, {"wamid.1": "sent"})
        late = await deliver(client, body)  # after it was answered
        await deliver(client, webhook(message("wamid.2", "next")))
        await fake.until_delivered(2)
        await until_states(store, {"wamid.1": "sent", "wamid.2": "sent"})
    assert [a.json()["messages_queued"] for a in (first, again, late)] == [1, 0, 0]
    assert [r.text for r in fake.requests] == ["Bot re: hello", "Bot re: next"]
    assert user_texts(store) == ["hello", "next"]


async def test_workers_start_and_stop_with_the_app(store: Any, fake: FakeGraphAPI) -> None:
    """The app's lifespan (what uvicorn runs) starts the workers and stops them."""
    channel = build_channel(store, fake.url)
    before = asyncio.all_tasks()
    async with channel.app.router.lifespan_context(channel.app), client_of(channel) as client:
        await deliver(client, webhook(message("wamid.1", "hello")))
        await fake.until_delivered(1)
        await until_states(store, {"wamid.1": "sent"})
    assert asyncio.all_tasks() == before, "the workers outlived the app"
    assert [r.text for r in fake.requests] == ["Bot re: hello"]


async def test_web_only_app_leaves_the_messages_to_separate_workers(
    store: Any, fake: FakeGraphAPI
) -> None:
    web = build_channel(store, fake.url, in_app_workers=False)
    async with web.app.router.lifespan_context(web.app), client_of(web) as client:
        await deliver(client, webhook(message("wamid.1", "hello")))
    assert await states(store) == {"wamid.1": "pending"}
    worker = build_channel(store, fake.url)
    serving = asyncio.ensure_future(worker.serve())
    try:
        await fake.until_delivered(1)
        await until_states(store, {"wamid.1": "sent"})
    finally:
        serving.cancel()
        await asyncio.wait([serving])
    assert [r.text for r in fake.requests] == ["Bot re: hello"]


async def test_media_gets_the_unsupported_message_without_a_turn(
    store: Any, fake: FakeGraphAPI
) -> None:
    engine = ScriptedEngine()
    channel = build_channel(store, fake.url, engine)
    async with client_of(channel) as client, channel.running():
        await deliver(client, webhook(message("wamid.1", None, kind="image")))
        await fake.until_delivered(1)
        await until_states(store, {"wamid.1": "sent"})
    assert [r.text for r in fake.requests] == ["I can only read text."]
    assert engine.calls == 0 and user_texts(store) == []


async def test_a_failed_send_is_retried_without_running_the_turn_again(
    store: Any, fake: FakeGraphAPI
) -> None:
    engine = ScriptedEngine()
    channel = build_channel(store, fake.url, engine)
    fake.answer_next(500, 429, 429, 429, 429)  # a 5xx, then 429 past upstream's own retries
    async with client_of(channel) as client, channel.running():
        await deliver(client, webhook(message("wamid.1", "hello")))
        await fake.until_delivered(1)
        await until_states(store, {"wamid.1": "sent"})
    assert [r.status for r in fake.requests] == [500, 429, 429, 429, 429, 200]
    assert engine.calls == 1 and user_texts(store) == ["hello"]


async def test_a_long_reply_goes_in_chunks_and_a_retry_resumes_at_the_failed_one(
    store: Any, fake: FakeGraphAPI
) -> None:
    text = " ".join(f"word{k}" for k in range(1400))  # the reply is three chunks
    channel = build_channel(store, fake.url)
    fake.answer_next(200, 503)
    async with client_of(channel) as client, channel.running():
        await deliver(client, webhook(message("wamid.1", text)))
        await fake.until_delivered(3)
        await until_states(store, {"wamid.1": "sent"})
    chunks = [r.text for r in fake.delivered()]
    assert len(chunks) == 3 and all(len(chunk) <= 4096 for chunk in chunks)
    assert " ".join(chunks) == f"Bot re: {text}", "a chunk was lost or sent twice"
    assert [r.status for r in fake.requests] == [200, 503, 200, 200]


async def test_a_request_that_went_out_unanswered_is_not_sent_again(
    store: Any, fake: FakeGraphAPI
) -> None:
    """WhatsApp may have delivered it: as upstream, no second send (no duplicate)."""
    channel = build_channel(store, fake.url)
    fake.answer_next(DROP)
    async with client_of(channel) as client, channel.running():
        await deliver(client, webhook(message("wamid.1", "hello")))
        await until_states(store, {"wamid.1": "sent"})
    assert [(r.status, r.text) for r in fake.requests] == [(DROP, "Bot re: hello")]


async def test_an_unreachable_graph_api_is_retried_then_dead(store: Any) -> None:
    """Upstream's connect retries, then the inbox's: the reply is kept, the messages dead."""
    closed = f"http://127.0.0.1:{free_port()}"
    channel = build_channel(store, closed, max_attempts=2, max_outbound_retries=1)
    async with client_of(channel) as client, channel.running():
        await deliver(client, webhook(message("wamid.1", "hello")))
        await until_states(store, {"wamid.1": "dead"})
    (entry,) = await store.inbox.aentries()
    assert entry.error is not None and "could not connect" in entry.error
    assert user_texts(store) == ["hello"], "the turn ran once"


async def test_a_failing_turn_is_retried_then_dead_after_the_fallback(
    store: Any, fake: FakeGraphAPI
) -> None:
    engine = ScriptedEngine()
    channel = build_channel(store, fake.url, engine, max_attempts=2)
    async with client_of(channel) as client, channel.running():
        await deliver(client, webhook(message("wamid.1", "fail")))
        await until_states(store, {"wamid.1": "dead"})
    assert engine.calls == 2, "the failed turn was not retried"
    assert [r.text for r in fake.requests] == ["Sorry, try again later."]
    assert user_texts(store) == []


async def test_a_turn_past_llm_timeout_seconds_fails(store: Any, fake: FakeGraphAPI) -> None:
    channel = build_channel(store, fake.url, ScriptedEngine(delay=HANG_GUARD),
                            llm_timeout_seconds=0.1, max_attempts=1)
    async with client_of(channel) as client, channel.running():
        await deliver(client, webhook(message("wamid.1", "hello")))
        await until_states(store, {"wamid.1": "dead"})
    (entry,) = await store.inbox.aentries()
    assert entry.error is not None and "llm_timeout_seconds" in entry.error
    assert [r.text for r in fake.requests] == ["Sorry, try again later."]


# ------------------------------------------------------------------ misuse


async def test_the_runner_must_use_the_channels_store(store: Any, tmp_path: Path) -> None:
    from chatflow_agent import Agent, Runner

    from chatflow_sqlalchemy import SessionStore

    channel = build_channel(store, "http://127.0.0.1:9")
    channel.attach(Runner(starting_agent=Agent(name="Bot", instructions=""),
                          session_store=SessionStore(), engine=ScriptedEngine()))
    with pytest.raises(ValueError, match="session_store=store"):
        async with channel.app.router.lifespan_context(channel.app):
            pass
    with pytest.raises(TypeError, match="open_store"):
        build_channel(object(), "http://127.0.0.1:9")
    with pytest.raises(ValueError, match="graph_api_url"):
        build_channel(store, "ftp://example")
    with pytest.raises(ValueError, match="concurrency"):
        build_channel(store, "http://127.0.0.1:9", concurrency=0)
    assert DurableWhatsAppChannel.__mro__[1] is WhatsAppChannel


# ------------------------------------------------------------------ killed workers


def _post(port: int, body: dict[str, Any]) -> Any:
    raw, headers = signed(body)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=HANG_GUARD) as client:
        return client.post("/webhook", content=raw, headers=headers)


def _wait_sent(spec: StoreSpec, message_id: str) -> None:
    store: Any = spec.open()
    try:
        deadline = time.monotonic() + HANG_GUARD
        while {e.message_id: e.state for e in store.inbox.entries()} != {message_id: "sent"}:
            assert time.monotonic() < deadline, store.inbox.entries()
            time.sleep(0.05)
    finally:
        store.close()


def _history(spec: StoreSpec) -> tuple[list[str | None], list[Any]]:
    store: Any = spec.open()
    try:
        return user_texts(store), store.inbox.entries()
    finally:
        store.close()


@pytest.mark.slow
def test_a_worker_killed_after_the_200_before_handling(
    spec: StoreSpec, fake: FakeGraphAPI, tmp_path: Path
) -> None:
    """The process that answered 200 dies before its workers take the message."""
    gate = gate_path(tmp_path)
    Path(gate).touch()
    port = free_port()
    first = start_process(serve_whatsapp, spec, fake.url, port, gate, HANG_GUARD)  # won't batch
    try:
        assert first.next_event()[0] == "ready"
        answer = _post(port, webhook(message("wamid.k", "hello after the 200")))
        assert (answer.status_code, answer.json()["messages_queued"]) == (200, 1)
        left = first.kill()
        assert not [e for e in left if e[0] == "turn"], "it handled the message before the kill"
    finally:
        first.stop()
    assert [e.state for e in _history(spec)[1]] == ["pending"]
    second = start_process(serve_whatsapp, spec, fake.url, free_port(), gate, 0.05)
    try:
        fake.wait_delivered(1)
        _wait_sent(spec, "wamid.k")
        turns = [e for e in second.kill() if e[0] == "turn"]
    finally:
        second.stop()
    assert turns == [("turn", second.pid, "hello after the 200")]
    assert [(r.to, r.text) for r in fake.requests] == [(PHONE, "Bot re: hello after the 200")]
    assert _history(spec)[0] == ["hello after the 200"]


@pytest.mark.slow
def test_a_worker_killed_mid_turn(spec: StoreSpec, fake: FakeGraphAPI, tmp_path: Path) -> None:
    """Killed while its model runs: the turn runs again elsewhere, one reply reaches WhatsApp."""
    gate = gate_path(tmp_path)  # missing: the first worker's model waits
    port = free_port()
    first = start_process(serve_whatsapp, spec, fake.url, port, gate, 0.05)
    try:
        assert first.next_event()[0] == "ready"
        answer = _post(port, webhook(message("wamid.k", "hello mid-turn")))
        assert answer.status_code == 200
        assert first.next_event() == ("turn", first.pid, "hello mid-turn")
        first.kill()
    finally:
        first.stop()
    assert fake.requests == []
    Path(gate).touch()
    second = start_process(serve_whatsapp, spec, fake.url, free_port(), gate, 0.05)
    try:
        fake.wait_delivered(1)
        _wait_sent(spec, "wamid.k")
        turns = [e for e in second.kill() if e[0] == "turn"]
    finally:
        second.stop()
    assert turns == [("turn", second.pid, "hello mid-turn")]
    assert [(r.to, r.text) for r in fake.requests] == [(PHONE, "Bot re: hello mid-turn")]
    texts, entries = _history(spec)
    assert texts == ["hello mid-turn"], "the killed turn left messages, or ran twice"
    assert [e.attempts for e in entries] == [2]


def test_without_the_extra_the_import_names_it(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.modules['fastapi'] = None\n"
        "import chatflow_sqlalchemy.channels as channels\n"
        "try:\n"
        "    channels.DurableWhatsAppChannel\n"
        "except Exception as exc:  # chatflow-agent's DependencyError, as upstream raises\n"
        "    print(type(exc).__name__, exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=HANG_GUARD, check=True, cwd=tmp_path)
    assert result.stdout.startswith("DependencyError"), result.stdout
    assert "pip install 'chatflow-sqlalchemy[whatsapp]'" in result.stdout, result.stdout


async def test_the_workers_stop_even_as_they_are_woken(store: Any, fake: FakeGraphAPI) -> None:
    """Stopping the app while a put wakes the workers still stops them.

    Before Python 3.12, ``asyncio.wait_for`` returns normally instead of raising the
    cancellation when what it waits for completes as the task is cancelled (CPython
    gh-86296): a worker loop waiting for its waker that way never stopped. The two
    yields put the cancellation exactly there: the waker's wait is done, the loop
    not yet resumed.
    """
    channel = build_channel(store, fake.url)

    async def wake_then_stop() -> None:
        async with channel.running():
            await asyncio.sleep(0.5)  # the workers found nothing and wait for their waker
            store.inbox.wake()
            await asyncio.sleep(0)
            await asyncio.sleep(0)

    for _ in range(5):
        stopping = asyncio.ensure_future(wake_then_stop())
        done, _ = await asyncio.wait([stopping], timeout=HANG_GUARD / 4)
        assert done, "the workers did not stop when the app did"
        stopping.result()
