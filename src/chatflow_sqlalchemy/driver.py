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

from sqlalchemy import Connection, Dialect, Engine, Pool
from sqlalchemy import exc as sa_exc
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import BindParameter

__all__ = [
    "DriverStatement",
    "distrust_pool",
    "pool_distrusted_since",
    "run_driver_statement",
    "translate_driver_errors",
]

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
        values = [
            _convert(params[key] if required else params.get(key, value), process)
            for key, process, required, value in self._slots
        ]
        return tuple(values) if self._names is None else dict(zip(self._names, values, strict=True))

    def execute(self, cursor: Any, params: Mapping[str, Any]) -> Any:
        """Execute once on a DBAPI cursor; return the cursor."""
        cursor.execute(self.sql, self.parameters(params))
        return cursor

    def executemany(self, cursor: Any, rows: Sequence[Mapping[str, Any]]) -> Any:
        """Execute once per row on a DBAPI cursor (one ``executemany``)."""
        cursor.executemany(self.sql, [self.parameters(row) for row in rows])
        return cursor

    def __repr__(self) -> str:
        return f"<DriverStatement {self.sql!r}>"


def _slot(bind: BindParameter[Any], dialect: Dialect) -> _Slot:
    process = bind.type.dialect_impl(dialect).bind_processor(dialect)
    return bind.key, process, bool(bind.required), bind.effective_value


def _convert(value: Any, process: Callable[[Any], Any] | None) -> Any:
    return value if process is None else process(value)


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


@contextmanager
def translate_driver_errors(
    engine: Engine,
    dbapi_connection: Any,
    statement: DriverStatement,
    invalidate: Callable[[BaseException], None],
) -> Iterator[None]:
    """Raise DBAPI errors as SQLAlchemy's ``DBAPIError`` subclasses, as ``execute`` would.

    A lost connection is invalidated (``invalidate``) and the rest of the
    pool distrusted (:func:`distrust_pool`), and the error says so
    (``connection_invalidated``), which the store turns into
    :class:`~chatflow_sqlalchemy.exceptions.DatabaseUnavailableError`.
    """
    dialect = engine.dialect
    dbapi = dialect.loaded_dbapi
    try:
        yield
    except dbapi.Error as exc:
        lost = dialect.is_disconnect(exc, dbapi_connection, None)
        if lost:
            invalidate(exc)
            distrust_pool(engine.pool)
        raise sa_exc.DBAPIError.instance(
            statement.sql,
            None,
            exc,
            dbapi.Error,
            connection_invalidated=lost,
            dialect=dialect,
        ) from exc


def run_driver_statement(
    connection: Connection,
    statement: DriverStatement,
    params: Mapping[str, Any] | Sequence[Mapping[str, Any]],
) -> int:
    """Run ``statement`` inside ``connection``'s transaction, on its DBAPI cursor.

    A list of parameter sets runs as one ``executemany``. Returns the rowcount.
    """
    dbapi_connection = connection.connection.dbapi_connection
    with translate_driver_errors(
        connection.engine, dbapi_connection, statement, connection.invalidate
    ):
        cursor = connection.connection.cursor()
        if isinstance(params, Mapping):
            statement.execute(cursor, params)
        else:
            statement.executemany(cursor, params)
        count = int(cursor.rowcount)
        cursor.close()
    return count
