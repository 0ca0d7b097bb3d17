"""One benchmark process: ``python -m benchmarks.worker`` (driven by the parent over stdio).

Protocol: the parent writes one JSON spec line; the worker opens its store,
prints ``READY``, waits for a ``GO`` line (so that N workers start together),
runs, and prints ``RESULT <json>``. Each store runs in its own process so
that peak RSS is per store.
"""

from __future__ import annotations

import asyncio
import gc
import json
import resource
import sys
import time
import traceback
from typing import Any

__all__ = ["main"]


def _rss_kb() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss // 1024)


def _peak_rss_kb() -> int:
    """This process's peak RSS (``VmHWM``: unlike ``ru_maxrss`` it is not inherited
    from the parent across fork + exec)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _handshake() -> None:
    print("READY", flush=True)
    if sys.stdin.readline().strip() != "GO":
        raise SystemExit("parent went away")


async def run_turns(spec: dict[str, Any]) -> dict[str, Any]:
    """Drive this worker's share of the webhook-turn workload."""
    from benchmarks.stores import Target, adapter_class
    from benchmarks.workload import plan_for, session_ids

    adapter = adapter_class(spec["adapter"])(Target.from_json(spec["target"]))
    sessions = session_ids(spec["sessions"])
    plan = plan_for(spec["mode"], sessions, spec["turns"], spec["worker"], spec["workers"])
    payloads = [adapter.payload(ref) for ref in plan.turns]
    await adapter.open()
    profiler = _profiler(adapter, spec)
    gc.collect()
    rss_ready = _rss_kb()
    _handshake()
    latencies, won, start = [], [], time.monotonic()
    if profiler is not None:
        profiler.__enter__()
    for ref, payload in zip(plan.turns, payloads, strict=True):
        began = time.perf_counter()
        ran = await adapter.turn(ref, payload)
        if ran:
            latencies.append((time.perf_counter() - began) * 1000.0)
            won.append(ref.webhook_id)
    end = time.monotonic()
    if profiler is not None:
        profiler.__exit__(None, None, None)
        _dump_profile(profiler, spec["profile"])
    windows = await adapter.read_windows(sessions) if adapter.ephemeral else None
    await adapter.close()
    return {
        "ran": len(latencies),
        "offered": len(plan.turns),
        "won": won if spec["mode"] == "redelivery" else [],
        "latencies_ms": latencies,
        "start": start,
        "end": end,
        "rss_ready_kb": rss_ready,
        "rss_peak_kb": _peak_rss_kb(),
        "windows": windows,
    }


def _profiler(adapter: Any, spec: dict[str, Any]) -> Any:
    if not spec.get("profile"):
        return None
    from benchmarks.profiling import Profiler

    return Profiler(getattr(adapter, "store", None))


def _dump_profile(profiler: Any, path: str) -> None:
    profiler.stats().dump_stats(path)


async def run_rss(spec: dict[str, Any]) -> dict[str, Any]:
    """Touch many sessions (one turn each) with one store; report RSS growth."""
    from benchmarks.stores import Target, adapter_class
    from benchmarks.workload import TurnRef, session_ids

    adapter = adapter_class(spec["adapter"])(Target.from_json(spec["target"]))
    await adapter.open()
    refs = [TurnRef(sid, 0, f"wamid.rss.{sid}") for sid in session_ids(spec["sessions"])]
    warmup = spec["warmup"]
    _handshake()
    start = time.monotonic()
    for ref in refs[:warmup]:
        await adapter.turn(ref, adapter.payload(ref))
    gc.collect()
    baseline = _rss_kb()
    for ref in refs[warmup:]:
        await adapter.turn(ref, adapter.payload(ref))
    gc.collect()
    after = _rss_kb()
    end = time.monotonic()
    await adapter.close()
    return {"baseline_kb": baseline, "after_kb": after, "sessions": len(refs),
            "seconds": end - start, "rss_peak_kb": _peak_rss_kb()}


async def run_loop_lag(spec: dict[str, Any]) -> dict[str, Any]:
    """Event-loop lag while concurrent writers append 2 KB messages."""
    from benchmarks.looplag import measure

    return await measure(spec)


ACTIONS = {"turns": run_turns, "rss": run_rss, "looplag": run_loop_lag}


def main() -> None:
    """Read the spec, run the action, print the result line."""
    spec = json.loads(sys.stdin.readline())
    try:
        result = asyncio.run(ACTIONS[spec["action"]](spec))
    except BaseException as exc:
        if isinstance(exc, SystemExit):
            raise
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
