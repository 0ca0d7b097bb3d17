"""Where a SQL store's database work runs: its engines, transactions, threads and loops.

One :class:`StoreRuntime` per store. Every statement the store sends goes
through :meth:`StoreRuntime.transaction` on a SQLAlchemy ``Connection``, so the
engine's events, ``echo`` and SQLAlchemy's instrumentation see all of it. The
async API runs the very same sync code through :meth:`StoreRuntime.run_blocking`:

* on-disk databases without an async driver: a private pool of threads;
* in-memory SQLite: directly on the loop (one shared connection, serialised);
* native async (PostgreSQL, ``sqlite+aiosqlite``): in greenlets on an
  ``AsyncEngine`` (``AsyncSession.run_sync``), whose sync facade runs the
  same statements on the async driver without a thread hop.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import sqlalchemy
from sqlalchemy import URL, Connection, Engine, RootTransaction, create_engine
from sqlalchemy import exc as sa_exc

from chatflow_sqlalchemy.dialect import DialectSupport
from chatflow_sqlalchemy.exceptions import BackendImportError, DatabaseUnavailableError
from chatflow_sqlalchemy.iopool import IOPool

if TYPE_CHECKING:  # the asyncio extension needs greenlet: imported only where it is used
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

__all__ = [
    "ASYNC_INSTALL_HINT",
    "RunBlocking",
    "StoreRuntime",
    "create_store_engine",
    "describe",
    "is_deadlock",
    "merged",
    "retrying_deadlocks",
]

_T = TypeVar("_T")


class RunBlocking(Protocol):
    """A store's way to run blocking work off the loop, handed to its parts.

    It is the store's own, which a backend may bound in time (the PostgreSQL store does).
    """

    async def __call__(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``, off the event loop."""
        ...


ASYNC_INSTALL_HINT = "pip install 'chatflow-sqlalchemy[aiosqlite]'"

_IN_ASYNC_FACADE: ContextVar[bool] = ContextVar("chatflow_in_async_facade", default=False)
"""True while store code runs in a greenlet on the AsyncEngine's sync facade."""


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


_RESTORES_AUTOCOMMIT = _version(sqlalchemy.__version__) >= (2, 0, 20)
"""A pooled connection gets its engine-level AUTOCOMMIT back after a transaction at another
level (SQLAlchemy issue 10147); before 2.0.20 it kept that level, and each later autocommit
statement would cost a COMMIT round trip: the AsyncEngine's pool then stays as it was."""

_SKIPS_AUTOCOMMIT_ROLLBACK = _version(sqlalchemy.__version__) >= (2, 0, 43)
"""``create_engine(skip_autocommit_rollback=True)`` exists (SQLAlchemy 2.0.43)."""

_READ, _WRITE, _SINGLE = 0, 1, 2
"""Indexes of the engine modes (see :meth:`StoreRuntime._engine_modes`)."""


DEADLOCK_RETRIES = 5
"""Attempts of a transaction the database keeps choosing as a deadlock victim."""


def is_deadlock(exc: sa_exc.DBAPIError) -> bool:
    """The database rolled the transaction back as a deadlock victim (SQLSTATE 40001/40P01)."""
    orig = exc.orig
    if getattr(orig, "sqlstate", None) in ("40001", "40P01"):
        return True
    args: tuple[Any, ...] = tuple(getattr(orig, "args", ()))
    return bool(args) and args[0] == 1213  # MySQL/MariaDB ER_LOCK_DEADLOCK (SQLSTATE 40001)


def retrying_deadlocks(run: Callable[[], _T]) -> _T:
    """``run()`` (one whole transaction), run again while it is rolled back as a deadlock victim.

    For upkeep that takes many rows at once (a sweep's batch, the inbox's purge):
    on InnoDB it can deadlock with the turns and inbox writes beside it, and a
    victim was rolled back whole, so running it again is safe. The pause between
    tries is skipped on an event loop's thread (a native-async store runs its work
    there, in SQLAlchemy's greenlet), where sleeping would stall every other task.
    """
    for attempt in range(DEADLOCK_RETRIES):
        try:
            return run()
        except sa_exc.OperationalError as exc:
            if not is_deadlock(exc) or attempt == DEADLOCK_RETRIES - 1:
                raise
            if _running_loop() is None:
                time.sleep(0.01 * (attempt + 1))
    raise AssertionError("unreachable")  # pragma: no cover


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def describe(url: URL) -> str:
    """Name host and database of ``url`` without the password."""
    if url.get_backend_name() == "sqlite":
        return f"SQLite database {url.database or ':memory:'!r}"
    host = f"{url.host or 'localhost'}:{url.port}" if url.port else (url.host or "localhost")
    return f"{url.get_backend_name()} database {url.database!r} on {host} as {url.username!r}"


def _unavailable(url: URL, exc: sa_exc.DBAPIError) -> DatabaseUnavailableError:
    reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
    return DatabaseUnavailableError(f"cannot reach {describe(url)}: {reason}")


class _Guard:
    """Serialises the users of one shared connection; a lost connection becomes one clear error.

    A class rather than a ``@contextmanager`` generator: several guarded
    units run every turn, and a generator context manager costs more.
    What counts as lost is SQLAlchemy's own verdict: the dialect recognised a
    disconnect and invalidated the connection (``connection_invalidated``).
    """

    __slots__ = ("_serial", "_url")

    def __init__(self, serial: threading.RLock | None, url: URL) -> None:
        self._serial = serial
        self._url = url

    def __enter__(self) -> None:
        if self._serial is not None:
            self._serial.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._serial is not None:
            self._serial.release()
        if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
            raise _unavailable(self._url, exc) from exc


class _Transaction:
    """:meth:`StoreRuntime.transaction`: under the guard, a connection in a transaction.

    What ``with guard: with conn, conn.begin(): ...`` does, in a class for the
    reason :class:`_Guard` is one. A commit or rollback that fails still closes
    the connection and leaves the guard, which sees that failure, as the nested
    ``with`` statements would.
    """

    __slots__ = ("_begun", "_conn", "_mode", "_runtime")

    def __init__(self, runtime: StoreRuntime, mode: int) -> None:
        self._runtime = runtime
        self._mode = mode
        self._conn: Connection | None = None
        self._begun: RootTransaction | None = None

    def __enter__(self) -> Connection:
        runtime = self._runtime
        engine = runtime._engine_for(self._mode)
        guard = runtime.guard
        guard.__enter__()
        try:
            conn = runtime.connect(engine)
            try:
                # Entered as ``with conn.begin():`` does: SQLAlchemy then refuses a
                # statement after the block ended this transaction itself, instead
                # of beginning another that closing the connection rolls back.
                begun = conn.begin().__enter__()
            except BaseException as exc:
                conn.__exit__(type(exc), exc, exc.__traceback__)
                raise
        except BaseException as exc:
            guard.__exit__(type(exc), exc, exc.__traceback__)
            raise
        self._conn, self._begun = conn, begun
        return conn

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        conn, begun = self._conn, self._begun
        assert conn is not None and begun is not None
        self._conn = self._begun = None
        guard = self._runtime.guard
        try:
            try:
                begun.__exit__(exc_type, exc, tb)  # commits, or rolls back on an error
            except BaseException as failed:
                conn.__exit__(type(failed), failed, failed.__traceback__)
                raise
            conn.__exit__(exc_type, exc, tb)
        except BaseException as failed:
            guard.__exit__(type(failed), failed, failed.__traceback__)
            raise
        guard.__exit__(exc_type, exc, tb)


class StoreRuntime:
    """The engines of one store and how its sync and async calls reach them.

    Args:
        engine: The store's engine (created by the store, or the caller's).
        support: The dialect support of the engine's database.
        url: The URL the store was opened on (the AsyncEngine is built from it).
        owns_engine: The store created ``engine`` (it may then build an
            AsyncEngine with the same options, and disposes both on close).
        engine_options: The caller's ``create_engine`` options, over the dialect's.
        io_workers: Threads of the private pool that serves the async API
            where it cannot be native.

    Raises:
        BackendImportError: The URL names an async driver and greenlet is missing.

    """

    def __init__(
        self,
        engine: Engine,
        support: DialectSupport,
        url: URL,
        *,
        owns_engine: bool,
        engine_options: Mapping[str, Any],
        io_workers: int,
    ) -> None:
        self.engine = engine
        self.support = support
        self.url = url
        self.owns_engine = owns_engine
        self.system = engine.dialect.name
        """The database's name for telemetry (``db.system.name``)."""
        self.ephemeral = support.is_ephemeral(url)
        self._engine_options = dict(engine_options)
        self._io_workers = io_workers
        self._engines = self._engine_modes(engine)
        self._aengines: tuple[Engine, Engine, Engine] | None = None
        self.aengine: AsyncEngine | None = None
        """The AsyncEngine of a native-async store, once needed (its async API runs on it)."""
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._arunner: AsyncSession | None = None
        self._thread_loops: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
        self.pool: IOPool | None = None
        """The private thread pool, once the async API needed it."""
        self._lock = threading.Lock()
        self.closed = False
        # One shared connection (in-memory SQLite) must not be used by two threads at once.
        self.guard = _Guard(threading.RLock() if self.ephemeral else None, url)
        self.native_async = self._wants_native_async()

    @property
    def engines(self) -> tuple[Engine, ...]:
        """The store's engine, and its AsyncEngine's sync facade on a native-async store.

        The AsyncEngine is created here if the async API has not run yet (it
        connects only when used), so listeners can be attached before.
        """
        if not self.native_async:
            return (self.engine,)
        with self._lock:
            return (self.engine, self._async_engine().sync_engine)

    def _async_engine(self) -> AsyncEngine:
        """The AsyncEngine, created on first need (call with ``_lock`` held)."""
        if self.aengine is None:
            level = self._transaction_level()
            self.aengine = self._make_async_engine(level is not None)
            facade = self.aengine.sync_engine
            self.support.prepare_engine(facade)
            self._aengines = self._engine_modes(facade, level)
        return self.aengine

    def _transaction_level(self) -> str | None:
        """The isolation level of transactions, when the AsyncEngine's pool runs in autocommit.

        Nearly every statement of the async API runs alone in autocommit (a
        claim, a lease, a turn's write on PostgreSQL). Switching a pooled
        connection to autocommit and back costs two driver calls per
        statement, so where autocommit is an isolation level the AsyncEngine's
        connections stay in it and the rarer transactions name the level of
        the store's engine instead (the caller's ``isolation_level``, else the
        database's default). None: keep the pool as it is.
        """
        if not _RESTORES_AUTOCOMMIT:
            return None
        if self.support.autocommit_options() != {"isolation_level": "AUTOCOMMIT"}:
            return None
        given = merged(self.support.engine_options(self.url), self._engine_options)
        level = given.get("isolation_level") or self.engine.dialect.default_isolation_level
        return level if isinstance(level, str) and level != "AUTOCOMMIT" else None

    def _wants_native_async(self) -> bool:
        """Whether the async API runs in greenlets on an AsyncEngine (else the thread pool).

        It needs an async driver for the URL and greenlet; a URL naming an async
        driver without greenlet is refused. A caller's engine carries settings
        (connect_args, pool, listeners) that an AsyncEngine built from its URL
        would not: its async work runs on threads.
        """
        if self.ephemeral or self.support.async_url(self.url) is None or not self.owns_engine:
            return False
        if importlib.util.find_spec("greenlet") is not None:
            return True
        if self.support.sync_url(self.url).drivername != self.url.drivername:
            raise BackendImportError(
                f"{self.url.drivername} runs on SQLAlchemy's asyncio extension, which needs "
                f"greenlet: {ASYNC_INSTALL_HINT}"
            )
        return False

    def _engine_modes(
        self, engine: Engine, level: str | None = None
    ) -> tuple[Engine, Engine, Engine]:
        """The engine as used for reads, for writes, and for single autocommit statements.

        ``level``: the engine's connections run in autocommit; transactions
        run at this isolation level.
        """
        if level is not None:
            reads = engine.execution_options(isolation_level=level)
            return reads, reads.execution_options(chatflow_write=True), engine
        return (
            engine,
            engine.execution_options(chatflow_write=True),
            engine.execution_options(**self.support.autocommit_options()),
        )

    def check_open(self) -> None:
        """Raise ``RuntimeError`` if the store was closed."""
        if self.closed:
            raise RuntimeError("this session store is closed; open a new one")

    def connect(self, engine: Engine | None = None) -> Connection:
        """A connection of ``engine`` (the store's by default).

        Raises:
            DatabaseUnavailableError: No connection could be opened (the
                driver's ``OperationalError`` or ``InterfaceError``: refused,
                unreachable, unknown database, bad credentials; the message
                names host and database, never the password), or none of the
                pool's came free within its ``pool_timeout`` (each one waits
                on a database that stopped answering). Other errors (a file
                that is not a database, say) are SQLAlchemy's own.

        """
        try:
            return (engine or self.engine).connect()
        except (sa_exc.OperationalError, sa_exc.InterfaceError) as exc:
            raise _unavailable(self.url, exc) from exc
        except sa_exc.TimeoutError as exc:
            raise DatabaseUnavailableError(
                f"no connection to {describe(self.url)} came free within the pool's "
                f"pool_timeout: every one is still waiting on the database ({exc})"
            ) from exc

    def transaction(self, *, write: bool = False, single: bool = False) -> _Transaction:
        """One transaction; ``write`` takes the database's write lock up front.

        ``single`` is for one statement that is atomic on its own: it runs in
        the driver's autocommit mode, without BEGIN/COMMIT round trips.

        Inside :meth:`run_blocking` on a native-async store this code runs in
        a greenlet and uses the AsyncEngine's sync facade, so the very same
        statements execute on the async driver without a thread hop.

        Use it as ``with runtime.transaction() as conn:``; the connection is
        taken when the block is entered.
        """
        return _Transaction(self, _SINGLE if single else _WRITE if write else _READ)

    def _engine_for(self, mode: int) -> Engine:
        """The engine of ``mode`` (``_READ``...), on the sync facade inside :meth:`run_blocking`."""
        self.check_open()
        engines = self._aengines if self.in_async_facade() else self._engines
        assert engines is not None
        return engines[mode]

    def in_async_facade(self) -> bool:
        """True in :meth:`run_blocking`'s greenlet: use the AsyncEngine's sync facade."""
        return self.native_async and _IN_ASYNC_FACADE.get()

    async def run_blocking(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run blocking database work ``fn(*args)`` without blocking the event loop.

        On-disk databases use a private pool of threads owned by the store;
        in-memory SQLite runs directly on the loop, where a thread hop would
        cost more than the work; native-async stores run it in a greenlet.
        """
        if self.ephemeral:
            return fn(*args)
        runner = await self._greenlet_runner() if self.native_async else None
        if runner is not None:
            return await runner.run_sync(_on_async_facade, fn, *args)
        return await self._io_pool().run(fn, *args)

    def _make_async_engine(self, autocommit: bool = False) -> AsyncEngine:
        """The AsyncEngine with the store's options (``autocommit``: :meth:`_transaction_level`).

        Raises:
            BackendImportError: The async driver is not installed (names the extra).

        """
        from sqlalchemy.ext.asyncio import create_async_engine

        url = self.support.async_url(self.url)
        assert url is not None
        try:
            options = merged(self.support.engine_options(url), self._engine_options)
            if autocommit:  # see _transaction_level
                options["isolation_level"] = "AUTOCOMMIT"
                if url.get_backend_name() == "postgresql":
                    # The store has no hstore columns: without this, every new connection
                    # looks the type up in a transaction of its own (BEGIN ... COMMIT).
                    options.setdefault("use_native_hstore", False)
                    if _SKIPS_AUTOCOMMIT_ROLLBACK:
                        # The pool rolls back every connection it takes back, also after
                        # a commit; in autocommit psycopg has nothing to roll back, and
                        # the call still costs a hop into the driver's coroutine. Only a
                        # connection in autocommit skips it (one at another isolation
                        # level, after a transaction, is still rolled back).
                        options.setdefault("skip_autocommit_rollback", True)
            return create_async_engine(url, **options)
        except ImportError as exc:
            raise BackendImportError(
                f"{url.drivername} needs its async driver: {ASYNC_INSTALL_HINT} ({exc})"
            ) from exc

    async def _greenlet_runner(self) -> AsyncSession | None:
        """The running loop's way into SQLAlchemy's greenlet, or None: use the thread pool.

        ``AsyncSession.run_sync`` is SQLAlchemy's documented way to run a sync
        callable in its greenlet, where sync statements on the AsyncEngine's
        facade await the async driver. The session itself is never used for
        statements: it connects only when used, so it holds no connection
        while the callable checks out its own (unlike
        ``AsyncConnection.run_sync``, which holds one for the whole call).
        One is made per AsyncEngine and reused by every call, since building
        a session (and its ORM session) per call costs more than the hop.
        """
        runner, loop = self._arunner, asyncio.get_running_loop()
        owned = runner is not None and self._aloop is loop and not self.closed
        if owned and loop not in self._thread_loops:
            return runner  # the owning loop is running: no hand-over can happen meanwhile
        engine = await self._async_engine_for_loop()
        if engine is None:
            return None
        from sqlalchemy.ext.asyncio import AsyncSession

        with self._lock:
            if self._arunner is None or self._arunner.bind is not engine:
                self._arunner = AsyncSession(engine)
            return self._arunner

    async def _async_engine_for_loop(self) -> AsyncEngine | None:
        """The AsyncEngine for the running loop, or None: use the thread pool from this loop.

        Async connections belong to the loop that opened them, so the
        AsyncEngine serves one loop at a time. A store that outlives a loop
        (``Runner.run`` calls ``asyncio.run`` every time) hands it to the next
        loop once the old one is closed, after closing the old loop's idle
        connections. While the owning loop still runs (threads that each run
        their own loop over one store), other loops run their I/O on the
        store's threads, on the sync engine.
        """
        loop = asyncio.get_running_loop()
        if loop in self._thread_loops:
            return None
        with self._lock:
            self.check_open()
            owner = self._aloop
            if owner is not None and owner is not loop and not owner.is_closed():
                return None
            stale = owner is not None and owner is not loop
            self._aloop = loop
            engine = self._async_engine()
        if stale:
            await engine.dispose()
        return engine

    def keep_on_threads(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run ``loop``'s database work on the store's threads, never on the AsyncEngine.

        For a loop of the store's own that lives as long as the store (the
        summaries'): were it to take the AsyncEngine once the caller's loop
        closed, the caller's next loops would be left with the threads.
        """
        self._thread_loops.add(loop)

    def _io_pool(self) -> IOPool:
        with self._lock:
            self.check_open()
            if self.pool is None:
                self.pool = IOPool(self._io_workers, thread_name_prefix="chatflow-io")
            return self.pool

    def close(self) -> None:
        """Stop the thread pool and dispose the engines the store created."""
        self.closed = True
        with self._lock:
            pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if self.aengine is not None and self._aloop is not None:  # it has connections
            _dispose_from_sync_code(self.aengine)
        if self.owns_engine:
            self.engine.dispose()

    async def adispose_async_engine(self) -> None:
        """Close the AsyncEngine's connections if they belong to the running loop."""
        if self.aengine is not None and self._aloop is asyncio.get_running_loop():
            await self.aengine.dispose()


_BACKGROUND: set[asyncio.Task[None]] = set()


def _dispose_from_sync_code(engine: AsyncEngine) -> None:
    """Close an AsyncEngine's pool from sync code (``aclose`` is the clean way)."""
    loop = _running_loop()
    if loop is None:
        asyncio.run(engine.dispose())
        return
    task = loop.create_task(engine.dispose())
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


def _on_async_facade(_session: Any, fn: Callable[..., _T], *args: Any) -> _T:
    """Run ``fn`` marked as running on the AsyncEngine's sync facade (in a greenlet)."""
    token = _IN_ASYNC_FACADE.set(True)
    try:
        return fn(*args)
    finally:
        _IN_ASYNC_FACADE.reset(token)


def merged(defaults: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` engine options over the dialect's ``defaults``, ``connect_args`` key by key."""
    options = {**defaults, **given}
    if "connect_args" in defaults and "connect_args" in given:
        options["connect_args"] = {**defaults["connect_args"], **given["connect_args"]}
    return options


def create_store_engine(url: URL, options: Mapping[str, Any], install_hint: str) -> Engine:
    """``create_engine``; a missing driver names what to install, if there is a hint."""
    try:
        return create_engine(url, **options)
    except ImportError as exc:
        if not install_hint:
            raise
        raise BackendImportError(f"{install_hint} ({exc})") from exc


def require_transactions(runtime: StoreRuntime) -> None:
    """Refuse an engine whose connections run in autocommit mode.

    A turn is written in one transaction, so that a crash or a lost race
    never leaves half a turn; in autocommit every statement would commit on
    its own. (Single self-contained statements already run in autocommit.)
    It connects once, so an unreachable database fails here, clearly.

    Raises:
        ValueError: The engine runs in autocommit mode.
        DatabaseUnavailableError: The database cannot be reached.

    """
    autocommit = runtime.engine.get_execution_options().get("isolation_level") == "AUTOCOMMIT"
    if not autocommit:
        with runtime.guard, runtime.connect() as conn:
            autocommit = getattr(conn.connection.dbapi_connection, "autocommit", None) is True
    if autocommit:
        raise ValueError(
            "the engine's connections run in autocommit mode (isolation_level='AUTOCOMMIT'), "
            "so a turn could not be written atomically: open the store without it (the store "
            "runs single statements in autocommit by itself)"
        )
