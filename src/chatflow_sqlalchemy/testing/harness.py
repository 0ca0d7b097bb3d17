"""Describe a session-store backend to the conformance suite.

A backend package tests itself against the shipped suite by overriding the
``store_factory`` pytest fixture so that it returns a :class:`StoreHarness`
for its store::

    # conftest.py of a third-party backend
    import pytest
    from chatflow_sqlalchemy.testing import Capability, SpecHarness, StoreSpec

    @pytest.fixture
    def store_factory(tmp_path):
        harness = SpecHarness(
            "mariadb",
            StoreSpec("chatflow_mariadb:MariaDBSessionStore", (MARIADB_URL,)),
            capabilities={Capability.PERSISTENT, Capability.CROSS_PROCESS, Capability.SQL},
        )
        yield harness
        harness.close()

    # test_conformance.py
    from chatflow_sqlalchemy.testing.suite import *  # noqa: F403

Tests never look at backend names: each declares the :class:`Capability`
values it needs (``@requires(Capability.PERSISTENT)``) and is skipped, with
the missing capability in the reason, on a harness that lacks them.

This module is imported by the worker processes of the cross-process tests,
so it stays light: pytest and the store classes are imported lazily.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import importlib
import multiprocessing
import os
import queue as queue_module
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext, SpawnContext  # no fork server on Windows
    from multiprocessing.process import BaseProcess

    import pytest
    from chatflow_agent import BaseSessionStore

__all__ = [
    "CRASH_EXIT_CODE",
    "Capability",
    "FactoryHarness",
    "SpecHarness",
    "StoreHarness",
    "StoreSpec",
    "UnreachableHarness",
    "Worker",
    "claim_worker",
    "crash_worker",
    "database_problem",
    "missing_capabilities",
    "requires",
    "run_process",
    "run_workers",
    "start_process",
    "turns_worker",
    "worker_context",
    "worker_process",
]


class Capability(str, enum.Enum):
    """What a backend under test can do; tests require capabilities, never names.

    Members are plain strings too (``Capability.SQL == "sql"``), so a harness
    may declare ``capabilities`` as any set of these values.
    """

    PERSISTENT = "persistent"
    """A new store instance from ``harness.open()`` sees everything earlier ones wrote.

    Declare it when ``open()`` reaches the same database every time (a file, a
    server schema, a named shared-memory database kept alive by the harness).
    Tests that reload a session "after a restart" require it.
    """

    CROSS_PROCESS = "cross_process"
    """Several OS processes can use the database at once.

    Requires :meth:`StoreHarness.spec`: spawned worker processes open their
    own store from it. Dedup claim races, concurrent turns and crash-safety
    tests run real processes and require it.
    """

    SQL = "sql"
    """The store is a SQL store with an ``engine`` attribute (a SQLAlchemy Engine)
    over the ``chatflow_sessions`` / ``chatflow_messages`` /
    ``chatflow_processed_messages`` tables. Tests inspect rows (cascades,
    orphans, corrupt rows) through it.
    """

    ASYNC_THREADPOOL = "async_threadpool"
    """The async API runs blocking work on the store's private thread pool.

    The store has ``_run_blocking`` and ``_pool`` (an :class:`~chatflow_sqlalchemy.iopool.IOPool`
    whose threads are named ``chatflow-io*``); database work started from the
    ``a*`` methods never runs on the event-loop thread.
    """

    ASYNC_NATIVE = "async_native"
    """The async API drives a native async driver on the event loop.

    A SQL store with it runs the same statements through a SQLAlchemy
    ``AsyncEngine`` (e.g. psycopg 3's async mode): no thread hop and no
    blocking driver call on the loop thread.
    """

    EPHEMERAL = "ephemeral"
    """The database lives only in this process's memory.

    SQL stores with it run their async work directly on the event loop (no
    thread hop) and create no thread pool.
    """

    USER_SCOPE = "user_scope"
    """Lifecycle and data governance: per-user scope and GDPR.

    ``get_or_create(..., user_id=)``, ``list_sessions(user_id=, metadata=,
    updated_after=, limit=, after=)``, ``erase_user`` and ``export_user``
    with their async twins (see DESIGN "Lifecycle and data governance").
    """

    RETENTION = "retention"
    """``session_ttl_hours`` (a constructor keyword) and ``sweep()`` / ``asweep()``.

    Sweeping never removes a session whose turn is in progress or that a
    live webhook claim holds; with ``CROSS_PROCESS`` four processes sweep at once.
    """

    ARCHIVE = "archive"
    """``archive_pruned`` (a constructor keyword), ``transcript()`` / ``atranscript()``."""

    ENCRYPTION = "encryption"
    """SQL stores: ``cipher=`` (an ``AESGCMCipher``), ``require_encryption=`` and
    ``rotate_keys()``; rows are inspected through ``store.engine`` (needs ``SQL`` too)."""

    FORKS = "forks"
    """``store.fork(session_id, new_session_id, at_turn=)`` / ``afork`` and
    ``list_sessions(forked_from=)`` (see DESIGN "Summaries, rewind and forks")."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class StoreSpec:
    """A picklable recipe for opening a store, usable in a spawned process.

    Attributes:
        target: ``"package.module:callable"`` returning a store (usually the
            store class itself).
        args: Positional arguments for the callable.
        kwargs: Keyword arguments for the callable (picklable values only).

    """

    target: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def resolve(self) -> Callable[..., Any]:
        """Import and return the callable named by :attr:`target`."""
        module_name, _, attr = self.target.partition(":")
        if not attr:
            raise ValueError(f"StoreSpec target must be 'module:callable', got {self.target!r}")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        if not callable(obj):
            raise TypeError(f"StoreSpec target {self.target!r} is not callable")
        return obj  # type: ignore[no-any-return]

    def open(self, **store_kwargs: Any) -> BaseSessionStore:
        """Open a store; ``store_kwargs`` override :attr:`kwargs`."""
        factory = self.resolve()
        store: BaseSessionStore = factory(*self.args, **{**dict(self.kwargs), **store_kwargs})
        return store


def missing_capabilities(have: Iterable[str], need: Iterable[str]) -> list[str]:
    """Return the capabilities of ``need`` that ``have`` lacks, as strings, in order."""
    owned = {str(c) for c in have}
    return [str(c) for c in need if str(c) not in owned]


def requires(*capabilities: Capability | str) -> pytest.MarkDecorator:
    """Mark a test (or class) as needing ``capabilities`` of the store under test.

    On a harness without them the test is skipped with a reason naming the
    missing capabilities. Shorthand for ``@pytest.mark.chatflow_requires(...)``.
    """
    import pytest

    return pytest.mark.chatflow_requires(*(str(c) for c in capabilities))


class StoreHarness(abc.ABC):
    """One backend under test: how to open its store and what it can do.

    Subclass it and implement :meth:`_open` (and :meth:`spec` for
    ``CROSS_PROCESS``), or use :class:`SpecHarness` / :class:`FactoryHarness`.
    Every store returned by :meth:`open` is closed by :meth:`close`.

    Attributes:
        name: Human-readable backend name (shown in test ids and skip reasons).
        capabilities: The :class:`Capability` values this backend has.

    """

    name: str = "store"
    capabilities: frozenset[str] = frozenset()

    def __init__(
        self, name: str | None = None, capabilities: Iterable[Capability | str] | None = None
    ) -> None:
        if name is not None:
            self.name = name
        if capabilities is not None:
            self.capabilities = frozenset(str(c) for c in capabilities)
        unknown = self.capabilities - {c.value for c in Capability}
        if unknown:
            raise ValueError(f"unknown capabilities {sorted(unknown)} for harness {self.name!r}")
        self._opened: list[BaseSessionStore] = []
        self._closed = False

    @abc.abstractmethod
    def _open(self, **store_kwargs: Any) -> BaseSessionStore:
        """Create a new store instance on this harness's database."""

    def open(self, **store_kwargs: Any) -> BaseSessionStore:
        """Open a NEW store instance on the same database as every other call.

        Keyword arguments (``default_max_turns``, ``dedup_ttl_hours``) go to the
        store's constructor. The store is closed by :meth:`close`.
        """
        if self._closed:
            raise RuntimeError(f"harness {self.name!r} is closed")
        store = self._open(**store_kwargs)
        self._opened.append(store)
        return store

    def spec(self) -> StoreSpec:
        """A picklable recipe for opening this database in another process.

        Required when the harness declares ``CROSS_PROCESS``.
        """
        raise NotImplementedError(
            f"harness {self.name!r} has no spec(); implement it to declare CROSS_PROCESS"
        )

    def has(self, *capabilities: Capability | str) -> bool:
        """Return True when the harness has every capability given."""
        return not missing_capabilities(self.capabilities, capabilities)

    def require(self, *capabilities: Capability | str) -> None:
        """Skip the running test unless the harness has every capability given."""
        missing = missing_capabilities(self.capabilities, capabilities)
        if missing:
            import pytest

            pytest.skip(self.skip_reason(missing))

    def skip_reason(self, missing: Sequence[str]) -> str:
        """The skip message for a test that needs ``missing`` capabilities."""
        return (
            f"store {self.name!r} lacks capability {', '.join(missing)} "
            f"(has: {', '.join(sorted(self.capabilities)) or 'none'})"
        )

    def close(self) -> None:
        """Close every store opened through this harness, then :meth:`cleanup`."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        for store in reversed(self._opened):
            try:
                close = getattr(store, "close", None)
                if close is not None:
                    close()
            except Exception as exc:  # keep closing the others
                errors.append(exc)
        self._opened.clear()
        self.cleanup()
        if errors:
            raise errors[0]

    def cleanup(self) -> None:  # noqa: B027 - an optional hook, not an abstract method
        """Release the database itself (delete files, drop schemas); a hook."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {sorted(self.capabilities)}>"


def database_problem(url: Any) -> str | None:
    """Why the database at ``url`` cannot be used right now, or None when it answers.

    For conftest files: a configured server that does not answer should fail
    the backend's tests with this reason (see :class:`UnreachableHarness`).
    """
    from sqlalchemy import create_engine, text

    try:
        engine = create_engine(url, connect_args={"connect_timeout": 5})
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        finally:
            engine.dispose()
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
    return None


class _FailingStore:
    """Stands in for a store that cannot be opened: any use fails the test."""

    def __init__(self, message: str) -> None:
        self._message = message

    def close(self) -> None:
        """Nothing to close."""

    def __getattr__(self, name: str) -> Any:
        import pytest

        pytest.fail(self._message, pytrace=False)


class UnreachableHarness(StoreHarness):
    """The harness to return when the configured database server cannot be reached.

    It claims every capability, so no test is skipped, and its stores fail the
    test as soon as the test body touches them: each test of the backend is
    reported FAILED with ``message``, never silently skipped (a fixture that
    raised would show as an ERROR instead).
    """

    def __init__(self, name: str, message: str) -> None:
        super().__init__(name, list(Capability))
        self.message = message

    def _open(self, **store_kwargs: Any) -> Any:
        return _FailingStore(self.message)

    def spec(self) -> StoreSpec:
        import pytest

        pytest.fail(self.message, pytrace=False)


class SpecHarness(StoreHarness):
    """A harness whose stores are opened from a :class:`StoreSpec`.

    Args:
        name: Backend name.
        spec: How to open the store (also used by spawned processes).
        capabilities: What the backend can do.
        cleanup: Called once after every store was closed.

    """

    def __init__(
        self,
        name: str,
        spec: StoreSpec,
        capabilities: Iterable[Capability | str],
        cleanup: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(name, capabilities)
        self._spec = spec
        self._cleanup = cleanup

    def _open(self, **store_kwargs: Any) -> BaseSessionStore:
        return self._spec.open(**store_kwargs)

    def spec(self) -> StoreSpec:
        """Return the spec this harness opens its stores from."""
        return self._spec

    def cleanup(self) -> None:
        """Run the cleanup callback, if any."""
        if self._cleanup is not None:
            self._cleanup()


class FactoryHarness(StoreHarness):
    """A harness whose stores come from any callable (no cross-process use).

    Args:
        name: Backend name.
        factory: ``factory(**store_kwargs)`` returns a new store.
        capabilities: What the backend can do (``CROSS_PROCESS`` needs ``spec``).
        spec: Optional recipe for spawned processes.
        cleanup: Called once after every store was closed.

    """

    def __init__(
        self,
        name: str,
        factory: Callable[..., BaseSessionStore],
        capabilities: Iterable[Capability | str],
        spec: StoreSpec | None = None,
        cleanup: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(name, capabilities)
        self._factory = factory
        self._spec = spec
        self._cleanup = cleanup

    def _open(self, **store_kwargs: Any) -> BaseSessionStore:
        return self._factory(**store_kwargs)

    def spec(self) -> StoreSpec:
        """Return the spec given to the constructor."""
        if self._spec is None:
            return super().spec()
        return self._spec

    def cleanup(self) -> None:
        """Run the cleanup callback, if any."""
        if self._cleanup is not None:
            self._cleanup()


# ------------------------------------------------------------------ processes
#
# Workers run in fresh processes (worker_context: a fork server, else spawn):
# they receive a StoreSpec, open their own store and report through a queue.
# They are module-level functions so that they pickle by name.


WORKER_PRELOAD = (
    "chatflow_agent",
    "sqlalchemy",
    "chatflow_sqlalchemy",
    "chatflow_sqlalchemy.testing.harness",
    "chatflow_sqlalchemy.testing.claim_workers",
    "chatflow_sqlalchemy.testing.lifecycle_suite",
    "chatflow_sqlalchemy.testing.inbox_suite",
)
"""Modules the kit's fork server imports once, so each worker process does not."""


START_METHOD_ENV = "CHATFLOW_TEST_START_METHOD"
"""Set to ``spawn`` to start the kit's workers with ``spawn`` instead of the fork server."""


def worker_context() -> SpawnContext | ForkServerContext:
    """The ``multiprocessing`` context the kit starts its worker processes with.

    A fork server that imported chatflow-agent, SQLAlchemy and the store once
    (:data:`WORKER_PRELOAD`) where the platform has one, else ``spawn``
    (also when :data:`START_METHOD_ENV` says ``spawn``). The fork server
    saves every worker the seconds of CPU that importing those libraries
    costs, which on a small machine is most of what the cross-process tests
    spend. Its children are forks of the server, not of the test process:
    they share no engine, connection, thread or lock with it. Start them with
    :func:`worker_process`, which also gives them the test process's
    environment as it is at the start (the server's was fixed when it started).
    """
    if (
        os.environ.get(START_METHOD_ENV, "").lower() == "spawn"
        or "forkserver" not in multiprocessing.get_all_start_methods()
    ):
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(WORKER_PRELOAD))
    return context


def worker_process(
    context: SpawnContext | ForkServerContext, target: Callable[..., Any], args: tuple[Any, ...]
) -> BaseProcess:
    """A daemon process of ``context`` that runs ``target(*args)`` in today's environment."""
    return context.Process(
        target=_in_environment, args=(dict(os.environ), target, *args), daemon=True
    )


def _in_environment(environ: dict[str, str], target: Callable[..., Any], *args: Any) -> Any:
    os.environ.clear()
    os.environ.update(environ)
    return target(*args)


def run_workers(
    target: Callable[..., Any],
    per_worker_args: Sequence[tuple[Any, ...]],
    *,
    timeout: float = 60.0,
) -> list[Any]:
    """Run ``target(*args, barrier, results)`` in one worker process per args tuple.

    The workers wait on a shared barrier so they start together, and each puts
    exactly one result on ``results``. Returns the results (in completion
    order). Raises ``AssertionError`` if a worker fails, exits without a
    result, or the whole run exceeds ``timeout`` seconds; stragglers are killed.
    """
    ctx = worker_context()
    results: Any = ctx.Queue()
    barrier = ctx.Barrier(len(per_worker_args))
    processes = [
        worker_process(ctx, target, (*args, barrier, results)) for args in per_worker_args
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    collected: list[Any] = []
    try:
        while len(collected) < len(processes):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"worker processes timed out after {timeout}s "
                    f"({len(collected)}/{len(processes)} reported)"
                )
            try:
                item = results.get(timeout=min(remaining, 0.5))
            except queue_module.Empty:
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead and results.empty():
                    codes = [p.exitcode for p in dead]
                    raise AssertionError(f"worker process died with exit codes {codes}") from None
                continue
            if isinstance(item, tuple) and item and item[0] == "error":
                raise AssertionError(f"worker process failed: {item[1]}")
            collected.append(item)
    finally:
        for process in processes:
            process.join(timeout=max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(5)
        results.close()
    return collected


def run_process(target: Callable[..., Any], args: tuple[Any, ...], *, timeout: float = 60.0) -> int:
    """Run ``target(*args)`` in one worker process and return its exit code."""
    ctx = worker_context()
    process = worker_process(ctx, target, args)
    process.start()
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join(5)
        raise AssertionError(f"worker process did not finish within {timeout}s")
    assert process.exitcode is not None
    return process.exitcode


class Worker:
    """A worker process started by :func:`start_process`, and the queue it reports on.

    Events are tuples whose first item names them: ``("ready", pid)`` (the
    worker reached the point a test acts at: kill it, stop it), ``("ack",
    what)`` (something it did is stored), ``("done", pid, result)`` and
    ``("crash", pid, reason)`` (its target raised).
    """

    def __init__(self, process: BaseProcess, events: Any) -> None:
        self.process = process
        self.events = events

    @property
    def pid(self) -> int:
        """The worker's process id."""
        assert self.process.pid is not None
        return int(self.process.pid)

    def next_event(self, timeout: float = 120.0) -> tuple[Any, ...]:
        """The worker's next event; fails if it crashed, died silently or ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                event: tuple[Any, ...] = self.events.get(timeout=0.2)
            except queue_module.Empty:
                if not self.process.is_alive() and self.events.empty():
                    raise AssertionError(
                        f"worker {self.pid} exited with {self.process.exitcode} and no event"
                    ) from None
                if time.monotonic() > deadline:
                    raise AssertionError(f"worker {self.pid} sent nothing for {timeout}s") from None
                continue
            if event[0] == "crash":
                raise AssertionError(f"worker {self.pid} failed: {event[2]}")
            return event

    def result(self, timeout: float = 120.0) -> Any:
        """Wait for the worker's ``done`` event and return its result, skipping other events."""
        while True:
            event = self.next_event(timeout)
            if event[0] == "done":
                return event[2]

    def kill(self) -> list[tuple[Any, ...]]:
        """``SIGKILL`` the worker, reap it, and return the events it sent but nobody read."""
        self.process.kill()
        self.process.join(30)
        assert self.process.exitcode is not None, f"worker {self.pid} survived SIGKILL"
        left: list[tuple[Any, ...]] = []
        with contextlib.suppress(queue_module.Empty):
            while True:
                left.append(self.events.get(timeout=0.1))
        return left

    def stop(self) -> None:
        """Kill the worker if it still runs, and reap it."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)


def start_process(target: Callable[..., Any], *args: Any) -> Worker:
    """Start ``target(*args, events)`` in a worker process (:func:`worker_context`).

    ``target`` reports on ``events`` (see :class:`Worker`); if it raises, a
    ``crash`` event carries the error. It must be a module-level function, so
    that it pickles by name.
    """
    ctx = worker_context()
    events: Any = ctx.Queue()
    process = worker_process(ctx, _report_crash, (events, target, *args))
    process.start()
    return Worker(process, events)


def _report_crash(events: Any, target: Callable[..., Any], *args: Any) -> None:
    try:
        target(*args, events)
    except BaseException as exc:
        events.put(("crash", os.getpid(), f"{type(exc).__name__}: {exc}"))
        raise


def _report_errors(results: Any, fn: Callable[[], Any]) -> None:
    try:
        results.put(fn())
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def claim_worker(spec: StoreSpec, message_ids: Sequence[str], barrier: Any, results: Any) -> None:
    """Claim every id with ``record_processed_message``; report ``(pid, claimed ids)``."""

    def work() -> tuple[int, list[str]]:
        store = spec.open()
        try:
            store.is_message_processed("warm-up")  # connect before the race starts
            barrier.wait(30)
            claimed = [m for m in message_ids if store.record_processed_message(m)]
        finally:
            getattr(store, "close", lambda: None)()
        return os.getpid(), claimed

    _report_errors(results, work)


def turns_worker(
    spec: StoreSpec,
    session_id: str,
    agent_name: str,
    label: str,
    n_turns: int,
    barrier: Any,
    results: Any,
) -> None:
    """Run ``n_turns`` locked turns (USER then MODEL, both ``f"{label}-{k}"``); report label."""

    def work() -> str:
        from chatflow_agent import Agent, Message, Role

        store = spec.open()
        try:
            ctx = store.get_or_create(session_id, Agent(name=agent_name, instructions=""))
            barrier.wait(30)

            async def turns() -> None:
                for k in range(n_turns):
                    async with ctx.lock:
                        ctx.add_message(Message(role=Role.USER, content=f"{label}-{k}"))
                        await asyncio.sleep(0.001)
                        ctx.add_message(Message(role=Role.MODEL, content=f"{label}-{k}"))

            asyncio.run(turns())
        finally:
            getattr(store, "close", lambda: None)()
        return label

    _report_errors(results, work)


CRASH_EXIT_CODE = 17
"""Exit status of :func:`crash_worker` when it died where it meant to."""


def crash_worker(spec: StoreSpec, locked_session: str, unlocked_session: str) -> None:
    """Die (``os._exit``) in the middle of two turns, one inside ``session.lock``.

    ``locked_session`` gets one complete turn, then a second turn that dies
    inside the lock after a USER message and a MODEL tool call.
    ``unlocked_session`` gets a USER message and a MODEL tool call written
    outside any lock, and the process dies before the tool result.
    """
    from chatflow_agent import Agent, Message, Role, ToolCall

    store = spec.open()
    agent = Agent(name="Crasher", instructions="")
    call = ToolCall(id="call-crash", name="lookup", args={"q": "x"})

    locked = store.get_or_create(locked_session, agent)
    locked.add_message(Message(role=Role.USER, content="turn 1"))
    locked.add_message(Message(role=Role.MODEL, content="answer 1"))

    unlocked = store.get_or_create(unlocked_session, agent)
    unlocked.add_message(Message(role=Role.USER, content="turn 1"))
    unlocked.add_message(Message(role=Role.MODEL, content=None, tool_calls=[call]))

    async def die_mid_turn() -> None:
        async with locked.lock:
            locked.add_message(Message(role=Role.USER, content="turn 2"))
            locked.add_message(Message(role=Role.MODEL, content=None, tool_calls=[call]))
            os._exit(CRASH_EXIT_CODE)

    asyncio.run(die_mid_turn())
