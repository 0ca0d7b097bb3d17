"""Backend registry: which store class serves which database dialect.

Lookup order, as in SQLAlchemy's dialect registry: names registered at run
time with :func:`register`, then the built-in backends, then the entry-point
group ``chatflow_sqlalchemy.backends`` that third-party packages declare::

    [project.entry-points."chatflow_sqlalchemy.backends"]
    mysql = "chatflow_sqlalchemy_mariadb:MariaDBSessionStore"

Targets are imported lazily; a backend that fails to import is reported by
:func:`available_backends` with its error and never breaks the others.
"""

from __future__ import annotations

import importlib
import threading
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any

from sqlalchemy import URL, make_url

from chatflow_sqlalchemy.exceptions import (
    BackendImportError,
    BackendNotFoundError,
    DuplicateBackendError,
)

if TYPE_CHECKING:
    from chatflow_sqlalchemy.store import SQLAlchemySessionStore

__all__ = [
    "ENTRY_POINT_GROUP",
    "available_backends",
    "backend_name_for_url",
    "load_backend",
    "open_store",
    "register",
    "unregister",
]

ENTRY_POINT_GROUP = "chatflow_sqlalchemy.backends"

_BUILTINS: dict[str, tuple[str, str | None]] = {
    "sqlite": ("chatflow_sqlalchemy.backends.sqlite:SQLiteSessionStore", None),
    "postgresql": ("chatflow_sqlalchemy.backends.postgresql:PostgresSessionStore", "postgres"),
}
"""name -> (import target, pip extra that provides its driver)."""

_ALIASES = {"postgres": "postgresql", "mariadb": "mysql"}

_registered: dict[str, str | type[SQLAlchemySessionStore]] = {}
_lock = threading.Lock()


def register(name: str, target: str | type[SQLAlchemySessionStore]) -> None:
    """Register a backend at run time; it wins over built-ins and entry points.

    Args:
        name: Dialect name (``make_url(url).get_backend_name()``).
        target: The store class, or ``"module:Class"`` to import lazily.

    """
    with _lock:
        _registered[name] = target


def unregister(name: str) -> None:
    """Forget a name registered with :func:`register` (no error if absent)."""
    with _lock:
        _registered.pop(name, None)


def backend_name_for_url(url: str | URL) -> str:
    """The backend name a URL selects: its dialect, with ``postgres`` → ``postgresql``."""
    name = make_url(url).get_backend_name()
    return _ALIASES.get(name, name)


def _entry_points() -> dict[str, EntryPoint]:
    """Entry points by name; two distributions claiming one name is an error."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        previous = found.get(ep.name)
        if previous is not None and previous.value != ep.value:
            raise DuplicateBackendError(
                f"backend {ep.name!r} is registered by two distributions: "
                f"{_dist_name(previous)} ({previous.value}) and {_dist_name(ep)} ({ep.value}); "
                "uninstall one of them or call chatflow_sqlalchemy.register() to choose"
            )
        found[ep.name] = ep
    return found


def _dist_name(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return str(dist.name) if dist is not None else "<unknown distribution>"


def _import_target(name: str, target: str, extra: str | None) -> type[SQLAlchemySessionStore]:
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except ImportError as exc:
        hint = (
            f"pip install 'chatflow-sqlalchemy[{extra}]'"
            if extra
            else "reinstall the package that provides it"
        )
        raise BackendImportError(
            f"backend {name!r} ({target}) cannot be imported: {exc}; {hint}"
        ) from exc
    return obj  # type: ignore[no-any-return]


def load_backend(name: str) -> type[SQLAlchemySessionStore]:
    """Return the store class for backend ``name``.

    Raises:
        BackendNotFoundError: No backend of that name is installed.
        BackendImportError: It is installed but cannot be imported.
        DuplicateBackendError: Two distributions claim the name.

    """
    name = _ALIASES.get(name, name)
    with _lock:
        target = _registered.get(name)
    if target is not None and not isinstance(target, str):
        return target
    if target is not None:
        return _import_target(name, target, None)
    if name in _BUILTINS:
        builtin, extra = _BUILTINS[name]
        return _import_target(name, builtin, extra)
    eps = _entry_points()
    if name in eps:
        return _import_target(name, eps[name].value, None)
    raise BackendNotFoundError(name, installed=list(_names()))


def _names() -> list[str]:
    with _lock:
        names = set(_registered)
    names.update(_BUILTINS)
    try:
        names.update(_entry_points())
    except DuplicateBackendError:
        names.update(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def available_backends() -> dict[str, type[SQLAlchemySessionStore] | Exception]:
    """Every installed backend: its loaded class, or the error that prevented loading."""
    result: dict[str, type[SQLAlchemySessionStore] | Exception] = {}
    for name in _names():
        try:
            result[name] = load_backend(name)
        except Exception as exc:  # reported, never raised: one broken plugin must not hide others
            result[name] = exc
    return result


def open_store(url: str | URL, **kwargs: Any) -> SQLAlchemySessionStore:
    """Open a session store for ``url``, picking the backend by its dialect.

    ``postgresql://`` URLs use psycopg 3. Keyword arguments go to the
    backend's ``from_url`` (e.g. ``default_max_turns``, ``dedup_ttl_hours``).

    Raises:
        BackendNotFoundError: The dialect has no installed backend (lists installed ones).
        BackendImportError: Its driver is missing (names the extra to install).

    """
    return load_backend(backend_name_for_url(url)).from_url(url, **kwargs)
