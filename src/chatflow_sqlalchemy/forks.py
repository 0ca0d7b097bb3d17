"""Forks: a new session that starts as a copy of another one's first turns (``store.fork``).

The rules every store shares, without SQL: which arguments are accepted and
which messages of the source's window a fork takes. A fork holds the
source's SYSTEM messages and its first ``at_turn`` complete turns (all of
them when ``at_turn`` is None), with the seqs they have in the source, so
what the fork writes next comes after them. The stores copy the rest (the
summary, the active agent, the metadata, the owner) and record where the fork
came from; the SQL one in :meth:`~chatflow_sqlalchemy.store.SQLAlchemySessionStore.fork`.
"""

from __future__ import annotations

from typing import NamedTuple

from chatflow_agent import Message, Role

from chatflow_sqlalchemy.values import validate_id, validate_session_id

__all__ = [
    "ForkedWindow",
    "fork_window",
    "no_such_session",
    "session_exists",
    "validate_fork",
]


class ForkedWindow(NamedTuple):
    """The messages a fork starts with, their seqs, and how many turns they hold."""

    messages: list[Message]
    seqs: list[int]
    turns: int
    """The number of the source's turns taken: the fork's ``forked_at_turn``."""


def validate_fork(session_id: object, new_session_id: object, at_turn: object) -> None:
    """Check the arguments of ``fork``; a bad one raises ``ValueError`` saying what to pass.

    Raises:
        ValueError: An invalid id, the same id twice, or an ``at_turn`` that is
            neither None nor a non-negative int.

    """
    validate_session_id(session_id)
    validate_id(new_session_id, "new_session_id")
    if new_session_id == session_id:
        raise ValueError(
            f"new_session_id is the session being forked ({session_id!r}): a fork is a new "
            "session, give it an id of its own"
        )
    if at_turn is not None and (
        isinstance(at_turn, bool) or not isinstance(at_turn, int) or at_turn < 0
    ):
        raise ValueError(
            "at_turn must be None (every turn of the window) or a number of turns >= 0, "
            f"got {at_turn!r}"
        )


def fork_window(
    session_id: str, messages: list[Message], seqs: list[int], at_turn: int | None
) -> ForkedWindow:
    """What a fork of ``session_id`` takes of its window (``messages`` with ``seqs``).

    The window is in canonical order (SYSTEM messages first, then whole turns,
    each opened by a USER message), as contexts and the stored rows keep it.
    A tool call left without its result at the end of what is taken (a
    tool still running for the source) is not copied: the fork would never
    get its result.

    Raises:
        ValueError: ``at_turn`` is more than the window's turns (the message says how many).

    """
    systems = 0
    while systems < len(messages) and messages[systems].role == Role.SYSTEM:
        systems += 1
    starts = [i for i in range(systems, len(messages)) if messages[i].role == Role.USER]
    taken = len(starts) if at_turn is None else at_turn
    if taken > len(starts):
        raise ValueError(
            f"cannot fork session {session_id!r} at turn {at_turn}: its window holds "
            f"{len(starts)} turn(s); pass at_turn from 0 to {len(starts)}, or None for all "
            "(pruned turns are no longer in the window)"
        )
    end = starts[taken] if taken < len(starts) else len(messages)
    while end > systems and messages[end - 1].role == Role.MODEL and messages[end - 1].tool_calls:
        end -= 1  # a tool call: its result would never come (the tool runs for the source)
    return ForkedWindow(list(messages[:end]), list(seqs[:end]), taken)


def no_such_session(session_id: str) -> ValueError:
    """The error of a fork whose source does not exist (what every store raises)."""
    return ValueError(
        f"cannot fork session {session_id!r}: there is no such session (list them with "
        "store.list_sessions())"
    )


def session_exists(new_session_id: str) -> ValueError:
    """The error of a fork onto an id that is taken (what every store raises)."""
    return ValueError(
        f"cannot fork into {new_session_id!r}: a session with that id exists already; "
        "pick a new id (or delete that session first)"
    )
