"""cProfile of this project's stores on the single-process workload (``--profile``)."""

from __future__ import annotations

import pstats
from pathlib import Path

from benchmarks.profiling import top_entries
from benchmarks.runner import Env, run_case
from benchmarks.suites import Config, Progress, _wanted

__all__ = ["run_profiles"]

PROFILED = ("ours-sqlite", "ours-pg")


def _report(store: str, path: Path, turns: int) -> str:
    stats = pstats.Stats(str(path))
    by_self = top_entries(stats, "tottime", 25)
    ours = top_entries(pstats.Stats(str(path)), "cumulative", 400)
    ours_lines = [line for line in ours.splitlines()[1:]
                  if any(name in line for name in ("store.py", "context.py", "sqlite.py",
                                                   "postgresql.py", "chatflow.py", "dialect.py"))]
    header = ours.splitlines()[0] if ours else ""
    return "\n".join([
        f"#### `{store}`: {turns} turns under cProfile (all threads merged)",
        "Top 25 by own time:", "```", by_self, "```",
        "This project's functions by cumulative time:", "```", header, *ours_lines[:30], "```",
    ])


def run_profiles(cfg: Config, env: Env, log: Progress, out_dir: Path) -> str:
    """Profile each store once; return a markdown section (also written to ``out_dir``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sections = []
    for store in (s for s in PROFILED if _wanted(cfg, s)):
        path = out_dir / f"{store}.prof"
        case = run_case(store, "single", 1, cfg.sessions, cfg.turns, env, f"{store}-profile",
                        profile=str(path))
        if not case.ok:
            sections.append(f"#### `{store}`: profile run FAILED: {case.problems[:1]}")
            continue
        log(f"  profiled {store}: {case.ran} turns, {case.throughput:.0f} turns/s under cProfile")
        section = _report(store, path, case.ran)
        (out_dir / f"{store}.txt").write_text(section + "\n")
        sections.append(section)
    return "\n\n".join(sections)
