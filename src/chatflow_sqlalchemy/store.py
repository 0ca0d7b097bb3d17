"""The generic SQLAlchemy session store.

Every query lives here, written once against SQLAlchemy Core; backends only
contribute a :class:`~chatflow_sqlalchemy.dialect.DialectSupport`. The async
API runs the same sync code through :meth:`SQLAlchemySessionStore._run_blocking`
(a private thread pool for on-disk SQLite, directly on the loop for in-memory
SQLite, in greenlets on an AsyncEngine for PostgreSQL and ``sqlite+aiosqlite``),
so there is no second copy of the SQL.

Write path, per logical operation one transaction:

* outside ``session.lock`` each context change is written at once;
* inside it (one Runner turn) the turn's messages, prunes, handoff and
  metadata are written in one transaction when the lock is released.

Each write starts with a compare-and-swap of the session's ``version``
(``UPDATE ... WHERE version = :known``), under the database's write lock (row
lock on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite). If another process wrote
since this context loaded, the context is rebased on the fresh rows and its
new messages are appended after them as whole turns, never interleaved.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import logging
import os
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

from chatflow_agent import Agent, Message, Role
from pydantic import ValidationError
from pydantic_core import PydanticSerializationError
from sqlalchemy import (
    URL,
    Connection,
    Engine,
    Executable,
    Table,
    bindparam,
    case,
    create_engine,
    delete,
    insert,
    make_url,
    select,
    update,
)
from sqlalchemy import exc as sa_exc

from chatflow_sqlalchemy import telemetry
from chatflow_sqlalchemy.aio import AsyncStoreAPI
from chatflow_sqlalchemy.claims import (
    DEFAULT_DEDUP_TTL_HOURS,
    DEFAULT_LEASE_SECONDS,
    MAX_DEDUP_TTL_HOURS,
    ClaimFence,
    WebhookClaim,
    active_fence,
    validate_dedup_ttl,
    validate_message_id,
)
from chatflow_sqlalchemy.context import (
    DurableState,
    SessionContext,
    dump_message,
    dump_metadata,
    validate_max_turns,
    validate_session_id,
)
from chatflow_sqlalchemy.crypto import AESGCMCipher, is_encrypted
from chatflow_sqlalchemy.dialect import DialectSupport, SessionWrite, TurnLocks
from chatflow_sqlalchemy.exceptions import (
    BackendImportError,
    ClaimLostError,
    CorruptRowError,
    DatabaseUnavailableError,
    SessionDeletedError,
)
from chatflow_sqlalchemy.iopool import IOPool
from chatflow_sqlalchemy.lifecycle import (
    EXPORT_FORMAT,
    SWEEP_BATCH,
    ListFilters,
    pruned_seqs,
    touch_interval,
    validate_archive_pruned,
    validate_session_ttl,
    validate_sweep_limit,
    validate_user_id,
)
from chatflow_sqlalchemy.models import (
    ChatflowMessage,
    ChatflowProcessedMessage,
    ChatflowSession,
    utcnow,
)
from chatflow_sqlalchemy.sealing import ROTATE_BATCH, Sealer, rotate_batch
from chatflow_sqlalchemy.sql_claims import FENCE_CLAIM, SQLClaims
from chatflow_sqlalchemy.sql_lifecycle import (
    SweepCursor,
    archive_rows,
    decode_transcript,
    erase_sessions,
    export_sessions,
    session_page,
    sweep_candidates,
    touch_session,
    transcript_sources,
    user_session_ids,
)

if TYPE_CHECKING:  # the asyncio extension needs greenlet: imported only where it is used
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = [
    "DEFAULT_DATABASE_URL",
    "DEFAULT_DEDUP_TTL_HOURS",
    "MAX_DEDUP_TTL_HOURS",
    "SQLAlchemySessionStore",
    "database_url_from_env",
]

_T = TypeVar("_T")

logger = logging.getLogger("chatflow_sqlalchemy")

_IN_ASYNC_FACADE: ContextVar[bool] = ContextVar("chatflow_in_async_facade", default=False)
"""True while store code runs in a greenlet on the AsyncEngine's sync facade."""

ASYNC_INSTALL_HINT = "pip install 'chatflow-sqlalchemy[aiosqlite]'"

DEFAULT_DATABASE_URL = "sqlite:///chatflow.db"

_RECENTLY_VERIFIED = 0.05
"""Seconds during which a context checked against the database counts as current.

Only backends without a cross-process turn lock use it (to skip a second
version check right after ``get_or_create``); their writes still compare and
swap the version, so a stale context is rebased, never merged blindly.
"""

_FIRST_VERSION_BITS = 52
"""New sessions start at a random version below 2**52 (still exact as a float in JSON)."""

_PURGE_BATCH = 1000
_PURGE_INTERVAL = timedelta(minutes=5)

_sessions = cast(Table, ChatflowSession.__table__)
_messages = cast(Table, ChatflowMessage.__table__)
_processed = cast(Table, ChatflowProcessedMessage.__table__)

_SELECT_VERSION = select(_sessions.c.version).where(
    _sessions.c.session_id == bindparam("session_id")
)
_SELECT_SESSION = select(
    _sessions.c.version,
    _sessions.c.active_agent_name,
    _sessions.c.metadata_json,
    _sessions.c.created_at,
    _sessions.c.updated_at,
).where(_sessions.c.session_id == bindparam("session_id"))
_SELECT_MESSAGES = (
    select(_messages.c.id, _messages.c.seq, _messages.c.message_json)
    .where(_messages.c.session_id == bindparam("session_id"))
    .order_by(case((_messages.c.role == Role.SYSTEM.value, 0), else_=1), _messages.c.seq)
)
_INSERT_MESSAGES = insert(_messages)
_DELETE_ALL_MESSAGES = delete(_messages).where(_messages.c.session_id == bindparam("session_id"))
_DELETE_SOME_MESSAGES = _DELETE_ALL_MESSAGES.where(
    _messages.c.seq.in_(bindparam("seqs", expanding=True))
)
_BUMP_SESSION = (
    update(_sessions)
    .where(
        _sessions.c.session_id == bindparam("sid"),
        _sessions.c.version == bindparam("expected"),
    )
    .values(
        version=bindparam("new_version"),
        active_agent_name=bindparam("agent_name"),
        updated_at=bindparam("now"),
    )
)
_BUMP_SESSION_AND_METADATA = _BUMP_SESSION.values(metadata_json=bindparam("metadata"))
_IS_PROCESSED = select(_processed.c.message_id).where(
    _processed.c.message_id == bindparam("message_id"),
    _processed.c.processed_at >= bindparam("cutoff"),
)


def database_url_from_env(url: str | URL | None = None) -> str | URL:
    """Return ``url``, else ``$CHATFLOW_DATABASE_URL``, else ``sqlite:///chatflow.db``."""
    return url or os.environ.get("CHATFLOW_DATABASE_URL") or DEFAULT_DATABASE_URL


class _Guard:
    """What :meth:`SQLAlchemySessionStore._guard` returns; holds no per-use state.

    A class rather than a ``@contextmanager`` generator: three guarded units
    run every turn, and a generator context manager costs several times more.
    """

    __slots__ = ("_serial", "_url")

    def __init__(self, serial: threading.RLock | None, url: URL) -> None:
        self._serial = serial
        self._url = url

    def __enter__(self) -> None:
        if self._serial is not None:
            self._serial.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._serial is not None:
            self._serial.release()
        if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError)) and (
            exc.connection_invalidated or _is_connect_error(exc)
        ):
            reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
            message = f"cannot reach {_describe(self._url)}: {reason}"
            raise DatabaseUnavailableError(message) from exc


def _describe(url: URL) -> str:
    """Name host and database of ``url`` without the password."""
    if url.get_backend_name() == "sqlite":
        return f"SQLite database {url.database or ':memory:'!r}"
    host = f"{url.host or 'localhost'}:{url.port}" if url.port else (url.host or "localhost")
    return f"{url.get_backend_name()} database {url.database!r} on {host} as {url.username!r}"


_SWEEP_DEADLOCK_RETRIES = 5


def _is_deadlock(exc: sa_exc.DBAPIError) -> bool:
    """The database rolled the transaction back as a deadlock victim (SQLSTATE 40001/40P01)."""
    orig = exc.orig
    if getattr(orig, "sqlstate", None) in ("40001", "40P01"):
        return True
    args: tuple[Any, ...] = tuple(getattr(orig, "args", ()))
    return bool(args) and args[0] == 1213  # MySQL/MariaDB ER_LOCK_DEADLOCK (SQLSTATE 40001)


@dataclass
class _StoredSession:
    """A session as read from the database (the rows of its window)."""

    version: int
    agent_name: str
    metadata: dict[str, Any]
    messages: list[Message]
    seqs: list[int]
    created_at: datetime | None = None
    updated_at: datetime | None = None


class SQLAlchemySessionStore(AsyncStoreAPI):
    """Session store on any database with a chatflow-sqlalchemy backend.

    Args:
        url: SQLAlchemy URL; defaults to ``$CHATFLOW_DATABASE_URL`` or
            ``sqlite:///chatflow.db``. Ignored when ``engine`` is given.
        engine: An existing engine to use (the store does not dispose it).
        default_max_turns: History window of new contexts, in complete turns.
        dedup_ttl_hours: How long a processed webhook id stays claimed.
        session_ttl_hours: A session not updated for this many hours is expired
            and removed by ``sweep()``; None (the default) keeps sessions forever.
        archive_pruned: Keep the messages pruning drops from the window in the
            archive table (read back by ``transcript()``) instead of deleting them.
        cipher: An :class:`~chatflow_sqlalchemy.crypto.AESGCMCipher`: message
            content and metadata are encrypted at rest (see :mod:`~chatflow_sqlalchemy.sealing`).
        require_encryption: Refuse plaintext rows with ``CorruptRowError``.
        auto_migrate: Create or upgrade the schema on open (True), or refuse
            a missing or old schema with
            :class:`~chatflow_sqlalchemy.exceptions.SchemaError` and change
            nothing (False). None (the default) reads ``CHATFLOW_AUTO_MIGRATE``
            (``0/false/no/off`` turn it off; unset means on).
        engine_options: Keyword arguments for ``create_engine`` over the
            dialect's defaults (pool sizes, ``pool_recycle``, ``echo``...;
            ``connect_args`` key by key) when the store creates its engine from
            ``url``, for its AsyncEngine too on a native-async URL; an
            ``engine`` you pass is used as it is (a ``ValueError`` with both).

    The schema is created or upgraded on open (under a cross-process lock); a
    database migrated by a newer version raises
    :class:`~chatflow_sqlalchemy.exceptions.SchemaAheadError`. What was
    migrated is logged at INFO on the ``chatflow_sqlalchemy`` logger.

    Raises:
        ValueError: For invalid parameters (or an unreadable ``CHATFLOW_AUTO_MIGRATE``).
        SchemaError: The schema is missing or behind and auto-migration is off.
        BackendNotFoundError: When no backend handles the URL's dialect.
        DatabaseUnavailableError: When the database cannot be reached.

    """

    dialect_support: ClassVar[DialectSupport | None] = None
    """Set by backend subclasses; the generic class looks it up by dialect name."""

    _blocking_io_workers: ClassVar[int] = 4
    _context_cache_size: ClassVar[int] = 256

    def __init__(
        self,
        url: str | URL | None = None,
        *,
        engine: Engine | None = None,
        default_max_turns: int = 40,
        dedup_ttl_hours: float = DEFAULT_DEDUP_TTL_HOURS,
        auto_migrate: bool | None = None,
        session_ttl_hours: float | None = None,
        archive_pruned: bool = False,
        cipher: AESGCMCipher | None = None,
        require_encryption: bool = False,
        engine_options: Mapping[str, Any] | None = None,
    ) -> None:
        from chatflow_sqlalchemy.migrate import auto_migrate_enabled

        self.auto_migrate = auto_migrate_enabled(auto_migrate)
        self.default_max_turns = validate_max_turns(default_max_turns, "default_max_turns")
        self.dedup_ttl_hours = validate_dedup_ttl(dedup_ttl_hours)
        self._dedup_ttl = timedelta(hours=self.dedup_ttl_hours)
        self.session_ttl_hours = validate_session_ttl(session_ttl_hours)
        self.archive_pruned = validate_archive_pruned(archive_pruned)
        self._sealer = Sealer(cipher, require_encryption)
        self._agent_resolver: Callable[[str], Agent | None] | None = None
        self._warned_agents: set[str] = set()
        self._contexts: weakref.WeakValueDictionary[str, SessionContext] = (
            weakref.WeakValueDictionary()
        )
        self._recent: OrderedDict[str, SessionContext] = OrderedDict()
        self._cache_lock = threading.RLock()
        self._pool: IOPool | None = None
        self._pool_lock = threading.Lock()
        self._closed = False
        self._last_purge = utcnow()

        self._extra_engine_options = dict(engine_options or {})
        if engine is None:
            self.url = make_url(database_url_from_env(url))
            self.support = self._support_for(self.url.get_backend_name())
            sync_url = self.support.sync_url(self.url)
            options = _merged(self.support.engine_options(sync_url), self._extra_engine_options)
            # A backend's own class picked the driver; the generic one takes the URL's.
            hint = self.support.install_hint if type(self).dialect_support is not None else ""
            engine = _create_engine(sync_url, options, hint)
            self._owns_engine = True
        else:
            if engine_options:
                raise ValueError(
                    "engine_options apply to an engine the store creates from url; "
                    "configure the engine you pass as engine= yourself"
                )
            self.url = engine.url
            self.support = self._support_for(engine.dialect.name)
            self._owns_engine = False
        try:
            self._open_on(engine)
        except BaseException:
            if self._owns_engine:
                engine.dispose()
            raise

    def _open_on(self, engine: Engine) -> None:
        """Set the store up on ``engine`` (its own or the caller's)."""
        self.support.prepare_engine(engine)
        self.engine = engine
        self._system = engine.dialect.name  # db.system.name in telemetry
        self._turn_locks: TurnLocks | None = self.support.turn_locks(engine)
        self._engines = self._engine_modes(engine)
        # Dialect statements are built once: building an upsert costs more than running it.
        self._insert_session = self.support.insert_ignore(_sessions)
        self._claim = self.support.claim_processed(_processed)
        self._mark = self.support.upsert_processed(_processed)
        self._purge = self.support.purge_processed(_processed, _PURGE_BATCH)
        self._lock_version = self.support.lock_session_row(_SELECT_VERSION)
        # A backend that overrides the hook sends each write as one statement.
        self._writes_at_once = (
            type(self.support).write_at_once is not DialectSupport.write_at_once
        )
        self._aengines: tuple[Engine, Engine, Engine] | None = None
        self._ephemeral = self.support.is_ephemeral(self.url)
        # One shared connection (in-memory SQLite) must not be used by two threads at once.
        self._serial: threading.RLock | None = threading.RLock() if self._ephemeral else None
        self._guarded = _Guard(self._serial, self.url)
        self._native_async = False
        self._aengine: AsyncEngine | None = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._claims_backend: SQLClaims | None = None
        try:
            self._native_async = self._wants_native_async()
            self._open_schema()
        except BaseException:
            if self._turn_locks is not None:
                self._turn_locks.close()
            raise

    # ------------------------------------------------------------ plumbing

    def _wants_native_async(self) -> bool:
        """Whether the async API runs in greenlets on an AsyncEngine (else the thread pool).

        Needs an async driver for the URL and greenlet (the asyncio extension
        of SQLAlchemy). A URL that names an async driver itself
        (``sqlite+aiosqlite://``) without greenlet installed is refused with
        the extra to install; otherwise the thread pool serves the async API.

        Raises:
            BackendImportError: The URL asks for an async driver and greenlet is missing.

        """
        if self._ephemeral or self.support.async_url(self.url) is None:
            return False
        if not self._owns_engine:
            # A given engine carries settings (connect_args, pool, listeners) that an
            # AsyncEngine built from its URL would not: its async work runs on threads.
            return False
        if _greenlet_available():
            return True
        if self.support.sync_url(self.url).drivername != self.url.drivername:
            raise BackendImportError(
                f"{self.url.drivername} runs on SQLAlchemy's asyncio extension, which needs "
                f"greenlet: {ASYNC_INSTALL_HINT}"
            )
        return False

    @classmethod
    def _support_for(cls, dialect_name: str) -> DialectSupport:
        if cls.dialect_support is not None:
            return cls.dialect_support
        from chatflow_sqlalchemy.registry import load_backend

        backend = load_backend(dialect_name)
        if backend.dialect_support is None:
            raise TypeError(f"backend {dialect_name!r} ({backend!r}) declares no dialect_support")
        return backend.dialect_support

    @classmethod
    def from_url(cls, url: str | URL, **kwargs: Any) -> SQLAlchemySessionStore:
        """Open a store of this class for ``url`` (what ``open_store`` calls)."""
        return cls(url, **kwargs)

    def _open_schema(self) -> None:
        from chatflow_sqlalchemy.migrate import ensure_schema, require_existing_database

        with self._guard():
            if not self.auto_migrate:  # connecting would create a missing SQLite file
                require_existing_database(self.engine)
            _require_transactions(self.engine)
            ensure_schema(self.engine, self.support, auto_migrate=self.auto_migrate)

    def _guard(self) -> _Guard:
        """``with self._guard():``: connection failures become one clear, password-free error.

        It also serialises the users of a single shared connection (in-memory SQLite).
        """
        return self._guarded

    @contextmanager
    def _transaction(self, *, write: bool = False, single: bool = False) -> Iterator[Connection]:
        """One transaction; ``write`` takes the database's write lock up front.

        ``single`` is for one statement that is atomic on its own: it runs in
        the driver's autocommit mode, without BEGIN/COMMIT round trips.

        Inside :meth:`_run_blocking` on a native-async store this code runs in
        a greenlet and uses the AsyncEngine's sync facade, so the very same
        statements execute on the async driver without a thread hop.
        """
        self._check_open()
        engines = self._aengines if self._in_async_facade() else self._engines
        assert engines is not None
        with self._guard(), engines[2 if single else int(write)].begin() as conn:
            yield conn

    def _engine_modes(self, engine: Engine) -> tuple[Engine, Engine, Engine]:
        """The engine as used for reads, for writes, and for single autocommit statements."""
        return (
            engine,
            engine.execution_options(chatflow_write=True),
            engine.execution_options(**self.support.autocommit_options()),
        )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this session store is closed; open a new one")

    async def _run_blocking(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run blocking database work off the event loop.

        On-disk databases use a private pool of ``_blocking_io_workers`` threads
        owned by the store; in-memory SQLite runs directly on the loop, where a
        thread hop would cost more than the work.
        """
        if self._ephemeral:
            return fn(*args)
        if self._native_async and await self._async_engine_for_loop() is not None:
            return cast(_T, await _greenlet_spawn()(_on_async_facade, fn, *args))
        return await self._io_pool().run(fn, *args)

    def _in_async_facade(self) -> bool:
        """True in :meth:`_run_blocking`'s greenlet: use the AsyncEngine's sync facade."""
        return self._native_async and _IN_ASYNC_FACADE.get()

    def _make_async_engine(self) -> AsyncEngine:
        """Create the AsyncEngine of a native-async store (backends may add options).

        Raises:
            BackendImportError: The async driver is not installed (names the extra).

        """
        from sqlalchemy.ext.asyncio import create_async_engine

        url = self.support.async_url(self.url)
        assert url is not None
        try:
            options = _merged(self.support.engine_options(url), self._extra_engine_options)
            return create_async_engine(url, **options)
        except ImportError as exc:
            raise BackendImportError(
                f"{url.drivername} needs its async driver: {ASYNC_INSTALL_HINT} ({exc})"
            ) from exc

    async def _async_engine_for_loop(self) -> AsyncEngine | None:
        """The AsyncEngine for the running loop, or None: use the thread pool from this loop.

        Async connections belong to the loop that opened them, so the
        AsyncEngine serves one loop at a time. A store that outlives a loop
        (``Runner.run`` calls ``asyncio.run`` every time) hands it to the next
        loop once the old one is closed, after closing the old loop's idle
        connections. While the owning loop still runs (threads that each run
        their own loop over one store), other loops run their I/O on the
        store's threads, on the sync engine.
        """
        loop = asyncio.get_running_loop()
        with self._pool_lock:
            self._check_open()
            owner = self._aloop
            if owner is not None and owner is not loop and not owner.is_closed():
                return None
            stale = self._aengine is not None and owner is not loop
            if self._aengine is None:
                self._aengine = self._make_async_engine()
                facade = self._aengine.sync_engine
                self.support.prepare_engine(facade)
                self._aengines = self._engine_modes(facade)
            self._aloop = loop
            engine = self._aengine
        if stale:
            await engine.dispose()
        return engine

    def _io_pool(self) -> IOPool:
        with self._pool_lock:
            self._check_open()
            if self._pool is None:
                self._pool = IOPool(self._blocking_io_workers, thread_name_prefix="chatflow-io")
            return self._pool

    # ------------------------------------------------------------ contexts

    def set_agent_resolver(self, resolver: Callable[[str], Agent | None]) -> None:
        """Register how stored agent names map back to Agent objects (the Runner does)."""
        self._agent_resolver = resolver

    def _resolve_agent(self, name: str, default: Agent | None) -> Agent:
        if self._agent_resolver is not None:
            agent = self._agent_resolver(name)
            if agent is not None:
                return agent
        if default is not None and default.name == name:
            return default
        if name not in self._warned_agents:
            self._warned_agents.add(name)
            logger.warning(
                "no agent resolver knows agent %r; using a temporary fallback agent without "
                "tools (pass session_store= to a Runner that knows it, or call "
                "store.set_agent_resolver)",
                name,
            )
        return Agent(name=name, instructions="", model="gemini-2.5-flash")

    def _cached(self, session_id: str) -> SessionContext | None:
        with self._cache_lock:
            ctx = self._contexts.get(session_id)
            if ctx is not None:
                self._recent[session_id] = ctx
                self._recent.move_to_end(session_id)
            return ctx

    def _publish(self, ctx: SessionContext) -> SessionContext:
        """Cache ``ctx`` unless another thread published a live one first."""
        with self._cache_lock:
            existing = self._contexts.get(ctx.session_id)
            if existing is not None and not existing.deleted:
                return existing
            self._contexts[ctx.session_id] = ctx
            self._recent[ctx.session_id] = ctx
            self._recent.move_to_end(ctx.session_id)
            while len(self._recent) > self._context_cache_size:
                self._recent.popitem(last=False)
            return ctx

    def _forget(self, session_id: str) -> None:
        with self._cache_lock:
            ctx = self._contexts.pop(session_id, None)
            self._recent.pop(session_id, None)
        if ctx is not None:
            ctx._deleted = True

    def _build_context(self, stored: _StoredSession, session_id: str,
                       default_agent: Agent | None) -> SessionContext:
        agent = self._resolve_agent(stored.agent_name, default_agent)
        ctx = SessionContext(session_id, agent, max_turns=self.default_max_turns)
        self._install(ctx, stored, agent)
        ctx._owner = self
        return ctx

    def _install(
        self,
        ctx: SessionContext,
        stored: _StoredSession,
        agent: Agent,
        shown: frozenset[int] | set[int] = frozenset(),
    ) -> None:
        """Load ``stored`` into ``ctx``; ``shown`` are the seqs ``ctx`` shows already."""
        messages, seqs, hidden = _repair_window(stored.messages, stored.seqs, shown)
        durable = DurableState(
            version=stored.version,
            seqs=set(stored.seqs).difference(hidden),
            agent_name=stored.agent_name,
            metadata_json=dump_metadata(stored.metadata),
            incarnation=stored.created_at,
            hidden=frozenset(hidden),
        )
        ctx._load(messages, seqs, agent, stored.metadata, durable)
        if stored.updated_at is not None:
            age = max((utcnow() - stored.updated_at).total_seconds(), 0.0)
            ctx._touched_at = max(ctx._touched_at, time.monotonic() - age)

    def _refresh(self, ctx: SessionContext) -> bool:
        """Catch ``ctx`` up with the database; False if its session is gone."""
        version = self._read_version(ctx.session_id)
        if version is None:
            self._forget(ctx.session_id)
            return False
        durable = ctx._durable
        if durable is not None and durable.version == version and not ctx._stale:
            ctx._verified_at = time.monotonic()
            return True
        stored = self._load(ctx.session_id)
        if stored is None or _other_incarnation(ctx, stored):
            self._forget(ctx.session_id)
            return False
        with ctx._mutex:
            if _holds_newer_than(ctx, stored):
                return True
            agent = self._resolve_agent(stored.agent_name, ctx.active_agent)
            carried = _orphaned_tool_call(ctx, stored) or _unsaved_tail_call(ctx)
            self._install(ctx, stored, agent, set(ctx._seqs))
            if carried is not None:
                ctx._append(carried)  # unsaved again: written with its result
            ctx._verified_at = time.monotonic()
        return True

    def _read_version(self, session_id: str) -> int | None:
        """The session's committed version (one autocommit statement), None if it is gone."""
        row = self._single_row(_SELECT_VERSION, {"session_id": session_id})
        return None if row is None else int(row[0])

    def _single_row(self, statement: Executable, params: dict[str, Any]) -> Any:
        """First row of one self-contained statement, run without BEGIN/COMMIT."""
        with self._transaction(single=True) as conn:
            return conn.execute(statement, params).first()

    def _read_session(self, conn: Connection, session_id: str) -> _StoredSession | None:
        row = _fetch_session_row(conn, session_id)
        if row is None:
            return None
        metadata = self._sealer.open_metadata(session_id, row.metadata_json)
        if not isinstance(metadata, dict):
            kind = type(metadata).__name__
            raise CorruptRowError(
                session_id, None, f"metadata_json is not a JSON object (found {kind})",
                table="chatflow_sessions",
            )
        messages: list[Message] = []
        seqs: list[int] = []
        for msg_row in conn.execute(_SELECT_MESSAGES, {"session_id": session_id}):
            text = msg_row.message_json
            if self._sealer.active or self._sealer.require or is_encrypted(text):
                text = self._sealer.open_text(session_id, msg_row.id, text, "chatflow_messages")
            messages.append(_parse_message(session_id, msg_row.id, text))
            seqs.append(msg_row.seq)
        return _StoredSession(
            row.version,
            row.active_agent_name,
            metadata,
            messages,
            seqs,
            row.created_at,
            row.updated_at,
        )

    # ------------------------------------------------------------ store API

    def get_or_create(
        self,
        session_id: str,
        default_agent: Agent,
        metadata: dict[str, Any] | None = None,
        *,
        user_id: str | None = None,
    ) -> SessionContext:
        """Return the session's context, creating the session if it does not exist.

        ``metadata`` is stored only when the session is created. ``user_id``
        records whose session it is (on creation, or on a session that has
        none yet). The same context object is returned for a session while
        anyone holds it, so its ``lock`` serialises turns within the process.

        Raises:
            ValueError: For an invalid ``session_id``, ``user_id`` or non-JSON
                ``metadata``, or a ``user_id`` other than the session's own.

        """
        validate_session_id(session_id)
        if user_id is not None:
            validate_user_id(user_id)
            ctx = self._get_or_create(session_id, default_agent, metadata, user_id)
            self._record_owner(session_id, user_id)
            return ctx
        return self._get_or_create(session_id, default_agent, metadata, None)

    def _record_owner(self, session_id: str, user_id: str) -> None:
        """Make ``user_id`` the session's owner, unless it already has another one."""
        with self._transaction() as conn:
            owner = conn.execute(
                select(_sessions.c.user_id).where(_sessions.c.session_id == session_id)
            ).scalar()
        if owner is None:
            with self._transaction(write=True) as conn:
                conn.execute(
                    update(_sessions)
                    .where(_sessions.c.session_id == session_id, _sessions.c.user_id.is_(None))
                    .values(user_id=user_id)
                )
                owner = conn.execute(
                    select(_sessions.c.user_id).where(_sessions.c.session_id == session_id)
                ).scalar()
        if owner is not None and owner != user_id:
            raise ValueError(
                f"session {session_id!r} belongs to another user_id; a session has one owner "
                "(use a session id of this user's, or erase_user the other one first)"
            )

    def _get_or_create(
        self,
        session_id: str,
        default_agent: Agent,
        metadata: dict[str, Any] | None,
        user_id: str | None,
    ) -> SessionContext:
        metadata = dict(metadata or {})
        if metadata:
            dump_metadata(metadata)  # bad metadata fails now, whether or not it gets stored
        ctx, stored = self._lookup(session_id)
        if ctx is not None:
            return ctx
        if stored is None:
            now = utcnow()
            with self._transaction(write=True) as conn:
                conn.execute(
                    self._insert_session,
                    {
                        "session_id": session_id,
                        "active_agent_name": default_agent.name,
                        "metadata_json": self._sealer.seal_metadata(session_id, metadata),
                        "version": _first_version(),
                        "created_at": now,
                        "updated_at": now,
                        "user_id": user_id,
                    },
                )
                stored = self._read_session(conn, session_id)
            assert stored is not None
        return self._publish(self._build_context(stored, session_id, default_agent))

    def get(self, session_id: str) -> SessionContext | None:
        """Return the session's context, or None if the session does not exist."""
        validate_session_id(session_id)
        ctx, stored = self._lookup(session_id)
        if ctx is not None or stored is None:
            return ctx
        return self._publish(self._build_context(stored, session_id, None))

    def _lookup(self, session_id: str) -> tuple[SessionContext | None, _StoredSession | None]:
        """The live cached context (checked against the database), else the stored rows."""
        ctx = self._cached(session_id)
        if ctx is not None and (ctx._in_turn or self._refresh(ctx)):
            return ctx, None
        return None, self._load(session_id)

    def _load(self, session_id: str) -> _StoredSession | None:
        """The session's row and messages, read in one snapshot (None: no such session)."""
        with telemetry.operation("load", self._system) as op, self._transaction() as conn:
            stored = self._read_session(conn, session_id)
            op.set("chatflow.messages", 0 if stored is None else len(stored.messages))
            return stored

    def delete(self, session_id: str) -> bool:
        """Delete a session and its messages; live contexts then raise SessionDeletedError."""
        validate_session_id(session_id)
        with self._transaction(write=True) as conn:
            result = conn.execute(delete(_sessions).where(_sessions.c.session_id == session_id))
        self._forget(session_id)
        return bool(result.rowcount)

    def list_sessions(
        self,
        *,
        user_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        updated_after: datetime | None = None,
        limit: int | None = None,
        after: str | None = None,
    ) -> list[str]:
        """Session ids, filtered and paged (see :mod:`chatflow_sqlalchemy.lifecycle`).

        Without arguments: every id, most recently updated first (as 0.3.4).
        ``user_id``, ``metadata`` (key -> value, all must match, compared by
        JSON type) and ``updated_after`` filter; ``limit`` and ``after`` (the
        last id of the previous page) page by keyset in ``session_id`` order.

        Raises:
            ValueError: For an invalid argument (the message says which).

        """
        filters = ListFilters.build(
            user_id=user_id, metadata=metadata, updated_after=updated_after,
            limit=limit, after=after,
        )
        if filters.metadata and self._sealer.active:
            raise ValueError(
                "metadata filters cannot look inside encrypted metadata (this store has a "
                "cipher=): filter by user_id / updated_after, or keep the key in user_id"
            )
        with self._transaction() as conn:
            return session_page(conn, filters)

    def erase_user(self, user_id: str) -> int:
        """Erase every session of ``user_id`` with its messages and claims, in one transaction.

        Live contexts of the erased sessions then raise ``SessionDeletedError``.
        Returns how many sessions were erased.

        Raises:
            ValueError: For an invalid ``user_id``.

        """
        validate_user_id(user_id)
        with self._transaction(write=True) as conn:
            ids = user_session_ids(conn, user_id, lock=True)
            erased = erase_sessions(conn, ids)
        for session_id in ids:
            self._forget(session_id)
        return erased

    def sweep(self, limit: int | None = None) -> int:
        """Remove expired sessions (messages and claims too) in batches; return how many.

        A session is expired when not updated for ``session_ttl_hours``. Each
        batch of at most ``SWEEP_BATCH`` sessions is one transaction. Never
        removed: a session whose turn is in progress (its turn lock is held,
        on backends with one, or a turn of this store is running) or that a
        live webhook claim holds. Many processes may sweep at once: each
        session is removed by exactly one of them.

        Raises:
            ValueError: The store has no ``session_ttl_hours``, or ``limit`` is invalid.

        """
        ttl = self._session_ttl()
        validate_sweep_limit(limit)
        cutoff = utcnow() - ttl
        cursor = SweepCursor()
        total = 0
        while limit is None or total < limit:
            want = SWEEP_BATCH if limit is None else min(SWEEP_BATCH, limit - total)
            found, removed = self._sweep_batch(cutoff, want, cursor)
            total += len(removed)
            for session_id in removed:
                self._forget(session_id)
            if len(found) < want:
                break
        telemetry.count("chatflow.sessions.swept", total, self._system)
        return total

    def _sweep_batch(
        self, cutoff: datetime, want: int, cursor: SweepCursor
    ) -> tuple[list[str], list[str]]:
        """One sweep transaction: (candidates found, sessions removed).

        Sweepers racing on the same rows can be chosen as a deadlock victim
        (InnoDB); the database rolled that transaction back whole, so it is
        run again, a bounded number of times.
        """
        start = (cursor.updated_at, cursor.session_id)
        for attempt in range(_SWEEP_DEADLOCK_RETRIES):
            cursor.updated_at, cursor.session_id = start  # a rolled-back batch is redone whole
            try:
                # Left in reverse order: turn locks held until the transaction committed.
                with ExitStack() as held, self._transaction(write=True) as conn:
                    found = sweep_candidates(
                        conn, cutoff, utcnow(), want, cursor, self.support.lock_batch
                    )
                    ours = self._sweep_busy(found)
                    others = held.enter_context(
                        self.support.hold_turns(
                            conn, [s for s in found if s not in ours], self._turn_locks
                        )
                    )
                    removed = [sid for sid in found if sid not in ours | others]
                    erase_sessions(conn, removed)
                return found, removed
            except sa_exc.OperationalError as exc:
                if not _is_deadlock(exc) or attempt == _SWEEP_DEADLOCK_RETRIES - 1:
                    raise
                time.sleep(0.01 * (attempt + 1))
        raise AssertionError("unreachable")  # pragma: no cover

    def transcript(self, session_id: str) -> list[Message]:
        """The whole conversation: archived messages, then the window, in order.

        Archived messages exist for stores opened with ``archive_pruned=True``
        (those pruned before that are gone). An unknown session has none ([]).

        Raises:
            ValueError: For an invalid ``session_id``.
            CorruptRowError: A stored row cannot be decoded.

        """
        validate_session_id(session_id)
        with self._transaction() as conn:
            rows = transcript_sources(conn, session_id)
        return decode_transcript(session_id, rows, self._sealer.parser(_parse_message))

    def rotate_keys(self, batch: int = ROTATE_BATCH) -> int:
        """Re-encrypt every row not sealed with the cipher's primary key; return how many.

        Online: each batch (at most ``batch`` rows per table) is one short write
        transaction, and turns keep running between them. Plaintext rows are
        encrypted too. What ``chatflow-sqlalchemy keys rotate`` runs.

        Raises:
            ValueError: The store has no cipher, or ``batch`` is not a positive int.

        """
        cipher = self._sealer.cipher
        if cipher is None:
            raise ValueError("rotate_keys needs a store opened with cipher=")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be a positive int, got {batch!r}")
        cursor: dict[str, str] = {}
        total = 0
        while True:
            with self._transaction(write=True) as conn:
                done, more = rotate_batch(conn, cipher, cursor, batch, self.support.lock_batch)
            total += done
            if not more:
                return total

    def _session_ttl(self) -> timedelta:
        if self.session_ttl_hours is None:
            raise ValueError(
                "this store keeps sessions forever: open it with session_ttl_hours=H to sweep "
                "sessions not updated for H hours"
            )
        return timedelta(hours=self.session_ttl_hours)

    def _sweep_busy(self, session_ids: list[str]) -> set[str]:
        """Of ``session_ids``, those whose turn is running in this store.

        Other processes' turns are found by :meth:`DialectSupport.hold_turns`.
        """
        with self._cache_lock:
            return {
                sid for sid in session_ids
                if (ctx := self._contexts.get(sid)) is not None and ctx._in_turn
            }

    def export_user(self, user_id: str) -> dict[str, Any]:
        """Everything held about ``user_id``: sessions, messages, claims (JSON-serialisable).

        Raises:
            ValueError: For an invalid ``user_id``.
            CorruptRowError: A stored row of the user's cannot be decoded.

        """
        validate_user_id(user_id)
        with self._transaction() as conn:
            sessions = export_sessions(
                conn, user_session_ids(conn, user_id), self._sealer.parser(_parse_message),
                self._sealer.open_metadata,
            )
        return {
            "format": EXPORT_FORMAT,
            "user_id": user_id,
            "exported_at": utcnow().isoformat(),
            "sessions": sessions,
        }

    def clear(self) -> None:
        """Delete every session and message (processed webhook ids are kept)."""
        with self._transaction(write=True) as conn:
            conn.execute(delete(_messages))
            conn.execute(delete(_sessions))
        with self._cache_lock:
            ids = list(self._contexts.keys())
        for session_id in ids:
            self._forget(session_id)

    # ------------------------------------------------------------ dedup

    def is_message_processed(self, message_id: str) -> bool:
        """True if ``message_id`` was claimed within the dedup TTL."""
        validate_message_id(message_id)
        params = {"message_id": message_id, "cutoff": utcnow() - self._dedup_ttl}
        return self._single_row(_IS_PROCESSED, params) is not None

    def mark_message_processed(self, message_id: str) -> None:
        """Record ``message_id`` as processed now (check-then-mark; prefer the atomic claim)."""
        validate_message_id(message_id)
        with self._transaction(write=True) as conn:
            conn.execute(
                self._mark,
                {"message_id": message_id, "processed_at": utcnow()},
            )

    def record_processed_message(self, message_id: str) -> bool:
        """Atomically claim ``message_id``: True only for its first caller within the TTL.

        One ``INSERT ... ON CONFLICT`` statement decides, so concurrent threads
        and processes racing on the same id get exactly one True. An expired
        claim can be taken again. Expired ids are purged in bounded batches
        at most every five minutes.
        """
        validate_message_id(message_id)
        now = utcnow()
        params = {"message_id": message_id, "processed_at": now, "cutoff": now - self._dedup_ttl}
        with self._transaction(single=True) as conn:  # one statement decides, atomically
            claimed = self.support.claimed(conn.execute(self._claim, params))
        if now - self._last_purge >= _PURGE_INTERVAL:
            self._last_purge = now
            self._purge_batch(now - self._dedup_ttl)
        return claimed

    def purge_processed_messages(self) -> int:
        """Delete expired processed ids in batches of 1000; return how many went."""
        cutoff = utcnow() - self._dedup_ttl
        total = 0
        while True:
            removed = self._purge_batch(cutoff)
            total += removed
            if removed < _PURGE_BATCH:
                return total

    def claim(
        self,
        message_id: str,
        *,
        session_id: str | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ) -> WebhookClaim:
        """Claim a webhook delivery for exactly-once, in-order processing.

        Use the result as ``async with`` (or ``with``); see
        :mod:`chatflow_sqlalchemy.claims` for what each status means, the
        lease, fencing of the turn run on ``session_id``, and the order of
        one session's claims.

        Raises:
            ValueError: For an invalid ``message_id``, ``session_id`` or ``lease_seconds``.

        """
        validate_message_id(message_id)
        if session_id is not None:
            validate_session_id(session_id)
        return WebhookClaim(
            self._claims(), message_id, session_id=session_id, lease_seconds=lease_seconds
        )

    def _claims(self) -> SQLClaims:
        """The claim statements of this store (built on first use)."""
        if self._claims_backend is None:
            self._claims_backend = SQLClaims(self)
        return self._claims_backend

    def _purge_batch(self, cutoff: Any) -> int:
        with self._transaction(write=True) as conn:
            return int(conn.execute(self._purge, {"cutoff": cutoff}).rowcount)

    # ------------------------------------------------------------ writes

    def _flush_context(self, ctx: SessionContext, fence: ClaimFence | None = None) -> None:
        """Write what ``ctx`` changed since the database last saw it, in one transaction.

        ``fence``: the webhook claim of the turn being written; it is marked
        done in the same transaction, or nothing is written and
        :class:`ClaimLostError` is raised (the context is reloaded).
        """
        with ctx._mutex:
            ctx._check_alive()
            ctx._ensure_indexed()
            if ctx._durable is None or not _has_changes(ctx):
                return
            ctx._writing += 1
            try:
                with telemetry.operation("turn.commit", self._system):
                    deleted = self._write_context(ctx, fence)
                telemetry.count("chatflow.messages.pruned", deleted, self._system)
                ctx._verified_at = ctx._touched_at = time.monotonic()
            except SessionDeletedError:
                self._forget(ctx.session_id)
                raise
            except ClaimLostError:
                ctx._stale = True  # memory must not keep what the database refused
                with suppress(Exception):
                    self._refresh(ctx)
                raise
            finally:
                ctx._writing -= 1
            if fence is not None:
                fence.committed = True

    def _write_context(self, ctx: SessionContext, fence: ClaimFence | None = None) -> int:
        """Write ``ctx``'s changes; return how many message rows it deleted (pruned or cleared).

        A backend that sends a whole write as one statement gets the first
        try (:meth:`_write_at_once`); otherwise, and whenever that swap
        missed, :meth:`_write_changes` runs in a write transaction.
        """
        if self._writes_at_once and ctx._seqs and not self._archives_now(ctx):
            deleted = self._write_at_once(ctx, fence)
            if deleted is not None:
                return deleted
        with self._transaction(write=True) as conn:
            return self._write_changes(conn, ctx, fence)

    def _write_at_once(self, ctx: SessionContext, fence: ClaimFence | None) -> int | None:
        """:meth:`DialectSupport.write_at_once` in autocommit; None if it changed nothing.

        Nothing is written when the swap missed: the session moved or is
        gone, or the claim was lost, which the step-by-step write then tells
        apart (it raises what applies, or rebases).
        """
        now = utcnow()
        gone, new_rows = self._message_diff(ctx, now)
        if gone.intersection(row["seq"] for row in new_rows):
            return None  # one statement cannot delete a row and insert its seq again
        metadata_json, swap = self._bump_params(ctx, now)
        write = SessionWrite(
            swap=swap,
            gone=sorted(gone),
            rows=new_rows,
            fence=None if fence is None else fence.params(now),
        )
        with self._transaction(single=True) as conn:
            outcome = self.support.write_at_once(conn, write)
        if outcome is None or not outcome[0]:
            return None
        self._mark_written(ctx, gone, new_rows, metadata_json)
        return len(gone)

    def _write_changes(
        self, conn: Connection, ctx: SessionContext, fence: ClaimFence | None = None
    ) -> int:
        """Compare-and-swap the session's version, then write the message diff.

        The store's one write algorithm. The conditional UPDATE both detects
        concurrent writers and takes the row's write lock; only when it misses
        does the store read the row (locked) to tell a deleted session from a
        moved one and rebase.
        """
        session_id = ctx.session_id
        now = utcnow()
        bumped, metadata_json = self._bump_version(conn, ctx, now)
        if not bumped:
            version = conn.execute(self._lock_version, {"session_id": session_id}).scalar()
            if version is None:
                raise SessionDeletedError(session_id)
            self._rebase(conn, ctx)
            bumped, metadata_json = self._bump_version(conn, ctx, now)
            if not bumped:
                raise RuntimeError(f"session {session_id!r} changed while its row was locked")
        gone, new_rows = self._message_diff(ctx, now)
        if gone and self.archive_pruned:
            archive_rows(conn, session_id, pruned_seqs(gone, ctx._seqs, ctx._n_system), now)
        if gone and not ctx._seqs:
            conn.execute(_DELETE_ALL_MESSAGES, {"session_id": session_id})
        elif gone:
            conn.execute(_DELETE_SOME_MESSAGES, {"session_id": session_id, "seqs": sorted(gone)})
        if new_rows:
            conn.execute(_INSERT_MESSAGES, new_rows)
        if fence is not None and conn.execute(FENCE_CLAIM, fence.params(now)).rowcount != 1:
            raise ClaimLostError(fence.message_id)
        self._mark_written(ctx, gone, new_rows, metadata_json)
        return len(gone)

    def _archives_now(self, ctx: SessionContext) -> bool:
        """True if this write prunes rows to archive (it then takes the step-by-step path)."""
        if not self.archive_pruned:
            return False
        durable = ctx._durable
        assert durable is not None
        gone = durable.seqs.difference(ctx._seqs)
        return bool(gone and pruned_seqs(gone, ctx._seqs, ctx._n_system))

    def _message_diff(
        self, ctx: SessionContext, now: datetime
    ) -> tuple[set[int], list[dict[str, Any]]]:
        """The seqs of rows to delete and the rows to insert since ``ctx`` was last written."""
        durable = ctx._durable
        assert durable is not None
        gone = durable.seqs.difference(ctx._seqs)
        pending = ctx._pending_messages()
        if durable.hidden and (pending or ctx._cleared):
            gone.update(durable.hidden)  # a call no result can follow any more
        new_rows = [
            {
                "session_id": ctx.session_id,
                "seq": seq,
                "role": message.role.value,
                "content": None if self._sealer.active else _content_column(message.content),
                "message_json": self._sealer.seal_text(
                    ctx.session_id, _dump_message(ctx.session_id, message)
                ),
                "created_at": now,
            }
            for seq, message in pending
        ]
        return gone, new_rows

    @staticmethod
    def _mark_written(
        ctx: SessionContext,
        gone: set[int],
        new_rows: list[dict[str, Any]],
        metadata_json: str | None,
    ) -> None:
        """Record what the database now holds: ``ctx`` as it is, one version up.

        ``metadata_json`` is the metadata just written, None if it was unchanged.
        """
        durable = ctx._durable
        assert durable is not None
        seqs = durable.seqs - gone
        seqs.update(row["seq"] for row in new_rows)
        ctx._durable = DurableState(
            version=durable.version + 1,
            seqs=seqs,
            agent_name=ctx.active_agent.name,
            metadata_json=durable.metadata_json if metadata_json is None else metadata_json,
            incarnation=durable.incarnation,
            hidden=durable.hidden.difference(gone),
        )
        ctx._cleared = False

    def _bump_version(
        self, conn: Connection, ctx: SessionContext, now: datetime
    ) -> tuple[bool, str | None]:
        """UPDATE the session row if its version is still the one ``ctx`` knows.

        Returns whether it did, and the metadata JSON it wrote (None: unchanged).
        """
        metadata_json, params = self._bump_params(ctx, now)
        statement = _BUMP_SESSION if metadata_json is None else _BUMP_SESSION_AND_METADATA
        return conn.execute(statement, params).rowcount == 1, metadata_json

    def _bump_params(
        self, ctx: SessionContext, now: datetime
    ) -> tuple[str | None, dict[str, Any]]:
        """Parameters of the compare-and-swap UPDATE, after the metadata's JSON if it changed."""
        durable = ctx._durable
        assert durable is not None
        params: dict[str, Any] = {
            "sid": ctx.session_id,
            "expected": durable.version,
            "new_version": durable.version + 1,
            "agent_name": ctx.active_agent.name,
            "now": now,
        }
        metadata_json = dump_metadata(ctx._metadata)
        if metadata_json == durable.metadata_json:
            return None, params
        params["metadata"] = self._sealer.seal_metadata(ctx.session_id, dict(ctx._metadata))
        return metadata_json, params

    def _rebase(self, conn: Connection, ctx: SessionContext) -> None:
        """Another writer moved the session: replay our unsaved changes on its rows.

        A session deleted meanwhile, or deleted and created anew under the same
        id, raises :class:`SessionDeletedError`: nothing of ``ctx`` is written
        into another conversation. An unsaved clear (or a replaced history)
        also drops what the other writer added before it.
        """
        durable = ctx._durable
        assert durable is not None
        pending = [message for _, message in ctx._pending_messages()]
        cleared = ctx._cleared
        our_agent = ctx.active_agent if ctx.active_agent.name != durable.agent_name else None
        our_metadata = dict(ctx._metadata)
        metadata_changed = dump_metadata(our_metadata) != durable.metadata_json
        stored = self._read_session(conn, ctx.session_id)
        if stored is None or _other_incarnation(ctx, stored):
            raise SessionDeletedError(ctx.session_id)
        telemetry.count("chatflow.version_conflicts", 1, self._system)
        carried = None if cleared else _orphaned_tool_call(ctx, stored)
        agent = our_agent or self._resolve_agent(stored.agent_name, ctx.active_agent)
        self._install(ctx, stored, agent, set(ctx._seqs))
        if metadata_changed:
            ctx._replace_metadata(our_metadata)
        if cleared:
            ctx._history, ctx._seqs, ctx._cleared = [], [], True
            ctx._reindex()
        for message in pending if carried is None else [carried, *pending]:
            ctx._append(message)
        logger.info(
            "session %r changed in another process; %d new message(s) appended after its rows",
            ctx.session_id,
            len(pending),
        )

    async def _abegin_turn(self, ctx: SessionContext) -> None:
        """Before a turn: take the cross-process turn lock, then catch up with the database.

        The lock is polled with a short backoff rather than waited for, so a
        contended session never pins one of the I/O threads.
        """
        locks = self._turn_locks
        if locks is None:
            await self._touch_if_idle(ctx)
        recent = time.monotonic() - ctx._verified_at < _RECENTLY_VERIFIED
        if locks is None and recent and not ctx._stale:
            return  # the Runner's get_or_create checked the version a moment ago
        known, version = False, None
        if locks is not None:
            known, version = await self._await_turn_lock(locks, ctx.session_id)
        try:
            if locks is not None and self._locked_version_matches(ctx, known, version):
                return
            if not await self._run_blocking(self._refresh, ctx):
                raise SessionDeletedError(ctx.session_id)
        except BaseException:
            if locks is not None:
                await locks.release(ctx.session_id)
            raise

    async def _await_turn_lock(
        self, locks: TurnLocks, session_id: str
    ) -> tuple[bool, int | None]:
        """Poll the turn lock until taken; return (version known, version) read with it."""
        delay = 0.002
        with telemetry.operation("turn.lock", self._system) as op:
            attempts = 0
            while True:
                attempts += 1
                with self._guard():
                    acquired, known, version = await locks.try_acquire(session_id)
                if acquired:
                    op.set("chatflow.lock.attempts", attempts)
                    return known, version
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.005)  # a freed lock is noticed within 5 ms

    async def _touch_if_idle(self, ctx: SessionContext) -> None:
        """Without turn locks: mark the session as in use, so no sweep takes it mid-turn.

        Another process's sweep cannot see this turn; it keeps sessions
        updated within its TTL, so a turn on a session idle for a while
        moves ``updated_at`` first (one statement; see ``touch_interval``).
        """
        interval = touch_interval(self.session_ttl_hours)
        if time.monotonic() - ctx._touched_at < interval:
            return
        if not await self._run_blocking(self._touch, ctx.session_id, interval):
            # Gone (swept or deleted elsewhere since it was last checked), or touched
            # elsewhere: check the version instead of trusting a recent check.
            ctx._verified_at = float("-inf")
        ctx._touched_at = time.monotonic()

    def _touch(self, session_id: str, interval: float) -> bool:
        with self._transaction(single=True) as conn:
            return touch_session(conn, session_id, utcnow(), interval)

    def _locked_version_matches(
        self, ctx: SessionContext, known: bool, version: int | None
    ) -> bool:
        """True if the version read with the turn lock held equals the one ``ctx`` knows."""
        if not known:
            return False
        if version is None:
            self._forget(ctx.session_id)
            raise SessionDeletedError(ctx.session_id)
        durable = ctx._durable
        if durable is None or durable.version != version or ctx._stale:
            return False
        ctx._verified_at = time.monotonic()
        return True

    async def _aend_turn(self, ctx: SessionContext) -> None:
        """After a turn: write it in one transaction, then let other processes in.

        A turn inside a webhook claim block for this session commits the claim
        with it (the claim is found here, in the caller's context).
        """
        fence = active_fence(ctx.session_id)
        try:
            await self._run_blocking(self._flush_context, ctx, fence)
        finally:
            if self._turn_locks is not None:
                await self._turn_locks.release(ctx.session_id)

    async def _adiscard_turn(self, ctx: SessionContext) -> None:
        """After a turn ended by an exception: write nothing, let other processes in."""
        if self._turn_locks is not None:
            await self._turn_locks.release(ctx.session_id)

    @property
    def turn_locks(self) -> TurnLocks | None:
        """The cross-process turn locks of this store (from its dialect support), or None."""
        return self._turn_locks

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Release the thread pool and (if the store created it) the engine."""
        if self._closed:
            return
        self._closed = True
        if self._turn_locks is not None:
            self._turn_locks.close()
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if self._aengine is not None:
            _dispose_from_sync_code(self._aengine)
        if self._owns_engine:
            self.engine.dispose()

    def __enter__(self) -> SQLAlchemySessionStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> SQLAlchemySessionStore:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # ------------------------------------------------------------ async twins

    async def aclose(self) -> None:
        """Async :meth:`close` (waits for in-flight work off the loop)."""
        if self._turn_locks is not None and not self._closed:
            await self._turn_locks.aclose()
        if self._aengine is not None and self._aloop is asyncio.get_running_loop():
            await self._aengine.dispose()
        if self._ephemeral:
            self.close()
        else:
            await asyncio.get_running_loop().run_in_executor(None, self.close)


    def __repr__(self) -> str:
        return f"<{type(self).__name__} {_describe(self.url)}>"


_BACKGROUND: set[asyncio.Task[None]] = set()


def _dispose_from_sync_code(engine: AsyncEngine) -> None:
    """Close an AsyncEngine's pool from sync code (``aclose`` is the clean way)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(engine.dispose())
    else:
        task = loop.create_task(engine.dispose())
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)


def _merged(defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``given`` engine options over the dialect's ``defaults``, ``connect_args`` key by key."""
    options = {**defaults, **given}
    if "connect_args" in defaults and "connect_args" in given:
        options["connect_args"] = {**defaults["connect_args"], **given["connect_args"]}
    return options


def _create_engine(url: URL, options: dict[str, Any], install_hint: str) -> Engine:
    """``create_engine``; a missing driver names what to install, if there is a hint."""
    try:
        return create_engine(url, **options)
    except ImportError as exc:
        if not install_hint:
            raise
        raise BackendImportError(f"{install_hint} ({exc})") from exc


def _greenlet_available() -> bool:
    """SQLAlchemy's asyncio layer needs greenlet (shipped with the postgres extra)."""
    return importlib.util.find_spec("greenlet") is not None


def _on_async_facade(fn: Callable[..., _T], *args: Any) -> _T:
    """Run ``fn`` marked as running on the AsyncEngine's sync facade (in a greenlet)."""
    token = _IN_ASYNC_FACADE.set(True)
    try:
        return fn(*args)
    finally:
        _IN_ASYNC_FACADE.reset(token)


@functools.cache
def _greenlet_spawn() -> Callable[..., Any]:
    """SQLAlchemy's ``greenlet_spawn``, imported on first native-async use.

    It is the one name used from outside SQLAlchemy's documented API: the
    documented ``AsyncConnection.run_sync`` is built on it but holds a pooled
    connection for the whole call, while the store checks out its own
    connections inside. ``sqlalchemy.util.greenlet_spawn`` has kept its name
    and signature from 1.4 to 2.1.
    """
    from sqlalchemy.util import greenlet_spawn

    return cast(Callable[..., Any], greenlet_spawn)


def _parse_message(session_id: str, row_id: object, text: str) -> Message:
    try:
        return Message.model_validate_json(text)
    except ValidationError as exc:
        if _too_deep_for_pydantic_json(exc):
            return _parse_deep_message(session_id, row_id, text)
        raise CorruptRowError(session_id, row_id, str(exc).splitlines()[0]) from exc
    except (ValueError, TypeError) as exc:
        raise CorruptRowError(session_id, row_id, str(exc).splitlines()[0]) from exc


def _too_deep_for_pydantic_json(exc: ValidationError) -> bool:
    """True if pydantic's JSON parser gave up on nesting depth, not on the content.

    pydantic writes JSON nested deeper than its own parser reads back (a tool
    result ~200 levels deep); such a row is valid and is parsed another way.
    """
    errors = exc.errors()
    return (
        len(errors) == 1
        and errors[0]["type"] == "json_invalid"
        and "recursion limit" in str(errors[0].get("ctx", {}).get("error", ""))
    )


def _parse_deep_message(session_id: str, row_id: object, text: str) -> Message:
    """Parse a deeply nested row with the stdlib's JSON parser, then validate it."""
    try:
        return Message.model_validate(json.loads(text))
    except (ValidationError, ValueError, TypeError, RecursionError) as exc:
        raise CorruptRowError(session_id, row_id, str(exc).splitlines()[0]) from exc


def _dump_message(session_id: str, message: Message) -> str:
    """A message's JSON for its row, or ``ValueError`` saying why it cannot be stored."""
    try:
        return dump_message(message)
    except PydanticSerializationError as exc:
        raise ValueError(
            f"a {message.role.value} message of session {session_id!r} cannot be stored: "
            f"{exc}. Tool results and arguments must be JSON-serialisable and nested at "
            "most 250 levels deep; flatten or stringify the value (the turn was not stored)"
        ) from None


def _other_incarnation(ctx: SessionContext, stored: _StoredSession) -> bool:
    """True if ``stored`` is a later session under ``ctx``'s id (deleted and created anew).

    Versions cannot tell: a new session starts at a random version. The row's
    ``created_at`` can, and is read only when the version has moved.
    """
    durable = ctx._durable
    known = None if durable is None else durable.incarnation
    return known is not None and stored.created_at is not None and stored.created_at != known


def _unsaved_tail_call(ctx: SessionContext) -> Message | None:
    """``ctx``'s last message if it is a tool call not written yet (carried, see below)."""
    durable = ctx._durable
    if durable is None or not ctx._seqs or ctx._seqs[-1] in durable.seqs:
        return None
    message = ctx._history[-1]
    return message if message.role == Role.MODEL and message.tool_calls else None


def _orphaned_tool_call(ctx: SessionContext, stored: _StoredSession) -> Message | None:
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


def _content_column(content: str | None) -> str | None:
    """The text for the ``content`` column: a readable copy of ``message_json``'s content.

    PostgreSQL text cannot hold NUL, so NUL becomes U+FFFD in this copy (on
    every backend, alike); the message itself is read back from
    ``message_json``, where JSON escapes it, so it round-trips exactly.
    """
    if content is not None and "\x00" in content:
        return content.replace("\x00", "\ufffd")
    return content


def _fetch_session_row(conn: Connection, session_id: str) -> Any:
    """The session's row; metadata that is not valid JSON is a :class:`CorruptRowError`.

    Databases with a JSON type validate on write; SQLite stores text, which
    a hand edit or a damaged file can leave undecodable.
    """
    try:
        return conn.execute(_SELECT_SESSION, {"session_id": session_id}).first()
    except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
        reason = f"metadata_json is not valid JSON ({str(exc).splitlines()[0]})"
        raise CorruptRowError(session_id, None, reason, table="chatflow_sessions") from exc


def _require_transactions(engine: Engine) -> None:
    """Refuse an engine whose connections run in autocommit mode.

    A turn is written in one transaction, so that a crash or a lost race
    never leaves half a turn; in autocommit every statement would commit on
    its own. (Single self-contained statements already run in autocommit.)
    """
    autocommit = engine.get_execution_options().get("isolation_level") == "AUTOCOMMIT"
    if not autocommit:
        with engine.connect() as conn:
            autocommit = getattr(conn.connection.dbapi_connection, "autocommit", None) is True
    if autocommit:
        raise ValueError(
            "the engine's connections run in autocommit mode (isolation_level='AUTOCOMMIT'), "
            "so a turn could not be written atomically: open the store without it (the store "
            "runs single statements in autocommit by itself)"
        )


def _first_version() -> int:
    """A random starting version for a new session row.

    Contexts trust a session whose version equals the one they know. Were
    every session to start at 0, one deleted and re-created elsewhere would,
    after as many writes, show a cached context the version it expects
    (ABA) and be taken for the old one.
    """
    return secrets.randbits(_FIRST_VERSION_BITS)


def _holds_newer_than(ctx: SessionContext, stored: _StoredSession) -> bool:
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


def _has_changes(ctx: SessionContext) -> bool:
    durable = ctx._durable
    assert durable is not None
    if ctx.active_agent.name != durable.agent_name or len(ctx._seqs) != len(durable.seqs):
        return True
    if ctx._cleared:
        return True  # also what another writer added before the clear must go
    if any(seq not in durable.seqs for seq in reversed(ctx._seqs)):  # new ones are last
        return True
    return dump_metadata(ctx._metadata) != durable.metadata_json


def _repair_window(
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


def _is_connect_error(exc: sa_exc.DBAPIError) -> bool:
    text = str(exc.orig or exc).lower()
    markers = (
        "connection refused", "could not connect", "connection failed", "password authentication",
        "unable to open database", "could not translate host name", "timeout expired",
        "server closed the connection", "no such host", "does not exist", "terminating connection",
        "connection is closed", "the connection is lost", "consuming input failed",
    )
    return any(marker in text for marker in markers)
