"""The options every store takes, declared and validated once: :class:`StoreOptions`.

An option is a field here (checked in ``__post_init__``) and a keyword of
:class:`StoreKeywords` or :class:`SQLStoreKeywords` for type checkers (a test
checks they agree). No SQLAlchemy: the in-memory store runs without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import Any, TypedDict

from chatflow_sqlalchemy.claims import DEFAULT_DEDUP_TTL_HOURS, validate_dedup_ttl
from chatflow_sqlalchemy.context import validate_max_turns
from chatflow_sqlalchemy.crypto import AESGCMCipher
from chatflow_sqlalchemy.lifecycle import validate_archive_pruned, validate_session_ttl
from chatflow_sqlalchemy.summaries import Summarizer, validate_summarizer
from chatflow_sqlalchemy.values import DEFAULT_TURN_LEASE_SECONDS, validate_turn_lease_seconds

__all__ = ["SQL_ONLY", "OptionsOwner", "SQLStoreKeywords", "StoreKeywords", "StoreOptions"]

SQL_ONLY = frozenset({"auto_migrate", "cipher", "require_encryption"})
"""Options of the SQL stores only (the in-memory store keeps nothing at rest)."""


class StoreKeywords(TypedDict, total=False):
    """The keyword-only options every store takes (besides the two positional ones)."""

    session_ttl_hours: float | None
    archive_pruned: bool
    turn_lease_seconds: float
    summarizer: Summarizer | None


class SQLStoreKeywords(StoreKeywords, total=False):
    """The keyword-only options of the SQL stores: every store's, and what is at rest."""

    auto_migrate: bool | None
    cipher: AESGCMCipher | None
    require_encryption: bool


@dataclass(frozen=True)
class StoreOptions:
    """A store's options, checked when they are made (a bad value never reaches a store).

    Attributes:
        default_max_turns: History window of new contexts, in complete turns.
        dedup_ttl_hours: How long a processed webhook id stays claimed.
        session_ttl_hours: ``sweep()`` removes sessions not updated for this
            many hours; None (the default) keeps them forever.
        archive_pruned: Archive what pruning drops (for ``transcript()``), not delete it.
        turn_lease_seconds: How long a turn's lease lasts without renewal: a
            worker that dies mid-turn frees its session after this long.
        summarizer: An async ``(previous_summary, dropped) -> str`` that
            summarizes what pruning drops (:mod:`~chatflow_sqlalchemy.summaries`).
        auto_migrate: SQL stores: create or upgrade the schema on open (True),
            or refuse an old or missing one with ``SchemaError`` (False); None
            reads ``CHATFLOW_AUTO_MIGRATE``.
        cipher: SQL stores: an :class:`~chatflow_sqlalchemy.crypto.AESGCMCipher`
            encrypting content and metadata at rest.
        require_encryption: SQL stores: refuse plaintext rows with ``CorruptRowError``.

    Raises:
        ValueError: A value out of its range or of the wrong kind.
        TypeError: ``auto_migrate`` is neither a bool nor None.

    """

    default_max_turns: int = 40
    dedup_ttl_hours: float = DEFAULT_DEDUP_TTL_HOURS
    session_ttl_hours: float | None = None
    archive_pruned: bool = False
    turn_lease_seconds: float = DEFAULT_TURN_LEASE_SECONDS
    summarizer: Summarizer | None = None
    auto_migrate: bool | None = None
    cipher: AESGCMCipher | None = None
    require_encryption: bool = False

    def __post_init__(self) -> None:
        checked = {
            "default_max_turns": validate_max_turns(self.default_max_turns, "default_max_turns"),
            "dedup_ttl_hours": validate_dedup_ttl(self.dedup_ttl_hours),
            "session_ttl_hours": validate_session_ttl(self.session_ttl_hours),
            "archive_pruned": validate_archive_pruned(self.archive_pruned),
            "turn_lease_seconds": validate_turn_lease_seconds(self.turn_lease_seconds),
            "summarizer": validate_summarizer(self.summarizer),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        if self.auto_migrate is not None and not isinstance(self.auto_migrate, bool):
            raise TypeError(f"auto_migrate must be True, False or None, not {self.auto_migrate!r}")
        if self.cipher is not None and not isinstance(self.cipher, AESGCMCipher):
            raise ValueError(
                f"cipher must be a chatflow_sqlalchemy.crypto.AESGCMCipher, got {self.cipher!r}"
            )
        if not isinstance(self.require_encryption, bool):
            raise ValueError(
                f"require_encryption must be True or False, got {self.require_encryption!r}"
            )
        if self.require_encryption and self.cipher is None:
            raise ValueError("require_encryption=True needs a cipher= to read and write with")

    @property
    def dedup_ttl(self) -> timedelta:
        """``dedup_ttl_hours`` as a duration."""
        return timedelta(hours=self.dedup_ttl_hours)

    @classmethod
    def of(
        cls, store: str, keywords: Mapping[str, Any], *, sql: bool = True, fix: str = ""
    ) -> StoreOptions:
        """The options a constructor of ``store`` was called with.

        Args:
            store: The class name, for the error message.
            keywords: Its keyword arguments, the positional options included.
            sql: It is a SQL store (which also takes :data:`SQL_ONLY`).
            fix: What to do instead, added to the error of an unknown keyword.

        Raises:
            TypeError: A keyword that is no option of ``store``, naming the ones there are.

        """
        known = {f.name for f in fields(cls)} - (set() if sql else SQL_ONLY)
        unknown = sorted(set(keywords) - known)
        if unknown:
            name = unknown[0]
            why = f": {name} is an option of the SQL stores, which keep data at rest"
            raise TypeError(
                f"{store}() got an unexpected keyword argument {name!r}"
                f"{why if name in SQL_ONLY else ''}; its options are "
                f"{', '.join(sorted(known))} (chatflow_sqlalchemy.options.StoreOptions)"
                + (f"; {fix}" if fix else "")
            )
        return cls(**keywords)


class OptionsOwner:
    """A store's options, as ``store.options`` and one attribute per shared option."""

    options: StoreOptions
    """What the store was opened with, validated."""

    @property
    def default_max_turns(self) -> int:
        """History window of new contexts, in complete turns (assignable, as upstream's)."""
        return self.options.default_max_turns

    @default_max_turns.setter
    def default_max_turns(self, value: int) -> None:
        self.options = replace(self.options, default_max_turns=value)

    @property
    def dedup_ttl_hours(self) -> float:
        """How long a processed webhook id stays claimed."""
        return self.options.dedup_ttl_hours

    @property
    def session_ttl_hours(self) -> float | None:
        """After how long without an update a session is expired (None: never)."""
        return self.options.session_ttl_hours

    @property
    def archive_pruned(self) -> bool:
        """Whether pruned messages are archived rather than deleted."""
        return self.options.archive_pruned

    @property
    def turn_lease_seconds(self) -> float:
        """How long a turn's lease lasts without renewal."""
        return self.options.turn_lease_seconds

    @property
    def summarizer(self) -> Summarizer | None:
        """What summarizes pruned turns, if anything."""
        return self.options.summarizer
