"""What differs per database dialect, behind one small interface.

The generic store (``store.py``) writes every query once against SQLAlchemy
Core. A :class:`DialectSupport` subclass in ``backends/`` holds only what
cannot be portable: engine options and per-connection setup, the atomic
upsert forms, how a write transaction takes its locks, and how migrations
are serialised across processes.

A :class:`DialectSupport` subclass is also what a backend *is*: the registry
(:mod:`chatflow_sqlalchemy.registry`) maps a backend name to it, and its
:attr:`DialectSupport.store_class` names the store class ``open_store``
opens. That class is named by a ``"module:Class"`` string, imported only
when a store is opened, so neither this module nor the registry imports a
store.
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
    "IDLE_PING_SECONDS",
    "RECLAIMED_AS_DONE",
    "AcquiredClaim",
    "DialectSupport",
    "SessionWrite",
    "WriteStep",
    "first_time_on",
    "on_conflict_acquire",
    "ping_when_idle",
]

IDLE_PING_SECONDS = 1.0
"""A pooled connection idle for longer than this is checked before it is used again."""

RECLAIMED_AS_DONE: dict[str, Any] = {
    "state": literal_column("'done'"),
    **{name: null() for name in (
        "token", "session_id", "ticket", "lease_expires_at", "claimed_at", "response"
    )},
}
"""What ``record_processed_message`` sets besides ``processed_at`` when it takes an
expired id again: a plain done row, nothing left of an earlier ``store.claim``.
Constants are inline SQL, not anonymous binds: one cached statement whatever they are."""


@dataclass(frozen=True)
class AcquiredClaim:
    """What :meth:`DialectSupport.read_claim` read off the acquire statement's result.

    Attributes:
        acquired: The claim was taken (inserted or taken over).
        ticket: Its place in its session's order; None when the statement
            cannot return it (the store reads it afterwards).
        earlier_in_flight: Whether an earlier claim of the session was in
            flight, for a backend whose acquire statement looks (it must look
            in a snapshot that sees every claim with a smaller ticket); None:
            the store looks with a statement of its own.
        session_checked: The statement also read the claimed session's
            version (``session_version``, None: no such session): the claim
            block's first ``get_or_create`` uses it (the turn's lease reads
            the version again before the turn).
        session_version: See ``session_checked``.
        partition_day: The day partition the claim's row is in, for a backend
            whose claims table is partitioned by day (None elsewhere): the
            turn's write names it, so the database looks in that partition
            alone rather than planning for every one.
        lease_fence: The statement also took the claimed session's turn lease
            (free, and no earlier claim of the session in flight), as
            :mod:`chatflow_sqlalchemy.lease` takes it: its fence. The
            store's next turn on the session uses that lease (the claim
            gives it back if none did); None: the turn takes its own.

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
    """One write of a session, for :meth:`DialectSupport.execute_write`.

    The store builds it once from what a context changed; a backend runs
    it all or nothing. Values are sealed already where the store encrypts.

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
        summary: The session's new summary (``summary``, ``through``: the
            seq it runs through), None when unchanged. Archived rows waiting
            for it up to ``through`` stop waiting; with ``keep`` False they
            are deleted. ``archived`` and ``waiting`` already account for it.
        fence: Parameters of the turn's claim fence (``claim_id``,
            ``claim_token``, ``claim_now``, ``claim_reply``: the reply stored
            with the claim), None for a turn without a claim.
        lease: Parameters of the turn's lease check
            (:func:`chatflow_sqlalchemy.lease.lease_params`: ``sid``,
            ``holder_token``, ``holder_fence``, ``lease_now``; with
            ``keep_lease`` also ``lease_until`` and ``turn_lease_seconds``),
            None for a write outside a turn.
        keep_lease: The lease is moved on rather than given back (the turn of
            an inbox batch keeps it for the batch's reply).
        batch: The inbox batch the turn answers (``token``, ``reply``, ``now``,
            ``size``: how many in-flight items hold the token), or None.
        steps: The same write as portable statements, in order: what
            :meth:`DialectSupport.execute_write` runs by default (empty for a
            backend whose ``one_statement_write`` is True: a write run in
            autocommit cannot be several statements).

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
        store_class: The store class ``open_store`` opens for this backend
            (its ``from_url(url, **kwargs)``): ``"module:Class"``, imported
            when a store is opened, or the class itself. Default: the
            generic :class:`~chatflow_sqlalchemy.store.SQLAlchemySessionStore`,
            which takes everything it needs of the database from this
            support; a backend names its own class only for what that class
            adds (a URL with its driver, extra methods).
        default_driver: The DBAPI a URL that names none runs on (``"pymysql"``:
            ``mysql://`` is ``mysql+pymysql://``); None keeps SQLAlchemy's default.
        expires_processed_whole: True when :meth:`drop_expired_processed`
            removes expired dedup rows in bulk (PostgreSQL's day partitions):
            the store's own periodic purge then leaves every row to it, and
            only an explicit ``purge_processed_messages()`` deletes the rest
            (the cutoff's own day) row by row.
        one_statement_write: True when :meth:`execute_write` sends each write
            as one atomic statement: the store runs it in autocommit, without
            ``BEGIN`` and ``COMMIT`` round trips.

    """

    name: str = "generic"
    store_class: ClassVar[str | type[Any]] = "chatflow_sqlalchemy.store:SQLAlchemySessionStore"
    install_hint: str = ""
    """What to install when the dialect's driver is missing; a store that creates its
    engine raises :class:`~chatflow_sqlalchemy.exceptions.BackendImportError` with it
    (empty: the driver's ``ImportError`` propagates as it is)."""
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

        The store calls it for every write, in a write transaction (in
        autocommit where :attr:`one_statement_write` is True), and rolls the
        transaction back when it returns False. The write must stand only if
        the compare-and-swap matches, the turn's lease (if any) is still the
        writer's and unexpired, the claim (if any) is still held and the
        inbox batch (if any) still in flight. The default runs
        :attr:`SessionWrite.steps` in order (the swap first) and returns
        False as soon as one changes other than the rows it must; a backend
        may send the same write its own way (PostgreSQL: one statement).
        The store then tells why with one read, raises or rebases, and
        calls this again.
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
        ``released``, its lease has expired, or it is older than the dedup TTL;
        any other row (done, or held under a live lease) is left as it is. A
        takeover draws the new ``token`` but keeps the row's ``ticket`` (its
        place in its session's order). Bind parameters: ``message_id``,
        ``now``, ``cutoff``, ``token``, ``lease`` (the lease expiry),
        ``session_id`` and ``horizon`` (see :class:`AcquiredClaim`): the
        worker's clock values; ``lease_seconds`` and ``ttl_seconds`` for the
        database's clock (``clock.CLAIM_NOW``, ``CLAIM_LEASE``,
        ``CLAIM_CUTOFF``, ``CLAIM_HORIZON``), which its leases and takeover test use.
        :meth:`read_claim` reads the result. Backends with
        ``ON CONFLICT ... WHERE ... RETURNING`` build it with
        :func:`on_conflict_acquire`. The parameters of the session's lease
        (``holder_token``, ``lease_now``, ``lease_until``,
        ``lease_seconds``: :mod:`chatflow_sqlalchemy.lease`) are passed too,
        for a backend that takes it in the same statement
        (:attr:`AcquiredClaim.lease_fence`).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement acquire_claim()")

    def claim_acquired(self, result: CursorResult[Any]) -> tuple[bool, int | None]:
        """Interpret :meth:`acquire_claim`: ``(acquired, ticket or None if unknown)``.

        The default reads the ``RETURNING ticket`` row. A statement that
        returns no rows (MySQL's upserts cannot) is judged by :meth:`claimed`,
        and the store reads the ticket afterwards.
        """
        if not result.returns_rows:
            return self.claimed(result), None
        row = result.first()
        return (False, None) if row is None else (True, row[0])

    def read_claim(self, result: CursorResult[Any]) -> AcquiredClaim:
        """Interpret :meth:`acquire_claim` whole; the default is :meth:`claim_acquired`'s answer.

        A backend whose acquire statement also tells whether an earlier claim
        of the session is in flight overrides this to return it, saving the
        store that look's round trip.
        """
        acquired, ticket = self.claim_acquired(result)
        return AcquiredClaim(acquired, ticket)

    def claim_ticket(self, table: Table) -> Any:
        """The SQL expression that numbers a new claim (FIFO order per session).

        It must be assigned atomically by the database. The default, the
        session's ``MAX(ticket) + 1`` (an index range read on ``(session_id,
        ticket)``), is atomic only where a write statement holds the
        database's write lock from its start (SQLite); dialects with
        sequences use ``chatflow_claim_ticket_seq``.
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

        The ids come from a ``LIMIT``-ed derived table, which every dialect
        takes (MySQL refuses a ``LIMIT`` in an ``IN`` subquery itself, and
        accepts it one level down).
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
        """Remove expired dedup rows in bulk, before the batched :meth:`purge_processed`.

        For backends that store the dedup table in a shape that expires whole
        (PostgreSQL drops day partitions); runs in the purge's transaction and
        returns how many rows went. It may also prepare that shape for what is
        coming (the days ahead). Default: nothing to do, 0.
        """
        return 0

    def lock_session_row(self, select: Select[Any]) -> Select[Any]:
        """Make a session-row SELECT lock the row for the rest of the transaction."""
        return select.with_for_update()

    def lock_batch(self, select: Select[Any], connection: Connection) -> Select[Any]:
        """Lock the rows a batch job picked (sweep, key rotation) for its transaction.

        Default ``FOR UPDATE SKIP LOCKED``: concurrent jobs take disjoint
        batches and a row a writer holds is passed over, not waited for.
        Backends whose server may lack ``SKIP LOCKED`` decide from
        ``connection``'s server version (jobs then wait for one another).
        SQLite ignores row locks.
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

    ``insert`` is the dialect's ``insert`` function (PostgreSQL's or SQLite's),
    ``ticket`` the expression of :meth:`DialectSupport.claim_ticket`. The
    conflict branch runs only for a row that may be taken over, so exactly
    one of any number of racing callers gets a row back from ``RETURNING``.
    A ``partition_day`` expression (a table partitioned by day) is inserted
    with the row and joins ``message_id`` as the conflict target.
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
    """Check pooled connections before use, only those idle for over ``idle_seconds``.

    ``idle_seconds`` defaults to :data:`IDLE_PING_SECONDS`.
    ``pool_pre_ping`` costs a round trip on every checkout, several per turn.
    A connection that was fine moments ago is almost always still fine, and a
    server restart or failover takes longer than a second, so every
    connection that sat through it is pinged and, if dead, replaced before
    use (a :class:`~sqlalchemy.exc.DisconnectionError` from the checkout
    event makes the pool open a fresh one). A connection lost within the
    window fails one operation with a disconnect error; SQLAlchemy then
    invalidates it and every connection the pool opened before it
    (``ExceptionContext.invalidate_pool_on_disconnect``), which are replaced
    at their next checkout.
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
    """True only the first time ``what`` is set up on ``engine``.

    Several stores may share one engine; the listeners each of them would
    install (pragmas and BEGIN, idle pings) must be added once.
    """
    done = _SET_UP.setdefault(engine, set())
    if what in done:
        return False
    done.add(what)
    return True
