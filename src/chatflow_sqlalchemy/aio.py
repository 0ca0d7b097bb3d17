"""The async API of every store, written once: each ``a``-method runs its sync twin."""

from __future__ import annotations

import abc
import asyncio
import functools
from collections.abc import Callable, Coroutine
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from chatflow_agent import Agent, BaseSessionStore, Message

from chatflow_sqlalchemy.context import SessionContext

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["AsyncStoreAPI"]

_T = TypeVar("_T")
_P = ParamSpec("_P")


def _twin(
    sync: Callable[Concatenate[Any, _P], _T],
) -> Callable[Concatenate[AsyncStoreAPI, _P], Coroutine[Any, Any, _T]]:
    """The ``a``-method of the store method ``sync``: the store's own, by :meth:`_run_blocking`.

    It looks the method up on the store, so a subclass's override is the one run.
    """
    name = sync.__name__

    async def twin(self: AsyncStoreAPI, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        method = getattr(self, name)
        if kwargs:
            method = functools.partial(method, **kwargs)
        return await self._run_blocking(method, *args)

    functools.update_wrapper(twin, sync, (), ())  # its signature, for help() and inspect
    twin.__name__ = f"a{name}"
    twin.__qualname__ = f"AsyncStoreAPI.a{name}"
    twin.__doc__ = f"Async :meth:`{name}`."
    return twin


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

    async def await_for_summaries(self, timeout: float | None = None) -> bool:
        """Async ``wait_for_summaries`` (the wait runs on a thread, never on the loop)."""
        return await asyncio.to_thread(self.wait_for_summaries, timeout)

    aget = _twin(get)
    adelete = _twin(BaseSessionStore.delete)
    alist_sessions = _twin(list_sessions)
    afork = _twin(fork)
    aerase_user = _twin(erase_user)
    atranscript = _twin(transcript)
    asweep = _twin(sweep)
    aexport_user = _twin(export_user)
    aclear = _twin(BaseSessionStore.clear)
    ais_message_processed = _twin(BaseSessionStore.is_message_processed)
    amark_message_processed = _twin(mark_message_processed)
    arecord_processed_message = _twin(BaseSessionStore.record_processed_message)
    apurge_processed_messages = _twin(purge_processed_messages)
