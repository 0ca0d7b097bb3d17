"""No import cycle in ``chatflow_sqlalchemy``, not even behind a function or ``TYPE_CHECKING``.

Every ``import`` statement of the package counts, wherever it stands (module
level, inside a function, under ``if TYPE_CHECKING``), because a cycle hidden
there is still a cycle in the design (issue 26: the registry used to map names
to store classes, so the store and the registry imported each other). Two
kinds of reference are not edges: names loaded by ``importlib`` from strings
(the registry's targets, the lazy exports of ``__init__`` and ``backend``),
and imports of the top package itself (``from chatflow_sqlalchemy import
__version__``): every submodule runs the package's ``__init__`` first anyway,
and it imports nothing at run time.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = "chatflow_sqlalchemy"
ROOT = Path(__file__).resolve().parents[1] / "src" / PACKAGE


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _known() -> dict[str, Path]:
    return {_module_of(path): path for path in ROOT.rglob("*.py")}


def _targets(node: ast.AST, known: dict[str, Path]) -> set[str]:
    """The package's modules one import statement names (a submodule where it names one)."""
    found: set[str] = set()
    if isinstance(node, ast.Import):
        found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        for alias in node.names:
            sub = f"{node.module}.{alias.name}"
            found.add(sub if sub in known else node.module)
    return {name for name in found if name in known and name != PACKAGE}


def _graph() -> dict[str, set[str]]:
    known = _known()
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[module] = {t for node in ast.walk(tree) for t in _targets(node, known)} - {module}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that comes back to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*path[path.index(target):], target]
            if target not in state and (found := visit(target)) is not None:
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)) is not None:
            return found
    return None


def test_the_package_has_no_import_cycle() -> None:
    graph = _graph()
    assert "chatflow_sqlalchemy.store" in graph["chatflow_sqlalchemy.backends.sqlite"]
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_registry_imports_no_store_and_no_migrations() -> None:
    """A store looks its dialect up in the registry, never the other way round."""
    reached: set[str] = set()
    graph = _graph()
    todo = ["chatflow_sqlalchemy.registry"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(graph[module])
    assert not reached & {
        "chatflow_sqlalchemy.store",
        "chatflow_sqlalchemy.migrate",
        "chatflow_sqlalchemy.backends.sqlite",
        "chatflow_sqlalchemy.backends.postgresql",
    }


def test_a_cycle_is_found() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


PUBLIC_SQLALCHEMY = {
    "sqlalchemy", "sqlalchemy.dialects", "sqlalchemy.dialects.mysql",
    "sqlalchemy.dialects.postgresql", "sqlalchemy.dialects.sqlite", "sqlalchemy.engine",
    "sqlalchemy.exc", "sqlalchemy.ext.asyncio", "sqlalchemy.ext.compiler", "sqlalchemy.orm",
    "sqlalchemy.pool", "sqlalchemy.sql.compiler", "sqlalchemy.sql.dml",
    "sqlalchemy.sql.functions", "sqlalchemy.sql.schema", "sqlalchemy.types",
}
"""SQLAlchemy modules whose names its documentation gives (not ``sqlalchemy.util``)."""


def test_only_documented_sqlalchemy_modules_are_imported() -> None:
    """Issue 26: no undocumented SQLAlchemy API (the async path used ``util.greenlet_spawn``)."""
    plugin = ROOT.parents[1] / "plugins/chatflow-sqlalchemy-mariadb/src"
    used: dict[str, str] = {}
    for path in [*ROOT.rglob("*.py"), *plugin.rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            )
            used.update({n: path.name for n in names if n.partition(".")[0] == "sqlalchemy"})
    assert {n: p for n, p in used.items() if n not in PUBLIC_SQLALCHEMY} == {}


LIGHT_SUPPORT_PROBE = (
    "import json, sys\n"
    "from chatflow_sqlalchemy.registry import load_backend\n"
    "support = load_backend(sys.argv[1])\n"
    "heavy = ('chatflow_sqlalchemy.store', 'chatflow_agent', 'psycopg')\n"
    "loaded = sorted(m for m in sys.modules if any(m == h or m.startswith(h + '.') "
    "for h in heavy))\n"
    "print(json.dumps({'support': f'{support.__module__}.{support.__qualname__}', "
    "'loaded': loaded}))\n"
)
"""Loads one backend's support class by its registered name in a fresh interpreter."""


@pytest.mark.parametrize("name", ["sqlite", "postgresql"])
def test_a_builtin_support_loads_without_its_store(name: str) -> None:
    """Issue 26: the registry's target is a light module; the store is imported by its string.

    Loading ``sqlite`` used to import ``backends.sqlite``, which imports the
    store, which looks ``sqlite`` up in the registry: a cycle only importlib
    strings hid, and ``chatflow-sqlalchemy backends`` loaded chatflow-agent
    and psycopg to print a class path.
    """
    result = subprocess.run(
        [sys.executable, "-c", LIGHT_SUPPORT_PROBE, name],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["support"].rpartition(".")[2].endswith("DialectSupport")
    assert report["loaded"] == []
