"""Turn aggregated rows into markdown tables and PASS/MISS target lines."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.stores import adapter_class, floor_of
from benchmarks.suites import Config, Row

__all__ = ["Results", "render", "targets"]


@dataclass
class Results:
    """Everything one run measured, by suite."""

    single: list[Row]
    multi: list[Row]
    growth: list[Row]
    rss: list[Row]
    lag: list[Row]
    claims: str = ""
    """The webhook-claim suite's markdown (``benchmarks/claims.py``), empty if not run."""
    inbox: str = ""
    """The inbox suite's markdown (``benchmarks/inbox.py``), empty if not run."""
    summaries: str = ""
    """The summaries suite's markdown (``benchmarks/summaries.py``), empty if not run."""


def _table(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out)


def _floor_of(row: Row, rows: Sequence[Row]) -> Row | None:
    floor = floor_of(row.store)
    return next((r for r in rows if r.store == floor and r.mode == row.mode
                 and r.workers == row.workers and r.sessions == row.sessions
                 and r.turns == row.turns), None)


def ratio(row: Row, rows: Sequence[Row]) -> float | None:
    """Median throughput of ``row`` over its floor's (same mode, size, run)."""
    floor = _floor_of(row, rows)
    if floor is None or not floor.ok or not row.ok or floor.med("throughput") <= 0:
        return None
    return row.med("throughput") / floor.med("throughput")


def _verified(row: Row) -> str:
    if not row.ok:
        return "**FAILED**"
    return "ok (same instance)" if adapter_class(row.store).ephemeral else "ok"


def _num(value: float, digits: int = 0) -> str:
    return f"{value:,.{digits}f}"


def _ratio_cell(row: Row, rows: Sequence[Row]) -> str:
    if adapter_class(row.store).floor:
        return "1.00 (floor)"
    value = ratio(row, rows)
    against = adapter_class(row.store).compared_with
    return "-" if value is None else f"{value:.2f}x" + (f" (`{against}`)" if against else "")


def _perf_cells(row: Row, rows: Sequence[Row]) -> list[str]:
    if not row.ok:
        return ["FAILED", "-", "-", "-"]
    return [_num(row.med("throughput")), _ratio_cell(row, rows),
            _num(row.med("p50_ms"), 3), _num(row.med("p99_ms"), 2)]


def single_table(rows: Sequence[Row]) -> str:
    """Mode 1, every store."""
    lines = [[f"`{r.store}`", adapter_class(r.store).backend, str(r.sessions),
              *_perf_cells(r, rows), _num(r.med("peak_rss_mb")), _num(r.med("rss_delta_mb"), 1),
              _verified(r)] for r in rows]
    header = ["store", "backend", "S", "turns/s", "x floor", "p50 ms", "p99 ms",
              "peak RSS MB", "RSS growth MB", "verified"]
    return _table(header, lines)


def multi_table(rows: Sequence[Row]) -> str:
    """Modes 2-4."""
    lines = [[f"`{r.store}`", r.mode, str(r.workers), *_perf_cells(r, rows),
              _num(r.med("peak_rss_mb")), _verified(r)] for r in rows]
    header = ["store", "mode", "N", "turns/s (all N)", "x floor", "p50 ms", "p99 ms",
              "peak RSS MB (max worker)", "verified"]
    return _table(header, lines)


def growth_pairs(rows: Sequence[Row]) -> list[tuple[str, Row, Row]]:
    """(store, short run, long run) pairs of the growth suite."""
    pairs = []
    for store in dict.fromkeys(r.store for r in rows):
        mine = sorted((r for r in rows if r.store == store), key=lambda r: r.turns)
        if len(mine) >= 2:
            pairs.append((store, mine[0], mine[-1]))
    return pairs


def growth_table(rows: Sequence[Row]) -> str:
    """p50 per turn at two conversation lengths."""
    lines = []
    for store, short, long in growth_pairs(rows):
        value = long.med("p50_ms") / short.med("p50_ms") if short.med("p50_ms") else 0.0
        lines.append([f"`{store}`", str(short.sessions), _num(short.med("p50_ms"), 3),
                      _num(long.med("p50_ms"), 3), f"{value:.2f}x",
                      _num(short.med("throughput")), _num(long.med("throughput")),
                      "ok" if short.ok and long.ok else "**FAILED**"])
    if not lines:
        return "(not run)"
    short_t, long_t = growth_pairs(rows)[0][1].turns, growth_pairs(rows)[0][2].turns
    header = ["store", "S", f"p50 ms T={short_t}", f"p50 ms T={long_t}", "ratio",
              f"turns/s T={short_t}", f"turns/s T={long_t}", "verified"]
    return _table(header, lines)


def rss_table(rows: Sequence[Row]) -> str:
    """RSS growth touching many sessions."""
    lines = [[f"`{r.store}`", _num(r.sessions), _num(r.med("after_mb")),
              _num(r.med("growth_mb"), 1), _num(r.med("seconds"), 1),
              "ok" if r.ok else "**FAILED** " + "; ".join(r.problems[:1])] for r in rows]
    header = ["store", "sessions", "RSS after MB", "RSS growth MB", "seconds", "run"]
    return _table(header, lines) if lines else "(not run)"


def lag_table(rows: Sequence[Row]) -> str:
    """Event-loop lag."""
    lines = [[f"`{r.store}`", "await aadd_message" if r.store.startswith("ours")
              else "add_message on the loop", _num(r.med("p50_ms"), 2), _num(r.med("p99_ms"), 2),
              _num(r.med("max_ms"), 1), _num(r.med("writes_per_s"))]
             for r in rows if r.ok]
    header = ["store", "API", "lag p50 ms", "lag p99 ms", "lag max ms", "writes/s"]
    return _table(header, lines) if lines else "(not run)"


def _find(rows: Sequence[Row], store: str, mode: str = "single", workers: int = 1) -> Row | None:
    return next((r for r in rows if r.store == store and r.mode == mode
                 and r.workers == workers and r.sessions == max(
                     (x.sessions for x in rows if x.store == store and x.mode == mode), default=0)),
                None)


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def _floor_target(res: Results, store: str, want: float) -> tuple[str, str]:
    row = _find(res.single, store)
    value = ratio(row, res.single) if row else None
    if row is not None and not row.ok:
        return "FAILED", "verification failed"
    return _verdict(None if value is None else value >= want), (
        "-" if value is None else f"{value:.2f}x")


def _memory_target(res: Results) -> tuple[str, str]:
    ours, theirs = _find(res.single, "ours-memory"), _find(res.single, "upstream-memory")
    if ours is None or theirs is None or not theirs.med("throughput"):
        return "n/a", "-"
    value = ours.med("throughput") / theirs.med("throughput")
    return _verdict(ours.ok and value >= 3.0), f"{value:.2f}x"


def _multi_target(res: Results, cfg: Config) -> list[tuple[str, str, str]]:
    out = []
    for store in ("ours-sqlite", "ours-pg"):
        for mode in ("contention", "redelivery"):
            for n in cfg.workers:
                row = _find(res.multi, store, mode, n)
                ok = None if row is None else row.ok
                detail = "-" if row is None else ("verified" if row.ok else "; ".join(
                    row.problems[:1]))
                out.append((f"{store} {mode} N={n} passes verification", _verdict(ok), detail))
    return out


def targets(res: Results, cfg: Config) -> list[tuple[str, str, str]]:
    """(target, PASS/MISS/n/a, measured) for every target of issue 5."""
    out = [("ours-sqlite >= 0.6x raw SQLite floor, one process",
            *_floor_target(res, "ours-sqlite", 0.6)),
           ("ours-pg >= 0.6x raw psycopg floor, one process", *_floor_target(res, "ours-pg", 0.6)),
           ("ours-pg-claim >= 0.5x raw-pg-claim (same guarantees), one process",
            *_floor_target(res, "ours-pg-claim", 0.5)),
           ("ours-memory >= 3x upstream in-memory SessionStore", *_memory_target(res))]
    out += _multi_target(res, cfg)
    for store, short, long in growth_pairs(res.growth):
        if adapter_class(store).floor:
            continue
        value = long.med("p50_ms") / short.med("p50_ms") if short.med("p50_ms") else 0.0
        out.append((f"{store} p50 at T={long.turns} within 1.2x of T={short.turns}",
                    _verdict(short.ok and long.ok and value <= 1.2), f"{value:.2f}x"))
    for row in res.rss:
        grown = row.med("growth_mb")
        out.append((f"{row.store}: {row.sessions:,} sessions RSS growth < 100 MB",
                    _verdict(row.ok and grown < 100), f"{grown:.1f} MB"))
    return out


def _problems(rows: Sequence[Row]) -> list[str]:
    return [f"- `{r.store}` {r.mode} N={r.workers}: {p}" for r in rows if not r.ok
            for p in r.problems[:3]]


def render(res: Results, cfg: Config) -> str:
    """The whole report as markdown."""
    parts = [
        f"### One process: S={cfg.sessions} sessions x T={cfg.turns} turns "
        f"(medians of {cfg.rounds} rounds)", single_table(res.single),
        f"### N processes: S={cfg.multi_sessions} sessions x T={cfg.turns} turns "
        f"(medians of {cfg.rounds} rounds)", multi_table(res.multi) if res.multi else "(not run)",
        "### Conversation growth (one process)", growth_table(res.growth),
        "### Many sessions in one process", rss_table(res.rss),
        f"### Event-loop lag: {cfg.lag_writers} concurrent writers x {cfg.lag_messages} "
        f"messages of {cfg.lag_size} bytes", lag_table(res.lag),
        "### Targets", _table(["target", "result", "measured"],
                              [list(t) for t in targets(res, cfg)]),
    ]
    if res.claims:
        parts.append(res.claims.rstrip())
    if res.inbox:
        parts.append(res.inbox.rstrip())
    if res.summaries:
        parts.append(res.summaries.rstrip())
    problems = _problems(res.single + res.multi + res.growth + res.rss + res.lag)
    if problems:
        parts += ["### Verification failures", "\n".join(problems)]
    return "\n\n".join(parts) + "\n"
