"""What every store under test implements, and where its data lives."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from benchmarks.workload import Tag, TurnRef

__all__ = ["Adapter", "Target"]


@dataclass(frozen=True)
class Target:
    """Where one run's data lives: a SQLite file, or a PostgreSQL schema (or nothing)."""

    path: str | None = None
    pg_url: str | None = None
    schema: str | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (sent to worker processes)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Target:
        """Inverse of :meth:`to_json`."""
        return cls(**data)


class Adapter(abc.ABC):
    """One store driven through the webhook-turn workload.

    Subclasses set ``backend`` (which raw floor they are compared with),
    ``ephemeral`` (the data dies with the process: verified in the worker, not
    from a fresh instance) and ``multiprocess`` (can be shared by processes).
    ``compared_with`` names another floor when the backend's does not give the
    store's guarantees (a claimed turn against the guarantee-equivalent floor).
    """

    name: ClassVar[str]
    backend: ClassVar[str]
    ephemeral: ClassVar[bool] = False
    multiprocess: ClassVar[bool] = False
    floor: ClassVar[bool] = False
    compared_with: ClassVar[str] = ""
    note: ClassVar[str] = ""

    def __init__(self, target: Target) -> None:
        self.target = target

    @classmethod
    def prepare(cls, target: Target) -> None:
        """Create the schema before workers start (run once, in the parent)."""
        return None

    @abc.abstractmethod
    async def open(self) -> None:
        """Open the store (not timed)."""

    @abc.abstractmethod
    def payload(self, ref: TurnRef) -> Any:
        """Build the turn's messages (not timed)."""

    @abc.abstractmethod
    async def turn(self, ref: TurnRef, payload: Any) -> bool:
        """Run one turn; False when the webhook id was already claimed (nothing ran)."""

    @abc.abstractmethod
    async def read_windows(self, session_ids: Sequence[str]) -> dict[str, list[Tag]]:
        """Read every session's stored history back as tags."""

    async def close(self) -> None:
        """Release connections and pools."""
        return None
