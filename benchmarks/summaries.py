"""The summaries suite: what a store's ``summarizer`` costs a turn, and how soon it writes.

On SQLite (a file) and PostgreSQL (a fresh schema per case), the same store
options (``default_max_turns=window``) with and without a trivial async
summarizer, which returns how many messages it has folded in so far: what the
store's summaries machinery costs by itself, with no model behind it.

* **throughput**: one process, one event loop, real ``Runner`` turns
  (``ScriptedEngine``, two messages a turn) on ``sessions`` sessions x
  ``turns`` turns, round-robin. From turn ``window + 1`` of a session on,
  every turn prunes one turn, so with the summarizer every such turn hands
  the store a summary to make (in the background, on its summaries thread,
  competing with the turns for the CPU and the database). Turns/s and the
  p50/p99 of ``run_async``, plain and summarized interleaved, medians over
  rounds. Verified afterwards: a fresh store shows every session's summary
  first and it counts exactly the messages pruned (none lost, none twice).
* **one turn at a time**: one session, plain and summarized; each turn
  prunes, and the next starts once its summary is stored. The turn's p50,
  the statements sent per turn (its summary's included: a count that machine
  noise does not move), and how long after the turn's end its summary is
  stored (``store.wait_for_summaries()`` returns).

Run alone: ``python -m benchmarks --only summaries`` or ``python -m benchmarks.summaries``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from chatflow_agent import Message
from sqlalchemy import event

from benchmarks.pg import create_schema, drop_schema, schema_connect_args
from benchmarks.runner import Env, median, percentile, run_alone

__all__ = ["QUICK", "SummaryConfig", "render_summaries", "run_summaries"]

Progress = Callable[[str], None]
_MODES = ("plain", "summarized")
_WAIT_SECONDS = 120.0


@dataclass(frozen=True)
class SummaryConfig:
    """Sizes of the summaries suite."""

    sessions: int = 20
    turns: int = 60
    window: int = 10
    latency_turns: int = 100
    rounds: int = 3


QUICK = SummaryConfig(sessions=5, turns=30, latency_turns=30, rounds=1)
"""The sizes of ``--quick``."""


async def count_folded(previous: str | None, dropped: list[Message]) -> str:
    """A trivial summarizer: how many messages the summary covers (checkable, no model)."""
    return str(int(previous or 0) + len(dropped))


def _open(spec: dict[str, Any], **kwargs: Any) -> Any:
    if spec["kind"] == "sqlite":
        from chatflow_sqlalchemy import SQLiteSessionStore

        return SQLiteSessionStore(spec["path"], **kwargs)
    from chatflow_sqlalchemy import PostgresSessionStore

    return PostgresSessionStore(
        spec["url"], connect_args=schema_connect_args(spec["schema"]), **kwargs
    )


@contextmanager
def _fresh(env: Env, backend: str, label: str) -> Iterator[dict[str, Any]]:
    """An empty database of ``backend`` for one case (a new file, or a new schema)."""
    if backend == "sqlite":
        yield {"kind": "sqlite", "path": str(env.workdir / f"summaries-{label}.db")}
        return
    assert env.pg_url is not None
    schema = create_schema(env.pg_url, "summaries")
    try:
        yield {"kind": "postgresql", "url": env.pg_url, "schema": schema}
    finally:
        drop_schema(env.pg_url, schema)


def _store(spec: dict[str, Any], cfg: SummaryConfig, mode: str) -> Any:
    summarizer = count_folded if mode == "summarized" else None
    return _open(spec, default_max_turns=cfg.window, summarizer=summarizer)


def _agents() -> dict[str, Any]:
    from chatflow_agent import Agent

    return {"Bot": Agent(name="Bot", instructions="")}


def _runner(store: Any) -> Any:
    from chatflow_agent import Runner

    from chatflow_sqlalchemy.testing import ScriptedEngine

    return Runner(starting_agent=_agents()["Bot"], session_store=store, engine=ScriptedEngine())


# ------------------------------------------------------------------ throughput


async def _turns(store: Any, cfg: SummaryConfig) -> tuple[float, list[float]]:
    """(seconds, ms per turn) of ``sessions`` x ``turns`` Runner turns, round-robin."""
    runner = _runner(store)
    latencies = []
    began = time.perf_counter()
    for turn in range(cfg.turns):
        for session in range(cfg.sessions):
            start = time.perf_counter()
            await runner.run_async(f"s{session}", f"turn {turn}")
            latencies.append((time.perf_counter() - start) * 1e3)
    return time.perf_counter() - began, latencies


def _verify(spec: dict[str, Any], cfg: SummaryConfig, mode: str) -> None:
    """A fresh store shows each session's window, and the summary of exactly what was pruned.

    Raises:
        RuntimeError: It does not: the case's figures would not count.

    """
    pruned = 2 * (cfg.turns - cfg.window)
    expected = str(pruned) if mode == "summarized" else None
    with _open(spec, default_max_turns=cfg.window) as store:
        store.set_agent_resolver(_agents().get)  # the Runner's agent: no fallback warning
        for session in range(cfg.sessions):
            ctx = store.get(f"s{session}")
            shown = len(ctx.history) - (ctx.summary is not None)
            if ctx.summary != expected or shown != 2 * cfg.window:
                raise RuntimeError(f"session s{session}: summary {ctx.summary!r} (expected "
                                   f"{expected!r}), {shown} messages in the window")


def _throughput_case(spec: dict[str, Any], cfg: SummaryConfig, mode: str) -> dict[str, float]:
    store = _store(spec, cfg, mode)
    try:
        seconds, latencies = asyncio.run(_turns(store, cfg))
        if not store.wait_for_summaries(_WAIT_SECONDS):
            raise RuntimeError(f"summaries still being made {_WAIT_SECONDS:g} s after the run")
    finally:
        store.close()
    _verify(spec, cfg, mode)
    return {"per_s": len(latencies) / seconds, "p50": percentile(latencies, 0.5),
            "p99": percentile(latencies, 0.99)}


# ------------------------------------------------------------------ time to summary


@contextmanager
def _statements(store: Any) -> Iterator[list[int]]:
    """Count the statements ``store`` sends meanwhile (its summaries thread's too)."""
    sent = [0]

    def count(*_: Any) -> None:
        sent[0] += 1

    for engine in store.engines:
        event.listen(engine, "before_cursor_execute", count)
    try:
        yield sent
    finally:
        for engine in store.engines:
            event.remove(engine, "before_cursor_execute", count)


async def _one_at_a_time(store: Any, cfg: SummaryConfig, mode: str
                         ) -> tuple[list[float], list[float], int]:
    """(turn ms, turn end -> summary stored ms, statements) over turns that each prune."""
    runner = _runner(store)
    for turn in range(cfg.window):
        await runner.run_async("t", f"warm {turn}")
    turns, waits = [], []
    with _statements(store) as sent:
        for turn in range(cfg.latency_turns):
            began = time.perf_counter()
            await runner.run_async("t", f"turn {turn}")
            ended = time.perf_counter()
            if not await asyncio.to_thread(store.wait_for_summaries, _WAIT_SECONDS):
                raise RuntimeError(f"no summary {_WAIT_SECONDS:g} s after turn {turn}")
            turns.append((ended - began) * 1e3)
            waits.append((time.perf_counter() - ended) * 1e3)
    expected = str(2 * cfg.latency_turns) if mode == "summarized" else None
    if store.get("t").summary != expected:
        raise RuntimeError(f"summary {store.get('t').summary!r}, expected {expected!r}")
    return turns, waits, sent[0]


def _latency_case(spec: dict[str, Any], cfg: SummaryConfig, mode: str) -> dict[str, float]:
    store = _store(spec, cfg, mode)
    try:
        turns, waits, sent = asyncio.run(_one_at_a_time(store, cfg, mode))
    finally:
        store.close()
    return {"turn_p50": percentile(turns, 0.5), "statements": sent / cfg.latency_turns,
            "p50": percentile(waits, 0.5), "p99": percentile(waits, 0.99)}


# ------------------------------------------------------------------ suite


def _backends(env: Env) -> list[str]:
    return ["sqlite"] + (["postgresql"] if env.pg_url is not None else [])


def run_summaries(env: Env, log: Progress, cfg: SummaryConfig | None = None) -> str:
    """Run both parts on every available database; return the markdown section."""
    cfg = cfg or SummaryConfig()
    series: dict[tuple[str, str], list[dict[str, float]]] = {}
    latency: dict[tuple[str, str], list[dict[str, float]]] = {}
    for rnd in range(cfg.rounds):
        for backend in _backends(env):
            for mode in _MODES:
                with _fresh(env, backend, f"r{rnd}-{mode}") as spec:
                    result = _throughput_case(spec, cfg, mode)
                series.setdefault((backend, mode), []).append(result)
                log(f"  round {rnd + 1}: {backend:10} {mode:10} {result['per_s']:7.0f} turns/s"
                    f"  p50 {result['p50']:6.2f} ms  p99 {result['p99']:6.2f} ms")
            for mode in _MODES:
                with _fresh(env, backend, f"r{rnd}-one-{mode}") as spec:
                    one = _latency_case(spec, cfg, mode)
                latency.setdefault((backend, mode), []).append(one)
                stored = (f", summary stored after p50 {one['p50']:.2f} ms p99 {one['p99']:.2f}"
                          " ms" if mode == "summarized" else "")
                log(f"  round {rnd + 1}: {backend:10} {mode:10} one at a time: turn p50 "
                    f"{one['turn_p50']:.2f} ms, {one['statements']:.1f} statements{stored}")
    return render_summaries(series, latency, cfg)


def _med(cases: list[dict[str, float]], key: str) -> float:
    return median([case[key] for case in cases])


def render_summaries(series: dict[tuple[str, str], list[dict[str, float]]],
                     latency: dict[tuple[str, str], list[dict[str, float]]],
                     cfg: SummaryConfig) -> str:
    """The markdown of the summaries suite (medians over rounds)."""
    lines = [f"### Summaries: a summarized turn beside a plain one, S={cfg.sessions} x "
             f"T={cfg.turns} Runner turns, window {cfg.window} (every turn past it prunes), "
             f"a trivial async summarizer (medians of {cfg.rounds} rounds)", "",
             "| database | store | turns/s | x plain | p50 ms | p99 ms |",
             "|---|---|---:|---:|---:|---:|"]
    for (backend, mode), cases in series.items():
        plain = _med(series[(backend, "plain")], "per_s")
        ratio = "1.00" if mode == "plain" else f"{_med(cases, 'per_s') / plain:.2f}x"
        lines.append(f"| {backend} | {mode} | {_med(cases, 'per_s'):,.0f} | {ratio} | "
                     f"{_med(cases, 'p50'):.2f} | {_med(cases, 'p99'):.2f} |")
    lines += ["", f"One session, {cfg.latency_turns} turns one at a time, each pruning (the "
              "next starts once its summary is stored):", "",
              "| database | store | turn p50 ms | statements / turn (summary included) | "
              "summary stored after: p50 ms | p99 ms |", "|---|---|---:|---:|---:|---:|"]
    for (backend, mode), cases in latency.items():
        stored = (f"{_med(cases, 'p50'):.2f} | {_med(cases, 'p99'):.2f}"
                  if mode == "summarized" else "- | -")
        lines.append(f"| {backend} | {mode} | {_med(cases, 'turn_p50'):.2f} | "
                     f"{_med(cases, 'statements'):.1f} | {stored} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """``python -m benchmarks.summaries [--quick]``: this suite alone."""
    run_alone(run_summaries, QUICK)


if __name__ == "__main__":
    main()
