"""AES-GCM encryption of stored text, with named keys for rotation.

Every token names its key id (``cfenc:1:<key id>:<base64url(nonce || ciphertext
|| tag)>``); associated data (the session id) is authenticated but not stored,
so a token copied to another session does not decrypt there. ``cryptography``
is an optional extra: building a cipher without it names the extra.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from chatflow_sqlalchemy.values import TOKEN_PREFIX, is_encrypted

if TYPE_CHECKING:  # defined there: importing the errors loads chatflow-agent, reading does not
    from chatflow_sqlalchemy.exceptions import CipherError, MissingKeyError

__all__ = [
    "CRYPTO_INSTALL_HINT", "KEYS_ENV_VAR", "TOKEN_PREFIX", "AESGCMCipher", "CipherError",
    "MissingKeyError", "is_encrypted", "token_key_id",
]

CRYPTO_INSTALL_HINT = "pip install 'chatflow-sqlalchemy[crypto]'"
KEYS_ENV_VAR = "CHATFLOW_KEYS"

_KEY_ID = re.compile(r"^[A-Za-z0-9_.\-]{1,32}$")
_NONCE_BYTES = 12
_KEY_SIZES = (16, 24, 32)


def token_key_id(text: str) -> str | None:
    """The key id named by a token, None for plaintext."""
    if not is_encrypted(text):
        return None
    key_id, sep, _ = text[len(TOKEN_PREFIX) :].partition(":")
    return key_id if sep else None


def __getattr__(name: str) -> Any:
    """``CipherError`` and ``MissingKeyError``, still importable from here (PEP 562)."""
    if name in ("CipherError", "MissingKeyError"):
        from chatflow_sqlalchemy import exceptions

        return getattr(exceptions, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _cipher_error(message: str) -> CipherError:
    from chatflow_sqlalchemy.exceptions import CipherError

    return CipherError(message)


class AESGCMCipher:
    """AES-GCM with several named keys: encrypts with ``primary``, decrypts with any.

    Args:
        keys: Key id -> key bytes (16, 24 or 32 bytes). Ids: 1-32 of
            ``A-Z a-z 0-9 _ . -``.
        primary: The id of the key new values are encrypted with.

    Raises:
        ValueError: A bad key id, key length, or a ``primary`` not in ``keys``.
        ImportError: ``cryptography`` is not installed (names the extra).

    """

    def __init__(self, keys: Mapping[str, bytes], primary: str) -> None:
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError as exc:
            raise ImportError(
                f"encryption needs the 'cryptography' package: {CRYPTO_INSTALL_HINT} ({exc})"
            ) from exc
        if not keys:
            raise ValueError("keys must hold at least one key id -> key bytes")
        for key_id, key in keys.items():
            if not isinstance(key_id, str) or not _KEY_ID.match(key_id):
                raise ValueError(
                    f"key id {key_id!r} must be 1-32 characters of A-Z a-z 0-9 _ . -"
                )
            if not isinstance(key, (bytes, bytearray)) or len(key) not in _KEY_SIZES:
                size = len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__
                raise ValueError(
                    f"key {key_id!r} must be 16, 24 or 32 bytes (AES-128/192/256), got {size}; "
                    "make one with os.urandom(32)"
                )
        if primary not in keys:
            raise ValueError(f"primary {primary!r} is not one of the key ids {sorted(keys)}")
        self.primary = primary
        self._ciphers = {key_id: AESGCM(bytes(key)) for key_id, key in keys.items()}

    @property
    def key_ids(self) -> frozenset[str]:
        """Every key id this cipher can decrypt with."""
        return frozenset(self._ciphers)

    def encrypt(self, plaintext: str, associated_data: str = "") -> str:
        """Encrypt ``plaintext`` with the primary key; return a token naming that key."""
        nonce = os.urandom(_NONCE_BYTES)
        sealed = self._ciphers[self.primary].encrypt(
            nonce, plaintext.encode("utf-8"), associated_data.encode("utf-8")
        )
        payload = base64.urlsafe_b64encode(nonce + sealed).decode("ascii")
        return f"{TOKEN_PREFIX}{self.primary}:{payload}"

    def decrypt(self, token: str, associated_data: str = "") -> str:
        """Decrypt a token with the key it names.

        Raises:
            CipherError: Not a token, an unknown key id, or a token that fails
                authentication (wrong key, tampered, or other associated data).

        """
        key_id = token_key_id(token)
        if key_id is None:
            raise _cipher_error("not an encrypted value (no 'cfenc:1:<key id>:' prefix)")
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            raise _cipher_error(
                f"encrypted with key {key_id!r}, which this cipher does not hold "
                f"(it has {sorted(self._ciphers)}): add that key to keys= / {KEYS_ENV_VAR}"
            )
        try:
            raw = base64.urlsafe_b64decode(token[len(TOKEN_PREFIX) + len(key_id) + 1 :])
            plain = cipher.decrypt(
                raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], associated_data.encode("utf-8")
            )
        except (binascii.Error, ValueError) as exc:
            raise _cipher_error(f"malformed token for key {key_id!r}: {exc}") from None
        except Exception as exc:  # cryptography's InvalidTag
            raise _cipher_error(
                f"token does not authenticate with key {key_id!r} (wrong key, tampered, or "
                f"moved from another session): {type(exc).__name__}"
            ) from None
        return bytes(plain).decode("utf-8")

    @classmethod
    def from_env(cls, value: str | None = None) -> AESGCMCipher:
        """Build from ``"k2:<base64>,k1:<base64>"`` (default: ``$CHATFLOW_KEYS``); first = primary.

        Raises:
            ValueError: The variable is unset or malformed (says the format).

        """
        text = os.environ.get(KEYS_ENV_VAR, "") if value is None else value
        keys: dict[str, bytes] = {}
        primary = None
        for item in (part.strip() for part in text.split(",") if part.strip()):
            key_id, sep, encoded = item.partition(":")
            try:
                key = base64.b64decode(encoded, validate=True) if sep else b""
            except binascii.Error:
                key = b""
            if not sep or not key:
                raise ValueError(
                    f"{KEYS_ENV_VAR} must be 'id:base64key[,id:base64key...]' (the first is "
                    f"the primary), got an entry for {key_id!r} that is not"
                )
            keys[key_id] = key
            primary = primary or key_id
        if primary is None:
            raise ValueError(f"{KEYS_ENV_VAR} is empty: set it to 'k1:<base64 of 32 bytes>'")
        return cls(keys, primary)

    def __repr__(self) -> str:  # never the key bytes
        return f"<AESGCMCipher primary={self.primary!r} keys={sorted(self._ciphers)}>"
