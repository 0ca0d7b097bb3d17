"""A deferred load (get_or_create on a loop) racing a use of the context from another thread."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from chatflow_agent import Agent, Message, Role

from chatflow_sqlalchemy import open_store
from chatflow_sqlalchemy.context import SessionContext
from chatflow_sqlalchemy.crypto import AESGCMCipher

SUPPORT = Agent(name="support", instructions="help")
BILLING = Agent(name="billing", instructions="bills")
KEYS = {"k1": bytes(range(32))}


class GatedCipher(AESGCMCipher):
    """Decrypts only once ``gate`` is set, once armed: holds a load mid-read."""

    def __init__(self) -> None:
        super().__init__(KEYS, "k1")
        self.armed = False
        self.entered = threading.Event()
        self.gate = threading.Event()

    def decrypt(self, token: str, associated_data: str = "") -> str:
        if self.armed:
            self.entered.set()
            self.gate.wait(30)
        return super().decrypt(token, associated_data)


def test_a_read_from_another_thread_waits_for_the_load_in_progress(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    with open_store(url, cipher=AESGCMCipher(KEYS, "k1")) as seed:
        ctx = seed.get_or_create("s1", BILLING, {"plan": "gold"})

        async def turn() -> None:
            async with ctx.lock:
                ctx.add_message(Message(role=Role.USER, content="hello"))

        asyncio.run(turn())
    cipher = GatedCipher()
    with open_store(url, cipher=cipher) as store:

        async def on_the_loop() -> SessionContext:
            return store.get_or_create("s1", SUPPORT)

        lazy = asyncio.run(on_the_loop())
        cipher.armed = True
        loader = threading.Thread(target=lazy.ensure_loaded)
        loader.start()
        assert cipher.entered.wait(30)  # the load is reading, held
        seen: dict[str, object] = {}

        def read() -> None:
            seen["history"] = [m.content for m in lazy.history]
            seen["metadata"] = dict(lazy.metadata)
            seen["agent"] = lazy.active_agent.name

        reader = threading.Thread(target=read)
        reader.start()
        reader.join(0.5)  # lets a reader that does not wait read now
        cipher.gate.set()
        loader.join(30)
        reader.join(30)
        assert seen == {"history": ["hello"], "metadata": {"plan": "gold"}, "agent": "billing"}
