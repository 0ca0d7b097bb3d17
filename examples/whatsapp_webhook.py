"""A WhatsApp Cloud API-style webhook: payload → store → the real Runner, offline.

Run it from the repository root (after ``pip install '.[examples]'`` or ``make install``)::

    uvicorn examples.whatsapp_webhook:app

The store comes from ``CHATFLOW_DATABASE_URL`` (any URL ``open_store`` accepts),
else the SQLite file ``chatflow-webhook.db`` in the working directory. The
"model" is :class:`chatflow_sqlalchemy.testing.ScriptedEngine`, so no network and
no API key are needed; swap in a real engine for a real bot.

A real WhatsApp app sends its reply through the Graph API
(``POST /{phone-number-id}/messages``); this one returns the replies in the
HTTP response instead, so you can see them with ``curl``.

**Delivery guarantee.** Each message id is claimed with ``store.claim`` for its
sender's session: the turn runs once, in arrival order per sender, and commits
the claim with its messages. If the turn fails (a provider error) the claim is
released and the app answers 500, so the platform's retry runs it again; if the
worker dies, the retry takes the claim over after its lease. A redelivery of a
processed id gets the stored reply back instead of a second run; one that
arrives while another worker still runs the id is answered 409 so the
platform retries it later.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

from chatflow_agent import Runner
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from chatflow_sqlalchemy import ClaimLostError, open_store
from chatflow_sqlalchemy.demo import build_agents
from chatflow_sqlalchemy.testing import ScriptedEngine

__all__ = [
    "DEFAULT_DATABASE_URL",
    "InFlightError",
    "IncomingText",
    "Reply",
    "WebhookPayload",
    "app",
    "create_app",
    "process_once",
    "text_messages",
]

DEFAULT_DATABASE_URL = "sqlite:///chatflow-webhook.db"
"""Where the store lives when ``CHATFLOW_DATABASE_URL`` is unset."""

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ the payload


class _Open(BaseModel):
    """The Cloud API adds fields over time: keep what we read, ignore the rest."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class TextBody(_Open):
    """``messages[].text``."""

    body: str


class WhatsAppMessage(_Open):
    """One entry of ``value.messages``: who sent what, under which id."""

    sender: str = Field(alias="from")
    id: str
    type: str = "text"
    text: TextBody | None = None


class ChangeValue(_Open):
    """``changes[].value``: new messages, or delivery statuses (ignored here)."""

    messages: list[WhatsAppMessage] = []


class Change(_Open):
    """``entry[].changes[]``."""

    field: str = "messages"
    value: ChangeValue


class Entry(_Open):
    """``entry[]``: one business account's changes."""

    id: str | None = None
    changes: list[Change] = []


class WebhookPayload(_Open):
    """The body WhatsApp POSTs: ``{"object": ..., "entry": [...]}``."""

    object: str = "whatsapp_business_account"
    entry: list[Entry] = []


@dataclass(frozen=True)
class IncomingText:
    """A text message to answer: ``sender`` is the session id, ``id`` the dedup id."""

    sender: str
    id: str
    body: str


def text_messages(payload: WebhookPayload) -> list[IncomingText]:
    """Every text message of a delivery, in order (statuses and media are skipped)."""
    return [
        IncomingText(sender=message.sender, id=message.id, body=message.text.body)
        for entry in payload.entry
        for change in entry.changes
        for message in change.value.messages
        if message.type == "text" and message.text is not None
    ]


# ------------------------------------------------------------------ one message


class Reply(BaseModel):
    """What became of one message: answered now, or a duplicate (with the stored reply)."""

    id: str
    to: str
    status: Literal["answered", "duplicate"]
    text: str | None = None


class InFlightError(Exception):
    """Another worker is processing this message id right now: answer 409, let it retry."""


async def process_once(
    store: Any, message: IncomingText, turn: Callable[[], Awaitable[str | None]]
) -> Reply:
    """Run ``turn`` for ``message`` exactly once (``store.claim``), in order per sender.

    A redelivery of a processed id returns the stored reply (``duplicate``).
    If ``turn`` raises, the claim is released and the error propagates, so the
    platform's retry runs the turn again.

    Raises:
        InFlightError: Another delivery of the id holds a live claim.

    """
    async with store.claim(message.id, session_id=message.sender) as claim:
        if claim.status == "in_flight":
            raise InFlightError(message.id)
        if not claim.acquired:
            return Reply(id=message.id, to=message.sender, status="duplicate",
                         text=claim.response)
        text = await turn()
        claim.response = text
        return Reply(id=message.id, to=message.sender, status="answered", text=text)


# ------------------------------------------------------------------ the app


def create_app(database_url: str | None = None) -> FastAPI:
    """Build the webhook app; the store opens at startup and closes at shutdown.

    Args:
        database_url: Where the sessions live. ``None``: ``CHATFLOW_DATABASE_URL``,
            else :data:`DEFAULT_DATABASE_URL`, read when the app starts.

    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        url = database_url or os.environ.get("CHATFLOW_DATABASE_URL") or DEFAULT_DATABASE_URL
        store = open_store(url)
        agents = build_agents()
        app.state.store = store
        app.state.runner = Runner(
            starting_agent=agents["Support"], session_store=store, engine=ScriptedEngine()
        )
        try:
            yield
        finally:
            await store.aclose()

    app = FastAPI(title="chatflow-sqlalchemy WhatsApp webhook example", lifespan=lifespan)

    @app.get("/webhook", response_class=PlainTextResponse)
    async def verify(
        mode: str = Query("", alias="hub.mode"),
        token: str = Query("", alias="hub.verify_token"),
        challenge: str = Query("", alias="hub.challenge"),
    ) -> str:
        """Meta's subscription check: echo the challenge if the token is ours."""
        expected = os.environ.get("WHATSAPP_VERIFY_TOKEN")
        if mode == "subscribe" and expected and token == expected:
            return challenge
        raise HTTPException(403, "verification failed: set WHATSAPP_VERIFY_TOKEN to your token")

    @app.post("/webhook")
    async def receive(payload: WebhookPayload, request: Request) -> dict[str, list[Reply]]:
        """Answer every new text message of the delivery; replay the reply of redelivered ones."""
        store, runner = request.app.state.store, request.app.state.runner
        replies = []
        for message in text_messages(payload):

            async def turn(message: IncomingText = message) -> str | None:
                response = await runner.run_async(session_id=message.sender,
                                                  user_message=message.body)
                return response.content

            try:
                replies.append(await process_once(store, message, turn))
            except (InFlightError, ClaimLostError):
                raise HTTPException(409, f"{message.id} is being processed; retry") from None
            except Exception:
                log.exception("turn failed for message %s; its claim is released", message.id)
                raise HTTPException(500, f"the turn for {message.id} failed") from None
        return {"replies": replies}

    return app


app = create_app()
"""The app ``uvicorn examples.whatsapp_webhook:app`` serves."""
