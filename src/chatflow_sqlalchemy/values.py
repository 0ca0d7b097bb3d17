"""Values the tables hold that code outside SQL needs too, without SQLAlchemy.

The id length limit, the claim states, the UTC clock and the rules for text
and page sizes every backend can store are shared by the SQL stores
(``models.py`` builds the tables with them) and the in-memory store, which
must run without importing SQLAlchemy.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

__all__ = [
    "CLAIM_ACQUIRED",
    "CLAIM_DONE",
    "CLAIM_RELEASED",
    "DEFAULT_TURN_LEASE_SECONDS",
    "MAX_PAGE_LIMIT",
    "SESSION_ID_MAX_LENGTH",
    "TURN_LEASE_BOUNDS",
    "UNBORN_AGENT",
    "Lease",
    "check_storable_text",
    "utcnow",
    "validate_page_limit",
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
"""Largest row limit sent to a database (the largest a signed ``INTEGER`` holds,
which every backend's ``LIMIT`` takes); a larger ``limit`` asks for every row, and
is clamped to this."""


def check_storable_text(value: str, name: str) -> None:
    """Raise ``ValueError`` naming ``name`` if ``value`` is text a column cannot hold.

    Refused on every backend alike: the NUL character (PostgreSQL's text
    types cannot hold it) and lone surrogates (a half of a UTF-16 pair
    alone: not UTF-8, so no driver can send them).
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
    """Return ``limit`` (None: no limit) clamped to ``MAX_PAGE_LIMIT``, else raise ``ValueError``.

    A limit larger than any database's ``LIMIT`` means "every row", which is
    what the clamped limit returns; the same on every backend.
    """
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"{name} must be a positive int or None (no limit), got {limit!r}")
    return min(limit, MAX_PAGE_LIMIT)


UNBORN_AGENT = ""
"""The agent name of a session the inbox created for its lease before any turn: the first
``get_or_create`` gives it the caller's agent; until then ``get`` and ``list_sessions``
do not show it."""

DEFAULT_TURN_LEASE_SECONDS = 30.0
"""How long a turn's lease on its session lasts without renewal (store option)."""


TURN_LEASE_BOUNDS = (0.5, 86400.0)
"""Shortest and longest accepted ``turn_lease_seconds``: renewed every third of it, a
shorter lease would be mostly renewals; a longer one blocks a dead worker's session
for more than a day."""


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
        kept: An inbox batch holds it beyond its turns: a turn's write checks
            it and keeps it, and only the batch gives it back.

    """

    session_id: str
    owner: str
    fence: int
    version: int
    released: bool = False
    kept: bool = False
