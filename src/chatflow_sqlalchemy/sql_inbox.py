"""The durable inbox on the SQL stores: ``chatflow_inbox`` and the sessions' leases.

What the inbox does is described in :mod:`chatflow_sqlalchemy.inbox`; this
module is its rows (:class:`SQLInbox`, an :class:`~chatflow_sqlalchemy.inbox.InboxRows`)
in portable Core. Every time a statement stores or compares is the
database's clock (:class:`~chatflow_sqlalchemy.clock.DatabaseNow`), as for
the leases. Every call that acts for a batch first checks, in its own
transaction, that the batch still holds its session's lease, so a worker
that lost it changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from datetime import datetime, timedelta
from typing import Any, Protocol, TypeVar

from sqlalchemy import (
    Connection,
    Float,
    Integer,
    and_,
    bindparam,
    case,
    func,
    insert,
    literal_column,
    null,
    or_,
    select,
    update,
)
from sqlalchemy import exc as sa_exc

from chatflow_sqlalchemy import tables
from chatflow_sqlalchemy.clock import DatabaseNow
from chatflow_sqlalchemy.exceptions import CorruptRowError, LeaseLostError, SessionDeletedError
from chatflow_sqlalchemy.inbox import BATCH_LIMIT as _BATCH_LIMIT
from chatflow_sqlalchemy.inbox import (
    DEAD,
    DONE,
    IN_FLIGHT,
    INBOX_STATES,
    MAX_COALESCE_FACTOR,
    PENDING,
    SENT,
    InboxEntry,
    InboxItem,
    InboxReply,
    InboxStats,
    Unsent,
    resumed_token,
)
from chatflow_sqlalchemy.lease import KEEP_HELD, SessionLeases, free_at, lease_params
from chatflow_sqlalchemy.runtime import StoreRuntime
from chatflow_sqlalchemy.sealing import Sealer
from chatflow_sqlalchemy.tables import UTCDateTime
from chatflow_sqlalchemy.values import Lease, utcnow

__all__ = ["ANSWER_BATCH", "SQLInbox"]

_T = TypeVar("_T")

_i = tables.inbox
_s = tables.sessions
_TABLE = _i.name
_NOW = DatabaseNow(bindparam("now", type_=UTCDateTime()))
_COALESCED = DatabaseNow(
    bindparam("coalesced", type_=UTCDateTime()), -bindparam("coalesce_seconds", type_=Float())
)
_WAITED = DatabaseNow(
    bindparam("waited", type_=UTCDateTime()), -bindparam("wait_seconds", type_=Float())
)
_RETRY_AT = DatabaseNow(
    bindparam("retry_at", type_=UTCDateTime()), bindparam("retry_seconds", type_=Float())
)
_BEFORE = DatabaseNow(
    bindparam("cutoff", type_=UTCDateTime()), -bindparam("older_than", type_=Float())
)


def _state(name: str) -> Any:
    """A state as an inline constant: one cached statement whatever the values."""
    return literal_column(f"'{name}'")


_OF_BATCH = (_i.c.batch_token == bindparam("token")) & (_i.c.state == _state(IN_FLIGHT))

ANSWER_BATCH = (
    update(_i)
    .where(_OF_BATCH)
    .values(answered_at=_NOW, reply=bindparam("reply"), updated_at=_NOW)
)
"""What a batch's turn adds to its write transaction: the reply, the items answered."""

_PUT = insert(_i).values(
    received_at=_NOW, updated_at=_NOW, state=_state(PENDING), attempts=0
)
_READY = (
    select(_i.c.session_id)
    .select_from(_i.outerjoin(_s, _s.c.session_id == _i.c.session_id))
    .where(
        _i.c.state.in_([_state(PENDING), _state(IN_FLIGHT)]),
        or_(_s.c.session_id.is_(None), free_at(_NOW)),
        _i.c.session_id.not_in(bindparam("busy", expanding=True)),
    )
    .group_by(_i.c.session_id)
    .having(
        or_(
            func.max(case((_i.c.state == _state(IN_FLIGHT), 1), else_=0)) == 1,
            and_(
                func.max(case((_i.c.not_before > _NOW, 1), else_=0)) == 0,
                or_(
                    func.max(_i.c.received_at) <= _COALESCED,
                    func.min(_i.c.received_at) <= _WAITED,
                ),
            ),
        )
    )
    .order_by(func.min(_i.c.id))
    .limit(bindparam("limit", type_=Integer()))
)
_OF_SESSION = _i.c.session_id == bindparam("sid")
_ABANDONED = (
    update(_i)
    .where(_OF_SESSION, _i.c.state == _state(IN_FLIGHT), _i.c.answered_at.is_(None))
    .values(
        state=case((_i.c.attempts >= bindparam("max_attempts"), _state(DEAD)),
                   else_=_state(PENDING)),
        error=bindparam("error"),
        batch_token=case((_i.c.attempts >= bindparam("max_attempts"), _i.c.batch_token),
                         else_=null()),
        updated_at=_NOW,
    )
)
_ANSWERED = (
    select(_i.c.id, _i.c.batch_token, _i.c.message_id, _i.c.reply)
    .where(
        _OF_SESSION,
        _i.c.answered_at.is_not(None),
        _i.c.state.in_([_state(PENDING), _state(IN_FLIGHT)]),
    )
    .order_by(_i.c.id)
)
_RESUME = (
    update(_i)
    .where(_i.c.id.in_(bindparam("ids", expanding=True)))
    .values(state=_state(IN_FLIGHT), batch_token=bindparam("token"), updated_at=_NOW)
)
_NOTHING_TO_SEND = (
    update(_i)
    .where(_i.c.id.in_(bindparam("ids", expanding=True)))
    .values(state=_state(DONE), updated_at=_NOW)
)
_ITEM_COLUMNS = (
    _i.c.id, _i.c.message_id, _i.c.text, _i.c.sent_at, _i.c.received_at, _i.c.payload,
    _i.c.attempts,
)
_PENDING = (
    select(*_ITEM_COLUMNS)
    .where(_OF_SESSION, _i.c.state == _state(PENDING), _i.c.answered_at.is_(None))
    .order_by(func.coalesce(_i.c.sent_at, _i.c.received_at), _i.c.id)
    .limit(_BATCH_LIMIT)
)
_TAKE_ITEMS = (
    update(_i)
    .where(_i.c.id.in_(bindparam("ids", expanding=True)))
    .values(
        state=_state(IN_FLIGHT),
        batch_token=bindparam("token"),
        attempts=_i.c.attempts + 1,
        not_before=null(),
        updated_at=_NOW,
    )
)
_UNREADABLE = (
    update(_i)
    .where(_i.c.id == bindparam("row_id"))
    .values(state=_state(DEAD), error=bindparam("error"), updated_at=_NOW)
)
_FINISH = (
    update(_i)
    .where(_OF_BATCH)
    .values(
        reply=bindparam("reply"),
        answered_at=func.coalesce(_i.c.answered_at, _NOW),
        state=bindparam("state"),
        updated_at=_NOW,
    )
)
_SENT = update(_i).where(_OF_BATCH).values(state=_state(SENT), updated_at=_NOW)
_GIVES_UP = or_(_i.c.attempts >= bindparam("max_attempts"), _i.c.answered_at.is_not(None))
"""A failed batch's item is dead after its last attempt, or at once if its turn committed
(running the turn again would repeat it; its reply is withheld until an operator retries)."""
_FAILED = (
    update(_i)
    .where(_OF_BATCH)
    .values(
        state=case((_GIVES_UP, _state(DEAD)), else_=_state(PENDING)),
        batch_token=case((_GIVES_UP, _i.c.batch_token), else_=null()),
        not_before=_RETRY_AT,
        error=bindparam("error"),
        updated_at=_NOW,
    )
)
_UNDELIVERABLE = (
    update(_i)
    .where(_OF_BATCH)
    .values(state=_state(DEAD), error=bindparam("error"), updated_at=_NOW)
)
_ABANDON = (
    update(_i)
    .where(_OF_BATCH, _i.c.answered_at.is_(None))
    .values(
        state=_state(PENDING),
        attempts=_i.c.attempts - 1,
        batch_token=null(),
        updated_at=_NOW,
    )
)
_DEAD_TOKEN = select(_i.c.batch_token).where(
    _i.c.message_id == bindparam("message_id"), _i.c.state == _state(DEAD)
)
_RETRY = (
    update(_i)
    .where(
        _i.c.state == _state(DEAD),
        or_(_i.c.message_id == bindparam("retry_id"), _i.c.batch_token == bindparam("token")),
    )
    .values(state=_state(PENDING), attempts=0, not_before=null(), updated_at=_NOW)
)
_ENTRY_COLUMNS = (
    _i.c.message_id, _i.c.session_id, _i.c.state, _i.c.attempts, _i.c.received_at,
    _i.c.updated_at, _i.c.sent_at, _i.c.error,
)
_COUNTS = select(_i.c.state, func.count()).group_by(_i.c.state)
_OLDEST_PENDING = select(_NOW.label("now"), func.min(_i.c.received_at)).where(
    _i.c.state == _state(PENDING)
)
_DEAD_LAST_HOUR = select(func.count()).where(
    _i.c.state == _state(DEAD),
    _i.c.updated_at > DatabaseNow(bindparam("hour_ago", type_=UTCDateTime()), -3600.0),
)
_PURGE = (
    _i.delete()
    .where(_i.c.state.in_([_state(DONE), _state(SENT)]), _i.c.updated_at < _BEFORE)
)


class _Turns(Protocol):
    def lend(self, lease: Lease) -> None: ...

    def unlend(self, lease: Lease) -> None: ...


class _Store(Protocol):
    """What the inbox rows need of their store (the store passes itself)."""

    @property
    def turns(self) -> _Turns: ...

    @property
    def runtime(self) -> StoreRuntime: ...

    async def _run_blocking(self, fn: Callable[..., _T], *args: Any) -> _T: ...

    def _create_empty_session(self, session_id: str) -> None: ...

    def _warm(self, session_id: str, version: int) -> None: ...


class SQLInbox:
    """:class:`~chatflow_sqlalchemy.inbox.InboxRows` on a SQL store.

    Args:
        store: The store (its runtime, and how it creates a session).
        leases: The store's session leases (the turns' own).
        sealer: Seals text and replies as the store seals message content.

    """

    def __init__(self, store: _Store, leases: SessionLeases, sealer: Sealer) -> None:
        self._store = store
        self._runtime = store.runtime
        self._leases = leases
        self._sealer = sealer

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run blocking work as the store's async API does."""
        return await self._store._run_blocking(fn, *args)

    def put(
        self, message_id: str, session_id: str, text: str, sent_at: datetime | None, payload: Any
    ) -> bool:
        """Insert a pending message; False if the id is in the inbox (its unique key)."""
        params = {
            "message_id": message_id,
            "session_id": session_id,
            "text": self._sealer.seal_text(session_id, text),
            "sent_at": sent_at,
            "payload": self._sealer.seal_json(session_id, payload),
            "now": utcnow(),
        }
        try:
            with self._runtime.transaction(single=True) as conn:
                conn.execute(_PUT, params)
        except sa_exc.IntegrityError:
            return False
        return True

    def ready(self, coalesce_seconds: float, limit: int, busy: Collection[str]) -> list[str]:
        """Sessions whose batch is due (a burst over, or a dead holder's left) and lease free."""
        now = utcnow()
        params = {
            "now": now,
            "coalesced": now - timedelta(seconds=coalesce_seconds),
            "coalesce_seconds": coalesce_seconds,
            "waited": now - timedelta(seconds=coalesce_seconds * MAX_COALESCE_FACTOR),
            "wait_seconds": coalesce_seconds * MAX_COALESCE_FACTOR,
            "busy": sorted(busy) or [""],
            "limit": limit,
        }
        with self._runtime.transaction(single=True) as conn:
            return [row[0] for row in conn.execute(_READY, params)]

    def take(self, session_id: str) -> Lease | None:
        """The session's lease, kept by the batch and lent to the store's turns.

        A session first met here is created empty first.
        """
        try:
            lease = self._leases.take(session_id)
        except SessionDeletedError:
            self._store._create_empty_session(session_id)
            lease = self._leases.take(session_id)
        if lease is not None:
            lease.kept = True
            self._store.turns.lend(lease)
        return lease

    def warm(self, lease: Lease) -> None:
        """Cache the session's context (read at the lease's version) before ``handle``."""
        self._store._warm(lease.session_id, lease.version)

    def renew(self, lease: Lease) -> bool:
        """Move the lease on; False if lost."""
        return self._leases.renew(lease)

    def release(self, lease: Lease) -> None:
        """Give the lease back."""
        self._store.turns.unlend(lease)
        self._leases.release(lease)

    def open_batch(
        self, lease: Lease, token: str, max_attempts: int
    ) -> tuple[list[Unsent], list[InboxItem]]:
        """Recover a dead holder's messages, gather unsent replies, take the pending batch."""
        session_id = lease.session_id
        params = {"sid": session_id, "token": token, "now": utcnow()}
        with self._runtime.transaction(write=True) as conn:
            self._check(conn, lease)
            conn.execute(_ABANDONED, {
                **params, "max_attempts": max_attempts,
                "error": "the worker handling it stopped (its lease expired)",
            })
            unsent = self._answered(conn, session_id, params)
            items = self._take_pending(conn, session_id, params)
        return unsent, items

    def _take_pending(
        self, conn: Connection, session_id: str, params: dict[str, Any]
    ) -> list[InboxItem]:
        """Mark the pending messages in flight; one that cannot be read is dead at once."""
        items, taken = [], []
        for row in conn.execute(_PENDING, params).all():
            try:
                items.append(self._item(session_id, row))
            except CorruptRowError as exc:
                dead = {"row_id": row.id, "error": str(exc), "now": params["now"]}
                conn.execute(_UNREADABLE, dead)
                continue
            taken.append(row.id)
        if taken:
            conn.execute(_TAKE_ITEMS, {**params, "ids": taken})
        return items

    def _answered(self, conn: Connection, session_id: str, params: dict[str, Any]) -> list[Unsent]:
        """Replies stored and not sent, each taken under a token of ours; empty ones are done."""
        groups: dict[str | None, list[Any]] = {}
        for row in conn.execute(_ANSWERED, params):
            groups.setdefault(row.batch_token, []).append(row)
        unsent: list[Unsent] = []
        for rows in groups.values():
            ids = [row.id for row in rows]
            reply = rows[-1].reply
            if reply is None:
                conn.execute(_NOTHING_TO_SEND, {**params, "ids": ids})
                continue
            try:
                text = self._sealer.open_text(session_id, rows[-1].id, reply, _TABLE)
            except CorruptRowError as exc:  # a reply no one can send: never blocks the rest
                for row in rows:
                    conn.execute(_UNREADABLE, {"row_id": row.id, "error": str(exc), **params})
                continue
            token = resumed_token(params["token"], len(unsent))
            conn.execute(_RESUME, {**params, "ids": ids, "token": token})
            message_ids = tuple(row.message_id for row in rows)
            unsent.append(Unsent(token, InboxReply(session_id, text, message_ids)))
        return unsent

    def _item(self, session_id: str, row: Any) -> InboxItem:
        return InboxItem(
            message_id=row.message_id,
            session_id=session_id,
            text=self._sealer.open_text(session_id, row.id, row.text, _TABLE),
            sent_at=row.sent_at,
            received_at=row.received_at,
            payload=self._sealer.open_json(session_id, row.id, row.payload, _TABLE),
            attempts=row.attempts + 1,
        )

    def finish(self, lease: Lease, token: str, reply: str | None, to_send: bool) -> bool:
        """Store the reply; the items are done, or in flight until sent."""
        sealed = None if reply is None else self._sealer.seal_text(lease.session_id, reply)
        params = {
            "token": token, "reply": sealed, "now": utcnow(),
            "state": IN_FLIGHT if to_send else DONE,
        }
        with self._runtime.transaction(write=True) as conn:
            if conn.execute(KEEP_HELD, self._lease_params(lease)).rowcount != 1:
                return False
            conn.execute(_FINISH, params)
        return True

    def sent(self, token: str) -> None:
        """The reply was sent: recorded whatever the lease, since it is true."""
        with self._runtime.transaction(single=True) as conn:
            conn.execute(_SENT, {"token": token, "now": utcnow()})

    def failed(
        self, lease: Lease, token: str, error: str, retry_in: float, max_attempts: int
    ) -> None:
        """Back to pending after ``retry_in`` seconds, or dead after ``max_attempts``."""
        now = utcnow()
        params = {
            "token": token, "now": now, "error": error, "max_attempts": max_attempts,
            "retry_at": now + timedelta(seconds=retry_in), "retry_seconds": retry_in,
        }
        with self._runtime.transaction(write=True) as conn:
            self._check(conn, lease)
            conn.execute(_FAILED, params)

    def undeliverable(self, lease: Lease, token: str, error: str) -> None:
        """``send`` kept failing: the items are dead, their reply kept for a retry."""
        with self._runtime.transaction(write=True) as conn:
            self._check(conn, lease)
            conn.execute(_UNDELIVERABLE, {"token": token, "error": error, "now": utcnow()})

    def abandon(self, lease: Lease, token: str) -> None:
        """``serve`` stopped during ``handle``: unanswered items pending again, uncounted."""
        with self._runtime.transaction(write=True) as conn:
            self._check(conn, lease)
            conn.execute(_ABANDON, {"token": token, "now": utcnow()})

    def entries(self, state: str | None, limit: int | None) -> list[InboxEntry]:
        """Messages in arrival order, optionally of one state."""
        query = select(*_ENTRY_COLUMNS).order_by(_i.c.id)
        if state is not None:
            query = query.where(_i.c.state == state)
        if limit is not None:
            query = query.limit(limit)
        with self._runtime.transaction() as conn:
            return [InboxEntry(*row) for row in conn.execute(query)]

    def retry(self, message_id: str) -> bool:
        """A dead message, with the rest of its dead batch, back to pending."""
        with self._runtime.transaction(write=True) as conn:
            found = conn.execute(_DEAD_TOKEN, {"message_id": message_id}).first()
            if found is None:
                return False
            conn.execute(_RETRY, {"retry_id": message_id, "token": found[0], "now": utcnow()})
        return True

    def stats(self) -> InboxStats:
        """Counts per state, oldest pending age (database clock), dead in the last hour."""
        now = utcnow()
        with self._runtime.transaction() as conn:
            counts = dict.fromkeys(INBOX_STATES, 0)
            counts.update({state: int(n) for state, n in conn.execute(_COUNTS)})
            clock, oldest = conn.execute(_OLDEST_PENDING, {"now": now}).one()
            dead = conn.execute(_DEAD_LAST_HOUR, {"hour_ago": now - timedelta(hours=1)})
            dead_last_hour = int(dead.scalar() or 0)
        age = None if oldest is None else max(0.0, (clock - oldest).total_seconds())
        return InboxStats(counts, age, dead_last_hour)

    def purge(self, older_than_seconds: float) -> int:
        """Delete done and sent messages older than the dedup window."""
        params = {"cutoff": utcnow() - timedelta(seconds=older_than_seconds),
                  "older_than": older_than_seconds}
        with self._runtime.transaction(single=True) as conn:
            return int(conn.execute(_PURGE, params).rowcount)

    def _check(self, conn: Connection, lease: Lease) -> None:
        """First statement of a batch's transaction: the lease still holds (and is moved on)."""
        if conn.execute(KEEP_HELD, self._lease_params(lease)).rowcount != 1:
            raise LeaseLostError(lease.session_id)

    def _lease_params(self, lease: Lease) -> dict[str, Any]:
        return {**lease_params(lease), **self._leases.until_params()}
