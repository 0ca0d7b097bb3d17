"""``MariaDBSessionStore``: the chatflow session store on MariaDB or MySQL.

Everything but the dialect hooks (:mod:`.dialect`) and the cross-process
turn lock is the generic :class:`~chatflow_sqlalchemy.SQLAlchemySessionStore`.
The async API runs on the store's private thread pool (PyMySQL is a sync
driver), and ``session.lock`` also holds a server-side named lock
(``GET_LOCK``) for the whole turn, taken on one dedicated connection per
store so that a turn waiting on a slow model pins no pooled connection. The
server drops a connection's named locks when the connection dies, so a
crashed worker never leaves a session locked.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Mapping
from typing import Any

from chatflow_sqlalchemy.backend import (
    DEFAULT_DEDUP_TTL_HOURS,
    AESGCMCipher,
    DatabaseUnavailableError,
    IOPool,
    SQLAlchemySessionStore,
)
from sqlalchemy import URL, Connection, Engine, make_url, select
from sqlalchemy.exc import DBAPIError

from chatflow_sqlalchemy_mariadb.dialect import (
    MariaDBDialectSupport,
    lock_name,
    with_driver,
)
from chatflow_sqlalchemy_mariadb.schema import info

__all__ = ["MariaDBSessionStore", "NamedTurnLocks"]


class _Attempt:
    """One ``try_acquire`` call: hands its result over, unless its caller is gone."""

    __slots__ = ("_caller_gone", "_guard", "_handed_a_lock")

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._caller_gone = False
        self._handed_a_lock = False

    def hand_over(self, taken: bool) -> bool:
        """In the worker thread: False if the caller was cancelled (the lock is ours to free)."""
        with self._guard:
            if self._caller_gone:
                return False
            self._handed_a_lock = taken
            return True

    def abandon(self) -> bool:
        """In the cancelled caller: True if a taken lock was already handed over (free it)."""
        with self._guard:
            self._caller_gone = True
            return self._handed_a_lock


_UNLOCKING: set[asyncio.Future[None]] = set()
"""Releases that outlive a cancelled caller (strong references until they finish)."""


class NamedTurnLocks:
    """Per-session named locks (``GET_LOCK(name, 0)``) on one dedicated connection.

    The :class:`~chatflow_sqlalchemy.dialect.TurnLocks` of MariaDB (see
    :meth:`MariaDBDialectSupport.turn_locks`). The lock connection is a
    SQLAlchemy :class:`~sqlalchemy.engine.Connection` of the locks' own engine
    (:attr:`engines`), in autocommit: named locks belong to the connection,
    not to a transaction, and every statement goes through SQLAlchemy, so
    engine events and ``echo`` see it. The driver is sync: each call runs on
    a thread of the locks' own (a ``chatflow-io`` pool, never the loop's
    default executor, the caller's context included) and calls are
    serialised by a thread lock, because the connection is shared by every
    thread and event loop using the store.

    Args:
        engine: A ``NullPool`` engine whose connections are used only for locks.

    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._database = engine.url.database
        self._conn: Connection | None = None
        self._mutex = threading.Lock()
        self._closed = False
        self._pool = IOPool(1, thread_name_prefix="chatflow-io-locks")

    @property
    def engines(self) -> tuple[Engine, ...]:
        """The engine the lock statements run on, apart from the store's own.

        The locks hold a connection outside the store's pool, so listeners and
        instrumentation on ``store.engine`` alone never see ``GET_LOCK`` or
        ``RELEASE_LOCK``; listening on these engines too sees every statement
        the store sends.
        """
        return (self._engine,)

    def _call(self, sql: str, session_id: str) -> Any:
        with self._mutex:
            if self._closed:  # e.g. a late give-back after the store closed: nothing held
                raise RuntimeError("the store's turn locks are closed")
            try:
                if self._conn is None:
                    self._conn = self._engine.connect()
                    self._conn.execution_options(isolation_level="AUTOCOMMIT")
                name = lock_name("turn", self._database, session_id)
                return self._conn.exec_driver_sql(sql, (name,)).scalar()
            except Exception:
                self._abandon()
                raise

    def _try_acquire(self, session_id: str) -> bool:
        try:
            return bool(self._call("SELECT GET_LOCK(%s, 0)", session_id) == 1)
        except DBAPIError as exc:  # the driver's error, wrapped (a lost connection included)
            error = exc.orig if exc.orig is not None else exc
            text = str(error).strip()
            reason = text.splitlines()[0] if text else repr(error)
            raise DatabaseUnavailableError(
                f"cannot take the turn lock of session {session_id!r}: {reason}"
            ) from exc

    async def try_acquire(self, session_id: str) -> tuple[bool, bool, int | None]:
        """Take the session's lock if it is free; never waits (the version is not read).

        A caller cancelled meanwhile (a timeout, a shutdown) never leaves the
        lock held: the worker thread goes on, and a lock it takes for a caller
        that is gone is given back at once.
        """
        attempt = _Attempt()

        def take() -> bool:
            taken = self._try_acquire(session_id)
            if attempt.hand_over(taken):
                return taken
            if taken:  # nobody awaits it any more
                self._release(session_id)
            return False

        if self._closed:
            raise RuntimeError("the store's turn locks are closed")
        try:
            return await self._pool.run(take), False, None
        except asyncio.CancelledError:
            if attempt.abandon():  # handed over just as the caller was cancelled
                threading.Thread(target=self._release, args=(session_id,), daemon=True).start()
            raise

    def _release(self, session_id: str) -> None:
        with contextlib.suppress(Exception):
            self._call("SELECT RELEASE_LOCK(%s)", session_id)

    async def release(self, session_id: str) -> None:
        """Release the session's lock (a lost connection already released it).

        Shielded: a caller cancelled meanwhile (a timeout, a shutdown) does not
        stop the ``RELEASE_LOCK``, which would otherwise leave the lock held
        for the life of the lock connection.
        """
        unlock = asyncio.ensure_future(self._release_on_pool(session_id))
        _UNLOCKING.add(unlock)
        unlock.add_done_callback(_UNLOCKING.discard)
        await asyncio.shield(unlock)

    async def _release_on_pool(self, session_id: str) -> None:
        with contextlib.suppress(RuntimeError):  # closed: the server released it
            await self._pool.run(self._release, session_id)

    def distrust(self) -> None:
        """Drop the lock connection (its locks are released by the server)."""
        with self._mutex:
            self._abandon()

    def _abandon(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.invalidate()

    def side_connection(self) -> Connection:
        """A new connection opened like the lock connection, outside the store's pool.

        For locks held a short while beside the turns (a sweep's, see
        :meth:`MariaDBDialectSupport.hold_turns`); closing it releases them.
        """
        return self._engine.connect()

    async def aclose(self) -> None:
        """Close the connection off the loop; the server releases every lock it held."""
        await asyncio.to_thread(self.close)  # not on the locks' thread: close() stops it

    def close(self) -> None:
        """Close the connection; the server releases every lock it held."""
        with self._mutex:
            self._closed = True
            conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
        self._pool.shutdown(wait=True)
        self._engine.dispose()


class MariaDBSessionStore(SQLAlchemySessionStore):
    """Session store on MariaDB or MySQL, for many workers sharing sessions.

    Tested on MariaDB 10.11 (needs 10.3+: ``utf8mb4_nopad_bin``, ``DATETIME(6)``,
    JSON). MySQL 8.0.17+ is meant to work (``utf8mb4_0900_bin`` ids) but is not
    tested by this project.

    Args:
        url: ``mysql+pymysql://user:pw@host/db`` (``mysql://`` and ``mariadb://``
            use PyMySQL; ``mysql+mysqldb://`` uses mysqlclient if installed).
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
            ``connect_args``, ...), over the backend's defaults (``connect_args``
            key by key); also as keyword arguments of their own.

    Raises:
        BackendImportError: The driver is not installed.
        DatabaseUnavailableError: The server cannot be reached.

    """

    dialect_support = MariaDBDialectSupport()

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
        super().__init__(
            with_driver(make_url(url)),
            engine_options={**(engine_options or {}), **more_engine_options},
            default_max_turns=default_max_turns,
            dedup_ttl_hours=dedup_ttl_hours,
            auto_migrate=auto_migrate,
            session_ttl_hours=session_ttl_hours,
            archive_pruned=archive_pruned,
            cipher=cipher,
            require_encryption=require_encryption,
        )

    @classmethod
    def from_url(cls, url: str | URL, **kwargs: Any) -> MariaDBSessionStore:
        """Open ``url`` (what ``open_store`` calls)."""
        return cls(url, **kwargs)

    def backend_info(self) -> dict[str, str]:
        """What the plugin recorded when it created this schema (``chatflow_mariadb_info``)."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(info.c.name, info.c.value)).all()
        return {name: value for name, value in rows}
