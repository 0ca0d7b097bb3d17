"""Encryption at rest in the SQL stores: what is sealed, how rows are opened, key rotation.

Sealed with the store's ``cipher``, each with the session id as associated
data: message and archive ``message_json``, session ``metadata_json``
(stored as ``{"_enc": "<token>"}`` so the column stays a JSON object) and
``summary``, and the inbox's text, payload and reply. Ids, ``seq``, roles,
timestamps, versions and claims stay in clear; the readable ``content`` copy
is NULL for sealed rows. Every token names its key id.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Select, and_, not_, or_, select, update

from chatflow_sqlalchemy import tables
from chatflow_sqlalchemy.crypto import TOKEN_PREFIX, AESGCMCipher, is_encrypted, token_key_id

if TYPE_CHECKING:
    from chatflow_agent import Message

# The errors are imported where they are raised: they load chatflow-agent, which
# reading a sealed row (the CLI's read commands) does not need.

__all__ = ["ROTATE_BATCH", "Sealer", "rotate_batch"]

ROTATE_BATCH = 200
"""Rows re-encrypted per transaction by ``keys rotate``."""

_SEALED_KEY = "_enc"
_sessions = tables.sessions
_messages = tables.messages
_archive = tables.message_archive
_inbox = tables.inbox
_ROTATE = "encrypt it with chatflow-sqlalchemy keys rotate"


def _corrupt(session_id: str, row_id: object, reason: str, table: str) -> Exception:
    from chatflow_sqlalchemy.exceptions import CorruptRowError

    return CorruptRowError(session_id, row_id, reason, table=table)


class Sealer:
    """Seals and opens one store's rows with its cipher (or passes them through).

    Args:
        cipher: The cipher, or None (plaintext rows).
        require_encryption: Refuse a plaintext row with ``CorruptRowError``.

    """

    def __init__(self, cipher: AESGCMCipher | None, require_encryption: bool) -> None:
        self.cipher = cipher
        self.require = require_encryption

    @property
    def active(self) -> bool:
        """True if this store seals what it writes."""
        return self.cipher is not None

    def seal_text(self, session_id: str, text: str) -> str:
        """``message_json`` as stored."""
        return text if self.cipher is None else self.cipher.encrypt(text, session_id)

    def seal_metadata(self, session_id: str, metadata: dict[str, Any]) -> dict[str, Any]:
        """``metadata_json`` as stored: sealed whatever it holds (``keys rotate`` seals a null)."""
        if self.cipher is None:
            return metadata
        text = json.dumps(metadata, sort_keys=True, separators=(",", ":"), allow_nan=False)
        return {_SEALED_KEY: self.cipher.encrypt(text, session_id)}

    def open_text(self, session_id: str, row_id: object, text: str, table: str) -> str:
        """A stored ``message_json`` in clear; plaintext is refused when encryption is required."""
        if not is_encrypted(text):
            if self.require:
                raise _corrupt(session_id, row_id, "plaintext row while "
                               f"require_encryption=True ({_ROTATE})", table)
            return text
        key_id = token_key_id(text)
        if key_id is not None and (self.cipher is None or key_id not in self.cipher.key_ids):
            from chatflow_sqlalchemy.exceptions import MissingKeyError

            raise MissingKeyError(session_id, row_id, key_id, table=table)
        if self.cipher is None:
            raise _corrupt(session_id, row_id, "malformed encrypted value", table)
        try:
            return self.cipher.decrypt(text, session_id)
        except Exception as exc:  # a CipherError (imported only once one is raised)
            from chatflow_sqlalchemy.exceptions import CipherError

            if not isinstance(exc, CipherError):
                raise
            raise _corrupt(session_id, row_id, str(exc), table) from exc

    def open_summary(self, session_id: str, stored: str | None) -> str | None:
        """A stored ``chatflow_sessions.summary`` in clear (None: the session has none)."""
        return None if stored is None else self.open_text(
            session_id, None, stored, _sessions.name
        )

    def seal_json(self, session_id: str, value: Any) -> Any:
        """A JSON document as stored (an inbox message's ``payload``); None stays None."""
        return value if value is None else self.seal_metadata(session_id, value)

    def open_json(
        self, session_id: str, row_id: object, stored: Any, table: str, what: str = "JSON",
        *, nullable: bool = True,
    ) -> Any:
        """A document :meth:`seal_json` stored, in clear (None stays None if ``nullable``)."""
        if isinstance(stored, dict) and set(stored) == {_SEALED_KEY}:
            text = self.open_text(session_id, row_id, stored[_SEALED_KEY], table)
            try:
                return json.loads(text)
            except ValueError as exc:
                raise _corrupt(session_id, row_id, f"sealed {what} is not JSON ({exc})",
                               table) from exc
        if self.require and (stored is not None or not nullable):
            raise _corrupt(session_id, row_id, f"plaintext {what} while "
                           f"require_encryption=True ({_ROTATE})", table)
        return stored

    def open_metadata(self, session_id: str, stored: Any) -> Any:
        """A stored ``metadata_json`` in clear (a dict, or what was stored if not one)."""
        return self.open_json(session_id, None, stored, _sessions.name, "metadata", nullable=False)

    def parser(self, parse: Callable[[str, object, str], Message]) -> Callable[..., Message]:
        """``parse`` (the store's row decoder) opening each message row first."""
        def parse_sealed(session_id: str, row_id: object, text: str) -> Message:
            return parse(session_id, row_id, self.open_text(
                session_id, row_id, text, "chatflow_messages"
            ))
        return parse_sealed


def _stale(column: Any, primary: str) -> Any:
    """Rows not yet sealed with the primary key (plaintext or an older key)."""
    return not_(column.startswith(f"{TOKEN_PREFIX}{primary}:", autoescape=True))


def _reseal(cipher: AESGCMCipher, text: str, session_id: str) -> str:
    """``text`` (plaintext or sealed with any key) sealed with the primary key."""
    if is_encrypted(text):
        text = cipher.decrypt(text, session_id)
    return cipher.encrypt(text, session_id)


def rotate_batch(
    conn: Connection,
    cipher: AESGCMCipher,
    cursor: dict[str, str],
    batch: int,
    lock: Callable[[Select[Any], Connection], Select[Any]],
) -> tuple[int, bool]:
    """Re-seal up to ``batch`` rows of each table with the primary key (plaintext rows too).

    Returns ``(rows rewritten, whether more rows may remain)``. Runs in the
    caller's write transaction; ``lock`` is the dialect's ``lock_batch`` (so
    concurrent rotations skip each other's rows). Turns only insert or delete
    message rows, so each is rewritten by id; a session row only if its
    ``version`` is still the one read, so a concurrent turn's metadata or
    summary is never overwritten. ``cursor`` carries the last session looked
    at from batch to batch.
    """
    done, more = 0, False
    for table in (_messages, _archive):
        rows = conn.execute(lock(
            select(table.c.id, table.c.session_id, table.c.message_json)
            .where(_stale(table.c.message_json, cipher.primary))
            .order_by(table.c.id)
            .limit(batch),
            conn,
        )).all()
        for row in rows:
            sealed = _reseal(cipher, row.message_json, row.session_id)
            conn.execute(
                update(table).where(table.c.id == row.id).values(message_json=sealed, content=None)
            )
        done += len(rows)
        more = more or len(rows) == batch
    inbox_done = _rotate_inbox(conn, cipher, batch, lock)
    rewritten, scanned = _rotate_sessions(conn, cipher, batch, cursor)
    return done + inbox_done + rewritten, more or inbox_done == batch or scanned == batch


def _rotate_inbox(
    conn: Connection,
    cipher: AESGCMCipher,
    batch: int,
    lock: Callable[[Select[Any], Connection], Select[Any]],
) -> int:
    """Re-seal inbox rows' text, payload and reply; a row only if its reply is unchanged.

    Workers write a row's reply and state; its text and payload never change.
    """
    sealer = Sealer(cipher, False)
    i = _inbox.c
    rows = conn.execute(lock(
        select(i.id, i.session_id, i.text, i.payload, i.reply)
        .where(or_(_stale(i.text, cipher.primary),
                   and_(i.reply.is_not(None), _stale(i.reply, cipher.primary))))
        .order_by(i.id)
        .limit(batch),
        conn,
    )).all()
    for row in rows:
        payload = sealer.open_json(row.session_id, row.id, row.payload, _inbox.name)
        values = {"text": _reseal(cipher, row.text, row.session_id),
                  "payload": sealer.seal_json(row.session_id, payload)}
        unchanged = i.reply.is_(None)
        if row.reply is not None:
            values["reply"] = _reseal(cipher, row.reply, row.session_id)
            unchanged = i.reply == row.reply
        conn.execute(update(_inbox).where(i.id == row.id, unchanged).values(values))
    return len(rows)


def _rotate_sessions(
    conn: Connection, cipher: AESGCMCipher, batch: int, cursor: dict[str, str]
) -> tuple[int, int]:
    """Re-seal the metadata and summary of up to ``batch`` sessions; (rewritten, looked at)."""
    c = _sessions.c
    query = select(c.session_id, c.version, c.metadata_json, c.summary)
    if "session" in cursor:
        query = query.where(c.session_id > cursor["session"])
    sealer = Sealer(cipher, False)
    primary = f"{TOKEN_PREFIX}{cipher.primary}:"
    done = 0
    rows = conn.execute(query.order_by(c.session_id).limit(batch)).all()
    for row in rows:
        cursor["session"] = sid = row.session_id
        values: dict[str, Any] = {}
        stored = row.metadata_json
        token = stored.get(_SEALED_KEY) if isinstance(stored, dict) else None
        if not (isinstance(token, str) and token.startswith(primary)):
            values["metadata_json"] = sealer.seal_metadata(sid, sealer.open_metadata(sid, stored))
        if row.summary is not None and not row.summary.startswith(primary):
            values["summary"] = sealer.seal_text(sid, sealer.open_summary(sid, row.summary) or "")
        if values:
            conn.execute(
                update(_sessions)
                .where(and_(c.session_id == sid, c.version == row.version))
                .values(values)
            )
            done += 1
    return done, len(rows)
