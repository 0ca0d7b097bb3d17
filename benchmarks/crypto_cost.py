"""What encryption at rest costs per turn: the same turns with and without ``cipher=``.

Run: ``python -m benchmarks.crypto_cost [--turns 400] [--url POSTGRES_URL]``.

One process, one session per store, ``--turns`` Runner-shaped turns (USER,
then MODEL with a ~300-character reply, inside ``session.lock``) on a SQLite
file and on PostgreSQL (a fresh schema), each without a cipher and with
``AESGCMCipher`` (AES-256-GCM). Reported per backend: mean microseconds per
turn both ways and the difference. Rounds alternate and the best of three is
kept, to damp the noise of a shared machine. ``cipher_alone`` is the
AES-GCM work of one turn by itself (seal the two messages; open them again
on a reload), which the end-to-end difference hides in noise on a loaded
machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from chatflow_agent import Agent, Message, Role

from benchmarks.pg import create_schema, drop_schema, pg_url_from_env, schema_connect_args

__all__ = ["main", "run_cost"]

_REPLY = "Your order 5 left the warehouse this morning and should arrive tomorrow. " * 4


def _per_turn(store: Any, turns: int) -> float:
    ctx = store.get_or_create(f"bench-{time.monotonic_ns()}", Agent(name="a", instructions=""))

    async def run() -> float:
        started = time.perf_counter()
        for n in range(turns):
            async with ctx.lock:
                await ctx.aadd_message(Message(role=Role.USER, content=f"where is order {n}?"))
                await ctx.aadd_message(Message(role=Role.MODEL, content=_REPLY))
        return (time.perf_counter() - started) / turns * 1e6

    return asyncio.run(run())


def _measure(open_store: Any, turns: int) -> dict[str, float]:
    from chatflow_sqlalchemy.crypto import AESGCMCipher

    cipher = AESGCMCipher({"k1": os.urandom(32)}, "k1")
    best = {"plain_us": float("inf"), "encrypted_us": float("inf")}
    for _ in range(3):
        for label, kwargs in (("plain_us", {}), ("encrypted_us", {"cipher": cipher})):
            store = open_store(**kwargs)
            try:
                _per_turn(store, 20)  # warm up
                best[label] = min(best[label], _per_turn(store, turns))
            finally:
                store.close()
    return {
        "plain_us": round(best["plain_us"]),
        "encrypted_us": round(best["encrypted_us"]),
        "cost_us": round(best["encrypted_us"] - best["plain_us"]),
    }


def _cipher_alone() -> dict[str, float]:
    """Microseconds the cipher itself adds to a turn: seal two messages, open them on reload."""
    from chatflow_sqlalchemy.context import dump_message
    from chatflow_sqlalchemy.crypto import AESGCMCipher

    cipher = AESGCMCipher({"k1": os.urandom(32)}, "k1")
    texts = [
        dump_message(Message(role=Role.USER, content="where is order 5?")),
        dump_message(Message(role=Role.MODEL, content=_REPLY)),
    ]
    rounds = 20_000
    started = time.perf_counter()
    tokens = []
    for _ in range(rounds):
        tokens = [cipher.encrypt(text, "session") for text in texts]
    sealed = (time.perf_counter() - started) / rounds * 1e6
    started = time.perf_counter()
    for _ in range(rounds):
        for token in tokens:
            cipher.decrypt(token, "session")
    opened = (time.perf_counter() - started) / rounds * 1e6
    return {"seal_us_per_turn": round(sealed, 1), "open_us_per_turn": round(opened, 1)}


def run_cost(turns: int, pg_url: str | None) -> dict[str, Any]:
    """Measure on a SQLite file and (if reachable) PostgreSQL."""
    from chatflow_sqlalchemy.backends.postgresql import PostgresSessionStore
    from chatflow_sqlalchemy.backends.sqlite import SQLiteSessionStore

    figures: dict[str, Any] = {"turns": turns, "cipher_alone": _cipher_alone()}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "cost.db"
        figures["sqlite"] = _measure(lambda **kw: SQLiteSessionStore(path, **kw), turns)
    if pg_url:
        schema = create_schema(pg_url, "crypto")
        try:
            figures["postgresql"] = _measure(
                lambda **kw: PostgresSessionStore(
                    pg_url, connect_args=schema_connect_args(schema), **kw
                ),
                turns,
            )
        finally:
            drop_schema(pg_url, schema)
    return figures


def main(argv: list[str] | None = None) -> None:
    """Command line: print the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=400)
    parser.add_argument("--url", default=None)
    args = parser.parse_args(argv)
    print(json.dumps(run_cost(args.turns, pg_url_from_env(args.url)), indent=2))


if __name__ == "__main__":
    main()
