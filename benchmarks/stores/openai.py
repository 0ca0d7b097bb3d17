"""openai-agents sessions (``SQLiteSession``, ``SQLAlchemySession``) on the same workload.

Adapted honestly, and said so in RESULTS.md:

* a turn is the same four items (user message, ``function_call``,
  ``function_call_output``, assistant message), written with one
  ``add_items`` call after the Runner-style ``get_items()`` read of the window;
* openai-agents has no webhook dedup, so the claim is emulated with one raw
  ``INSERT .. ON CONFLICT DO NOTHING RETURNING`` on a ``bench_processed``
  table in the same database (stdlib ``sqlite3`` on the loop for
  ``SQLiteSession``, the session's own AsyncEngine for ``SQLAlchemySession``);
* it never prunes: every item is kept and the window is applied on read with
  ``SessionSettings(limit=4 * 40)``, so it skips the DELETE the other stores do.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from benchmarks import MAX_TURNS
from benchmarks.pg import libpq_url
from benchmarks.stores.base import Adapter, Target
from benchmarks.workload import Tag, TurnRef, build_items, item_tag

__all__ = ["OpenAISQLAlchemyPostgres", "OpenAISQLAlchemySQLite", "OpenAISQLite"]

WINDOW_ITEMS = 4 * MAX_TURNS
CLAIM_DDL = (
    "CREATE TABLE IF NOT EXISTS bench_processed "
    "(message_id VARCHAR(255) PRIMARY KEY, processed_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP)"
)
CLAIM = (
    "INSERT INTO bench_processed (message_id) VALUES ({p}) "
    "ON CONFLICT (message_id) DO NOTHING RETURNING 1"
)


def _settings() -> Any:
    from agents.memory import SessionSettings

    return SessionSettings(limit=WINDOW_ITEMS)


class _OpenAIAdapter(Adapter):
    """Shared turn logic: claim, ``get_items()``, ``add_items(4 items)`` under a session lock."""

    note = "no pruning (window applied on read); dedup emulated with raw SQL"

    def __init__(self, target: Target) -> None:
        super().__init__(target)
        self.sessions: dict[str, Any] = {}
        self.locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    def payload(self, ref: TurnRef) -> list[dict[str, Any]]:
        return build_items(ref.session_id, ref.turn)

    def new_session(self, session_id: str) -> Any:
        """A session object bound to ``session_id``."""
        raise NotImplementedError

    async def claim(self, webhook_id: str) -> bool:
        """The emulated atomic dedup claim."""
        raise NotImplementedError

    def session(self, session_id: str) -> Any:
        """One cached session object per session id (what a long-lived server would keep)."""
        session = self.sessions.get(session_id)
        if session is None:
            session = self.sessions[session_id] = self.new_session(session_id)
        return session

    async def turn(self, ref: TurnRef, payload: list[dict[str, Any]]) -> bool:
        if not await self.claim(ref.webhook_id):
            return False
        session = self.session(ref.session_id)
        async with self.locks[ref.session_id]:
            _history = await session.get_items()
            await session.add_items(payload)
        return True

    async def read_windows(self, session_ids: Sequence[str]) -> dict[str, list[Tag]]:
        windows: dict[str, list[Tag]] = {}
        for session_id in session_ids:
            items = await self.new_session(session_id).get_items()
            windows[session_id] = [item_tag(item) for item in items]
        return windows


class OpenAISQLite(_OpenAIAdapter):
    """``agents.SQLiteSession`` on a file (thread-local connections via ``asyncio.to_thread``)."""

    name = "oai-sqlite"
    backend = "sqlite-file"
    multiprocess = True

    def __init__(self, target: Target) -> None:
        super().__init__(target)
        self.conn: sqlite3.Connection | None = None

    @classmethod
    def prepare(cls, target: Target) -> None:
        from agents import SQLiteSession

        SQLiteSession("init", target.path or "").close()
        with sqlite3.connect(target.path or "") as conn:
            conn.execute(CLAIM_DDL)

    async def open(self) -> None:
        self.conn = sqlite3.connect(self.target.path or "", isolation_level=None, timeout=30)
        self.conn.execute("PRAGMA busy_timeout = 30000")

    def new_session(self, session_id: str) -> Any:
        from agents import SQLiteSession

        return SQLiteSession(session_id, self.target.path or "", session_settings=_settings())

    async def claim(self, webhook_id: str) -> bool:
        assert self.conn is not None
        return bool(self.conn.execute(CLAIM.format(p="?"), (webhook_id,)).fetchall())

    async def close(self) -> None:
        for session in self.sessions.values():
            session.close()
        if self.conn is not None:
            self.conn.close()


class _OpenAISQLAlchemy(_OpenAIAdapter):
    """``agents.extensions.memory.SQLAlchemySession`` on one shared AsyncEngine."""

    def __init__(self, target: Target) -> None:
        super().__init__(target)
        self.engine: Any = None

    @classmethod
    def engine_for(cls, target: Target) -> Any:
        """The AsyncEngine for ``target``."""
        raise NotImplementedError

    @classmethod
    def prepare(cls, target: Target) -> None:
        asyncio.run(cls._create_tables(target))

    @classmethod
    async def _create_tables(cls, target: Target) -> None:
        from agents.extensions.memory import SQLAlchemySession
        from sqlalchemy import text

        engine = cls.engine_for(target)
        try:
            await SQLAlchemySession("init", engine=engine, create_tables=True).get_items()
            async with engine.begin() as conn:
                await conn.execute(text(CLAIM_DDL))
        finally:
            await engine.dispose()

    async def open(self) -> None:
        self.engine = self.engine_for(self.target)

    def new_session(self, session_id: str) -> Any:
        from agents.extensions.memory import SQLAlchemySession

        return SQLAlchemySession(session_id, engine=self.engine, session_settings=_settings())

    async def claim(self, webhook_id: str) -> bool:
        from sqlalchemy import text

        async with self.engine.begin() as conn:
            result = await conn.execute(text(CLAIM.format(p=":id")), {"id": webhook_id})
            return bool(result.all())

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.dispose()


class OpenAISQLAlchemySQLite(_OpenAISQLAlchemy):
    """``SQLAlchemySession`` on ``sqlite+aiosqlite``."""

    name = "oai-sqla-sqlite"
    backend = "sqlite-file"
    multiprocess = True

    @classmethod
    def engine_for(cls, target: Target) -> Any:
        from sqlalchemy.ext.asyncio import create_async_engine

        return create_async_engine(f"sqlite+aiosqlite:///{target.path}")


class OpenAISQLAlchemyPostgres(_OpenAISQLAlchemy):
    """``SQLAlchemySession`` on ``postgresql+asyncpg`` (its documented driver)."""

    name = "oai-sqla-pg"
    backend = "postgres"
    multiprocess = True

    @classmethod
    def engine_for(cls, target: Target) -> Any:
        from sqlalchemy.ext.asyncio import create_async_engine

        url = libpq_url(target.pg_url or "", "postgresql+asyncpg")
        settings = {"search_path": target.schema or "public"}
        return create_async_engine(url, connect_args={"server_settings": settings})
