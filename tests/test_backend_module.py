"""``chatflow_sqlalchemy.backend`` is all a plugin needs; the MariaDB plugin uses nothing else."""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from chatflow_sqlalchemy import backend
from chatflow_sqlalchemy.registry import load_backend, store_class_for
from tests.fake_dists import write_dist

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


def test_the_plugin_authors_guide_lists_every_name() -> None:
    guide = (PLUGIN.parents[2] / "docs/plugin-authors.md").read_text()
    assert [name for name in backend.__all__ if f"`{name}`" not in guide] == []


def test_the_mariadb_plugin_holds_only_what_differs() -> None:
    """Issue 26: what the core does generically is not in the plugin (at most 400 lines)."""
    lines = sum(len(p.read_text().splitlines()) for p in PLUGIN.rglob("*.py"))
    assert lines <= 400


def test_importing_it_loads_nothing_heavy() -> None:
    """A plugin's driver-free schema module imports it on every ``db`` command."""
    code = (
        "import sys, chatflow_sqlalchemy.backend as b; "
        "print(sorted(m for m in ('chatflow_sqlalchemy.store', 'alembic') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_plugins_entry_points_name_its_dialect_support(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As its pyproject declares them (a dist-info of its name shadows an older install)."""
    tomllib = pytest.importorskip("tomllib")
    pytest.importorskip("chatflow_sqlalchemy_mariadb", reason="the MariaDB plugin is not installed")
    project = tomllib.loads((PLUGIN.parent / "pyproject.toml").read_text())["project"]
    write_dist(tmp_path, project["name"], project["entry-points"], version=project["version"])
    monkeypatch.syspath_prepend(str(tmp_path))
    from chatflow_sqlalchemy_mariadb.dialect import MariaDBDialectSupport
    from chatflow_sqlalchemy_mariadb.store import MariaDBSessionStore

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # no store class named any more
        for name in ("mysql", "mariadb"):
            assert load_backend(name) is MariaDBDialectSupport
            assert store_class_for(name) is MariaDBSessionStore
