"""What differs per database dialect, behind one small interface.

The generic store writes every query once against SQLAlchemy Core; a
:class:`DialectSupport` subclass holds only what cannot be portable (engine
setup, atomic upserts, locking, migration serialisation). It is also what a
backend *is*: the registry maps a name to it, and its ``store_class``
(``"module:Class"``, imported when a store opens) names the store class.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any, ClassVar, cast

from sqlalchemy import (
    URL,
    Connection,
    CursorResult,
    Engine,
    Executable,
    Select,
    Table,
    and_,
    bindparam,
    case,
    delete,
    event,
    func,
    literal_column,
    null,
    or_,
    select,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.sql.dml import Delete, Insert

__all__ = [
    "IDLE_PING_SECONDS", "RECLAIMED_AS_DONE", "AcquiredClaim", "DialectSupport", "SessionWrite",
    "WriteStep", "first_time_on", "on_conflict_acquire", "ping_when_idle",
]

IDLE_PING_SECONDS = 1.0
"""A pooled connection idle for longer than this is checked before it is used again."""

RECLAIMED_AS_DONE: dict[str, Any] = {
    "state": literal_column("'done'"),
    **{name: null() for name in (
        "token", "session_id", "ticket", "lease_expires_at", "claimed_at", "response"
    )},
}
"""What ``record_processed_message`` sets besides ``processed_at`` when it takes an expired id
again: a plain done row (inline SQL constants: one cached statement)."""


@dataclass(frozen=True)
class AcquiredClaim:
    """What :meth:`DialectSupport.read_claim` read off the acquire statement's result.

    Attributes:
        acquired: The claim was taken (inserted or taken over).
        ticket: Its place in its session's order; None: the store reads it afterwards.
        earlier_in_flight: Whether an earlier claim of the session was in
            flight (seen in a snapshot that sees every smaller ticket); None:
            the store looks with a statement of its own.
        session_checked: The statement also read the session's version
            (``session_version``, None: no such session), for the claim
            block's first ``get_or_create``.
        session_version: See ``session_checked``.
        partition_day: The day partition of the claim's row (a claims table
            partitioned by day, else None): the turn's write names it.
        lease_fence: The fence of the session's turn lease, when the
            statement also took it (free, no earlier claim in flight); the
            next turn on the session uses it. None: the turn takes its own.

    """

    acquired: bool
    ticket: int | None = None
    earlier_in_flight: bool | None = None
    session_checked: bool = False
    session_version: int | None = None
    partition_day: date | None = None
    lease_fence: int | None = None


@dataclass(frozen=True)
class WriteStep:
    """One portable statement of a session write (:attr:`SessionWrite.steps`).

    Attributes:
        statement: The statement.
        params: Its parameters (a list of them: one execution for each).
        rows: How many rows it must change for the write to stand (None: any).

    """

    statement: Executable
    params: Mapping[str, Any] | Sequence[Mapping[str, Any]]
    rows: int | None = None


@dataclass(frozen=True)
class SessionWrite:
    """One write of a session (values already sealed), run all or nothing by a backend.

    Attributes:
        swap: Parameters of the session row's compare-and-swap: ``sid``,
            ``expected`` (the version the writer read), ``new_version``,
            ``agent_name``, ``now`` and, only when it changed, ``metadata``.
        gone: Seqs of the message rows to delete; a seq also in ``rows`` is
            replaced (a rewound turn written again).
        clear: Delete every message row of the session (``clear_history``).
        rows: Message rows to insert: ``session_id``, ``seq``, ``role``,
            ``content``, ``message_json``, ``created_at``.
        archived: Seqs of rows to copy into the archive before they are deleted.
        waiting: Seqs of rows to archive as waiting for the session's summary.
        summary: The new summary (``summary``, ``through``: the seq it runs
            through; rows waiting up to it stop waiting, deleted unless
            ``keep``), None when unchanged.
        fence: The turn's claim fence (``claim_id``, ``claim_token``,
            ``claim_now``, ``claim_reply``), None for a turn without a claim.
        lease: The turn's lease check (:func:`chatflow_sqlalchemy.lease.lease_params`),
            None for a write outside a turn.
        keep_lease: The lease is moved on, not given back (an inbox batch's turn).
        batch: The inbox batch the turn answers (``token``, ``reply``, ``now``,
            ``size``), or None.
        steps: The same write as portable statements, in order, which
            :meth:`DialectSupport.execute_write` runs by default (empty when
            ``one_statement_write``).

    """

    swap: Mapping[str, Any]
    gone: Sequence[int]
    rows: Sequence[Mapping[str, Any]]
    fence: Mapping[str, Any] | None
    lease: Mapping[str, Any] | None = None
    keep_lease: bool = False
    clear: bool = False
    archived: Sequence[int] = ()
    waiting: Sequence[int] = ()
    summary: Mapping[str, Any] | None = None
    batch: Mapping[str, Any] | None = None
    steps: Sequence[WriteStep] = ()


class DialectSupport:
    """Per-dialect hooks; subclass it in a backend and override what differs.

    Attributes:
        name: The SQLAlchemy dialect name this support handles.
        store_class: The store class ``open_store`` opens (its ``from_url``):
            ``"module:Class"`` (imported when a store opens) or the class.
            Default: the generic :class:`~chatflow_sqlalchemy.store.SQLAlchemySessionStore`;
            name your own only for what it adds (a URL with its driver, methods).
        default_driver: The DBAPI of a URL that names none (``"pymysql"``:
            ``mysql://`` is ``mysql+pymysql://``); None keeps SQLAlchemy's default.
        expires_processed_whole: :meth:`drop_expired_processed` removes
            expired dedup rows in bulk, so the periodic purge leaves them to it.
        one_statement_write: :meth:`execute_write` sends each write as one
            atomic statement, run in autocommit.

    """

    name: str = "generic"
    store_class: ClassVar[str | type[Any]] = "chatflow_sqlalchemy.store:SQLAlchemySessionStore"
    install_hint: str = ""
    """What to install when the driver is missing (in the ``BackendImportError``; empty:
    the driver's ``ImportError`` propagates)."""
    default_driver: str | None = None
    expires_processed_whole: bool = False
    one_statement_write: bool = False

    def engine_options(self, url: URL) -> dict[str, Any]:
        """Keyword arguments for ``create_engine`` (pool, connect args)."""
        return {"pool_pre_ping": True}

    def autocommit_options(self) -> dict[str, Any]:
        """Execution options under which one statement runs without BEGIN/COMMIT."""
        return {"isolation_level": "AUTOCOMMIT"}

    def execute_write(self, connection: Connection, write: SessionWrite) -> bool:
        """Run one session write, all of it or (returning False) nothing of it.

        Called in a write transaction (autocommit with :attr:`one_statement_write`),
        rolled back on False. The write stands only if the compare-and-swap
        matches and the lease, claim and inbox batch (if any) are still held.
        The default runs :attr:`SessionWrite.steps` in order and returns False
        when one changes other than the rows it must.
        """
        for step in write.steps:
            result = connection.execute(step.statement, step.params)
            if step.rows is not None and result.rowcount != step.rows:
                return False
        return True

    def sync_url(self, url: URL) -> URL:
        """The URL for the store's sync engine: :attr:`default_driver` where it names none."""
        if self.default_driver and "+" not in url.drivername:
            return url.set(drivername=f"{url.drivername}+{self.default_driver}")
        return url

    def async_url(self, url: URL) -> URL | None:
        """The URL for a native AsyncEngine, or None to run async work on the thread pool."""
        return None

    def prepare_engine(self, engine: Engine) -> None:
        """Install per-connection setup (event listeners) on a new engine."""

    def is_ephemeral(self, url: URL) -> bool:
        """True when the database lives only in this process's memory."""
        return False

    def insert_ignore(self, table: Table) -> Insert:
        """An INSERT of one row that silently does nothing if its primary key exists."""
        raise NotImplementedError(f"{type(self).__name__} must implement insert_ignore()")

    def claim_processed(self, table: Table) -> Insert:
        """The atomic dedup claim: insert ``message_id``, or refresh an expired row.

        Bind parameters: ``message_id``, ``processed_at`` (now) and ``cutoff``
        (rows older than it are expired). The statement must affect a row
        exactly when the claim succeeded; :meth:`claimed` reads its result
        (by default: a row came back from ``RETURNING``).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement claim_processed()")

    def claimed(self, result: CursorResult[Any]) -> bool:
        """Interpret the result of :meth:`claim_processed`."""
        return result.first() is not None

    def acquire_claim(self, table: Table) -> Executable:
        """The one atomic statement that acquires a webhook claim (``store.claim``).

        Insert the id as ``acquired``, or take the row over when it is
        ``released``, its lease expired, or it is older than the dedup TTL
        (keeping its ``ticket``, drawing a new ``token``). Bind parameters:
        ``message_id``, ``token``, ``session_id``; the worker's clock values
        ``now``, ``cutoff``, ``lease`` (the lease expiry) and ``horizon`` (see
        :class:`AcquiredClaim`); ``lease_seconds`` and ``ttl_seconds`` for the
        database's clock (``clock.CLAIM_NOW``, ``CLAIM_LEASE``, ``CLAIM_CUTOFF``,
        ``CLAIM_HORIZON``); and the session lease's (``holder_token``,
        ``lease_now``, ``lease_until``: :mod:`chatflow_sqlalchemy.lease`) for a
        backend that takes it too. :meth:`read_claim` reads the result;
        :func:`on_conflict_acquire` builds it where ``ON CONFLICT`` exists.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement acquire_claim()")

    def claim_acquired(self, result: CursorResult[Any]) -> tuple[bool, int | None]:
        """Interpret :meth:`acquire_claim`: ``(acquired, ticket or None if unknown)``.

        Reads the ``RETURNING ticket`` row, or (no rows: MySQL) asks :meth:`claimed`.
        """
        if not result.returns_rows:
            return self.claimed(result), None
        row = result.first()
        return (False, None) if row is None else (True, row[0])

    def read_claim(self, result: CursorResult[Any]) -> AcquiredClaim:
        """Interpret :meth:`acquire_claim` whole (a backend may fill more of it)."""
        acquired, ticket = self.claim_acquired(result)
        return AcquiredClaim(acquired, ticket)

    def claim_ticket(self, table: Table) -> Any:
        """The SQL expression that numbers a new claim (FIFO order per session), atomically.

        The default ``MAX(ticket) + 1`` is atomic only where a write holds the
        database's write lock from its start (SQLite); others use a sequence.
        """
        latest = select(func.max(table.c.ticket)).where(
            table.c.session_id == bindparam("session_id")
        )
        return select(func.coalesce(latest.scalar_subquery(), 0) + 1).scalar_subquery()

    def upsert_processed(self, table: Table) -> Insert:
        """Insert ``message_id`` or move its ``processed_at`` to now (``mark``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement upsert_processed()")

    def purge_processed(self, table: Table, batch_size: int) -> Delete:
        """Delete at most ``batch_size`` expired dedup rows (bind parameter ``cutoff``).

        The ``LIMIT`` sits in a derived table: MySQL refuses it in an ``IN`` subquery.
        """
        expired = (
            select(table.c.message_id)
            .where(table.c.processed_at < bindparam("cutoff"))
            .limit(batch_size)
            .subquery("expired")
        )
        return delete(table).where(table.c.message_id.in_(select(expired.c.message_id)))

    def drop_expired_processed(
        self, connection: Connection, cutoff: datetime, now: datetime
    ) -> int:
        """Remove expired dedup rows in bulk (PostgreSQL: day partitions); return how many.

        Runs in the purge's transaction, before :meth:`purge_processed`. Default: 0.
        """
        return 0

    def lock_session_row(self, select: Select[Any]) -> Select[Any]:
        """Make a session-row SELECT lock the row for the rest of the transaction."""
        return select.with_for_update()

    def lock_batch(self, select: Select[Any], connection: Connection) -> Select[Any]:
        """Lock the rows a batch job picked (sweep, key rotation) for its transaction.

        Default ``FOR UPDATE SKIP LOCKED`` (concurrent jobs take disjoint
        batches); a server that may lack it decides from ``connection``'s version.
        """
        return select.with_for_update(skip_locked=True)

    def begin_migration(self, connection: Connection) -> None:
        """Prepare a connection before the migration transaction begins."""

    def lock_migrations(self, connection: Connection) -> None:
        """Inside the migration transaction: wait until no other process migrates."""

    def end_migration(self, connection: Connection) -> None:
        """Undo :meth:`begin_migration` after the migration transaction ended."""


def on_conflict_acquire(
    insert: Any, table: Table, ticket: Any, partition_day: Any = None
) -> Insert:
    """:meth:`DialectSupport.acquire_claim` as ``INSERT ... ON CONFLICT DO UPDATE ... WHERE``.

    ``insert`` is the dialect's ``insert`` function, ``ticket`` the
    :meth:`DialectSupport.claim_ticket` expression; a ``partition_day``
    expression joins the row and the conflict target. Exactly one racing
    caller gets a row back from ``RETURNING``.
    """
    from chatflow_sqlalchemy.clock import CLAIM_CUTOFF, CLAIM_LEASE, CLAIM_NOW

    c = table.c
    now, cutoff = CLAIM_NOW, CLAIM_CUTOFF  # the database's clock (see sql_claims)
    stmt = insert(table).values(
        message_id=bindparam("message_id"),
        processed_at=now,
        state="acquired",
        token=bindparam("token"),
        session_id=bindparam("session_id"),
        ticket=ticket,
        lease_expires_at=CLAIM_LEASE,
        claimed_at=now,
    )
    keys = [c.message_id]
    if partition_day is not None:
        stmt = stmt.values(partition_day=partition_day)
        keys.append(c.partition_day)
    new = stmt.excluded
    expired = c.processed_at < cutoff
    takeover = or_(
        c.state == "released",
        and_(c.state == "acquired", c.lease_expires_at < now),
        expired,
    )
    acquire = stmt.on_conflict_do_update(
        index_elements=keys,
        set_={
            "state": "acquired",
            "token": new.token,
            "lease_expires_at": new.lease_expires_at,
            "claimed_at": new.claimed_at,
            "processed_at": new.processed_at,
            "session_id": new.session_id,
            "ticket": case((expired, new.ticket), else_=func.coalesce(c.ticket, new.ticket)),
            "response": None,
        },
        where=takeover,
    ).returning(c.ticket)
    return cast(Insert, acquire)


def ping_when_idle(engine: Engine, idle_seconds: float | None = None) -> None:
    """At checkout, ping pooled connections idle over ``idle_seconds`` (:data:`IDLE_PING_SECONDS`).

    Unlike ``pool_pre_ping`` (a round trip per checkout), a connection used
    moments ago is trusted; one lost within the window fails one operation,
    after which SQLAlchemy invalidates the pool's older connections.
    """
    if not first_time_on(engine, "idle ping"):
        return  # one more store on the same engine: its listeners are already there
    dialect = engine.dialect
    window = IDLE_PING_SECONDS if idle_seconds is None else idle_seconds

    @event.listens_for(engine, "checkin")
    def _idle_from(dbapi_connection: Any, record: Any) -> None:
        if record is not None:
            record.info["chatflow_idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _ping_if_idle(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        since = record.info.get("chatflow_idle_since")
        if since is None:
            return  # a new connection
        if time.monotonic() - since < window:
            return
        try:
            dialect.do_ping(dbapi_connection)
        except dialect.loaded_dbapi.Error as exc:
            raise sa_exc.DisconnectionError(f"pooled connection failed its ping: {exc}") from exc


_SET_UP: weakref.WeakKeyDictionary[Engine, set[str]] = weakref.WeakKeyDictionary()


def first_time_on(engine: Engine, what: str) -> bool:
    """True only the first time ``what`` is set up on ``engine`` (stores may share one)."""
    done = _SET_UP.setdefault(engine, set())
    if what in done:
        return False
    done.add(what)
    return True
