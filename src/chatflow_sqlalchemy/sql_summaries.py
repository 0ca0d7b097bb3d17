"""Summaries on the SQL stores: the claim on the session row and the archive's pending rows.

What summaries do is described in :mod:`chatflow_sqlalchemy.summaries`;
this module is their rows (:class:`SQLSummaries`, a
:class:`~chatflow_sqlalchemy.summaries.SummaryRows`) in portable Core. The
claim's deadline is set and compared by the database's clock.
"""

from __future__ import annotations

from chatflow_agent import Message
from sqlalchemy import Float, bindparam, exists, or_, select, update

from chatflow_sqlalchemy import tables
from chatflow_sqlalchemy.clock import DatabaseNow
from chatflow_sqlalchemy.context import SessionContext
from chatflow_sqlalchemy.crypto import is_encrypted
from chatflow_sqlalchemy.rows import messages as _m
from chatflow_sqlalchemy.rows import parse_message
from chatflow_sqlalchemy.runtime import StoreRuntime
from chatflow_sqlalchemy.sealing import Sealer
from chatflow_sqlalchemy.sql_lifecycle import parser_for
from chatflow_sqlalchemy.summaries import CLAIM_SECONDS, PendingSummary
from chatflow_sqlalchemy.tables import UTCDateTime
from chatflow_sqlalchemy.values import utcnow

__all__ = ["SQLSummaries"]

_s = tables.sessions
_a = tables.message_archive
_NOW = DatabaseNow(bindparam("now", type_=UTCDateTime()))
_UNTIL = DatabaseNow(bindparam("until", type_=UTCDateTime()), bindparam("seconds", type_=Float()))
_OF_SESSION = _s.c.session_id == bindparam("sid")

_CLAIM = (
    update(_s)
    .where(_OF_SESSION, or_(_s.c.summary_claimed_until.is_(None),
                            _s.c.summary_claimed_until <= _NOW))
    .values(summary_claimed_until=_UNTIL)
)
_GIVE_UP = update(_s).where(_OF_SESSION).values(summary_claimed_until=None)
_SUMMARY = select(_s.c.summary, _s.c.summary_through, _s.c.created_at).where(_OF_SESSION)
_PENDING = (
    select(_a.c.id, _a.c.seq, _a.c.message_json)
    .where(
        _a.c.session_id == bindparam("sid"),
        _a.c.pending_summary,
        _a.c.seq > bindparam("through"),  # older ones are covered: settled by the next write
        ~exists().where(  # back in the window (a rollback undid the prune): not dropped
            _m.c.session_id == _a.c.session_id, _m.c.seq == _a.c.seq
        ),
    )
    .order_by(_a.c.seq, _a.c.id)
)


class SQLSummaries:
    """The summaries' rows of a SQL store.

    Args:
        runtime: Where the statements run.
        sealer: Opens what the store encrypts at rest.

    """

    def __init__(self, runtime: StoreRuntime, sealer: Sealer) -> None:
        self._runtime = runtime
        self._sealer = sealer
        self._parse = parser_for(_a, sealer.parser(parse_message))

    def claim(self, session_id: str) -> PendingSummary | None:
        """Claim the session's summarizing and read its input (None: taken, or nothing waits)."""
        now = utcnow()
        params = {"sid": session_id, "now": now, "until": now, "seconds": CLAIM_SECONDS}
        with self._runtime.transaction(write=True) as conn:
            if conn.execute(_CLAIM, params).rowcount != 1:
                return None
            summary, through, created_at = conn.execute(_SUMMARY, params).one()
            params["through"] = through
            rows = conn.execute(_PENDING, params).all()
            if not rows:
                conn.execute(_GIVE_UP, params)
                return None
        by_seq: dict[int, Message] = {}
        for row in rows:  # a seq archived twice (restored, then pruned again): the latest
            by_seq[row.seq] = self._parse(session_id, row.id, row.message_json)
        if summary is not None and (self._sealer.active or is_encrypted(summary)):
            summary = self._sealer.open_text(session_id, None, summary, _s.name)
        return PendingSummary(
            previous=summary,
            through=int(through),
            dropped=[by_seq[seq] for seq in sorted(by_seq)],
            last_seq=max(by_seq),
            incarnation=created_at,
        )

    def give_up(self, session_id: str) -> None:
        """Give back the claim; the pending rows wait for the next prune."""
        with self._runtime.transaction(single=True) as conn:
            conn.execute(_GIVE_UP, {"sid": session_id})

    def incarnation(self, ctx: SessionContext) -> object:
        """The ``created_at`` of the session row ``ctx`` was read from (as ``claim`` reads it)."""
        return ctx.incarnation
