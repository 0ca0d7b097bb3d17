"""A user's export meets session metadata that is not JSON: a clear CorruptRowError, no traceback.

SQLite keeps ``metadata_json`` as text, which a hand edit or a damaged file can
leave undecodable. ``get`` and ``sessions show``/``export`` already name the row;
``export_user`` and ``users export`` must too, instead of a bare ``JSONDecodeError``.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from chatflow_agent import Agent, Message, Role

from chatflow_sqlalchemy import open_store
from chatflow_sqlalchemy.cli import main
from chatflow_sqlalchemy.exceptions import CorruptRowError

_BROKEN, _INTACT = "s-broken", "s-intact"


@pytest.fixture
def url(tmp_path: Path) -> str:
    """A SQLite file where user ann has two sessions, one with metadata that is not JSON."""
    path = tmp_path / "store.db"
    url = f"sqlite:///{path}"
    with open_store(url) as store:
        for session_id in (_BROKEN, _INTACT):
            ctx = store.get_or_create(session_id, Agent(name="a", instructions=""), user_id="ann")
            ctx.add_message(Message(role=Role.USER, content="hi"))
    with sqlite3.connect(path) as conn:
        conn.execute(
            "UPDATE chatflow_sessions SET metadata_json = '{oops' WHERE session_id = ?",
            (_BROKEN,),
        )
    return url


def test_export_user_names_the_corrupt_session_row(url: str) -> None:
    with open_store(url) as store, pytest.raises(CorruptRowError) as caught:
        store.export_user("ann")
    assert caught.value.session_id == _BROKEN
    assert "metadata_json" in str(caught.value)


def test_users_export_reports_the_corrupt_row_in_one_line(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "ann.json"
    code = main(["--url", url, "users", "export", "ann", "--output", str(target)])
    out, err = capsys.readouterr()
    assert code == 1, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert _BROKEN in lines[0] and "metadata_json" in lines[0]
    assert "Traceback" not in err + out
    assert not target.exists(), "a stopped export leaves no file"
