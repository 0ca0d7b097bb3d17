"""How a context and its session's stored rows are reconciled.

A context holds a window of a conversation; the database holds what every
writer committed. These rules decide what memory shows of the rows (a hidden
unanswered tool call, leading rows upstream's store left), when rows read from
the database may replace what a context holds, and which message a context
must carry over when another writer moved the session.
"""

from __future__ import annotations

from chatflow_agent import Agent, Message, Role

from chatflow_sqlalchemy.context import SUMMARY_SEQ, DurableState, SessionContext, dump_metadata
from chatflow_sqlalchemy.rows import StoredSession

__all__ = [
    "has_changes",
    "holds_newer_than",
    "incarnation_of",
    "install",
    "orphaned_tool_call",
    "other_incarnation",
    "repair_window",
    "summary_changed",
    "unsaved_tail_call",
]


def install(
    ctx: SessionContext,
    stored: StoredSession,
    agent: Agent,
    shown: frozenset[int] | set[int] = frozenset(),
) -> None:
    """Load ``stored`` into ``ctx``; ``shown`` are the seqs ``ctx`` shows already."""
    window, seqs, hidden = repair_window(stored.messages, stored.seqs, shown)
    durable = DurableState(
        version=stored.version,
        seqs=set(stored.seqs).difference(hidden),
        agent_name=stored.agent_name,
        metadata_json=dump_metadata(stored.metadata),
        incarnation=stored.created_at,
        hidden=frozenset(hidden),
        summary=stored.summary,
        summary_through=stored.summary_through,
    )
    ctx._load(window, seqs, agent, stored.metadata, durable)
    # A seq names one message in the transcript (archive and window merged by
    # seq): never reuse an archived one (a rewound turn's, or one a fork copied
    # to wait for its summary) for a new message.
    ctx._next_seq = max(ctx._next_seq, stored.archived_through + 1)
    ctx.forked_from, ctx.forked_at_turn = stored.forked_from, stored.forked_at_turn


def repair_window(
    messages: list[Message], seqs: list[int], shown: frozenset[int] | set[int] = frozenset()
) -> tuple[list[Message], list[int], set[int]]:
    """The window memory shows of the stored rows, and the seqs of the rows it hides.

    * Leading non-USER messages (only a file written by upstream holds them)
      are dropped; their rows are deleted by the next write.
    * A trailing tool call without its result is hidden (returned as hidden):
      it was written outside a turn by a writer that died or is still running
      the tool. The context that wrote it (``shown``: the seqs a context shows
      already) keeps it, so its result lands after it; the rows are deleted
      only when a later message makes the result impossible.
    """
    end = len(messages)
    while (
        end > 0
        and messages[end - 1].role == Role.MODEL
        and messages[end - 1].tool_calls
        and seqs[end - 1] not in shown
    ):
        end -= 1
    hidden = set(seqs[end:])
    first = 0
    while first < end and messages[first].role == Role.SYSTEM:
        first += 1
    start = first
    while start < end and messages[start].role != Role.USER:
        start += 1
    if start == first and end == len(messages):
        return messages, seqs, hidden
    return (
        messages[:first] + messages[start:end],
        seqs[:first] + seqs[start:end],
        hidden,
    )


def incarnation_of(ctx: SessionContext) -> object:
    """The ``created_at`` of the session row ``ctx`` was last read from (None: none yet)."""
    durable = ctx._durable
    return None if durable is None else durable.incarnation


def other_incarnation(ctx: SessionContext, stored: StoredSession) -> bool:
    """True if ``stored`` is a later session under ``ctx``'s id (deleted and created anew).

    Versions cannot tell: a new session starts at a random version. The row's
    ``created_at`` can, and is read only when the version has moved.
    """
    durable = ctx._durable
    known = None if durable is None else durable.incarnation
    return known is not None and stored.created_at is not None and stored.created_at != known


def holds_newer_than(ctx: SessionContext, stored: StoredSession) -> bool:
    """True if installing ``stored`` would throw away what a turn or a write holds.

    Another thread may look a context up (and so refresh it) while a turn is
    open on it, between the end of a turn and its write, or (native async,
    where a greenlet on the loop thread re-enters the context's mutex) while a
    write is in progress: the unsaved messages must stay, and the write
    rebases them onto whatever the database holds by then. A context that
    wrote meanwhile is newer than what was read before that write. A stale
    context holds nothing worth keeping.
    """
    durable = ctx._durable
    if durable is None or ctx._stale:
        return False
    return ctx._in_turn or ctx._writing > 0 or durable.version >= stored.version


def has_changes(ctx: SessionContext) -> bool:
    """True if ``ctx`` differs from what the database last held for it."""
    durable = ctx._durable
    assert durable is not None
    shown = len(ctx._seqs) - (ctx.summary is not None)
    if ctx.active_agent.name != durable.agent_name or shown != len(durable.seqs):
        return True
    if ctx._cleared or summary_changed(ctx):
        return True  # a clear: also what another writer added before it must go
    if any(seq not in durable.seqs for seq in reversed(ctx._seqs) if seq != SUMMARY_SEQ):
        return True  # new ones are last
    return dump_metadata(ctx._metadata) != durable.metadata_json


def summary_changed(ctx: SessionContext) -> bool:
    """True if ``ctx``'s summary is not the one the database last held for it."""
    durable = ctx._durable
    assert durable is not None
    return (ctx.summary, ctx.summary_through) != (durable.summary, durable.summary_through)


def unsaved_tail_call(ctx: SessionContext) -> Message | None:
    """``ctx``'s last message if it is a tool call not written yet (carried, see below)."""
    durable = ctx._durable
    if durable is None or not ctx._seqs or ctx._seqs[-1] in durable.seqs:
        return None
    message = ctx._history[-1]
    return message if message.role == Role.MODEL and message.tool_calls else None


def orphaned_tool_call(ctx: SessionContext, stored: StoredSession) -> Message | None:
    """``ctx``'s stored trailing tool call whose row another writer deleted, if any.

    A process that wrote a tool call outside a turn and is running the tool
    still holds the call; another process that loaded the session meanwhile
    hid the unanswered call and, when it appended a message, deleted it. The
    call then goes after the other writer's rows again, so the result that
    follows it is never stored without its call.
    """
    durable = ctx._durable
    if durable is None:
        return None
    index = len(ctx._seqs) - 1
    while index >= 0 and ctx._seqs[index] not in durable.seqs:
        index -= 1  # skip the unsaved messages after it
    if index < 0:
        return None
    message = ctx._history[index]
    if message.role != Role.MODEL or not message.tool_calls:
        return None
    return None if ctx._seqs[index] in stored.seqs else message
