"""The webhook-claim suite: what ``store.claim`` costs, and whether it holds under kills.

Two parts, on SQLite (a file) and PostgreSQL (a fresh schema):

* **cost**: one process handles ``cost_messages`` webhooks, each one turn
  (USER + MODEL inside ``session.lock``), three ways: no dedup, the 0.3.4
  ``record_processed_message`` claim before the turn, and ``store.claim``
  around it (DESIGN.md's pattern). Per handler: mean microseconds and the
  statements sent to the database (a PostgreSQL pipeline counts once;
  BEGIN/COMMIT are not counted).
* **kills**: ``messages`` webhooks of one session are delivered to every one
  of 2 and 4 worker processes (the platform fans out, and retries a delivery
  answered ``in_flight`` until it is ``done``). Meanwhile workers are
  SIGKILLed at random points and restarted with the deliveries they had not
  finished. Counted from the stored history afterwards: delivered,
  processed, doubled, lost, out of order (adjacent pairs stored in the wrong
  order).
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.pg import create_schema, drop_schema, schema_connect_args
from benchmarks.runner import Env

__all__ = ["ClaimConfig", "render_claims", "run_claims"]

_SESSION = "whatsapp:+15550100"


@dataclass(frozen=True)
class ClaimConfig:
    """Sizes of the claim suite."""

    cost_messages: int = 300
    messages: int = 60
    workers: tuple[int, ...] = (2, 4)
    lease_seconds: float = 1.0
    kill_every: tuple[float, float] = (0.5, 2.0)
    latency: float = 0.02


def _open(spec: dict[str, Any], **kwargs: Any) -> Any:
    if spec["kind"] == "sqlite":
        from chatflow_sqlalchemy import SQLiteSessionStore

        return SQLiteSessionStore(spec["path"], **kwargs)
    from chatflow_sqlalchemy import PostgresSessionStore

    return PostgresSessionStore(
        spec["url"], connect_args=schema_connect_args(spec["schema"]), **kwargs
    )


# ------------------------------------------------------------------ cost


class _Counter:
    """Counts the statements a store sends (SQLAlchemy's events see every one)."""

    def __init__(self, store: Any) -> None:
        from sqlalchemy import event

        self.count = 0
        event.listen(store.engine, "before_cursor_execute", self._core)
        self._store = store

    def _core(self, *_args: Any) -> None:
        self.count += 1

    def watch_async_engine(self) -> None:
        from sqlalchemy import event

        aengine = self._store.runtime.aengine
        if aengine is not None:
            event.listen(aengine.sync_engine, "before_cursor_execute", self._core)

    def close(self) -> None:
        from sqlalchemy import event

        event.remove(self._store.engine, "before_cursor_execute", self._core)


async def _cost_case(store: Any, mode: str, n: int) -> tuple[float, float]:
    from chatflow_agent import Agent, Message, Role

    ctx = await store.aget_or_create(f"{_SESSION}:{mode}", Agent(name="Bot", instructions=""))

    async def turn(k: int) -> None:
        async with ctx.lock:
            ctx.add_message(Message(role=Role.USER, content=f"m{k}"))
            ctx.add_message(Message(role=Role.MODEL, content=f"r{k}"))

    async def handle(k: int) -> None:
        mid = f"{mode}-{k}"
        if mode == "record":
            if await store.arecord_processed_message(mid):
                await turn(k)
        elif mode == "claim":
            async with store.claim(mid, session_id=ctx.session_id) as claim:
                if claim.acquired:
                    await turn(k)
                    claim.response = f"r{k}"
        else:
            await turn(k)

    for k in range(10):  # warm-up: connections, compiled statements
        await handle(-1 - k)
    counter = _Counter(store)
    counter.watch_async_engine()
    try:
        began = time.perf_counter()
        for k in range(n):
            await handle(k)
        seconds = time.perf_counter() - began
    finally:
        counter.close()
    return seconds / n * 1e6, counter.count / n


def _cost(spec: dict[str, Any], cfg: ClaimConfig) -> list[dict[str, Any]]:
    rows = []
    for mode in ("none", "record", "claim"):
        store = _open(spec, default_max_turns=10)
        try:
            micros, statements = asyncio.run(_cost_case(store, mode, cfg.cost_messages))
        finally:
            store.close()
        rows.append({"mode": mode, "us": micros, "statements": statements})
    return rows


# ------------------------------------------------------------------ kills


def _kill_worker(spec: dict[str, Any], deliveries: list[str], lease: float, latency: float,
                 progress: str) -> None:
    """Handle ``deliveries`` (message ids) as DESIGN.md's handler; retry in-flight ones."""
    from chatflow_agent import Agent, BaseEngine, Message, Role, Runner
    from chatflow_agent.core.engines.base import EngineTurnResult

    rng = random.Random()

    class Model(BaseEngine):
        async def generate_turn_async(
            self, agent: Agent, history: list[Message]
        ) -> EngineTurnResult:
            await asyncio.sleep(rng.uniform(0, latency))
            text = next(m.content for m in reversed(history) if m.role == Role.USER)
            return EngineTurnResult(text=f"reply to {text}")

    store = _open(spec, default_max_turns=10_000)
    runner = Runner(starting_agent=Agent(name="Bot", instructions=""), session_store=store,
                    engine=Model())

    async def on_webhook(mid: str) -> str:
        async with store.claim(mid, session_id=_SESSION, lease_seconds=lease) as claim:
            if not claim.acquired:
                return claim.status
            await asyncio.sleep(rng.uniform(0, latency))  # work before the turn
            result = await runner.run_async(_SESSION, mid)
            claim.response = result.content
            return "done"

    async def deliver() -> None:
        pending = list(deliveries)
        with open(progress, "a") as log:
            while pending:
                retry = []
                for mid in pending:
                    try:
                        status = await on_webhook(mid)
                    except Exception:  # a lost claim or a failed turn: the platform retries
                        status = "in_flight"
                    if status == "done":
                        log.write(mid + "\n")
                        log.flush()
                    else:
                        retry.append(mid)
                    await asyncio.sleep(rng.uniform(0.001, 0.005))
                pending = retry
                if pending:
                    await asyncio.sleep(0.05)

    asyncio.run(deliver())
    store.close()


def _start(spec: dict[str, Any], deliveries: list[str], cfg: ClaimConfig, progress: Path) -> Any:
    ctx = multiprocessing.get_context("spawn")
    process = ctx.Process(
        target=_kill_worker,
        args=(spec, deliveries, cfg.lease_seconds, cfg.latency, str(progress)),
        daemon=True,
    )
    process.start()
    return process


def _kills(spec: dict[str, Any], cfg: ClaimConfig, n_workers: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    ids = [f"m{k:04d}" for k in range(cfg.messages)]
    logs = [Path(spec["dir"]) / f"progress-{n_workers}-{w}.txt" for w in range(n_workers)]
    for log in logs:
        log.write_text("")
    workers = [_start(spec, ids, cfg, log) for log in logs]
    kills = 0
    deadline = time.monotonic() + 600
    try:
        while any(w.is_alive() for w in workers):
            if time.monotonic() > deadline:
                raise RuntimeError("the kill run did not finish in 600 s")
            time.sleep(rng.uniform(*cfg.kill_every))
            victim = rng.randrange(n_workers)
            if not workers[victim].is_alive():
                continue
            os.kill(workers[victim].pid, signal.SIGKILL)
            workers[victim].join()
            kills += 1
            finished = set(logs[victim].read_text().split())
            remaining = [mid for mid in ids if mid not in finished]
            if remaining:
                workers[victim] = _start(spec, remaining, cfg, logs[victim])
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
            w.join()
    return _count(spec, ids, kills)


def _count(spec: dict[str, Any], ids: list[str], kills: int) -> dict[str, Any]:
    store = _open(spec, default_max_turns=10_000)
    try:
        ctx = store.get(_SESSION)
        stored = [m.content for m in ctx.history if m.role.value == "user"] if ctx else []
    finally:
        store.close()
    counts = Counter(stored)
    order = [ids.index(text) for text in stored if text in ids]
    return {
        "delivered": len(ids),
        "processed": len(counts),
        "doubled": sum(1 for n in counts.values() if n > 1),
        "lost": sum(1 for mid in ids if mid not in counts),
        "out_of_order": sum(1 for a, b in itertools.pairwise(order) if b < a),
        "kills": kills,
    }


# ------------------------------------------------------------------ suite


def _targets(env: Env) -> list[tuple[str, dict[str, Any], Callable[[], None]]]:
    targets: list[tuple[str, dict[str, Any], Callable[[], None]]] = []
    sqlite_dir = env.workdir / "claims"
    sqlite_dir.mkdir(exist_ok=True)
    targets.append(("sqlite", {"kind": "sqlite", "path": str(sqlite_dir / "claims.db"),
                               "dir": str(sqlite_dir)}, lambda: None))
    if env.pg_url is not None:
        url = env.pg_url
        schema = create_schema(url, "claims")
        targets.append(("postgresql", {"kind": "postgresql", "url": url, "schema": schema,
                                       "dir": str(sqlite_dir)}, lambda: drop_schema(url, schema)))
    return targets


def _fresh(spec: dict[str, Any], label: str) -> dict[str, Any]:
    """The same database kind, emptied for the next case."""
    if spec["kind"] == "sqlite":
        return {**spec, "path": str(Path(spec["dir"]) / f"{label}.db")}
    store = _open(spec)
    try:
        store.clear()
        with store.engine.begin() as conn:
            from sqlalchemy import text

            conn.execute(text("DELETE FROM chatflow_processed_messages"))
    finally:
        store.close()
    return spec


def run_claims(env: Env, log: Callable[[str], None], cfg: ClaimConfig | None = None) -> str:
    """Run both parts on every available database; return the markdown section."""
    cfg = cfg or ClaimConfig()
    cost: dict[str, list[dict[str, Any]]] = {}
    kills: dict[str, dict[int, dict[str, Any]]] = {}
    for name, spec, cleanup in _targets(env):
        try:
            log(f"claims: cost on {name}")
            cost[name] = _cost(_fresh(spec, "cost"), cfg)
            kills[name] = {}
            for n in cfg.workers:
                log(f"claims: {cfg.messages} messages to {n} processes on {name}, with kills")
                kills[name][n] = _kills(_fresh(spec, f"kills-{n}"), cfg, n, seed=n)
        finally:
            cleanup()
    return render_claims(cost, kills, cfg)


def render_claims(
    cost: dict[str, list[dict[str, Any]]],
    kills: dict[str, dict[int, dict[str, Any]]],
    cfg: ClaimConfig,
) -> str:
    """The markdown of the claim suite."""
    lines = ["### Webhook claims: cost per handled webhook (one turn each)", "",
             "| database | dedup | us / webhook | statements / webhook |", "|---|---|---:|---:|"]
    names = {"none": "none (bare turn)", "record": "record_processed_message",
             "claim": "store.claim"}
    for db, rows in cost.items():
        for row in rows:
            lines.append(f"| {db} | {names[row['mode']]} | {row['us']:.0f} | "
                         f"{row['statements']:.1f} |")
    lines += ["", f"### Webhook claims: {cfg.messages} messages delivered to every process, "
              f"workers SIGKILLed at random and restarted (lease {cfg.lease_seconds:g} s)", "",
              "| database | processes | kills | delivered | processed | doubled | lost | "
              "out of order |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for db, by_n in kills.items():
        for n, c in by_n.items():
            lines.append(f"| {db} | {n} | {c['kills']} | {c['delivered']} | {c['processed']} | "
                         f"{c['doubled']} | {c['lost']} | {c['out_of_order']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m benchmarks.claims: this suite alone
    import sys

    from benchmarks.pg import pg_available, pg_url_from_env

    url = pg_url_from_env()
    environment = Env.create(url if pg_available(url) is None else None)
    try:
        print(run_claims(environment, lambda m: print(m, file=sys.stderr, flush=True)))
    finally:
        environment.cleanup()
