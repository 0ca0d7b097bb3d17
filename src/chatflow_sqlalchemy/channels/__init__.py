"""Channels that answer through the durable inbox (:mod:`chatflow_sqlalchemy.inbox`).

:class:`DurableWhatsAppChannel` is chatflow-agent's ``WhatsAppChannel`` whose
webhook stores each message before its 200 and whose workers answer them::

    from chatflow_sqlalchemy.channels import DurableWhatsAppChannel

    channel = DurableWhatsAppChannel(verify_token=..., access_token=..., phone_number_id=...,
                                     app_secret=..., store=store)
    channel.attach(Runner(starting_agent=agent, session_store=store))
    channel.run()                         # or: uvicorn myapp:app, with app = channel.app

Workers alone, for deployments that keep them apart from the web processes:
``await channel.serve()``, ``channel.run_workers()`` or
``python -m chatflow_sqlalchemy.channels myapp:channel``.

The names are imported lazily (PEP 562): the channel needs FastAPI, httpx and
uvicorn (``pip install 'chatflow-sqlalchemy[whatsapp]'``), and importing this
package without them only fails when a name is used, saying what to install.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatflow_sqlalchemy.channels.whatsapp import (
        WHATSAPP_TEXT_LIMIT,
        DurableWhatsAppChannel,
        GraphAPIError,
    )

__all__ = ["WHATSAPP_TEXT_LIMIT", "DurableWhatsAppChannel", "GraphAPIError"]

_HOME = "chatflow_sqlalchemy.channels.whatsapp"
_NEEDS = ("fastapi", "httpx", "uvicorn")


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(_HOME)
    except ImportError as exc:
        if exc.name not in _NEEDS:
            raise
        from chatflow_agent.exceptions import DependencyError

        raise DependencyError(
            feature="DurableWhatsAppChannel",
            extra_package="whatsapp",
            install_command="pip install 'chatflow-sqlalchemy[whatsapp]'",
        ) from exc
    return getattr(module, name)


def __dir__() -> list[str]:
    return sorted(__all__)
