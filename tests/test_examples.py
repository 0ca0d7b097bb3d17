"""The examples, served by a real uvicorn, driven by httpx, on a SQLite file.

Started exactly as examples/README.md says (``uvicorn examples.whatsapp_webhook:app``,
``uvicorn examples.durable_whatsapp_bot:app`` from the repository root, the store from
``CHATFLOW_DATABASE_URL``), on a free loopback port; "restart" is a new server process on
the same file. The durable bot sends its replies to a fake Graph API on loopback
(tests/fake_graph.py) through ``WHATSAPP_GRAPH_API_URL``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from chatflow_sqlalchemy import SQLiteSessionStore

httpx = pytest.importorskip("httpx", reason="the examples extra is not installed")
pytest.importorskip("fastapi", reason="the examples extra is not installed")
pytest.importorskip("uvicorn", reason="the examples extra is not installed")

ROOT = Path(__file__).resolve().parents[1]
HANG_GUARD = 60.0  # seconds; only against a server that never comes up or never stops
PHONE = "15550100"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serve(db: Path, app: str = "examples.whatsapp_webhook:app", ready: str = "/openapi.json",
          **env: str) -> Iterator[Any]:
    """Run ``uvicorn APP``; yield an httpx client once ``ready`` answers; stop it cleanly."""
    port = _free_port()
    environ = {**os.environ, "CHATFLOW_DATABASE_URL": f"sqlite:///{db}", **env}
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=HANG_GUARD)
    try:
        deadline = time.monotonic() + HANG_GUARD
        while True:
            try:
                client.get(ready).raise_for_status()
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    out = proc.communicate(timeout=HANG_GUARD)[0] if proc.poll() is not None else ""
                    pytest.fail(f"uvicorn did not come up:\n{out}")
                time.sleep(0.1)
        yield client
    finally:
        client.close()
        proc.send_signal(signal.SIGINT)
        try:
            out = proc.communicate(timeout=HANG_GUARD)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
            pytest.fail(f"uvicorn did not stop:\n{out}")
    assert proc.returncode == 0, out
    assert "Application shutdown complete" in out, out  # the lifespan closed the store


def payload(*messages: tuple[str, str], sender: str = PHONE) -> dict[str, Any]:
    """A WhatsApp Cloud API webhook body carrying text messages ``(id, body)``."""
    return {
        "object": "whatsapp_business_account",
        "entry": [{
            "id": "102290129340398",
            "changes": [{
                "field": "messages",
                "value": {
                    "messaging_product": "whatsapp",
                    "metadata": {"display_phone_number": "15550783881",
                                 "phone_number_id": "106540352242922"},
                    "contacts": [{"profile": {"name": "Sheena"}, "wa_id": sender}],
                    "messages": [
                        {"from": sender, "id": mid, "timestamp": "1749416383",
                         "type": "text", "text": {"body": body}}
                        for mid, body in messages
                    ],
                },
            }],
        }],
    }


def post(client: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = client.post("/webhook", json=body)
    assert response.status_code == 200, response.text
    replies: list[dict[str, Any]] = response.json()["replies"]
    return replies


def history(db: Path, session_id: str = PHONE) -> list[tuple[str, str | None]]:
    with SQLiteSessionStore(db) as store:
        session = store.get(session_id)
        assert session is not None
        return [(m.role.value, m.content) for m in session.history]


def test_message_duplicate_and_restart_keep_one_history(tmp_path: Path) -> None:
    db = tmp_path / "webhook.db"
    with serve(db) as client:
        (first,) = post(client, payload(("wamid.1", "Hello there")))
        assert first["status"] == "answered" and first["to"] == PHONE and first["text"]
        (again,) = post(client, payload(("wamid.1", "Hello there")))  # redelivered
        assert again == {"id": "wamid.1", "to": PHONE, "status": "duplicate",
                         "text": first["text"]}, "a redelivery gets the stored reply back"
        (order,) = post(client, payload(("wamid.2", "Where is order 405?")))
        assert order["status"] == "answered" and "405" in order["text"]
    before = history(db)
    assert [text for role, text in before if role == "user"] == [
        "Hello there", "Where is order 405?",
    ]
    with serve(db) as client:  # a new process on the same file
        (late,) = post(client, payload(("wamid.2", "Where is order 405?")))
        assert late["status"] == "duplicate", "a dedup id must survive the restart"
        (after,) = post(client, payload(("wamid.3", "And order 406?")))
        assert after["status"] == "answered" and "406" in after["text"]
    after_restart = history(db)
    assert after_restart[: len(before)] == before, "the restart kept the history"
    assert [text for role, text in after_restart if role == "user"] == [
        "Hello there", "Where is order 405?", "And order 406?",
    ]


def test_statuses_and_media_are_not_turns(tmp_path: Path) -> None:
    statuses = {"object": "whatsapp_business_account", "entry": [{"changes": [{
        "field": "messages",
        "value": {"statuses": [{"id": "wamid.9", "status": "delivered"}]},
    }]}]}
    image = payload(("wamid.img", "ignored"))
    message = image["entry"][0]["changes"][0]["value"]["messages"][0]
    message.update(type="image", image={"id": "media-1"})
    del message["text"]
    with serve(tmp_path / "webhook.db") as client:
        assert post(client, statuses) == []
        assert post(client, image) == []
        assert client.post("/webhook", json={"entry": "not a list"}).status_code == 422


def test_subscription_check_echoes_the_challenge_only_for_our_token(tmp_path: Path) -> None:
    with serve(tmp_path / "webhook.db", WHATSAPP_VERIFY_TOKEN="s3cret") as client:
        ok = client.get("/webhook", params={"hub.mode": "subscribe",
                                            "hub.verify_token": "s3cret",
                                            "hub.challenge": "1158201444"})
        assert (ok.status_code, ok.text) == (200, "1158201444")
        bad = client.get("/webhook", params={"hub.mode": "subscribe",
                                             "hub.verify_token": "guess",
                                             "hub.challenge": "1"})
        assert bad.status_code == 403


def test_a_failed_turn_answers_500_and_its_retry_runs_it_again(tmp_path: Path) -> None:
    """A failed turn releases its claim: the platform's retry runs the turn again.

    The scripted engine fails on every "fail" message, so the retry fails too; what
    matters is that it ran (500 again, not a skipped "duplicate") and wrote nothing.
    """
    from chatflow_sqlalchemy.claims import list_claims

    db = tmp_path / "webhook.db"
    with serve(db) as client:
        post(client, payload(("wamid.1", "Hello")))
        failed = client.post("/webhook", json=payload(("wamid.2", "fail")))
        assert failed.status_code == 500
        retry = client.post("/webhook", json=payload(("wamid.2", "fail")))
        assert retry.status_code == 500, "the retry must run the turn, not skip it"
    assert [text for role, text in history(db) if role == "user"] == ["Hello"]  # rolled back
    with SQLiteSessionStore(db) as store:
        states = {claim.message_id: claim.state for claim in list_claims(store)}
    assert states == {"wamid.1": "done", "wamid.2": "released"}


# ------------------------------------------------------------------ the durable bot

DURABLE_BOT = "examples.durable_whatsapp_bot:app"


def test_the_durable_bot_answers_each_message_once_through_the_graph_api(tmp_path: Path) -> None:
    """Signed webhooks in, replies out at the Graph API; then web and workers apart."""
    from chatflow_sqlalchemy import open_store

    from ._whatsapp import PHONE_NUMBER_ID, SECRET, message, signed, webhook
    from .fake_graph import FakeGraphAPI

    db = tmp_path / "bot.db"
    with FakeGraphAPI() as fake:
        env = {"WHATSAPP_APP_SECRET": SECRET, "WHATSAPP_VERIFY_TOKEN": "s3cret",
               "WHATSAPP_ACCESS_TOKEN": "token", "WHATSAPP_PHONE_NUMBER_ID": PHONE_NUMBER_ID,
               "WHATSAPP_GRAPH_API_URL": fake.url}
        with serve(db, DURABLE_BOT, "/health", **env) as client:
            raw, headers = signed(webhook(message("wamid.1", "Where is order 405?")))
            first = client.post("/webhook", content=raw, headers=headers)
            assert first.json()["messages_queued"] == 1, first.text
            forged = client.post("/webhook", content=raw, headers={
                **headers, "X-Hub-Signature-256": "sha256=" + "0" * 64})
            assert forged.status_code == 403
            (reply,) = fake.wait_delivered(1)
            assert reply.to == PHONE and "405" in reply.text and "shipped" in reply.text
            again = client.post("/webhook", content=raw, headers=headers)
            assert again.json()["messages_queued"] == 0, "a redelivery must not be queued"
            check = client.get("/webhook", params={"hub.mode": "subscribe",
                                                   "hub.verify_token": "s3cret",
                                                   "hub.challenge": "7"})
            assert (check.status_code, check.text) == (200, "7")
        with serve(db, DURABLE_BOT, "/health", CHATFLOW_INBOX_WORKERS="separate", **env) as web:
            raw, headers = signed(webhook(message("wamid.2", "And order 406?")))
            assert web.post("/webhook", content=raw, headers=headers).status_code == 200
            store = open_store(f"sqlite:///{db}")
            try:
                states = {e.message_id: e.state for e in store.inbox.entries()}
            finally:
                store.close()
            assert states == {"wamid.1": "sent", "wamid.2": "pending"}, "the web app answered"
            workers = subprocess.Popen(
                [sys.executable, "-m", "chatflow_sqlalchemy.channels",
                 "examples.durable_whatsapp_bot:channel"],
                cwd=ROOT, env={**os.environ, "CHATFLOW_DATABASE_URL": f"sqlite:///{db}", **env},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            try:
                second = fake.wait_delivered(2)[1]
            finally:
                workers.send_signal(signal.SIGINT)
                out = workers.communicate(timeout=HANG_GUARD)[0]
            assert workers.returncode == 0, out
        assert "406" in second.text
        assert len(fake.requests) == 2, fake.requests
