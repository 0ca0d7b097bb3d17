"""Revisions are frozen: none imports the package's runtime code.

A revision must do tomorrow what it did the day it was released, whatever the
runtime becomes; so it may import the standard library, SQLAlchemy, Alembic and
the public exception types it raises, and nothing else of chatflow_sqlalchemy.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERSION_FOLDERS = (
    ROOT / "migrations" / "versions",
    ROOT / "plugins/chatflow-sqlalchemy-mariadb/src/chatflow_sqlalchemy_mariadb"
    / "migrations/versions",
)
REVISIONS = sorted(p for folder in VERSION_FOLDERS for p in folder.glob("[0-9]*.py"))


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def _allowed(module: str) -> bool:
    top = module.partition(".")[0]
    return (
        top in sys.stdlib_module_names
        or top in ("sqlalchemy", "alembic")
        or module == "chatflow_sqlalchemy.exceptions"
    )


def test_every_revision_folder_is_found() -> None:
    assert len(REVISIONS) >= 8, REVISIONS


@pytest.mark.parametrize("path", REVISIONS, ids=lambda p: p.name)
def test_a_revision_imports_no_runtime_code(path: Path) -> None:
    live = sorted(m for m in _imports(path) if not _allowed(m))
    assert live == [], f"{path.name} imports runtime code: {live}; copy what it needs into it"
