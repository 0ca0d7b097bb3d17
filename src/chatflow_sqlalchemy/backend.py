"""What a backend plugin builds on: the one module plugin authors import from.

A plugin (such as ``chatflow-sqlalchemy-mariadb``) subclasses
:class:`DialectSupport` for its database (its entry points name that class;
its ``store_class`` names the store ``open_store`` opens, by default the
generic :class:`SQLAlchemySessionStore`, which a plugin may subclass), ships
its own tables as a :class:`MigrationChain`, and
writes claim statements with the database-clock times (:data:`CLAIM_NOW`,
:data:`CLAIM_LEASE`, :data:`CLAIM_CUTOFF`, :data:`CLAIM_HORIZON`). Everything
here is public and covered by the conformance kit (:mod:`chatflow_sqlalchemy.testing`);
the rest of the package may change between releases. Names are imported on
first use, so a plugin's driver-free schema module stays cheap to import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatflow_sqlalchemy.clock import (
        CLAIM_CUTOFF,
        CLAIM_HORIZON,
        CLAIM_LEASE,
        CLAIM_NOW,
        DatabaseNow,
    )
    from chatflow_sqlalchemy.crypto import AESGCMCipher
    from chatflow_sqlalchemy.dialect import (
        RECLAIMED_AS_DONE,
        DialectSupport,
        SessionWrite,
        WriteStep,
    )
    from chatflow_sqlalchemy.exceptions import BackendImportError, DatabaseUnavailableError
    from chatflow_sqlalchemy.iopool import IOPool
    from chatflow_sqlalchemy.migrate import MigrationChain
    from chatflow_sqlalchemy.options import StoreOptions
    from chatflow_sqlalchemy.server_store import ServerSessionStore
    from chatflow_sqlalchemy.store import SQLAlchemySessionStore
    from chatflow_sqlalchemy.summaries import Summarizer
    from chatflow_sqlalchemy.tables import CLAIM_TICKETS, NAMING_CONVENTION, UTCDateTime
    from chatflow_sqlalchemy.values import DEFAULT_DEDUP_TTL_HOURS, DEFAULT_TURN_LEASE_SECONDS

_SOURCES: dict[str, str] = {
    name: f"chatflow_sqlalchemy.{module}"
    for module, names in {
        "values": ("DEFAULT_DEDUP_TTL_HOURS", "DEFAULT_TURN_LEASE_SECONDS"),
        "crypto": ("AESGCMCipher",),
        "dialect": ("RECLAIMED_AS_DONE", "DialectSupport", "SessionWrite", "WriteStep"),
        "exceptions": ("BackendImportError", "DatabaseUnavailableError"),
        "iopool": ("IOPool",),
        "migrate": ("MigrationChain",),
        "tables": ("CLAIM_TICKETS", "NAMING_CONVENTION", "UTCDateTime"),
        "options": ("StoreOptions",),
        "server_store": ("ServerSessionStore",),
        "clock": ("CLAIM_CUTOFF", "CLAIM_HORIZON", "CLAIM_LEASE", "CLAIM_NOW", "DatabaseNow"),
        "store": ("SQLAlchemySessionStore",),
        "summaries": ("Summarizer",),
    }.items()
    for name in names
}
"""Where each name lives, by module (imported on first use)."""

__all__ = [
    "CLAIM_CUTOFF",
    "CLAIM_HORIZON",
    "CLAIM_LEASE",
    "CLAIM_NOW",
    "CLAIM_TICKETS",
    "DEFAULT_DEDUP_TTL_HOURS",
    "DEFAULT_TURN_LEASE_SECONDS",
    "NAMING_CONVENTION",
    "RECLAIMED_AS_DONE",
    "AESGCMCipher",
    "BackendImportError",
    "DatabaseNow",
    "DatabaseUnavailableError",
    "DialectSupport",
    "IOPool",
    "MigrationChain",
    "SQLAlchemySessionStore",
    "ServerSessionStore",
    "SessionWrite",
    "StoreOptions",
    "Summarizer",
    "UTCDateTime",
    "WriteStep",
]


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
