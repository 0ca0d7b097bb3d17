"""Event-loop lag under concurrent writers: does the store's disk I/O stall the loop?

Eight writer tasks each append 2 KB messages to their own session (USER/MODEL
alternating, so the window prunes once it is full). A ticker task sleeps 1 ms
in a loop and records how late it wakes up: that lateness is what every other
request on the same loop would wait. This project's store is written to with
``await session.aadd_message`` (disk work on its private pool); upstream's has
no async API, so its ``add_message`` runs on the loop, as a bot would call it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from chatflow_agent import Message, Role

__all__ = ["measure"]

TICK = 0.001


async def _ticker(stop: asyncio.Event, lags: list[float]) -> None:
    while not stop.is_set():
        began = time.perf_counter()
        await asyncio.sleep(TICK)
        lags.append((time.perf_counter() - began - TICK) * 1000.0)


async def _writer(session: Any, count: int, size: int, use_async: bool) -> None:
    for index in range(count):
        role = Role.USER if index % 2 == 0 else Role.MODEL
        message = Message(role=role, content=f"{index:06d}" + "x" * (size - 6))
        if use_async:
            await session.aadd_message(message)
        else:
            session.add_message(message)
            await asyncio.sleep(0)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the writers and the ticker; report lag percentiles (ms) and writes/s."""
    from benchmarks.stores import Target, adapter_class
    from benchmarks.worker import _handshake

    adapter: Any = adapter_class(spec["adapter"])(Target.from_json(spec["target"]))
    await adapter.open()
    sessions = [
        adapter.store.get_or_create(f"lag-{index}", adapter.agent)
        for index in range(spec["writers"])
    ]
    use_async = hasattr(sessions[0], "aadd_message")
    _handshake()
    stop, lags = asyncio.Event(), list[float]()
    ticker = asyncio.create_task(_ticker(stop, lags))
    began = time.perf_counter()
    await asyncio.gather(
        *(_writer(s, spec["messages"], spec["size"], use_async) for s in sessions)
    )
    elapsed = time.perf_counter() - began
    stop.set()
    await ticker
    await adapter.close()
    writes = spec["writers"] * spec["messages"]
    return {
        "p50_ms": _percentile(lags, 0.50),
        "p99_ms": _percentile(lags, 0.99),
        "max_ms": max(lags, default=0.0),
        "ticks": len(lags),
        "writes_per_s": writes / elapsed,
        "async_api": use_async,
    }
