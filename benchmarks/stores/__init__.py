"""Every store under test, by name."""

from __future__ import annotations

from benchmarks.stores.base import Adapter, Target
from benchmarks.stores.chatflow import (
    OursMemory,
    OursPostgres,
    OursPostgresClaim,
    OursSQLite,
    OursSQLiteMemory,
    UpstreamMemory,
    UpstreamSQLite,
)
from benchmarks.stores.floors import (
    RawMemory,
    RawPostgres,
    RawPostgresClaim,
    RawSQLite,
    RawSQLiteHop,
    RawSQLiteMemory,
    RawSQLiteOurs,
)
from benchmarks.stores.openai import (
    OpenAISQLAlchemyPostgres,
    OpenAISQLAlchemySQLite,
    OpenAISQLite,
)

__all__ = ["ADAPTERS", "FLOORS", "Adapter", "Target", "adapter_class", "floor_of"]

ADAPTERS: dict[str, type[Adapter]] = {
    cls.name: cls
    for cls in (
        RawSQLite,
        RawSQLiteHop,
        RawSQLiteOurs,
        OursSQLite,
        UpstreamSQLite,
        OpenAISQLite,
        OpenAISQLAlchemySQLite,
        RawSQLiteMemory,
        OursSQLiteMemory,
        RawMemory,
        OursMemory,
        UpstreamMemory,
        RawPostgres,
        RawPostgresClaim,
        OursPostgres,
        OursPostgresClaim,
        OpenAISQLAlchemyPostgres,
    )
}
"""Every adapter, in the order the tables list them (floor first within a backend)."""

FLOORS: dict[str, str] = {cls.backend: cls.name for cls in ADAPTERS.values() if cls.floor}
"""backend -> name of its raw floor."""


def adapter_class(name: str) -> type[Adapter]:
    """Look an adapter up by name."""
    try:
        return ADAPTERS[name]
    except KeyError:
        raise ValueError(f"unknown store {name!r}; known: {', '.join(ADAPTERS)}") from None


def floor_of(name: str) -> str:
    """The floor a store's ratio is taken against: its own choice, else its backend's."""
    cls = adapter_class(name)
    return cls.compared_with or FLOORS[cls.backend]
