"""The generic SQLAlchemy session store: the public façade over its parts.

Every query is written once against SQLAlchemy Core; backends only contribute
a :class:`~chatflow_sqlalchemy.dialect.DialectSupport`. One transaction per
logical operation: a context change outside ``session.lock`` at once, a whole
Runner turn when the lock is released.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping
from contextlib import suppress
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from chatflow_agent import Agent, Message
from sqlalchemy import URL, Connection, Engine, delete, select, update
from sqlalchemy import exc as sa_exc

from chatflow_sqlalchemy import telemetry
from chatflow_sqlalchemy.aio import AsyncStoreAPI
from chatflow_sqlalchemy.claims import (
    DEFAULT_DEDUP_TTL_HOURS,
    DEFAULT_LEASE_SECONDS,
    MAX_DEDUP_TTL_HOURS,
    ClaimFence,
    WebhookClaim,
    claimed_session_version,
    validate_message_id,
)
from chatflow_sqlalchemy.context import (
    ContextOwner,
    SessionContext,
    check_metadata,
    validate_agent,
    validate_session_id,
)
from chatflow_sqlalchemy.contexts import AgentResolver, ContextCache
from chatflow_sqlalchemy.dialect import DialectSupport
from chatflow_sqlalchemy.exceptions import (
    ChatflowStoreError,
    LeaseLostError,
    SessionDeletedError,
)
from chatflow_sqlalchemy.forks import session_exists, validate_fork
from chatflow_sqlalchemy.inbox import BatchFence, Inbox, active_batch
from chatflow_sqlalchemy.lease import SessionLeases
from chatflow_sqlalchemy.lifecycle import (
    SWEEP_BATCH,
    ListFilters,
    validate_sweep_limit,
    validate_user_id,
)
from chatflow_sqlalchemy.migrate import (
    auto_migrate_enabled,
    ensure_schema,
    require_existing_database,
)
from chatflow_sqlalchemy.options import OptionsOwner, SQLStoreKeywords, StoreOptions
from chatflow_sqlalchemy.registry import support_for
from chatflow_sqlalchemy.rows import (
    IS_PROCESSED,
    SELECT_VERSION,
    StoredSession,
    first_version,
    parse_message,
    read_session,
)
from chatflow_sqlalchemy.rows import messages as _messages
from chatflow_sqlalchemy.rows import processed as _processed
from chatflow_sqlalchemy.rows import sessions as _sessions
from chatflow_sqlalchemy.runtime import (
    StoreRuntime,
    create_store_engine,
    describe,
    merged,
    require_transactions,
    retrying_deadlocks,
)
from chatflow_sqlalchemy.sealing import ROTATE_BATCH, Sealer, rotate_batch
from chatflow_sqlalchemy.sql_claims import SQLClaims
from chatflow_sqlalchemy.sql_forks import copy_session
from chatflow_sqlalchemy.sql_inbox import SQLInbox
from chatflow_sqlalchemy.sql_lifecycle import (
    SweepCursor,
    decode_transcript,
    delete_session,
    erase_sessions,
    export_user_document,
    session_page,
    sweep_candidates,
    transcript_sources,
    user_session_ids,
)
from chatflow_sqlalchemy.sql_summaries import SQLSummaries
from chatflow_sqlalchemy.summaries import Summaries
from chatflow_sqlalchemy.turns import Turns
from chatflow_sqlalchemy.urls import parse_database_url, require_backend
from chatflow_sqlalchemy.values import UNBORN_AGENT, Lease, utcnow
from chatflow_sqlalchemy.writer import SessionWriter

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "DEFAULT_DEDUP_TTL_HOURS",
    "MAX_DEDUP_TTL_HOURS",
    "SQLAlchemySessionStore",
]

_T = TypeVar("_T")

logger = logging.getLogger(__name__)

_PURGE_BATCH = 1000
_PURGE_INTERVAL = timedelta(minutes=5)


class SQLAlchemySessionStore(OptionsOwner, AsyncStoreAPI):
    """Session store on any database with a chatflow-sqlalchemy backend.

    Args:
        url: SQLAlchemy URL; defaults to ``$CHATFLOW_DATABASE_URL`` or
            ``sqlite:///chatflow.db``. Ignored when ``engine`` is given.
        engine: An existing engine to use (the store does not dispose it).
        default_max_turns: History window of new contexts, in complete turns.
        dedup_ttl_hours: How long a processed webhook id stays claimed.
        engine_options: Keyword arguments for ``create_engine`` over the
            dialect's defaults (pool sizes, ``pool_recycle``, ``echo``...;
            ``connect_args`` key by key) when the store creates its engine from
            ``url``, for its AsyncEngine too on a native-async URL; an
            ``engine`` you pass is used as it is (a ``ValueError`` with both).
        **options: The other store options, by keyword: ``session_ttl_hours``,
            ``archive_pruned``, ``turn_lease_seconds``, ``summarizer``,
            ``auto_migrate``, ``cipher``, ``require_encryption`` (see
            :class:`~chatflow_sqlalchemy.options.StoreOptions`); any other
            keyword is a ``TypeError``.

    The schema is created or upgraded on open (under a cross-process lock,
    logged at INFO); a database migrated by a newer version raises
    :class:`~chatflow_sqlalchemy.exceptions.SchemaAheadError`.

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
        engine_options: Mapping[str, Any] | None = None,
        **options: Unpack[SQLStoreKeywords],
    ) -> None:
        given = {"default_max_turns": default_max_turns, "dedup_ttl_hours": dedup_ttl_hours}
        chosen = StoreOptions.of(
            type(self).__name__, {**given, **options}, fix="engine options go in engine_options="
        )
        self._start(chosen, url, engine, engine_options)

    def _start(
        self,
        options: StoreOptions,
        url: str | URL | None,
        engine: Engine | None = None,
        engine_options: Mapping[str, Any] | None = None,
    ) -> None:
        """Open the store with ``options`` on ``engine``, or on one made from ``url``.

        Every constructor ends with it (a backend's class calls it instead of ``__init__``).
        """
        self.options = options
        self.auto_migrate = auto_migrate_enabled(options.auto_migrate)
        self._dedup_ttl = options.dedup_ttl
        self._sealer = Sealer(options.cipher, options.require_encryption)
        self._agents = AgentResolver()
        self._contexts = ContextCache(self._context_cache_size)
        self._last_purge = utcnow()
        self._claims_backend: SQLClaims | None = None

        extra_options = dict(engine_options or {})
        if engine is None:
            engine = self._create_engine(url, extra_options)
            owns_engine = True
        else:
            if engine_options:
                raise ValueError(
                    "engine_options apply to an engine the store creates from url; "
                    "configure the engine you pass as engine= yourself"
                )
            self.url = engine.url
            self.support = self._support_for(engine.dialect.name)
            owns_engine = False
        try:
            self._open_on(engine, owns_engine, extra_options)
        except BaseException:
            if owns_engine:
                engine.dispose()
            raise

    def _create_engine(self, url: str | URL | None, engine_options: Mapping[str, Any]) -> Engine:
        """The store's own engine for ``url``: the dialect's options under the caller's."""
        self.url = parse_database_url(url)
        self.support = self._support_for(self.url.get_backend_name())
        if type(self).dialect_support is not None:
            require_backend(self.url, self.support.name, type(self).__name__)
        sync_url = self.support.sync_url(self.url)
        options = merged(self.support.engine_options(sync_url), engine_options)
        # A backend's own class picked the driver; the generic one takes the URL's.
        hint = self.support.install_hint if type(self).dialect_support is not None else ""
        return create_store_engine(sync_url, options, hint)

    def _open_on(self, engine: Engine, owns_engine: bool, options: dict[str, Any]) -> None:
        """Assemble the store on ``engine`` (its own or the caller's) and open the schema."""
        self.support.prepare_engine(engine)
        self.engine = engine
        self.runtime = StoreRuntime(
            engine, self.support, self.url, owns_engine=owns_engine, engine_options=options,
            io_workers=self._blocking_io_workers,
        )
        leases = SessionLeases(self.runtime, self.turn_lease_seconds)
        self.turns = Turns(
            self.runtime, leases, self._run_blocking, self._refresh, self._flush_context
        )
        self._context_owner = ContextOwner(  # flush and run_blocking: looked up at each call,
            lambda ctx: self._flush_context(ctx),  # as a test or benchmark may wrap them
            self.turns.begin, self.turns.end, self._discard_turn,
            lambda fn, *args: self._run_blocking(fn, *args),
        )
        self._summaries = None if self.summarizer is None else Summaries(
            self.summarizer, SQLSummaries(self.runtime, self._sealer), self.get,
            self.runtime.system, on_loop=self.runtime.keep_on_threads,
        )
        self._writer = SessionWriter(
            self.runtime, self._sealer, self._agents, archive_pruned=self.archive_pruned,
            leases=leases, summaries=self._summaries,
        )
        self.inbox = Inbox(
            SQLInbox(
                self.runtime, self._run_blocking, leases, self.turns, self._sealer,
                create_empty=self._create_empty_session, warm=self._warm,
            ),
            lease_seconds=self.turn_lease_seconds,
            dedup_seconds=self._dedup_ttl.total_seconds(),
            system=self.runtime.system,
        )
        """The durable inbox (:mod:`chatflow_sqlalchemy.inbox`)."""
        # Dialect statements are built once: building an upsert costs more than running it.
        self._insert_session = self.support.insert_ignore(_sessions)
        self._claim = self.support.claim_processed(_processed)
        self._mark = self.support.upsert_processed(_processed)
        self._purge = self.support.purge_processed(_processed, _PURGE_BATCH)
        self._open_schema()

    @classmethod
    def _support_for(cls, dialect_name: str) -> DialectSupport:
        """The class's own dialect hooks, else those the registry has for ``dialect_name``."""
        return cls.dialect_support if cls.dialect_support is not None else support_for(dialect_name)

    @classmethod
    def from_url(cls, url: str | URL, **kwargs: Any) -> SQLAlchemySessionStore:
        """Open a store of this class for ``url`` (what ``open_store`` calls)."""
        return cls(url, **kwargs)

    def _open_schema(self) -> None:
        with self.runtime.guard:
            if not self.auto_migrate:  # connecting would create a missing SQLite file
                require_existing_database(self.engine)
        require_transactions(self.runtime)
        with self.runtime.guard:
            ensure_schema(self.engine, self.support, auto_migrate=self.auto_migrate)

    @property
    def engines(self) -> tuple[Engine, ...]:
        """Every engine this store runs statements on, for engine events and instrumentation.

        ``store.engine``, plus on a native-async store the sync facade of its
        ``AsyncEngine``. Listening on each (``event.listen`` or
        ``SQLAlchemyInstrumentor().instrument(engines=store.engines)``) sees every statement.
        """
        return self.runtime.engines

    async def _run_blocking(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run blocking database work off the event loop (see :class:`StoreRuntime`)."""
        return await self.runtime.run_blocking(fn, *args)

    # ------------------------------------------------------------ contexts

    def set_agent_resolver(self, resolver: Callable[[str], Agent | None]) -> None:
        """Register how stored agent names map back to Agent objects (the Runner does)."""
        self._agents.resolver = resolver

    def _forget(self, session_id: str, ctx: SessionContext | None = None) -> None:
        """Drop the session's context (only ``ctx``, if given: a newer one stays)."""
        self._contexts.forget(session_id, ctx)

    def _build_context(
        self, stored: StoredSession, session_id: str, default_agent: Agent | None
    ) -> SessionContext:
        agent = self._agents(stored.agent_name, default_agent)
        ctx = self._new_context(session_id, agent)
        ctx.load(stored, agent)
        return ctx

    def _new_context(self, session_id: str, agent: Agent) -> SessionContext:
        """An empty context of this store's (``load`` fills it)."""
        ctx = SessionContext(session_id, agent, max_turns=self.default_max_turns)
        ctx.attach(self._context_owner)
        return ctx

    def _refresh(
        self, ctx: SessionContext, claimed: tuple[bool, int | None] = (False, None)
    ) -> bool:
        """Catch ``ctx`` up with the database; False if its session is gone.

        ``claimed``: the version a claim already read (:meth:`_claimed_version`).
        """
        read, version = claimed
        if not read:
            version = self._read_version(ctx.session_id)
        if version is not None and ctx.is_current(version):
            return True
        if version is None or not ctx.catch_up(self._load(ctx.session_id), self._agents):
            self._forget(ctx.session_id, ctx)
            return False
        return True

    def _read_version(self, session_id: str) -> int | None:
        """The session's committed version (one autocommit statement), None if it is gone."""
        with self.runtime.transaction(single=True) as conn:
            row = conn.execute(SELECT_VERSION, {"session_id": session_id}).first()
        return None if row is None else int(row[0])

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

        Called on a thread whose event loop is running (``Runner.run_async``),
        it does not wait on the database: the context is read (and the owner
        checked) on first use, off the loop by the turn's start, and that
        read raises its errors (``DatabaseUnavailableError``, another owner).
        Only a ``user_id`` for a live context still reads on the loop.
        ``aget_or_create`` reads before it returns, off the loop.

        Raises:
            ValueError: For an invalid ``session_id``, ``user_id``, agent name or
                ``metadata``, or a ``user_id`` other than the session's own.
            TypeError: For ``metadata`` with a key that is not a str.

        """
        validate_session_id(session_id)
        validate_agent(default_agent)
        if user_id is not None:
            validate_user_id(user_id)
        metadata = dict(metadata or {})
        if metadata:
            check_metadata(metadata)  # bad metadata fails now, whether or not it gets stored
        if self._on_a_running_loop():
            ctx = self._get_or_create_later(session_id, default_agent, metadata, user_id)
            if ctx is not None:
                return ctx
        ctx, stored = self._lookup(session_id, self._claimed_version(session_id))
        if ctx is not None:
            self._adopt_unborn(ctx, default_agent, metadata, user_id)
        else:
            stored = self._stored_or_created(session_id, default_agent, metadata, user_id, stored)
            ctx = self._contexts.publish(self._build_context(stored, session_id, default_agent))
        if user_id is not None:
            self._record_owner(session_id, user_id)
        return ctx

    def _on_a_running_loop(self) -> bool:
        """Called on an event loop's own thread (not in-memory SQLite: it waits on no I/O)."""
        if self.runtime.ephemeral or self.runtime.in_async_facade():
            return False
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    def _get_or_create_later(
        self,
        session_id: str,
        default_agent: Agent,
        metadata: dict[str, Any],
        user_id: str | None,
    ) -> SessionContext | None:
        """:meth:`get_or_create` without I/O: the context reads on first use.

        A live context catches up (or is made anew) on first use; a new one is
        published at once and loads on first use. None for a live context and a
        ``user_id``: a shared context's owner is checked at the call, so a failed
        check does not fail the others' next use.
        """
        ctx = self._contexts.get(session_id)
        if ctx is None:
            ctx = self._new_context(session_id, default_agent)
            ctx.defer_load(
                functools.partial(self._load_into, ctx, default_agent, metadata, user_id)
            )
            return self._contexts.publish(ctx)
        if user_id is not None:
            return None
        # The version a claim or inbox batch read: a catch-up at it reads nothing more.
        claimed = self._claimed_version(session_id)
        catch_up = functools.partial(self._catch_up, ctx, claimed, default_agent, metadata)
        recreate = functools.partial(self._load_into, ctx, default_agent, metadata, None)
        ctx.defer_catch_up(catch_up, recreate)
        return ctx

    def _load_into(
        self,
        ctx: SessionContext,
        default_agent: Agent,
        metadata: dict[str, Any],
        user_id: str | None,
    ) -> None:
        """The deferred first load of a context :meth:`_get_or_create_later` made."""
        stored = self._stored_or_created(
            ctx.session_id, default_agent, metadata, user_id, self._load(ctx.session_id)
        )
        ctx.load(stored, self._agents(stored.agent_name, default_agent))
        if user_id is None:
            return
        try:
            self._record_owner(ctx.session_id, user_id)
        except ValueError:  # a context of another user's session is not kept
            self._forget(ctx.session_id, ctx)
            raise

    def _catch_up(
        self,
        ctx: SessionContext,
        claimed: tuple[bool, int | None],
        default_agent: Agent,
        metadata: dict[str, Any],
    ) -> None:
        """The deferred catch-up of a live context; a session deleted meanwhile is made anew."""
        read, version = claimed
        if not read:
            version = self._read_version(ctx.session_id)
        if version is None:
            self._load_into(ctx, default_agent, metadata, None)
        elif self._refresh(ctx, (True, version)):
            self._adopt_unborn(ctx, default_agent, metadata)

    def _adopt_unborn(
        self,
        ctx: SessionContext,
        default_agent: Agent,
        metadata: dict[str, Any],
        user_id: str | None = None,
    ) -> None:
        """:meth:`get_or_create` of a live context whose session has no agent yet: adopt it.

        Its first turn failed unwritten (:meth:`_discard_turn`); a turn in
        progress keeps its own view, and its write gives the session its agent.
        """
        if not ctx.unborn or ctx.in_turn:
            return
        stored = self._adopt(ctx.session_id, default_agent, metadata, user_id)
        if not ctx.catch_up(stored, lambda name, _: self._agents(name, default_agent)):
            self._forget(ctx.session_id, ctx)  # another session under the id meanwhile
            raise SessionDeletedError(ctx.session_id)

    def _record_owner(self, session_id: str, user_id: str) -> None:
        """Make ``user_id`` the session's owner, unless it already has another one."""
        owner_of = select(_sessions.c.user_id).where(_sessions.c.session_id == session_id)
        with self.runtime.transaction() as conn:
            owner = conn.execute(owner_of).scalar()
        if owner is None:
            with self.runtime.transaction(write=True) as conn:
                conn.execute(
                    update(_sessions)
                    .where(_sessions.c.session_id == session_id, _sessions.c.user_id.is_(None))
                    .values(user_id=user_id)
                )
                owner = conn.execute(owner_of).scalar()
        if owner is not None and owner != user_id:
            raise ValueError(
                f"session {session_id!r} belongs to another user_id; a session has one owner "
                "(use a session id of this user's, or erase_user the other one first)"
            )

    def _stored_or_created(
        self,
        session_id: str,
        default_agent: Agent,
        metadata: dict[str, Any],
        user_id: str | None,
        stored: StoredSession | None,
    ) -> StoredSession:
        """The session as stored (``stored``, just read), created if it does not exist.

        A session with no agent yet is adopted as if created here. ``made``
        says this store (not another writer) made it: a failed turn may unmake it.
        """
        if stored is None:
            stored = self._inserted(session_id, default_agent, metadata, user_id)
        elif stored.agent_name == UNBORN_AGENT:
            stored = self._adopt(session_id, default_agent, metadata, user_id)
        return stored

    def _inserted(
        self, session_id: str, default_agent: Agent, metadata: dict[str, Any], user_id: str | None
    ) -> StoredSession:
        """The session's row, inserted unless it exists, as read in the same transaction.

        Inserted again if none is read: the row the insert found (another
        writer's) was deleted before the read, which PostgreSQL's insert does
        not prevent (it locks no row it finds).
        """
        while True:
            with self.runtime.transaction(write=True) as conn:
                version = self._insert(conn, session_id, default_agent.name, metadata, user_id)
                stored = read_session(conn, self._sealer, session_id)
            if stored is not None:
                # Ours, unless another writer's insert won (an INSERT's rowcount is not portable).
                stored.made = stored.version == version
                return stored

    def _create_empty_session(self, session_id: str) -> None:
        """A session for the inbox to lease before its first turn; ``get_or_create`` adopts it."""
        with self.runtime.transaction(write=True) as conn:
            self._insert(conn, session_id, UNBORN_AGENT, {}, None)

    def _insert(
        self,
        conn: Connection,
        session_id: str,
        agent_name: str,
        metadata: dict[str, Any],
        user_id: str | None,
    ) -> int:
        """Insert the session's row unless it exists; return the version it was given."""
        now, version = utcnow(), first_version()
        conn.execute(self._insert_session, {
            "session_id": session_id,
            "active_agent_name": agent_name,
            "metadata_json": self._sealer.seal_metadata(session_id, metadata),
            "version": version,
            "created_at": now,
            "updated_at": now,
            "user_id": user_id,
        })
        return version

    def _adopt(
        self, session_id: str, agent: Agent, metadata: dict[str, Any], user_id: str | None
    ) -> StoredSession:
        """Give a session with no agent yet its agent, metadata and owner, as if new."""
        sealed = self._sealer.seal_metadata(session_id, metadata)
        with self.runtime.transaction(write=True) as conn:
            adopted = conn.execute(
                update(_sessions)
                .where(_sessions.c.session_id == session_id,
                       _sessions.c.active_agent_name == UNBORN_AGENT)
                .values(active_agent_name=agent.name, metadata_json=sealed, user_id=user_id,
                        version=_sessions.c.version + 1, updated_at=utcnow())
            ).rowcount == 1
            stored = read_session(conn, self._sealer, session_id)
        if stored is None:
            raise SessionDeletedError(session_id)
        stored.made = adopted
        return stored

    def get(self, session_id: str) -> SessionContext | None:
        """Return the session's context, or None if the session does not exist."""
        validate_session_id(session_id)
        return self._get(session_id, (False, None))

    def _warm(self, session_id: str, version: int) -> None:
        """Cache, off the loop, the context of a session an inbox batch holds at ``version``."""
        self._get(session_id, (True, version))

    def _get(self, session_id: str, claimed: tuple[bool, int | None]) -> SessionContext | None:
        ctx, stored = self._lookup(session_id, claimed)
        if ctx is not None:
            return None if ctx.unborn else ctx
        if stored is None or stored.agent_name == UNBORN_AGENT:
            return None
        return self._contexts.publish(self._build_context(stored, session_id, None))

    def _lookup(
        self, session_id: str, claimed: tuple[bool, int | None] = (False, None)
    ) -> tuple[SessionContext | None, StoredSession | None]:
        """The live cached context (checked against the database), else the stored rows."""
        ctx = self._contexts.get(session_id)
        if ctx is not None and not ctx.loaded:  # handed out on a loop's thread, unread
            ctx.ensure_loaded()
            if not ctx.deleted:
                return ctx, None
        elif ctx is not None and (ctx.in_turn or self._refresh(ctx, claimed)):
            return ctx, None
        return None, self._load(session_id)

    def _claimed_version(self, session_id: str) -> tuple[bool, int | None]:
        """The version this store's active claim (or inbox batch) read for ``session_id``, once.

        The turn's lease reads it again anyway, so ``get_or_create`` inside the
        claim needs no round trip. ``(False, None)`` when there is none.
        """
        batch = active_batch(session_id)
        if batch is not None:
            return True, batch.lease.version
        if self._claims_backend is None:
            return False, None
        return claimed_session_version(session_id, self._claims_backend)

    def _load(self, session_id: str) -> StoredSession | None:
        """The session's row and messages, read in one snapshot (None: no such session)."""
        operation = telemetry.operation("load", self.runtime.system)
        with operation as op, self.runtime.transaction() as conn:
            stored = read_session(conn, self._sealer, session_id)
            op.set("chatflow.messages", 0 if stored is None else len(stored.messages))
            return stored

    def delete(self, session_id: str) -> bool:
        """Delete a session and everything stored for it, in one transaction.

        Its messages, archive, webhook claims (with their stored replies) and
        inbox messages go with it, as :meth:`erase_user` removes them: nothing
        of it is left for a later session under the same id, or its owner, to
        export or erase. Live contexts of the session then raise
        ``SessionDeletedError``; a turn, claim or inbox batch in flight for it
        writes nothing (``LeaseLostError`` or ``ClaimLostError``).

        Returns:
            Whether the session existed (its claims and inbox messages go either way).

        """
        validate_session_id(session_id)
        with self.runtime.transaction(write=True) as conn:
            existed = delete_session(conn, session_id)
        self._deleted(session_id)
        return existed

    def _deleted(self, session_id: str) -> None:
        """Forget what this store holds of a deleted session: its context, an offered lease."""
        self._forget(session_id)
        self.turns.forget_offered(session_id)

    def list_sessions(
        self,
        *,
        user_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        updated_after: datetime | None = None,
        limit: int | None = None,
        after: str | None = None,
        forked_from: str | None = None,
    ) -> list[str]:
        """Session ids, filtered and paged (see :mod:`chatflow_sqlalchemy.lifecycle`).

        Without arguments: every id, most recently updated first.
        ``user_id``, ``metadata`` (every key -> value must match, by JSON type),
        ``updated_after`` and ``forked_from`` filter; ``limit`` and ``after``
        (the last id of the previous page) page in ``session_id`` order.

        Raises:
            ValueError: For an invalid argument (the message says which).

        """
        filters = ListFilters.build(
            user_id=user_id, metadata=metadata, updated_after=updated_after,
            limit=limit, after=after, forked_from=forked_from,
        )
        if filters.metadata and self._sealer.active:
            raise ValueError(
                "metadata filters cannot look inside encrypted metadata (this store has a "
                "cipher=): filter by user_id / updated_after, or keep the key in user_id"
            )
        with self.runtime.transaction() as conn:
            return session_page(conn, filters)

    def fork(
        self, session_id: str, new_session_id: str, *, at_turn: int | None = None
    ) -> SessionContext:
        """A new session ``new_session_id`` that starts as a copy of ``session_id``; its context.

        The fork holds the source's SYSTEM messages and its window's first
        ``at_turn`` complete turns (all when None), its summary, active agent,
        metadata and ``user_id`` (so ``erase_user`` covers forks). Its context's
        ``forked_from`` and ``forked_at_turn`` say where it came from. It is
        copied in one transaction from the source as committed; the source is
        unchanged.

        Raises:
            ValueError: An invalid argument, no session ``session_id``,
                ``new_session_id`` exists (nothing is written), or ``at_turn``
                is negative or more than the window's turns.
            CorruptRowError: A row of the source cannot be decoded (or opened).

        """
        validate_fork(session_id, new_session_id, at_turn)
        try:
            with self.runtime.transaction(write=True) as conn:
                copy_session(conn, self._sealer, session_id, new_session_id, at_turn)
                stored = read_session(conn, self._sealer, new_session_id)
        except sa_exc.IntegrityError:
            if self._read_version(new_session_id) is None:
                raise
            raise session_exists(new_session_id) from None  # created meanwhile by another writer
        assert stored is not None
        if self._summaries is not None:
            self._summaries.due(new_session_id)  # what waited for the source's summary
        live = self._contexts.get(session_id)  # its agent stands for the name, as on a reload
        agent = None if live is None else live.active_agent
        self._forget(new_session_id)  # a context left of a session once under this id
        return self._contexts.publish(self._build_context(stored, new_session_id, agent))

    def erase_user(self, user_id: str) -> int:
        """Erase every session of ``user_id`` with its messages and claims, in one transaction.

        Live contexts of the erased sessions then raise ``SessionDeletedError``.
        Returns how many sessions were erased.

        Raises:
            ValueError: For an invalid ``user_id``.

        """
        validate_user_id(user_id)
        with self.runtime.transaction(write=True) as conn:
            ids = user_session_ids(conn, user_id, lock=True)
            erased = erase_sessions(conn, ids)
        for session_id in ids:
            self._deleted(session_id)
        return erased

    def sweep(self, limit: int | None = None) -> int:
        """Remove expired sessions (messages and claims too) in batches; return how many.

        Inbox messages done or sent longer ago than the dedup window go too.

        A session is expired when not updated for ``session_ttl_hours``; each
        batch is one transaction. A session under a live turn lease or webhook
        claim stays. Concurrent sweepers remove each session exactly once.

        Raises:
            ValueError: The store has no ``session_ttl_hours``, or ``limit`` is invalid.

        """
        ttl = self._session_ttl()
        validate_sweep_limit(limit)
        self.inbox.purge()
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
        telemetry.count("chatflow.sessions.swept", total, self.runtime.system)
        return total

    def _sweep_batch(
        self, cutoff: datetime, want: int, cursor: SweepCursor
    ) -> tuple[list[str], list[str]]:
        """One sweep transaction: (candidates found, sessions removed).

        A deadlock victim (racing sweepers on InnoDB) was rolled back whole: it is retried.
        """
        start = (cursor.updated_at, cursor.session_id)

        def batch() -> tuple[list[str], list[str]]:
            cursor.updated_at, cursor.session_id = start  # a rolled-back batch is redone whole
            with self.runtime.transaction(write=True) as conn:
                found = sweep_candidates(
                    conn, cutoff, utcnow(), want, cursor, self.support.lock_batch
                )
                ours = self._contexts.in_turn(found)
                removed = [sid for sid in found if sid not in ours]
                erase_sessions(conn, removed)
            return found, removed

        return retrying_deadlocks(batch)

    def transcript(self, session_id: str) -> list[Message]:
        """The whole conversation: archived messages, then the window, in order.

        Archived messages exist for stores opened with ``archive_pruned=True``
        (those pruned before that are gone). An unknown session has none ([]).

        Raises:
            ValueError: For an invalid ``session_id``.
            CorruptRowError: A stored row cannot be decoded.

        """
        validate_session_id(session_id)
        with self.runtime.transaction() as conn:
            # Pruned rows waiting for a summary are the transcript only where pruned
            # rows are kept (archive_pruned): without it they go once summarized.
            rows = transcript_sources(conn, session_id, waiting=self.archive_pruned)
        return decode_transcript(session_id, rows, self._sealer.parser(parse_message))

    def rotate_keys(self, batch: int = ROTATE_BATCH) -> int:
        """Re-encrypt every row not sealed with the cipher's primary key; return how many.

        Online: each batch (at most ``batch`` rows per table) is one short write
        transaction. Plaintext rows are encrypted too.

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
            with self.runtime.transaction(write=True) as conn:
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

    def export_user(self, user_id: str) -> dict[str, Any]:
        """Everything held about ``user_id`` (JSON-serialisable): what ``erase_user`` removes.

        Its sessions with their messages, archive and claims, and the inbox
        messages of its sessions; in clear when a cipher sealed them.

        Raises:
            ValueError: For an invalid ``user_id``.
            CorruptRowError: A stored row of the user's cannot be decoded.

        """
        validate_user_id(user_id)
        with self.runtime.transaction() as conn:
            return export_user_document(conn, user_id, self._sealer, parse_message)

    def clear(self) -> None:
        """Delete every session and message (processed webhook ids are kept)."""
        with self.runtime.transaction(write=True) as conn:
            conn.execute(delete(_messages))
            conn.execute(delete(_sessions))
        self._contexts.forget_all()

    # ------------------------------------------------------------ dedup

    def is_message_processed(self, message_id: str) -> bool:
        """True if ``message_id`` was claimed within the dedup TTL."""
        validate_message_id(message_id)
        params = {"message_id": message_id, "cutoff": utcnow() - self._dedup_ttl}
        with self.runtime.transaction(single=True) as conn:
            return conn.execute(IS_PROCESSED, params).first() is not None

    def mark_message_processed(self, message_id: str) -> None:
        """Record ``message_id`` as processed now (check-then-mark; prefer the atomic claim)."""
        validate_message_id(message_id)
        with self.runtime.transaction(write=True) as conn:
            conn.execute(
                self._mark,
                {"message_id": message_id, "processed_at": utcnow()},
            )

    def record_processed_message(self, message_id: str) -> bool:
        """Atomically claim ``message_id``: True only for its first caller within the TTL.

        One ``INSERT ... ON CONFLICT`` decides, so racing callers get exactly
        one True; an expired claim can be taken again.
        """
        validate_message_id(message_id)
        now = utcnow()
        params = {"message_id": message_id, "processed_at": now, "cutoff": now - self._dedup_ttl}
        with self.runtime.transaction(single=True) as conn:  # one statement decides, atomically
            claimed = self.support.claimed(conn.execute(self._claim, params))
        self._purge_now_and_then(now)
        return claimed

    def purge_processed_messages(self) -> int:
        """Delete expired processed ids (whole partitions first where the backend has them)."""
        now = utcnow()
        cutoff = now - self._dedup_ttl
        total = self._drop_expired(cutoff, now)
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
            self._claims_backend = SQLClaims(
                self.runtime, self._run_blocking, self.support, self.turns, self._dedup_ttl,
                self._purge_now_and_then,
            )
        return self._claims_backend

    def _purge_now_and_then(self, now: datetime) -> None:
        """The dedup upkeep claims do on their way, at most every five minutes."""
        if now - self._last_purge < _PURGE_INTERVAL:
            return
        self._last_purge = now
        try:
            self._drop_expired(now - self._dedup_ttl, now)
            if not self.support.expires_processed_whole:
                self._purge_batch(now - self._dedup_ttl)
        except (sa_exc.SQLAlchemyError, ChatflowStoreError) as exc:
            # The id is recorded already: a failed upkeep must not fail the caller's claim.
            logger.warning("dedup upkeep failed, next try in five minutes: %s", exc)

    def _drop_expired(self, cutoff: datetime, now: datetime) -> int:
        # Not write=: on SQLite the default hook sends nothing and must not take the write lock.
        with self.runtime.transaction() as conn:
            return self.support.drop_expired_processed(conn, cutoff, now)

    def _purge_batch(self, cutoff: Any) -> int:
        with self.runtime.transaction(write=True) as conn:
            return int(conn.execute(self._purge, {"cutoff": cutoff}).rowcount)

    # ------------------------------------------------------------ writes and turns

    def _flush_context(
        self,
        ctx: SessionContext,
        fence: ClaimFence | None = None,
        lease: Lease | None = None,
        batch: BatchFence | None = None,
    ) -> None:
        """Write what ``ctx`` changed since the database last saw it, in one transaction.

        The same transaction marks ``fence`` (the turn's webhook claim) done and
        gives ``lease`` back, or writes nothing (``ClaimLostError``,
        ``LeaseLostError``); it records ``batch``'s reply and keeps its lease.
        """
        self._claimed_version(ctx.session_id)  # stale once written: no later call may use it
        with ctx.writing() as pending:
            if pending is None:
                return
            try:
                with telemetry.operation("turn.commit", self.runtime.system):
                    deleted = self._writer.write(ctx, pending, fence, lease, batch)
                telemetry.count("chatflow.messages.pruned", deleted, self.runtime.system)
            except SessionDeletedError:
                self._forget(ctx.session_id, ctx)
                raise
            except LeaseLostError:
                ctx.mark_stale()  # memory must not keep what the database refused
                with suppress(Exception):
                    self._refresh(ctx)
                raise
            if fence is not None:
                fence.committed = True

    async def _discard_turn(self, ctx: SessionContext) -> None:
        """A turn ended by an exception: nothing is written, the lease goes back.

        A session this store made for it and never wrote to is unborn again
        (:attr:`SessionContext.made_version`): ``get`` no longer shows it.
        """
        await self.turns.discard(ctx, ctx.made_version)

    # ------------------------------------------------------------ lifecycle

    def wait_for_summaries(self, timeout: float | None = None) -> bool:
        """Wait until no summary is being made; False if ``timeout`` seconds passed first.

        Summaries are made in the background: a job that exits after its last turn waits first.
        """
        return True if self._summaries is None else self._summaries.wait(timeout)

    def close(self) -> None:
        """Release the thread pool and (if the store created it) the engine.

        Summaries still being made are dropped: their turns wait for the next prune.
        """
        if self.runtime.closed:
            return
        if self._summaries is not None:
            self._summaries.close()
        self.runtime.close()

    async def aclose(self) -> None:
        """Async :meth:`close` (waits for in-flight work off the loop)."""
        await self.runtime.adispose_async_engine()
        if self.runtime.ephemeral:
            self.close()
        else:
            await asyncio.get_running_loop().run_in_executor(None, self.close)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {describe(self.url)}>"
