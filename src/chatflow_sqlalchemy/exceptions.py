"""Errors raised by chatflow-sqlalchemy, all a :class:`ChatflowStoreError` (a ``ChatFlowError``).

Each message says what happened and what to do about it.
"""

from __future__ import annotations

import shlex

from chatflow_agent.exceptions import ChatFlowError

__all__ = [
    "BackendImportError", "BackendNotFoundError", "ChatflowStoreError", "CipherError",
    "ClaimLostError", "CorruptRowError", "DatabaseURLError", "DatabaseUnavailableError",
    "DuplicateBackendError", "LeaseLostError", "MigrationPluginError", "MissingKeyError",
    "SchemaAheadError", "SchemaError", "SessionDeletedError",
]


class ChatflowStoreError(ChatFlowError):
    """Base class of every error raised by chatflow-sqlalchemy."""


class SessionDeletedError(ChatflowStoreError):
    """A live session context was used after ``delete`` or ``clear`` removed its session.

    In this process or another one: fetch a fresh context with
    ``store.get_or_create`` to start over.
    """

    def __init__(self, session_id: str) -> None:
        super().__init__(
            f"session {session_id!r} was deleted; call store.get_or_create({session_id!r}, ...) "
            "to start a new conversation"
        )
        self.session_id = session_id


class DatabaseURLError(ChatflowStoreError, ValueError):
    """A database URL (or a store's path) is refused before anything is created.

    The message gives the URL to write instead.
    """


class BackendNotFoundError(ChatflowStoreError, LookupError):
    """No installed backend handles the requested database dialect."""

    def __init__(self, name: str, installed: list[str], fix: str | None = None) -> None:
        listing = ", ".join(sorted(installed)) or "none"
        fix = fix or (
            "no known plugin provides it; use a URL of an installed backend, or write a "
            "plugin (see the plugin authors' guide)"
        )
        super().__init__(
            f"no chatflow-sqlalchemy backend for {name!r} databases (installed: {listing}); "
            f"{fix}"
        )
        self.name = name
        self.installed = sorted(installed)


class BackendImportError(ChatflowStoreError, ImportError):
    """A backend is registered but its module (or its driver) cannot be imported."""


class DuplicateBackendError(ChatflowStoreError):
    """Two installed distributions register the same backend name."""


class SchemaError(ChatflowStoreError):
    """The database schema does not match what this version of the code expects."""

    def __init__(self, message: str, *, found: str | None, expected: str) -> None:
        super().__init__(message)
        self.found = found
        self.expected = expected


class SchemaAheadError(SchemaError):
    """The database was migrated by a newer chatflow-sqlalchemy than this one."""


class CorruptRowError(ChatflowStoreError):
    """A stored row cannot be decoded; the message names its table, session and row id.

    ``table`` is ``chatflow_messages`` (``row_id``: the message's id),
    ``chatflow_message_archive`` (an archived message) or ``chatflow_sessions``
    (``row_id`` None: the session id is its key); ``reason`` says what is wrong.
    """

    def __init__(
        self, session_id: str, row_id: object, reason: str, *, table: str = "chatflow_messages"
    ) -> None:
        where = f"session {session_id!r}" + ("" if row_id is None else f", id {row_id}")
        super().__init__(
            f"corrupt row in {table} ({where}): {reason}; "
            f"inspect it with: chatflow-sqlalchemy sessions show {shlex.quote(session_id)}"
        )
        self.session_id = session_id
        self.row_id = row_id
        self.table = table
        self.reason = reason


class CipherError(ChatflowStoreError):
    """A token cannot be decrypted (unknown key id, wrong key, tampered or truncated)."""


class MissingKeyError(CorruptRowError):
    """A row is encrypted with a key (``key_id``) the reader does not hold: locked, not corrupt.

    A :class:`CorruptRowError`, so existing handlers still catch it.
    """

    def __init__(
        self, session_id: str, row_id: object, key_id: str, *, table: str = "chatflow_messages"
    ) -> None:
        where = f"session {session_id!r}" + ("" if row_id is None else f", id {row_id}")
        reason = f"encrypted with key {key_id!r}, not in CHATFLOW_KEYS"
        super().__init__(session_id, row_id, reason, table=table)
        self.key_id = key_id
        self.args = (
            f"a row in {table} ({where}) is {reason}: add that key to CHATFLOW_KEYS "
            f"('{key_id}:<base64 key>', after the primary) and open the store with "
            "cipher=AESGCMCipher.from_env()",
        )


class DatabaseUnavailableError(ChatflowStoreError):
    """The database cannot be reached or refused the credentials (the password is never shown)."""


class LeaseLostError(ChatflowStoreError):
    """A turn's lease on its session was lost before the turn was written.

    It expired, was taken over, or went with its session (``delete``,
    ``erase_user``). Nothing of the turn was written; run it again if it is
    still wanted.
    """

    session_id: str | None

    def __init__(
        self, session_id: str, reason: str = "it expired, was taken over or was deleted"
    ) -> None:
        super().__init__(
            f"the turn's lease on session {session_id!r} was lost ({reason}); nothing of the "
            "turn was written: run it again, or raise turn_lease_seconds if turns outlive it"
        )
        self.session_id = session_id


class ClaimLostError(LeaseLostError):
    """A webhook claim's lease was lost before its work committed (nothing was written).

    Another worker now owns the delivery, or the claim went with its deleted
    session: answer the platform without a reply.
    """

    def __init__(
        self, message_id: str, reason: str = "its lease was taken over or its session deleted"
    ) -> None:
        ChatflowStoreError.__init__(
            self,
            f"webhook claim {message_id!r} is no longer held ({reason}); the turn was not "
            "written: another delivery of this id now processes it, so do not reply"
        )
        self.message_id = message_id
        self.session_id = None


class MigrationPluginError(ChatflowStoreError):
    """A plugin's migration chain cannot be used (nothing is migrated); names the plugin."""
