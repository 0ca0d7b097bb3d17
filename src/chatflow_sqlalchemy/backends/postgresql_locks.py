"""PostgreSQL's turn locks: transaction-scoped advisory locks on an engine of their own.

A turn's lock is ``pg_try_advisory_xact_lock`` on :func:`session_lock_key`,
held by a transaction open on a connection of the lock engine (outside the
store's pool, so a turn waiting on a slow model pins no pooled connection)
and released by ``ROLLBACK``; the connection then serves the next turn.

**Every statement goes through SQLAlchemy.** The lock engine is an
``AsyncEngine`` (see :func:`lock_engine`), listed in ``store.engines``: its
events, ``echo`` and SQLAlchemy's instrumentation see the locks' statements
like the store's own. It runs in autocommit with client-side binding, so a
statement may open the transaction it leaves behind, and nothing is prepared
(a transaction-pooling PgBouncer carries no prepared statements).

**One round trip to take a lock and read the session's version.** The lock's
statement is ``SELECT ... FROM chatflow_turn_lock(...); BEGIN``, one
simple-protocol query. PostgreSQL runs it as one transaction, and the
``BEGIN`` that ends it turns that transaction into an open one (statements
before a ``BEGIN`` in one query belong to the transaction it opens), so the
lock outlives the query. ``chatflow_turn_lock`` (created by revision 0007)
sets the lease, tries the lock and, when it was taken, reads the session's
version in a snapshot of its own, taken after the lock: the version reflects
every turn committed before. It refuses any isolation level but READ
COMMITTED, where that snapshot would be older than the lock.

**A lease, not just a lock.** The transaction sets
``idle_in_transaction_session_timeout`` to the lease, so a worker that died
or was cut off by a network partition loses its lock after at most a lease
of silence: PostgreSQL ends the idle session, which releases the lock, even
when no TCP error ever reaches the server. A live turn keeps its lock by a
heartbeat (``SELECT 1``) every third of the lease. Transaction-scoped locks
also hold under a transaction-pooling PgBouncer, which session-level locks
do not.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import socket
import threading
from collections.abc import Awaitable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import URL, Engine, event, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.pool import NullPool

from chatflow_sqlalchemy.dialect import ConnectArguments
from chatflow_sqlalchemy.exceptions import DatabaseUnavailableError
from chatflow_sqlalchemy.runtime import describe

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

__all__ = [
    "LOCK_RELEASE_TIMEOUT_SECONDS",
    "TURN_LOCK_LEASE_SECONDS",
    "AdvisoryTurnLocks",
    "lock_engine",
    "session_lock_key",
]

logger = logging.getLogger("chatflow_sqlalchemy")

LOCK_RELEASE_TIMEOUT_SECONDS = 5.0
"""Bound of the ``ROLLBACK`` that releases a turn lock; a connection that does not answer
is closed instead, which releases the lock too."""

TURN_LOCK_LEASE_SECONDS = 30.0
"""A turn lock whose holder went silent is released by the server after this long
(``idle_in_transaction_session_timeout``); live holders renew it every third of it."""

_TAKE = text(
    "SELECT lock_taken, session_version "
    "FROM chatflow_turn_lock(CAST(:key AS bigint), :session_id, :lease_ms); BEGIN"
)
"""A turn lock's one round trip: the lock and the version, then the transaction kept open."""

_R = TypeVar("_R")

_PENDING: set[asyncio.Future[Any]] = set()
"""Lock calls that outlive a cancelled caller (strong references until they finish)."""


def _keep(future: asyncio.Future[_R]) -> asyncio.Future[_R]:
    _PENDING.add(future)
    future.add_done_callback(_PENDING.discard)
    return future


def session_lock_key(session_id: str) -> int:
    """A stable signed 64-bit advisory-lock key for a session id."""
    digest = hashlib.blake2b(session_id.encode(), digest_size=8, person=b"chatflow").digest()
    return int.from_bytes(digest, "big", signed=True)


def lock_engine(engine: Engine, fallback_connect_args: dict[str, Any]) -> AsyncEngine:
    """The AsyncEngine of ``engine``'s turn locks: its connections opened like ``engine``'s.

    ``NullPool``: the locks keep their idle connections themselves, per
    event loop (an async connection serves the loop that opened it). Each
    connection runs in autocommit, with psycopg's client-side binding
    (``AsyncClientCursor``): one query may then hold several statements and
    leave a transaction open, and nothing is prepared. ``echo`` and
    ``hide_parameters`` follow ``engine``.

    Args:
        engine: The store's engine.
        fallback_connect_args: Connect arguments until ``engine`` opened a
            connection (see :class:`~chatflow_sqlalchemy.dialect.ConnectArguments`).

    """
    import psycopg
    from sqlalchemy.ext.asyncio import create_async_engine

    arguments = ConnectArguments(engine, fallback_connect_args)
    locks = create_async_engine(
        engine.url.set(drivername="postgresql+psycopg"),
        poolclass=NullPool,
        isolation_level="AUTOCOMMIT",
        use_native_hstore=False,  # no hstore here: spares the type lookup of the first connect
        echo=engine.echo,
        hide_parameters=engine.hide_parameters,
    )

    @event.listens_for(locks.sync_engine, "do_connect")
    def _like_the_store(_dialect: Any, _record: Any, cargs: Any, cparams: Any) -> None:
        cargs[:] = arguments.args
        cparams.clear()
        cparams.update(arguments.params)
        cparams["cursor_factory"] = psycopg.AsyncClientCursor

    return locks


class _LockConnection:
    """A connection of the lock engine, its psycopg connection, and whether it is in use.

    psycopg's protocol generators keep libpq's connection pointer while they
    wait for the server, so libpq's memory must never be freed under a
    statement that is still waiting: that statement would resume on freed
    memory. :meth:`cut` therefore only shuts the socket down, and the
    connection is closed (libpq freed) once no statement waits on it.
    """

    __slots__ = ("busy", "driver", "loop", "sa", "was_cut")

    def __init__(self, sa: AsyncConnection, driver: Any) -> None:
        self.sa = sa
        self.driver = driver
        self.loop = asyncio.get_running_loop()
        self.busy = False
        self.was_cut = False

    @property
    def closed(self) -> bool:
        return bool(self.was_cut or self.sa.closed or self.sa.invalidated or self.driver.closed)

    @property
    def in_flight(self) -> bool:
        """A statement waits on this connection, in a loop that can still resume it."""
        return self.busy and not self.loop.is_closed()

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """Mark a statement on this connection, from its start until it has unwound."""
        self.busy = True
        try:
            yield
        finally:
            self.busy = False

    async def send(self, statement: str) -> None:
        """Run ``statement`` (a heartbeat, a ``ROLLBACK``), marked as in use until it ends."""
        with self.in_use():
            await self.sa.exec_driver_sql(statement)

    def cut(self) -> None:
        """Shut the socket down, no round trip: the server ends the session, freeing its locks.

        A statement still waiting on the connection then fails on the shut
        socket when it resumes.
        """
        self.was_cut = True
        with contextlib.suppress(Exception):
            borrowed = socket.socket(fileno=self.driver.fileno())
            try:
                borrowed.shutdown(socket.SHUT_RDWR)
            finally:
                borrowed.detach()  # the descriptor stays psycopg's


async def _discard(connections: Iterable[_LockConnection]) -> None:
    """Cut the sockets, then close what no statement waits on (a waiting one closes itself)."""
    for conn in connections:
        conn.cut()
        if conn.in_flight:
            continue  # its statement fails on the shut socket, and its failure discards it
        with contextlib.suppress(Exception):
            await conn.sa.invalidate()
            await conn.sa.close()


def _discard_soon(connections: list[_LockConnection]) -> None:
    """:func:`_discard` from sync code: cut now; SQLAlchemy's part on a loop, if one runs."""
    if not connections:
        return
    for conn in connections:
        conn.cut()
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # sync code: a private loop, the thread's own left as it was
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(_discard(connections))
        finally:
            loop.close()
    else:
        _keep(asyncio.ensure_future(_discard(connections)))


async def _bounded_on(conn: _LockConnection, call: Awaitable[_R], seconds: float) -> _R:
    """``call`` on ``conn``, given at most ``seconds``; past them the socket is shut down.

    ``asyncio.wait_for`` would cancel the call, and psycopg answers a
    cancelled query by asking the server to cancel it and waiting for that:
    into a network that does not answer, seconds past the bound. A shut
    socket ends the call at once, and the server frees the connection's locks.

    Raises:
        asyncio.TimeoutError: No answer within ``seconds`` (the connection is cut).

    """
    expired: list[bool] = []

    def expire() -> None:
        expired.append(True)
        conn.cut()

    timer = asyncio.get_running_loop().call_later(seconds, expire)
    try:
        result = await call
    except Exception as exc:
        if expired:
            raise asyncio.TimeoutError from exc
        raise
    finally:
        timer.cancel()
    if expired:  # answered as the bound ran out: the connection is cut all the same
        raise asyncio.TimeoutError
    return result


class _Held:
    """A turn lock being held: its connection (in a transaction) and its heartbeat."""

    __slots__ = ("conn", "heartbeat", "stop", "use")

    def __init__(self, conn: _LockConnection) -> None:
        self.conn = conn
        self.stop = asyncio.Event()
        self.use = asyncio.Lock()
        self.heartbeat: asyncio.Future[None] | None = None


class _LoopLocks:
    """The lock connections of one event loop: idle, held, being released, distrusted."""

    __slots__ = ("distrusted", "held", "idle", "releasing")

    def __init__(self) -> None:
        self.idle: list[_LockConnection] = []
        self.held: dict[str, _Held] = {}
        self.releasing: set[_LockConnection] = set()
        self.distrusted: set[str] = set()

    def abandon(self) -> list[_LockConnection]:
        """Cut every socket at once (the loop is gone; the server frees the locks)."""
        idle, self.idle = self.idle, []
        held = list(self.held.values())
        releasing, self.releasing = self.releasing, set()
        self.held = {}
        self.distrusted.clear()
        gone = [*idle, *(lock.conn for lock in held), *releasing]
        for conn in gone:
            conn.cut()
        for lock in held:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits
                lock.stop.set()
        return gone


class AdvisoryTurnLocks:
    """Transaction-scoped advisory locks for turns, one lock connection per held lock.

    Every call on a lock connection is bounded by ``call_timeout`` seconds
    (``release`` by :data:`LOCK_RELEASE_TIMEOUT_SECONDS`); a connection that
    did not answer is closed (which also gives its lock back). See the
    module's docstring for the statements and the lease.

    Args:
        engine: The lock engine (:func:`lock_engine`).
        lease_seconds: The lease (:data:`TURN_LOCK_LEASE_SECONDS`).
        call_timeout: Bound of each call on a lock connection.
        url: The store's URL, named (without password) by errors.

    """

    max_idle_connections = 4
    """Lock connections kept open between turns (more are closed after use)."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        lease_seconds: float = TURN_LOCK_LEASE_SECONDS,
        call_timeout: float,
        url: URL | None = None,
    ) -> None:
        self._engine = engine
        self.url = url
        self.lease_seconds = lease_seconds
        self.call_timeout = call_timeout
        self._loops: dict[asyncio.AbstractEventLoop, _LoopLocks] = {}
        self._loops_lock = threading.Lock()
        self._first_connection: concurrent.futures.Future[None] | None = None
        self._initialised = False
        self._closed = False

    @property
    def engines(self) -> tuple[Engine, ...]:
        """The lock engine's sync facade, where engine events see the locks' statements."""
        return (self._engine.sync_engine,)

    def _here(self) -> _LoopLocks:
        """The lock connections of the running loop (psycopg async connections are per loop).

        Threads that each run their own loop over one store each get their
        own; a lock taken in one loop is never touched from another. Those of
        closed loops are dropped (closing their sockets frees their locks).
        """
        loop = asyncio.get_running_loop()
        gone: list[_LockConnection] = []
        with self._loops_lock:
            here = self._loops.get(loop)
            if here is None:
                for old in [old for old in self._loops if old.is_closed()]:
                    gone += self._loops.pop(old).abandon()
                here = self._loops[loop] = _LoopLocks()
        _discard_soon(gone)
        return here

    async def _take(self) -> _LockConnection:
        idle = self._here().idle
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
            _discard_soon([conn])
        sa = await self._connect()
        try:
            raw = await sa.get_raw_connection()
        except BaseException:
            await sa.close()
            raise
        return _LockConnection(sa, raw.driver_connection)

    async def _connect(self) -> AsyncConnection:
        """A new connection of the lock engine, once its dialect is initialised."""
        if not self._initialised:
            # Shielded: a caller that gives up leaves the first connection to finish.
            await asyncio.shield(asyncio.wrap_future(self._initialise()))
        return await self._engine.connect()

    def _initialise(self) -> concurrent.futures.Future[None]:
        """The engine's first connection, made once on a thread and event loop of its own.

        SQLAlchemy initialises the dialect on an engine's first connection
        under an asyncio mutex. A caller's loop closed half-way through would
        leave that mutex held for good, and every later connection would wait
        on it; a loop of the locks' own always runs the connection to its end.
        A failed attempt (the server down) is retried by the next caller.
        """
        with self._loops_lock:
            first = self._first_connection
            if first is None or (first.done() and first.exception() is not None):
                first = self._first_connection = concurrent.futures.Future()
                threading.Thread(
                    target=self._first_connect, args=(first,),
                    name="chatflow-lock-engine-init", daemon=True,
                ).start()
            return first

    def _first_connect(self, done: concurrent.futures.Future[None]) -> None:
        async def connect_once() -> None:
            conn = await self._engine.connect()
            await conn.close()

        try:
            asyncio.run(connect_once())
        except BaseException as exc:
            done.set_exception(exc)
        else:
            self._initialised = True
            done.set_result(None)

    def _put(self, conn: _LockConnection) -> None:
        if self._closed:  # closed while this connection was in use: nothing keeps it
            _discard_soon([conn])
            return
        idle = self._here().idle
        if conn.closed or len(idle) >= self.max_idle_connections:
            _discard_soon([conn])
        else:
            idle.append(conn)

    async def try_acquire(self, session_id: str) -> tuple[bool, bool, int | None]:
        """:meth:`try_acquire_reading_version` as the :class:`TurnLocks` protocol has it.

        Raises:
            DatabaseUnavailableError: The server failed or did not answer in ``call_timeout``.

        """
        try:
            taken, version = await self.try_acquire_reading_version(session_id)
        except (sa_exc.OperationalError, sa_exc.InterfaceError) as exc:
            raise _lock_unavailable(session_id, self.url, exc) from exc
        except sa_exc.DBAPIError as exc:
            if not exc.connection_invalidated:
                raise
            raise _lock_unavailable(session_id, self.url, exc) from exc
        except asyncio.TimeoutError as exc:
            reason = f"no answer within {self.call_timeout:g} s"
            raise _lock_unavailable(session_id, self.url, exc, reason) from exc
        return taken, True, version

    async def try_acquire_reading_version(self, session_id: str) -> tuple[bool, int | None]:
        """Try the lock and read the session's version in one round trip.

        The version is read after the lock was taken and reflects every turn
        committed before. It is meaningless when the lock was not taken.

        Raises:
            asyncio.TimeoutError: The server did not answer within ``call_timeout``.
            sqlalchemy.exc.DBAPIError: The connection or the statement failed.

        """
        task = _keep(asyncio.ensure_future(self._attempt(session_id)))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # The caller gave up, but the call goes on: a lock it takes must be given
            # back, or the session stays locked until the lease runs out.
            task.add_done_callback(lambda done: self._give_back(session_id, done))
            raise

    def _give_back(self, session_id: str, done: asyncio.Future[tuple[bool, int | None]]) -> None:
        if done.cancelled() or done.exception() is not None or not done.result()[0]:
            return
        _keep(asyncio.ensure_future(self.release(session_id)))

    async def _attempt(self, session_id: str) -> tuple[bool, int | None]:
        conn = await asyncio.wait_for(self._take(), self.call_timeout)
        try:
            taken, version = await _bounded_on(
                conn, self._lock_in_transaction(conn, session_id), self.call_timeout
            )
        except BaseException:
            _discard_soon([conn])
            raise
        if self._closed:  # closed while the lock was being taken: give it back at once
            _discard_soon([conn])
            raise RuntimeError("the turn locks were closed (the store is closed)")
        if not taken:
            self._put(conn)
            return False, None
        held = _Held(conn)
        held.heartbeat = _keep(asyncio.ensure_future(self._beat(session_id, held)))
        self._here().held[session_id] = held
        return True, version

    async def _lock_in_transaction(
        self, conn: _LockConnection, session_id: str
    ) -> tuple[bool, int | None]:
        """The lease, the lock, the version, the open transaction; a lock not taken ends it."""
        lease_ms = str(max(1, round(self.lease_seconds * 1000)))
        params = {"key": session_lock_key(session_id), "session_id": session_id,
                  "lease_ms": lease_ms}
        with conn.in_use():
            taken, version = (await conn.sa.execute(_TAKE, params)).one()
            if not taken:
                await conn.sa.exec_driver_sql("ROLLBACK")
                return False, None
        return True, (None if version is None else int(version))

    async def _beat(self, session_id: str, held: _Held) -> None:
        """Keep the lease alive while the turn runs; a silent connection is closed."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(held.stop.wait(), self.lease_seconds / 3)
                return
            async with held.use:
                if held.stop.is_set():
                    return
                try:
                    await _bounded_on(held.conn, held.conn.send("SELECT 1"), self.call_timeout)
                except Exception as exc:
                    logger.warning(
                        "the turn lock of session %r was lost (%s); the turn's write is still "
                        "checked against concurrent writers", session_id, type(exc).__name__,
                    )
                    _discard_soon([held.conn])
                    return
                if held.conn.was_cut:  # cut meanwhile (the store closing): closed here
                    _discard_soon([held.conn])
                    return

    async def release(self, session_id: str) -> None:
        """Release the session's lock (``ROLLBACK``); a lost connection already released it.

        It returns once the server answered, so the lock is free for every
        process by then. Shielded: a caller cancelled meanwhile does not stop
        the unlock. A ``ROLLBACK`` that fails or gets no answer within
        :data:`LOCK_RELEASE_TIMEOUT_SECONDS` cuts the connection instead,
        which frees the lock too.
        """
        here = self._here()
        held = here.held.pop(session_id, None)
        if held is None:
            return
        held.stop.set()
        if session_id in here.distrusted:
            here.distrusted.discard(session_id)
            _discard_soon([held.conn])  # no round trip into a frozen network: closing releases
            return
        here.releasing.add(held.conn)  # where close() finds it meanwhile, to cut it
        with contextlib.suppress(Exception):
            await asyncio.shield(_keep(asyncio.ensure_future(self._end(held, here.releasing))))

    async def _end(self, held: _Held, releasing: set[_LockConnection]) -> None:
        try:
            async with held.use:
                await _bounded_on(held.conn, held.conn.send("ROLLBACK"),
                                  LOCK_RELEASE_TIMEOUT_SECONDS)
        except BaseException:
            _discard_soon([held.conn])
            raise
        finally:
            releasing.discard(held.conn)
        self._put(held.conn)

    def held(self) -> list[str]:
        """Sessions whose lock this process holds now (in every event loop)."""
        with self._loops_lock:
            return [session for state in self._loops.values() for session in state.held]

    def distrust(self) -> None:
        """Release the locks held now by closing their connections, not by ``ROLLBACK``.

        For when the network looks frozen: a ``ROLLBACK`` would wait for an
        answer first; a closed connection's lock is freed by the server at
        once, or at the latest when its lease ends.
        """
        with self._loops_lock:
            for state in self._loops.values():
                state.distrusted.update(state.held)

    async def aclose(self) -> None:
        """Close every lock connection, releasing every lock."""
        self._closed = True
        with self._loops_lock:
            loops, self._loops = self._loops, {}
        gone = [conn for state in loops.values() for conn in state.abandon()]
        await _discard(gone)
        await self._engine.dispose()

    def close(self) -> None:
        """Close from sync code: cut the sockets (the server releases the locks)."""
        self._closed = True
        with self._loops_lock:
            loops, self._loops = self._loops, {}
        _discard_soon([conn for state in loops.values() for conn in state.abandon()])


def _lock_unavailable(
    session_id: str, url: URL | None, exc: BaseException, reason: str | None = None
) -> DatabaseUnavailableError:
    if reason is None:
        cause = getattr(exc, "orig", None) or exc
        reason = str(cause).strip().splitlines()[0] if str(cause).strip() else repr(cause)
    where = "" if url is None else f" on {describe(url)}"
    return DatabaseUnavailableError(
        f"cannot take the turn lock of session {session_id!r}{where}: {reason}"
    )
