"""Simulate installed distributions: ``*.dist-info`` folders on ``sys.path``.

``importlib.metadata`` finds a distribution wherever a ``<name>-<version>.dist-info``
folder with a ``METADATA`` file sits on ``sys.path``; its ``entry_points.txt``
declares entry points exactly as an installed wheel's does. Tests build such
folders (and the modules they point at) in a temporary directory and prepend
it to ``sys.path`` with ``monkeypatch.syspath_prepend``.
"""

from __future__ import annotations

import textwrap
import uuid
from collections.abc import Mapping
from pathlib import Path


def unique_module(prefix: str) -> str:
    """A module name no other test uses (``sys.modules`` outlives a test)."""
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def write_module(root: Path, dotted: str, source: str) -> Path:
    """Write ``dotted`` (a module or ``pkg.module``) under ``root``; return its file."""
    parts = dotted.split(".")
    folder = root.joinpath(*parts[:-1])
    folder.mkdir(parents=True, exist_ok=True)
    for depth in range(1, len(parts)):
        init = root.joinpath(*parts[:depth], "__init__.py")
        if not init.exists():
            init.write_text("")
    path = folder / f"{parts[-1]}.py"
    path.write_text(textwrap.dedent(source))
    return path


def write_dist(
    root: Path,
    name: str,
    entry_points: Mapping[str, Mapping[str, str]],
    version: str = "1.0",
) -> Path:
    """Write ``<name>-<version>.dist-info`` declaring ``{group: {ep name: target}}``."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    info.joinpath("METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    )
    lines: list[str] = []
    for group, points in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{ep} = {target}" for ep, target in points.items()]
        lines.append("")
    info.joinpath("entry_points.txt").write_text("\n".join(lines))
    return info
