"""Encrypted rows read without their key are locked, not corrupt; ``keys rotate`` asks first
before encrypting a plaintext database. Real SQLite and (when configured) PostgreSQL.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from chatflow_agent import Agent, Message, Role

from chatflow_sqlalchemy import open_store
from chatflow_sqlalchemy.cli import main
from chatflow_sqlalchemy.crypto import AESGCMCipher, MissingKeyError
from chatflow_sqlalchemy.exceptions import CorruptRowError

from . import pg_util

K1, K2 = os.urandom(32), os.urandom(32)
ENV_K1 = f"k1:{base64.b64encode(K1).decode()}"
ENV_K2 = f"k2:{base64.b64encode(K2).decode()}"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHATFLOW_DATABASE_URL", raising=False)
    monkeypatch.delenv("CHATFLOW_KEYS", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'keys.db'}"
        return
    base = pg_util.postgres_url()
    with pg_util.fresh_schema(base) as schema:
        yield f"{base}?options={quote(f'-csearch_path={schema}')}"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _write(url: str, cipher: AESGCMCipher | None, session_id: str = "e") -> None:
    with open_store(url, cipher=cipher) as store:
        agent = Agent(name="a", instructions="", model="gemini-2.5-flash")
        ctx = store.get_or_create(session_id, agent, {"secret": "x"}, user_id="u")
        ctx.add_message(Message(role=Role.USER, content="private"))


def _one_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_rows_without_their_key_are_named_locked_not_corrupt(
    url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(url, AESGCMCipher({"k1": K1}, "k1"))
    for keys in (None, ENV_K2):  # no keys at all, or only another key
        if keys is None:
            monkeypatch.delenv("CHATFLOW_KEYS", raising=False)
        else:
            monkeypatch.setenv("CHATFLOW_KEYS", keys)
        code, out, err = run(capsys, "--url", url, "sessions", "show", "e")
        assert code == 1
        assert "encrypted with key 'k1', not in CHATFLOW_KEYS" in out
        line = _one_error(err)
        assert "encrypted with key 'k1', not in CHATFLOW_KEYS" in line
        assert "corrupt" not in (out + line).lower() and "delete" not in line
        assert "private" not in out
        code, out, _ = run(capsys, "--url", url, "sessions", "show", "e", "--json")
        shown = json.loads(out)
        assert shown["metadata_locked"] == {"key_id": "k1"}
        assert shown["metadata_corrupt"] is None
        assert [(m["corrupt"], m["locked"]) for m in shown["messages"]] == [
            (None, {"key_id": "k1"})
        ]
        code, out, err = run(capsys, "--url", url, "sessions", "export")
        assert code == 1 and "encrypted with key 'k1', not in CHATFLOW_KEYS" in _one_error(err)
        code, out, err = run(capsys, "--url", url, "users", "export", "u")
        line = _one_error(err)
        assert code == 1 and "'k1', not in CHATFLOW_KEYS" in line
        assert "corrupt" not in line
    monkeypatch.setenv("CHATFLOW_KEYS", f"{ENV_K2},{ENV_K1}")
    code, out, err = run(capsys, "--url", url, "sessions", "show", "e")
    assert code == 0, err
    assert "private" in out


def test_the_store_names_the_missing_key(url: str) -> None:
    _write(url, AESGCMCipher({"k1": K1}, "k1"))
    for cipher in (None, AESGCMCipher({"k2": K2}, "k2")):
        with open_store(url, cipher=cipher) as store, pytest.raises(MissingKeyError) as caught:
            store.get("e")
        assert isinstance(caught.value, CorruptRowError)  # existing handlers still catch it
        assert caught.value.key_id == "k1"
        message = str(caught.value)
        assert "encrypted with key 'k1', not in CHATFLOW_KEYS" in message
        assert "corrupt" not in message


def test_rotate_asks_before_encrypting_plaintext_rows(
    url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(url, None)
    monkeypatch.setenv("CHATFLOW_KEYS", ENV_K1)
    code, out, err = run(capsys, "--url", url, "keys", "rotate")  # stdin is not a terminal
    assert code == 2
    line = _one_error(err)
    assert "plaintext" in line and "--yes" in line
    with open_store(url) as store:  # nothing was encrypted
        assert [m.content for m in store.get("e").history] == ["private"]
    code, out, err = run(capsys, "--url", url, "keys", "rotate", "--yes", "--json")
    assert code == 0, err
    assert json.loads(out) == {"primary": "k1", "rewritten": 2}
    # An encrypted database is re-keyed without asking.
    monkeypatch.setenv("CHATFLOW_KEYS", f"{ENV_K2},{ENV_K1}")
    code, out, err = run(capsys, "--url", url, "keys", "rotate", "--json")
    assert code == 0, err
    assert json.loads(out) == {"primary": "k2", "rewritten": 2}


def test_users_export_opens_the_users_sealed_inbox_messages(
    url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The inbox's sealed text and payload are exported in clear with the key, never without."""
    _write(url, AESGCMCipher({"k1": K1}, "k1"))
    with open_store(url, cipher=AESGCMCipher({"k1": K1}, "k1")) as store:
        store.inbox.put("in-1", session_id="e", text="my card is 4111", payload={"n": 1})
    monkeypatch.setenv("CHATFLOW_KEYS", ENV_K1)
    code, out, err = run(capsys, "--url", url, "users", "export", "u")
    assert code == 0, err
    assert [(m["text"], m["payload"]) for m in json.loads(out)["inbox"]] == [
        ("my card is 4111", {"n": 1})
    ]
    monkeypatch.setenv("CHATFLOW_KEYS", ENV_K2)
    code, out, err = run(capsys, "--url", url, "users", "export", "u")
    assert code == 1 and "'k1', not in CHATFLOW_KEYS" in _one_error(err)
    assert "4111" not in out + err
