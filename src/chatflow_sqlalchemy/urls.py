"""Database URLs: read one, and refuse what it cannot mean before anything is opened.

``sqlite://chat.db`` (two slashes) would be an in-memory database, silently
losing the history; every entry point reads its URL through
:func:`parse_database_url`, so all refuse the same URLs with the same fix.
Tools map URLs here without importing any store.
"""

from __future__ import annotations

import os

from sqlalchemy import URL, make_url
from sqlalchemy import exc as sa_exc

__all__ = [
    "ALIASES", "DEFAULT_DATABASE_URL", "URL_EXAMPLES", "parse_database_url", "psycopg_url",
    "quoted_url", "require_backend",
]

DEFAULT_DATABASE_URL = "sqlite:///chatflow.db"
"""The URL used when none is given and ``$CHATFLOW_DATABASE_URL`` is unset."""

ALIASES = {"postgres": "postgresql", "mariadb": "mysql"}
"""Dialect names served by the backend of another name."""

URL_EXAMPLES = (
    "sqlite:///chat.db (a file beside the program), sqlite:////var/lib/bot/chat.db "
    "(an absolute path), postgresql+psycopg://user:password@host/dbname"
)


def parse_database_url(url: str | URL | None = None) -> URL:
    """The URL to open: ``url``, else ``$CHATFLOW_DATABASE_URL``, else ``sqlite:///chatflow.db``.

    Raises:
        DatabaseURLError: ``url`` is not a database URL, or is a SQLite URL with two
            slashes (which would open an in-memory database). The message gives the
            URL to write instead.

    """
    raw = url or os.environ.get("CHATFLOW_DATABASE_URL") or DEFAULT_DATABASE_URL
    if isinstance(raw, str) and "://" not in raw:
        raise _url_error(
            f"{raw!r} is not a database URL; for a SQLite file write 'sqlite:///{raw}' "
            f"(or open SQLiteSessionStore({raw!r})); URLs look like: {URL_EXAMPLES}"
        )
    try:
        parsed = make_url(raw)
    except (sa_exc.ArgumentError, ValueError) as exc:
        reason = "the port is not a number" if "int()" in str(exc) else str(exc)
        raise _url_error(
            f"cannot read the database URL {quoted_url(raw)}: {reason}; "
            f"URLs look like: {URL_EXAMPLES}"
        ) from None
    if parsed.get_backend_name() == "sqlite":
        _refuse_sqlite_host(parsed)
    return parsed


def require_backend(url: URL, backend: str, store: str) -> None:
    """Refuse ``url`` unless its dialect is ``backend``, naming the store that fits it.

    Raises:
        DatabaseURLError: The URL is for another database than ``store`` serves.

    """
    name = url.get_backend_name()
    if ALIASES.get(name, name) != backend:
        raise _url_error(
            f"{store} opens {backend} databases, not {quoted_url(url)}; open any URL with "
            f"chatflow_sqlalchemy.open_store(url), which picks the store for its database"
        )


def psycopg_url(url: str | URL) -> URL:
    """Map ``postgresql://`` / ``postgres://`` URLs to the psycopg 3 driver.

    Raises:
        DatabaseURLError: ``url`` is not a PostgreSQL URL, or names another driver
            (the store runs on psycopg 3 only).

    """
    parsed = parse_database_url(str(url).replace("postgres://", "postgresql://", 1)
                                if isinstance(url, str) else url)
    require_backend(parsed, "postgresql", "PostgresSessionStore")
    if parsed.drivername in ("postgresql", "postgres"):
        return parsed.set(drivername="postgresql+psycopg")
    if parsed.drivername != "postgresql+psycopg":
        driver = parsed.drivername.partition("+")[2]
        raise _url_error(
            f"the PostgreSQL store runs on psycopg 3, not {driver}: write the URL as "
            f"{parsed.set(drivername='postgresql+psycopg').render_as_string()!r}"
        )
    return parsed


def _refuse_sqlite_host(url: URL) -> None:
    if not (url.host or url.port or url.username):
        return
    name = url.host or ""
    raise _url_error(
        f"{quoted_url(url)} has two slashes, so SQLite would open an in-memory database and "
        f"keep nothing; write 'sqlite:///{name}' for a file beside the program, "
        f"'sqlite:////path/to/{name or 'chat.db'}' for an absolute path, or 'sqlite://' "
        "for an in-memory database"
    )


def quoted_url(url: str | URL) -> str:
    """The URL in quotes, without its password, for messages."""
    try:
        text = make_url(url).render_as_string(hide_password=True)
    except (sa_exc.ArgumentError, ValueError):
        text = "<unreadable URL>" if "@" in str(url) else str(url)
    return repr(text)


def _url_error(message: str) -> Exception:
    """A ``DatabaseURLError`` (imported when raised: its module loads chatflow-agent)."""
    from chatflow_sqlalchemy.exceptions import DatabaseURLError

    return DatabaseURLError(message)
