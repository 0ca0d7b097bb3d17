"""What the durable WhatsApp channel's tests share, and their worker process.

``serve_whatsapp`` is a worker for :func:`chatflow_sqlalchemy.testing.harness.start_process`:
it serves the channel's real FastAPI app with uvicorn on a loopback port,
workers in its lifespan, as a deployment would, and reports ``("ready",
pid)`` once it listens and ``("turn", pid, text)`` whenever its model is
asked for a turn. Its model waits while the ``gate`` file is missing, so a
test can kill the process in the middle of a turn.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import socket
from pathlib import Path
from typing import Any

from chatflow_agent import Agent, Message, Role, Runner

from chatflow_sqlalchemy.testing import ScriptedEngine, StoreSpec

SECRET = "test-app-secret"
VERIFY_TOKEN = "test-verify-token"
ACCESS_TOKEN = "test-access-token"
PHONE_NUMBER_ID = "106540352242922"
PHONE = "15550100"
LEASE_SECONDS = 1.0
"""The stores' ``turn_lease_seconds``: a killed worker's session is taken over this soon."""

BOT = Agent(name="Bot", instructions="")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def build_channel(store: Any, graph_url: str, engine: Any = None, **options: Any) -> Any:
    """A DurableWhatsAppChannel on ``store`` sending to ``graph_url``, its runner attached.

    Backoffs are short (the tests wait for retries); ``options`` override any argument.
    """
    from chatflow_sqlalchemy.channels import DurableWhatsAppChannel

    arguments: dict[str, Any] = {
        "verify_token": VERIFY_TOKEN, "access_token": ACCESS_TOKEN,
        "phone_number_id": PHONE_NUMBER_ID, "app_secret": SECRET, "store": store,
        "graph_api_url": graph_url, "coalesce_seconds": 0.05, "retry_seconds": 0.0,
        "outbound_base_delay": 0.01, "outbound_max_delay": 0.05,
        "fallback_message": "Sorry, try again later.",
        "unsupported_media_message": "I can only read text.",
        **options,
    }
    channel = DurableWhatsAppChannel(**arguments)
    channel.attach(Runner(starting_agent=BOT, session_store=store,
                          engine=engine or ScriptedEngine()))
    return channel


def message(wamid: str, text: str | None, *, sender: str = PHONE, timestamp: int = 1749416383,
            kind: str = "text") -> dict[str, Any]:
    """One ``value.messages[]`` object of the Cloud API (``text`` None: an image)."""
    found: dict[str, Any] = {"from": sender, "id": wamid, "timestamp": str(timestamp),
                             "type": kind}
    if kind == "text":
        found["text"] = {"body": text}
    else:
        found[kind] = {"id": f"media-{wamid}", "mime_type": "image/jpeg"}
    return found


def webhook(*messages: dict[str, Any]) -> dict[str, Any]:
    """A Cloud API webhook body carrying ``messages``."""
    return {
        "object": "whatsapp_business_account",
        "entry": [{"id": "102290129340398", "changes": [{"field": "messages", "value": {
            "messaging_product": "whatsapp",
            "metadata": {"display_phone_number": "15550783881",
                         "phone_number_id": PHONE_NUMBER_ID},
            "messages": list(messages),
        }}]}],
    }


def signed(body: dict[str, Any], secret: str = SECRET) -> tuple[bytes, dict[str, str]]:
    """The raw body and the headers Meta sends with it (``X-Hub-Signature-256``)."""
    raw = json.dumps(body).encode()
    signature = "sha256=" + hmac.new(secret.encode(), raw, hashlib.sha256).hexdigest()
    return raw, {"Content-Type": "application/json", "X-Hub-Signature-256": signature}


def user_texts(store: Any, session_id: str = PHONE) -> list[str | None]:
    """The user messages stored in ``session_id``'s history (one per turn)."""
    session = store.get(session_id)
    return [] if session is None else [m.content for m in session.history if m.role == Role.USER]


class GatedEngine(ScriptedEngine):
    """The scripted engine, reporting each model call and waiting while ``gate`` is missing."""

    def __init__(self, gate: str, events: Any) -> None:
        super().__init__()
        self.gate = gate
        self.events = events

    async def generate_turn_async(self, agent: Agent, history: list[Message]) -> Any:
        asked = [m.content for m in history if m.role == Role.USER][-1]
        self.events.put(("turn", os.getpid(), asked))
        while not os.path.exists(self.gate):
            await asyncio.sleep(0.02)
        return await super().generate_turn_async(agent, history)


def serve_whatsapp(spec: StoreSpec, graph_url: str, port: int, gate: str,
                   coalesce_seconds: float, events: Any) -> None:
    """Serve the channel's app with uvicorn on ``port`` (workers in its lifespan) until killed."""
    import uvicorn

    store = spec.open(turn_lease_seconds=LEASE_SECONDS)
    channel = build_channel(store, graph_url, GatedEngine(gate, events),
                            coalesce_seconds=coalesce_seconds)
    server = uvicorn.Server(uvicorn.Config(channel.app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))

    async def main() -> None:
        serving = asyncio.ensure_future(server.serve())
        while not server.started:
            if serving.done():
                await serving
                raise RuntimeError("uvicorn stopped before it listened")
            await asyncio.sleep(0.01)
        events.put(("ready", os.getpid()))
        await serving

    asyncio.run(main())


def gate_path(directory: Path) -> str:
    return str(directory / "gate-open")
