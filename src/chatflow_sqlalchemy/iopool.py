"""The store's private pool of I/O threads, awaited from the event loop.

A ``concurrent.futures.ThreadPoolExecutor`` awaited with
``loop.run_in_executor``: the standard library's pool, its lifecycle
(threads started on demand up to ``max_workers``, ``shutdown`` lets queued
and running calls finish, interpreter exit waits for calls in flight) and its
cancellation (a call whose awaiter gave up before it started never runs). The
wrapper adds what a store needs on top: the caller's contextvars reach the
call (as with ``asyncio.to_thread``), an initializer that fails is logged
instead of breaking the pool, a clear error once the pool was shut down, and
fresh threads in a forked child.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import os
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["IOPool"]

_T = TypeVar("_T")

logger = logging.getLogger("chatflow_sqlalchemy")


class IOPool:
    """Up to ``max_workers`` threads running blocking calls for coroutines.

    Args:
        max_workers: Most threads the pool starts.
        thread_name_prefix: Its threads are named ``<prefix>_<n>``.
        initializer: Called at the start of each thread (e.g. to profile it);
            if it raises, the error is logged and the thread serves anyway.

    """

    def __init__(
        self,
        max_workers: int,
        thread_name_prefix: str,
        initializer: Callable[[], object] | None = None,
    ) -> None:
        if max_workers <= 0:
            raise ValueError(f"max_workers must be positive, got {max_workers}")
        self._new_executor = functools.partial(
            ThreadPoolExecutor,
            max_workers,
            thread_name_prefix,
            initializer=None if initializer is None else functools.partial(_logged, initializer),
        )
        self._closed = False
        self._executor = self._new_executor()
        _ALL_POOLS.add(self)

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` on a pool thread, in a copy of the caller's context.

        Returns (or raises) its outcome. If the awaiting task is cancelled
        before a thread picks the call up, the call never runs; once running,
        it finishes and its outcome is dropped.

        Raises:
            RuntimeError: If the pool was shut down.

        """
        if self._closed:
            raise RuntimeError("cannot run blocking work: the I/O pool was shut down")
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        # A failed call's traceback holds this frame: it must not also hold the call's
        # arguments in a cycle through the exception.
        del fn, args
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def shutdown(self, wait: bool = True) -> None:
        """Refuse new work and stop the threads once queued and running calls finish.

        Idempotent. ``wait=False`` returns at once; the threads still finish
        the calls they were given.
        """
        self._closed = True
        self._executor.shutdown(wait=wait)

    def _reset_after_fork(self) -> None:
        """In a forked child: the parent's threads do not exist here; start afresh."""
        if not self._closed:
            self._executor = self._new_executor()


def _logged(initializer: Callable[[], object]) -> None:
    try:
        initializer()
    except Exception:  # the thread still serves: its callers must not wait forever
        logger.exception("the I/O pool's thread initializer failed")


_ALL_POOLS: weakref.WeakSet[IOPool] = weakref.WeakSet()


def _reset_pools_after_fork() -> None:
    for pool in list(_ALL_POOLS):
        pool._reset_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_pools_after_fork)
