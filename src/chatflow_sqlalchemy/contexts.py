"""The live contexts of a SQL store (one per session, DESIGN item 3), and their agents (item 5)."""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable

from chatflow_agent import Agent

from chatflow_sqlalchemy.context import SessionContext

__all__ = ["AgentResolver", "ContextCache"]

logger = logging.getLogger("chatflow_sqlalchemy")


class ContextCache:
    """The contexts of one store by session id: weakly held, the newest ``size`` strongly.

    A forgotten context is marked deleted, so its holders get ``SessionDeletedError``.
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._live: weakref.WeakValueDictionary[str, SessionContext] = (
            weakref.WeakValueDictionary()
        )
        self._recent: OrderedDict[str, SessionContext] = OrderedDict()
        self._lock = threading.RLock()

    def get(self, session_id: str) -> SessionContext | None:
        """The live context of ``session_id``, if any (it becomes the most recent)."""
        with self._lock:
            ctx = self._live.get(session_id)
            if ctx is not None:
                self._recent[session_id] = ctx
                self._recent.move_to_end(session_id)
            return ctx

    def publish(self, ctx: SessionContext) -> SessionContext:
        """Cache ``ctx`` unless another thread published a live one first; return the one cached."""
        with self._lock:
            existing = self._live.get(ctx.session_id)
            if existing is not None and not existing.deleted:
                return existing
            self._live[ctx.session_id] = ctx
            self._recent[ctx.session_id] = ctx
            self._recent.move_to_end(ctx.session_id)
            while len(self._recent) > self._size:
                self._recent.popitem(last=False)
            return ctx

    def forget(self, session_id: str, only: SessionContext | None = None) -> None:
        """Drop ``session_id``'s context (only if it is ``only``, if given); mark it deleted."""
        with self._lock:
            ctx = self._live.get(session_id)
            if only is not None and ctx is not only:
                only.mark_deleted()
                return
            self._live.pop(session_id, None)
            self._recent.pop(session_id, None)
        if ctx is not None:
            ctx.mark_deleted()

    def forget_all(self) -> None:
        """Drop every context, each marked deleted."""
        with self._lock:
            ids = list(self._live.keys())
        for session_id in ids:
            self.forget(session_id)

    def in_turn(self, session_ids: Iterable[str]) -> set[str]:
        """Of ``session_ids``, those whose context is in a turn right now."""
        with self._lock:
            return {
                sid for sid in session_ids
                if (ctx := self._live.get(sid)) is not None and ctx.in_turn
            }


class AgentResolver:
    """Maps stored agent names to Agents: the Runner's resolver, else a fallback agent."""

    def __init__(self) -> None:
        self.resolver: Callable[[str], Agent | None] | None = None
        self._warned: set[str] = set()

    def __call__(self, name: str, default: Agent | None) -> Agent:
        """The Agent named ``name``: the resolver's, else ``default`` of that name (or unnamed).

        Else a temporary agent without tools, with a warning once per name.
        """
        if not name and default is not None:
            return default
        if self.resolver is not None:
            agent = self.resolver(name)
            if agent is not None:
                return agent
        if default is not None and default.name == name:
            return default
        if name not in self._warned:
            self._warned.add(name)
            logger.warning(
                "no agent resolver knows agent %r; using a temporary fallback agent without "
                "tools (pass session_store= to a Runner that knows it, or call "
                "store.set_agent_resolver)",
                name,
            )
        return Agent(name=name, instructions="", model="gemini-2.5-flash")
