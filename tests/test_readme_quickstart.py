"""The key-free quick starts of README.md and docs/index.md run as written.

Each page's first ```python block is what a new user copies first: it must run
offline (the public ``ScriptedEngine`` stands in for the model), create the
SQLite file it names, and keep the conversation across runs. Each snippet runs
twice in a fresh folder, in its own interpreter, exactly as written; the file
is then read back with a store of its own.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from chatflow_agent import Role

from chatflow_sqlalchemy import SQLiteSessionStore

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "docs" / "index.md"]
PUBLIC_IMPORT = "from chatflow_sqlalchemy.testing import ScriptedEngine"
MAX_LINES = 15


def _scripted_engine_is_public() -> bool:
    try:
        from chatflow_sqlalchemy.testing import ScriptedEngine  # noqa: F401
    except ImportError:
        return False
    return True


def first_python_block(page: Path) -> str:
    """The first fenced ```python block of ``page``, without its fences."""
    match = re.search(r"^```python\n(.*?)^```", page.read_text(encoding="utf-8"), re.S | re.M)
    assert match, f"{page.relative_to(ROOT)} has no ```python block"
    return match.group(1)


def database_file(snippet: str) -> str:
    """The SQLite file the snippet opens (``sqlite:///<file>``)."""
    match = re.search(r"sqlite:///([^\"'\s]+)", snippet)
    assert match, f"the quick start names no sqlite:/// file:\n{snippet}"
    return match.group(1)


def run_snippet(snippet: str, folder: Path) -> subprocess.CompletedProcess[str]:
    script = folder / "quickstart.py"
    script.write_text(snippet, encoding="utf-8")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CHATFLOW_")}
    environ = {k: v for k, v in environ.items() if not k.endswith("_API_KEY")}  # no key
    return subprocess.run(
        [sys.executable, str(script)], cwd=folder, env=environ,
        capture_output=True, text=True, timeout=300,
    )


def stored_conversation(path: Path) -> list[tuple[str, str | None]]:
    """(role, content) of the one session stored in ``path``."""
    with SQLiteSessionStore(str(path)) as store:
        sessions = store.list_sessions()
        assert len(sessions) == 1, f"expected one conversation, found {sessions}"
        session = store.get(sessions[0])
        assert session is not None
        return [(m.role.value, m.content) for m in session.history]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_quick_start_is_short_key_free_and_uses_the_public_engine(page: Path) -> None:
    snippet = first_python_block(page)
    assert len(snippet.splitlines()) <= MAX_LINES, snippet
    assert PUBLIC_IMPORT in snippet
    assert "model=" not in snippet and "API_KEY" not in snippet


@pytest.mark.skipif(not _scripted_engine_is_public(), reason="ScriptedEngine not public yet")
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_quick_start_runs_as_written_and_history_survives(page: Path, tmp_path: Path) -> None:
    snippet = first_python_block(page)
    database = tmp_path / database_file(snippet)

    first = run_snippet(snippet, tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert database.is_file(), f"the quick start did not create {database.name}"
    after_one = stored_conversation(database)
    assert [role for role, _ in after_one].count(Role.USER.value) == 1
    assert after_one[-1][0] == Role.MODEL.value and after_one[-1][1]

    second = run_snippet(snippet, tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert stored_conversation(database) == after_one + after_one  # the first run is kept


def test_readme_keeps_the_quick_start_commands_and_stays_short() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make demo" in readme and "make test" in readme  # CI runs the README's test command
    assert len(readme.splitlines()) <= 250
    assert len((ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines()) <= 200
