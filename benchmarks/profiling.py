"""cProfile of a worker: the loop thread plus every thread of the store's I/O pool.

cProfile only sees the thread that enabled it, and this project's on-disk
SQLite store does its async work on a private pool, so the pool is swapped
for one whose threads each enable their own profiler; all are merged at the
end. (This touches the store's private ``runtime._io_pool``: benchmark-only.)
"""

from __future__ import annotations

import cProfile
import io
import pstats
from typing import Any

from chatflow_sqlalchemy.iopool import IOPool

__all__ = ["Profiler", "top_entries"]


class Profiler:
    """Profile the calling thread and, if ``store`` has one, its I/O pool threads."""

    def __init__(self, store: Any = None) -> None:
        self.main = cProfile.Profile()
        self.threads: list[cProfile.Profile] = []
        self.pool: IOPool | None = None
        if store is not None and hasattr(store, "runtime"):
            self._hook_pool(store)

    def _start_thread(self) -> None:
        profile = cProfile.Profile()
        self.threads.append(profile)
        profile.enable()

    def _hook_pool(self, store: Any) -> None:
        workers = int(getattr(store, "_blocking_io_workers", 4))
        self.pool = IOPool(workers, "chatflow-io", initializer=self._start_thread)
        pool = self.pool
        store.runtime._io_pool = lambda: pool

    def __enter__(self) -> Profiler:
        self.main.enable()
        return self

    def __exit__(self, *exc: object) -> None:
        self.main.disable()
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def stats(self) -> pstats.Stats:
        """All threads' statistics merged."""
        stats = pstats.Stats(self.main)
        for profile in self.threads:
            stats.add(profile)
        return stats


def top_entries(stats: pstats.Stats, sort: str, limit: int) -> str:
    """The ``limit`` top lines of ``stats`` sorted by ``sort`` (``tottime``/``cumulative``)."""
    buffer = io.StringIO()
    stats.stream = buffer  # type: ignore[attr-defined]
    stats.strip_dirs().sort_stats(sort).print_stats(limit)
    text = buffer.getvalue()
    start = text.find("   ncalls")
    return text[start:].rstrip() if start >= 0 else text.rstrip()
