"""The durable inbox on the SQL stores: ``chatflow_inbox`` and the sessions' leases.

:class:`SQLInbox` is :class:`~chatflow_sqlalchemy.inbox.InboxRows` in portable
Core. Every time a statement stores or compares is the database's clock, as
for the leases, and every call made for a batch first checks, in its own
transaction, that the batch still holds its session's lease, so a worker
that lost it changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import (
    Connection,
    Executable,
    Float,
    Integer,
    Update,
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
from chatflow_sqlalchemy.inbox import (
    BATCH_LIMIT,
    DEAD,
    DONE,
    IN_FLIGHT,
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
from chatflow_sqlalchemy.inbox_reads import read_entries, read_stats
from chatflow_sqlalchemy.lease import KEEP_HELD, free_at, lease_params
from chatflow_sqlalchemy.runtime import retrying_deadlocks
from chatflow_sqlalchemy.tables import UTCDateTime
from chatflow_sqlalchemy.values import Lease, utcnow

if TYPE_CHECKING:
    from chatflow_sqlalchemy.lease import SessionLeases
    from chatflow_sqlalchemy.runtime import RunBlocking, StoreRuntime
    from chatflow_sqlalchemy.sealing import Sealer
    from chatflow_sqlalchemy.turns import Turns

__all__ = ["ANSWER_BATCH", "SQLInbox"]

_T = TypeVar("_T")

_i = tables.inbox
_TABLE = _i.name
_NOW = DatabaseNow(bindparam("now", type_=UTCDateTime()))
_ABANDONED_ERROR = "the worker handling it stopped (its lease expired)"


def _clock(name: str, seconds: str, sign: int) -> DatabaseNow:
    """The database's clock moved by ``sign`` times the ``seconds`` parameter."""
    moved = bindparam(seconds, type_=Float())
    return DatabaseNow(bindparam(name, type_=UTCDateTime()), -moved if sign < 0 else moved)


def _moved(
    now: datetime, name: str, seconds_name: str, seconds: float, sign: int
) -> dict[str, Any]:
    """The parameters of :func:`_clock`: the worker's value and the seconds."""
    return {name: now + timedelta(seconds=sign * seconds), seconds_name: seconds}


def _state(name: str) -> Any:
    """A state as an inline constant: one cached statement whatever the values."""
    return literal_column(f"'{name}'")


def _where(*conditions: Any) -> Update:
    return update(_i).where(*conditions)


_OF_BATCH = (_i.c.batch_token == bindparam("token")) & (_i.c.state == _state(IN_FLIGHT))
_OF_IDS = _i.c.id.in_(bindparam("ids", expanding=True))
_OF_SESSION = _i.c.session_id == bindparam("sid")
_LIVE = _i.c.state.in_([_state(PENDING), _state(IN_FLIGHT)])

ANSWER_BATCH = _where(_OF_BATCH).values(
    answered_at=_NOW, reply=bindparam("reply"), updated_at=_NOW
)
"""What a batch's turn adds to its write transaction: the reply, the items answered."""

_PUT = insert(_i).values(received_at=_NOW, updated_at=_NOW, state=_state(PENDING), attempts=0)
_READY = (
    select(_i.c.session_id)
    .select_from(_i.outerjoin(tables.sessions, tables.sessions.c.session_id == _i.c.session_id))
    .where(
        _LIVE,
        or_(tables.sessions.c.session_id.is_(None), free_at(_NOW)),
        _i.c.session_id.not_in(bindparam("busy", expanding=True)),
    )
    .group_by(_i.c.session_id)
    .having(or_(
        func.max(case((_i.c.state == _state(IN_FLIGHT), 1), else_=0)) == 1,
        and_(
            func.max(case((_i.c.not_before > _NOW, 1), else_=0)) == 0,
            or_(
                func.max(_i.c.received_at) <= _clock("coalesced", "coalesce_seconds", -1),
                func.min(_i.c.received_at) <= _clock("waited", "wait_seconds", -1),
            ),
        ),
    ))
    .order_by(func.min(_i.c.id))
    .limit(bindparam("limit", type_=Integer()))
)


def _dead_if(condition: Any) -> dict[str, Any]:
    """Dead (its batch token kept, for ``retry``) if ``condition``, else pending."""
    return {"state": case((condition, _state(DEAD)), else_=_state(PENDING)),
            "batch_token": case((condition, _i.c.batch_token), else_=null())}


_ABANDONED = _where(
    _OF_SESSION, _i.c.state == _state(IN_FLIGHT), _i.c.answered_at.is_(None)
).values(
    error=bindparam("error"), updated_at=_NOW,
    **_dead_if(_i.c.attempts >= bindparam("max_attempts")),
)
_ANSWERED = (
    select(_i.c.id, _i.c.batch_token, _i.c.message_id, _i.c.reply)
    .where(_OF_SESSION, _i.c.answered_at.is_not(None), _LIVE)
    .order_by(_i.c.id)
)
_RESUME = _where(_OF_IDS).values(
    state=_state(IN_FLIGHT), batch_token=bindparam("token"), updated_at=_NOW
)
_NOTHING_TO_SEND = _where(_OF_IDS).values(state=_state(DONE), updated_at=_NOW)
_PENDING = (
    select(_i.c.id, _i.c.message_id, _i.c.text, _i.c.sent_at, _i.c.received_at, _i.c.payload,
           _i.c.attempts)
    .where(_OF_SESSION, _i.c.state == _state(PENDING), _i.c.answered_at.is_(None))
    .order_by(func.coalesce(_i.c.sent_at, _i.c.received_at), _i.c.id)
    .limit(BATCH_LIMIT)
)
_TAKE_ITEMS = _where(_OF_IDS).values(
    state=_state(IN_FLIGHT), batch_token=bindparam("token"), attempts=_i.c.attempts + 1,
    not_before=null(), updated_at=_NOW,
)
_UNREADABLE = _where(_i.c.id == bindparam("row_id")).values(
    state=_state(DEAD), error=bindparam("error"), updated_at=_NOW
)
_FINISH = _where(_OF_BATCH).values(
    reply=bindparam("reply"), answered_at=func.coalesce(_i.c.answered_at, _NOW),
    state=bindparam("state"), updated_at=_NOW,
)
_SENT = _where(_OF_BATCH).values(state=_state(SENT), updated_at=_NOW)
# A failed batch's item is dead after its last attempt, or at once if its turn committed
# (running the turn again would repeat it; its reply is withheld until an operator retries).
_FAILED = _where(_OF_BATCH).values(
    not_before=_clock("retry_at", "retry_seconds", 1), error=bindparam("error"), updated_at=_NOW,
    **_dead_if(or_(_i.c.attempts >= bindparam("max_attempts"), _i.c.answered_at.is_not(None))),
)
_UNDELIVERABLE = _where(_OF_BATCH).values(
    state=_state(DEAD), error=bindparam("error"), updated_at=_NOW
)
_ABANDON = _where(_OF_BATCH, _i.c.answered_at.is_(None)).values(
    state=_state(PENDING), attempts=_i.c.attempts - 1, batch_token=null(), updated_at=_NOW
)
_DEAD_TOKEN = select(_i.c.batch_token).where(
    _i.c.message_id == bindparam("message_id"), _i.c.state == _state(DEAD)
)
_RETRY = _where(
    _i.c.state == _state(DEAD),
    or_(_i.c.message_id == bindparam("retry_id"), _i.c.batch_token == bindparam("token")),
).values(state=_state(PENDING), attempts=0, not_before=null(), updated_at=_NOW)
_PURGE = _i.delete().where(
    _i.c.state.in_([_state(DONE), _state(SENT)]),
    _i.c.updated_at < _clock("cutoff", "older_than", -1),
)


class SQLInbox:
    """:class:`~chatflow_sqlalchemy.inbox.InboxRows` on a SQL store.

    Args:
        runtime: Where the statements run.
        run_blocking: The store's way to run blocking work off the loop.
        leases: The store's session leases (the turns' own).
        turns: The store's turns, lent a batch's lease while its ``handle`` runs.
        sealer: Seals text and replies as the store seals message content.
        create_empty: Creates a session with no agent yet, for a lease before its first turn.
        warm: Caches the context of a session held at a version.

    """

    def __init__(
        self,
        runtime: StoreRuntime,
        run_blocking: RunBlocking,
        leases: SessionLeases,
        turns: Turns,
        sealer: Sealer,
        *,
        create_empty: Callable[[str], None],
        warm: Callable[[str, int], None],
    ) -> None:
        self._runtime = runtime
        self._run_blocking = run_blocking
        self._leases = leases
        self._turns = turns
        self._sealer = sealer
        self._create_empty = create_empty
        self._warm = warm

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run blocking work as the store's async API does."""
        return await self._run_blocking(fn, *args)

    def put(
        self, message_id: str, session_id: str, text: str, sent_at: datetime | None, payload: Any
    ) -> bool:
        """Insert a pending message; False if the id is in the inbox (its unique key)."""
        seal = self._sealer
        try:
            self._execute(_PUT, {
                "message_id": message_id, "session_id": session_id, "sent_at": sent_at,
                "text": seal.seal_text(session_id, text),
                "payload": seal.seal_json(session_id, payload),
            })
        except sa_exc.IntegrityError:
            return False
        return True

    def ready(self, coalesce_seconds: float, limit: int, busy: Collection[str]) -> list[str]:
        """Sessions whose batch is due and whose lease is free."""
        now = utcnow()
        waited = coalesce_seconds * MAX_COALESCE_FACTOR
        params = {
            "now": now, "busy": sorted(busy) or [""], "limit": limit,
            **_moved(now, "coalesced", "coalesce_seconds", coalesce_seconds, -1),
            **_moved(now, "waited", "wait_seconds", waited, -1),
        }
        with self._runtime.transaction(single=True) as conn:
            return [row[0] for row in conn.execute(_READY, params)]

    def take(self, session_id: str) -> Lease | None:
        """The session's lease (the session created empty if new), lent to the store's turns."""
        try:
            lease = self._leases.take(session_id)
        except SessionDeletedError:
            self._create_empty(session_id)
            lease = self._leases.take(session_id)
        if lease is not None:
            lease.kept = True
            self._turns.lend(lease)
        return lease

    def warm(self, lease: Lease) -> None:
        """Cache the session's context (read at the lease's version) before ``handle``."""
        self._warm(lease.session_id, lease.version)

    def renew(self, lease: Lease) -> bool:
        """Move the lease on; False if lost."""
        return self._leases.renew(lease)

    def release(self, lease: Lease) -> None:
        """Give the lease back."""
        self._turns.unlend(lease)
        self._leases.release(lease)

    def open_batch(
        self, lease: Lease, token: str, max_attempts: int
    ) -> tuple[list[Unsent], list[InboxItem]]:
        """Recover a dead holder's messages, gather unsent replies, take the pending batch."""
        params = {"sid": lease.session_id, "token": token, "now": utcnow()}
        with self._runtime.transaction(write=True) as conn:
            self._check(conn, lease)
            conn.execute(
                _ABANDONED, {**params, "max_attempts": max_attempts, "error": _ABANDONED_ERROR}
            )
            unsent = self._answered(conn, lease.session_id, params)
            items = self._take_pending(conn, lease.session_id, params)
        return unsent, items

    def _take_pending(
        self, conn: Connection, session_id: str, params: dict[str, Any]
    ) -> list[InboxItem]:
        """Mark the pending messages in flight; one that cannot be read is dead at once."""
        items, taken = [], []
        for row in conn.execute(_PENDING, params).all():
            try:
                items.append(InboxItem(
                    message_id=row.message_id,
                    session_id=session_id,
                    text=self._sealer.open_text(session_id, row.id, row.text, _TABLE),
                    sent_at=row.sent_at,
                    received_at=row.received_at,
                    payload=self._sealer.open_json(session_id, row.id, row.payload, _TABLE),
                    attempts=row.attempts + 1,
                ))
            except CorruptRowError as exc:
                conn.execute(_UNREADABLE, {**params, "row_id": row.id, "error": str(exc)})
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
            if rows[-1].reply is None:
                conn.execute(_NOTHING_TO_SEND, {**params, "ids": ids})
                continue
            try:
                text = self._sealer.open_text(session_id, rows[-1].id, rows[-1].reply, _TABLE)
            except CorruptRowError as exc:  # a reply no one can send: never blocks the rest
                for row in rows:
                    conn.execute(_UNREADABLE, {**params, "row_id": row.id, "error": str(exc)})
                continue
            token = resumed_token(params["token"], len(unsent))
            conn.execute(_RESUME, {**params, "ids": ids, "token": token})
            message_ids = tuple(row.message_id for row in rows)
            unsent.append(Unsent(token, InboxReply(session_id, text, message_ids)))
        return unsent

    def finish(self, lease: Lease, token: str, reply: str | None, to_send: bool) -> bool:
        """Store the reply; the items are done, or in flight until sent."""
        sealed = None if reply is None else self._sealer.seal_text(lease.session_id, reply)
        state = IN_FLIGHT if to_send else DONE
        try:
            self._fenced(lease, _FINISH, {"token": token, "reply": sealed, "state": state})
        except LeaseLostError:
            return False
        return True

    def sent(self, token: str) -> None:
        """The reply was sent: recorded whatever the lease, since it is true."""
        self._execute(_SENT, {"token": token})

    def failed(
        self, lease: Lease, token: str, error: str, retry_in: float, max_attempts: int
    ) -> None:
        """Back to pending after ``retry_in`` seconds, or dead."""
        self._fenced(lease, _FAILED, {
            "token": token, "error": error, "max_attempts": max_attempts,
            **_moved(utcnow(), "retry_at", "retry_seconds", retry_in, 1),
        })

    def undeliverable(self, lease: Lease, token: str, error: str) -> None:
        """``send`` kept failing: the items are dead, their reply kept for a retry."""
        self._fenced(lease, _UNDELIVERABLE, {"token": token, "error": error})

    def abandon(self, lease: Lease, token: str) -> None:
        """``serve`` stopped during ``handle``: unanswered items pending again, uncounted."""
        self._fenced(lease, _ABANDON, {"token": token})

    def entries(self, state: str | None, limit: int | None) -> list[InboxEntry]:
        """Messages in arrival order, optionally of one state."""
        with self._runtime.transaction() as conn:
            return read_entries(conn, state, limit)

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
        with self._runtime.transaction() as conn:
            return read_stats(conn)

    def purge(self, older_than_seconds: float) -> int:
        """Delete done and sent messages older than the dedup window."""
        params = _moved(utcnow(), "cutoff", "older_than", older_than_seconds, -1)
        return retrying_deadlocks(lambda: self._execute(_PURGE, params))

    def _execute(self, statement: Executable, params: dict[str, Any]) -> int:
        """One statement on its own (autocommit), at the worker's ``now``; rows it changed."""
        with self._runtime.transaction(single=True) as conn:
            return int(conn.execute(statement, {"now": utcnow(), **params}).rowcount)

    def _fenced(self, lease: Lease, statement: Executable, params: dict[str, Any]) -> None:
        """``statement`` in a write transaction that first checks (and moves on) the lease."""
        with self._runtime.transaction(write=True) as conn:
            self._check(conn, lease)
            conn.execute(statement, {"now": utcnow(), **params})

    def _check(self, conn: Connection, lease: Lease) -> None:
        params = {**lease_params(lease), **self._leases.until_params()}
        if conn.execute(KEEP_HELD, params).rowcount != 1:
            raise LeaseLostError(lease.session_id)
