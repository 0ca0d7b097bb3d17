"""The session context: a conversation's history window, active agent and metadata.

:class:`SessionContext` subclasses ``chatflow_agent.SessionContext`` and keeps
its public behaviour (turn-safe pruning, rollback, the ``lock`` the Runner
holds around a turn) while fixing what upstream gets wrong:

* pruning is incremental: each message costs O(1) amortised bookkeeping
  instead of regrouping the whole history;
* ``rollback_to`` restores the exact earlier state (history *and* active
  agent), also when the rolled-back messages pruned older turns;
* mutation is thread-safe, and a context whose session was deleted raises
  :class:`~chatflow_sqlalchemy.exceptions.SessionDeletedError`.

A context created directly (or by the in-memory store) lives only in memory.
A context handed out by a SQL store is *attached*: the store persists every
change. Outside ``session.lock`` each change is written at once; inside it
(one Runner turn) changes are buffered and written in one transaction when
the lock is released, so a failed turn rolls back as a plain discard and a
crash mid-turn leaves no partial turn behind.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import deque
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timezone
from types import TracebackType
from typing import Any, Protocol, TypeVar

from chatflow_agent import Agent, Message, Role
from chatflow_agent import SessionContext as _UpstreamSessionContext
from pydantic_core import to_json

from chatflow_sqlalchemy.exceptions import SessionDeletedError
from chatflow_sqlalchemy.values import SESSION_ID_MAX_LENGTH, check_storable_text

__all__ = [
    "METADATA_MAX_DEPTH",
    "SUMMARY_SEQ",
    "SessionContext",
    "TurnLock",
    "check_metadata",
    "dump_message",
    "dump_metadata",
    "validate_agent",
    "validate_id",
    "validate_max_turns",
    "validate_session_id",
]

_T = TypeVar("_T")

_JOURNAL_LIMIT = 64
"""Rollback points kept per context (bounded so long-lived contexts stay small)."""

SUMMARY_SEQ = 0
"""The seq of the summary's SYSTEM message in memory; no stored row has it (rows start at 1)."""

SUMMARY_HEADER = "Summary of the earlier conversation (its turns are no longer shown):\n"
"""What the summary's SYSTEM message says before the summary itself."""

SUMMARY_TIMESTAMP = datetime(1970, 1, 1, tzinfo=timezone.utc)
"""The summary message's timestamp: fixed, so a reload shows the very same message."""



def validate_id(value: object, name: str) -> str:
    """Return ``value`` if it is a usable id, else raise ``ValueError`` naming ``name``.

    One rule for every id the store keys rows by (sessions, users) and for
    agent names: a non-empty str of at most ``SESSION_ID_MAX_LENGTH``
    characters that every backend can store (no NUL, no lone surrogate; see
    :func:`~chatflow_sqlalchemy.values.check_storable_text`).
    """
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a str, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must be a non-empty string")
    if len(value) > SESSION_ID_MAX_LENGTH:
        raise ValueError(f"{name} is {len(value)} characters; the limit is {SESSION_ID_MAX_LENGTH}")
    check_storable_text(value, name)
    return value


def validate_session_id(session_id: object) -> str:
    """Return ``session_id`` if it is a usable id, else raise ``ValueError`` naming it."""
    return validate_id(session_id, "session_id")


def validate_agent(agent: Agent) -> Agent:
    """Return ``agent`` if its name fits the session's ``active_agent_name`` column.

    Checked before a session is created or switches agent, so a name no
    backend can store never reaches the database (the rule of :func:`validate_id`).
    """
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


_ESCAPED_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
"""An escaped NUL in JSON text (not an escaped backslash followed by ``u0000``)."""


METADATA_MAX_DEPTH = 31
"""Deepest nesting of dicts and lists accepted in metadata (the deepest MariaDB's JSON
type takes; deeper is refused on every backend alike, as is a container that holds
itself: much deeper nesting would exhaust Python's recursion limit too)."""


def _check_shape(value: object, max_depth: int, depth: int = 1) -> None:
    """Refuse non-str dict keys (JSON would turn them into strings) and over-deep nesting."""
    if isinstance(value, dict):
        children: Iterable[object] = value.values()
        for key in value:
            if not isinstance(key, str):
                raise TypeError(
                    f"metadata keys must be str, got {key!r} ({type(key).__name__}): JSON "
                    f"would read it back as a str; use str keys (e.g. str({key!r}))"
                )
    elif isinstance(value, (list, tuple)):
        children = value
    else:
        return
    if depth > max_depth:
        raise ValueError(
            f"metadata is nested more than {max_depth} dicts/lists deep (or holds "
            "itself): flatten it, or store the deep part as a JSON string"
        )
    for child in children:
        _check_shape(child, max_depth, depth + 1)


def _depth(value: object) -> int:
    """How many dicts/lists deep decoded JSON ``value`` is nested."""
    if isinstance(value, dict):
        value = list(value.values())
    if not isinstance(value, list):
        return 0
    return 1 + max((_depth(child) for child in value), default=0)


def check_metadata(metadata: object, *, stored_json: str | None = None) -> str:
    """:func:`dump_metadata` of new metadata, refusing also what JSON would not keep.

    Metadata given by the caller (and metadata a write changed) is checked
    with this: nesting deeper than ``METADATA_MAX_DEPTH`` (``ValueError``)
    and dict keys that are not str (``TypeError``) are refused before
    anything is written. Stored metadata is never refused: a change to
    metadata that was already stored deeper (``stored_json``, written before
    the limit) may keep that depth.
    """
    try:
        _check_shape(metadata, METADATA_MAX_DEPTH)
    except ValueError:
        stored_depth = _depth(json.loads(stored_json)) if stored_json else 0
        if stored_depth <= METADATA_MAX_DEPTH:
            raise
        _check_shape(metadata, stored_depth)
    return dump_metadata(metadata)


def dump_metadata(metadata: object) -> str:
    """Serialise metadata to canonical JSON, or raise ``ValueError`` naming ``metadata``.

    Refused, so that what is accepted reads back the same on every backend:
    NaN and infinities (JSON has no such numbers), the NUL character and
    lone surrogates anywhere in a key or string (PostgreSQL's ``jsonb``
    cannot hold them).
    """
    try:
        text = json.dumps(metadata, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"metadata must be JSON-serialisable: {exc}") from None
    if "\\ud" in text:  # a surrogate escape: fine in a pair, not alone (not UTF-8 text)
        try:
            json.dumps(metadata, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                "metadata must not contain a lone surrogate ('\\ud800'-'\\udfff') in a key "
                "or string value (it is not UTF-8 text): decode the bytes it came from properly"
            ) from None
    if "\\u0000" in text and _ESCAPED_NUL.search(text):
        raise ValueError(
            "metadata must not contain the NUL character ('\\x00') in a key or string value "
            "(PostgreSQL cannot store it in JSON): remove it or encode the value first"
        )
    return text


def dump_message(message: Message) -> str:
    """A message as the JSON stored in ``message_json``, which reads back equal.

    Tool arguments and results may hold NaN or infinities (a data tool's
    output); pydantic writes those as ``null`` by default, so messages with
    tool calls or results are written with the ``NaN``/``Infinity``
    constants, which :meth:`Message.model_validate_json` reads back. Other
    messages (no floats) take pydantic's faster path; both give the same text.
    """
    if message.tool_calls is None and message.tool_results is None:
        return message.model_dump_json()
    return to_json(message.model_dump(), inf_nan_mode="constants").decode()


def _rewind_count(turns: object) -> int:
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        raise ValueError(f"turns must be a positive int, got {turns!r}")
    return turns


class ContextOwner(Protocol):
    """What an attached context needs from its store (implemented by the SQL store)."""

    def _flush_context(self, ctx: SessionContext) -> None: ...

    async def _abegin_turn(self, ctx: SessionContext) -> None: ...

    async def _aend_turn(self, ctx: SessionContext) -> None: ...

    async def _adiscard_turn(self, ctx: SessionContext) -> None: ...

    async def _run_blocking(self, fn: Callable[..., _T], *args: Any) -> _T: ...


@dataclass
class _Snapshot:
    history: list[Message]
    seqs: list[int]
    agent: Agent
    cleared: bool
    summary: str | None = None
    summary_through: int = 0


@dataclass
class _TurnSnapshot:
    """Everything a turn may change, as it was when the turn began (restored if discarded)."""

    state: _Snapshot
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
    """What tells this session apart from a later one under the same id (the row's
    ``created_at``); a writer that finds another incarnation writes nothing."""
    hidden: frozenset[int] = frozenset()
    """Rows held back from memory: a trailing tool call without its result, written
    outside a turn by a writer that may have died. Deleted by the next write that
    appends a message after them."""
    summary: str | None = None
    summary_through: int = 0
    """The highest seq folded into ``summary`` (0: none)."""


class _TrackedDict(dict[str, Any]):
    """A dict that tells its context about top-level changes, so they get persisted.

    Values are checked to be JSON-serialisable before they are stored, so a bad
    value raises ``ValueError`` and changes nothing. Nested changes
    (``metadata["a"]["b"] = 1``) are not seen at once; they are persisted with
    the next write of the session (any message, or the end of the turn), unless
    the context catches up with another writer first (it then shows what the
    database holds). Assign the top-level key to have a nested change written now.
    """

    def __init__(self, owner: SessionContext, data: dict[str, Any]) -> None:
        super().__init__(data)
        self._owner = owner

    def _changed(self) -> None:
        self._owner._on_metadata_change()

    def __setitem__(self, key: str, value: Any) -> None:
        check_metadata({key: value})
        super().__setitem__(key, value)
        self._changed()

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self._changed()

    def update(self, *args: Any, **kwargs: Any) -> None:
        incoming = dict(*args, **kwargs)
        check_metadata(incoming)
        super().update(incoming)
        self._changed()

    def pop(self, key: str, *default: Any) -> Any:
        value = super().pop(key, *default)
        self._changed()
        return value

    def popitem(self) -> tuple[str, Any]:
        item = super().popitem()
        self._changed()
        return item

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def clear(self) -> None:
        super().clear()
        self._changed()

    def __ior__(self, other: Any) -> _TrackedDict:  # type: ignore[override,misc]
        self.update(other)
        return self


class _AnyLoopLock:
    """A FIFO lock awaited from any event loop in any thread.

    A context can outlive an event loop (``Runner.run`` uses ``asyncio.run``
    on every call) and be shared by threads that each run their own loop (a
    sync web server calling ``Runner.run`` per request). An ``asyncio.Lock``
    is bound to one loop, and a waiter parked in one loop and woken from
    another thread would never resume. Here each waiter parks on a future of
    its own loop and is handed the lock with that loop's
    ``call_soon_threadsafe``; a thread lock guards the state.
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
    """The object behind ``session.lock``: an ``asyncio.Lock`` that also frames a turn.

    ``async with session.lock:`` serialises turns of this session within the
    process. On entry the context catches up with what other processes
    committed (and the store may take a cross-process lock); on exit the
    turn's changes are written in one transaction.
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
        """Close the turn without writing anything, and let the next turn in.

        Memory goes back to the state the turn began with (history, active
        agent, metadata); what the database holds is untouched.
        """
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
        # A turn that ends by any exception (an error, a cancellation such as
        # asyncio.wait_for's timeout, KeyboardInterrupt) is discarded as a whole.
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
        self._journal: list[tuple[int, _Snapshot]] = []
        self._turn_snapshot: _Snapshot | None = None
        self._turn_start: _TurnSnapshot | None = None
        self._cleared = False
        self._in_turn = False
        # Writes pending (a turn closed, not yet written) or in progress: a refresh
        # must not install over them (a native-async refresh re-enters the mutex).
        self._writing = 0
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
        # What the first use must read (defer_load): guarded by a lock of its own that
        # is never held across I/O, so that a loop's thread never waits for a read.
        self._deferred_load: Callable[[], object] | None = None
        self._deferred_catch_up = False
        self._recreate: Callable[[], object] | None = None
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

        The model sees it as one SYSTEM message after the session's own
        SYSTEM messages, at the head of ``history``.
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

        For a store asked for a context on a thread whose event loop is
        running (the Runner's sync ``get_or_create``), where waiting on the
        database would block the loop. The turn's start runs ``load`` off the
        loop (:meth:`TurnLock.acquire`); any other first use (reading
        ``history``, ``metadata``, ``active_agent``..., or a change) runs it
        where it is. ``load`` reads or creates the session and installs it
        here; until it succeeded, every use tries it again.
        """
        with self._defer_lock:
            self._deferred_load, self._deferred_catch_up = load, False

    def defer_catch_up(
        self, catch_up: Callable[[], object], recreate: Callable[[], object]
    ) -> None:
        """Catch up with the database on first use (``catch_up``), as :meth:`defer_load` loads.

        A turn's start catches up by itself, so a turn drops it instead of
        running it; should the turn find the session deleted meanwhile (by
        another process), it runs ``recreate`` (off the loop), which creates
        the session anew in this context, and starts again. Ignored while a
        turn is open (the turn shows its own state) or a first load is
        pending (it reads everything anyway).
        """
        with self._defer_lock:
            if self._in_turn or self._deferred_load is not None:
                return
            self._deferred_load, self._deferred_catch_up = catch_up, True
            self._recreate = recreate

    def _drop_catch_up(self) -> Callable[[], object] | None:
        """A turn starts: it catches up itself. The dropped catch-up's ``recreate``, if any."""
        with self._defer_lock:
            recreate, self._recreate = self._recreate, None
            if not self._deferred_catch_up:
                return None
            self._deferred_load, self._deferred_catch_up = None, False
            return recreate

    @property
    def loaded(self) -> bool:
        """False while the context waits for its deferred first load (:meth:`defer_load`)."""
        return self._deferred_load is None

    def ensure_loaded(self) -> None:
        """Run the deferred first load now, if there is one (see :meth:`defer_load`)."""
        if self._deferred_load is None:
            return
        with self._mutex:  # one load at a time, and no other use of the state meanwhile
            with self._defer_lock:
                load, catch_up = self._deferred_load, self._deferred_catch_up
                # Reads made while it installs (by the load itself) see what it installs.
                self._deferred_load, self._deferred_catch_up = None, False
            if load is None:
                return
            try:
                load()
            except BaseException:
                with self._defer_lock:
                    if self._deferred_load is None:
                        self._deferred_load, self._deferred_catch_up = load, catch_up
                raise

    # -------------------------------------------------------------- mutation

    def add_message(self, message: Message) -> None:
        """Append a message and prune to ``max_turns`` complete turns.

        Raises:
            SessionDeletedError: If the session was deleted.

        """
        with self._mutex:
            self._check_alive()
            self._ensure_indexed()
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

        A clear wins over what it cleared: if another writer added messages
        before this change is written, they are dropped too (after a clear the
        session holds no message older than it).
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

        Inside ``session.lock`` a checkpoint taken at the start of the turn
        restores exactly the pre-turn history and active agent, even when the
        turn's messages pruned older turns. Otherwise the most recent recorded
        state of that length is restored; with none recorded, the history is
        truncated as upstream does. Rollback never undoes tool side effects.

        Raises:
            SessionDeletedError: If the session was deleted.

        """
        with self._mutex:
            self._check_alive()
            undo = self._snapshot()
            snapshot = self._find_snapshot(checkpoint_len)
            if snapshot is not None:
                self._restore(snapshot)
            elif 0 <= checkpoint_len < len(self._history):
                self._ensure_indexed()
                del self._history[checkpoint_len:]
                del self._seqs[checkpoint_len:]
                self._reindex()
            else:
                return
            self._changed(undo)

    def rewind(self, turns: int = 1) -> None:
        """Remove the last ``turns`` complete turns, in memory and in the store alike.

        Runs as a turn of its own (see :meth:`arewind`); call :meth:`arewind`
        from a running event loop. Edit-and-regenerate is a rewind, then a
        new turn with the edited message.

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

        The turn fences it like any other (on a SQL store it holds the
        session's lease and catches up first), and waits for a turn other
        tasks or threads have open; removed messages go to the archive on a
        store with ``archive_pruned=True``.

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
        """Regroup the whole history into whole turns (upstream's full algorithm).

        Normal appends prune incrementally; this is for callers that changed
        ``history`` by hand and want it made canonical again.
        """
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
        # Async writers of one context take turns: on a native-async store they
        # share the loop thread, where the thread mutex cannot tell them apart.
        async with self._async_writer:
            await self._owner._run_blocking(fn, *args)

    # ------------------------------------------------------------------ turns

    async def _abegin_turn(self) -> None:
        if self._owner is not None:
            async with self._async_writer:
                recreate = self._drop_catch_up()
                if self._deferred_load is not None:  # read off the loop, never on it
                    await self._owner._run_blocking(self.ensure_loaded)
                with self._mutex:
                    self._check_alive()
                try:
                    await self._owner._abegin_turn(self)
                except SessionDeletedError:
                    if recreate is None or self._deleted:
                        raise
                    await self._owner._run_blocking(self._locked, recreate)  # as get_or_create
                    await self._owner._abegin_turn(self)
        try:
            self._open_turn()
        except BaseException:
            if self._owner is not None:  # what the store took for the turn goes back
                await self._owner._adiscard_turn(self)
            raise

    def _locked(self, fn: Callable[[], object]) -> None:
        """``fn()`` holding the mutex: a load into this context, which nothing may use meanwhile."""
        with self._mutex:
            fn()

    def _open_turn(self) -> None:
        with self._mutex:
            self._drop_catch_up()  # set after the turn's own catch-up: nothing to add to it
            self._check_alive()
            self._ensure_indexed()
            self._in_turn = True
            self._journal.clear()
            self._turn_snapshot = self._snapshot()
            self._turn_start = _TurnSnapshot(
                self._turn_snapshot, dump_metadata(self._metadata), self._durable
            )

    def _close_turn(self, *, to_write: bool = False) -> _TurnSnapshot | None:
        with self._mutex:
            start = self._turn_start
            self._in_turn = False
            if to_write:
                self._writing += 1
            self._turn_snapshot = None
            self._turn_start = None
            self._journal.clear()
            return start

    async def _aend_turn(self) -> None:
        start = self._close_turn(to_write=self._owner is not None)
        if self._owner is not None:
            try:
                async with self._async_writer:
                    await self._owner._aend_turn(self)
            except BaseException:
                # Not written (or not known to be): memory shows what the database
                # held when the turn began, never an unsaved turn, and is checked
                # against the database again before the next one.
                self._discard_to(start, stale=True)
                raise
            finally:
                with self._mutex:
                    self._writing -= 1

    async def _adiscard_turn(self) -> None:
        self._discard_to(self._close_turn(), stale=False)
        if self._owner is not None:
            await self._owner._adiscard_turn(self)

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

    def _changed(self, undo: _Snapshot | None = None) -> None:
        """Persist now, or leave it for the end of the turn.

        If writing fails, the change is undone in memory (``undo`` is the state
        before it; metadata goes back to what was last written) and the context
        is marked stale, so the store reloads it from the database before its
        next use: memory never claims what the database does not hold.
        """
        if self._owner is None or self._in_turn:
            return
        durable = self._durable
        try:
            self._owner._flush_context(self)
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

    def _snapshot(self) -> _Snapshot:
        return _Snapshot(
            list(self._history), list(self._seqs), self.active_agent, self._cleared,
            self._summary, self._summary_through,
        )

    def _push_undo(self) -> _Snapshot:
        snapshot = self._snapshot()
        self._journal.append((len(self._history), snapshot))
        if len(self._journal) > _JOURNAL_LIMIT:
            del self._journal[0]
        return snapshot

    def _find_snapshot(self, checkpoint_len: int) -> _Snapshot | None:
        turn = self._turn_snapshot
        if turn is not None and len(turn.history) == checkpoint_len:
            self._journal.clear()
            return turn
        for index in range(len(self._journal) - 1, -1, -1):
            length, snapshot = self._journal[index]
            if length == checkpoint_len:
                del self._journal[index:]
                return snapshot
        return None

    def _restore(self, snapshot: _Snapshot) -> None:
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
        role = message.role
        if role == Role.SYSTEM:
            at = self._n_system - (self._summary is not None)  # the summary stays last
            self._history.insert(at, message)
            self._seqs.insert(at, self._new_seq())
            self._n_system += 1
        elif role == Role.USER:
            self._history.append(message)
            self._seqs.append(self._new_seq())
            self._turns.append(1)
        elif self._turns:
            self._history.append(message)
            self._seqs.append(self._new_seq())
            self._turns[-1] += 1
        # else: a non-USER message with no turn to belong to is discarded forward.
        self._enforce_window()

    def _enforce_window(self) -> None:
        excess = len(self._turns) - self._max_turns
        if excess <= 0:
            return
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

    def _load(
        self,
        messages: list[Message],
        seqs: list[int],
        agent: Agent,
        metadata: dict[str, Any],
        durable: DurableState,
    ) -> None:
        """Replace the whole state with what the store read (caller holds the mutex)."""
        self._history = messages
        self._seqs = seqs
        self.active_agent = agent
        self._replace_metadata(metadata)
        self._next_seq = max(
            self._next_seq,
            max(durable.seqs | durable.hidden, default=0) + 1,
            durable.summary_through + 1,
        )
        self._journal.clear()
        self._durable = durable
        self._stale = False
        self._cleared = False
        self._summary = durable.summary
        self._summary_through = durable.summary_through
        self._reindex()
        self._place_summary()

    def _replace_metadata(self, metadata: dict[str, Any]) -> None:
        self._metadata = _TrackedDict(self, metadata)

    def _pending_messages(self) -> list[tuple[int, Message]]:
        """Messages in memory that the database does not hold yet, with their seqs."""
        durable = self._durable.seqs if self._durable is not None else set()
        pairs = zip(self._seqs, self._history, strict=True)
        return [
            (seq, message) for seq, message in pairs if seq not in durable and seq != SUMMARY_SEQ
        ]

    # -------------------------------------------------------------- summary

    def _is_summary(self, message: Message) -> bool:
        """True if ``message`` is the summary's SYSTEM message this context shows, or a copy.

        A copy too: ``history = [m.model_copy() for m in history]`` (a redaction
        pass, a JSON round trip) must not store the summary as a message.
        """
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

    async def _aapply_summary(self, summary: str, based_on: int, through: int) -> bool:
        """Take ``summary`` (of the turns up to seq ``through``) as a turn of its own.

        Only over the summary it was made from (``based_on``, what
        ``summary_through`` was then): False, changing nothing, if another
        summary came first, or if a message it covers is back in the window (a
        rollback undid its prune: the model would see it twice).
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
