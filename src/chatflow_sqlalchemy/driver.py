"""Core statements compiled once and executed on the DBAPI cursor.

A turn runs the same few statements every time: the dedup claim, the version
check, the compare-and-swap of the session row and the message writes. For
them SQLAlchemy's per-execution work (cache lookup, parameter and result
set-up, event dispatch: ~25-30 us a statement) costs more than SQLite's own
work. A :class:`DriverStatement` keeps the statement written once in Core and
compiled by the dialect (placeholders, casts and type conversions included);
only its execution goes straight to the driver. Everything else in the store
runs through SQLAlchemy as usual.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, cast

from sqlalchemy import Dialect, Engine, Pool, PoolProxiedConnection
from sqlalchemy import exc as sa_exc
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import BindParameter

__all__ = [
    "DriverConnection",
    "DriverStatement",
    "distrust_pool",
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
        converted: tuple[Any, ...] | dict[str, Any] = self.parameter_rows([params])[0]
        return converted

    def execute(self, cursor: Any, params: Mapping[str, Any]) -> Any:
        """Execute once on a DBAPI cursor; return the cursor."""
        cursor.execute(self.sql, self.parameter_rows([params])[0])
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

    __slots__ = ("_invalidate", "engine", "pooled")

    def __init__(
        self,
        engine: Engine,
        pooled: PoolProxiedConnection,
        invalidate: Callable[[BaseException], None],
    ) -> None:
        self.engine = engine
        self.pooled = pooled
        self._invalidate = invalidate

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


@contextmanager
def translate_driver_errors(connection: DriverConnection, sql: str) -> Iterator[None]:
    """Raise DBAPI errors as SQLAlchemy's ``DBAPIError`` subclasses, as ``execute`` would.

    A lost connection is invalidated (and the rest of the pool distrusted),
    and the error says so (``connection_invalidated``), which the store turns
    into :class:`~chatflow_sqlalchemy.exceptions.DatabaseUnavailableError`.
    """
    dialect = connection.engine.dialect
    dbapi = dialect.loaded_dbapi
    try:
        yield
    except dbapi.Error as exc:
        lost = dialect.is_disconnect(exc, connection.dbapi_connection, None)
        if lost:
            connection.invalidate(exc)
        raise sa_exc.DBAPIError.instance(
            sql, None, exc, dbapi.Error, connection_invalidated=lost, dialect=dialect
        ) from exc


def run_driver_statement(
    connection: DriverConnection,
    statement: DriverStatement,
    params: Mapping[str, Any] | Sequence[Mapping[str, Any]],
) -> int:
    """Run ``statement`` in the connection's current transaction; return the rowcount.

    A list of parameter sets runs as one ``executemany``.
    """
    with translate_driver_errors(connection, statement.sql):
        cursor = connection.cursor()
        if isinstance(params, Mapping):
            statement.execute(cursor, params)
        else:
            statement.executemany(cursor, params)
        count = int(cursor.rowcount)
        cursor.close()
    return count
