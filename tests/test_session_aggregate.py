"""The session is an aggregate: no module but ``context.py`` touches its private state.

Issue 26 (outcome 4): stores persist a ``SessionContext`` only through its
public persistence interface (``writing``/``applied``/``rebase``/``catch_up``
and the rest), so the rules of what is pending, written and caught up with
live in one place. This reads every module of the package and refuses an
attribute access ``x._name`` (``x`` not ``self``/``cls``) where ``_name`` is
one of ``SessionContext``'s own underscore attributes or methods.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "chatflow_sqlalchemy"

UPSTREAM_API = {"_prune_history"}
"""Upstream's method of that name, which the conformance kit compares with upstream's."""


def _private_names() -> set[str]:
    """The underscore attributes and methods ``SessionContext`` defines or sets on itself."""
    tree = ast.parse((ROOT / "context.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SessionContext")
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")} - UPSTREAM_API


def test_no_module_outside_the_context_touches_its_private_state() -> None:
    private = _private_names()
    assert {"_durable", "_history", "_seqs", "_mutex"} <= private
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == ROOT / "context.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in private
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
