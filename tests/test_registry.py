"""The backend registry with simulated installed plugins (``*.dist-info`` on ``sys.path``).

Rules proven here (issue 6, part 2; issue 26: names map to DialectSupport classes):

* an installed plugin's entry point names its ``DialectSupport`` subclass, whose
  ``store_class`` is what ``open_store`` opens (imported only then);
* an entry point that still names a store class works, with a DeprecationWarning;
* ``register()`` beats entry points, also when two plugins claim a name;
* two distributions claiming one name is an error naming both, raised only
  for that name: every other backend still loads;
* a plugin that fails to import is listed by ``available_backends()`` and
  ``chatflow-sqlalchemy backends`` with its error, and breaks nothing else;
* an unknown dialect lists the installed backends; a missing driver names
  the extra to install.
"""

from __future__ import annotations

import json
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
    SQLAlchemySessionStore,
    available_backends,
    open_store,
    register,
)
from chatflow_sqlalchemy.backend import DialectSupport
from chatflow_sqlalchemy.backends.postgresql import PostgresDialectSupport
from chatflow_sqlalchemy.backends.sqlite import SQLiteDialectSupport, SQLiteSessionStore
from chatflow_sqlalchemy.cli import main
from chatflow_sqlalchemy.registry import (
    ENTRY_POINT_GROUP,
    backend_sources,
    load_backend,
    store_class_for,
    support_for,
    unregister,
)
from tests.fake_dists import unique_module, write_dist, write_module

BACKEND_SOURCE = """
from chatflow_sqlalchemy.backend import DialectSupport


class {cls}Store:
    opened = []

    @classmethod
    def from_url(cls, url, **kwargs):
        cls.opened.append((str(url), kwargs))
        return (cls.__name__, str(url), kwargs)


class {cls}(DialectSupport):
    store_class = __name__ + ":{cls}Store"
"""

LEGACY_SOURCE = """
from chatflow_sqlalchemy.backends.sqlite import SQLiteDialectSupport


class OldStore:
    dialect_support = SQLiteDialectSupport()

    @classmethod
    def from_url(cls, url, **kwargs):
        return ("OldStore", str(url), kwargs)
"""


class Opens:
    """A store class for ``register()`` tests: ``from_url`` answers its argument."""

    @classmethod
    def from_url(cls, url: Any, **kwargs: Any) -> str:
        return f"opened {url}"


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
        """A distribution whose module defines a backend per name.

        ``names`` maps backend name -> DialectSupport class name (its store
        class is that name + ``Store``). Returns the module name.
        """
        module = unique_module(dist.replace("-", "_"))
        body = source if source is not None else "".join(
            BACKEND_SOURCE.format(cls=cls) for cls in sorted(set(names.values()))
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
    for name in ("fakedb", "clash", "postgres", "sqlite", "olddb"):
        unregister(name)


def test_entry_point_serves_its_dialect(plugins: Plugins) -> None:
    module = plugins.backend("chatflow-sqlalchemy-fakedb", {"fakedb": "Fake"})
    cls = load_backend("fakedb")
    assert cls.__module__ == module and cls.__name__ == "Fake"
    assert issubclass(cls, DialectSupport)
    assert open_store("fakedb://host/chat", default_max_turns=3) == (
        "FakeStore",
        "fakedb://host/chat",
        {"default_max_turns": 3},
    )
    assert store_class_for("fakedb").__name__ == "FakeStore"
    assert available_backends()["fakedb"] is cls
    assert available_backends()["sqlite"] is SQLiteDialectSupport
    support = support_for("fakedb")
    assert type(support) is cls and support_for("fakedb") is support  # one shared instance
    source = backend_sources()["fakedb"]
    assert source.distributions == ("chatflow-sqlalchemy-fakedb 1.0",)
    assert source.target == f"{module}:Fake"


def test_register_beats_entry_points(plugins: Plugins) -> None:
    plugins.backend("chatflow-sqlalchemy-fakedb", {"fakedb": "Fake"})

    class Chosen(DialectSupport):
        store_class = Opens

    register("fakedb", Chosen)
    assert load_backend("fakedb") is Chosen
    assert open_store("fakedb://x") == "opened fakedb://x"
    assert backend_sources()["fakedb"].origin == "register()"
    assert backend_sources()["fakedb"].target == f"{__name__}:{Chosen.__qualname__}"
    unregister("fakedb")
    assert load_backend("fakedb").__name__ == "Fake"


def test_register_by_import_path_is_lazy(plugins: Plugins) -> None:
    module = plugins.backend("chatflow-sqlalchemy-fakedb", {"fakedb": "Fake"})
    register("clash", f"{module}:Fake")
    assert load_backend("clash").__name__ == "Fake"
    register("clash", f"{module}:NoSuchClass")
    with pytest.raises(BackendImportError, match="NoSuchClass"):
        load_backend("clash")


def test_the_store_class_is_imported_only_when_a_store_is_opened(plugins: Plugins) -> None:
    source = (
        "from chatflow_sqlalchemy.backend import DialectSupport\n\n"
        "class Broken(DialectSupport):\n"
        "    store_class = 'no_such_module_for_chatflow_tests:Store'\n"
    )
    plugins.backend("chatflow-sqlalchemy-broken", {"broken": "Broken"}, source=source)
    assert available_backends()["broken"].__name__ == "Broken"  # type: ignore[union-attr]
    with pytest.raises(BackendImportError) as info:
        open_store("broken://db")
    message = str(info.value)
    assert "no_such_module_for_chatflow_tests" in message and "store_class of" in message


def test_two_distributions_claiming_one_name(
    plugins: Plugins, capsys: pytest.CaptureFixture[str]
) -> None:
    first = plugins.backend("vendor-one", {"clash": "One"})
    second = plugins.backend("vendor-two", {"clash": "Two"}, version="2.5")
    plugins.backend("chatflow-sqlalchemy-fine", {"fakedb": "Fine"})
    with pytest.raises(DuplicateBackendError) as info:
        load_backend("clash")
    message = str(info.value)
    assert "vendor-one 1.0" in message and "vendor-two 2.5" in message
    assert f"{first}:One" in message and f"{second}:Two" in message
    assert "register(" in message
    with pytest.raises(DuplicateBackendError):
        open_store("clash://db")
    # only that name is broken: every other backend still loads
    backends = available_backends()
    assert isinstance(backends["clash"], DuplicateBackendError)
    assert backends["fakedb"].__name__ == "Fine"  # type: ignore[union-attr]
    assert backends["sqlite"] is SQLiteDialectSupport
    assert backend_sources()["clash"].distributions == ("vendor-one 1.0", "vendor-two 2.5")
    # register() is how a user chooses between them
    register("clash", f"{second}:Two")
    assert load_backend("clash").__name__ == "Two"
    assert open_store("clash://db")[0] == "TwoStore"  # type: ignore[index]
    unregister("clash")
    # the CLI lists the conflict and keeps going
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    clash_line = next(line for line in out.splitlines() if line.startswith("clash"))
    assert "unavailable" in clash_line and "vendor-one" in clash_line
    assert "vendor-one 1.0 + vendor-two 2.5" in clash_line
    lines = out.splitlines()
    sqlite_line = next(line for line in lines if line.startswith("sqlite"))
    assert "SQLiteSessionStore" in sqlite_line and "SQLiteDialectSupport" in sqlite_line
    fine_line = next(line for line in lines if line.startswith("fakedb"))
    assert "chatflow-sqlalchemy-fine 1.0" in fine_line
    assert "FineStore" in fine_line and ".Fine" in fine_line


def test_plugin_that_fails_to_import_is_reported(
    plugins: Plugins, capsys: pytest.CaptureFixture[str]
) -> None:
    plugins.backend(
        "chatflow-sqlalchemy-crashy",
        {"crashy": "Support"},
        source="raise RuntimeError('boom at import')\n",
    )
    plugins.backend(
        "chatflow-sqlalchemy-nodriver",
        {"nodriver": "Support"},
        source="import no_such_driver_for_chatflow_tests\n",
    )
    plugins.backend(
        "chatflow-sqlalchemy-extra",
        {"extradb": "Support"},
        source="import no_such_fast_driver\n",
        extras=" [fast]",
    )
    plugins.backend("chatflow-sqlalchemy-fakedb", {"fakedb": "Fake"})
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
    assert backends["fakedb"].__name__ == "Fake"  # type: ignore[union-attr]
    assert backends["sqlite"] is SQLiteDialectSupport
    assert backends["postgresql"] is PostgresDialectSupport
    with pytest.raises(BackendImportError, match="boom at import") as info:
        open_store("crashy://db")
    assert isinstance(info.value, ImportError)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "crashy" in out and "boom at import" in out
    assert "FakeStore" in out


def test_entry_point_that_is_not_a_backend(plugins: Plugins) -> None:
    plugins.backend("chatflow-sqlalchemy-odd", {"odd": "make"}, source="def make():\n    pass\n")
    with pytest.raises(BackendImportError, match="not a DialectSupport subclass"):
        load_backend("odd")


def test_a_support_whose_store_class_is_not_a_store(plugins: Plugins) -> None:
    class NoStore(DialectSupport):
        store_class = int

    register("clash", NoStore)
    with pytest.raises(BackendImportError, match="not a session store class"):
        open_store("clash://db")


def test_entry_point_naming_a_store_class_is_deprecated_but_works(plugins: Plugins) -> None:
    """Until the next release: the store class stands for its support, opening it."""
    module = plugins.backend(
        "chatflow-sqlalchemy-old", {"olddb": "OldStore"}, source=LEGACY_SOURCE
    )
    with pytest.warns(DeprecationWarning, match=r"olddb.*names a store class"):
        backend = load_backend("olddb")
    assert issubclass(backend, SQLiteDialectSupport)
    assert backend.store_class.__name__ == "OldStore"  # type: ignore[union-attr]
    with pytest.warns(DeprecationWarning):
        assert open_store("olddb://db") == ("OldStore", "olddb://db", {})
    with pytest.warns(DeprecationWarning):
        assert load_backend("olddb") is backend  # the same class each time
    assert backend_sources()["olddb"].target == f"{module}:OldStore"


def test_register_with_a_store_class_is_deprecated_but_works() -> None:
    register("clash", Opens)  # type: ignore[arg-type]
    with pytest.warns(DeprecationWarning, match="names a store class"):
        assert open_store("clash://db") == "opened clash://db"


def test_unknown_dialect_lists_installed_backends(plugins: Plugins) -> None:
    plugins.backend("chatflow-sqlalchemy-fakedb", {"fakedb": "Fake"})
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
    assert load_backend("sqlite") is SQLiteDialectSupport
    warning = "\n".join(r.getMessage() for r in caplog.records)
    assert "sqlite-hijack" in warning and "built into" in warning
    assert backend_sources()["sqlite"].origin == "built-in"


def test_exact_name_first_then_alias() -> None:
    assert load_backend("postgres") is PostgresDialectSupport

    class Exact(DialectSupport):
        store_class = Opens

    register("postgres", Exact)
    assert load_backend("postgres") is Exact
    assert open_store("postgres://h/db") == "opened postgres://h/db"


def test_builtins_open_their_own_store_classes(tmp_path: Path) -> None:
    """Each built-in support names its store class; the generic store asks the registry."""
    assert store_class_for("sqlite") is SQLiteSessionStore
    assert store_class_for("postgresql").__name__ == "PostgresSessionStore"
    assert store_class_for("postgres").__name__ == "PostgresSessionStore"
    store = open_store(f"sqlite:///{tmp_path / 'chat.db'}")
    try:
        assert type(store) is SQLiteSessionStore
    finally:
        store.close()
    generic = SQLAlchemySessionStore(f"sqlite:///{tmp_path / 'generic.db'}")
    try:
        assert generic.support is support_for("sqlite")
        assert isinstance(generic.support, SQLiteDialectSupport)
    finally:
        generic.close()


def test_cli_backends_json_names_the_store_class(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)["backends"]}
    assert rows["sqlite"]["store_class"] == (
        "chatflow_sqlalchemy.backends.sqlite.SQLiteSessionStore"
    )
    assert rows["sqlite"]["detail"] == (
        "chatflow_sqlalchemy.backends.sqlite_dialect.SQLiteDialectSupport"
    )
    assert rows["sqlite"]["from"] == "built-in" and rows["sqlite"]["available"] is True


def test_missing_driver_names_the_extra() -> None:
    # A fresh interpreter where psycopg cannot be imported (as without the extra).
    code = (
        "import sys\n"
        "sys.modules['psycopg'] = None\n"
        "from chatflow_sqlalchemy import BackendImportError, available_backends, open_store\n"
        "error = available_backends()['postgresql']\n"
        "assert isinstance(error, BackendImportError), error\n"
        "assert available_backends()['sqlite'].__name__ == 'SQLiteDialectSupport'\n"
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


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception linked to it (cause and context), as a debugger walks them."""
    found: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop()
        if current is not None and not any(current is seen for seen in found):
            found.append(current)
            todo += [current.__cause__, current.__context__]
    return found


def test_a_backend_import_error_links_no_private_exception(plugins: Plugins) -> None:
    """Each public path raises BackendImportError linked only to the real failure.

    The registry's internal reason must not ride along as ``__context__`` (a
    debugger, a log handler or Sentry walking the chain would show a private class).
    """
    class LostStore(DialectSupport):
        store_class = "no_such_module_for_chatflow_tests:Store"

    register("fakedb", "no_such_module_for_chatflow_tests:Support")
    register("clash", LostStore)
    register("olddb", int)  # type: ignore[arg-type]
    failing = [
        lambda: load_backend("fakedb"),
        lambda: support_for("fakedb"),
        lambda: load_backend("olddb"),
        lambda: store_class_for("clash"),
        lambda: open_store("clash://db"),
    ]
    for run in failing:
        with pytest.raises(BackendImportError) as caught:
            run()
        linked = [type(e) for e in _chain(caught.value)[1:]]
        assert all(issubclass(t, ImportError) for t in linked), linked
    error = available_backends()["fakedb"]
    assert isinstance(error, BackendImportError)
    assert isinstance(error.__cause__, ModuleNotFoundError)
    assert all(isinstance(e, ImportError) for e in _chain(error)), _chain(error)
