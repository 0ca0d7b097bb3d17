"""Command line of "Summaries, rewind and forks": ``sessions rewind`` and ``sessions fork``.

On a real SQLite file, PostgreSQL and MariaDB (each when configured): plain
and ``--json`` output, what the database holds afterwards, and the exit
codes of bad input (1: no such session; 2: a usage mistake, nothing changed); and
``keys rotate``, which seals summaries too.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import quote

import pytest
from chatflow_agent import Agent, Message, Role
from sqlalchemy import text

from chatflow_sqlalchemy import open_store
from chatflow_sqlalchemy.cli import main
from chatflow_sqlalchemy.crypto import AESGCMCipher

from . import pg_util
from .test_bad_input import _mariadb_database


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CHATFLOW_DATABASE_URL", "CHATFLOW_AUTO_MIGRATE", "FORCE_COLOR",
                 "CHATFLOW_KEYS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(params=[
    "sqlite",
    pytest.param("postgresql", marks=pytest.mark.postgres),
    pytest.param("mariadb", marks=pytest.mark.mariadb),
])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A new, empty database of each kind, as the URL the CLI is given."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'cli.db'}"
        return
    if request.param == "mariadb":
        pytest.importorskip("chatflow_sqlalchemy_mariadb")
        with ExitStack() as stack:
            yield _mariadb_database(stack)
        return
    base = pg_util.postgres_url()
    with pg_util.fresh_schema(base) as schema:
        yield f"{base}?options={quote(f'-csearch_path={schema}')}"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _agent() -> Agent:
    return Agent(name="support", instructions="")


def _seed(url: str, **options: object) -> None:
    """Session ``s`` of user ``ann``: a SYSTEM message and three turns."""
    with open_store(url, **options) as store:
        ctx = store.get_or_create("s", _agent(), {"tier": "gold"}, user_id="ann")
        ctx.add_message(Message(role=Role.SYSTEM, content="be brief"))
        for n in range(3):
            ctx.add_message(Message(role=Role.USER, content=f"u{n}"))
            ctx.add_message(Message(role=Role.MODEL, content=f"m{n}"))


def _contents(url: str, session_id: str, **options: object) -> list[str | None]:
    with open_store(url, **options) as store:
        ctx = store.get(session_id)
        assert ctx is not None
        return [m.content for m in ctx.history]


def test_rewind_removes_the_last_turns(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    _seed(url)
    code, out, err = run(capsys, "sessions", "rewind", "s", "--yes", "--url", url)
    assert (code, err) == (0, "")
    assert out == "rewound 1 turn(s) of session 's': 2 turn(s) left\n"
    assert _contents(url, "s") == ["be brief", "u0", "m0", "u1", "m1"]
    code, out, _ = run(capsys, "sessions", "rewind", "s", "--turns", "2", "--yes", "--json",
                       "--url", url)
    assert code == 0
    assert json.loads(out) == {"session_id": "s", "rewound": 2, "turns": 0}
    assert _contents(url, "s") == ["be brief"]
    with open_store(url) as store:
        assert store.transcript("s") == store.get("s").history, "nothing was archived"


def test_rewind_with_archive_keeps_the_removed_turn_in_the_transcript(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _seed(url)
    code, _, _ = run(capsys, "sessions", "rewind", "s", "--archive", "--yes", "--url", url)
    assert code == 0
    with open_store(url) as store:
        assert [m.content for m in store.transcript("s")][-2:] == ["u2", "m2"]
        assert [m.content for m in store.get("s").history][-1] == "m1"


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["nope", "--yes"], 1, "no session 'nope'"),
        (["s", "--turns", "4", "--yes"], 2, "its window holds 3; pass --turns from 1 to 3"),
        (["s", "--turns", "0", "--yes"], 2, "--turns"),
        (["s"], 2, "pass --yes"),
        (["x" * 300, "--yes"], 2, "session_id is 300 characters"),
    ],
)
def test_rewind_bad_input_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], code: int, needle: str
) -> None:
    url = f"sqlite:///{tmp_path / 'bad.db'}"
    _seed(url)
    got, out, err = run(capsys, "sessions", "rewind", *args, "--url", url)
    assert (got, out) == (code, "")
    assert needle in err and "Traceback" not in err
    assert len(_contents(url, "s")) == 7


def test_fork_copies_a_session(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    _seed(url)
    code, out, err = run(capsys, "sessions", "fork", "s", "early", "--at-turn", "1",
                         "--url", url)
    assert (code, err) == (0, "")
    assert out == "forked session 's' into 'early': 1 turn(s), 3 message(s)\n"
    code, out, _ = run(capsys, "sessions", "fork", "s", "whole", "--json", "--url", url)
    assert code == 0
    assert json.loads(out) == {
        "session_id": "whole", "forked_from": "s", "forked_at_turn": 3, "messages": 7,
    }
    assert _contents(url, "early") == ["be brief", "u0", "m0"]
    assert _contents(url, "whole") == _contents(url, "s")
    code, out, _ = run(capsys, "sessions", "list", "--forked-from", "s", "--json", "--url", url)
    assert code == 0
    assert sorted(row["session_id"] for row in json.loads(out)["sessions"]) == ["early", "whole"]
    code, out, _ = run(capsys, "users", "export", "ann", "--url", url)
    by_id = {row["session_id"]: row for row in json.loads(out)["sessions"]}
    assert sorted(by_id) == ["early", "s", "whole"], "a fork belongs to the source's user"
    assert (by_id["early"]["forked_from"], by_id["early"]["forked_at_turn"]) == ("s", 1)
    assert by_id["early"]["metadata"] == {"tier": "gold"}


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["nope", "new"], 1, "no session 'nope'"),
        (["s", "taken"], 2, "exists already"),
        (["s", "new", "--at-turn", "4"], 2, "pass at_turn from 0 to 3"),
        (["s", "new", "--at-turn", "-1"], 2, "--at-turn"),
        (["s", "s"], 2, "a fork is a new session"),
        (["s", ""], 2, "new_session_id must be a non-empty string"),
    ],
)
def test_fork_bad_input_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], code: int, needle: str
) -> None:
    url = f"sqlite:///{tmp_path / 'bad.db'}"
    _seed(url)
    with open_store(url) as store:
        store.get_or_create("taken", _agent()).add_message(
            Message(role=Role.USER, content="mine")
        )
    got, out, err = run(capsys, "sessions", "fork", *args, "--url", url)
    assert (got, out) == (code, "")
    assert needle in err and "Traceback" not in err
    with open_store(url) as store:
        assert sorted(store.list_sessions()) == ["s", "taken"]
        assert [m.content for m in store.get("taken").history] == ["mine"]


def test_encrypted_database_needs_its_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'sealed.db'}"
    key = os.urandom(32)
    cipher = AESGCMCipher({"k1": key}, "k1")
    _seed(url, cipher=cipher)
    code, out, err = run(capsys, "sessions", "fork", "s", "copy", "--url", url)
    assert (code, out) == (1, "")
    assert "CHATFLOW_KEYS" in err and "nothing was changed" in err
    code, _, err = run(capsys, "sessions", "rewind", "s", "--yes", "--url", url)
    assert code == 1 and "CHATFLOW_KEYS" in err
    monkeypatch.setenv("CHATFLOW_KEYS", f"k1:{base64.b64encode(key).decode()}")
    code, _, _ = run(capsys, "sessions", "fork", "s", "copy", "--at-turn", "2", "--url", url)
    assert code == 0
    code, _, _ = run(capsys, "sessions", "rewind", "copy", "--yes", "--url", url)
    assert code == 0
    options = {"cipher": cipher, "require_encryption": True}
    assert _contents(url, "copy", **options) == ["be brief", "u0", "m0"]
    assert len(_contents(url, "s", **options)) == 7


def test_keys_rotate_seals_a_plaintext_summary(
    url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    key = os.urandom(32)
    cipher = AESGCMCipher({"k1": key}, "k1")
    _seed(url, cipher=cipher)
    with open_store(url, cipher=cipher) as store, store.engine.begin() as conn:
        # A summary written before the store had a cipher: the only plaintext left.
        conn.execute(text(
            "UPDATE chatflow_sessions SET summary = 'plain words', summary_through = 1"
        ))
    monkeypatch.setenv("CHATFLOW_KEYS", f"k1:{base64.b64encode(key).decode()}")
    code, _, err = run(capsys, "keys", "rotate", "--url", url)
    assert code == 2 and "holds plaintext rows" in err, "a plaintext summary counts"
    code, out, _ = run(capsys, "keys", "rotate", "--yes", "--json", "--url", url)
    assert code == 0 and json.loads(out)["rewritten"] == 1
    with open_store(url, cipher=cipher, require_encryption=True) as store:
        with store.engine.connect() as conn:
            stored = conn.execute(text("SELECT summary FROM chatflow_sessions")).scalar_one()
        assert stored.startswith("cfenc:1:k1:")
        assert store.get("s").summary == "plain words"


_HANG_GUARD = 60.0  # seconds: only a hang guard for the background summaries


async def _summarize(previous: str | None, dropped: list[Message]) -> str:
    """Joins what pruning dropped: the summary names every turn it stands for."""
    return "\n".join([*([previous] if previous else []), *(str(m.content) for m in dropped)])


def _summarized(url: str, **options: object) -> None:
    """Session ``src`` of user ``ann``: four turns, the first two pruned into its summary.

    Then ``dst``, a fork of ``src`` at turn 1 (it carries the summary too).
    """
    with open_store(url, summarizer=_summarize, default_max_turns=2, **options) as store:
        ctx = store.get_or_create("src", _agent(), {"tier": "gold"}, user_id="ann")
        for n in range(4):
            ctx.add_message(Message(role=Role.USER, content=f"u{n}"))
            ctx.add_message(Message(role=Role.MODEL, content=f"m{n}"))
        assert store.wait_for_summaries(_HANG_GUARD)
        assert ctx.summary == "u0\nm0\nu1\nm1"
        store.fork("src", "dst", at_turn=1)


def _export_lines(out: str) -> dict[str, dict[str, object]]:
    rows = [json.loads(line) for line in out.splitlines()]
    return {row["session_id"]: row for row in rows}


def test_show_prints_the_summary_and_where_a_fork_came_from(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _summarized(url)
    code, out, err = run(capsys, "sessions", "show", "src", "--url", url)
    assert (code, err) == (0, "")
    assert "summary:\n  u0\n  m0\n  u1\n  m1\n" in out
    assert "forked from" not in out
    code, out, _ = run(capsys, "sessions", "show", "dst", "--url", url)
    assert code == 0
    assert "forked from: src at turn 1\n" in out and "summary:\n  u0\n" in out
    code, out, _ = run(capsys, "sessions", "show", "dst", "--json", "--url", url)
    assert code == 0
    shown = json.loads(out)
    assert (shown["summary"], shown["forked_from"], shown["forked_at_turn"]) == (
        "u0\nm0\nu1\nm1", "src", 1,
    )
    assert (shown["summary_corrupt"], shown["summary_locked"]) == (None, None)
    code, out, _ = run(capsys, "sessions", "show", "src", "--json", "--url", url)
    assert code == 0
    assert (json.loads(out)["forked_from"], json.loads(out)["forked_at_turn"]) == (None, None)


def test_show_on_a_terminal_prints_the_summary_lines_and_the_fork(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'rich.db'}"
    _summarized(url)
    monkeypatch.setenv("FORCE_COLOR", "1")  # the Rich layout, as on a terminal
    code, out, err = run(capsys, "sessions", "show", "dst", "--url", url)
    assert (code, err) == (0, "")
    assert "forked from" in out and "src at turn 1" in out
    assert all(part in out for part in ("summary", "u0", "m0", "u1", "m1"))


def test_export_keeps_the_summary_and_the_fork_as_users_export_does(
    url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    _summarized(url)
    code, out, err = run(capsys, "sessions", "export", "--url", url)
    assert (code, err) == (0, "")
    exported = _export_lines(out)
    code, out, _ = run(capsys, "users", "export", "ann", "--url", url)
    assert code == 0
    by_user = {row["session_id"]: row for row in json.loads(out)["sessions"]}
    keys = ("summary", "forked_from", "forked_at_turn")
    for sid in ("src", "dst"):
        assert {k: exported[sid][k] for k in keys} == {k: by_user[sid][k] for k in keys}
    assert exported["src"]["summary"] == "u0\nm0\nu1\nm1"
    assert (exported["dst"]["forked_from"], exported["dst"]["forked_at_turn"]) == ("src", 1)
    target = tmp_path / "backup.jsonl"
    code, out, _ = run(capsys, "sessions", "export", "-o", str(target), "--json", "--url", url)
    assert code == 0 and json.loads(out)["exported"] == 2
    assert _export_lines(target.read_text()) == exported


def test_an_encrypted_summary_needs_its_key_and_is_never_corrupt(
    url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    key = os.urandom(32)
    _summarized(url, cipher=AESGCMCipher({"k1": key}, "k1"))
    code, out, err = run(capsys, "sessions", "show", "src", "--url", url)
    assert code == 1
    assert "summary: (encrypted with key 'k1', not in CHATFLOW_KEYS)\n" in out
    assert "corrupt" not in (out + err).lower()
    # metadata, summary and the four window rows: each part counted once
    assert "6 part(s) encrypted with key 'k1'" in err
    code, out, _ = run(capsys, "sessions", "show", "src", "--json", "--url", url)
    assert code == 1
    shown = json.loads(out)
    assert (shown["summary"], shown["summary_locked"], shown["summary_corrupt"]) == (
        None, {"key_id": "k1"}, None,
    )
    code, out, err = run(capsys, "sessions", "export", "--skip-corrupt", "--url", url)
    assert (code, out) == (0, "")
    assert "skipped: session 'src': summary is encrypted with key 'k1', not in CHATFLOW_KEYS" in err
    monkeypatch.setenv("CHATFLOW_KEYS", f"k1:{base64.b64encode(key).decode()}")
    code, out, err = run(capsys, "sessions", "show", "dst", "--url", url)
    assert (code, err) == (0, "")
    assert "summary:\n  u0\n  m0\n  u1\n  m1\n" in out and "forked from: src at turn 1\n" in out
    code, out, _ = run(capsys, "sessions", "show", "src", "--json", "--url", url)
    assert code == 0 and json.loads(out)["summary"] == "u0\nm0\nu1\nm1"
    code, out, err = run(capsys, "sessions", "export", "--url", url)
    assert (code, err) == (0, "")
    assert _export_lines(out)["src"]["summary"] == "u0\nm0\nu1\nm1"
