"""A durable WhatsApp bot: chatflow-agent's WhatsApp channel on the chatflow-sqlalchemy inbox.

Run it from the repository root (after ``pip install '.[whatsapp]'`` or ``make install``)::

    WHATSAPP_APP_SECRET=your-app-secret uvicorn examples.durable_whatsapp_bot:app

``app`` is chatflow-agent's own WhatsApp webhook app (the subscription check,
the ``X-Hub-Signature-256`` check, the body limits), except that each message
is stored in the database before the 200, and the workers that answer it
start and stop with the app. Kill the server at any moment: what it answered
200 to is answered after the restart, once.

Settings (environment):

* ``CHATFLOW_DATABASE_URL``: the store (any URL ``open_store`` accepts), else
  the SQLite file ``chatflow-whatsapp.db`` in the working directory.
* ``WHATSAPP_APP_SECRET`` (required): your Meta app's secret; webhooks not
  signed with it are refused.
* ``WHATSAPP_VERIFY_TOKEN``: the token of Meta's subscription check.
* ``WHATSAPP_ACCESS_TOKEN`` and ``WHATSAPP_PHONE_NUMBER_ID``: where replies
  are sent from. Without them replies are only stored, with the turn
  (``chatflow-sqlalchemy sessions show PHONE`` shows them).
* ``WHATSAPP_GRAPH_API_URL``: send to this URL instead of
  ``https://graph.facebook.com`` (a local stand-in, for trying it offline).
* ``CHATFLOW_INBOX_WORKERS=separate``: the app only stores messages; run the
  workers elsewhere with ``python -m chatflow_sqlalchemy.channels
  examples.durable_whatsapp_bot:channel``.

The "model" is :class:`chatflow_sqlalchemy.testing.ScriptedEngine` driving the
demo's agents, so no API key is needed; swap in a real engine for a real bot.
"""

from __future__ import annotations

import os

from chatflow_agent import Runner

from chatflow_sqlalchemy import open_store
from chatflow_sqlalchemy.channels import DurableWhatsAppChannel
from chatflow_sqlalchemy.demo import build_agents
from chatflow_sqlalchemy.testing import ScriptedEngine

__all__ = ["DEFAULT_DATABASE_URL", "app", "channel", "runner", "store"]

DEFAULT_DATABASE_URL = "sqlite:///chatflow-whatsapp.db"
"""Where the store lives when ``CHATFLOW_DATABASE_URL`` is unset."""


def _app_secret() -> str:
    secret = os.environ.get("WHATSAPP_APP_SECRET")
    if not secret:
        raise SystemExit(
            "set WHATSAPP_APP_SECRET to your Meta app's secret (any string to try it locally): "
            "webhooks are refused unless signed with it"
        )
    return secret


store = open_store(os.environ.get("CHATFLOW_DATABASE_URL") or DEFAULT_DATABASE_URL)
"""The sessions and the inbox, in one database."""

runner = Runner(
    starting_agent=build_agents()["Support"], session_store=store, engine=ScriptedEngine()
)
"""The bot: its turns are stored with the inbox batch they answer."""

channel = DurableWhatsAppChannel(
    verify_token=os.environ.get("WHATSAPP_VERIFY_TOKEN", ""),
    access_token=os.environ.get("WHATSAPP_ACCESS_TOKEN"),
    phone_number_id=os.environ.get("WHATSAPP_PHONE_NUMBER_ID"),
    app_secret=_app_secret(),
    fallback_message="Sorry, we are having trouble right now. Please try again in a moment.",
    unsupported_media_message="For now I can only read text messages.",
    store=store,
    graph_api_url=os.environ.get("WHATSAPP_GRAPH_API_URL"),
    in_app_workers=os.environ.get("CHATFLOW_INBOX_WORKERS", "app") != "separate",
)
"""The WhatsApp channel: ``channel.run()`` serves it too."""
channel.attach(runner)

app = channel.app
"""What ``uvicorn examples.durable_whatsapp_bot:app`` serves."""
