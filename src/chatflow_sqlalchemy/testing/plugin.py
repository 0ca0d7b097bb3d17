"""pytest plugin of the chatflow-sqlalchemy conformance kit (auto-loaded via ``pytest11``).

It is loaded into every pytest run of an environment where
chatflow-sqlalchemy is installed, so it is deliberately inert:

* at import time it imports only :mod:`pytest` (chatflow and SQLAlchemy are
  imported lazily, only by tests that use the kit);
* it registers the ``chatflow_requires(*capabilities)`` marker;
* it provides a default ``store_factory`` fixture that skips with
  instructions. A backend's ``conftest.py`` overrides it to return a
  :class:`~chatflow_sqlalchemy.testing.harness.StoreHarness`; suites that
  never request ``store_factory`` never run it;
* it enforces ``chatflow_requires`` only for tests that request
  ``store_factory`` and carry the marker; every other test is untouched.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

__all__ = ["MARKER", "pytest_configure", "pytest_runtest_setup", "store_factory"]

MARKER = "chatflow_requires"

_OVERRIDE_HINT = (
    "chatflow-sqlalchemy conformance suite: no store under test. Override the "
    "`store_factory` fixture in your conftest.py to return a "
    "chatflow_sqlalchemy.testing.StoreHarness for your backend "
    "(see chatflow_sqlalchemy.testing.harness)."
)


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``chatflow_requires`` marker (so ``--strict-markers`` accepts it)."""
    config.addinivalue_line(
        "markers",
        f"{MARKER}(*capabilities): skip unless the chatflow store under test "
        "(the store_factory harness) has every capability given",
    )


@pytest.fixture
def store_factory() -> Any:
    """The store under test; override it to return a ``StoreHarness`` (default: skip)."""
    pytest.skip(_OVERRIDE_HINT)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    """Skip a marked test whose ``store_factory`` harness lacks a required capability.

    Tests of the shipped suite are gated earlier (before their store opens);
    this catches users' own tests that use the marker with ``store_factory``.
    """
    result = yield
    markers = list(item.iter_markers(MARKER))
    if markers:
        funcargs: dict[str, Any] = getattr(item, "funcargs", {})
        harness = funcargs.get("store_factory")
        capabilities = getattr(harness, "capabilities", None)
        if capabilities is not None:
            owned = {str(c) for c in capabilities}
            needed = [str(c) for marker in markers for c in marker.args]
            missing = [c for c in needed if c not in owned]
            if missing:
                name = getattr(harness, "name", type(harness).__name__)
                pytest.skip(f"store {name!r} lacks capability {', '.join(missing)}")
    return result
