"""The private I/O pool: outcomes, cancellation, thread limits and shutdown."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import weakref

import pytest

from chatflow_sqlalchemy.iopool import IOPool


def _pool_threads(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


async def test_returns_results_and_raises_errors_of_the_call() -> None:
    pool = IOPool(2, "iopool-outcome")
    try:
        assert await pool.run(lambda a, b: a + b, 2, 3) == 5
        assert await pool.run(threading.current_thread) is not threading.current_thread()
        with pytest.raises(KeyError, match="missing"):
            await pool.run({}.__getitem__, "missing")
    finally:
        pool.shutdown()


async def test_never_starts_more_threads_than_max_workers() -> None:
    pool = IOPool(3, "iopool-limit")
    names: set[str] = set()

    def work() -> None:
        names.add(threading.current_thread().name)
        time.sleep(0.01)

    try:
        await asyncio.gather(*(pool.run(work) for _ in range(20)))
        assert len(names) == 3
        assert all(name.startswith("iopool-limit_") for name in names)
        await asyncio.gather(*(pool.run(work) for _ in range(5)))
        assert len(_pool_threads("iopool-limit")) == 3  # idle threads are reused
    finally:
        pool.shutdown()


async def test_a_call_whose_awaiter_was_cancelled_before_it_started_never_runs() -> None:
    pool = IOPool(1, "iopool-cancel")
    gate = threading.Event()
    ran: list[str] = []
    try:
        blocker = asyncio.ensure_future(pool.run(gate.wait))
        queued = asyncio.ensure_future(pool.run(ran.append, "queued"))
        await asyncio.sleep(0.01)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        gate.set()
        assert await blocker is True
        assert await pool.run(ran.append, "after") is None
        assert ran == ["after"]
    finally:
        pool.shutdown()


async def test_a_running_call_finishes_when_its_awaiter_is_cancelled() -> None:
    pool = IOPool(1, "iopool-running")
    started, finished, release = threading.Event(), threading.Event(), threading.Event()

    def slow() -> None:
        started.set()
        release.wait(60)  # held until the awaiter is cancelled: no race with a sleep
        finished.set()

    try:
        task = asyncio.ensure_future(pool.run(slow))
        await asyncio.get_running_loop().run_in_executor(None, started.wait)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not finished.is_set()
    finally:
        release.set()
        pool.shutdown(wait=True)
    assert finished.is_set()


async def test_shutdown_finishes_queued_calls_then_refuses_new_ones() -> None:
    pool = IOPool(1, "iopool-shutdown")
    done: list[int] = []
    calls = [asyncio.ensure_future(pool.run(lambda i=i: (time.sleep(0.005), done.append(i))))
             for i in range(5)]
    await asyncio.sleep(0)
    await asyncio.get_running_loop().run_in_executor(None, pool.shutdown)
    assert done == [0, 1, 2, 3, 4]
    await asyncio.gather(*calls)
    assert not _pool_threads("iopool-shutdown")
    with pytest.raises(RuntimeError, match="shut down"):
        await pool.run(print)
    pool.shutdown()  # idempotent


def test_a_pool_nobody_shut_down_stops_its_threads_when_collected() -> None:
    pool = IOPool(2, "iopool-collected")
    asyncio.run(pool.run(time.sleep, 0))
    assert _pool_threads("iopool-collected")
    ref = weakref.ref(pool)
    del pool
    gc.collect()
    assert ref() is None
    deadline = time.monotonic() + 60  # a hang guard only
    while _pool_threads("iopool-collected") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _pool_threads("iopool-collected")


def test_interpreter_exit_waits_for_a_call_in_flight(tmp_path: object) -> None:
    script = (
        "import asyncio, threading\n"
        "from chatflow_sqlalchemy.iopool import IOPool\n"
        "pool = IOPool(1, 'exit')\n"
        "started, main_done = threading.Event(), threading.Event()\n"
        "def slow():\n"
        "    started.set()\n"
        "    main_done.wait(60)\n"
        "    print('finished', flush=True)\n"
        "async def main():\n"
        "    asyncio.ensure_future(pool.run(slow))\n"
        "    await asyncio.get_running_loop().run_in_executor(None, started.wait, 60)\n"
        "asyncio.run(main())\n"
        "print('main done', flush=True)\n"
        "main_done.set()\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, check=True)
    assert result.stdout.split() == ["main", "done", "finished"]


def test_max_workers_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_workers must be positive"):
        IOPool(0, "iopool-bad")


async def test_shutdown_without_waiting_stops_every_thread() -> None:
    """wait=False: threads started up to the shutdown all get their stop signal."""
    pool = IOPool(3, "iopool-nowait")
    gate = threading.Event()
    calls = [asyncio.ensure_future(pool.run(gate.wait, 5)) for _ in range(3)]
    await asyncio.sleep(0.01)
    pool.shutdown(wait=False)
    with pytest.raises(RuntimeError, match="shut down"):
        await pool.run(print)
    gate.set()
    assert await asyncio.gather(*calls) == [True, True, True]
    deadline = time.monotonic() + 60  # a hang guard only
    while _pool_threads("iopool-nowait") and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert not _pool_threads("iopool-nowait")


async def test_a_failed_call_leaves_no_reference_cycle() -> None:
    """The exception's traceback must not keep the call (and what it holds) alive."""

    class Payload:
        pass

    payload = Payload()
    ref = weakref.ref(payload)

    def fail(held: Payload) -> None:
        raise ValueError("boom")

    pool = IOPool(1, "iopool-cycle")
    gc.disable()
    try:
        try:  # not pytest.raises: its ExceptionInfo would keep the traceback alive
            await pool.run(fail, payload)
        except ValueError as exc:
            assert str(exc) == "boom"
        else:
            raise AssertionError("the call's exception was not raised")
        del payload
        await pool.run(int)  # the one thread has let go of the failed call by now
        assert ref() is None, "the failed call is only reachable through a cycle"
    finally:
        gc.enable()
        pool.shutdown()


async def test_a_failing_initializer_is_logged_and_the_thread_still_serves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken() -> None:
        raise RuntimeError("profiler unavailable")

    pool = IOPool(1, "iopool-init", initializer=broken)
    try:
        assert await asyncio.wait_for(pool.run(lambda: 42), timeout=60) == 42
    finally:
        pool.shutdown()
    assert "initializer failed" in caplog.text


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_gets_fresh_threads() -> None:
    """The parent's threads do not exist in a child: its first call must not hang."""
    pool = IOPool(2, "iopool-fork")
    try:
        assert asyncio.run(pool.run(lambda: 1)) == 1
        pid = os.fork()
        if pid == 0:  # the child: report through the exit code only
            signal.alarm(10)  # a hang kills the child, and the test fails
            ok = asyncio.run(pool.run(lambda: 2)) == 2
            pool.shutdown()
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert asyncio.run(pool.run(lambda: 3)) == 3
    finally:
        pool.shutdown()
