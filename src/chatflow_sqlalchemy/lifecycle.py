"""Lifecycle and data governance: the rules every store shares, without SQL.

The arguments of ``list_sessions``, ``sweep`` and the retention options are
checked here and metadata filters matched here, so the SQL stores
(:mod:`chatflow_sqlalchemy.sql_lifecycle`) and the in-memory store apply the
same rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from chatflow_sqlalchemy.values import (
    check_metadata,
    utcnow,
    validate_id,
    validate_page_limit,
    validate_session_id,
)

__all__ = [
    "EXPORT_FORMAT", "MAX_SESSION_TTL_HOURS", "SWEEP_BATCH", "ExportedInboxMessage",
    "ListFilters", "export_document", "json_equal", "matches_metadata",
    "validate_archive_pruned", "validate_session_ttl", "validate_sweep_limit",
    "validate_user_id",
]

# Bumped if the shape of export_user's document changes incompatibly; a key added
# beside the others (as "inbox" was) keeps it, so readers of the first documents still work.
EXPORT_FORMAT = "chatflow-user-export/1"
SWEEP_BATCH = 500  # sessions removed per sweep transaction: bounds lock time and size
MAX_SESSION_TTL_HOURS = 876_000  # 100 years, as the dedup window


def validate_user_id(user_id: object) -> str:
    """Return ``user_id`` if usable (same rules as a session id), else raise ``ValueError``."""
    return validate_id(user_id, "user_id")


@dataclass(frozen=True)
class ListFilters:
    """The validated arguments of ``list_sessions`` (every store builds one)."""

    user_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    updated_after: datetime | None = None
    limit: int | None = None
    after: str | None = None
    forked_from: str | None = None

    @classmethod
    def build(
        cls,
        *,
        user_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        updated_after: datetime | None = None,
        limit: int | None = None,
        after: str | None = None,
        forked_from: str | None = None,
    ) -> ListFilters:
        """Check every argument; bad input raises ``ValueError`` saying what to pass."""
        if user_id is not None:
            validate_user_id(user_id)
        if forked_from is not None:
            validate_id(forked_from, "forked_from")  # a session id: the forks of that session
        wanted: dict[str, Any] = {}
        if metadata is not None:
            if not isinstance(metadata, Mapping) or not all(isinstance(k, str) for k in metadata):
                raise ValueError(
                    f"metadata must be a dict of str keys to JSON values, got {metadata!r}"
                )
            wanted = dict(metadata)
            check_metadata(wanted)  # refuses what stored metadata cannot hold (NaN, NUL...)
        if updated_after is not None and (
            not isinstance(updated_after, datetime) or updated_after.tzinfo is None
        ):
            raise ValueError(
                "updated_after must be a timezone-aware datetime "
                f"(e.g. datetime.now(timezone.utc) - timedelta(days=1)), got {updated_after!r}"
            )
        limit = validate_page_limit(limit)
        if after is not None:
            try:
                validate_session_id(after)
            except ValueError as exc:
                reason = f"after must be a session id (the last of a page): {exc}"
                raise ValueError(reason) from None
        return cls(user_id, wanted, updated_after, limit, after, forked_from)

    @property
    def paged(self) -> bool:
        """Paging (``limit`` or ``after`` given): keyset order by ``session_id``."""
        return self.limit is not None or self.after is not None


@dataclass(frozen=True)
class ExportedInboxMessage:
    """One durable-inbox message of a user's session, as ``export_user`` holds it.

    The user's own words (``text``, the platform's ``payload``) and what
    became of them (``state``, ``attempts``, the ``reply`` stored for them,
    the ``error`` of a failed attempt): every store builds its ``inbox``
    entries from this, so they hold the same keys.
    """

    message_id: str
    session_id: str
    state: str
    text: str
    payload: Any
    sent_at: datetime | None
    received_at: datetime
    updated_at: datetime
    attempts: int
    reply: str | None
    error: str | None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (times as ISO 8601)."""
        fields = asdict(self)
        for name in ("sent_at", "received_at", "updated_at"):
            fields[name] = None if fields[name] is None else fields[name].isoformat()
        return fields


def export_document(
    user_id: str, sessions: list[dict[str, Any]], inbox: list[ExportedInboxMessage]
) -> dict[str, Any]:
    """``export_user``'s document: one shape for every store and ``users export``."""
    return {
        "format": EXPORT_FORMAT,
        "user_id": user_id,
        "exported_at": utcnow().isoformat(),
        "sessions": sessions,
        "inbox": [message.as_dict() for message in inbox],
    }


def json_equal(left: object, right: object) -> bool:
    """Equality of two decoded JSON values by JSON type: ``1`` equals ``1.0``, not ``true``."""
    if isinstance(left, bool) or isinstance(right, bool):
        return isinstance(left, bool) and isinstance(right, bool) and left == right
    if isinstance(left, (int, float)) and isinstance(right, (int, float)):
        return left == right
    if isinstance(left, str) or isinstance(right, str):
        return isinstance(left, str) and isinstance(right, str) and left == right
    if left is None or right is None:
        return left is None and right is None
    if isinstance(left, dict) and isinstance(right, dict):
        return left.keys() == right.keys() and all(json_equal(left[k], right[k]) for k in left)
    if isinstance(left, list) and isinstance(right, list):
        return len(left) == len(right) and all(
            json_equal(a, b) for a, b in zip(left, right, strict=True)
        )
    return False


def matches_metadata(stored: object, wanted: Mapping[str, Any]) -> bool:
    """True if ``stored`` (a session's metadata) has every key of ``wanted`` with an equal value."""
    if not isinstance(stored, dict):
        return not wanted
    return all(key in stored and json_equal(stored[key], value) for key, value in wanted.items())


def validate_session_ttl(value: object) -> float | None:
    """``session_ttl_hours`` as a float (or None), if ``0 < value <= 100 years``."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value <= MAX_SESSION_TTL_HOURS
    ):
        raise ValueError(
            "session_ttl_hours must be None (keep sessions forever) or a number of hours with "
            f"0 < session_ttl_hours <= {MAX_SESSION_TTL_HOURS} (100 years), got {value!r}"
        )
    return float(value)


def validate_archive_pruned(value: object) -> bool:
    """``archive_pruned`` must be a bool (a truthy string would silently mean yes)."""
    if not isinstance(value, bool):
        raise ValueError(f"archive_pruned must be True or False, got {value!r}")
    return value


def validate_sweep_limit(limit: object) -> int | None:
    """``sweep(limit)``: None (everything expired) or a positive int."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None (no limit), got {limit!r}")
    return limit
