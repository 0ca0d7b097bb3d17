"""The backend registry with simulated installed plugins (``*.dist-info`` on ``sys.path``).

Rules proven here (issue 6, part 2):

* an installed plugin's entry point serves its dialect through ``open_store``;
* ``register()`` beats entry points, also when two plugins claim a name;
* two distributions claiming one name is an error naming both, raised only
  for that name: every other backend still loads;
* a plugin that fails to import is listed by ``available_backends()`` and
  ``chatflow-sqlalchemy backends`` with its error, and breaks nothing else;
* an unknown dialect lists the installed backends; a missing driver names
  the extra to install.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from chatflow_sqlalchemy import (
    BackendImportError,
    BackendNotFoundError,
    DuplicateBackendError,
    available_backends,
    open_store,
    register,
)
from chatflow_sqlalchemy.backends.postgresql import PostgresSessionStore
from chatflow_sqlalchemy.backends.sqlite import SQLiteSessionStore
from chatflow_sqlalchemy.cli import main
from chatflow_sqlalchemy.registry import (
    ENTRY_POINT_GROUP,
    backend_sources,
    load_backend,
    unregister,
)
from tests.fake_dists import unique_module, write_dist, write_module

STORE_SOURCE = """
class {cls}:
    opened = []

    @classmethod
    def from_url(cls, url, **kwargs):
        cls.opened.append((str(url), kwargs))
        return (cls.__name__, str(url), kwargs)
"""


class Plugins:
    """Builds fake plugin distributions in one folder on ``sys.path``."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        monkeypatch.syspath_prepend(str(root))

    def backend(
        self,
        dist: str,
        names: dict[str, str],
        *,
        source: str | None = None,
        extras: str = "",
        version: str = "1.0",
    ) -> str:
        """A distribution whose module defines a store class per backend name.

        ``names`` maps backend name -> class name. Returns the module name.
        """
        module = unique_module(dist.replace("-", "_"))
        body = source if source is not None else "".join(
            STORE_SOURCE.format(cls=cls) for cls in sorted(set(names.values()))
        )
        write_module(self.root, module, body)
        points = {name: f"{module}:{cls}{extras}" for name, cls in names.items()}
        write_dist(self.root, dist, {ENTRY_POINT_GROUP: points}, version=version)
        return module


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Plugins:
    return Plugins(tmp_path / "site", monkeypatch)


@pytest.fixture(autouse=True)
def _forget_registrations() -> Any:
    yield
    for name in ("fakedb", "clash", "postgres", "sqlite"):
        unregister(name)


def test_entry_point_serves_its_dialect(plugins: Plugins) -> None:
    module = plugins.backend("chatflow-sqlalchemy-fakedb", {"fakedb": "FakeStore"})
    cls = load_backend("fakedb")
    assert cls.__module__ == module
    assert open_store("fakedb://host/chat", default_max_turns=3) == (
        "FakeStore",
        "fakedb://host/chat",
        {"default_max_turns": 3},
    )
    assert available_backends()["fakedb"] is cls
    assert isinstance(available_backends()["sqlite"], type)
    source = backend_sources()["fakedb"]
    assert source.distributions == ("chatflow-sqlalchemy-fakedb 1.0",)
    assert source.target == f"{module}:FakeStore"


def test_register_beats_entry_points(plugins: Plugins) -> None:
    plugins.backend("chatflow-sqlalchemy-fakedb", {"fakedb": "FakeStore"})

    class Chosen:
        @classmethod
        def from_url(cls, url: Any, **kwargs: Any) -> str:
            return "chosen"

    register("fakedb", Chosen)  # type: ignore[arg-type]
    assert load_backend("fakedb") is Chosen
    assert open_store("fakedb://x") == "chosen"
    assert backend_sources()["fakedb"].origin == "register()"
    unregister("fakedb")
    assert load_backend("fakedb").__name__ == "FakeStore"


def test_register_by_import_path_is_lazy(plugins: Plugins) -> None:
    module = plugins.backend("chatflow-sqlalchemy-fakedb", {"fakedb": "FakeStore"})
    register("clash", f"{module}:FakeStore")
    assert load_backend("clash").__name__ == "FakeStore"
    register("clash", f"{module}:NoSuchClass")
    with pytest.raises(BackendImportError, match="NoSuchClass"):
        load_backend("clash")


def test_two_distributions_claiming_one_name(
    plugins: Plugins, capsys: pytest.CaptureFixture[str]
) -> None:
    first = plugins.backend("vendor-one", {"clash": "OneStore"})
    second = plugins.backend("vendor-two", {"clash": "TwoStore"}, version="2.5")
    plugins.backend("chatflow-sqlalchemy-fine", {"fakedb": "FineStore"})
    with pytest.raises(DuplicateBackendError) as info:
        load_backend("clash")
    message = str(info.value)
    assert "vendor-one 1.0" in message and "vendor-two 2.5" in message
    assert f"{first}:OneStore" in message and f"{second}:TwoStore" in message
    assert "register(" in message
    with pytest.raises(DuplicateBackendError):
        open_store("clash://db")
    # only that name is broken: every other backend still loads
    backends = available_backends()
    assert isinstance(backends["clash"], DuplicateBackendError)
    assert backends["fakedb"].__name__ == "FineStore"  # type: ignore[union-attr]
    assert backends["sqlite"] is SQLiteSessionStore
    assert backend_sources()["clash"].distributions == ("vendor-one 1.0", "vendor-two 2.5")
    # register() is how a user chooses between them
    register("clash", f"{second}:TwoStore")
    assert load_backend("clash").__name__ == "TwoStore"
    unregister("clash")
    # the CLI lists the conflict and keeps going
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    clash_line = next(line for line in out.splitlines() if line.startswith("clash"))
    assert "unavailable" in clash_line and "vendor-one" in clash_line
    assert "vendor-one 1.0 + vendor-two 2.5" in clash_line
    lines = out.splitlines()
    assert any(line.startswith("sqlite") and "SQLiteSessionStore" in line for line in lines)


def test_plugin_that_fails_to_import_is_reported(
    plugins: Plugins, capsys: pytest.CaptureFixture[str]
) -> None:
    plugins.backend(
        "chatflow-sqlalchemy-crashy",
        {"crashy": "Store"},
        source="raise RuntimeError('boom at import')\n",
    )
    plugins.backend(
        "chatflow-sqlalchemy-nodriver",
        {"nodriver": "Store"},
        source="import no_such_driver_for_chatflow_tests\n",
    )
    plugins.backend(
        "chatflow-sqlalchemy-extra",
        {"extradb": "Store"},
        source="import no_such_fast_driver\n",
        extras=" [fast]",
    )
    plugins.backend("chatflow-sqlalchemy-fakedb", {"fakedb": "FakeStore"})
    backends = available_backends()
    crashy, nodriver, extra = backends["crashy"], backends["nodriver"], backends["extradb"]
    assert isinstance(crashy, BackendImportError)
    assert "boom at import" in str(crashy) and "RuntimeError" in str(crashy)
    assert "chatflow-sqlalchemy-crashy" in str(crashy)
    assert isinstance(nodriver, BackendImportError)
    assert "no_such_driver_for_chatflow_tests" in str(nodriver)
    assert "pip install --force-reinstall 'chatflow-sqlalchemy-nodriver'" in str(nodriver)
    assert isinstance(extra, BackendImportError)
    assert "pip install 'chatflow-sqlalchemy-extra[fast]'" in str(extra)
    # the others are untouched
    assert backends["fakedb"].__name__ == "FakeStore"  # type: ignore[union-attr]
    assert backends["sqlite"] is SQLiteSessionStore
    assert backends["postgresql"] is PostgresSessionStore
    with pytest.raises(BackendImportError, match="boom at import") as info:
        open_store("crashy://db")
    assert isinstance(info.value, ImportError)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "crashy" in out and "boom at import" in out
    assert "FakeStore" in out


def test_entry_point_that_is_not_a_store_class(plugins: Plugins) -> None:
    plugins.backend("chatflow-sqlalchemy-odd", {"odd": "make"}, source="def make():\n    pass\n")
    with pytest.raises(BackendImportError, match="not a session store class"):
        load_backend("odd")


def test_unknown_dialect_lists_installed_backends(plugins: Plugins) -> None:
    plugins.backend("chatflow-sqlalchemy-fakedb", {"fakedb": "FakeStore"})
    with pytest.raises(BackendNotFoundError) as info:
        open_store("nosuchdb://host/db")
    message = str(info.value)
    for name in ("sqlite", "postgresql", "fakedb"):
        assert name in message
    assert "nosuchdb" in message
    assert "pip install" not in message  # no such package exists to suggest
    assert "fakedb" in info.value.installed
    assert isinstance(info.value, LookupError)


def test_builtin_name_claimed_by_a_plugin_is_ignored_with_a_warning(
    plugins: Plugins, caplog: pytest.LogCaptureFixture
) -> None:
    plugins.backend("sqlite-hijack", {"sqlite": "OtherSqlite"})
    caplog.set_level(logging.WARNING, logger="chatflow_sqlalchemy")
    assert load_backend("sqlite") is SQLiteSessionStore
    warning = "\n".join(r.getMessage() for r in caplog.records)
    assert "sqlite-hijack" in warning and "built into" in warning
    assert backend_sources()["sqlite"].origin == "built-in"


def test_exact_name_first_then_alias() -> None:
    assert load_backend("postgres") is PostgresSessionStore

    class Exact:
        @classmethod
        def from_url(cls, url: Any, **kwargs: Any) -> str:
            return "exact"

    register("postgres", Exact)  # type: ignore[arg-type]
    assert load_backend("postgres") is Exact


def test_missing_driver_names_the_extra() -> None:
    # A fresh interpreter where psycopg cannot be imported (as without the extra).
    code = (
        "import sys\n"
        "sys.modules['psycopg'] = None\n"
        "from chatflow_sqlalchemy import BackendImportError, available_backends, open_store\n"
        "error = available_backends()['postgresql']\n"
        "assert isinstance(error, BackendImportError), error\n"
        "assert available_backends()['sqlite'].__name__ == 'SQLiteSessionStore'\n"
        "try:\n"
        "    open_store('postgresql://u@h/db')\n"
        "except BackendImportError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'chatflow-sqlalchemy[postgres]'" in result.stdout
    assert "psycopg" in result.stdout
