"""PostgreSQL backend on psycopg 3.

What differs from the generic store: ``postgresql://`` URLs are mapped to the
psycopg 3 driver, dedup claims and session creation use ``ON CONFLICT``,
session rows are locked with ``SELECT ... FOR UPDATE`` during a write, and
migrations are serialised across processes with a transaction-scoped
advisory lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar, cast

from sqlalchemy import URL, Connection, CursorResult, Engine, Select, bindparam, make_url, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.dml import Insert
from sqlalchemy.sql.schema import Table

from chatflow_sqlalchemy.backends import postgresql_claims as pg_claims
from chatflow_sqlalchemy.backends import postgresql_write
from chatflow_sqlalchemy.crypto import AESGCMCipher
from chatflow_sqlalchemy.dialect import (
    RECLAIMED_AS_DONE,
    AcquiredClaim,
    ConnectArguments,
    DialectSupport,
    SessionWrite,
    TurnLocks,
    on_conflict_acquire,
    ping_when_idle,
)
from chatflow_sqlalchemy.exceptions import BackendImportError, DatabaseUnavailableError
from chatflow_sqlalchemy.models import UTCDateTime
from chatflow_sqlalchemy.runtime import describe
from chatflow_sqlalchemy.store import DEFAULT_DEDUP_TTL_HOURS, SQLAlchemySessionStore

if TYPE_CHECKING:  # the asyncio extension needs greenlet: imported only where it is used
    import psycopg
else:
    try:
        import psycopg
    except ImportError:  # the class stays importable; opening a store names the extra
        psycopg = None

__all__ = [
    "CONNECT_TIMEOUT_SECONDS",
    "INSTALL_HINT",
    "LOCK_RELEASE_TIMEOUT_SECONDS",
    "MIGRATION_LOCK_KEY",
    "OPERATION_TIMEOUT_SECONDS",
    "PREPARE_THRESHOLD",
    "TCP_OPTIONS",
    "TURN_LOCK_LEASE_SECONDS",
    "AdvisoryTurnLocks",
    "PostgresDialectSupport",
    "PostgresSessionStore",
    "default_connect_args",
    "jsonb_dumps",
    "psycopg_url",
    "session_lock_key",
]

INSTALL_HINT = "PostgreSQL needs psycopg 3: pip install 'chatflow-sqlalchemy[postgres]'"
"""What to install when psycopg is missing (the ``postgres`` extra)."""

MIGRATION_LOCK_KEY = 0x63686174666C6F77 & 0x7FFFFFFFFFFFFFFF
"""Advisory lock key ("chatflow") held while migrations run."""

CONNECT_TIMEOUT_SECONDS = 10
"""libpq ``connect_timeout`` unless the URL or ``connect_args`` set one: how long opening
a connection (TCP, TLS, startup and authentication) may take before it fails."""

TCP_OPTIONS: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}
"""libpq TCP settings of every connection, unless the URL or ``connect_args`` set them.

Against a real network partition (packets dropped) a connection waiting on
the server fails after about 30 s instead of TCP's ~15 minutes. They cannot
help when something still acknowledges the packets (a hung proxy): that is
what :data:`OPERATION_TIMEOUT_SECONDS` bounds.
"""

PREPARE_THRESHOLD: int | None = None
"""psycopg's ``prepare_threshold`` unless ``connect_args`` set one: None prepares nothing.

A transaction-pooling PgBouncer (also RDS Proxy, Supavisor) gives each
transaction whichever server connection is free, where a statement prepared
by an earlier transaction is missing or, under the same name, another one
(``DuplicatePreparedStatement: prepared statement "_pg3_0" already exists``).
Everything else the store does is transaction-scoped, so with this default
it needs no setting behind a pooler. Connected straight to the server,
``connect_args={"prepare_threshold": 5}`` (psycopg's default) turns
preparing back on.
"""

OPERATION_TIMEOUT_SECONDS = 15.0
"""Bound of each async store operation and each turn-lock call (the default of
``PostgresSessionStore.operation_timeout``)."""

LOCK_RELEASE_TIMEOUT_SECONDS = 5.0
"""Bound of the ``ROLLBACK`` that releases a turn lock; a connection that does not answer
is closed instead, which releases the lock too."""

TURN_LOCK_LEASE_SECONDS = 30.0
"""A turn lock whose holder went silent is released by the server after this long
(``idle_in_transaction_session_timeout``); live holders renew it every third of it."""

logger = logging.getLogger("chatflow_sqlalchemy")


def psycopg_url(url: str | URL) -> URL:
    """Map ``postgresql://`` / ``postgres://`` URLs to the psycopg 3 driver."""
    parsed = make_url(str(url).replace("postgres://", "postgresql://", 1)
                      if isinstance(url, str) else url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def default_connect_args(url: URL, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The timeouts, TCP settings and psycopg options that neither ``url`` nor ``given`` set.

    Then ``given`` on top.

    ``connect_args`` win over the URL's query in SQLAlchemy, so a default is
    only added where the user's URL does not name the parameter. psycopg's
    ``prepare_threshold`` is None (:data:`PREPARE_THRESHOLD`): no server-side
    prepared statements, so the store works unchanged behind a
    transaction-pooling PgBouncer.
    """
    given = dict(given or {})
    defaults: dict[str, Any] = {
        "connect_timeout": CONNECT_TIMEOUT_SECONDS,
        **TCP_OPTIONS,
        "prepare_threshold": PREPARE_THRESHOLD,
    }
    chosen = {k: v for k, v in defaults.items() if k not in url.query and k not in given}
    return {**chosen, **given}


def jsonb_dumps(value: Any) -> str:
    """``json.dumps`` for ``jsonb``, writing integral floats so they read back as floats.

    ``jsonb`` keeps numbers as ``numeric``, which prints ``4.417402109863705e+16``
    back as ``44174021098637050``: an int to every JSON reader. Python writes
    every float from 1e16 up in exponent form; those are written out in full
    with a trailing ``.0`` instead (``numeric`` keeps that scale), which reads
    back as the same float. Everything else is exactly ``json.dumps``.
    """
    floats: list[float] = []
    _collect_exponent_integral_floats(value, floats)
    if not floats:
        return json.dumps(value)
    marker = f"chatflow-float-{uuid.uuid4().hex}-"
    numbers: dict[str, str] = {}

    def replace(item: Any) -> Any:
        if isinstance(item, float) and _exponent_integral(item):
            key = f"{marker}{len(numbers)}"
            numbers[json.dumps(key)] = f"{int(item)}.0"
            return key
        if isinstance(item, dict):
            return {k: replace(v) for k, v in item.items()}
        if isinstance(item, (list, tuple)):
            return [replace(v) for v in item]
        return item

    text = json.dumps(replace(value))
    for placeholder, number in numbers.items():
        text = text.replace(placeholder, number)
    return text


def _exponent_integral(number: float) -> bool:
    return math.isfinite(number) and number.is_integer() and "e" in float.__repr__(number)


def _collect_exponent_integral_floats(value: Any, found: list[float]) -> None:
    if isinstance(value, float):
        if _exponent_integral(value):
            found.append(value)
    elif isinstance(value, dict):
        for item in value.values():
            _collect_exponent_integral_floats(item, found)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect_exponent_integral_floats(item, found)


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


_LOCK_AND_READ_VERSION = (
    "BEGIN ISOLATION LEVEL READ COMMITTED; "
    "SELECT set_config('idle_in_transaction_session_timeout', %s, true); "
    "SELECT pg_try_advisory_xact_lock(%s); "
    "SELECT version FROM chatflow_sessions WHERE session_id = %s"
)
"""A turn lock's first round trip; each statement reads its own snapshot, so the version
is read after the lock was taken."""


class _Held:
    """A turn lock being held: its connection (in a transaction) and its heartbeat."""

    __slots__ = ("conn", "heartbeat", "stop", "use")

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn
        self.stop = asyncio.Event()
        self.use = asyncio.Lock()
        self.heartbeat: asyncio.Future[None] | None = None


class _LoopLocks:
    """The lock connections of one event loop: idle ones, held locks, distrusted locks."""

    __slots__ = ("distrusted", "held", "idle")

    def __init__(self) -> None:
        self.idle: list[psycopg.AsyncConnection[Any]] = []
        self.held: dict[str, _Held] = {}
        self.distrusted: set[str] = set()

    def abandon(self) -> None:
        """Close every socket at once (the loop is gone; the server frees the locks)."""
        idle, self.idle = self.idle, []
        held, self.held = self.held, {}
        self.distrusted.clear()
        for conn in idle:
            _finish(conn)
        for lock in held.values():
            lock.stop.set()
            _finish(lock.conn)


class AdvisoryTurnLocks:
    """Transaction-scoped advisory locks for turns, one lock connection per held lock.

    A turn's lock is ``pg_try_advisory_xact_lock`` taken in a transaction
    opened on a connection of the store's own (outside the SQLAlchemy pool,
    so a turn that waits on a slow model pins no pooled connection) and
    released by ``ROLLBACK``; the connection then serves the next turn.

    Why a transaction and not a session-level lock: the transaction sets
    ``idle_in_transaction_session_timeout`` to ``lease_seconds``, so a worker
    that died or was cut off by a network partition loses its lock after at
    most ``lease_seconds`` of silence: PostgreSQL ends the idle session, which
    releases the lock, even when no TCP error ever reaches the server. A live
    turn keeps its lock by a heartbeat (``SELECT 1``) every third of the
    lease. Transaction-scoped locks also hold under a transaction-pooling
    PgBouncer, which session-level locks do not.

    Every call on a lock connection is bounded by ``call_timeout`` seconds
    (``release`` by :data:`LOCK_RELEASE_TIMEOUT_SECONDS`); a connection that
    did not answer is closed (which also gives its lock back).
    """

    max_idle_connections = 4
    """Lock connections kept open between turns (more are closed after use)."""

    def __init__(
        self,
        connect: Callable[[], Awaitable[psycopg.AsyncConnection[Any]]],
        *,
        lease_seconds: float = TURN_LOCK_LEASE_SECONDS,
        call_timeout: float = OPERATION_TIMEOUT_SECONDS,
        url: URL | None = None,
    ) -> None:
        self._connect = connect
        self.url = url
        self.lease_seconds = lease_seconds
        self.call_timeout = call_timeout
        self._loops: dict[asyncio.AbstractEventLoop, _LoopLocks] = {}
        self._loops_lock = threading.Lock()

    def _here(self) -> _LoopLocks:
        """The lock connections of the running loop (psycopg async connections are per loop).

        Threads that each run their own loop over one store each get their
        own; a lock taken in one loop is never touched from another. Those of
        closed loops are dropped (closing their sockets frees their locks).
        """
        loop = asyncio.get_running_loop()
        with self._loops_lock:
            here = self._loops.get(loop)
            if here is None:
                for gone in [old for old in self._loops if old.is_closed()]:
                    self._loops.pop(gone).abandon()
                here = self._loops[loop] = _LoopLocks()
            return here

    @property
    def _idle(self) -> list[psycopg.AsyncConnection[Any]]:
        return self._here().idle

    @property
    def _held(self) -> dict[str, _Held]:
        return self._here().held

    @property
    def _distrusted(self) -> set[str]:
        return self._here().distrusted

    def _abandon_all(self) -> None:
        with self._loops_lock:
            loops, self._loops = self._loops, {}
        for state in loops.values():
            state.abandon()

    async def _take(self) -> psycopg.AsyncConnection[Any]:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        return await self._connect()

    def _put(self, conn: psycopg.AsyncConnection[Any]) -> None:
        if conn.closed or len(self._idle) >= self.max_idle_connections:
            _finish(conn)
        else:
            self._idle.append(conn)

    async def try_acquire(self, session_id: str) -> tuple[bool, bool, int | None]:
        """:meth:`try_acquire_reading_version` as the :class:`TurnLocks` protocol has it.

        Raises:
            DatabaseUnavailableError: The server failed or did not answer in ``call_timeout``.

        """
        try:
            taken, version = await self.try_acquire_reading_version(session_id)
        except psycopg.OperationalError as exc:
            raise _lock_unavailable(session_id, self.url, exc) from exc
        except asyncio.TimeoutError as exc:
            reason = f"no answer within {self.call_timeout:g} s"
            raise _lock_unavailable(session_id, self.url, exc, reason) from exc
        return taken, True, version

    async def try_acquire_reading_version(self, session_id: str) -> tuple[bool, int | None]:
        """Try the lock and read the session's version in one round trip.

        The server runs the statements in order, each in its own snapshot
        (``READ COMMITTED``), so the version is read after the lock was taken
        and reflects every turn committed before. It is meaningless when the
        lock was not taken.

        Raises:
            asyncio.TimeoutError: The server did not answer within ``call_timeout``.
            psycopg.OperationalError: The connection failed.

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
        conn = await self._take()
        try:
            taken, version = await asyncio.wait_for(
                self._lock_in_transaction(conn, session_id), self.call_timeout
            )
        except BaseException:
            _finish(conn)
            raise
        if not taken:
            self._put(conn)
            return False, None
        held = _Held(conn)
        held.heartbeat = _keep(asyncio.ensure_future(self._beat(session_id, held)))
        self._held[session_id] = held
        return True, version

    async def _lock_in_transaction(
        self, conn: psycopg.AsyncConnection[Any], session_id: str
    ) -> tuple[bool, int | None]:
        """BEGIN, the lease, the lock, the version; a lock not taken ends the transaction.

        One simple-protocol query of four statements (one round trip), bound
        client-side. Not a psycopg pipeline: a pipeline's trailing flush
        leaves the server without its idle-in-transaction timer, and the
        lease would never run out.
        """
        lease_ms = str(max(1, round(self.lease_seconds * 1000)))
        cursor = psycopg.AsyncClientCursor(conn)
        params = (lease_ms, session_lock_key(session_id), session_id)
        await cursor.execute(_LOCK_AND_READ_VERSION, params)
        results: list[Any] = []
        while True:
            results.append(await cursor.fetchone() if cursor.description else None)
            if not cursor.nextset():
                break
        taken, row = results[2], results[3]
        if not (taken and taken[0]):
            await conn.execute("ROLLBACK")
            return False, None
        return True, (None if row is None else int(row[0]))

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
                    await asyncio.wait_for(held.conn.execute("SELECT 1"), self.call_timeout)
                except Exception as exc:
                    logger.warning(
                        "the turn lock of session %r was lost (%s); the turn's write is still "
                        "checked against concurrent writers", session_id, type(exc).__name__,
                    )
                    _finish(held.conn)
                    return

    async def release(self, session_id: str) -> None:
        """Release the session's lock (``ROLLBACK``); a lost connection already released it.

        Shielded: a caller cancelled meanwhile does not stop the unlock.
        """
        held = self._held.pop(session_id, None)
        if held is None:
            return
        held.stop.set()
        if session_id in self._distrusted:
            self._distrusted.discard(session_id)
            _finish(held.conn)  # no round trip into a frozen network: closing releases too
            return
        with contextlib.suppress(Exception):
            await asyncio.shield(_keep(asyncio.ensure_future(self._end(held))))

    async def _end(self, held: _Held) -> None:
        async with held.use:
            try:
                await asyncio.wait_for(
                    held.conn.execute("ROLLBACK"), LOCK_RELEASE_TIMEOUT_SECONDS
                )
            except BaseException:
                _finish(held.conn)
                raise
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
        loop = asyncio.get_running_loop()
        with self._loops_lock:
            loops, self._loops = self._loops, {}
        here = loops.pop(loop, None)
        for state in loops.values():
            state.abandon()
        if here is None:
            return
        idle, held = here.idle, here.held
        for lock in held.values():
            lock.stop.set()
        for conn in [*idle, *(lock.conn for lock in held.values())]:
            try:
                await asyncio.wait_for(conn.close(), LOCK_RELEASE_TIMEOUT_SECONDS)
            except (Exception, asyncio.TimeoutError):
                _finish(conn)

    def close(self) -> None:
        """Close from sync code: drop the sockets (the server releases the locks)."""
        self._abandon_all()


def _finish(conn: psycopg.AsyncConnection[Any]) -> None:
    """Close a connection's socket at once, without a round trip."""
    with contextlib.suppress(Exception):
        conn.pgconn.finish()


def _processed_row() -> dict[str, Any]:
    """The values of a dedup row inserted by id (its day read under the id's lock)."""
    now = bindparam("processed_at", type_=UTCDateTime())
    return {
        "message_id": bindparam("message_id"),
        "processed_at": now,
        "partition_day": pg_claims.claim_day(now),
    }


class PostgresDialectSupport(DialectSupport):
    """PostgreSQL specifics: ``ON CONFLICT`` upserts, row locks, advisory locks."""

    name = "postgresql"
    install_hint = INSTALL_HINT
    cross_process_turn_lock = True
    expires_processed_whole = True

    def engine_options(self, url: URL) -> dict[str, Any]:
        """A pool of 10 (+10 overflow); idle connections are pinged (:meth:`prepare_engine`).

        ``json_serializer`` keeps metadata floats floats through ``jsonb``
        (see :func:`jsonb_dumps`); ``connect_args`` bound connecting
        (:data:`CONNECT_TIMEOUT_SECONDS`) and a partitioned network
        (:data:`TCP_OPTIONS`), except where the URL's query sets them.
        """
        return {
            "pool_size": 10,
            "max_overflow": 10,
            "json_serializer": jsonb_dumps,
            "connect_args": default_connect_args(url),
        }

    def prepare_engine(self, engine: Engine) -> None:
        """Ping connections idle for over a second, so a restarted server is survived.

        Not every checkout (``pool_pre_ping``): that is a round trip per
        statement group, several per turn. See :func:`ping_when_idle`.
        """
        ping_when_idle(engine)

    def turn_locks(self, engine: Engine) -> TurnLocks | None:
        """:class:`AdvisoryTurnLocks` on psycopg async connections opened like ``engine``'s.

        Raises:
            BackendImportError: psycopg is not installed.

        """
        if psycopg is None:
            raise BackendImportError(INSTALL_HINT)
        arguments = ConnectArguments(engine, default_connect_args(engine.url))

        async def connect() -> psycopg.AsyncConnection[Any]:
            return await psycopg.AsyncConnection.connect(
                *arguments.args, **{**arguments.params, "autocommit": True}
            )

        return AdvisoryTurnLocks(connect, url=engine.url)

    def async_url(self, url: URL) -> URL | None:
        """Async work runs natively on psycopg 3's async driver (no thread hop)."""
        return psycopg_url(url)

    def insert_ignore(self, table: Table) -> Insert:
        """``INSERT ... ON CONFLICT DO NOTHING``."""
        return pg_insert(table).on_conflict_do_nothing()

    def claim_processed(self, table: Table) -> Insert:
        """Insert the id, or take over an expired claim; a live claim changes nothing.

        The id's row may sit in any day partition: its day comes from
        ``chatflow_claim_day`` (:mod:`.postgresql_claims`).
        """
        stmt = pg_insert(table).values(_processed_row())
        return stmt.on_conflict_do_update(
            index_elements=[table.c.message_id, table.c.partition_day],
            set_={"processed_at": stmt.excluded.processed_at, **RECLAIMED_AS_DONE},
            where=table.c.processed_at < bindparam("cutoff", type_=UTCDateTime()),
        ).returning(table.c.message_id)

    def acquire_claim(self, table: Table) -> Insert:
        """``ON CONFLICT DO UPDATE ... WHERE ... RETURNING`` in autocommit.

        The ticket is drawn under the session's lock; ``RETURNING`` gives it,
        whether a claim with a smaller one is in flight, and the session's
        version (:mod:`.postgresql_claims`).
        """
        day = pg_claims.claim_day(bindparam("now", type_=UTCDateTime()))
        acquire = on_conflict_acquire(pg_insert, table, self.claim_ticket(table), day)
        return acquire.returning(pg_claims.claim_waits(table), pg_claims.session_version(table))

    def read_claim(self, result: CursorResult[Any]) -> AcquiredClaim:
        """The ticket, the look for earlier claims and the session's version, off one row.

        The version serves the claim block's first ``get_or_create``; the turn
        lock reads it again, so a session written or deleted elsewhere since
        is caught up with, or raises ``SessionDeletedError``, before the turn.
        """
        row = result.first()
        if row is None:
            return AcquiredClaim(False)
        ticket, earlier, version = tuple(row)
        return AcquiredClaim(True, ticket, bool(earlier), True, version)

    def claim_ticket(self, table: Table) -> Any:
        """``chatflow_claim_ticket(session_id)``: ``nextval`` under the session's lock."""
        return pg_claims.claim_ticket()

    def upsert_processed(self, table: Table) -> Insert:
        """Insert the id or move its timestamp to now."""
        stmt = pg_insert(table).values(_processed_row())
        return stmt.on_conflict_do_update(
            index_elements=[table.c.message_id, table.c.partition_day],
            set_={"processed_at": stmt.excluded.processed_at},
        )

    def drop_expired_processed(
        self, connection: Connection, cutoff: datetime, now: datetime
    ) -> int:
        """Drop the expired day partitions, keep a week of them ready."""
        return pg_claims.drop_expired_days(connection, cutoff, now)

    def lock_session_row(self, select: Select[Any]) -> Select[Any]:
        """``FOR NO KEY UPDATE``: excludes other writers of the row, not foreign-key checks.

        The lock the compare-and-swap UPDATE itself takes: message inserts
        (their foreign-key check takes ``KEY SHARE``) are not held up by it.
        """
        return select.with_for_update(key_share=True)

    def write_at_once(
        self, connection: Connection, write: SessionWrite
    ) -> tuple[bool, bool] | None:
        """The swap, the message diff and the fence as one statement (``WITH`` clauses)."""
        return postgresql_write.write_at_once(connection, write)

    @contextmanager
    def hold_turns(
        self, connection: Connection, session_ids: Sequence[str], turn_locks: TurnLocks | None
    ) -> Iterator[set[str]]:
        """Try each session's turn lock in the sweep's transaction; a held one is busy.

        ``pg_try_advisory_xact_lock`` on the key :class:`AdvisoryTurnLocks`
        takes for a turn: a lock taken here is held until the sweep commits,
        so no turn starts on a session while it is being removed.
        """
        keys = {session_lock_key(sid): sid for sid in session_ids}
        if not keys:
            yield set()
            return
        taken = connection.execute(
            text("SELECT k FROM unnest(CAST(:keys AS bigint[])) AS k "
                 "WHERE pg_try_advisory_xact_lock(k)"),
            {"keys": list(keys)},
        ).scalars()
        free = {keys[int(key)] for key in taken}
        yield set(keys.values()) - free

    def lock_migrations(self, connection: Connection) -> None:
        """Wait for the advisory lock; it is released when the transaction ends."""
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})


async def _bounded(awaitable: Awaitable[_R], seconds: float) -> _R:
    """``awaitable`` cancelled after ``seconds`` (``asyncio.TimeoutError``), without a new task."""
    timeout = getattr(asyncio, "timeout", None)
    if timeout is None:  # Python 3.10
        return await asyncio.wait_for(awaitable, seconds)
    async with timeout(seconds):
        return await awaitable


def _lock_unavailable(
    session_id: str, url: URL | None, exc: BaseException, reason: str | None = None
) -> DatabaseUnavailableError:
    if reason is None:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
    where = "" if url is None else f" on {describe(url)}"
    return DatabaseUnavailableError(
        f"cannot take the turn lock of session {session_id!r}{where}: {reason}"
    )


class PostgresSessionStore(SQLAlchemySessionStore):
    """Session store on PostgreSQL (psycopg 3), for many workers sharing conversations.

    Args:
        url: ``postgresql://`` or ``postgresql+psycopg://`` URL.
        default_max_turns: History window of new contexts, in complete turns.
        dedup_ttl_hours: How long a processed webhook id stays claimed.
        session_ttl_hours: A session not updated for this many hours is expired
            and removed by ``sweep()``; None (the default) keeps sessions forever.
        archive_pruned: Keep the messages pruning drops from the window in the
            archive table (read back by ``transcript()``) instead of deleting them.
        cipher: An :class:`~chatflow_sqlalchemy.crypto.AESGCMCipher`: message
            content and metadata are encrypted at rest (see :mod:`~chatflow_sqlalchemy.sealing`).
        require_encryption: Refuse plaintext rows with ``CorruptRowError``.
        auto_migrate: False refuses a missing or old schema instead of creating
            or upgrading it; None (the default) reads ``CHATFLOW_AUTO_MIGRATE``.
        engine_options: Passed to ``sqlalchemy.create_engine`` (pool size,
            echo, ...), also as keyword arguments of their own.
            ``connect_args`` are added to the backend's defaults (a connect
            timeout and TCP keepalives, see :func:`default_connect_args`).

    Hangs are bounded: opening a connection by libpq's ``connect_timeout``
    (:data:`CONNECT_TIMEOUT_SECONDS` unless the URL or ``connect_args`` say
    otherwise); each async operation (``aget_or_create``, the turn's catch-up
    and write, the turn-lock calls) by :attr:`operation_timeout`; a lost
    connection under a real network partition by TCP keepalives and
    ``tcp_user_timeout`` (:data:`TCP_OPTIONS`). A bound that runs out is a
    :class:`~chatflow_sqlalchemy.exceptions.DatabaseUnavailableError`. A turn
    lock whose holder went silent is released within
    :attr:`turn_lock_lease_seconds` (see :class:`AdvisoryTurnLocks`).

    """

    dialect_support = PostgresDialectSupport()

    operation_timeout: float = OPERATION_TIMEOUT_SECONDS
    """Seconds an async operation may wait on the server before it fails.

    A stuck query is then cancelled by psycopg (which itself waits up to
    about 10 s more for the server before closing the connection).
    """

    turn_lock_lease_seconds: float = TURN_LOCK_LEASE_SECONDS
    """Seconds after which the server frees the turn lock of a worker gone silent."""

    def __init__(
        self,
        url: str | URL,
        default_max_turns: int = 40,
        dedup_ttl_hours: float = DEFAULT_DEDUP_TTL_HOURS,
        *,
        auto_migrate: bool | None = None,
        session_ttl_hours: float | None = None,
        archive_pruned: bool = False,
        cipher: AESGCMCipher | None = None,
        require_encryption: bool = False,
        engine_options: Mapping[str, Any] | None = None,
        **more_engine_options: Any,
    ) -> None:
        if psycopg is None:
            raise BackendImportError(INSTALL_HINT)
        parsed = psycopg_url(url)
        given = {**(engine_options or {}), **more_engine_options}
        options = {**self.dialect_support.engine_options(parsed), **given}
        options["connect_args"] = default_connect_args(parsed, given.get("connect_args"))
        super().__init__(
            parsed,
            engine_options=options,
            default_max_turns=default_max_turns,
            dedup_ttl_hours=dedup_ttl_hours,
            auto_migrate=auto_migrate,
            session_ttl_hours=session_ttl_hours,
            archive_pruned=archive_pruned,
            cipher=cipher,
            require_encryption=require_encryption,
        )
        locks = cast(AdvisoryTurnLocks, self.turn_locks)
        locks.lease_seconds = self.turn_lock_lease_seconds
        locks.call_timeout = self.operation_timeout

    async def _run_blocking(self, fn: Callable[..., _R], *args: Any) -> _R:
        """Run database work as the generic store does, bounded by :attr:`operation_timeout`.

        Only the native async path can be bounded (a coroutine can be
        cancelled; a thread blocked in libpq cannot): there the store's
        operations run as psycopg coroutines.
        """
        if not self.runtime.native_async:
            return await super()._run_blocking(fn, *args)
        try:
            return await _bounded(super()._run_blocking(fn, *args), self.operation_timeout)
        except asyncio.TimeoutError as exc:
            if self.turn_locks is not None:
                self.turn_locks.distrust()
            raise DatabaseUnavailableError(
                f"no answer from {describe(self.url)} within {self.operation_timeout:g} s "
                "(PostgresSessionStore.operation_timeout); the operation was cancelled"
            ) from exc

    @classmethod
    def from_url(cls, url: str | URL, **kwargs: Any) -> PostgresSessionStore:
        """Open ``url`` (what ``open_store`` calls)."""
        return cls(url, **kwargs)
