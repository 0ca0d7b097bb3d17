"""``python -m benchmarks``: how fast is each store, against what you'd otherwise use and the floor.

Examples::

    python -m benchmarks                     # full run, default sizes (~10 min on 2 cores)
    python -m benchmarks --quick             # smoke run (< 60 s)
    python -m benchmarks --only single,ours-sqlite --rounds 5
    python -m benchmarks --no-postgres --markdown /tmp/results.md
    python -m benchmarks --only profile      # cProfile of our SQLite and PostgreSQL stores
    python -m benchmarks --only claims       # webhook claims: cost, and kills with redelivery
    python -m benchmarks --only inbox        # the inbox: throughput, put -> send latency
    python -m benchmarks --only summaries    # a summarized turn beside a plain one
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from benchmarks.environment import describe
from benchmarks.pg import pg_available, pg_url_from_env, server_version
from benchmarks.report import Results, render
from benchmarks.runner import Env
from benchmarks.stores import ADAPTERS
from benchmarks.suites import (
    Config,
    run_growth,
    run_loop_lag,
    run_multi,
    run_rss,
    run_single,
)

SUITES = ("single", "multi", "growth", "rss", "looplag", "claims", "inbox", "summaries",
          "profile")
DEFAULT_SUITES = ("single", "multi", "growth", "rss", "looplag", "claims", "summaries")
OUT_DIR = Path(__file__).resolve().parent / "out"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n")[0] if __doc__ else None
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, one round (< 60 s)")
    parser.add_argument("--rounds", type=int, help="repeat every case this many times (3)")
    parser.add_argument("--only", default="", help=(
        f"comma list of suites ({', '.join(SUITES)}) and/or stores ({', '.join(ADAPTERS)}); "
        "floors are added for the stores named"))
    parser.add_argument("--no-postgres", action="store_true", help="skip PostgreSQL stores")
    parser.add_argument("--pg-url", help="PostgreSQL URL (default: $CHATFLOW_BENCH_POSTGRES_URL, "
                        "$CHATFLOW_TEST_POSTGRES_URL, or postgres@127.0.0.1:5432/test)")
    parser.add_argument("--sessions", type=int, help="S for the one-process suite (50)")
    parser.add_argument("--turns", type=int, help="T turns per session (60)")
    parser.add_argument("--profile", action="store_true", help="also run the cProfile suite")
    parser.add_argument("--markdown", type=Path, help="also write the report to this file")
    return parser


def _quick(cfg: Config) -> Config:
    return dataclasses.replace(
        cfg, sessions=8, turns=44, rounds=1, workers=(2,), multi_sessions=4, growth_sessions=2,
        growth_turns=(44, 120), rss_sessions=1000, lag_messages=16, slow_sessions={},
        multi_modes=("contention", "redelivery"), competitors_multi=False,
    )


def _selection(only: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    tokens = [t.strip() for t in only.split(",") if t.strip()]
    unknown = [t for t in tokens if t not in SUITES and t not in ADAPTERS]
    if unknown:
        raise SystemExit(f"error: unknown --only names {unknown}; suites: {', '.join(SUITES)}; "
                         f"stores: {', '.join(ADAPTERS)}")
    suites = tuple(t for t in tokens if t in SUITES) or DEFAULT_SUITES
    stores = tuple(t for t in tokens if t in ADAPTERS) or tuple(ADAPTERS)
    return suites, stores


def _config(args: argparse.Namespace, stores: tuple[str, ...], pg: bool) -> Config:
    cfg = Config(stores=stores, postgres=pg)
    if args.quick:
        cfg = _quick(cfg)
    for name in ("rounds", "sessions", "turns"):
        if getattr(args, name) is not None:
            cfg = dataclasses.replace(cfg, **{name: getattr(args, name)})
    return cfg


def _postgres(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(url, version) or (None, None) when skipped or unreachable."""
    if args.no_postgres:
        return None, None
    url = pg_url_from_env(args.pg_url)
    problem = pg_available(url)
    if problem is not None:
        print(f"PostgreSQL at {url} is unreachable ({problem}): PostgreSQL stores skipped "
              "(pass --no-postgres to silence this)", file=sys.stderr)
        return None, None
    return url, server_version(url)


_STARTED = time.monotonic()


def _log(message: str) -> None:
    elapsed = int(time.monotonic() - _STARTED)
    print(f"[{elapsed // 60:02d}:{elapsed % 60:02d}] {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the selected suites and print the report."""
    args = _parser().parse_args(argv)
    suites, stores = _selection(args.only)
    if args.profile and "profile" not in suites:
        suites = (*suites, "profile")
    pg_url, pg_version = _postgres(args)
    cfg = _config(args, stores, pg_url is not None)
    env = Env.create(pg_url)
    began = time.monotonic()
    _log(describe(pg_version))
    try:
        results, profile = _run(suites, cfg, env)
    finally:
        env.cleanup()
    report = "## Results\n\n" + describe(pg_version) + "\n\n" + render(results, cfg)
    if profile:
        report += "\n## Profiles\n\n" + profile + "\n"
    report += f"\n(total wall time {time.monotonic() - began:.0f} s)\n"
    print("\n" + report, flush=True)
    if args.markdown:
        args.markdown.write_text(report)
    return 0


def _run(suites: tuple[str, ...], cfg: Config, env: Env) -> tuple[Results, str]:
    results = Results([], [], [], [], [])
    steps = (("single", "single", run_single), ("multi", "multi", run_multi),
             ("growth", "growth", run_growth), ("rss", "rss", run_rss),
             ("looplag", "lag", run_loop_lag))
    for suite, attr, fn in steps:
        if suite in suites:
            _log(f"== {suite}")
            setattr(results, attr, fn(cfg, env, _log))
    profile = ""
    if "claims" in suites:
        from benchmarks.claims import ClaimConfig, run_claims

        _log("== claims")
        quick = ClaimConfig(cost_messages=60, messages=20, workers=(2,))
        results.claims = run_claims(env, _log, quick if cfg.rounds == 1 else None)
    if "inbox" in suites:
        from benchmarks.inbox import QUICK, run_inbox

        _log("== inbox")
        results.inbox = run_inbox(env, _log, QUICK if cfg.rounds == 1 else None)
    if "summaries" in suites:
        from benchmarks.summaries import QUICK as QUICK_SUMMARIES
        from benchmarks.summaries import run_summaries

        _log("== summaries")
        results.summaries = run_summaries(
            env, _log, QUICK_SUMMARIES if cfg.rounds == 1 else None
        )
    if "profile" in suites:
        from benchmarks.profile_suite import run_profiles

        _log("== profile")
        profile = run_profiles(cfg, env, _log, OUT_DIR)
    return results, profile


if __name__ == "__main__":
    sys.exit(main())
