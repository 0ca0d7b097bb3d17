"""Backend registry: which :class:`~chatflow_sqlalchemy.dialect.DialectSupport` serves a dialect.

Lookup order: :func:`register` (wins over everything), the built-ins (a
plugin claiming one is ignored with a warning), then the entry-point group
``chatflow_sqlalchemy.backends``; two distributions claiming one name raise
:class:`~chatflow_sqlalchemy.exceptions.DuplicateBackendError` when it is
used. The exact name is tried before its alias. Targets import lazily, and
one that fails never breaks the others. A target that is a store class (pre
0.3) still works, with a :class:`DeprecationWarning`. No store is imported here.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any, TypeVar, cast

from sqlalchemy import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from chatflow_sqlalchemy.dialect import DialectSupport
from chatflow_sqlalchemy.urls import ALIASES, URL_EXAMPLES

__all__ = [
    "ENTRY_POINT_GROUP", "BackendSource", "available_backends", "backend_availability",
    "backend_name_for_url",
    "backend_sources", "load_backend", "register", "store_class_for", "support_for", "unregister",
]

logger = logging.getLogger("chatflow_sqlalchemy")

ENTRY_POINT_GROUP = "chatflow_sqlalchemy.backends"

CORE_DISTRIBUTION = "chatflow-sqlalchemy"

_BUILTINS: dict[str, tuple[str, str | None, str | None]] = {
    "sqlite": ("chatflow_sqlalchemy.backends.sqlite_dialect:SQLiteDialectSupport", None, None),
    "postgresql": (
        "chatflow_sqlalchemy.backends.postgresql_dialect:PostgresDialectSupport",
        "postgres",
        "psycopg",
    ),
}
"""name -> (import target, pip extra of chatflow-sqlalchemy that provides its driver, the
driver module it needs: its module imports without it)."""

_KNOWN_PLUGINS = {"mysql": "chatflow-sqlalchemy-mariadb"}
"""name -> the published distribution that provides it (after aliasing)."""

_registered: dict[str, str | type[DialectSupport]] = {}
_lock = threading.Lock()
_warned_shadowed: set[tuple[str, str]] = set()
_instances: dict[type[DialectSupport], DialectSupport] = {}
"""One shared instance per support class (supports hold no state)."""
_of_store_classes: dict[type[Any], type[DialectSupport]] = {}
"""The support class standing for each store class a deprecated target named."""


@dataclass(frozen=True)
class BackendSource:
    """Where a backend name comes from (``chatflow-sqlalchemy backends`` lists them).

    Attributes:
        name: The backend name.
        origin: ``"register()"``, ``"built-in"`` or ``"entry point"``.
        distributions: The distributions that declare it (two or more: a conflict).
        target: ``"module:attr"`` of the backend's DialectSupport class, when known.

    """

    name: str
    origin: str
    distributions: tuple[str, ...]
    target: str | None


def register(name: str, target: str | type[DialectSupport]) -> None:
    """Register a backend at run time; it wins over built-ins and entry points.

    Args:
        name: Dialect name (``make_url(url).get_backend_name()``).
        target: The backend's :class:`~chatflow_sqlalchemy.dialect.DialectSupport`
            subclass, or ``"module:Class"`` to import it lazily (a store class:
            deprecated, with a warning).

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
    return f"{dist.name} {dist.version}" if dist is not None else "<unknown distribution>"


def _entry_points() -> dict[str, list[EntryPoint]]:
    """Third-party entry points by name, one per distribution (ours left out)."""
    found: dict[str, list[EntryPoint]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _BUILTINS and _normalise(_dist_name(ep)) == CORE_DISTRIBUTION:
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
                name, _dist_label(ep), ep.value, name, name, ep.value,
            )


def _single_claim(name: str, claims: list[EntryPoint]) -> EntryPoint:
    if len(claims) > 1:
        listing = " and ".join(f"{_dist_label(ep)} ({ep.value})" for ep in claims)
        from chatflow_sqlalchemy.exceptions import DuplicateBackendError

        raise DuplicateBackendError(
            f"backend {name!r} is registered by {len(claims)} distributions: {listing}; "
            f"uninstall all but one of them, or choose one with "
            f"chatflow_sqlalchemy.register({name!r}, 'module:DialectSupportClass')"
        )
    return claims[0]


# --------------------------------------------------------------------------- importing


class _Unavailable(Exception):
    """Why a backend cannot be loaded, inside this module.

    The public functions raise it as ``BackendImportError``, whose module loads
    chatflow-agent; :func:`backend_availability` gives its text without that.
    """

    def public(self) -> Exception:
        from chatflow_sqlalchemy.exceptions import BackendImportError

        return BackendImportError(str(self))


_T = TypeVar("_T")


def _publicly(run: Callable[[], _T]) -> _T:
    """``run()``, an :class:`_Unavailable` raised as ``BackendImportError``.

    Raised outside the handler, so the private reason is not its
    ``__context__``: the error links to the real failure only, as when the
    registry raised ``BackendImportError`` itself.
    """
    try:
        return run()
    except _Unavailable as exc:
        failed = exc
    error = failed.public().with_traceback(failed.__traceback__)
    error.__context__ = failed.__context__
    if failed.__cause__ is None:
        raise error
    raise error from failed.__cause__


def _import(name: str, target: str, hint: str) -> Any:
    """The object ``"module:attr"`` names; any failure is a :class:`BackendImportError`."""
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split(".") if attr else ():
            obj = getattr(obj, part)
    except Exception as exc:  # any import-time failure of a plugin is reported the same way
        raise _Unavailable(
            f"backend {name!r} ({target}) cannot be imported: "
            f"{type(exc).__name__}: {exc}; {hint}"
        ) from exc
    return obj


def _is_store_class(obj: Any) -> bool:
    return isinstance(obj, type) and callable(getattr(obj, "from_url", None))


def _as_support(name: str, obj: Any, target: str, hint: str) -> type[DialectSupport]:
    """``obj`` checked to be a backend: a DialectSupport subclass (or, deprecated, a store)."""
    if isinstance(obj, type) and issubclass(obj, DialectSupport):
        return obj
    if _is_store_class(obj):
        warnings.warn(
            f"backend {name!r} ({target}) names a store class; name its DialectSupport "
            "subclass instead, with store_class set to the store class (store classes "
            "are accepted until the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return _support_of_store(obj)
    raise _Unavailable(
        f"backend {name!r} ({target}) is not a DialectSupport subclass; {hint}"
    )


def _support_of_store(store: type[Any]) -> type[DialectSupport]:
    """The support class a store class stands for: its support's class, opening it."""
    with _lock:
        found = _of_store_classes.get(store)
        if found is None:
            given = getattr(store, "dialect_support", None)
            base = type(given) if isinstance(given, DialectSupport) else DialectSupport
            found = cast(type[DialectSupport], type(base.__name__, (base,), {
                "store_class": store,
                "__module__": base.__module__,
                "__qualname__": base.__qualname__,
            }))
            _of_store_classes[store] = found
        return found


def _import_target(name: str, target: str, hint: str) -> type[DialectSupport]:
    return _as_support(name, _import(name, target, hint), target, hint)


def _target_text(target: str | type[Any]) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


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
        raise _Unavailable(
            f"backend {name!r} needs the {driver} driver, which is not installed; "
            f"{_builtin_hint(extra)}"
        )


def _entry_point_hint(ep: EntryPoint) -> str:
    dist = _dist_name(ep)
    if ep.extras:
        return f"install its driver: pip install '{dist}[{','.join(ep.extras)}]'"
    return f"reinstall it with its dependencies: pip install --force-reinstall '{dist}'"


def _lookup(name: str) -> type[DialectSupport] | None:
    """Load backend ``name`` exactly (no alias); None when nothing provides it."""
    with _lock:
        target = _registered.get(name)
    if target is not None and not isinstance(target, str):
        hint = "pass register() a DialectSupport subclass"
        return _as_support(name, target, _target_text(target), hint)
    if target is not None:
        return _import_target(name, target, "fix the target given to register()")
    if name in _BUILTINS:
        builtin, extra, driver = _BUILTINS[name]
        shadowing = _entry_points().get(name)
        if shadowing:
            _warn_shadowed(name, shadowing)
        backend = _import_target(name, builtin, _builtin_hint(extra))
        _require_driver(name, driver, extra)
        return backend
    claims = _entry_points().get(name)
    if not claims:
        return None
    ep = _single_claim(name, claims)
    return _import_target(name, ep.value, _entry_point_hint(ep))


def load_backend(name: str) -> type[DialectSupport]:
    """Return the DialectSupport class of backend ``name`` (its alias is tried if nothing has it).

    Raises:
        BackendNotFoundError: No backend of that name is installed (lists installed ones).
        BackendImportError: It is installed but cannot be imported (names what to install).
        DuplicateBackendError: Two distributions claim the name (names both).

    """
    backend = _publicly(lambda: _lookup(name))
    if backend is None and name in ALIASES:
        backend = _publicly(lambda: _lookup(ALIASES[name]))
    if backend is None:
        from chatflow_sqlalchemy.exceptions import BackendNotFoundError

        raise BackendNotFoundError(name, installed=_names(), fix=_not_found_fix(name))
    return backend


def support_for(dialect_name: str) -> DialectSupport:
    """The dialect hooks of backend ``dialect_name``: one shared instance of its class."""
    backend = load_backend(dialect_name)
    with _lock:
        found = _instances.get(backend)
    if found is None:
        found = backend()
        with _lock:
            found = _instances.setdefault(backend, found)
    return found


def store_class_for(name: str) -> type[Any]:
    """The store class backend ``name`` opens (its support's ``store_class``), imported.

    Raises:
        BackendImportError: The class cannot be imported, or has no ``from_url``;
            and as :func:`load_backend`.

    """
    backend = load_backend(name)
    target = backend.store_class
    hint = f"fix store_class of {backend.__module__}.{backend.__qualname__}"
    store = _publicly(lambda: _import(name, target, hint)) if isinstance(target, str) else target
    if not _is_store_class(store):
        raise _Unavailable(
            f"backend {name!r}: {_target_text(target)} is not a session store class "
            f"(it has no from_url); {hint}"
        ).public()
    return cast(type[Any], store)


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
            sources[name] = BackendSource(name, "register()", (), _target_text(registered[name]))
        elif name in _BUILTINS:
            sources[name] = BackendSource(
                name, "built-in", (CORE_DISTRIBUTION,), _BUILTINS[name][0]
            )
        else:
            claims = eps[name]
            labels = tuple(_dist_label(ep) for ep in claims)
            target = claims[0].value if len(claims) == 1 else None
            sources[name] = BackendSource(name, "entry point", labels, target)
    return sources


def available_backends() -> dict[str, type[DialectSupport] | Exception]:
    """Every installed backend: its DialectSupport class, or the error that prevented loading."""
    result: dict[str, type[DialectSupport] | Exception] = {}
    for name in _names():
        try:
            result[name] = load_backend(name)
        except Exception as exc:  # reported, never raised: one broken plugin must not hide others
            result[name] = exc
    return result


def backend_availability() -> dict[str, type[DialectSupport] | str]:
    """:func:`available_backends` with each error as its message.

    A backend whose driver or plugin cannot be imported costs no import of
    chatflow-agent here (the error classes' module loads it), so
    ``chatflow-sqlalchemy backends`` answers as quickly as the other read commands.
    """
    result: dict[str, type[DialectSupport] | str] = {}
    for name in _names():
        try:
            found = _lookup(name)
        except Exception as exc:  # reported, never raised: one broken plugin must not hide others
            result[name] = str(exc)
        else:
            if found is not None:
                result[name] = found
    return result
