"""Values and rules the SQL stores and the in-memory store share (no SQLAlchemy imported)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

__all__ = [
    "CLAIM_ACQUIRED",
    "CLAIM_DONE",
    "CLAIM_RELEASED",
    "DEAD",
    "DEFAULT_DEDUP_TTL_HOURS",
    "DEFAULT_TURN_LEASE_SECONDS",
    "DONE",
    "INBOX_STATES",
    "IN_FLIGHT",
    "MAX_PAGE_LIMIT",
    "METADATA_MAX_DEPTH",
    "PENDING",
    "SENT",
    "SESSION_ID_MAX_LENGTH",
    "TOKEN_PREFIX",
    "TURN_LEASE_BOUNDS",
    "UNBORN_AGENT",
    "InboxEntry",
    "InboxStats",
    "Lease",
    "check_metadata",
    "check_storable_text",
    "dump_metadata",
    "is_encrypted",
    "utcnow",
    "validate_id",
    "validate_page_limit",
    "validate_session_id",
    "validate_turn_lease_seconds",
]

SESSION_ID_MAX_LENGTH = 255
"""Longest accepted session id / message id (an index-friendly VARCHAR on every dialect)."""

CLAIM_ACQUIRED = "acquired"
"""Claim state: a worker holds the id under a lease (``token``, ``lease_expires_at``)."""
CLAIM_DONE = "done"
"""Claim state: processed (also every id recorded by ``record_processed_message``)."""
CLAIM_RELEASED = "released"
"""Claim state: the block failed (or an operator freed it); the next delivery acquires it."""


def utcnow() -> datetime:
    """Return the current time as a timezone-aware UTC datetime."""
    return datetime.now(timezone.utc)


MAX_PAGE_LIMIT = 2**31 - 1
"""Largest row limit sent to a database (a signed ``INTEGER``); larger limits are clamped."""


def check_storable_text(value: str, name: str) -> None:
    """Raise ``ValueError`` naming ``name`` if ``value`` holds NUL or a lone surrogate.

    Refused on every backend alike: PostgreSQL cannot store NUL, and no driver can send
    a lone surrogate.
    """
    if "\x00" in value:
        raise ValueError(
            f"{name} must not contain the NUL character ('\\x00'): remove it first "
            "(e.g. value.replace('\\x00', ''))"
        )
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                f"{name} must be UTF-8 text, but holds a lone surrogate ('\\ud800'-'\\udfff'): "
                "decode the bytes it came from properly (bytes.decode('utf-8'))"
            ) from None


def validate_page_limit(limit: object, name: str = "limit") -> int | None:
    """``limit`` (None: no limit) clamped to ``MAX_PAGE_LIMIT``; ``ValueError`` if invalid."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"{name} must be a positive int or None (no limit), got {limit!r}")
    return min(limit, MAX_PAGE_LIMIT)


DEFAULT_DEDUP_TTL_HOURS = 192
"""Dedup window: 8 days, beyond WhatsApp's 7-day webhook retry window."""

TOKEN_PREFIX = "cfenc:1:"
"""Every encrypted value starts with it (then the key id, a colon and the payload)."""


def is_encrypted(text: object) -> bool:
    """True if ``text`` is a token written by :class:`~chatflow_sqlalchemy.crypto.AESGCMCipher`."""
    return isinstance(text, str) and text.startswith(TOKEN_PREFIX)


UNBORN_AGENT = ""
"""The agent name of a session with no agent yet (made for a lease, or its first turn
failed): ``get`` and ``list_sessions`` do not show it until it gets one."""

DEFAULT_TURN_LEASE_SECONDS = 30.0
"""How long a turn's lease on its session lasts without renewal (store option)."""


TURN_LEASE_BOUNDS = (0.5, 86400.0)
"""Shortest and longest accepted ``turn_lease_seconds`` (renewals; a dead worker's block)."""


def validate_turn_lease_seconds(value: object) -> float:
    """``turn_lease_seconds`` must be a number of seconds within :data:`TURN_LEASE_BOUNDS`."""
    low, high = TURN_LEASE_BOUNDS
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ValueError(
            f"turn_lease_seconds must be a number of seconds from {low:g} to {high:g} "
            f"(how long a dead worker's session stays blocked), got {value!r}"
        )
    return float(value)


@dataclass
class Lease:
    """A turn's hold on its session, as the take statement returned it.

    Attributes:
        session_id: The session.
        owner: This take's random token (the row's ``lease_owner``).
        fence: The session's fencing counter after this take.
        version: The session's version when the lease was taken.
        released: The turn's write gave the lease back.
        kept: An inbox batch holds it beyond its turns; only the batch gives it back.
        shared: The batch's ``handle`` runs: other tasks' turns on the session use it.

    """

    session_id: str
    owner: str
    fence: int
    version: int
    released: bool = False
    kept: bool = False
    shared: bool = False


def validate_id(value: object, name: str) -> str:
    """Return ``value`` if it is a usable id (or agent name), else raise ``ValueError``.

    A non-empty str of at most ``SESSION_ID_MAX_LENGTH`` storable characters.
    """
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a str, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must be a non-empty string")
    if len(value) > SESSION_ID_MAX_LENGTH:
        raise ValueError(f"{name} is {len(value)} characters; the limit is {SESSION_ID_MAX_LENGTH}")
    check_storable_text(value, name)
    return value


def validate_session_id(session_id: object) -> str:
    """Return ``session_id`` if it is a usable id, else raise ``ValueError`` naming it."""
    return validate_id(session_id, "session_id")


_ESCAPED_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
"""An escaped NUL in JSON text (not an escaped backslash followed by ``u0000``)."""


METADATA_MAX_DEPTH = 31
"""Deepest nesting of dicts and lists accepted in metadata (MariaDB's JSON limit)."""


def _check_shape(value: object, max_depth: int, depth: int = 1) -> None:
    """Refuse non-str dict keys (JSON would turn them into strings) and over-deep nesting."""
    if isinstance(value, dict):
        children: Iterable[object] = value.values()
        for key in value:
            if not isinstance(key, str):
                raise TypeError(
                    f"metadata keys must be str, got {key!r} ({type(key).__name__}): JSON "
                    f"would read it back as a str; use str keys (e.g. str({key!r}))"
                )
    elif isinstance(value, (list, tuple)):
        children = value
    else:
        return
    if depth > max_depth:
        raise ValueError(
            f"metadata is nested more than {max_depth} dicts/lists deep (or holds "
            "itself): flatten it, or store the deep part as a JSON string"
        )
    for child in children:
        _check_shape(child, max_depth, depth + 1)


def _depth(value: object) -> int:
    """How many dicts/lists deep decoded JSON ``value`` is nested."""
    if isinstance(value, dict):
        value = list(value.values())
    if not isinstance(value, list):
        return 0
    return 1 + max((_depth(child) for child in value), default=0)


def check_metadata(metadata: object, *, stored_json: str | None = None) -> str:
    """:func:`dump_metadata` of new metadata, refusing also what JSON would not keep.

    Refuses nesting deeper than ``METADATA_MAX_DEPTH`` (``ValueError``, unless
    ``stored_json`` was already as deep) and non-str keys (``TypeError``).
    """
    try:
        _check_shape(metadata, METADATA_MAX_DEPTH)
    except ValueError:
        stored_depth = _depth(json.loads(stored_json)) if stored_json else 0
        if stored_depth <= METADATA_MAX_DEPTH:
            raise
        _check_shape(metadata, stored_depth)
    return dump_metadata(metadata)


_METADATA_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False)
"""What ``json.dumps`` with these options builds on every call (it keeps no state)."""


def dump_metadata(metadata: object) -> str:
    """Serialise metadata to canonical JSON, or raise ``ValueError``.

    NaN, infinities, NUL and lone surrogates are refused on every backend alike.
    """
    try:
        text = _METADATA_ENCODER.encode(metadata)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"metadata must be JSON-serialisable: {exc}") from None
    if "\\ud" in text:  # a surrogate escape: fine in a pair, not alone (not UTF-8 text)
        try:
            json.dumps(metadata, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                "metadata must not contain a lone surrogate ('\\ud800'-'\\udfff') in a key "
                "or string value (it is not UTF-8 text): decode the bytes it came from properly"
            ) from None
    if "\\u0000" in text and _ESCAPED_NUL.search(text):
        raise ValueError(
            "metadata must not contain the NUL character ('\\x00') in a key or string value "
            "(PostgreSQL cannot store it in JSON): remove it or encode the value first"
        )
    return text


# ------------------------------------------------------------ the inbox, as operators read it

PENDING, IN_FLIGHT, DONE, SENT, DEAD = "pending", "in_flight", "done", "sent", "dead"
INBOX_STATES = (PENDING, IN_FLIGHT, DONE, SENT, DEAD)
"""Every state an inbox message can be in, in the order it goes through them."""


@dataclass(frozen=True)
class InboxEntry:
    """One inbox message as operators see it (``inbox list``).

    Attributes:
        message_id: The platform's id.
        session_id: Its session.
        state: One of :data:`INBOX_STATES`.
        attempts: Batches that took it.
        received_at: When it was stored.
        updated_at: Its last change of state.
        sent_at: The platform's timestamp, if given.
        error: Why its last attempt failed, if it did.

    """

    message_id: str
    session_id: str
    state: str
    attempts: int
    received_at: datetime
    updated_at: datetime
    sent_at: datetime | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (times as ISO 8601)."""
        fields = asdict(self)
        for name in ("received_at", "updated_at", "sent_at"):
            fields[name] = None if fields[name] is None else fields[name].isoformat()
        return fields


@dataclass(frozen=True)
class InboxStats:
    """Counts for operators (``inbox stats``).

    Attributes:
        counts: Messages per state (every state present, zero included).
        oldest_pending_seconds: Age of the oldest pending message, None if none.
        dead_last_hour: Messages that died in the last hour.

    """

    counts: dict[str, int]
    oldest_pending_seconds: float | None
    dead_last_hour: int

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return asdict(self)
