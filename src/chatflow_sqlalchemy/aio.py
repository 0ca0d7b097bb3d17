"""The async API of every store, written once: each ``a``-method runs its sync twin."""

from __future__ import annotations

import abc
import asyncio
import functools
from collections.abc import Callable
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from chatflow_agent import Agent, BaseSessionStore, Message

from chatflow_sqlalchemy.context import SessionContext

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["AsyncStoreAPI"]

_T = TypeVar("_T")


class AsyncStoreAPI(BaseSessionStore):
    """The ``a``-methods of a store, each its sync twin run by :meth:`_run_blocking`.

    A store is also a context manager (``with`` and ``async with``) that closes on exit.
    """

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the store holds; later calls raise ``RuntimeError``."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Async :meth:`close`."""

    @abc.abstractmethod
    async def _run_blocking(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` as the store's async API runs blocking work."""

    @abc.abstractmethod
    def get_or_create(
        self,
        session_id: str,
        default_agent: Agent,
        metadata: dict[str, Any] | None = None,
        *,
        user_id: str | None = None,
    ) -> SessionContext:
        """Return the session's context, creating the session if it does not exist."""

    @abc.abstractmethod
    def get(self, session_id: str) -> SessionContext | None:
        """Return the session's context, or None if the session does not exist."""

    @abc.abstractmethod
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
        """The ids of the sessions that match every filter given."""

    @abc.abstractmethod
    def fork(
        self, session_id: str, new_session_id: str, *, at_turn: int | None = None
    ) -> SessionContext:
        """A new session that starts as a copy of ``session_id``'s first turns; its context."""

    @abc.abstractmethod
    def erase_user(self, user_id: str) -> int:
        """Delete everything stored about ``user_id``; return how many sessions went."""

    @abc.abstractmethod
    def wait_for_summaries(self, timeout: float | None = None) -> bool:
        """Wait until no summary is being made; False if ``timeout`` seconds passed first."""

    @abc.abstractmethod
    def transcript(self, session_id: str) -> list[Message]:
        """The whole conversation, pruned messages included where they were kept."""

    @abc.abstractmethod
    def sweep(self, limit: int | None = None) -> int:
        """Remove expired sessions; return how many."""

    @abc.abstractmethod
    def export_user(self, user_id: str) -> dict[str, Any]:
        """Everything stored about ``user_id``, as one JSON-ready document."""

    @abc.abstractmethod
    def mark_message_processed(self, message_id: str) -> None:
        """Record ``message_id`` as processed."""

    @abc.abstractmethod
    def purge_processed_messages(self) -> int:
        """Remove expired processed ids; return how many."""

    async def aget_or_create(
        self,
        session_id: str,
        default_agent: Agent,
        metadata: dict[str, Any] | None = None,
        *,
        user_id: str | None = None,
    ) -> SessionContext:
        """Async :meth:`get_or_create`."""
        if user_id is None:
            return await self._run_blocking(self.get_or_create, session_id, default_agent, metadata)
        return await self._run_blocking(
            functools.partial(self.get_or_create, user_id=user_id),
            session_id, default_agent, metadata,
        )

    async def aget(self, session_id: str) -> SessionContext | None:
        """Async :meth:`get`."""
        return await self._run_blocking(self.get, session_id)

    async def adelete(self, session_id: str) -> bool:
        """Async :meth:`delete`."""
        return await self._run_blocking(self.delete, session_id)

    async def alist_sessions(
        self,
        *,
        user_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        updated_after: datetime | None = None,
        limit: int | None = None,
        after: str | None = None,
        forked_from: str | None = None,
    ) -> list[str]:
        """Async :meth:`list_sessions`."""
        return await self._run_blocking(
            functools.partial(
                self.list_sessions, user_id=user_id, metadata=metadata,
                updated_after=updated_after, limit=limit, after=after, forked_from=forked_from,
            )
        )

    async def afork(
        self, session_id: str, new_session_id: str, *, at_turn: int | None = None
    ) -> SessionContext:
        """Async :meth:`fork`."""
        return await self._run_blocking(
            functools.partial(self.fork, at_turn=at_turn), session_id, new_session_id
        )

    async def aerase_user(self, user_id: str) -> int:
        """Async :meth:`erase_user`."""
        return await self._run_blocking(self.erase_user, user_id)

    async def await_for_summaries(self, timeout: float | None = None) -> bool:
        """Async ``wait_for_summaries`` (the wait runs on a thread, never on the loop)."""
        return await asyncio.to_thread(self.wait_for_summaries, timeout)

    async def atranscript(self, session_id: str) -> list[Message]:
        """Async :meth:`transcript`."""
        return await self._run_blocking(self.transcript, session_id)

    async def asweep(self, limit: int | None = None) -> int:
        """Async :meth:`sweep`."""
        return await self._run_blocking(self.sweep, limit)

    async def aexport_user(self, user_id: str) -> dict[str, Any]:
        """Async :meth:`export_user`."""
        return await self._run_blocking(self.export_user, user_id)

    async def aclear(self) -> None:
        """Async :meth:`clear`."""
        await self._run_blocking(self.clear)

    async def ais_message_processed(self, message_id: str) -> bool:
        """Async :meth:`is_message_processed`."""
        return await self._run_blocking(self.is_message_processed, message_id)

    async def amark_message_processed(self, message_id: str) -> None:
        """Async :meth:`mark_message_processed`."""
        await self._run_blocking(self.mark_message_processed, message_id)

    async def arecord_processed_message(self, message_id: str) -> bool:
        """Async :meth:`record_processed_message`."""
        return await self._run_blocking(self.record_processed_message, message_id)

    async def apurge_processed_messages(self) -> int:
        """Async :meth:`purge_processed_messages`."""
        return await self._run_blocking(self.purge_processed_messages)
