"""``chatflow_sqlalchemy.backend`` is all a plugin needs; the MariaDB plugin uses nothing else."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from chatflow_sqlalchemy import backend

PLUGIN = Path(__file__).resolve().parents[1] / "plugins/chatflow-sqlalchemy-mariadb/src"


def _core_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        )
        found.update(n for n in names if n.partition(".")[0] == "chatflow_sqlalchemy")
    return found


@pytest.mark.parametrize("name", backend.__all__)
def test_every_name_it_offers_is_there(name: str) -> None:
    assert getattr(backend, name) is not None


def test_the_mariadb_plugin_imports_only_the_public_modules() -> None:
    sources = sorted(PLUGIN.rglob("*.py"))
    assert sources
    used = {str(p.relative_to(PLUGIN)): _core_imports(p) for p in sources}
    private = {
        path: sorted(m for m in modules if m not in ("chatflow_sqlalchemy", backend.__name__))
        for path, modules in used.items()
    }
    assert {path: m for path, m in private.items() if m} == {}


def test_importing_it_loads_nothing_heavy() -> None:
    """A plugin's driver-free schema module imports it on every ``db`` command."""
    code = (
        "import sys, chatflow_sqlalchemy.backend as b; "
        "print(sorted(m for m in ('chatflow_sqlalchemy.store', 'alembic') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
