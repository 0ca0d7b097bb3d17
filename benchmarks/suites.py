"""The benchmark suites: what runs, with which sizes, in which order.

Every suite runs ``rounds`` times; within a round the stores are interleaved
(floor first), so that machine noise hits every store alike. Figures are
medians over the rounds; a store that fails verification in any round is
FAILED and its figures do not count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.runner import CaseResult, Env, median, run_case, run_workers, scratch_target
from benchmarks.stores import ADAPTERS, adapter_class, floor_of

__all__ = ["Config", "Row", "run_growth", "run_loop_lag", "run_multi", "run_rss", "run_single"]

Progress = Callable[[str], None]

SLOW_STORES = {"upstream-sqlite": 10, "oai-sqla-sqlite": 10, "oai-sqla-pg": 10}
"""Competitors that run fewer sessions (same T: same history length and pruning per turn)."""

MULTI_STORES = ("raw-sqlite", "ours-sqlite", "raw-pg", "ours-pg")
COMPETITOR_MULTI = ("upstream-sqlite",)
"""Competitors also run in contention/redelivery with 2 processes, to see if they hold up
(openai-agents' ``SQLiteSession`` passes both; add it here to measure it)."""


@dataclass
class Config:
    """Sizes and selections of one benchmark run."""

    sessions: int = 50
    turns: int = 60
    rounds: int = 3
    workers: tuple[int, ...] = (2, 4)
    multi_modes: tuple[str, ...] = ("disjoint", "contention", "redelivery")
    competitors_multi: bool = True
    multi_sessions: int = 10
    growth_sessions: int = 3
    growth_turns: tuple[int, int] = (60, 400)
    rss_sessions: int = 10_000
    lag_writers: int = 8
    lag_messages: int = 60
    lag_size: int = 2048
    stores: tuple[str, ...] = tuple(ADAPTERS)
    postgres: bool = True
    slow_sessions: dict[str, int] = field(default_factory=lambda: dict(SLOW_STORES))


@dataclass
class Row:
    """One store/mode/size aggregated over rounds."""

    store: str
    mode: str
    workers: int
    sessions: int
    turns: int
    cases: list[CaseResult] = field(default_factory=list)
    extra: dict[str, list[float]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Verified in every round."""
        return all(case.ok for case in self.cases)

    @property
    def problems(self) -> list[str]:
        """The first failing round's problems."""
        return next((case.problems for case in self.cases if not case.ok), [])

    def med(self, attr: str) -> float:
        """Median of a CaseResult attribute (or of an ``extra`` series) over rounds."""
        if attr in self.extra:
            return median(self.extra[attr])
        return median([float(getattr(case, attr)) for case in self.cases])


def _wanted(cfg: Config, store: str) -> bool:
    backend = adapter_class(store).backend
    return store in cfg.stores and (cfg.postgres or backend != "postgres")


def _with_floors(cfg: Config, stores: Sequence[str]) -> list[str]:
    """``stores`` plus their floors (and the floors' own), floors first within a backend."""
    wanted = set(stores)
    while not {floor_of(s) for s in wanted} <= wanted:
        wanted |= {floor_of(s) for s in wanted}
    chosen = [s for s in ADAPTERS if s in wanted]
    return [s for s in chosen if cfg.postgres or adapter_class(s).backend != "postgres"]


class _Rows:
    """Rows keyed by (store, mode, workers, sessions, turns), in first-seen order."""

    def __init__(self) -> None:
        self.rows: dict[tuple[Any, ...], Row] = {}

    def add(self, case: CaseResult, sessions: int) -> Row:
        key = (case.store, case.mode, case.workers, sessions, case.turns)
        row = self.rows.setdefault(key, Row(case.store, case.mode, case.workers, sessions,
                                            case.turns))
        row.cases.append(case)
        return row


def _single_jobs(cfg: Config) -> list[tuple[str, int]]:
    """(store, sessions) pairs; a floor runs at every size one of its competitors runs."""
    jobs: list[tuple[str, int]] = []
    for store in _with_floors(cfg, [s for s in cfg.stores if _wanted(cfg, s)]):
        size = cfg.slow_sessions.get(store, cfg.sessions)
        for job in ((floor_of(store), size), (store, size)):
            if job not in jobs:
                jobs.append(job)
    return jobs


def run_single(cfg: Config, env: Env, log: Progress) -> list[Row]:
    """Mode 1: each store alone in one process, S x T turns."""
    rows = _Rows()
    jobs = _single_jobs(cfg)
    for rnd in range(cfg.rounds):
        for store, sessions in jobs:
            case = run_case(store, "single", 1, sessions, cfg.turns, env,
                            f"{store}-single-r{rnd}")
            rows.add(case, sessions)
            log(_line(case, rnd, sessions))
    return list(rows.rows.values())


def _multi_jobs(cfg: Config) -> list[tuple[str, str, int]]:
    """(store, mode, workers) triples: ours and floors in every mode, competitors in two."""
    ours = _with_floors(cfg, [s for s in MULTI_STORES if _wanted(cfg, s)])
    jobs = [(store, mode, n) for n in cfg.workers for mode in cfg.multi_modes for store in ours]
    competitors = [s for s in COMPETITOR_MULTI if cfg.competitors_multi and _wanted(cfg, s)]
    jobs += [(store, mode, min(cfg.workers)) for mode in ("contention", "redelivery")
             for store in competitors]
    return jobs


def run_multi(cfg: Config, env: Env, log: Progress) -> list[Row]:
    """Modes 2-4 with N processes: disjoint sessions, same sessions, same webhook ids."""
    rows = _Rows()
    jobs = _multi_jobs(cfg)
    for rnd in range(cfg.rounds):
        for store, mode, workers in jobs:
            case = run_case(store, mode, workers, cfg.multi_sessions, cfg.turns, env,
                            f"{store}-{mode}{workers}-r{rnd}")
            rows.add(case, cfg.multi_sessions)
            log(_line(case, rnd, cfg.multi_sessions))
    return list(rows.rows.values())


def run_growth(cfg: Config, env: Env, log: Progress) -> list[Row]:
    """Per-turn cost as conversations grow: the same store at two conversation lengths.

    The raw floors run too: what the database itself does as rows churn (dead
    tuples of the session row updated every turn, index growth) is then told
    apart from what the store adds.
    """
    rows = _Rows()
    stores = _with_floors(cfg, [s for s in ("ours-sqlite", "ours-pg") if _wanted(cfg, s)])
    for rnd in range(cfg.rounds):
        for store in stores:
            for turns in cfg.growth_turns:
                case = run_case(store, "single", 1, cfg.growth_sessions, turns, env,
                                f"{store}-growth{turns}-r{rnd}")
                rows.add(case, cfg.growth_sessions)
                log(_line(case, rnd, cfg.growth_sessions))
    return list(rows.rows.values())


def _one_off(action: str, store: str, env: Env, label: str, **spec: Any) -> dict[str, Any]:
    target = scratch_target(store, env, label)
    from benchmarks.runner import drop_target

    try:
        adapter_class(store).prepare(target)
        full = {"action": action, "adapter": store, "target": target.to_json(), **spec}
        return run_workers([full])[0]
    finally:
        drop_target(target)


def run_rss(cfg: Config, env: Env, log: Progress) -> list[Row]:
    """One process touches ``rss_sessions`` sessions (one turn each): RSS growth."""
    row = Row("ours-sqlite", "rss", 1, cfg.rss_sessions, 1)
    if not _wanted(cfg, "ours-sqlite"):
        return []
    for rnd in range(cfg.rounds):
        result = _one_off("rss", "ours-sqlite", env, f"rss-r{rnd}",
                          sessions=cfg.rss_sessions, warmup=min(200, cfg.rss_sessions // 10))
        if "error" in result:
            row.cases.append(CaseResult("ours-sqlite", "rss", 1, 1, problems=[result["error"]]))
            continue
        growth = (result["after_kb"] - result["baseline_kb"]) / 1024
        for key, value in (("growth_mb", growth), ("after_mb", result["after_kb"] / 1024),
                           ("seconds", result["seconds"])):
            row.extra.setdefault(key, []).append(value)
        row.cases.append(CaseResult("ours-sqlite", "rss", 1, 1))
        log(f"  round {rnd + 1}: rss {cfg.rss_sessions} sessions: +{growth:.1f} MB "
            f"in {result['seconds']:.1f}s")
    return [row]


def run_loop_lag(cfg: Config, env: Env, log: Progress) -> list[Row]:
    """Event-loop lag with concurrent async writers of 2 KB messages."""
    stores = [s for s in ("ours-sqlite", "upstream-sqlite") if _wanted(cfg, s)]
    rows = {store: Row(store, "looplag", cfg.lag_writers, cfg.lag_writers, cfg.lag_messages)
            for store in stores}
    for rnd in range(cfg.rounds):
        for store in stores:
            result = _one_off("looplag", store, env, f"{store}-lag-r{rnd}",
                              writers=cfg.lag_writers, messages=cfg.lag_messages,
                              size=cfg.lag_size)
            row = rows[store]
            if "error" in result:
                row.cases.append(CaseResult(store, "looplag", 1, 1, problems=[result["error"]]))
                continue
            for key in ("p50_ms", "p99_ms", "max_ms", "writes_per_s"):
                row.extra.setdefault(key, []).append(float(result[key]))
            row.cases.append(CaseResult(store, "looplag", 1, 1))
            log(f"  round {rnd + 1}: {store:16} loop lag p99 {result['p99_ms']:.2f} ms, "
                f"{result['writes_per_s']:.0f} writes/s")
    return list(rows.values())


def _line(case: CaseResult, rnd: int, sessions: int) -> str:
    status = "ok" if case.ok else "FAILED: " + "; ".join(case.problems[:2])
    return (f"  round {rnd + 1}: {case.store:16} {case.mode:10} N={case.workers} "
            f"S={sessions} T={case.turns}: {case.throughput:8.0f} turns/s  "
            f"p50 {case.p50_ms:7.3f} ms  p99 {case.p99_ms:7.3f} ms  {status}")
