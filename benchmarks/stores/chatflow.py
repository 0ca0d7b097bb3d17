"""chatflow-agent style stores: this project's and upstream's, driven as the Runner does.

A turn: ``store.record_processed_message(id)`` (the atomic claim, sync as in the
README's webhook handler), ``store.get_or_create(session_id, agent)`` (sync, as
``Runner.run_async`` calls it), then under ``async with session.lock:`` the
checkpoint ``len(session.history)`` and four ``session.add_message`` calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from chatflow_agent import Agent, Message

from benchmarks import MAX_TURNS
from benchmarks.pg import schema_connect_args
from benchmarks.stores.base import Adapter, Target
from benchmarks.workload import Tag, TurnRef, build_messages, message_tag

__all__ = [
    "ChatflowAdapter",
    "OursMemory",
    "OursPostgres",
    "OursPostgresClaim",
    "OursSQLite",
    "OursSQLiteMemory",
    "UpstreamMemory",
    "UpstreamSQLite",
    "make_agent",
]


def make_agent() -> Agent:
    """The agent every session starts with (no model is ever called)."""
    return Agent(name="Support", instructions="Você é o suporte.", model="gemini-2.5-flash")


class ChatflowAdapter(Adapter):
    """Drives any ``chatflow_agent.BaseSessionStore`` the way ``Runner.run_async`` does."""

    def __init__(self, target: Target) -> None:
        super().__init__(target)
        self.agent = make_agent()
        self.store: Any = None

    def make_store(self) -> Any:
        """Create the store object for ``self.target``."""
        raise NotImplementedError

    async def open(self) -> None:
        self.store = self.make_store()
        agent = self.agent
        self.store.set_agent_resolver(lambda name: agent if name == agent.name else None)

    def payload(self, ref: TurnRef) -> list[Message]:
        return build_messages(ref.session_id, ref.turn)

    async def turn(self, ref: TurnRef, payload: list[Message]) -> bool:
        store = self.store
        if not store.record_processed_message(ref.webhook_id):
            return False
        session = store.get_or_create(session_id=ref.session_id, default_agent=self.agent)
        async with session.lock:
            _checkpoint = len(session.history)
            for message in payload:
                session.add_message(message)
        return True

    async def read_windows(self, session_ids: Sequence[str]) -> dict[str, list[Tag]]:
        windows: dict[str, list[Tag]] = {}
        for session_id in session_ids:
            session = self.store.get(session_id)
            history = session.history if session is not None else []
            windows[session_id] = [message_tag(message) for message in history]
        return windows

    async def close(self) -> None:
        close = getattr(self.store, "aclose", None)
        if close is not None:
            await close()
        elif hasattr(self.store, "close"):
            self.store.close()


class OursSQLite(ChatflowAdapter):
    """``chatflow_sqlalchemy.SQLiteSessionStore`` on a file (WAL, async work on its pool)."""

    name = "ours-sqlite"
    backend = "sqlite-file"
    multiprocess = True

    @classmethod
    def prepare(cls, target: Target) -> None:
        from chatflow_sqlalchemy import SQLiteSessionStore

        SQLiteSessionStore(target.path or "", default_max_turns=MAX_TURNS).close()

    def make_store(self) -> Any:
        from chatflow_sqlalchemy import SQLiteSessionStore

        return SQLiteSessionStore(self.target.path or "", default_max_turns=MAX_TURNS)


class OursSQLiteMemory(ChatflowAdapter):
    """``chatflow_sqlalchemy.SQLiteSessionStore(":memory:")`` (runs on the loop)."""

    name = "ours-sqlite-mem"
    backend = "sqlite-memory"
    ephemeral = True

    def make_store(self) -> Any:
        from chatflow_sqlalchemy import SQLiteSessionStore

        return SQLiteSessionStore(":memory:", default_max_turns=MAX_TURNS)


class OursMemory(ChatflowAdapter):
    """``chatflow_sqlalchemy.SessionStore``: in-memory, thread-safe."""

    name = "ours-memory"
    backend = "memory"
    ephemeral = True

    def make_store(self) -> Any:
        from chatflow_sqlalchemy import SessionStore

        return SessionStore(default_max_turns=MAX_TURNS)


class OursPostgres(ChatflowAdapter):
    """``chatflow_sqlalchemy.PostgresSessionStore`` (psycopg 3)."""

    name = "ours-pg"
    backend = "postgres"
    multiprocess = True

    @classmethod
    def prepare(cls, target: Target) -> None:
        cls._open(target).close()

    @staticmethod
    def _open(target: Target) -> Any:
        from chatflow_sqlalchemy import PostgresSessionStore

        return PostgresSessionStore(
            target.pg_url or "",
            default_max_turns=MAX_TURNS,
            connect_args=schema_connect_args(target.schema or "public"),
        )

    def make_store(self) -> Any:
        return self._open(self.target)


class OursPostgresClaim(OursPostgres):
    """``ours-pg`` with each turn in ``async with store.claim(...)``, its reply stored.

    Measured against ``raw-pg-claim``, the raw floor that gives the same
    guarantees (durable fenced claim, the session's lease, fenced write).
    """

    name = "ours-pg-claim"
    compared_with = "raw-pg-claim"

    async def turn(self, ref: TurnRef, payload: list[Message]) -> bool:
        store = self.store
        async with store.claim(ref.webhook_id, session_id=ref.session_id) as claim:
            if not claim.acquired:
                return False
            session = store.get_or_create(session_id=ref.session_id, default_agent=self.agent)
            async with session.lock:
                for message in payload:
                    session.add_message(message)
            claim.response = payload[-1].content
        return True


class UpstreamSQLite(ChatflowAdapter):
    """``chatflow_agent.SQLiteSessionStore`` 0.3.4 (a connection per call, I/O on the loop)."""

    name = "upstream-sqlite"
    backend = "sqlite-file"
    multiprocess = True

    @classmethod
    def prepare(cls, target: Target) -> None:
        from chatflow_agent import SQLiteSessionStore

        SQLiteSessionStore(target.path or "", default_max_turns=MAX_TURNS)

    def make_store(self) -> Any:
        from chatflow_agent import SQLiteSessionStore

        return SQLiteSessionStore(self.target.path or "", default_max_turns=MAX_TURNS)


class UpstreamMemory(ChatflowAdapter):
    """``chatflow_agent.SessionStore`` 0.3.4 (regroups the whole history per message)."""

    name = "upstream-memory"
    backend = "memory"
    ephemeral = True
    note: ClassVar[str] = "no set_agent_resolver in upstream's in-memory store"

    async def open(self) -> None:
        self.store = self.make_store()

    def make_store(self) -> Any:
        from chatflow_agent import SessionStore

        return SessionStore(default_max_turns=MAX_TURNS)
