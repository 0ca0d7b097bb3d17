"""Conformance kit: run the chatflow-sqlalchemy contract against any session-store backend.

Three pieces, in the style of SQLAlchemy's dialect compliance suite:

* :mod:`chatflow_sqlalchemy.testing.harness`: :class:`StoreHarness` describes
  one backend (how to open a store on a database, how a spawned process opens
  the same database, and its :class:`Capability` set);
* :mod:`chatflow_sqlalchemy.testing.suite`: the test classes. A test module
  that does ``from chatflow_sqlalchemy.testing.suite import *`` collects them;
* :mod:`chatflow_sqlalchemy.testing.plugin`: the auto-loaded pytest plugin
  (the ``chatflow_requires`` marker and a default ``store_factory`` fixture
  that you override in ``conftest.py`` to return your harness).

Beside them, :class:`~chatflow_sqlalchemy.testing.engines.ScriptedEngine`: an
offline engine for the real ``Runner`` (no network, no API key, no pytest),
for quick starts, demos and tests.

Importing this package is cheap; the suite module is only imported by test
modules that use it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatflow_sqlalchemy.testing.engines import ScriptedEngine
    from chatflow_sqlalchemy.testing.harness import (
        Capability,
        FactoryHarness,
        SpecHarness,
        StoreHarness,
        StoreSpec,
        UnreachableHarness,
        database_problem,
        missing_capabilities,
        requires,
    )

__all__ = [
    "Capability",
    "FactoryHarness",
    "ScriptedEngine",
    "SpecHarness",
    "StoreHarness",
    "StoreSpec",
    "UnreachableHarness",
    "database_problem",
    "missing_capabilities",
    "requires",
]


_HOMES = {"ScriptedEngine": "chatflow_sqlalchemy.testing.engines"}


def __getattr__(name: str) -> Any:
    # Lazy, so the auto-loaded pytest plugin (a submodule) imports nothing heavy.
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    home = _HOMES.get(name, "chatflow_sqlalchemy.testing.harness")
    return getattr(importlib.import_module(home), name)
