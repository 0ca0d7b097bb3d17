"""The session context: a conversation's history window, active agent and metadata.

:class:`SessionContext` keeps upstream's public behaviour, with incremental
pruning, exact ``rollback_to``, thread-safe mutation and
:class:`~chatflow_sqlalchemy.exceptions.SessionDeletedError` for a deleted
session. A context a store hands out is *attached*: each change outside
``session.lock`` is written at once, a turn's changes in one transaction
when the lock is released (a failed turn is a plain discard).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timezone
from types import TracebackType
from typing import Any

from chatflow_agent import Agent, Message, Role
from chatflow_agent import SessionContext as _UpstreamSessionContext
from pydantic_core import to_json

from chatflow_sqlalchemy.exceptions import SessionDeletedError
from chatflow_sqlalchemy.values import (
    METADATA_MAX_DEPTH,
    UNBORN_AGENT,
    check_metadata,
    dump_metadata,
    validate_id,
    validate_session_id,
)

__all__ = [
    "METADATA_MAX_DEPTH",
    "SUMMARY_SEQ",
    "Checkpoint",
    "ContextOwner",
    "PendingWrite",
    "SessionContext",
    "StoredSession",
    "TurnLock",
    "check_metadata",
    "dump_message",
    "dump_metadata",
    "repair_window",
    "validate_agent",
    "validate_id",
    "validate_max_turns",
    "validate_session_id",
]

_JOURNAL_LIMIT = 64
"""Rollback points kept per context (bounded so long-lived contexts stay small)."""

SUMMARY_SEQ = 0
"""The seq of the summary's SYSTEM message in memory; no stored row has it (rows start at 1)."""

SUMMARY_HEADER = "Summary of the earlier conversation (its turns are no longer shown):\n"
"""What the summary's SYSTEM message says before the summary itself."""

SUMMARY_TIMESTAMP = datetime(1970, 1, 1, tzinfo=timezone.utc)
"""The summary message's timestamp: fixed, so a reload shows the very same message."""


def validate_agent(agent: Agent) -> Agent:
    """Return ``agent`` if its name can be stored as the session's agent (:func:`validate_id`)."""
    try:
        validate_id(agent.name, "agent name")
    except ValueError as exc:
        reason = f"{exc} (the session stores its agent by name: rename the agent)"
        raise ValueError(reason) from None
    return agent


def validate_max_turns(value: object, name: str = "max_turns") -> int:
    """Return ``value`` if it is a positive int, else raise ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def dump_message(message: Message) -> str:
    """A message as the JSON stored in ``message_json``, which reads back equal.

    Tool calls and results may hold NaN or infinities, which pydantic writes as
    ``null`` by default: those are written as ``NaN``/``Infinity`` constants.
    """
    if message.tool_calls is None and message.tool_results is None:
        return message.model_dump_json()
    return to_json(message.model_dump(), inf_nan_mode="constants").decode()


def _rewind_count(turns: object) -> int:
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        raise ValueError(f"turns must be a positive int, got {turns!r}")
    return turns


AgentLookup = Callable[[str, Agent | None], Agent]
"""Maps a stored agent name to an Agent, given the one to fall back on (the store's resolver)."""


@dataclass(frozen=True, slots=True)
class ContextOwner:
    """What an attached context needs from the store that hands it out: the store's hooks.

    Each is the store's own callable, called by the context with no adapter between.
    """

    flush: Callable[[SessionContext], None]
    """Write what a context changed outside a turn."""
    begin_turn: Callable[[SessionContext], Awaitable[None]]
    """Take the session for a turn of the context and catch it up."""
    end_turn: Callable[[SessionContext], Awaitable[None]]
    """Write the turn and give the session back."""
    discard_turn: Callable[[SessionContext], Awaitable[None]]
    """Give the session back after a failed turn, writing nothing of it."""
    run_blocking: Callable[..., Awaitable[Any]]
    """Run blocking work ``(fn, *args)`` off the event loop, as the store's async API does."""


@dataclass
class Checkpoint:
    """A context's state at one moment (:meth:`SessionContext.checkpoint`), to go back to."""

    history: list[Message]
    seqs: list[int]
    agent: Agent
    cleared: bool
    summary: str | None = None
    summary_through: int = 0


@dataclass
class _TurnSnapshot:
    """Everything a turn may change, as it was when the turn began (restored if discarded)."""

    state: Checkpoint
    metadata_json: str
    durable: DurableState | None


@dataclass
class DurableState:
    """What the database holds for a session, as last read or written by this context."""

    version: int
    seqs: set[int]
    agent_name: str
    metadata_json: str
    incarnation: object = None
    """The row's ``created_at``: tells this session from a later one under the same id."""
    hidden: frozenset[int] = frozenset()
    """Rows held back from memory (a trailing tool call without its result, see
    :func:`repair_window`); deleted by the next write that appends after them."""
    summary: str | None = None
    summary_through: int = 0
    """The highest seq folded into ``summary`` (0: none)."""
    made: bool = False
    """This version is the one the store made the session at (see :attr:`StoredSession.made`)."""


@dataclass
class StoredSession:
    """A session as read from the database (the rows of its window)."""

    version: int
    agent_name: str
    metadata: dict[str, Any]
    messages: list[Message]
    seqs: list[int]
    created_at: datetime | None = None
    updated_at: datetime | None = None
    summary: str | None = None
    summary_through: int = 0
    forked_from: str | None = None
    forked_at_turn: int | None = None
    archived_through: int = 0
    """The highest seq of its archived rows (0: none): new messages take seqs above it."""
    made: bool = False
    """The store just made the session at this version (created it, or adopted one with no
    agent yet): nothing was ever written to it, and a failed turn may unmake it again."""


@dataclass(frozen=True)
class PendingWrite:
    """What a context changed since the database last saw it: one transaction's worth.

    ``version`` and ``incarnation`` are what the write expects of the row;
    ``metadata``, ``metadata_json`` and ``summary`` are None when unchanged;
    ``gone`` are the rows to delete, ``pruned`` those of them pruning dropped;
    ``tail`` is the window's last message if the write adds it.
    """

    session_id: str
    version: int
    incarnation: object
    agent_name: str
    metadata: dict[str, Any] | None
    metadata_json: str | None
    messages: tuple[tuple[int, Message], ...]
    gone: frozenset[int]
    pruned: tuple[int, ...]
    hidden: frozenset[int]
    cleared: bool
    empty: bool
    summary: tuple[str | None, int] | None
    tail: Message | None
    changed: bool


def repair_window(
    messages: list[Message], seqs: list[int], shown: frozenset[int] | set[int] = frozenset()
) -> tuple[list[Message], list[int], set[int]]:
    """The window memory shows of the stored rows, and the seqs of the rows it hides.

    Leading non-USER messages (an upstream file) are dropped. A trailing tool
    call without its result (its writer died or still runs the tool) is hidden,
    unless in ``shown`` (the seqs the context that wrote it shows already).
    """
    end = len(messages)
    while end > 0 and _is_call(messages[end - 1]) and seqs[end - 1] not in shown:
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
    return messages[:first] + messages[start:end], seqs[:first] + seqs[start:end], hidden


def _is_call(message: Message | None) -> bool:
    """True for a model message that calls tools (its results follow it)."""
    return message is not None and message.role == Role.MODEL and bool(message.tool_calls)


class _TrackedDict(dict[str, Any]):
    """A dict that tells its context about top-level changes, so they get persisted.

    A value that is not JSON-serialisable raises ``ValueError`` and changes
    nothing. Nested changes (``metadata["a"]["b"] = 1``) go with the session's
    next write; assign the top-level key to have one written now.
    """

    def __init__(self, owner: SessionContext, data: dict[str, Any]) -> None:
        super().__init__(data)
        self._owner = owner

    def __setitem__(self, key: str, value: Any) -> None:
        check_metadata({key: value})
        super().__setitem__(key, value)
        self._owner._on_metadata_change()

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self._owner._on_metadata_change()

    def update(self, *args: Any, **kwargs: Any) -> None:
        incoming = dict(*args, **kwargs)
        check_metadata(incoming)
        super().update(incoming)
        self._owner._on_metadata_change()

    def pop(self, key: str, *default: Any) -> Any:
        value = super().pop(key, *default)
        self._owner._on_metadata_change()
        return value

    def popitem(self) -> tuple[str, Any]:
        item = super().popitem()
        self._owner._on_metadata_change()
        return item

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def clear(self) -> None:
        super().clear()
        self._owner._on_metadata_change()

    def __ior__(self, other: Any) -> _TrackedDict:  # type: ignore[override,misc]
        self.update(other)
        return self


class _AnyLoopLock:
    """A FIFO lock awaited from any event loop in any thread.

    A context outlives loops (``Runner.run`` runs ``asyncio.run`` per call) and
    is shared by threads with loops of their own, which an ``asyncio.Lock``
    (bound to one loop) cannot serve: each waiter parks on a future of its own
    loop and is handed the lock through ``call_soon_threadsafe``.
    """

    __slots__ = ("_held", "_mutex", "_waiters")

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held = False
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = deque()

    def locked(self) -> bool:
        return self._held

    async def acquire(self) -> bool:
        loop = asyncio.get_running_loop()
        with self._mutex:
            if not self._held and not self._waiters:
                self._held = True
                return True
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append((loop, waiter))
        try:
            await waiter
        except BaseException:
            with self._mutex:
                try:
                    self._waiters.remove((loop, waiter))
                    handed = False
                except ValueError:
                    handed = True  # the lock was handed over already: pass it on
            if handed:
                self.release()
            raise
        return True

    def release(self) -> None:
        """Hand the lock to the oldest waiter (in its own loop), or free it."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        with self._mutex:
            if not self._held:
                raise RuntimeError("release of an unlocked session lock")
            while self._waiters:
                loop, waiter = self._waiters.popleft()
                try:
                    if loop is running:
                        loop.call_soon(_hand_over, waiter)
                    else:
                        loop.call_soon_threadsafe(_hand_over, waiter)
                except RuntimeError:  # that loop is closed: its waiter is gone
                    continue
                return
            self._held = False

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()


def _hand_over(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():  # a cancelled waiter passes the lock on itself
        waiter.set_result(None)


_OPEN_TURNS: ContextVar[frozenset[int]] = ContextVar("chatflow_open_turns", default=frozenset())
"""The contexts (by id) whose turn the running task (or one it started) has open."""


class TurnLock:
    """``session.lock``: serialises the session's turns in the process, and frames each.

    On entry the context catches up (the store may take a cross-process
    lease); on exit the turn's changes are written in one transaction, or
    discarded whole if the block raised.
    """

    def __init__(self, ctx: SessionContext) -> None:
        self._ctx = ctx
        self._lock = _AnyLoopLock()

    async def acquire(self) -> bool:
        """Wait for the session's turn, then open it (from any thread's event loop)."""
        lock = self._lock
        await lock.acquire()
        try:
            await self._ctx._abegin_turn()
        except BaseException:
            lock.release()
            raise
        _OPEN_TURNS.set(_OPEN_TURNS.get() | {id(self._ctx)})
        return True

    async def release_async(self) -> None:
        """Close the turn (writing its changes) and let the next turn in."""
        try:
            await self._ctx._aend_turn()
        finally:
            _OPEN_TURNS.set(_OPEN_TURNS.get() - {id(self._ctx)})
            self._lock.release()

    async def discard_async(self) -> None:
        """Close the turn without writing: memory goes back to how the turn began."""
        try:
            await self._ctx._adiscard_turn()
        finally:
            _OPEN_TURNS.set(_OPEN_TURNS.get() - {id(self._ctx)})
            self._lock.release()

    def locked(self) -> bool:
        """Return True while a turn holds the lock."""
        return self._lock.locked()

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            await self.release_async()
        else:
            await self.discard_async()


class SessionContext(_UpstreamSessionContext):
    """Conversation state of one session: history window, active agent, metadata.

    Args:
        session_id: Non-empty id of at most 255 characters.
        initial_agent: The agent that handles the session until a handoff.
        max_turns: How many complete user turns the history keeps (> 0).
        metadata: JSON-serialisable dict stored with the session.

    Raises:
        ValueError: For an invalid ``session_id``, ``max_turns`` or ``metadata``.
        TypeError: For ``metadata`` with a key that is not a str.

    """

    def __init__(
        self,
        session_id: str,
        initial_agent: Agent,
        max_turns: int = 40,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        validate_session_id(session_id)
        self._mutex = threading.RLock()
        self._owner: ContextOwner | None = None
        self._deleted = False
        self._history: list[Message] = []
        self._seqs: list[int] = []
        self._n_system = 0
        self._turns: deque[int] = deque()
        self._next_seq = 1
        self._journal: list[tuple[int, Checkpoint]] = []
        self._turn_start: _TurnSnapshot | None = None
        self._cleared = False
        self._in_turn = False
        self._writing = 0  # writes pending or running: a refresh must not install over them
        self._stale = False
        self._durable: DurableState | None = None
        self._turn_lock: TurnLock | None = None
        self._async_writer = _AnyLoopLock()
        self._max_turns = 1
        self._metadata = _TrackedDict(self, {})
        self._summary: str | None = None
        self._summary_through = 0
        self._summary_message: Message | None = None
        self._forked_from: str | None = None
        self._forked_at_turn: int | None = None
        # What the first use must read (defer_load), under a lock never held across I/O.
        self._deferred_load: Callable[[], object] | None = None
        self._deferred_catch_up = False
        self._recreate: Callable[[], object] | None = None
        self._loading = False  # a deferred load runs (holding the mutex)
        self._defer_lock = threading.Lock()
        super().__init__(
            session_id=session_id,
            initial_agent=initial_agent,
            max_turns=max_turns,
            metadata=metadata,
        )

    # ------------------------------------------------------------------ state

    @property
    def active_agent(self) -> Agent:
        """The agent handling the session (switched by :meth:`set_active_agent`)."""
        self.ensure_loaded()
        return self._active_agent

    @active_agent.setter
    def active_agent(self, agent: Agent) -> None:
        self._active_agent = agent

    @property
    def forked_from(self) -> str | None:
        """The session this one was forked from (``store.fork``), None if it is no fork."""
        self.ensure_loaded()
        return self._forked_from

    @forked_from.setter
    def forked_from(self, session_id: str | None) -> None:
        self._forked_from = session_id

    @property
    def forked_at_turn(self) -> int | None:
        """How many of ``forked_from``'s turns the fork took when it was made."""
        self.ensure_loaded()
        return self._forked_at_turn

    @forked_at_turn.setter
    def forked_at_turn(self, turns: int | None) -> None:
        self._forked_at_turn = turns

    @property
    def max_turns(self) -> int:
        """How many complete user turns the history window keeps."""
        return self._max_turns

    @max_turns.setter
    def max_turns(self, value: int) -> None:
        self._max_turns = validate_max_turns(value)

    @property
    def history(self) -> list[Message]:
        """The history window: SYSTEM messages first, then whole user turns.

        Raises:
            SessionDeletedError: If the session was deleted.

        """
        self._check_alive()
        return self._history

    @history.setter
    def history(self, messages: Iterable[Message]) -> None:
        with self._mutex:
            self._check_alive()
            undo = self._push_undo()
            self._history = [m for m in messages if not self._is_summary(m)]
            self._seqs = []
            self._cleared = True  # a replacement: nothing stored before it survives a rebase
            self._regroup()
            self._place_summary()
            self._changed(undo)

    @property
    def metadata(self) -> dict[str, Any]:
        """Session metadata; top-level changes are persisted at once (see ``_TrackedDict``)."""
        self._check_alive()
        return self._metadata

    @metadata.setter
    def metadata(self, value: dict[str, Any] | None) -> None:
        value = dict(value or {})
        check_metadata(value)
        with self._mutex:
            self._check_alive()
            self._metadata = _TrackedDict(self, value)
            self._changed()

    @property
    def lock(self) -> TurnLock:  # type: ignore[override]
        """Async lock around one turn (``async with session.lock:``), as the Runner uses it."""
        if self._turn_lock is None:
            with self._mutex:
                if self._turn_lock is None:
                    self._turn_lock = TurnLock(self)
        return self._turn_lock

    @property
    def deleted(self) -> bool:
        """True once the session was deleted through its store."""
        return self._deleted

    @property
    def summary(self) -> str | None:
        """The summary of the turns pruning dropped (the store's ``summarizer``), or None.

        ``history`` shows it as a SYSTEM message after the session's own.
        """
        self.ensure_loaded()
        return self._summary

    @property
    def summary_through(self) -> int:
        """The position (seq) of the last message folded into ``summary`` (0: none yet)."""
        self.ensure_loaded()
        return self._summary_through

    # ------------------------------------------------------- deferred loading

    def defer_load(self, load: Callable[[], object]) -> None:
        """Hand this context out before its session is read: ``load`` fills it on first use.

        For ``get_or_create`` on a running loop's thread. A turn's start runs
        ``load`` off the loop, any other first use in place; until it succeeds,
        every use tries it again.
        """
        with self._defer_lock:
            self._deferred_load, self._deferred_catch_up = load, False

    def defer_catch_up(
        self, catch_up: Callable[[], object], recreate: Callable[[], object]
    ) -> None:
        """Catch up with the database on first use (``catch_up``), as :meth:`defer_load` loads.

        A turn's start catches up itself and drops it, running ``recreate``
        instead if it finds the session deleted meanwhile. Ignored during a
        turn or while a first load is pending.
        """
        with self._defer_lock:
            if self._in_turn or self._loading or self._deferred_load is not None:
                return
            self._deferred_load, self._deferred_catch_up = catch_up, True
            self._recreate = recreate

    def _drop_catch_up(self) -> tuple[Callable[[], object] | None, Callable[[], object] | None]:
        """A turn starts: it catches up itself. The dropped catch-up and its ``recreate``."""
        with self._defer_lock:
            recreate, self._recreate = self._recreate, None
            if not self._deferred_catch_up:
                return None, None
            catch_up = self._deferred_load
            self._deferred_load, self._deferred_catch_up = None, False
            return catch_up, recreate

    @property
    def loaded(self) -> bool:
        """False while the context waits for its deferred first load (:meth:`defer_load`)."""
        return self._deferred_load is None

    def ensure_loaded(self) -> None:
        """Run the deferred first load now, if any, or wait for the thread running it."""
        if self._deferred_load is None and not self._loading:
            return
        with self._mutex:  # one load at a time, and no other use of the state meanwhile
            with self._defer_lock:
                load, catch_up = self._deferred_load, self._deferred_catch_up
                if load is None:  # loaded meanwhile, or by this thread (the mutex re-enters)
                    return
                # Set before the load is taken: a reader seeing no load sees this.
                self._loading = True
                # Reads made while it installs (by the load itself) see what it installs.
                self._deferred_load, self._deferred_catch_up = None, False
            try:
                load()
            except BaseException:
                with self._defer_lock:  # tried again at the next use, unless deleted meanwhile
                    if self._deferred_load is None and not self._deleted:
                        self._deferred_load, self._deferred_catch_up = load, catch_up
                raise
            finally:
                self._loading = False

    # -------------------------------------------------------------- mutation

    def add_message(self, message: Message) -> None:
        """Append a message and prune to ``max_turns`` complete turns.

        Raises:
            SessionDeletedError: If the session was deleted.

        """
        with self._mutex:
            self._check_alive()
            undo = self._push_undo()
            self._append(message)
            self._changed(undo)

    def set_active_agent(self, agent: Agent) -> None:
        """Switch the agent handling this session (persisted by name).

        Raises:
            ValueError: The agent's name cannot be stored (see :func:`validate_agent`).
            SessionDeletedError: If the session was deleted.

        """
        validate_agent(agent)
        with self._mutex:
            self._check_alive()
            undo = self._push_undo()
            self.active_agent = agent
            self._changed(undo)

    def clear_history(self) -> None:
        """Drop every message of the session, SYSTEM messages included.

        Messages another writer added before the clear is written go too.
        """
        with self._mutex:
            self._check_alive()
            undo = self._push_undo()
            self._history = []
            self._seqs = []
            self._n_system = 0
            self._turns.clear()
            self._cleared = True
            self._summary = self._summary_message = None
            self._summary_through = self._next_seq - 1  # what was pruned before is no more
            self._changed(undo)

    def rollback_to(self, checkpoint_len: int) -> None:
        """Restore the state the session had when ``len(history) == checkpoint_len``.

        Inside ``session.lock`` the turn's starting length restores exactly the
        pre-turn history and active agent, even if the turn pruned older turns.
        Otherwise the latest recorded state of that length is restored, else the
        history is truncated as upstream does. Tool side effects stay.

        Raises:
            SessionDeletedError: If the session was deleted.

        """
        with self._mutex:
            self._check_alive()
            shown = len(self._history)  # the cut is at what the user saw, before any regroup
            undo = self._snapshot()
            snapshot = self._find_snapshot(checkpoint_len)
            if snapshot is not None:
                self._restore(snapshot)
            elif 0 <= checkpoint_len < shown:
                del self._history[checkpoint_len:]
                del self._seqs[checkpoint_len:]
                self._reindex()
            else:
                return
            self._changed(undo)

    def rewind(self, turns: int = 1) -> None:
        """Remove the last ``turns`` complete turns, in memory and in the store alike.

        Runs as a turn of its own (:meth:`arewind`, which a running loop must
        await). Edit-and-regenerate: rewind, then a turn with the edited message.

        Raises:
            ValueError: ``turns`` is not a positive int, or the window holds fewer turns.
            RuntimeError: Called inside a turn of this context, or an event loop is running.
            SessionDeletedError: If the session was deleted.

        """
        count = _rewind_count(turns)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            asyncio.run(self.arewind(count))
            return
        raise RuntimeError("rewind() cannot run inside a running event loop: await arewind()")

    async def arewind(self, turns: int = 1) -> None:
        """Async :meth:`rewind`: takes the session's turn, removes the turns, writes.

        It waits for a turn other tasks have open, and is fenced like any turn;
        removed messages are archived with ``archive_pruned=True``.

        Raises:
            ValueError: ``turns`` is not a positive int, or the window holds fewer turns.
            RuntimeError: Called inside a turn of this context (by its task or one
                it started): nothing is changed.
            SessionDeletedError: If the session was deleted.

        """
        count = _rewind_count(turns)
        with self._mutex:
            self._check_alive()
            if id(self) in _OPEN_TURNS.get():  # another task's turn is waited for
                raise RuntimeError(
                    "rewind inside a turn would remove the turn that is running: rewind "
                    "before or after the turn (inside it, rollback_to undoes the turn's messages)"
                )
        async with self.lock:
            with self._mutex:
                self._ensure_indexed()
                if count > len(self._turns):
                    raise ValueError(
                        f"cannot rewind {count} turn(s): the window holds {len(self._turns)} "
                        "(pruned turns are gone from it)"
                    )
                keep = len(self._history) - sum(list(self._turns)[-count:])
                del self._history[keep:]
                del self._seqs[keep:]
                self._reindex()

    def _prune_history(self) -> None:
        """Regroup the whole history into whole turns (after editing ``history`` by hand)."""
        with self._mutex:
            self._check_alive()
            undo = self._push_undo()
            self._regroup()
            self._changed(undo)

    # ------------------------------------------------------------ async twins

    async def aadd_message(self, message: Message) -> None:
        """Async :meth:`add_message`; disk I/O never runs on the event loop."""
        await self._maybe_blocking(self.add_message, message)

    async def aset_active_agent(self, agent: Agent) -> None:
        """Async :meth:`set_active_agent`."""
        await self._maybe_blocking(self.set_active_agent, agent)

    async def aclear_history(self) -> None:
        """Async :meth:`clear_history`."""
        await self._maybe_blocking(self.clear_history)

    async def arollback_to(self, checkpoint_len: int) -> None:
        """Async :meth:`rollback_to`."""
        await self._maybe_blocking(self.rollback_to, checkpoint_len)

    async def _maybe_blocking(self, fn: Callable[..., None], *args: Any) -> None:
        if self._owner is None or self._in_turn:
            fn(*args)  # nothing to write now: memory only, or buffered until the turn ends
            return
        # On a native-async store writers share the loop thread: the mutex cannot order them.
        async with self._async_writer:
            await self._owner.run_blocking(fn, *args)

    # ------------------------------------------------------------ persistence
    # A store reads and changes the context's state only by these methods.

    def attach(self, owner: ContextOwner) -> None:
        """Have ``owner`` (the store that hands this context out) persist its changes."""
        self._owner = owner

    def mark_deleted(self) -> None:
        """The session is gone: later uses raise SessionDeletedError (a pending load is dropped)."""
        with self._defer_lock:
            self._deleted = True
            self._deferred_load, self._deferred_catch_up, self._recreate = None, False, None

    def mark_stale(self) -> None:
        """Memory may hold what the database refused: the next catch-up reloads it."""
        self._stale = True

    @property
    def in_turn(self) -> bool:
        """True while a turn (``session.lock``) is open on this context."""
        return self._in_turn

    @property
    def incarnation(self) -> object:
        """The ``created_at`` of the session row this context last read or wrote (None: none)."""
        durable = self._durable
        return None if durable is None else durable.incarnation

    @property
    def made_version(self) -> int | None:
        """The version this context's store made (or adopted) its session at, if still current."""
        durable = self._durable
        return durable.version if durable is not None and durable.made else None

    @property
    def unborn(self) -> bool:
        """True if the session, as last read, has no agent yet: ``get`` does not show it."""
        durable = self._durable
        return durable is not None and durable.agent_name == UNBORN_AGENT

    def is_current(self, version: int) -> bool:
        """True if ``version`` is the one this context last read or wrote, and it is not stale."""
        durable = self._durable
        return durable is not None and durable.version == version and not self._stale

    def load(self, stored: StoredSession, agent: Agent) -> None:
        """Take ``stored`` whole: a first read, or the session made anew (any incarnation)."""
        with self._mutex:
            self._install(stored, agent, frozenset())

    def catch_up(self, stored: StoredSession | None, agents: AgentLookup) -> bool:
        """Take what the database holds (``stored``); False if that session is gone.

        Gone: ``stored`` is None, or a later session under the same id. Newer
        memory (a turn, a write, a version written here) stays; so does an
        unsaved trailing tool call, to be written with its result.
        """
        with self._mutex:
            if stored is None or self._other_incarnation(stored):
                return False
            durable = self._durable  # what a turn or a write holds is newer than ``stored``:
            if durable is not None and not self._stale and (
                self._in_turn or self._writing > 0 or durable.version >= stored.version
            ):
                return True
            tail = self._unsaved_tail()
            carried = self._orphaned_tool_call(stored) or (tail if _is_call(tail) else None)
            self._install(stored, agents(stored.agent_name, self.active_agent), set(self._seqs))
            if carried is not None:
                self._append(carried)  # unsaved again: written with its result
            return True

    @contextmanager
    def writing(self) -> Iterator[PendingWrite | None]:
        """Hold the context (its mutex) for one write; yield what it changed, None if nothing.

        Raises:
            SessionDeletedError: If the session was deleted.

        """
        with self._mutex:
            self._check_alive()
            self._ensure_indexed()
            pending = None if self._durable is None else self._pending()
            if pending is None or not pending.changed:
                yield None
                return
            self._writing += 1
            try:
                yield pending
            finally:
                self._writing -= 1

    def applied(self, write: PendingWrite) -> None:
        """``write`` committed: what it wrote is what the database holds now, one version up."""
        with self._mutex:
            durable = self._durable
            assert durable is not None
            seqs = durable.seqs - write.gone
            seqs.update(seq for seq, _ in write.messages)
            metadata_json = write.metadata_json or durable.metadata_json  # None: unchanged
            self._durable = DurableState(
                durable.version + 1, seqs, self.active_agent.name, metadata_json,
                durable.incarnation, durable.hidden.difference(write.gone),
                self._summary, self._summary_through,
            )
            self._cleared = False

    def rebase(self, stored: StoredSession | None, agents: AgentLookup) -> PendingWrite:
        """Another writer moved the session: take its rows, replay the unsaved changes on them.

        New messages go after its rows; an unsaved clear drops what it added;
        this context's agent, metadata and summary win where it changed them.

        Returns:
            What to write now.

        Raises:
            SessionDeletedError: ``stored`` is None, or is a later session under
                the same id: nothing of this context goes into another conversation.

        """
        with self._mutex:
            durable = self._durable
            assert durable is not None
            if stored is None or self._other_incarnation(stored):
                raise SessionDeletedError(self.session_id)
            unsaved = [message for _, message in self._pending_messages()]
            cleared = self._cleared
            agent = self.active_agent  # ours wins if we switched
            if agent.name == durable.agent_name:
                agent = agents(stored.agent_name, agent)
            metadata = dict(self._metadata)
            metadata_changed = dump_metadata(metadata) != durable.metadata_json
            summary = (self._summary, self._summary_through) if self._summary_changed() else None
            carried = None if cleared else self._orphaned_tool_call(stored)
            self._install(stored, agent, set(self._seqs))
            if metadata_changed:
                self._replace_metadata(metadata)
            if cleared:
                self._history, self._seqs, self._cleared = [], [], True
                self._reindex()
                if summary is None:  # a replaced history (history = ...) keeps the summary
                    self._set_summary(self._summary, self._summary_through)
                else:  # clear_history forgot it: the other's summary goes too
                    self._set_summary(None, self._next_seq - 1)
            elif summary is not None and stored.summary_through == durable.summary_through:
                self._set_summary(*summary)  # else another summary was written first: it stands
            for message in unsaved if carried is None else [carried, *unsaved]:
                self._append(message)
            return self._pending()

    def checkpoint(self) -> Checkpoint:
        """The state now (history, active agent, summary), to go back to with :meth:`restore`.

        A ``history`` edited in place is re-derived first, as a write does.
        """
        with self._mutex:
            return self._snapshot()

    def restore(self, checkpoint: Checkpoint) -> None:
        """Go back to ``checkpoint`` in memory (a store undoing a turn it refused)."""
        with self._mutex:
            self._restore(checkpoint)

    def changed_since(self, checkpoint: Checkpoint) -> bool:
        """True unless the history and the active agent are the very ones of ``checkpoint``."""
        same = len(self._history) == len(checkpoint.history) and all(
            now is then for now, then in zip(self._history, checkpoint.history, strict=True)
        )
        return not same or self.active_agent is not checkpoint.agent

    def added_since(self, checkpoint: Checkpoint) -> Message | None:
        """The window's last message if ``checkpoint`` did not hold it (a turn's answer)."""
        last = self._history[-1] if self._history else None
        if last is None or any(message is last for message in checkpoint.history):
            return None
        return last

    def settle_window(self, gone: Iterable[int]) -> tuple[list[int], bool]:
        """Of ``gone`` (seqs that left the window), those pruning dropped; and a clear, once."""
        cleared, self._cleared = self._cleared, False
        return self._pruned(gone), cleared

    def copy_for_fork(
        self,
        session_id: str,
        cut: Callable[[list[Message], list[int]], tuple[list[Message], list[int], int]],
        *,
        max_turns: int,
    ) -> SessionContext:
        """A new, unattached context that starts as a fork of this one (its state outside a turn).

        ``cut`` takes the window's messages and seqs and returns those kept and
        their turns; the summary, agent and metadata are copied.

        Raises:
            SessionDeletedError: If the session was deleted.

        """
        with self._mutex:
            self._check_alive()
            self._ensure_indexed()
            start = self._turn_start if self._in_turn else None
            state = start.state if start is not None else self._snapshot()
            metadata = json.loads(dump_metadata(self._metadata))
            next_seq = self._next_seq
        pairs = [(m, seq) for m, seq in zip(state.history, state.seqs, strict=True)
                 if seq != SUMMARY_SEQ]
        messages, seqs, turns = cut([m for m, _ in pairs], [seq for _, seq in pairs])
        ctx = SessionContext(session_id, state.agent, max_turns=max_turns, metadata=metadata)
        with ctx._mutex:
            ctx._restore(Checkpoint(
                [m.model_copy(deep=True) for m in messages], list(seqs),
                state.agent, False, state.summary, state.summary_through,
            ))
            ctx._place_summary()
            ctx._next_seq = next_seq
        ctx.forked_from, ctx.forked_at_turn = self.session_id, turns
        return ctx

    # ------------------------------------------------------------------ turns

    async def _abegin_turn(self) -> None:
        catch_up = None
        if self._owner is not None:
            async with self._async_writer:
                catch_up, recreate = self._drop_catch_up()
                if self.made_version is None:  # only what this context made is made anew
                    catch_up = None
                if self._deferred_load is not None:  # read off the loop, never on it
                    await self._owner.run_blocking(self.ensure_loaded)
                with self._mutex:
                    self._check_alive()
                try:
                    await self._owner.begin_turn(self)
                except SessionDeletedError:
                    if recreate is None or self._deleted:
                        raise
                    await self._owner.run_blocking(self._locked, recreate)  # as get_or_create
                    await self._owner.begin_turn(self)
        try:
            if catch_up is not None and self.unborn:  # its first turn failed: as if new
                assert self._owner is not None
                await self._owner.run_blocking(self._locked, catch_up)
            self._open_turn()
        except BaseException:
            if self._owner is not None:  # what the store took for the turn goes back
                await self._owner.discard_turn(self)
            raise

    def _locked(self, fn: Callable[[], object]) -> None:
        """``fn()`` holding the mutex: a load into this context, which nothing may use meanwhile."""
        with self._mutex:
            fn()

    def _open_turn(self) -> None:
        with self._mutex:
            self._drop_catch_up()  # set after the turn's own catch-up: nothing to add to it
            self._check_alive()
            self._in_turn = True
            self._journal.clear()
            self._turn_start = _TurnSnapshot(
                self._snapshot(), dump_metadata(self._metadata), self._durable
            )

    def _close_turn(self, *, to_write: bool = False) -> _TurnSnapshot | None:
        with self._mutex:
            start = self._turn_start
            self._in_turn = False
            if to_write:
                self._writing += 1
            self._turn_start = None
            self._journal.clear()
            return start

    async def _aend_turn(self) -> None:
        start = self._close_turn(to_write=self._owner is not None)
        if self._owner is not None:
            try:
                async with self._async_writer:
                    await self._owner.end_turn(self)
            except BaseException:
                # Not known written: back to the turn's start, checked again before the next.
                self._discard_to(start, stale=True)
                raise
            finally:
                with self._mutex:
                    self._writing -= 1

    async def _adiscard_turn(self) -> None:
        self._discard_to(self._close_turn(), stale=False)
        if self._owner is not None:
            await self._owner.discard_turn(self)

    def _discard_to(self, start: _TurnSnapshot | None, *, stale: bool) -> None:
        """Put back everything a turn changed (history, agent, metadata, what is durable)."""
        with self._mutex:
            if start is not None:
                self._restore(start.state)
                self._replace_metadata(json.loads(start.metadata_json))
                self._durable = start.durable
            self._stale = self._stale or stale

    # -------------------------------------------------------------- internals

    def _check_alive(self) -> None:
        """Raise if the session was deleted; first load a context handed out unread."""
        self.ensure_loaded()
        if self._deleted:
            raise SessionDeletedError(self.session_id)

    def _changed(self, undo: Checkpoint | None = None) -> None:
        """Persist now, or leave it for the end of the turn.

        A failed write undoes the change in memory (to ``undo``) and marks the
        context stale, to be reloaded before its next use.
        """
        if self._owner is None or self._in_turn:
            return
        durable = self._durable
        try:
            self._owner.flush(self)
        except BaseException:
            if undo is not None:
                self._restore(undo)
                if self._journal and self._journal[-1][1] is undo:
                    self._journal.pop()
            if durable is not None:
                self._durable = durable
                self._replace_metadata(json.loads(durable.metadata_json))
            self._stale = True
            raise

    def _on_metadata_change(self) -> None:
        with self._mutex:
            self._check_alive()
            self._changed()

    def _snapshot(self) -> Checkpoint:
        self._ensure_indexed()  # a history edited in place is re-derived before it is kept
        return Checkpoint(
            list(self._history), list(self._seqs), self.active_agent, self._cleared,
            self._summary, self._summary_through,
        )

    def _push_undo(self) -> Checkpoint:
        snapshot = self._snapshot()
        self._journal.append((len(self._history), snapshot))
        if len(self._journal) > _JOURNAL_LIMIT:
            del self._journal[0]
        return snapshot

    def _find_snapshot(self, checkpoint_len: int) -> Checkpoint | None:
        turn = self._turn_start
        if turn is not None and len(turn.state.history) == checkpoint_len:
            self._journal.clear()
            return turn.state
        for index in range(len(self._journal) - 1, -1, -1):
            length, snapshot = self._journal[index]
            if length == checkpoint_len:
                del self._journal[index:]
                return snapshot
        return None

    def _restore(self, snapshot: Checkpoint) -> None:
        self._history = list(snapshot.history)
        self._seqs = list(snapshot.seqs)
        self.active_agent = snapshot.agent
        self._cleared = snapshot.cleared
        self._summary = snapshot.summary
        self._summary_through = snapshot.summary_through
        self._summary_message = next(
            (m for m, seq in zip(self._history, self._seqs, strict=True) if seq == SUMMARY_SEQ),
            None,
        )
        self._reindex()

    def _new_seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def _append(self, message: Message) -> None:
        """Add ``message`` to the window, then prune it to ``max_turns`` turns."""
        role = message.role
        at: int | None = None  # None: a non-USER message with no turn to belong to is dropped
        if role == Role.SYSTEM:
            at = self._n_system - (self._summary is not None)  # the summary stays last
            self._n_system += 1
        elif role == Role.USER:
            at = len(self._history)
            self._turns.append(1)
        elif self._turns:
            at = len(self._history)
            self._turns[-1] += 1
        if at is not None:
            self._history.insert(at, message)
            self._seqs.insert(at, self._next_seq)
            self._next_seq += 1
        excess = len(self._turns) - self._max_turns
        if excess > 0:
            dropped = sum(self._turns.popleft() for _ in range(excess))
            start = self._n_system
            del self._history[start : start + dropped]
            del self._seqs[start : start + dropped]

    def _ensure_indexed(self) -> None:
        """Re-derive bookkeeping if ``history`` was edited in place behind our back."""
        expected = self._n_system + sum(self._turns)
        if len(self._history) != len(self._seqs) or len(self._history) != expected:
            self._regroup()

    def _regroup(self) -> None:
        """Upstream's full turn regroup; keeps the seqs of messages it can still match."""
        if len(self._seqs) != len(self._history):
            self._seqs = [
                SUMMARY_SEQ if self._is_summary(m) else self._new_seq() for m in self._history
            ]
        systems: list[tuple[Message, int]] = []
        summary: list[tuple[Message, int]] = []
        turns: list[list[tuple[Message, int]]] = []
        for message, seq in zip(self._history, self._seqs, strict=True):
            if seq == SUMMARY_SEQ:
                summary = [(message, seq)]
            elif message.role == Role.SYSTEM:
                systems.append((message, seq))
            elif message.role == Role.USER:
                turns.append([(message, seq)])
            elif turns:
                turns[-1].append((message, seq))
        kept = turns[-self._max_turns :]
        systems += summary
        pairs = systems + [pair for turn in kept for pair in turn]
        self._history = [message for message, _ in pairs]
        self._seqs = [seq for _, seq in pairs]
        self._n_system = len(systems)
        self._turns = deque(len(turn) for turn in kept)

    def _reindex(self) -> None:
        """Recompute bookkeeping of a history already in canonical order."""
        self._n_system = 0
        self._turns = deque()
        for message in self._history:
            if message.role == Role.SYSTEM:
                self._n_system += 1
            elif message.role == Role.USER:
                self._turns.append(1)
            elif self._turns:
                self._turns[-1] += 1
        if self._n_system + sum(self._turns) != len(self._history):
            self._regroup()

    def _install(
        self, stored: StoredSession, agent: Agent, shown: frozenset[int] | set[int]
    ) -> None:
        """Replace the whole state with ``stored`` (caller holds the mutex).

        ``shown``: the seqs this context shows already (see :func:`repair_window`).
        """
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
            made=stored.made,
        )
        self._history = window
        self._seqs = seqs
        self.active_agent = agent
        self._replace_metadata(stored.metadata)
        # A seq names one transcript message: never reuse an archived one.
        self._next_seq = max(
            self._next_seq,
            max(durable.seqs | durable.hidden, default=0) + 1,
            durable.summary_through + 1,
            stored.archived_through + 1,
        )
        self._journal.clear()
        self._durable = durable
        self._stale = False
        self._cleared = False
        self._summary = durable.summary
        self._summary_through = durable.summary_through
        self._reindex()
        self._place_summary()
        self.forked_from, self.forked_at_turn = stored.forked_from, stored.forked_at_turn

    def _replace_metadata(self, metadata: dict[str, Any]) -> None:
        self._metadata = _TrackedDict(self, metadata)

    def _pending_messages(self) -> list[tuple[int, Message]]:
        """Messages in memory that the database does not hold yet, with their seqs."""
        durable = self._durable.seqs if self._durable is not None else set()
        pairs = zip(self._seqs, self._history, strict=True)
        return [(seq, m) for seq, m in pairs if seq != SUMMARY_SEQ and seq not in durable]

    def _pending(self) -> PendingWrite:
        """What this context changed since it was last read or written (caller holds the mutex)."""
        durable = self._durable
        assert durable is not None
        messages = tuple(self._pending_messages())
        gone = durable.seqs.difference(self._seqs)
        if durable.hidden and (messages or self._cleared):
            gone.update(durable.hidden)  # a call no result can follow any more
        metadata_json: str | None = dump_metadata(self._metadata)
        metadata = None
        if metadata_json == durable.metadata_json:
            metadata_json = None
        else:  # a nested change made in place is checked here
            check_metadata(self._metadata, stored_json=durable.metadata_json)
            metadata = dict(self._metadata)
        summary = (self._summary, self._summary_through) if self._summary_changed() else None
        agent_name = self.active_agent.name
        changed = agent_name != durable.agent_name or bool(gone or messages) or self._cleared
        return PendingWrite(
            session_id=self.session_id, version=durable.version,
            incarnation=durable.incarnation, agent_name=agent_name,
            metadata=metadata, metadata_json=metadata_json, messages=messages,
            gone=frozenset(gone), pruned=tuple(self._pruned(gone)), hidden=durable.hidden,
            cleared=self._cleared, empty=not self._seqs, summary=summary,
            tail=self._unsaved_tail(),
            changed=changed or summary is not None or metadata is not None,
        )

    def _pruned(self, gone: Iterable[int]) -> list[int]:
        """Of the rows leaving the window (``gone``), those pruning dropped: older than all kept."""
        if len(self._seqs) <= self._n_system:
            return []
        oldest_kept = self._seqs[self._n_system]
        return sorted(seq for seq in gone if seq < oldest_kept)

    def _unsaved_tail(self) -> Message | None:
        """The window's last message if the database does not hold it yet."""
        durable = self._durable
        if durable is None or not self._seqs or self._seqs[-1] in durable.seqs:
            return None
        return self._history[-1]

    def _orphaned_tool_call(self, stored: StoredSession) -> Message | None:
        """Our saved trailing tool call whose row another writer deleted, if any.

        It goes after that writer's rows again, so its result is never stored without it.
        """
        durable = self._durable
        if durable is None:
            return None
        index = len(self._seqs) - 1
        while index >= 0 and self._seqs[index] not in durable.seqs:
            index -= 1  # skip the unsaved messages after it
        if index < 0:
            return None
        message = self._history[index]
        return message if _is_call(message) and self._seqs[index] not in stored.seqs else None

    def _other_incarnation(self, stored: StoredSession) -> bool:
        """True if ``stored`` is a later session under this id (told by ``created_at``)."""
        known = self.incarnation
        return known is not None and stored.created_at is not None and stored.created_at != known

    def _summary_changed(self) -> bool:
        """True if the summary is not the one the database last held (read or written)."""
        durable = self._durable
        assert durable is not None
        return (self._summary, self._summary_through) != (durable.summary, durable.summary_through)

    # -------------------------------------------------------------- summary

    def _is_summary(self, message: Message) -> bool:
        """True if ``message`` is the summary's SYSTEM message this context shows, or a copy."""
        shown = self._summary_message
        return shown is not None and (message is shown or message == shown)

    def _place_summary(self) -> None:
        """Show ``_summary`` as the last SYSTEM message, or no summary message if it is None."""
        if SUMMARY_SEQ in self._seqs:
            at = self._seqs.index(SUMMARY_SEQ)
            del self._history[at]
            del self._seqs[at]
            self._n_system -= 1
        self._summary_message = None
        if self._summary is not None:
            message = Message(
                role=Role.SYSTEM, content=SUMMARY_HEADER + self._summary,
                timestamp=SUMMARY_TIMESTAMP,
            )
            self._history.insert(self._n_system, message)
            self._seqs.insert(self._n_system, SUMMARY_SEQ)
            self._n_system += 1
            self._summary_message = message

    def _set_summary(self, summary: str | None, through: int) -> None:
        """Take a new summary of the turns up to seq ``through`` (a write persists it)."""
        with self._mutex:
            self._check_alive()
            self._summary = summary
            self._summary_through = through
            self._place_summary()

    async def aapply_summary(self, summary: str, based_on: int, through: int) -> bool:
        """Take ``summary`` (of the turns up to seq ``through``) as a turn of its own.

        False, changing nothing, if ``summary_through`` is no longer ``based_on``
        or a message it covers is back in the window.
        """
        async with self.lock:
            with self._mutex:
                if self._summary_through != based_on:
                    return False
                if any(seq <= through for seq in self._seqs[self._n_system :]):
                    return False
                self._set_summary(summary, through)
        return True

    def __repr__(self) -> str:
        return (
            f"<SessionContext id={self.session_id!r} active_agent={self._active_agent.name!r} "
            f"messages={len(self._history)} turns={len(self._turns)}>"
        )
