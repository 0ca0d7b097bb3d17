"""The database's clock in SQL: the time claim leases are set and judged by.

:class:`DatabaseNow` renders the database's own clock on SQLite, PostgreSQL and
MySQL/MariaDB, so no worker's clock decides whether a lease holds; the
``CLAIM_*`` expressions are the times the claim statements use.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Float, bindparam
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from chatflow_sqlalchemy.tables import UTCDateTime

__all__ = ["CLAIM_CUTOFF", "CLAIM_HORIZON", "CLAIM_LEASE", "CLAIM_NOW", "DatabaseNow"]


class DatabaseNow(FunctionElement[datetime]):
    """The database's clock, optionally moved by some seconds: the time claim leases use.

    Arguments: the bind parameter of the worker's clock value (rendered only
    on a database this module does not compile for), then optionally a SQL
    expression of seconds to add. Per dialect:

    * PostgreSQL: ``statement_timestamp()``, the start of the statement: one
      value throughout the statement, fresh for every statement even inside
      a long transaction (``now()`` would be the transaction's start).
    * SQLite: the machine's clock, ``strftime('%Y-%m-%d %H:%M:%f', 'now')``,
      padded to the six-digit text :class:`UTCDateTime` stores, so text
      comparisons with stored values hold.
    * MySQL / MariaDB: ``UTC_TIMESTAMP(6)``, UTC whatever the session's time
      zone, as the ``DATETIME(6)`` columns hold naive UTC.

    Another database renders the worker's clock value, as before; its backend
    gets the database's clock by compiling this element for its dialect
    (``sqlalchemy.ext.compiler.compiles``).
    """

    type = UTCDateTime()
    inherit_cache = True


def _seconds(element: DatabaseNow, compiler: SQLCompiler, **kw: Any) -> str | None:
    """The seconds argument compiled (None if none); the worker's value is left out."""
    args = list(element.clauses)
    return compiler.process(args[1], **kw) if len(args) > 1 else None


@compiles(DatabaseNow)
def _worker_clock(element: DatabaseNow, compiler: SQLCompiler, **kw: Any) -> str:
    return str(compiler.process(next(iter(element.clauses)), **kw))


@compiles(DatabaseNow, "postgresql")
def _postgresql_clock(element: DatabaseNow, compiler: SQLCompiler, **kw: Any) -> str:
    seconds = _seconds(element, compiler, **kw)
    if seconds is None:
        return "statement_timestamp()"
    return f"(statement_timestamp() + make_interval(secs => {seconds}))"


@compiles(DatabaseNow, "sqlite")
def _sqlite_clock(element: DatabaseNow, compiler: SQLCompiler, **kw: Any) -> str:
    seconds = _seconds(element, compiler, **kw)
    shift = "" if seconds is None else f", printf('%.6f seconds', {seconds})"
    return f"(strftime('%Y-%m-%d %H:%M:%f', 'now'{shift}) || '000')"


@compiles(DatabaseNow, "mysql")
@compiles(DatabaseNow, "mariadb")
def _mysql_clock(element: DatabaseNow, compiler: SQLCompiler, **kw: Any) -> str:
    seconds = _seconds(element, compiler, **kw)
    if seconds is None:
        return "UTC_TIMESTAMP(6)"
    return f"TIMESTAMPADD(MICROSECOND, ROUND(({seconds}) * 1000000), UTC_TIMESTAMP(6))"


def _worker_time(name: str) -> Any:
    return bindparam(name, type_=UTCDateTime())


_LEASE_SECONDS = bindparam("lease_seconds", type_=Float())
CLAIM_NOW = DatabaseNow(_worker_time("now"))
"""Now (worker's value: bind parameter ``now``)."""
CLAIM_LEASE = DatabaseNow(_worker_time("lease"), _LEASE_SECONDS)
"""The end of a lease taken or renewed now (``lease``; seconds: ``lease_seconds``)."""
CLAIM_HORIZON = DatabaseNow(_worker_time("horizon"), -_LEASE_SECONDS)
"""One lease ago (``horizon``): see :meth:`WebhookClaim.order_horizon`."""
CLAIM_CUTOFF = DatabaseNow(
    _worker_time("cutoff"), -bindparam("ttl_seconds", type_=Float())
)
"""One dedup TTL ago (``cutoff``; seconds: ``ttl_seconds``): older ids are taken over."""
