"""Values the tables hold that code outside SQL needs too, without SQLAlchemy.

The id length limit, the claim states and the UTC clock are shared by the
SQL stores (``models.py`` builds the tables with them) and the in-memory
store, which must run without importing SQLAlchemy.
"""

from __future__ import annotations

from datetime import datetime, timezone

__all__ = [
    "CLAIM_ACQUIRED",
    "CLAIM_DONE",
    "CLAIM_RELEASED",
    "SESSION_ID_MAX_LENGTH",
    "utcnow",
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
