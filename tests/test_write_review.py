"""Found reviewing the one write algorithm: behaviour the old writer had and lost."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Role

from chatflow_sqlalchemy.crypto import AESGCMCipher

BOT = Agent(name="Bot", instructions="")


def test_an_encrypting_store_refuses_a_claimed_nul_reply_before_writing(sql_store: Any) -> None:
    """On an encrypting store too, a claimed turn whose reply a claim cannot hold is refused
    before it is written: else the turn commits with its claim done, the block's
    ``claim.response = result.content`` then fails, and the redelivery finds the claim
    done without its reply."""
    cipher = AESGCMCipher(keys={"k1": bytes(range(32))}, primary="k1")
    store = sql_store(cipher=cipher)

    async def main() -> None:
        ctx = await store.aget_or_create("s", BOT)
        with pytest.raises(ValueError, match="NUL"):
            async with store.claim("m1", session_id="s"), ctx.lock:
                ctx.add_message(Message(role=Role.USER, content="hi"))
                ctx.add_message(Message(role=Role.MODEL, content="a\x00b"))

    asyncio.run(main())
    assert sql_store(cipher=cipher).get("s") is None, "nothing written: no session is left"
    with store.claim("m1", session_id="s") as again:
        assert again.acquired
