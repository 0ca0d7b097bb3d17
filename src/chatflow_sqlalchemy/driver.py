"""Core statements compiled once and executed on the DBAPI cursor.

A turn runs the same few statements every time: the dedup claim, the version
check, the compare-and-swap of the session row and the message writes. For
them SQLAlchemy's per-execution work (cache lookup, parameter and result
set-up, event dispatch; see ``benchmarks/RESULTS.md``) costs more than
SQLite's own work. A :class:`DriverStatement` keeps the statement written
once in Core and compiled by the dialect (placeholders, casts and type
conversions included); only its execution goes straight to the driver.
Everything else in the store runs through SQLAlchemy as usual.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, cast

from sqlalchemy import Dialect, Engine, ExceptionContext, Pool, PoolProxiedConnection, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.pool import QueuePool
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import BindParameter

__all__ = [
    "LAST_USED_KEY",
    "DriverConnection",
    "DriverStatement",
    "KeptConnections",
    "distrust_pool",
    "driver_error",
    "first_time_on",
    "pool_distrusted_since",
    "run_driver_statement",
    "translate_driver_errors",
]

_UNSET = object()

_Slot = tuple[str, Callable[[Any], Any] | None, bool, Any]
"""(parameter key, bind processor, required, value when not required)."""


class DriverStatement:
    """A Core statement compiled for one dialect, run with the DBAPI ``execute``.

    Args:
        statement: The Core statement (named ``bindparam`` keys are its parameters).
        dialect: The dialect of the connections it will run on.
        column_keys: For an ``INSERT`` without ``values()``, the columns to bind.
        many: Compile for :meth:`executemany`.

    """

    __slots__ = ("_names", "_slots", "sql")

    def __init__(
        self,
        statement: ClauseElement,
        dialect: Dialect,
        *,
        column_keys: Sequence[str] | None = None,
        many: bool = False,
    ) -> None:
        compiled = cast(
            SQLCompiler,
            statement.compile(
                dialect=dialect,
                column_keys=list(column_keys) if column_keys else None,
                for_executemany=many,  # e.g. no implicit RETURNING of an INSERT's key
            ),
        )
        self.sql: str = compiled.string
        binds = compiled.binds
        names = list(compiled.positiontup or ()) if compiled.positional else list(binds)
        self._names: tuple[str, ...] | None = None if compiled.positional else tuple(names)
        self._slots: tuple[_Slot, ...] = tuple(_slot(binds[name], dialect) for name in names)

    def parameters(self, params: Mapping[str, Any]) -> tuple[Any, ...] | dict[str, Any]:
        """The DBAPI parameters for ``params`` (keyed like the Core statement's)."""
        values = []
        for key, process, required, default in self._slots:
            value = params[key] if required else params.get(key, default)
            values.append(value if process is None else process(value))
        if self._names is None:
            return tuple(values)
        return dict(zip(self._names, values, strict=True))

    def execute(self, cursor: Any, params: Mapping[str, Any]) -> Any:
        """Execute once on a DBAPI cursor; return the cursor."""
        cursor.execute(self.sql, self.parameters(params))
        return cursor

    def executemany(self, cursor: Any, rows: Sequence[Mapping[str, Any]]) -> Any:
        """Execute once per row on a DBAPI cursor (one ``executemany``)."""
        cursor.executemany(self.sql, self.parameter_rows(rows))
        return cursor

    def parameter_rows(self, rows: Sequence[Mapping[str, Any]]) -> list[Any]:
        """The DBAPI parameters of each row, for ``executemany``.

        A value repeated across rows (a write's one timestamp) is converted once.
        """
        slots, names = self._slots, self._names
        last_in: list[Any] = [_UNSET] * len(slots)
        last_out: list[Any] = [None] * len(slots)
        converted: list[Any] = []
        for params in rows:
            values = []
            for index, (key, process, required, default) in enumerate(slots):
                value = params[key] if required else params.get(key, default)
                if process is not None:
                    if value is not last_in[index]:
                        last_in[index], last_out[index] = value, process(value)
                    value = last_out[index]
                values.append(value)
            if names is None:
                converted.append(tuple(values))
            else:
                converted.append(dict(zip(names, values, strict=True)))
        return converted

    def __repr__(self) -> str:
        return f"<DriverStatement {self.sql!r}>"


def _slot(bind: BindParameter[Any], dialect: Dialect) -> _Slot:
    process = bind.type.dialect_impl(dialect).bind_processor(dialect)
    return bind.key, process, bool(bind.required), bind.effective_value


_DISTRUSTED_SINCE: weakref.WeakKeyDictionary[Pool, float] = weakref.WeakKeyDictionary()


def distrust_pool(pool: Pool) -> None:
    """After a lost connection, have every connection now in ``pool`` pinged before reuse.

    Core invalidates the whole pool when a statement finds the connection
    gone (the server probably restarted); this is the same for statements
    run on the driver, through :func:`pool_distrusted_since`, which the idle
    ping of :func:`~chatflow_sqlalchemy.dialect.ping_when_idle` consults.
    """
    _DISTRUSTED_SINCE[pool] = time.monotonic()


def pool_distrusted_since(pool: Pool) -> float:
    """When a connection of ``pool`` was last found lost (``time.monotonic()``), or 0."""
    return _DISTRUSTED_SINCE.get(pool, 0.0)


class DriverConnection:
    """A pooled DBAPI connection checked out for the driver path, with its engine.

    No SQLAlchemy ``Connection`` is built around it (:meth:`checkout`).
    """

    __slots__ = ("_invalidate", "engine", "pool", "pooled", "taken_at", "used_at")

    def __init__(
        self,
        engine: Engine,
        pooled: PoolProxiedConnection,
        invalidate: Callable[[BaseException], None],
    ) -> None:
        self.engine = engine
        self.pooled = pooled
        self._invalidate = invalidate
        self.pool = engine.pool
        self.taken_at = self.used_at = time.monotonic()

    @classmethod
    def checkout(cls, engine: Engine) -> DriverConnection:
        """Check a connection out of ``engine``'s pool (close it with :meth:`close`).

        A connection that cannot be opened raises SQLAlchemy's ``DBAPIError``
        subclass, as ``engine.connect()`` would (``raw_connection`` lets the
        driver's own error through).
        """
        dbapi = engine.dialect.loaded_dbapi
        try:
            pooled = engine.raw_connection()
        except dbapi.Error as exc:
            raise sa_exc.DBAPIError.instance(
                None, None, exc, dbapi.Error, dialect=engine.dialect
            ) from exc
        return cls(engine, pooled, pooled.invalidate)

    @property
    def dbapi_connection(self) -> Any:
        """The DBAPI connection (SQLAlchemy's adapter on async drivers)."""
        return self.pooled.dbapi_connection

    @property
    def driver_connection(self) -> Any:
        """The driver's own connection object (e.g. a psycopg ``AsyncConnection``)."""
        return self.pooled.driver_connection

    @property
    def is_valid(self) -> bool:
        """False once the connection was found lost and invalidated."""
        return bool(self.pooled.is_valid)

    def cursor(self) -> Any:
        """A new DBAPI cursor."""
        return self.pooled.cursor()

    def invalidate(self, exc: BaseException) -> None:
        """Discard the connection (it was lost) and distrust the rest of its pool."""
        self._invalidate(exc)
        distrust_pool(self.engine.pool)

    def close(self) -> None:
        """Return a :meth:`checkout` connection to the pool."""
        self.pooled.close()


def driver_error(connection: DriverConnection, exc: Exception, sql: str) -> sa_exc.StatementError:
    """The SQLAlchemy ``DBAPIError`` subclass for the DBAPI error ``exc``, as ``execute`` raises.

    A lost connection is invalidated (and the rest of its pool distrusted),
    and the error says so (``connection_invalidated``), which the store turns
    into :class:`~chatflow_sqlalchemy.exceptions.DatabaseUnavailableError`.
    """
    dialect = connection.engine.dialect
    lost = dialect.is_disconnect(cast(Any, exc), connection.dbapi_connection, None)
    if lost:
        connection.invalidate(exc)
    return sa_exc.DBAPIError.instance(
        sql, None, exc, dialect.loaded_dbapi.Error,
        connection_invalidated=lost, dialect=dialect,
    )


@contextmanager
def translate_driver_errors(connection: DriverConnection, sql: str) -> Iterator[None]:
    """Raise DBAPI errors inside the block as :func:`driver_error` describes."""
    try:
        yield
    except connection.engine.dialect.loaded_dbapi.Error as exc:
        raise driver_error(connection, exc, sql) from exc


def run_driver_statement(
    connection: DriverConnection,
    statement: DriverStatement,
    params: Mapping[str, Any] | Sequence[Mapping[str, Any]],
) -> int:
    """Run ``statement`` in the connection's current transaction; return the rowcount.

    A list of parameter sets runs as one ``executemany``.
    """
    try:
        cursor = connection.cursor()
        if isinstance(params, Mapping):
            statement.execute(cursor, params)
        else:
            statement.executemany(cursor, params)
        count = int(cursor.rowcount)
        cursor.close()
    except connection.engine.dialect.loaded_dbapi.Error as exc:
        raise driver_error(connection, exc, statement.sql) from exc
    return count


LAST_USED_KEY = "chatflow_last_used"
"""Connection-record ``info`` key: when a connection back from :class:`KeptConnections`
was last used (``time.monotonic()``), so the idle ping counts its time aside as idle."""


class KeptConnections:
    """Driver connections of one engine kept checked out between units of work, briefly.

    Taking a connection out of SQLAlchemy's pool and putting it back
    (events, reset on return, bookkeeping) costs more than SQLite's own work
    for a one-row statement, and a turn runs three driver units. Up to
    ``keep`` connections given back in good order wait here instead, and
    only while the pool keeps a free slot for everything else (a
    ``QueuePool`` with fewer than ``pool_size`` connections out). The store
    passes ``keep=0`` where it cannot know the pool's settings or the pool
    pings on every checkout.

    A connection goes back through the pool, so that pings, recycling and
    invalidation apply as before, when its last unit started ``max_idle``
    seconds ago or more, when it left the pool ``max_age`` seconds ago, when
    it was opened ``recycle`` seconds ago (the engine's ``pool_recycle``: the
    pool then replaces it at checkout), when its pool was replaced
    (``engine.dispose()``) or when a lost connection was found on its pool
    since its last unit (by the driver path or by Core). For that short
    while it skips the pool's checkout and checkin events. A connection
    whose unit failed is never given back (the caller closes it).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        keep: int,
        max_idle: float,
        max_age: float = 30.0,
        recycle: float | None = None,
    ) -> None:
        self._engine = engine
        self._keep = keep
        self._max_idle = max_idle
        self._max_age = max_age
        self._recycle = recycle
        if keep and recycle is not None:
            _note_when_connections_open(engine)
        self._kept: list[DriverConnection] = []
        self._lock = threading.Lock()  # give_back's check-then-keep against close()
        self._closed = False
        if keep:
            _distrust_on_core_disconnects(engine)
        # A store nobody closed still hands its connections back (no SQLAlchemy
        # warning about a connection garbage-collected while checked out).
        self._finalizer = weakref.finalize(self, _retire_all, self._kept)
        _ALL_KEPT.add(self)

    def take(self) -> DriverConnection:
        """A kept connection still fresh, else one checked out of the pool."""
        now = time.monotonic()
        while self._kept:
            try:
                connection = self._kept.pop()
            except IndexError:  # another thread took the last one
                break
            if self._fresh(connection, now):
                connection.used_at = now
                return connection
            _retire(connection)
        return DriverConnection.checkout(self._engine)

    def _fresh(self, connection: DriverConnection, now: float) -> bool:
        pool = connection.pool
        return (
            pool is self._engine.pool
            and now - connection.used_at < self._max_idle
            and now - connection.taken_at < self._max_age
            and (self._recycle is None or now - _opened_at(connection) < self._recycle)
            and connection.used_at > pool_distrusted_since(pool)
            and connection.is_valid
        )

    def give_back(self, connection: DriverConnection) -> None:
        """Keep a connection whose unit of work succeeded (outside any transaction)."""
        with self._lock:
            if (
                not self._closed
                and len(self._kept) < self._keep
                and _has_room_to_keep(connection.pool)
            ):
                self._kept.append(connection)
                return
        _retire(connection)

    def close(self) -> None:
        """Return every kept connection to the pool; later ones go straight back too."""
        with self._lock:
            self._closed = True
        self._finalizer()


OPENED_AT_KEY = "chatflow_opened_at"
"""Connection-record ``info`` key: when the DBAPI connection was opened (``time.monotonic()``)."""


def _note_when_connections_open(engine: Engine) -> None:
    """Stamp every new DBAPI connection of ``engine`` with its opening time."""
    if not first_time_on(engine, "opened at"):
        return

    @event.listens_for(engine, "connect")
    def _opened(dbapi_connection: Any, record: Any) -> None:
        record.info[OPENED_AT_KEY] = time.monotonic()


def _opened_at(connection: DriverConnection) -> float:
    """When ``connection`` was opened; unknown counts as long ago (it goes back)."""
    opened = connection.pooled.info.get(OPENED_AT_KEY)
    return float("-inf") if opened is None else float(opened)


def _has_room_to_keep(pool: Pool) -> bool:
    """True if one more connection may stay out of ``pool`` without starving its users."""
    return isinstance(pool, QueuePool) and pool.checkedout() < pool.size()  # it is out too


_SET_UP: weakref.WeakKeyDictionary[Engine, set[str]] = weakref.WeakKeyDictionary()


def first_time_on(engine: Engine, what: str) -> bool:
    """True only the first time ``what`` is set up on ``engine``.

    Several stores may share one engine; the listeners each of them would
    install (pragmas and BEGIN, idle pings, disconnect watch) must be added once.
    """
    done = _SET_UP.setdefault(engine, set())
    if what in done:
        return False
    done.add(what)
    return True


def _distrust_on_core_disconnects(engine: Engine) -> None:
    """A lost connection found by a Core statement distrusts the pool too.

    Core then invalidates the pool's connections as they are checked out;
    kept connections are not checked out, so they consult the distrust time.
    """
    if not first_time_on(engine, "distrust on disconnect"):
        return

    @event.listens_for(engine, "handle_error")
    def _distrust(context: ExceptionContext) -> None:
        if context.is_disconnect:
            distrust_pool(engine.pool)


def _retire_all(kept: list[DriverConnection]) -> None:
    while kept:
        try:
            connection = kept.pop()
        except IndexError:  # another thread took the last one
            break
        _retire(connection)


def _retire(connection: DriverConnection) -> None:
    """Back to the pool, telling the idle ping when the connection was last used."""
    if connection.is_valid:
        connection.pooled.info[LAST_USED_KEY] = connection.used_at
    connection.close()


_ALL_KEPT: weakref.WeakSet[KeptConnections] = weakref.WeakSet()
_INHERITED: list[DriverConnection] = []


def _drop_inherited_connections() -> None:
    """In a forked child: forget the parent's kept connections without touching them.

    Closing them here would reset or terminate sessions the parent still
    uses (SQLAlchemy's pool documents the same rule, ``engine.dispose(close=False)``);
    they are held, unused, so that collecting them cannot close them either.
    """
    for kept in list(_ALL_KEPT):
        _INHERITED.extend(kept._kept)
        kept._kept.clear()
        kept._lock = threading.Lock()  # a parent thread may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited_connections)
