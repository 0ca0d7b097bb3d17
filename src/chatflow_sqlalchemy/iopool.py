"""The store's private pool of I/O threads, awaited from the event loop.

``loop.run_in_executor`` on a ``ThreadPoolExecutor`` chains a
``concurrent.futures.Future`` to an asyncio one, and its worker does that
bookkeeping (condition variables, done callbacks) after the result is ready,
while the woken loop thread waits for the GIL: for a turn's short database
work a sizeable share of its round trip (``benchmarks/RESULTS.md``).
:class:`IOPool` hands each job to an idle thread through one queue and
resolves the asyncio future with a single ``call_soon_threadsafe``, after
which the worker goes straight back to waiting, releasing the GIL.

Lifecycle matches ``ThreadPoolExecutor``: threads start on demand up to
``max_workers``, :meth:`IOPool.shutdown` lets queued and running jobs finish,
and at interpreter exit every pool still open is shut down the same way, so a
write in flight completes instead of being cut off.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable
from contextlib import suppress
from typing import Any, Generic, TypeVar

__all__ = ["IOPool"]

_T = TypeVar("_T")

logger = logging.getLogger("chatflow_sqlalchemy")


class _Job(Generic[_T]):
    """One call to run on a pool thread, and the loop future awaiting its outcome."""

    __slots__ = ("args", "context", "fn", "future", "loop")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[_T],
        fn: Callable[..., _T],
        args: tuple[Any, ...],
    ) -> None:
        self.loop = loop
        self.future = future
        self.fn = fn
        self.args = args
        # The caller's contextvars (request ids, tracing spans) reach the I/O, as with
        # asyncio.to_thread.
        self.context = contextvars.copy_context()

    def run(self) -> None:
        """Call ``fn`` (unless its awaiter gave up first) and hand the outcome to the loop."""
        if self.future.cancelled():  # a read of the future's state, safe from any thread
            return
        loop, future = self.loop, self.future
        try:
            outcome: Any = self.context.run(self.fn, *self.args)
            succeeded = True
        except BaseException as exc:  # the awaiter re-raises it, as run_in_executor does
            outcome, succeeded = exc, False
            # The traceback holds this frame: drop what would make a cycle through it.
            self = None  # type: ignore[assignment]
        with suppress(RuntimeError):  # raised if the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(_settle, future, succeeded, outcome)
        del outcome, future


_Jobs = queue.SimpleQueue[_Job[Any] | None]
"""A pool's queue: calls to run, and ``None`` to stop one thread."""


def _settle(future: asyncio.Future[Any], succeeded: bool, outcome: Any) -> None:
    if future.done():  # the awaiting task was cancelled meanwhile
        return
    if succeeded:
        future.set_result(outcome)
    else:
        future.set_exception(outcome)


class IOPool:
    """Up to ``max_workers`` threads running blocking calls for coroutines.

    Args:
        max_workers: Most threads the pool starts.
        thread_name_prefix: Its threads are named ``<prefix>_<n>``.
        initializer: Called at the start of each thread (e.g. to profile it).

    """

    def __init__(
        self,
        max_workers: int,
        thread_name_prefix: str,
        initializer: Callable[[], object] | None = None,
    ) -> None:
        if max_workers <= 0:
            raise ValueError(f"max_workers must be positive, got {max_workers}")
        self._max_workers = max_workers
        self._prefix = thread_name_prefix
        self._initializer = initializer
        self._jobs: _Jobs = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        # Threads hold no reference to the pool: a pool nobody closed stops its
        # threads when it is collected, or at interpreter exit (finalize's atexit).
        self._stop = weakref.finalize(self, _stop_threads, self._jobs, self._threads, self._lock)
        _ALL_POOLS.add(self)

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` on a pool thread, in a copy of the caller's context.

        Returns (or raises) its outcome.

        If the awaiting task is cancelled before a thread picks the call up,
        the call never runs; once running, it finishes and its outcome is
        dropped, as with ``run_in_executor``.

        Raises:
            RuntimeError: If the pool was shut down.

        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()
        self._submit(_Job(loop, future, fn, args))
        # A failed call's traceback holds this frame: it must not also hold the call's
        # arguments, nor (through the future) the exception itself, in a cycle.
        del fn, args
        try:
            return await future  # cancelling the awaiter cancels it: a queued call is skipped
        finally:
            del future

    def _submit(self, job: _Job[Any]) -> None:
        with self._lock:
            if not self._stop.alive:
                raise RuntimeError("cannot run blocking work: the I/O pool was shut down")
            self._jobs.put(job)
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max_workers:
                self._start_thread()

    def _start_thread(self) -> None:
        thread = threading.Thread(
            target=_serve,
            args=(self._jobs, self._idle, self._initializer),
            name=f"{self._prefix}_{len(self._threads)}",
            daemon=True,  # always joined: by shutdown(), on collection, at exit
        )
        thread.start()
        self._threads.append(thread)

    def shutdown(self, wait: bool = True) -> None:
        """Refuse new work and stop the threads once queued and running calls finish.

        Idempotent. ``wait=False`` returns at once; the threads still finish
        the calls they were given.
        """
        if wait:
            self._stop()
            return
        with self._lock:  # no thread may start between the refusal and the count
            self._stop.detach()
            threads = list(self._threads)
        _signal_stop(self._jobs, threads)

    def _reset_after_fork(self) -> None:
        """In a forked child: the parent's threads do not exist here; start afresh."""
        if not self._stop.alive:
            return  # shut down before the fork: stays shut down
        self._stop.detach()
        self._jobs = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._threads = []
        self._lock = threading.Lock()
        self._stop = weakref.finalize(self, _stop_threads, self._jobs, self._threads, self._lock)


def _serve(
    jobs: _Jobs,
    idle: threading.Semaphore,
    initializer: Callable[[], object] | None,
) -> None:
    if initializer is not None:
        try:
            initializer()
        except Exception:  # the thread still serves: its callers must not wait forever
            logger.exception("the I/O pool's thread initializer failed")
    while (job := jobs.get()) is not None:
        job.run()
        del job  # drop the finished call's arguments and outcome before waiting
        idle.release()


def _signal_stop(jobs: _Jobs, threads: list[threading.Thread]) -> None:
    for _ in threads:
        jobs.put(None)  # one stop signal per thread, queued after the pending calls


def _stop_threads(
    jobs: _Jobs,
    threads: list[threading.Thread],
    lock: threading.Lock,
) -> None:
    with lock:
        stopping = list(threads)
    _signal_stop(jobs, stopping)
    current = threading.current_thread()
    for thread in stopping:
        if thread is not current:
            thread.join()


_ALL_POOLS: weakref.WeakSet[IOPool] = weakref.WeakSet()


def _reset_pools_after_fork() -> None:
    for pool in list(_ALL_POOLS):
        pool._reset_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_pools_after_fork)
