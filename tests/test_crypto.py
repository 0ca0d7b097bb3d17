"""``chatflow_sqlalchemy.crypto.AESGCMCipher``: tokens, key ids, rotation, refusals."""

from __future__ import annotations

import base64
import os
import subprocess
import sys

import pytest

from chatflow_sqlalchemy.crypto import (
    TOKEN_PREFIX,
    AESGCMCipher,
    CipherError,
    is_encrypted,
    token_key_id,
)


def test_round_trip_names_the_key_and_hides_the_text() -> None:
    cipher = AESGCMCipher(keys={"k1": os.urandom(32)}, primary="k1")
    token = cipher.encrypt("olá, pedido 5 \x00 ✓", "session-1")
    assert token.startswith(f"{TOKEN_PREFIX}k1:") and "pedido" not in token
    assert token_key_id(token) == "k1" and is_encrypted(token)
    assert cipher.decrypt(token, "session-1") == "olá, pedido 5 \x00 ✓"
    assert cipher.encrypt("same", "s") != cipher.encrypt("same", "s"), "fresh nonce each time"
    assert not is_encrypted('{"role": "user"}') and token_key_id("plain") is None


def test_old_keys_still_decrypt_and_the_primary_encrypts() -> None:
    old, new = os.urandom(32), os.urandom(16)
    before = AESGCMCipher(keys={"k1": old}, primary="k1").encrypt("hello", "s")
    rotated = AESGCMCipher(keys={"k2": new, "k1": old}, primary="k2")
    assert rotated.decrypt(before, "s") == "hello"
    assert token_key_id(rotated.encrypt("hello", "s")) == "k2"
    with pytest.raises(CipherError, match="does not hold"):
        AESGCMCipher(keys={"k2": new}, primary="k2").decrypt(before, "s")


def test_tampering_wrong_key_or_other_session_is_refused() -> None:
    cipher = AESGCMCipher(keys={"k1": os.urandom(32)}, primary="k1")
    token = cipher.encrypt("secret", "s1")
    with pytest.raises(CipherError, match="moved from another session"):
        cipher.decrypt(token, "s2")
    flipped = token[:-2] + ("A" if token[-2] != "A" else "B") + token[-1]
    with pytest.raises(CipherError):
        cipher.decrypt(flipped, "s1")
    impostor = AESGCMCipher(keys={"k1": os.urandom(32)}, primary="k1")
    with pytest.raises(CipherError, match="does not authenticate"):
        impostor.decrypt(token, "s1")
    with pytest.raises(CipherError, match="not an encrypted value"):
        cipher.decrypt("plain text", "s1")


@pytest.mark.parametrize(
    ("keys", "primary", "needle"),
    [
        ({}, "k1", "at least one"),
        ({"k1": b"short"}, "k1", "16, 24 or 32 bytes"),
        ({"bad id!": os.urandom(32)}, "bad id!", "key id"),
        ({"k1": os.urandom(32)}, "k2", "primary 'k2'"),
    ],
)
def test_bad_keys_say_what_to_pass(keys: dict[str, bytes], primary: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        AESGCMCipher(keys=keys, primary=primary)


def test_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    k1, k2 = os.urandom(32), os.urandom(32)
    value = f"k2:{base64.b64encode(k2).decode()}, k1:{base64.b64encode(k1).decode()}"
    monkeypatch.setenv("CHATFLOW_KEYS", value)
    cipher = AESGCMCipher.from_env()
    assert cipher.primary == "k2" and cipher.key_ids == {"k1", "k2"}
    assert "k2" in repr(cipher) and base64.b64encode(k2).decode() not in repr(cipher)
    for bad in ("", "k1", "k1:not base64!"):
        with pytest.raises(ValueError, match="CHATFLOW_KEYS"):
            AESGCMCipher.from_env(bad)


def test_module_imports_without_cryptography_and_names_the_extra() -> None:
    # Hide only the AEAD module the cipher needs: chatflow-agent's own dependencies
    # (google-auth) import other parts of cryptography when they are installed.
    code = (
        "import sys; sys.modules['cryptography.hazmat.primitives.ciphers.aead'] = None\n"
        "from chatflow_sqlalchemy.crypto import AESGCMCipher\n"
        "try:\n    AESGCMCipher(keys={'k1': b'0' * 32}, primary='k1')\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "pip install 'chatflow-sqlalchemy[crypto]'" in out
