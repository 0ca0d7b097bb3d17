"""The long fault campaign: ``python -m tests.campaign [--examples N] [--kills N]``.

Runs, on SQLite and (when ``CHATFLOW_TEST_POSTGRES_URL`` is set) PostgreSQL:

* the hypothesis state machine of ``tests/test_fault_model.py`` with ``--examples``
  random examples (turns that commit, fail midway, are cancelled, end by a
  BaseException or fail to write, a second writer acting in between);
* the kill -9 campaigns of ``tests/test_processes.py``, ``--kills`` kills each,
  inside ``session.lock`` (the real Runner) and outside it (direct ``add_message``).

It prints what it did and found (examples, turns, faults injected, survived,
lost, duplicated) and exits non-zero if anything was lost, duplicated or
malformed. The quick slice of the same tests runs in ``make test``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _databases(tmp: Path) -> Iterator[tuple[str, Callable[..., Any], Any]]:
    """(name, store opener, worker spec) per database; PostgreSQL in a fresh schema."""
    from chatflow_sqlalchemy import SQLiteSessionStore

    from . import test_fault_model as fm
    from . import test_processes as tp

    path = tmp / "campaign.db"
    yield (
        "sqlite",
        lambda: SQLiteSessionStore(path, default_max_turns=fm.MAX_TURNS),
        tp.sqlite_spec(tmp / "kills.db"),
    )
    url = os.environ.get("CHATFLOW_TEST_POSTGRES_URL")
    if not url:
        print("postgresql: skipped (set CHATFLOW_TEST_POSTGRES_URL to include it)")
        return
    from chatflow_sqlalchemy.backends.postgresql import psycopg_url

    from . import pg_util

    url = psycopg_url(url).render_as_string(hide_password=False)
    with pg_util.fresh_schema(url) as schema, pg_util.fresh_schema(url) as kill_schema:
        yield (
            "postgresql",
            lambda: pg_util.schema_store(url, schema, default_max_turns=fm.MAX_TURNS),
            tp.postgres_spec(url, kill_schema),
        )


@contextmanager
def _timed(label: str) -> Iterator[None]:
    start = time.monotonic()
    yield
    print(f"  ({label}: {time.monotonic() - start:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.campaign", description=__doc__)
    parser.add_argument("--examples", type=int, default=2000, help="hypothesis examples per DB")
    parser.add_argument("--steps", type=int, default=25, help="operations per example")
    parser.add_argument("--kills", type=int, default=100, help="kill -9 per DB and mode")
    parser.add_argument("--seed", type=int, default=int(time.time()))
    args = parser.parse_args(argv)
    os.environ["CHATFLOW_CAMPAIGN"] = "long"
    os.environ["CHATFLOW_CAMPAIGN_EXAMPLES"] = str(args.examples)
    os.environ["CHATFLOW_CAMPAIGN_STEPS"] = str(args.steps)

    from . import test_fault_model as fm
    from . import test_processes as tp

    failed = False
    print(f"campaign seed {args.seed}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, opener, spec in _databases(Path(tmp)):
            fm.COUNTS.clear()
            print(f"{name}: hypothesis state machine, {args.examples} examples")
            with _timed("state machine"):
                try:
                    fm.run_machine(opener)
                except Exception:
                    failed = True
                    traceback.print_exc()
            c = fm.COUNTS
            print(
                f"  examples {c['examples']}, turns {c['turns']}, faults injected "
                f"{c['faults']}, survived {c['survived']}, reload checks {c['checks']}, "
                f"lost {c['lost']}, duplicated {c['duplicated']}"
            )
            for mode in ("locked", "direct"):
                print(f"{name}: kill -9 {'inside' if mode == 'locked' else 'outside'} the lock")
                with _timed("kills"):
                    counts = tp.kill_campaign(spec, mode, args.kills, seed=args.seed)
                print(
                    f"  kills {counts.kills}, turns acknowledged {counts.acknowledged}, "
                    f"survived {counts.survived}, lost {counts.lost}, duplicated "
                    f"{counts.duplicated}, malformed reloads {counts.malformed}"
                )
                for problem in counts.problems[:5]:
                    print(f"  problem: {problem}")
                if counts.lost or counts.duplicated or counts.malformed or counts.problems:
                    failed = True
    print("FAILED" if failed else "OK: nothing lost, duplicated or malformed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
