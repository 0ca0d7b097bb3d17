"""Encryption at rest in the SQL stores: what is sealed, how rows are opened, key rotation.

Sealed with the store's ``cipher`` (an :class:`~chatflow_sqlalchemy.crypto.AESGCMCipher`),
each with the session id as associated data:

* ``chatflow_messages.message_json`` (content, tool calls with their
  arguments, tool results) and the same column of the archive;
* ``chatflow_sessions.metadata_json``, stored as ``{"_enc": "<token>"}`` (the
  column stays a JSON object), and ``chatflow_sessions.summary`` (the summary of
  the turns pruning dropped, see :mod:`~chatflow_sqlalchemy.summaries`);
* the inbox's message text, payload and reply.

In clear: ids (session, message, webhook), ``seq``, ``role``, timestamps,
``version``, ``active_agent_name``, ``user_id``, and the webhook claims
(state, lease, stored reply). The readable ``content`` column copy is left
NULL for sealed rows, so it holds no plaintext. Every token names its key id.

Metadata filters of ``list_sessions`` cannot look inside sealed metadata:
a store with a cipher refuses them with ``ValueError``.
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

__all__ = [
    "ROTATE_BATCH",
    "Sealer",
    "rotate_batch",
]

ROTATE_BATCH = 200
"""Rows re-encrypted per transaction by ``keys rotate``."""

_SEALED_KEY = "_enc"

_sessions = tables.sessions
_messages = tables.messages
_archive = tables.message_archive
_inbox = tables.inbox


class Sealer:
    """Seals and opens one store's rows with its cipher (or passes them through).

    Args:
        cipher: The cipher, or None (plaintext rows).
        require_encryption: Refuse a plaintext row with ``CorruptRowError``.

    Both come checked (:class:`~chatflow_sqlalchemy.options.StoreOptions`).

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
        """``metadata_json`` as stored."""
        if self.cipher is None:
            return metadata
        text = json.dumps(metadata, sort_keys=True, separators=(",", ":"), allow_nan=False)
        return {_SEALED_KEY: self.cipher.encrypt(text, session_id)}

    def open_text(self, session_id: str, row_id: object, text: str, table: str) -> str:
        """A stored ``message_json`` in clear; plaintext is refused when encryption is required."""
        if not is_encrypted(text):
            if self.require:
                from chatflow_sqlalchemy.exceptions import CorruptRowError

                raise CorruptRowError(
                    session_id, row_id,
                    "plaintext row while require_encryption=True (encrypt it with "
                    "chatflow-sqlalchemy keys rotate)", table=table,
                )
            return text
        key_id = token_key_id(text)
        if key_id is not None and (self.cipher is None or key_id not in self.cipher.key_ids):
            from chatflow_sqlalchemy.exceptions import MissingKeyError

            raise MissingKeyError(session_id, row_id, key_id, table=table)
        if self.cipher is None:
            from chatflow_sqlalchemy.exceptions import CorruptRowError

            raise CorruptRowError(session_id, row_id, "malformed encrypted value", table=table)
        try:
            return self.cipher.decrypt(text, session_id)
        except Exception as exc:  # a CipherError (imported only once one is raised)
            from chatflow_sqlalchemy.exceptions import CipherError, CorruptRowError

            if not isinstance(exc, CipherError):
                raise
            raise CorruptRowError(session_id, row_id, str(exc), table=table) from exc

    def open_summary(self, session_id: str, stored: str | None) -> str | None:
        """A stored ``chatflow_sessions.summary`` in clear (None: the session has none)."""
        return None if stored is None else self.open_text(
            session_id, None, stored, _sessions.name
        )

    def seal_json(self, session_id: str, value: Any) -> Any:
        """A JSON document as stored (an inbox message's ``payload``); None stays None."""
        if self.cipher is None or value is None:
            return value
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
        return {_SEALED_KEY: self.cipher.encrypt(text, session_id)}

    def open_json(self, session_id: str, row_id: object, stored: Any, table: str) -> Any:
        """A document :meth:`seal_json` stored, in clear."""
        if isinstance(stored, dict) and set(stored) == {_SEALED_KEY}:
            text = self.open_text(session_id, row_id, stored[_SEALED_KEY], table)
            return json.loads(text)
        if self.require and stored is not None:
            from chatflow_sqlalchemy.exceptions import CorruptRowError

            raise CorruptRowError(
                session_id, row_id, "plaintext JSON while require_encryption=True (encrypt "
                "it with chatflow-sqlalchemy keys rotate)", table=table,
            )
        return stored

    def open_metadata(self, session_id: str, stored: Any) -> Any:
        """A stored ``metadata_json`` in clear (a dict, or what was stored if not one)."""
        if isinstance(stored, dict) and set(stored) == {_SEALED_KEY}:
            text = self.open_text(session_id, None, stored[_SEALED_KEY], "chatflow_sessions")
            try:
                return json.loads(text)
            except ValueError as exc:
                from chatflow_sqlalchemy.exceptions import CorruptRowError

                raise CorruptRowError(
                    session_id, None, f"sealed metadata is not JSON ({exc})",
                    table="chatflow_sessions",
                ) from exc
        if self.require:
            from chatflow_sqlalchemy.exceptions import CorruptRowError

            raise CorruptRowError(
                session_id, None, "plaintext metadata while require_encryption=True (encrypt "
                "it with chatflow-sqlalchemy keys rotate)", table="chatflow_sessions",
            )
        return stored

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


def rotate_batch(
    conn: Connection,
    cipher: AESGCMCipher,
    cursor: dict[str, str],
    batch: int,
    lock: Callable[[Select[Any], Connection], Select[Any]],
) -> tuple[int, bool]:
    """Re-seal up to ``batch`` rows of each table with the primary key.

    Returns ``(rows rewritten, whether more rows may remain)``. ``lock`` is
    the dialect's :meth:`~chatflow_sqlalchemy.dialect.DialectSupport.lock_batch`
    (concurrent rotations skip each other's rows where the server can).

    Runs in the caller's (write) transaction. Message and archive rows are
    never updated by turns (only inserted or deleted), so each is rewritten
    by id; a session's metadata and summary are rewritten only if its
    ``version`` is still the one read (every write of either bumps it), so a
    concurrent turn's are never overwritten. Plaintext rows are sealed too
    (this is how an existing database is encrypted). ``cursor`` carries the
    last session id whose row was looked at, from batch to batch of one rotation.
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
            text = row.message_json
            if is_encrypted(text):
                text = cipher.decrypt(text, row.session_id)
            sealed = cipher.encrypt(text, row.session_id)
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
    """Re-seal inbox messages' text, payload and reply, each row only if its reply is unchanged.

    Workers write a row's reply and state; its text and payload never change.
    """
    sealer = Sealer(cipher, False)
    rows = conn.execute(lock(
        select(_inbox.c.id, _inbox.c.session_id, _inbox.c.text, _inbox.c.payload,
               _inbox.c.reply)
        .where(or_(_stale(_inbox.c.text, cipher.primary),
                   and_(_inbox.c.reply.is_not(None), _stale(_inbox.c.reply, cipher.primary))))
        .order_by(_inbox.c.id)
        .limit(batch),
        conn,
    )).all()
    for row in rows:
        def reseal(text: str, session_id: str = row.session_id) -> str:
            if is_encrypted(text):
                text = cipher.decrypt(text, session_id)
            return cipher.encrypt(text, session_id)

        payload = sealer.open_json(row.session_id, row.id, row.payload, _inbox.name)
        values = {"text": reseal(row.text), "payload": sealer.seal_json(row.session_id, payload)}
        unchanged = _inbox.c.reply.is_(None)
        if row.reply is not None:
            values["reply"] = reseal(row.reply)
            unchanged = _inbox.c.reply == row.reply
        conn.execute(update(_inbox).where(_inbox.c.id == row.id, unchanged).values(values))
    return len(rows)


def _rotate_sessions(
    conn: Connection, cipher: AESGCMCipher, batch: int, cursor: dict[str, str]
) -> tuple[int, int]:
    """Re-seal the metadata and summary of up to ``batch`` sessions; (rewritten, looked at)."""
    query = (
        select(_sessions.c.session_id, _sessions.c.version, _sessions.c.metadata_json,
               _sessions.c.summary)
        .order_by(_sessions.c.session_id)
        .limit(batch)
    )
    if "session" in cursor:
        query = query.where(_sessions.c.session_id > cursor["session"])
    done = 0
    rows = conn.execute(query).all()
    for row in rows:
        cursor["session"] = row.session_id
        values = _resealed_session(Sealer(cipher, False), row)
        if not values:
            continue
        conn.execute(
            update(_sessions)
            .where(and_(_sessions.c.session_id == row.session_id,
                        _sessions.c.version == row.version))
            .values(values)
        )
        done += 1
    return done, len(rows)


def _resealed_session(sealer: Sealer, row: Any) -> dict[str, Any]:
    """The session row's values not sealed with the primary key, sealed with it."""
    cipher = sealer.cipher
    assert cipher is not None
    primary = f"{TOKEN_PREFIX}{cipher.primary}:"
    values: dict[str, Any] = {}
    stored = row.metadata_json
    token = stored.get(_SEALED_KEY) if isinstance(stored, dict) else None
    if not (isinstance(token, str) and token.startswith(primary)):
        metadata = sealer.open_metadata(row.session_id, stored)
        values["metadata_json"] = sealer.seal_metadata(row.session_id, metadata)
    summary = row.summary
    if summary is not None and not summary.startswith(primary):
        opened = sealer.open_text(row.session_id, None, summary, _sessions.name)
        values["summary"] = sealer.seal_text(row.session_id, opened)
    return values
