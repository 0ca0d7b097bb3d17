"""Backend registry: which store class serves which database dialect.

Lookup order, as in SQLAlchemy's dialect registry: names registered at run
time with :func:`register`, then the built-in backends, then the entry-point
group ``chatflow_sqlalchemy.backends`` that third-party packages declare::

    [project.entry-points."chatflow_sqlalchemy.backends"]
    mysql = "chatflow_sqlalchemy_mariadb:MariaDBSessionStore"
    mariadb = "chatflow_sqlalchemy_mariadb:MariaDBSessionStore"

Rules:

* :func:`register` wins over everything, also over two plugins that claim
  the same name (it is how a user chooses between them).
* Built-in names (``sqlite``, ``postgresql``) are served by this package; a
  plugin claiming one is ignored with a warning.
* Two installed distributions claiming one name is a
  :class:`~chatflow_sqlalchemy.exceptions.DuplicateBackendError` naming both,
  raised only when that name is used: the other backends keep working.
* Targets are imported lazily; a backend that fails to import is reported by
  :func:`available_backends` with its error (naming what to install) and
  never breaks the others.
* The exact dialect name is looked up first, then its alias
  (``mariadb`` → ``mysql``, ``postgres`` → ``postgresql``).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re
import threading
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any

from sqlalchemy import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from chatflow_sqlalchemy.exceptions import (
    BackendImportError,
    BackendNotFoundError,
    DuplicateBackendError,
)
from chatflow_sqlalchemy.urls import ALIASES, URL_EXAMPLES, parse_database_url

if TYPE_CHECKING:
    from chatflow_sqlalchemy.store import SQLAlchemySessionStore

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendSource",
    "available_backends",
    "backend_name_for_url",
    "backend_sources",
    "load_backend",
    "open_store",
    "register",
    "unregister",
]

logger = logging.getLogger("chatflow_sqlalchemy")

ENTRY_POINT_GROUP = "chatflow_sqlalchemy.backends"

CORE_DISTRIBUTION = "chatflow-sqlalchemy"

_BUILTINS: dict[str, tuple[str, str | None]] = {
    "sqlite": ("chatflow_sqlalchemy.backends.sqlite:SQLiteSessionStore", None),
    "postgresql": ("chatflow_sqlalchemy.backends.postgresql:PostgresSessionStore", "postgres"),
}
"""name -> (import target, pip extra of chatflow-sqlalchemy that provides its driver)."""

_BUILTIN_DRIVERS = {"postgresql": "psycopg"}
"""name -> the driver module a built-in backend needs (its module imports without it)."""

_KNOWN_PLUGINS = {"mysql": "chatflow-sqlalchemy-mariadb"}
"""name -> the published distribution that provides it (after aliasing)."""

_registered: dict[str, str | type[SQLAlchemySessionStore]] = {}
_lock = threading.Lock()
_warned_shadowed: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class BackendSource:
    """Where a backend name comes from (for listings such as ``chatflow-sqlalchemy backends``).

    Attributes:
        name: The backend name.
        origin: ``"register()"``, ``"built-in"`` or ``"entry point"``.
        distributions: The distributions that declare it (two or more: a conflict).
        target: ``"module:attr"`` of the store class, when known.

    """

    name: str
    origin: str
    distributions: tuple[str, ...]
    target: str | None


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
    """The backend name a URL selects: its dialect name (``mysql+pymysql://`` → ``mysql``)."""
    return make_url(url).get_backend_name()


# --------------------------------------------------------------------------- entry points


def _normalise(dist_name: str) -> str:
    return re.sub(r"[-_.]+", "-", dist_name).lower()


def _dist_name(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return str(dist.name) if dist is not None else "<unknown distribution>"


def _dist_label(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "<unknown distribution>"
    return f"{dist.name} {dist.version}"


def _is_core(ep: EntryPoint) -> bool:
    return _normalise(_dist_name(ep)) == CORE_DISTRIBUTION


def _entry_points() -> dict[str, list[EntryPoint]]:
    """Third-party entry points by name, one per distribution (ours left out)."""
    found: dict[str, list[EntryPoint]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if _is_core(ep) and ep.name in _BUILTINS:
            continue  # our own declaration of a built-in
        claims = found.setdefault(ep.name, [])
        if all(_normalise(_dist_name(ep)) != _normalise(_dist_name(c)) for c in claims):
            claims.append(ep)
    return found


def _warn_shadowed(name: str, claims: list[EntryPoint]) -> None:
    for ep in claims:
        key = (name, _dist_name(ep))
        if key not in _warned_shadowed:
            _warned_shadowed.add(key)
            logger.warning(
                "backend %r of %s (%s) is ignored: %r is built into chatflow-sqlalchemy; "
                "call chatflow_sqlalchemy.register(%r, %r) to use it instead",
                name,
                _dist_label(ep),
                ep.value,
                name,
                name,
                ep.value,
            )


def _single_claim(name: str, claims: list[EntryPoint]) -> EntryPoint:
    if len(claims) > 1:
        listing = " and ".join(f"{_dist_label(ep)} ({ep.value})" for ep in claims)
        raise DuplicateBackendError(
            f"backend {name!r} is registered by {len(claims)} distributions: {listing}; "
            f"uninstall all but one of them, or choose one with "
            f"chatflow_sqlalchemy.register({name!r}, 'module:StoreClass')"
        )
    return claims[0]


# --------------------------------------------------------------------------- importing


def _import_target(
    name: str, target: str, hint: str
) -> type[SQLAlchemySessionStore]:
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split(".") if attr else ():
            obj = getattr(obj, part)
    except Exception as exc:  # any import-time failure of a plugin is reported the same way
        raise BackendImportError(
            f"backend {name!r} ({target}) cannot be imported: "
            f"{type(exc).__name__}: {exc}; {hint}"
        ) from exc
    if not isinstance(obj, type) or not callable(getattr(obj, "from_url", None)):
        raise BackendImportError(
            f"backend {name!r} ({target}) is not a session store class (it has no from_url); "
            f"{hint}"
        )
    return obj


def _builtin_hint(extra: str | None) -> str:
    if extra:
        return f"install its driver: pip install 'chatflow-sqlalchemy[{extra}]'"
    return "reinstall chatflow-sqlalchemy"


def _require_driver(name: str, driver: str | None, extra: str | None) -> None:
    """Raise :class:`BackendImportError` when a built-in backend's driver is missing."""
    if driver is None:
        return
    try:
        found = importlib.util.find_spec(driver) is not None
    except (ImportError, ValueError):  # a module blocked in sys.modules
        found = False
    if not found:
        raise BackendImportError(
            f"backend {name!r} needs the {driver} driver, which is not installed; "
            f"{_builtin_hint(extra)}"
        )


def _entry_point_hint(ep: EntryPoint) -> str:
    dist = _dist_name(ep)
    if ep.extras:
        return f"install its driver: pip install '{dist}[{','.join(ep.extras)}]'"
    return f"reinstall it with its dependencies: pip install --force-reinstall '{dist}'"


def _lookup(name: str) -> type[SQLAlchemySessionStore] | None:
    """Load backend ``name`` exactly (no alias); None when nothing provides it."""
    with _lock:
        target = _registered.get(name)
    if target is not None and not isinstance(target, str):
        return target
    if target is not None:
        return _import_target(name, target, "fix the target given to register()")
    if name in _BUILTINS:
        builtin, extra = _BUILTINS[name]
        shadowing = _entry_points().get(name)
        if shadowing:
            _warn_shadowed(name, shadowing)
        backend = _import_target(name, builtin, _builtin_hint(extra))
        _require_driver(name, _BUILTIN_DRIVERS.get(name), extra)
        return backend
    claims = _entry_points().get(name)
    if not claims:
        return None
    ep = _single_claim(name, claims)
    return _import_target(name, ep.value, _entry_point_hint(ep))


def load_backend(name: str) -> type[SQLAlchemySessionStore]:
    """Return the store class for backend ``name`` (its alias is tried if nothing has it).

    Raises:
        BackendNotFoundError: No backend of that name is installed (lists installed ones).
        BackendImportError: It is installed but cannot be imported (names what to install).
        DuplicateBackendError: Two distributions claim the name (names both).

    """
    backend = _lookup(name)
    if backend is None and name in ALIASES:
        backend = _lookup(ALIASES[name])
    if backend is None:
        raise BackendNotFoundError(name, installed=_names(), fix=_not_found_fix(name))
    return backend


def _not_found_fix(name: str) -> str | None:
    """What to do about a name no backend serves: its plugin, or a URL that is a database's."""
    plugin = _KNOWN_PLUGINS.get(ALIASES.get(name, name))
    if plugin is not None:
        return f"install its plugin: pip install {plugin}"
    try:
        make_url(f"{name}://").get_dialect()
    except (NoSuchModuleError, ArgumentError):
        return f"{name!r} is not a database SQLAlchemy knows; URLs look like: {URL_EXAMPLES}"
    return None


def _names() -> list[str]:
    with _lock:
        names = set(_registered)
    names.update(_BUILTINS)
    names.update(_entry_points())
    return sorted(names)


def backend_sources() -> dict[str, BackendSource]:
    """Where each installed backend name comes from, without importing anything."""
    eps = _entry_points()
    with _lock:
        registered = dict(_registered)
    sources: dict[str, BackendSource] = {}
    for name in _names():
        if name in registered:
            target = registered[name]
            if isinstance(target, str):
                text = target
            else:
                text = f"{target.__module__}:{target.__qualname__}"
            sources[name] = BackendSource(name, "register()", (), text)
        elif name in _BUILTINS:
            sources[name] = BackendSource(
                name, "built-in", (CORE_DISTRIBUTION,), _BUILTINS[name][0]
            )
        else:
            claims = eps[name]
            sources[name] = BackendSource(
                name,
                "entry point",
                tuple(_dist_label(ep) for ep in claims),
                claims[0].value if len(claims) == 1 else None,
            )
    return sources


def available_backends() -> dict[str, type[SQLAlchemySessionStore] | Exception]:
    """Every installed backend: its loaded class, or the error that prevented loading."""
    result: dict[str, type[SQLAlchemySessionStore] | Exception] = {}
    for name in _names():
        try:
            result[name] = load_backend(name)
        except Exception as exc:  # reported, never raised: one broken plugin must not hide others
            result[name] = exc
    return result


def open_store(url: str | URL | None = None, **kwargs: Any) -> SQLAlchemySessionStore:
    """Open a session store for ``url``, picking the backend by its dialect.

    Without ``url``, ``$CHATFLOW_DATABASE_URL`` is used, else
    ``sqlite:///chatflow.db``, as in the CLI. ``postgresql://`` URLs use
    psycopg 3. Keyword arguments go to the backend's ``from_url`` (e.g.
    ``default_max_turns``, ``dedup_ttl_hours``).

    Raises:
        DatabaseURLError: The URL cannot mean a database (the message gives the fix).
        BackendNotFoundError: The dialect has no installed backend (lists installed ones).
        BackendImportError: Its driver is missing (names the extra to install).
        DuplicateBackendError: Two installed plugins claim the dialect.

    """
    parsed = parse_database_url(url)
    return load_backend(parsed.get_backend_name()).from_url(parsed, **kwargs)
