"""The ``chatflow-sqlalchemy`` command line (Click, with Rich output on a terminal).

docs/cli.md is the reference: every command and option, the JSON documents, the exit
codes. Read commands never create, migrate or write anything; expected errors are one
``error:`` line without the URL's password; output is cleaned of terminal controls.
Importing this module loads neither SQLAlchemy, Alembic, chatflow-agent nor Rich, so
``--help`` answers at once: each command imports what it needs.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from chatflow_agent import Message
    from rich.console import Console
    from sqlalchemy import URL, Connection, Engine

    from chatflow_sqlalchemy import migrate as migrate_module
    from chatflow_sqlalchemy.dialect import DialectSupport
    from chatflow_sqlalchemy.inbox import Inbox
    from chatflow_sqlalchemy.lifecycle import ListFilters
    from chatflow_sqlalchemy.sealing import Sealer

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "UPSTREAM_LABEL",
    "CliError",
    "clean",
    "cli",
    "main",
    "plain_rst",
]

EXIT_OK = 0
EXIT_FAILED = 1
"""The command ran and failed: check failed, no such session, corrupt rows, answered no."""
EXIT_USAGE = 2
"""A user mistake: bad arguments or URL, missing database, unreachable server, ..."""
EXIT_INTERRUPTED = 130
"""Interrupted with Ctrl-C."""

PROG = "chatflow-sqlalchemy"
UPGRADE_HINT = f"run: {PROG} db upgrade"
UPSTREAM_LABEL = "chatflow-agent 0.3.4 tables (unversioned)"
"""How a database holding upstream's tables without a revision is described, everywhere."""

EXIT_CODES_EPILOG = (
    "\b\nExit codes:\n"
    "  0    success\n"
    "  1    failed: db check behind/drifted, no such session, corrupt or locked rows,\n"
    "       answered no\n"
    "  2    usage or bad input: bad URL/arguments, missing SQLite file, unreachable\n"
    "       database or missing driver, schema not at head, unknown revision,\n"
    "       destructive command without --yes and without a terminal\n"
    "  130  interrupted\n"
    "\b\nThe URL comes from --url, else $CHATFLOW_DATABASE_URL, else sqlite:///chatflow.db.\n"
    "Read commands never create or migrate a database; add --json for scripts."
)

_T = TypeVar("_T")


class CliError(Exception):
    """An expected failure: printed as one ``error:`` line, exit with ``code``."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------- output safety

_UNSAFE_ABOVE_C0 = "\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069"
"""DEL, the C1 controls (CSI is \x9b), line/paragraph separators, bidi overrides."""
_CONTROL = re.compile(f"[\x00-\x1f{_UNSAFE_ABOVE_C0}]")
_CONTROL_BUT_NEWLINE = re.compile(f"[\x00-\x09\x0b-\x1f{_UNSAFE_ABOVE_C0}]")
_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}
_JSON_UNSAFE = re.compile(f"[{_UNSAFE_ABOVE_C0}]")


def _escape_char(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def clean(text: object, *, newlines: bool = False) -> str:
    r"""``text`` safe for a terminal: C0/C1 controls, DEL and bidi overrides as ``\x1b``-style text.

    Stored chat content can then neither drive the terminal nor spoof a line. With
    ``newlines=True`` a newline stays a newline (message bodies printed on their own lines).
    """
    pattern = _CONTROL_BUT_NEWLINE if newlines else _CONTROL
    return pattern.sub(_escape_char, str(text))


def _json_text(value: Any, **kwargs: Any) -> str:
    """JSON for output: readable non-ASCII text, C1 and bidi characters escaped (as C0)."""
    text = json.dumps(value, ensure_ascii=False, default=str, **kwargs)
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


_RST_ROLE = re.compile(r":[a-z]+(?::[a-z]+)*:`~?([^`<]*?)(?:\s*<[^>]*>)?`")
_RST_LITERAL = re.compile(r"``(.+?)``|`([^`]+)`")


def plain_rst(text: str) -> str:
    """``text`` written in reStructuredText, as plain text: roles and literals keep their text."""
    text = _RST_ROLE.sub(lambda m: m.group(1), text)
    return _RST_LITERAL.sub(lambda m: m.group(1) or m.group(2), text)


def _emit(as_json: bool, document: Any, *lines: str) -> None:
    """A command's result: ``document`` as JSON with ``--json``, else ``lines`` of text."""
    for line in [_json_text(document, indent=2)] if as_json else lines:
        click.echo(line)


def _rich_console() -> Console | None:
    """A Rich console for standard output when it is a terminal (or FORCE_COLOR is set)."""
    forced = bool(os.environ.get("FORCE_COLOR"))
    if not (forced or sys.stdout.isatty()):
        return None
    from rich.console import Console

    return Console(file=sys.stdout, highlight=False, force_terminal=True if forced else None)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print rows (already cleaned) as a Rich table on a terminal, aligned text otherwise."""
    console = _rich_console()
    if console is None:
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=True)]
            click.echo("  ".join(cells).rstrip())
        return
    from rich.table import Table
    from rich.text import Text

    table = Table(header_style="bold", show_lines=False)
    for name in header:
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))
    console.print(table)


_ROLE_STYLES = {"user": "bold green", "model": "bold cyan", "tool": "magenta", "system": "yellow"}


# --------------------------------------------------------------------------- URLs, errors


def _resolve_url(given: str | None) -> URL:
    """``--url`` (after the command, else before it), env, default file; read as the stores do."""
    from chatflow_sqlalchemy.urls import parse_database_url

    if given is None:
        ctx = click.get_current_context(silent=True)
        given = ctx.find_root().params.get("url") if ctx is not None else None
    try:
        return parse_database_url(given)
    except Exception as exc:
        from chatflow_sqlalchemy.exceptions import DatabaseURLError  # only now: it is heavy

        if isinstance(exc, DatabaseURLError):
            raise CliError(str(exc)) from None
        raise


def _safe_url(url: URL) -> str:
    return clean(url.render_as_string(hide_password=True))


def _describe(url: URL) -> str:
    """Name the database (and host) without the password."""
    if url.get_backend_name() == "sqlite":
        return clean(f"SQLite database {url.database or ':memory:'!r}")
    host = url.host or "localhost"
    if url.port:
        host = f"{host}:{url.port}"
    user = f" as {url.username!r}" if url.username else ""
    return clean(f"{url.get_backend_name()} database {url.database!r} on {host}{user}")


def _one_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines()]
    kept = [line for line in lines if line and not line.startswith("(Background on this error")]
    return " ".join(kept) or "unknown error"


def _db_error_reason(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None)
    text = str(orig) if orig is not None else str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _dialect_support(url: URL) -> DialectSupport:
    """The backend's dialect hooks; loading it first reports a missing driver's pip extra."""
    from chatflow_sqlalchemy.registry import backend_name_for_url, support_for

    return support_for(backend_name_for_url(url))


@contextmanager
def _database_errors(url: URL, action: str = "cannot use") -> Iterator[None]:
    """Turn driver errors into one line naming the database (never its password)."""
    from sqlalchemy import exc as sa_exc

    try:
        yield
    except (sa_exc.OperationalError, sa_exc.InterfaceError) as exc:
        raise CliError(f"{action} {_describe(url)}: {_db_error_reason(exc)}") from exc
    except sa_exc.DBAPIError as exc:
        raise CliError(f"database error on {_describe(url)}: {_db_error_reason(exc)}") from exc


# --------------------------------------------------------------------------- engines


def _sqlite_file(url: URL) -> Path | None:
    """The file a SQLite URL names; None for in-memory databases and other backends."""
    if url.get_backend_name() != "sqlite":
        return None
    from chatflow_sqlalchemy.backends.sqlite_files import is_ephemeral_sqlite

    if is_ephemeral_sqlite(url):
        return None
    database = url.database or ""
    if database.startswith("file:"):
        from urllib.parse import unquote

        database = unquote(database[len("file:") :].split("?", 1)[0])
    return Path(database)


def _read_only_sqlite(url: URL, path: Path) -> Engine:
    """An engine whose connections open an existing ``path`` query-only.

    ``mode=rw`` never creates the file and, unlike ``mode=ro``, lets the last
    connection remove the ``-wal``/``-shm`` files, so a read leaves the folder as it was.
    """
    import sqlite3
    from urllib.parse import quote

    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    from chatflow_sqlalchemy.backends.sqlite_files import BUSY_TIMEOUT_MS

    uri = f"file:{quote(str(path.resolve()))}?mode=rw"

    def connect() -> sqlite3.Connection:
        conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA query_only = ON")
        return conn

    return create_engine(url.set(database=str(path), query={}), creator=connect, poolclass=NullPool)


@contextmanager
def _engine(url: URL, *, read_only: bool) -> Iterator[Engine]:
    """An engine on the database as it is (never migrated; connected once up front).

    A SQLite file opened to read needs no backend: only the sqlite3 module.
    """
    path = _sqlite_file(url)
    if not (read_only and path):
        _dialect_support(url)
    if path is not None and not path.is_file():  # SQLite would create it on connect
        raise CliError(
            f"no SQLite database at {clean(str(path))!r} (nothing was created); "
            f"check the URL, or create it with: {PROG} db upgrade"
        )
    if read_only and path:
        engine = _read_only_sqlite(url, path)
    else:
        from chatflow_sqlalchemy import migrate

        engine = migrate.open_engine(url)
    try:
        with _database_errors(url, "cannot reach"), engine.connect():
            pass
        with _database_errors(url):
            yield engine
    finally:
        engine.dispose()


def _has_upstream_tables(engine: Engine) -> bool:
    from sqlalchemy import inspect

    from chatflow_sqlalchemy import tables

    return inspect(engine).has_table(tables.sessions.name)


def _label(
    revision: str | None,
    chain: migrate_module.MigrationChain | None = None,
    *,
    upstream: bool = False,
) -> str:
    """A revision for messages; a core chain without one is empty or upstream's tables."""
    if revision is not None:
        return revision
    if chain is not None and not chain.is_core:
        return "none"
    return UPSTREAM_LABEL if upstream else "none (empty database)"


def _statuses(engine: Engine) -> list[migrate_module.ChainStatus]:
    """Every chain's status, refusing a database ahead of this package."""
    from chatflow_sqlalchemy import migrate

    statuses = migrate.chain_status(engine)
    for status in statuses:
        migrate.check_not_ahead(status.current, status.chain)
    return list(statuses)


def _require_head(engine: Engine, url: URL) -> None:
    """Refuse (exit 2) unless every chain is at head: read commands never migrate."""
    behind = [status for status in _statuses(engine) if not status.at_head]
    if not behind:
        return
    first = behind[0]
    upstream = first.chain.is_core and first.current is None and _has_upstream_tables(engine)
    what = "the schema" if first.chain.is_core else f"the schema of plugin {first.chain.name}"
    raise CliError(
        f"{_describe(url)}: {what} is at {_label(first.current, first.chain, upstream=upstream)}, "
        f"this package needs revision {first.head}; nothing was changed; {UPGRADE_HINT}"
    )


@contextmanager
def _database(url_option: str | None, *, write: bool = False) -> Iterator[tuple[URL, Engine]]:
    """An engine on an existing database whose schema is at head (read-only unless ``write``)."""
    url = _resolve_url(url_option)
    with _engine(url, read_only=not write) as engine:
        _require_head(engine, url)
        yield url, engine


@contextmanager
def _read_conn(engine: Engine) -> Iterator[Connection]:
    """One connection (one snapshot) whose transaction is rolled back: reads only."""
    with engine.connect() as conn:
        try:
            yield conn
        finally:
            conn.rollback()


# --------------------------------------------------------------------------- confirmation


def _confirm(question: str, yes: bool) -> None:
    """Ask before a destructive step; refuse without a terminal unless ``--yes``."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise CliError(f"{question} -- refusing without confirmation: pass --yes to confirm")
    if not click.confirm(question, default=False, err=True):
        raise CliError("not confirmed; nothing was changed", EXIT_FAILED)


# --------------------------------------------------------------------------- formatting


def _format_time(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.strftime("%Y-%m-%d %H:%M:%S %Z").strip()


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _format_content(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)


_SHARED_OPTIONS: dict[str, tuple[list[str], dict[str, Any]]] = {
    "yes": (["--yes", "-y"], {"help": "do not ask for confirmation (needed without a terminal)"}),
    "json": (["--json", "as_json"], {"help": "print one JSON document (for scripts)"}),
    "url": (["--url"], {
        "metavar": "URL", "is_flag": False, "default": None,
        "help": "database URL (default: $CHATFLOW_DATABASE_URL, else sqlite:///chatflow.db)",
    }),
}


def _shared_option(name: str) -> click.Option:
    decls, attrs = _SHARED_OPTIONS[name]
    return click.Option(decls, **{"is_flag": True, **attrs})


def _command(
    group: click.Group, name: str, *, yes: bool = False, url: bool = True
) -> Callable[[Callable[..., Any]], click.Command]:
    """``group.command(name)`` with the shared options after its own: --yes, --json, --url."""
    shared = [key for key, wanted in (("yes", yes), ("json", True), ("url", url)) if wanted]

    def decorate(func: Callable[..., Any]) -> click.Command:
        command = group.command(name)(func)
        command.params.extend(_shared_option(key) for key in shared)
        return command

    return decorate


# --------------------------------------------------------------------------- the groups


@click.group(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=EXIT_CODES_EPILOG,
    no_args_is_help=True,
    invoke_without_command=True,
)
@click.version_option(
    package_name="chatflow-sqlalchemy", prog_name=PROG, message="%(prog)s %(version)s"
)
@click.pass_context
def cli(ctx: click.Context, url: str | None) -> None:
    """Manage chatflow-sqlalchemy databases: migrations, sessions, dedup ids, the inbox."""
    if ctx.invoked_subcommand is None:  # only options (--url X): the help, not an error
        click.echo(ctx.get_help())


cli.params.append(_shared_option("url"))


@cli.group(no_args_is_help=True)
def db() -> None:
    """Schema migrations. Only upgrade, downgrade and stamp change the schema."""


@cli.group(no_args_is_help=True)
def sessions() -> None:
    """Inspect, delete, sweep, export, rewind and fork sessions.

    The read commands (list, show, export) never create or migrate anything.
    """


@cli.group(no_args_is_help=True)
def dedup() -> None:
    """Processed webhook ids (the dedup window)."""


@cli.group(no_args_is_help=True)
def inbox() -> None:
    """The durable inbox: messages, retries, counts.

    list and stats never change anything; retry and purge write.
    """


# --------------------------------------------------------------------------- db


_CHAIN_HELP = (
    "act on one migration chain: 'core' or an installed plugin's name "
    "(default: head/base move every chain, other revisions the core chain)"
)


def _chains(
    engine: Engine, chain_name: str | None, revision: str, all_for: str | None
) -> list[migrate_module.MigrationChain]:
    """The chains a command acts on: ``--chain``, else every chain for head/base, else core."""
    from chatflow_sqlalchemy import migrate

    if chain_name:
        return [migrate.find_chain(chain_name, engine.dialect.name)]
    if all_for is not None and revision == all_for:
        return migrate.chains_for(engine.dialect.name)
    return [migrate.core_chain()]


def _check_revision(revision: str, chains: Sequence[migrate_module.MigrationChain]) -> None:
    """Refuse a revision no chain knows before asking or touching anything."""
    from chatflow_sqlalchemy import migrate

    if revision in ("head", "base", "heads") or re.fullmatch(r"[+-]\d+", revision):
        return
    if any(mark in revision for mark in "@:+-"):
        return  # relative and branch forms: Alembic checks them
    known = [rev.revision for chain in chains for rev in migrate.history(chain)]
    if not any(rev.startswith(revision) for rev in known):
        raise CliError(
            f"unknown revision {clean(revision)!r}; known: {', '.join(known)}, head, base "
            f"(see: {PROG} db history)"
        )


def _prefix(url: URL, chain: migrate_module.MigrationChain) -> str:
    return f"{_safe_url(url)}:" + ("" if chain.is_core else f" plugin {chain.name}:")


def _read_revision(engine: Engine, chain: migrate_module.MigrationChain) -> str | None:
    from chatflow_sqlalchemy import migrate

    with _read_conn(engine) as conn:
        return migrate.current_revision(conn, chain)


def _move(
    url_option: str | None, revision: str, chain_name: str | None, *,
    down: bool, yes: bool = False, as_json: bool = False,
) -> None:
    """Upgrade or downgrade, then report how each chain moved (plugins first going down)."""
    from chatflow_sqlalchemy import migrate

    url = _resolve_url(url_option)
    _prepare_new_sqlite_file(url, create=not down)
    with _engine(url, read_only=False) as engine:
        chains = _chains(engine, chain_name, revision, "base" if down else "head")
        _check_revision(revision, chains)
        if down and len(chains) > 1:
            chains = [*chains[1:][::-1], chains[0]]
        before = [_read_revision(engine, chain) for chain in chains]
        for chain, found in zip(chains, before, strict=True):
            migrate.check_not_ahead(found, chain)
        upstream = before[0] is None and chains[0].is_core and _has_upstream_tables(engine)
        if down:
            what = "the tables (data is lost)" if revision == "base" else f"revision {revision}"
            _confirm(f"Downgrade {_safe_url(url)} to {clean(what)}?", yes)
            migrate.downgrade(engine, revision, chain_name)
        else:
            migrate.upgrade(engine, revision, chain_name)
        after = [_read_revision(engine, chain) for chain in chains]
    if as_json:
        _emit(True, {"database": _safe_url(url), "chains": [
            {"chain": chain.name, "from": old, "to": new,
             "at_head": new == migrate.head_revision(chain)}
            for chain, old, new in zip(chains, before, after, strict=True)
        ]})
        return
    verb = "downgraded" if down else "upgraded"
    for chain, old, new in zip(chains, before, after, strict=True):
        suffix = " (head)" if not down and new == migrate.head_revision(chain) else ""
        shown_old = _label(old, chain, upstream=upstream)
        if old == new:
            moved = f"already at revision {shown_old}{suffix}"
        else:
            moved = f"{verb} from {shown_old} to {_label(new, chain)}{suffix}"
        click.echo(f"{_prefix(url, chain)} {moved}")


def _prepare_new_sqlite_file(url: URL, *, create: bool) -> None:
    """``db upgrade`` may create a SQLite file: make it private (0600, folder 0700)."""
    path = _sqlite_file(url)
    if path is None or path.exists() or not create:
        return
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
    except OSError as exc:
        raise CliError(f"cannot create {clean(str(path))!r}: {exc.strerror}") from None


@_command(db, "upgrade")
@click.argument("revision", default="head")
@click.option("--chain", "chain_name", metavar="NAME", help=_CHAIN_HELP)
def db_upgrade(revision: str, chain_name: str | None, as_json: bool, url: str | None) -> None:
    """Upgrade the schema (default: every chain to head).

    Moves the core chain and every plugin chain that applies to the database.
    Creates the SQLite file (mode 0600) if it does not exist.
    """
    _move(url, revision, chain_name, down=False, as_json=as_json)


@_command(db, "downgrade", yes=True)
@click.argument("revision")
@click.option("--chain", "chain_name", metavar="NAME", help=_CHAIN_HELP)
def db_downgrade(
    revision: str, chain_name: str | None, yes: bool, as_json: bool, url: str | None
) -> None:
    """Downgrade the schema to REVISION (asks first).

    'base' drops the tables, plugins' first. Asks for confirmation unless
    --yes. 'db downgrade 0001' makes a file readable by chatflow-agent 0.3.4
    again.
    """
    _move(url, revision, chain_name, down=True, yes=yes, as_json=as_json)


def _status_json(url: URL, statuses: Sequence[migrate_module.ChainStatus], upstream: bool) -> Any:
    return {"database": _safe_url(url), "chains": [
        {"chain": s.chain.name, "distribution": s.chain.distribution or None,
         "current": s.current, "head": s.head, "at_head": s.at_head,
         "description": _label(s.current, s.chain, upstream=upstream)}
        for s in statuses
    ], "at_head": all(s.at_head for s in statuses)}


def _db_status(
    url_option: str | None, *, drift: bool = False
) -> tuple[URL, list[migrate_module.ChainStatus], bool, list[str]]:
    """(URL, chain statuses, upstream tables?, drift from the models when at head), read-only."""
    from chatflow_sqlalchemy import migrate

    url = _resolve_url(url_option)
    with _engine(url, read_only=True) as engine:
        statuses = _statuses(engine)
        upstream = statuses[0].current is None and _has_upstream_tables(engine)
        at_head = all(s.at_head for s in statuses)
        return url, statuses, upstream, migrate.drift(engine) if drift and at_head else []


@_command(db, "current")
def db_current(as_json: bool, url: str | None) -> None:
    """Show the database's revision of every chain."""
    parsed, statuses, upstream, _ = _db_status(url)
    if as_json:
        _emit(True, _status_json(parsed, statuses, upstream))
        return
    click.echo(f"database: {_safe_url(parsed)}")
    for status in statuses:
        chain = status.chain
        name = "revision" if chain.is_core else f"plugin {chain.name} ({chain.distribution})"
        shown = _label(status.current, status.chain, upstream=upstream)
        if status.at_head:
            click.echo(f"{name}: {status.current} (head)")
        else:
            click.echo(f"{name}: {shown}; head is {status.head}")
    if not all(s.at_head for s in statuses):
        click.echo(UPGRADE_HINT)


@_command(db, "history")
@click.option("--chain", "chain_name", metavar="NAME", help="this chain instead of the core's")
@click.option("--all", "show_all", is_flag=True, help="also every installed plugin's chain")
def db_history(chain_name: str | None, show_all: bool, as_json: bool, url: str | None) -> None:
    """List the migration chain, newest first.

    Reads no database: it shows the revisions this installation knows.
    """
    from chatflow_sqlalchemy import migrate

    chains = (
        [migrate.find_chain(chain_name)]
        if chain_name
        else [migrate.core_chain(), *(migrate.plugin_chains() if show_all else [])]
    )
    if as_json:
        _emit(True, {"chains": [{
            "chain": chain.name,
            "distribution": chain.distribution or None,
            "version_table": chain.version_table,
            "revisions": [
                {"revision": rev.revision, "down_revision": rev.down_revision,
                 "is_head": rev.is_head, "doc": plain_rst(rev.doc)}
                for rev in reversed(migrate.history(chain))
            ],
        } for chain in chains]})
        return
    for index, chain in enumerate(chains):
        if index:
            dialects = ", ".join(sorted(chain.dialects)) if chain.dialects else "every database"
            click.echo("")
            click.echo(
                f"plugin {chain.name} ({chain.distribution}; version table "
                f"{chain.version_table}; {dialects}):"
            )
        for rev in reversed(migrate.history(chain)):
            marker = " (head)" if rev.is_head else ""
            doc = clean(plain_rst(rev.doc))
            click.echo(f"{rev.down_revision or '<base>'} -> {rev.revision}{marker}: {doc}")


@_command(db, "check")
def db_check(as_json: bool, url: str | None) -> int:
    """Check the schema is at head and matches the models.

    Exit 0 if it is, else 1 (read-only).
    """
    parsed, statuses, upstream, diffs = _db_status(url, drift=True)
    behind = [status for status in statuses if not status.at_head]
    if as_json:
        report = _status_json(parsed, statuses, upstream)
        report.update(ok=not behind and not diffs, drift=diffs)
        _emit(True, report)
        return EXIT_FAILED if behind or diffs else EXIT_OK
    for status in behind:
        what = _safe_url(parsed) + ("" if status.chain.is_core else f" plugin {status.chain.name}")
        shown = _label(status.current, status.chain, upstream=upstream)
        if status.current is not None:
            shown = f"revision {shown}"
        click.echo(
            f"behind: {what} is at {shown}, the code expects {status.head}; {UPGRADE_HINT}"
        )
    if behind:
        return EXIT_FAILED
    head = statuses[0].head
    if diffs:
        click.echo(
            f"drift: {_safe_url(parsed)} is at revision {head} (head), but its schema differs "
            f"from the models ({len(diffs)} difference(s)):"
        )
        for diff in diffs:
            click.echo(f"  - {clean(diff)}")
        return EXIT_FAILED
    plugins = "".join(
        f"; plugin {s.chain.name} at {s.current} (head)" for s in statuses if not s.chain.is_core
    )
    click.echo(
        f"ok: {_safe_url(parsed)} is at revision {head} (head) and matches the models{plugins}"
    )
    return EXIT_OK


@_command(db, "stamp")
@click.argument("revision")
@click.option(
    "--chain", "chain_name", metavar="NAME", help="the chain: 'core' (default) or a plugin"
)
def db_stamp(revision: str, chain_name: str | None, as_json: bool, url: str | None) -> None:
    """Record REVISION without running any migration."""
    from chatflow_sqlalchemy import migrate

    parsed = _resolve_url(url)
    with _engine(parsed, read_only=False) as engine:
        chain = _chains(engine, chain_name, revision, None)[0]
        _check_revision(revision, [chain])
        before = _read_revision(engine, chain)
        migrate.check_not_ahead(before, chain)
        upstream = before is None and chain.is_core and _has_upstream_tables(engine)
        migrate.stamp(engine, revision, chain)
        after = _read_revision(engine, chain)
    _emit(
        as_json,
        {"database": _safe_url(parsed), "chain": chain.name, "from": before, "to": after},
        f"{_prefix(parsed, chain)} stamped revision {_label(after, chain)} "
        f"(was {_label(before, chain, upstream=upstream)}); no migration was run",
    )


# --------------------------------------------------------------------------- reading sessions


@dataclass
class _Part:
    """A stored value as read with ``$CHATFLOW_KEYS``: in clear, or why it is not.

    ``value``: the value in clear (a message row: its JSON document, as pydantic's
    ``model_dump(mode="json")`` gives it), None when unreadable. ``locked_by``: the key
    id of a value sealed with a key not in ``$CHATFLOW_KEYS`` (not corruption);
    ``error``: why a corrupt value does not read, ``raw`` being what is stored.
    """

    value: Any = None
    raw: Any = None
    error: str | None = None
    locked_by: str | None = None

    def flags(self, prefix: str = "") -> dict[str, Any]:
        """The ``corrupt`` and ``locked`` members of a JSON document (each None if not)."""
        corrupt = None if self.error is None else {"reason": self.error, "raw": self.raw}
        locked = None if self.locked_by is None else {"key_id": self.locked_by}
        return {f"{prefix}corrupt": corrupt, f"{prefix}locked": locked}

    def shown(self) -> str | None:
        """The value as a header line shows it: none when readable (the caller formats it)."""
        if self.locked_by is not None:
            return f"({_locked(self.locked_by)})"
        if self.error is not None:
            return clean(f"CORRUPT ({self.error}): {self.raw!r}")
        return None


def open_row(session_id: str, stored: Any) -> _Part:
    """A stored ``message_json``, summary or metadata in clear when ``$CHATFLOW_KEYS`` opens it."""
    from chatflow_sqlalchemy.values import is_encrypted

    sealed_dict = isinstance(stored, dict) and set(stored) == {"_enc"}
    if not is_encrypted(stored["_enc"] if sealed_dict else stored):
        return _Part(stored, stored)
    sealer = _sealer_from_env(os.environ.get("CHATFLOW_KEYS", ""))
    try:
        if sealed_dict:
            return _Part(sealer.open_metadata(session_id, stored), stored)
        return _Part(sealer.open_text(session_id, None, stored, "chatflow_messages"), stored)
    except Exception as exc:  # the errors load chatflow-agent: imported only once raised
        locked_by, error = _why_closed(exc)
        return _Part(None, stored, error, locked_by)


def _why_closed(failure: Exception) -> tuple[str | None, str | None]:
    """(key id, None) for a value sealed with a key not in ``$CHATFLOW_KEYS``, else (None, why).

    Anything but a ``CorruptRowError`` is raised again.
    """
    from chatflow_sqlalchemy.exceptions import CorruptRowError, MissingKeyError

    if isinstance(failure, MissingKeyError):
        return failure.key_id, None
    if isinstance(failure, CorruptRowError):
        return None, failure.reason
    raise failure


@functools.lru_cache(maxsize=4)
def _sealer_from_env(keys: str) -> Sealer:
    """A sealer holding the keys of ``$CHATFLOW_KEYS`` (value ``keys``); none when unset."""
    from chatflow_sqlalchemy.crypto import AESGCMCipher
    from chatflow_sqlalchemy.sealing import Sealer

    return Sealer(_checked(AESGCMCipher.from_env, keys) if keys else None, False)


def _read_message(session_id: str, stored: str) -> _Part:
    """A message row opened and decoded; a row not in the stores' form is left to pydantic."""
    from chatflow_sqlalchemy.message_json import plain_message

    part = open_row(session_id, stored)
    if part.value is None:
        return part
    text, part.raw = part.value, str(part.value)
    part.value = plain_message(text)
    if part.value is None:
        from chatflow_agent import Message

        try:
            part.value = Message.model_validate_json(text).model_dump(mode="json")
        except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
            part.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return part


def _read_metadata(session_id: str, stored: Any) -> _Part:
    """Metadata from its stored JSON (never raises): a dict, else why not."""
    if stored is None:
        return _Part(error="metadata_json is NULL")
    text = stored if isinstance(stored, str) else json.dumps(stored, default=str)
    try:
        value = json.loads(text) if isinstance(stored, str) else stored
    except ValueError as exc:
        return _Part(raw=text, error=f"invalid JSON: {exc}")
    if not isinstance(value, dict):
        return _Part(raw=text, error=f"not a JSON object (a {type(value).__name__})")
    part = open_row(session_id, value)
    part.raw = text
    return part


@dataclass
class _MessageRow:
    """One stored message row and what it reads as."""

    row_id: int
    role: str
    created_at: datetime | None
    table: str
    part: _Part

    def json(self) -> dict[str, Any]:
        return {"id": self.row_id, "table": self.table, "role": self.role,
                "created_at": _iso(self.created_at), "message": self.part.value,
                **self.part.flags()}


@dataclass
class _SessionRecord:
    """One session as stored: its row, metadata, summary and messages, each read or not.

    ``rows``: the window (for ``show --all``, the transcript); ``archived``: for ``export``.
    The summary is kept beside the messages because, without an archive, it is the
    only record of the turns pruning dropped; an export must not lose it.
    """

    session_id: str
    agent: str
    created_at: datetime | None
    updated_at: datetime | None
    metadata: _Part
    summary: _Part
    forked_from: str | None
    forked_at_turn: int | None
    rows: list[_MessageRow] = field(default_factory=list)
    archived: list[_MessageRow] = field(default_factory=list)

    def _parts(self) -> list[tuple[str, str, _Part]]:
        """(what, where, part) per part: named for a locked part, ``what + where`` if corrupt."""
        sid = clean(repr(self.session_id))
        return [
            (f"session {sid}: metadata_json", " in chatflow_sessions", self.metadata),
            (f"session {sid}: summary", " in chatflow_sessions", self.summary),
            *((f"session {sid}: {row.table} row id {row.row_id}", "", row.part)
              for row in [*self.rows, *self.archived]),
        ]

    def locked(self) -> list[tuple[str, str]]:
        """(key id, what) per part encrypted with a key not in ``$CHATFLOW_KEYS``."""
        return [(p.locked_by, what) for what, _, p in self._parts() if p.locked_by is not None]

    def problems(self) -> list[str]:
        """One line per corrupt part, naming the session, the table and the row id."""
        return [f"{what}{where} is corrupt ({clean(p.error)})"
                for what, where, p in self._parts() if p.error is not None]

    def unreadable(self) -> list[str]:
        """One line per part that cannot be read: corrupt, or locked by a missing key."""
        return [*self.problems(), *(f"{what} is {_locked(key)}" for key, what in self.locked())]


def _locked(key_id: str) -> str:
    """How a value encrypted with a key not in ``$CHATFLOW_KEYS`` is described."""
    return f"encrypted with key {clean(repr(key_id))}, not in CHATFLOW_KEYS"


def _session_query(session_ids: Sequence[str] | None = None) -> Any:
    """The sessions ``show`` and ``export`` read; none without an agent yet (as ``get``)."""
    from sqlalchemy import Text, cast, select

    from chatflow_sqlalchemy import tables
    from chatflow_sqlalchemy.values import UNBORN_AGENT

    c = tables.sessions.c
    query = select(
        c.session_id, c.active_agent_name, c.created_at, c.updated_at,
        cast(c.metadata_json, Text).label("metadata_text"),
        c.summary, c.forked_from, c.forked_at_turn,
    ).where(c.active_agent_name != UNBORN_AGENT).order_by(c.updated_at.desc(), c.session_id)
    return query if session_ids is None else query.where(c.session_id.in_(session_ids))


def _messages(conn: Connection, session_id: str, archive: bool = False) -> list[Any]:
    """A session's message rows: the window (SYSTEM first, then by seq) or the archive."""
    from sqlalchemy import case, select

    from chatflow_sqlalchemy import tables

    c = (tables.message_archive if archive else tables.messages).c
    order = (c.seq, c.id) if archive else (case((c.role == "system", 0), else_=1), c.seq)
    query = select(c.id, c.seq, c.role, c.created_at, c.message_json)
    return list(conn.execute(query.where(c.session_id == session_id).order_by(*order)))


def _record(
    conn: Connection, row: Any, *, whole: bool = False, archived: bool = False
) -> _SessionRecord:
    """Read one session (``row`` of :func:`_session_query`) with its messages.

    ``whole``: ``rows`` is the transcript (archive + window, one row per seq);
    ``archived``: the archive is also read into ``archived`` (for export).
    """
    from chatflow_sqlalchemy import tables

    sid = row.session_id
    summary = _Part() if row.summary is None else open_row(sid, row.summary)
    record = _SessionRecord(
        sid, row.active_agent_name, row.created_at, row.updated_at,
        _read_metadata(sid, row.metadata_text), summary, row.forked_from, row.forked_at_turn,
    )

    def read(msg: Any, table: Any) -> _MessageRow:
        part = _read_message(sid, msg.message_json)
        return _MessageRow(msg.id, str(msg.role), msg.created_at, table.name, part)

    window, archive = tables.messages, tables.message_archive
    if whole:  # the transcript: archive + window, one row per seq (as store.transcript)
        by_seq = {msg.seq: (msg, table) for table in (archive, window)
                  for msg in _messages(conn, sid, table is archive)}
        record.rows.extend(read(*by_seq[seq]) for seq in sorted(by_seq))
        return record
    record.rows.extend(read(msg, window) for msg in _messages(conn, sid))
    if archived:
        record.archived.extend(read(msg, archive) for msg in _messages(conn, sid, True))
    return record


def _checked(check: Callable[..., _T], *args: Any, what: str = "", **kwargs: Any) -> _T:
    """``check(*args, **kwargs)``, a validator of the stores: its refusal is a usage error.

    A ValueError (or an ImportError naming a missing extra) is one ``error:`` line,
    after ``what`` (the option it is about).
    """
    try:
        return check(*args, **kwargs)
    except (ValueError, ImportError) as exc:
        raise CliError(f"{what}{clean(str(exc))}") from None


def _validate_session_id(session_id: str) -> None:
    from chatflow_sqlalchemy.values import validate_session_id

    _checked(validate_session_id, session_id)


def _no_session(session_id: str, url: URL) -> CliError:
    return CliError(f"no session {clean(repr(session_id))} in {_describe(url)}", EXIT_FAILED)


# --------------------------------------------------------------------------- sessions list


def _session_rows(engine: Engine, filters: ListFilters | None = None) -> list[Any]:
    from sqlalchemy import func, select

    from chatflow_sqlalchemy import tables
    from chatflow_sqlalchemy.values import UNBORN_AGENT

    sessions_t = tables.sessions
    s, m = sessions_t.c, tables.messages.c
    # Counted per listed session (an index range each), not over the whole table.
    count = select(func.count()).where(m.session_id == s.session_id).correlate(sessions_t)
    query = (
        select(
            s.session_id, s.active_agent_name, count.scalar_subquery().label("messages"),
            s.created_at, s.updated_at,
        )
        .where(s.active_agent_name != UNBORN_AGENT)  # the inbox's, before their first turn
        .order_by(s.updated_at.desc(), s.session_id)
    )
    with _read_conn(engine) as conn:
        if filters is None:
            return list(conn.execute(query))
        from chatflow_sqlalchemy.sql_lifecycle import session_page

        ids = session_page(conn, filters)  # the store's own filters and order
        rows = {
            row.session_id: row
            for chunk in (ids[i : i + 500] for i in range(0, len(ids), 500))
            for row in conn.execute(query.where(s.session_id.in_(chunk)))
        }
        return [rows[sid] for sid in ids if sid in rows]


def _list_filters(
    user: str | None, meta: Sequence[str], updated_after: str | None,
    limit: int | None, after: str | None, forked_from: str | None = None,
) -> ListFilters | None:
    """``sessions list`` options as the store's filters (None: the plain listing)."""
    from chatflow_sqlalchemy.lifecycle import ListFilters

    given = (user, updated_after, limit, after, forked_from)
    if not meta and all(option is None for option in given):
        return None
    wanted: dict[str, Any] = {}
    for item in meta:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise CliError(f"--meta takes KEY=VALUE, got {clean(repr(item))}")
        try:  # a JSON value (1, true, null, "1", [..]) keeps its type; anything else is text
            wanted[key] = json.loads(raw)
        except ValueError:
            wanted[key] = raw
    since = None
    if updated_after is not None:
        try:
            since = datetime.fromisoformat(updated_after)
        except ValueError:
            raise CliError(
                f"--updated-after takes an ISO 8601 time such as 2026-11-30T12:00:00Z, got "
                f"{clean(repr(updated_after))}"
            ) from None
        if since.tzinfo is None:
            since = since.replace(tzinfo=timezone.utc)  # documented: naive means UTC
    return _checked(
        ListFilters.build, user_id=user, metadata=wanted, updated_after=since, limit=limit,
        after=after, forked_from=forked_from,
    )


@_command(sessions, "list")
@click.option("--user", metavar="ID", help="only the sessions of this user_id")
@click.option(
    "--meta", metavar="KEY=VALUE", multiple=True,
    help="only sessions whose metadata has KEY equal to VALUE (a JSON value keeps its type: "
    "n=1 is the number, n='\"1\"' the string; other text is a string); repeat: all must match",
)
@click.option(
    "--updated-after", metavar="TIME",
    help="only sessions written after TIME (ISO 8601; without a zone it is UTC)",
)
@click.option("--limit", type=click.IntRange(min=1), help="at most this many (a page)")
@click.option("--after", metavar="ID", help="the page after this session id (the last shown)")
@click.option("--forked-from", metavar="ID", help="only the forks of this session")
def sessions_list(
    user: str | None, meta: tuple[str, ...], updated_after: str | None, limit: int | None,
    after: str | None, forked_from: str | None, as_json: bool, url: str | None,
) -> None:
    """List sessions, most recently updated first.

    With --limit or --after the list is paged by session id (ascending), so
    that walking the pages returns every session once even while they are
    written: pass the last id shown as --after for the next page.
    """
    filters = _list_filters(user, meta, updated_after, limit, after, forked_from)
    with _database(url) as (_parsed, engine):
        rows = _session_rows(engine, filters)
    full_page = limit is not None and len(rows) == limit
    next_after = rows[-1].session_id if full_page else None
    if as_json:
        document: dict[str, Any] = {"sessions": [
            {"session_id": row.session_id, "active_agent_name": row.active_agent_name,
             "messages": int(row.messages), "created_at": _iso(row.created_at),
             "updated_at": _iso(row.updated_at)}
            for row in rows
        ]}
        if limit is not None:  # paging: where the next page starts (None: this was the last)
            document["next_after"] = next_after
        _emit(True, document)
        return
    if not rows:
        click.echo("no sessions")
        return
    if next_after is not None:
        click.echo(f"next page: --after {clean(repr(next_after))}", err=True)
    _table(("SESSION", "ACTIVE AGENT", "MESSAGES", "UPDATED"), [
        (clean(r.session_id), clean(r.active_agent_name), str(r.messages),
         _format_time(r.updated_at))
        for r in rows
    ])


# --------------------------------------------------------------------------- sessions show


@dataclass
class _Line:
    """One printable part of a message: a role, a kind and its (cleaned) text."""

    role: str
    text: str
    corrupt: bool = False


def _message_parts(message: dict[str, Any]) -> list[_Line]:
    """The printable parts of a message (its JSON document)."""
    role = message["role"]
    parts: list[_Line] = []
    if message["content"]:
        parts.append(_Line(role, clean(message["content"], newlines=True)))
    for call in message["tool_calls"] or []:
        args = json.dumps(call["args"], ensure_ascii=False, sort_keys=True, default=str)
        parts.append(_Line(role, clean(f"tool call {call['name']} {args} (id {call['id']})")))
    for result in message["tool_results"] or []:
        text = f"tool result {result['name']} is_error={result['is_error']}: "
        parts.append(_Line(role, clean(text + _format_content(result["content"]), newlines=True)))
    return parts or [_Line(role, "(empty)")]


def _row_parts(row: _MessageRow) -> list[_Line]:
    part = row.part
    if part.value is not None:
        return _message_parts(part.value)
    if part.locked_by is not None:
        text = f"row id {row.row_id} in {row.table} is {_locked(part.locked_by)}"
    else:
        text = f"CORRUPT ROW id {row.row_id} in {row.table} ({part.error}): {part.raw!r}"
    return [_Line(row.role, clean(text), corrupt=True)]


_Group = tuple[str, list[tuple[_MessageRow, list[_Line]]]]


def _group_turns(rows: Sequence[_MessageRow]) -> list[_Group]:
    """SYSTEM messages first, then one group per user turn."""
    system = [(row, _row_parts(row)) for row in rows if row.role == "system"]
    groups: list[_Group] = [("System", system)] if system else []
    turn = 0
    for row in rows:
        if row.role == "system":
            continue
        entry = (row, _row_parts(row))
        if row.role == "user":
            turn += 1
            groups.append((f"Turn {turn}", []))
        elif turn == 0 and (not groups or groups[-1][0] != "Before the first turn"):
            groups.append(("Before the first turn", []))
        groups[-1][1].append(entry)
    return groups


def _header(record: _SessionRecord, turns: int) -> list[tuple[str, str, str]]:
    """The lines above the conversation: (name, cleaned value, Rich style)."""
    lines = [
        ("session", clean(record.session_id), ""),
        ("active agent", clean(record.agent), "bold"),
        ("created", _format_time(record.created_at), ""),
        ("updated", _format_time(record.updated_at), ""),
    ]
    if record.forked_from is not None:
        lines.append(("forked from", f"{clean(record.forked_from)} at turn "
                                     f"{record.forked_at_turn}", ""))
    for name, part in (("metadata", record.metadata), ("summary", record.summary)):
        shown = part.shown()
        if shown is not None:
            lines.append((name, shown, "bold red"))
        elif part.value and name == "metadata":
            lines.append((name, clean(_format_content(part.value)), ""))
        elif part.value is not None and name == "summary":  # a readable one keeps its newlines
            lines.append((name, clean(part.value, newlines=True), ""))
    return [*lines, ("messages", f"{len(record.rows)} in {turns} turn(s)", "")]


def _show_plain(record: _SessionRecord, groups: list[_Group], turns: int) -> None:
    for name, value, _style in _header(record, turns):
        if name == "summary" and record.summary.value is not None:  # a block: may span lines
            click.echo("summary:")
            for line in value.split("\n"):
                click.echo(f"  {line}")
        else:
            click.echo(f"{name}: {value}")
    for title, entries in groups:
        click.echo("")
        click.echo(title)
        for row, parts in entries:
            stamp = _format_time(row.created_at)
            for part in parts:
                first, *rest = part.text.split("\n")
                label = f"  {stamp}  [{part.role}] "
                click.echo(f"{label}{first}")
                for line in rest:
                    click.echo(f"{' ' * len(label)}{line}")


def _show_rich(console: Console, record: _SessionRecord, groups: list[_Group], turns: int) -> None:
    from rich.rule import Rule
    from rich.table import Table
    from rich.text import Text

    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    for name, value, style in _header(record, turns):
        head.add_row(name, Text(value, style=style))
    console.print(head)
    for title, entries in groups:
        console.print(Rule(Text(title, style="bold")))
        body = Table.grid(padding=(0, 1))
        body.add_column(style="dim", no_wrap=True)
        body.add_column(no_wrap=True)
        body.add_column(overflow="fold")
        for row, parts in entries:
            stamp = _format_time(row.created_at)
            for part in parts:
                role = Text(f"[{part.role}]", style=_ROLE_STYLES.get(part.role, "bold"))
                style = "bold red" if part.corrupt else ""
                body.add_row(Text(stamp), role, Text(part.text, style=style))
        console.print(body)


@_command(sessions, "show")
@click.argument("session_id")
@click.option(
    "--all", "whole", is_flag=True,
    help="the whole transcript: archived (pruned) messages too, in order",
)
def sessions_show(session_id: str, whole: bool, as_json: bool, url: str | None) -> int:
    """Print a conversation turn by turn (read-only).

    Without --all: the window the model sees. With --all: the transcript
    (messages pruned from the window and kept by a store opened with
    archive_pruned=True, then the window). Corrupt rows (and corrupt
    metadata) are shown raw and named, with exit code 1.
    """
    _validate_session_id(session_id)
    with _database(url) as (parsed, engine), _read_conn(engine) as conn:
        row = conn.execute(_session_query([session_id])).first()
        if row is None:
            raise _no_session(session_id, parsed)
        record = _record(conn, row, whole=whole)
    turns = sum(1 for row in record.rows if row.role == "user")
    problems = record.problems()
    if as_json:
        _emit(True, {
            "session_id": record.session_id, "active_agent_name": record.agent,
            "created_at": _iso(record.created_at), "updated_at": _iso(record.updated_at),
            "metadata": record.metadata.value, **record.metadata.flags("metadata_"),
            "summary": record.summary.value, **record.summary.flags("summary_"),
            "forked_from": record.forked_from, "forked_at_turn": record.forked_at_turn,
            "turns": turns, "messages": [row.json() for row in record.rows],
        })
    else:
        groups = _group_turns(record.rows)
        console = _rich_console()
        if console is None:
            _show_plain(record, groups, turns)
        else:
            _show_rich(console, record, groups, turns)
    failures = []
    if problems:
        failures.append(
            f"{len(problems)} corrupt part(s): {'; '.join(problems)}; fix or delete them, "
            "or delete the session"
        )
    locked = record.locked()
    if locked:  # what to do about parts encrypted with keys not in $CHATFLOW_KEYS
        keys = sorted({key for key, _ in locked})
        named = ", ".join(clean(repr(key)) for key in keys)
        failures.append(
            f"{len(locked)} part(s) encrypted with key {named}, not in CHATFLOW_KEYS "
            f"({locked[0][1]}{', ...' if len(locked) > 1 else ''}): to read them, add the key "
            f"to CHATFLOW_KEYS ('{clean(keys[0])}:<base64 key>', after the primary)"
        )
    if failures:
        raise CliError("; ".join(failures), EXIT_FAILED)
    return EXIT_OK


# --------------------------------------------------------------------------- delete / export


@_command(sessions, "delete", yes=True)
@click.argument("session_id")
def sessions_delete(session_id: str, yes: bool, as_json: bool, url: str | None) -> None:
    """Delete a session and its history (asks first).

    Asks for confirmation unless --yes.
    """
    from sqlalchemy import delete, select

    from chatflow_sqlalchemy import tables

    _validate_session_id(session_id)
    table = tables.sessions
    where = table.c.session_id == session_id
    with _database(url, write=True) as (parsed, engine):
        with _read_conn(engine) as conn:
            found = conn.execute(select(table.c.session_id).where(where)).first()
        if found is None:
            raise _no_session(session_id, parsed)
        _confirm(f"Delete session {clean(repr(session_id))} and its history?", yes)
        with engine.begin() as conn:
            gone = conn.execute(delete(table).where(where)).rowcount
    if not gone:
        raise _no_session(session_id, parsed)
    shown = clean(repr(session_id))
    _emit(as_json, {"session_id": session_id, "deleted": True}, f"deleted session {shown}")


# --------------------------------------------------------------------------- rewind / fork


@contextmanager
def _history_store(
    url_option: str | None, session_id: str, **options: Any
) -> Iterator[tuple[URL, Any]]:
    """(URL, a store) that changes the existing session's history as workers do.

    The same turns and keys: encrypted rows are read and written with the keys of
    ``$CHATFLOW_KEYS``; a stored agent name stands for itself (the CLI runs no
    agent); a row that cannot be read is exit 1, naming it. A session the inbox
    made before its first turn does not exist yet.
    """
    from sqlalchemy import select

    from chatflow_sqlalchemy import tables
    from chatflow_sqlalchemy.values import UNBORN_AGENT

    _validate_session_id(session_id)
    s = tables.sessions.c
    query = select(s.session_id).where(
        s.session_id == session_id, s.active_agent_name != UNBORN_AGENT
    )
    with _database(url_option) as (url, engine), _read_conn(engine) as conn:
        if conn.execute(query).first() is None:
            raise _no_session(session_id, url)
    from chatflow_agent import Agent

    from chatflow_sqlalchemy.exceptions import CorruptRowError
    from chatflow_sqlalchemy.opening import open_store

    cipher = _sealer_from_env(os.environ.get("CHATFLOW_KEYS", "")).cipher
    with open_store(url, cipher=cipher, auto_migrate=False, **options) as store:
        store.set_agent_resolver(lambda name: Agent(name=name, instructions=""))
        try:
            yield url, store
        except CorruptRowError as exc:
            raise CliError(f"nothing was changed: {clean(str(exc))}", EXIT_FAILED) from None
        except ValueError as exc:  # the store's refusal of an argument, naming the fix
            raise CliError(clean(str(exc))) from None


def _turns_in(history: Sequence[Message]) -> int:
    """How many turns a history window holds (each opens with a USER message)."""
    from chatflow_agent import Role

    return sum(1 for message in history if message.role == Role.USER)


@_command(sessions, "rewind", yes=True)
@click.argument("session_id")
@click.option(
    "--turns", type=click.IntRange(min=1), default=1, show_default=True,
    help="how many of the last complete turns to remove",
)
@click.option(
    "--archive", is_flag=True,
    help="keep the removed messages in the transcript archive (sessions show --all), as a "
    "store with archive_pruned=True does; without it they are deleted",
)
def sessions_rewind(
    session_id: str, turns: int, archive: bool, yes: bool, as_json: bool, url: str | None
) -> None:
    """Remove the last turns of a session (asks first).

    Runs as a turn of the session, as ctx.rewind does: it waits for a turn
    running on the session elsewhere, and workers show the shorter history
    from their next turn on. Edit-and-regenerate is a rewind, then a new
    turn. Asks for confirmation unless --yes. Encrypted rows are read and
    written with the keys of $CHATFLOW_KEYS.
    """
    shown = clean(repr(session_id))
    with _history_store(url, session_id, archive_pruned=archive) as (parsed, store):
        ctx = store.get(session_id)
        if ctx is None:
            raise _no_session(session_id, parsed)
        held = _turns_in(ctx.history)
        if turns > held:
            fix = f"pass --turns from 1 to {held}" if held else "there is nothing to rewind"
            raise CliError(
                f"cannot rewind {turns} turn(s) of session {shown}: its window holds "
                f"{held}; {fix} (nothing was changed)"
            )
        _confirm(f"Remove the last {turns} turn(s) of session {shown}?", yes)
        ctx.rewind(turns)
        left = _turns_in(ctx.history)
    _emit(as_json, {"session_id": session_id, "rewound": turns, "turns": left},
          f"rewound {turns} turn(s) of session {shown}: {left} turn(s) left")


@_command(sessions, "fork")
@click.argument("session_id")
@click.argument("new_session_id")
@click.option(
    "--at-turn", type=click.IntRange(min=0), metavar="K",
    help="take only the first K complete turns of the window (default: all of them)",
)
def sessions_fork(
    session_id: str, new_session_id: str, at_turn: int | None, as_json: bool, url: str | None
) -> None:
    """Copy a session into a new one, whole or up to a turn.

    NEW_SESSION_ID gets the SYSTEM messages and the first K complete turns
    of SESSION_ID's window (all of them without --at-turn), with its
    summary, active agent, metadata and user_id, in one transaction; the
    session is unchanged. An existing NEW_SESSION_ID is refused and nothing
    is written. sessions list --forked-from SESSION_ID lists the forks.
    Encrypted rows are read and written with the keys of $CHATFLOW_KEYS.
    """
    with _history_store(url, session_id) as (_parsed, store):
        ctx = store.fork(session_id, new_session_id, at_turn=at_turn)
        taken = ctx.forked_at_turn
        copied = len(ctx.history) - (ctx.summary is not None)  # the summary is no row
    _emit(
        as_json,
        {"session_id": new_session_id, "forked_from": session_id, "forked_at_turn": taken,
         "messages": copied},
        f"forked session {clean(repr(session_id))} into {clean(repr(new_session_id))}: "
        f"{taken} turn(s), {copied} message(s)",
    )


def _export_record(record: _SessionRecord) -> dict[str, Any]:
    def dump(rows: list[_MessageRow]) -> list[Any]:
        return [row.part.value for row in rows if row.part.value is not None]

    exported = {"session_id": record.session_id, "active_agent_name": record.agent,
                "metadata": record.metadata.value, "summary": record.summary.value,
                "forked_from": record.forked_from, "forked_at_turn": record.forked_at_turn,
                "messages": dump(record.rows)}
    if record.archived:  # only sessions with an archive (archive_pruned=True) have the key
        exported["archived_messages"] = dump(record.archived)
    return exported


def _export(engine: Engine, sink: IO[str], skip_corrupt: bool) -> tuple[int, list[str]]:
    """Write every readable session as one JSON line; return (count, skipped problems)."""
    exported = 0
    skipped: list[str] = []
    with _read_conn(engine) as conn:  # one snapshot for the whole export
        for row in list(conn.execute(_session_query())):
            record = _record(conn, row, archived=True)
            problems = record.unreadable()
            if problems:
                if not skip_corrupt:
                    # plain `show` reads the window only: an archived row needs --all
                    whole = " --all" if any(
                        r.part.value is None for r in record.archived
                    ) else ""
                    raise CliError(
                        f"export stopped: {problems[0]}; pass --skip-corrupt to export the "
                        f"other sessions, or see: {PROG} sessions show "
                        f"{clean(repr(record.session_id))}{whole}",
                        EXIT_FAILED,
                    )
                skipped.extend(problems)
                continue
            sink.write(_json_text(_export_record(record)) + "\n")
            exported += 1
    return exported, skipped


def _check_output(target: Path) -> None:
    """Refuse an ``--output`` that exists and is not a regular file (never following a link)."""
    import stat

    try:
        mode = os.lstat(target).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise CliError(f"cannot use --output {clean(str(target))!r}: {exc.strerror}") from None
    if stat.S_ISREG(mode):
        return
    kinds = {stat.S_ISLNK: "a symbolic link", stat.S_ISFIFO: "a named pipe",
             stat.S_ISDIR: "a folder", stat.S_ISCHR: "a device", stat.S_ISBLK: "a device",
             stat.S_ISSOCK: "a socket"}
    kind = next((name for test, name in kinds.items() if test(mode)), "not a regular file")
    raise CliError(
        f"--output {clean(str(target))!r} is {kind}; nothing was written: name a regular "
        "file (it is replaced) or a new path, or omit --output to write to stdout"
    )


def _write_output(target: Path, write: Callable[[IO[str]], _T]) -> _T:
    """Run ``write`` on a private (0600) file beside ``target``, then rename it over ``target``.

    ``target`` is replaced only if ``write`` succeeds and it is still absent or a regular file.
    """
    import tempfile

    _check_output(target)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    partial = Path(name)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as sink:
            result = write(sink)
        _check_output(target)
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return result


_output_option = click.option(
    "--output", "-o", metavar="FILE", help="write to FILE (mode 0600) instead of stdout"
)


@_command(sessions, "export")
@_output_option
@click.option(
    "--skip-corrupt",
    is_flag=True,
    help="export the readable sessions; report the others on stderr (corrupt, or encrypted "
    "with a key not in CHATFLOW_KEYS)",
)
def sessions_export(
    output: str | None, skip_corrupt: bool, as_json: bool, url: str | None
) -> None:
    """Export sessions as JSON lines (read-only).

    Each line: {"session_id", "active_agent_name", "metadata", "summary",
    "forked_from", "forked_at_turn", "messages"} (+ "archived_messages" for a
    session with an archive). A session with a corrupt row (in the window or
    the archive, or a corrupt summary) stops the export (FILE is then left as
    it was) unless --skip-corrupt, which names each bad row (session, table,
    row id) on stderr and exports the other sessions. With --json,
    the summary after writing FILE is a JSON document.
    """
    target = None if output in (None, "-") else Path(output)
    with _database(url) as (_parsed, engine):
        if target is None:
            _, skipped = _export(engine, sys.stdout, skip_corrupt)
        else:
            count, skipped = _write_output(target, lambda f: _export(engine, f, skip_corrupt))
    for problem in skipped:
        click.echo(f"skipped: {problem}", err=True)
    if target is not None:
        extra = f"; skipped {len(skipped)} corrupt part(s), see above" if skipped else ""
        _emit(as_json, {"exported": count, "output": str(target), "skipped": skipped},
              f"exported {count} session(s) to {clean(str(target))}{extra}")


# --------------------------------------------------------------------------- dedup


def _ttl(hours: float | None) -> float:
    """The dedup TTL in hours: ``--ttl-hours``, else the store's default window."""
    from chatflow_sqlalchemy.values import DEFAULT_DEDUP_TTL_HOURS

    if hours is None:
        return float(DEFAULT_DEDUP_TTL_HOURS)
    if not hours > 0 or hours == float("inf") or hours > 24 * 365 * 1000:
        raise CliError(f"--ttl-hours must be a positive number of hours, got {hours!r}")
    return hours


_ttl_option = click.option(
    "--ttl-hours", type=float, metavar="HOURS",
    help="dedup window in hours (default: the stores' default, 192 = 8 days)",
)


def _processed_table() -> Any:
    from chatflow_sqlalchemy import tables

    return tables.processed_messages


def _cutoff(ttl_hours: float) -> datetime:
    from chatflow_sqlalchemy.values import utcnow

    return utcnow() - timedelta(hours=ttl_hours)


def _dedup_counts(conn: Connection, ttl_hours: float) -> tuple[int, int]:
    """(all ids, expired ids) for the window ``ttl_hours``."""
    from sqlalchemy import func, select

    table = _processed_table()
    total = conn.execute(select(func.count()).select_from(table)).scalar_one()
    expired = conn.execute(
        select(func.count()).select_from(table).where(table.c.processed_at < _cutoff(ttl_hours))
    ).scalar_one()
    return int(total), int(expired)


@_command(dedup, "list")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True, help="rows")
@_ttl_option
def dedup_list(limit: int, ttl_hours: float | None, as_json: bool, url: str | None) -> None:
    """List processed ids and their claim state, newest first.

    States: in_flight (a worker holds it, lease live), expired (its worker
    stopped renewing: the next delivery takes it over), done, released (the
    next delivery acquires it).
    """
    from chatflow_sqlalchemy.sql_claims import read_claims

    ttl = _ttl(ttl_hours)
    with _database(url) as (_parsed, engine), _read_conn(engine) as conn:
        claims = read_claims(conn, limit=limit)
        total, _ = _dedup_counts(conn, ttl)
    cutoff = _cutoff(ttl)
    window = timedelta(hours=ttl)
    if as_json:
        _emit(True, {"ttl_hours": ttl, "total": total, "ids": [
            {"message_id": claim.message_id, "state": claim.state,
             "session_id": claim.session_id, "lease_age": claim.lease_age,
             "lease_left": claim.lease_left, "has_response": claim.has_response,
             "processed_at": _iso(claim.updated_at),
             "expires_at": _iso(claim.updated_at + window), "expired": claim.updated_at < cutoff}
            for claim in claims
        ]})
        return
    if not claims:
        click.echo("no processed ids")
        return
    _table(("MESSAGE ID", "STATE", "SESSION", "CLAIMED AT", "EXPIRES AT", "EXPIRED"), [
        (clean(claim.message_id), _claim_state(claim.state, claim.lease_age),
         clean(claim.session_id or "-"), _format_time(claim.updated_at),
         _format_time(claim.updated_at + window), "yes" if claim.updated_at < cutoff else "no")
        for claim in claims
    ])
    if total > len(claims):
        click.echo(f"showing {len(claims)} of {total}; use --limit to see more")


def _claim_state(state: str, lease_age: float | None) -> str:
    """``in_flight`` with how long ago its lease was last renewed, else the state."""
    return state if lease_age is None else f"{state} (lease renewed {lease_age:.0f} s ago)"


@_command(dedup, "release", yes=True)
@click.argument("message_id")
def dedup_release(message_id: str, yes: bool, as_json: bool, url: str | None) -> None:
    """Free a webhook id held by a stuck or dead worker.

    The next delivery of the id acquires it at once. If the old holder is
    alive after all, its turn gets ClaimLostError at commit and writes
    nothing. Asks for confirmation unless --yes.
    """
    from chatflow_sqlalchemy.sql_claims import free_claim

    shown = clean(message_id)
    with _database(url, write=True) as (_parsed, engine):
        _confirm(f"Release the claim on {shown}? The next delivery of it runs its turn.", yes)
        with engine.begin() as conn:
            freed = free_claim(conn, message_id)
    if not freed:
        raise CliError(
            f"{shown} is not held by any worker (unknown, done or released)", EXIT_FAILED
        )
    _emit(as_json, {"message_id": message_id, "released": True},
          f"released {shown}: the next delivery acquires it")


@_command(dedup, "count")
@_ttl_option
def dedup_count(ttl_hours: float | None, as_json: bool, url: str | None) -> None:
    """Count processed ids, live and expired (read-only)."""
    ttl = _ttl(ttl_hours)
    with _database(url) as (_parsed, engine), _read_conn(engine) as conn:
        total, expired = _dedup_counts(conn, ttl)
    live = total - expired
    _emit(as_json, {"ttl_hours": ttl, "total": total, "expired": expired, "live": live},
          f"{total} processed id(s): {live} live, {expired} expired (TTL {ttl:g} h)")


@_command(dedup, "purge", yes=True)
@_ttl_option
def dedup_purge(ttl_hours: float | None, yes: bool, as_json: bool, url: str | None) -> None:
    """Delete processed ids older than the TTL.

    A --ttl-hours shorter than the default window removes ids a webhook
    retry may still need: that asks for confirmation unless --yes.
    """
    from sqlalchemy import delete

    from chatflow_sqlalchemy.values import utcnow

    ttl = _ttl(ttl_hours)
    default_ttl = _ttl(None)
    table = _processed_table()
    with _database(url, write=True) as (parsed, engine):
        if ttl < default_ttl:
            with _read_conn(engine) as conn:
                unexpired = _dedup_counts(conn, ttl)[1] - _dedup_counts(conn, default_ttl)[1]
            if unexpired:
                _confirm(
                    f"Purge {unexpired} id(s) still inside the default {default_ttl:g} h dedup "
                    "window (a retried webhook could then run twice)?",
                    yes,
                )
        now = utcnow()
        cutoff = now - timedelta(hours=ttl)
        with engine.begin() as conn:  # whole days first (PostgreSQL's day partitions)
            removed = _dialect_support(parsed).drop_expired_processed(conn, cutoff, now)
        with engine.begin() as conn:
            removed += conn.execute(delete(table).where(table.c.processed_at < cutoff)).rowcount
    _emit(as_json, {"ttl_hours": ttl, "removed": removed},
          f"removed {removed} expired processed message id(s) (TTL {ttl:g} h)")


# --------------------------------------------------------------------------- inbox


INBOX_STATES = ("pending", "in_flight", "done", "sent", "dead")
"""The inbox's states (``chatflow_sqlalchemy.inbox.INBOX_STATES``, not imported: it is heavy)."""


@contextmanager
def _inbox(
    url_option: str | None, *, write: bool = False, dedup_ttl_hours: float | None = None
) -> Iterator[tuple[URL, Engine, Inbox]]:
    """The inbox of an existing database at head, through a store on the CLI's own engine.

    Without ``write`` the engine is the query-only one of the read commands, so
    the store can only read (SQLite refuses any write); it never migrates.
    """
    from chatflow_sqlalchemy.store import SQLAlchemySessionStore

    with (
        _database(url_option, write=write) as (parsed, engine),
        SQLAlchemySessionStore(
            engine=engine, auto_migrate=False, dedup_ttl_hours=_ttl(dedup_ttl_hours)
        ) as store,
    ):
        yield parsed, engine, store.inbox


def _inbox_table() -> Any:
    from chatflow_sqlalchemy import tables

    return tables.inbox


def _age(seconds: float) -> str:
    """A duration for people: seconds, minutes, hours or days."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


@_command(inbox, "list")
@click.option(
    "--state", type=click.Choice(INBOX_STATES), help="only the messages in this state"
)
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True, help="rows")
def inbox_list(state: str | None, limit: int, as_json: bool, url: str | None) -> None:
    """List inbox messages in arrival order, oldest first (read-only).

    States: pending (waiting for a worker), in_flight (a worker's batch),
    done (answered, no send), sent (answered and sent), dead (failed
    max_attempts times; the error says why: retry it with inbox retry).
    """
    with _inbox(url) as (_parsed, _engine, rows):
        entries = rows.entries(state=state, limit=limit)
        counts = rows.stats().counts
    total = counts.get(state, 0) if state is not None else sum(counts.values())
    if as_json:
        _emit(True, {"state": state, "total": total,
                     "messages": [entry.as_dict() for entry in entries]})
        return
    if not entries:
        click.echo(f"no {state} messages in the inbox" if state else "no messages in the inbox")
        return
    _table(("MESSAGE ID", "SESSION", "STATE", "ATTEMPTS", "RECEIVED", "UPDATED", "ERROR"), [
        (clean(e.message_id), clean(e.session_id), e.state, str(e.attempts),
         _format_time(e.received_at), _format_time(e.updated_at), clean(e.error or "-"))
        for e in entries
    ])
    if total > len(entries):
        click.echo(f"showing {len(entries)} of {total}; use --limit to see more")
    if any(entry.state == "dead" for entry in entries):
        click.echo(f"give a dead message another try with: {PROG} inbox retry MESSAGE_ID",
                   err=True)


@_command(inbox, "retry")
@click.argument("message_id")
def inbox_retry(message_id: str, as_json: bool, url: str | None) -> None:
    """Give a dead message another try, with the rest of its batch.

    Its batch's dead messages are pending again with their attempts reset;
    the next worker of inbox.serve answers them. Only dead messages are
    retried: see them with inbox list --state dead.
    """
    from chatflow_sqlalchemy.claims import validate_message_id

    _checked(validate_message_id, message_id)
    shown = clean(repr(message_id))
    with _inbox(url, write=True) as (parsed, engine, rows):
        if not rows.retry(message_id):
            raise _not_dead(engine, parsed, message_id)
    _emit(as_json, {"message_id": message_id, "retried": True},
          f"retried {shown}: it is pending again with the rest of its batch; "
          "the next worker of inbox.serve answers it")


def _not_dead(engine: Engine, url: URL, message_id: str) -> CliError:
    """Why ``inbox retry`` did nothing: no such message, or it is not dead (exit 1)."""
    from sqlalchemy import select

    table = _inbox_table()
    with _read_conn(engine) as conn:
        state = conn.execute(
            select(table.c.state).where(table.c.message_id == message_id)
        ).scalar()
    shown = clean(repr(message_id))
    if state is None:
        return CliError(f"no message {shown} in the inbox of {_describe(url)}; see: "
                        f"{PROG} inbox list", EXIT_FAILED)
    why = {"pending": "it waits for a worker", "in_flight": "a worker is answering it",
           "done": "it was answered", "sent": "it was answered and its reply sent"}
    return CliError(
        f"message {shown} is {clean(state)}, not dead ({why.get(state, 'nothing to retry')}): "
        f"only dead messages are retried; see them with: {PROG} inbox list --state dead",
        EXIT_FAILED,
    )


@_command(inbox, "stats")
def inbox_stats(as_json: bool, url: str | None) -> None:
    """Count inbox messages per state (read-only).

    Also the age of the oldest pending message (by the database's clock)
    and how many messages died in the last hour.
    """
    with _inbox(url) as (_parsed, _engine, rows):
        stats = rows.stats()
    if as_json:
        _emit(True, stats.as_dict())
        return
    _table(("STATE", "MESSAGES"), [(state, str(n)) for state, n in stats.counts.items()])
    oldest = stats.oldest_pending_seconds
    click.echo("no pending messages" if oldest is None
               else f"oldest pending message: waiting {_age(oldest)}")
    click.echo(f"dead in the last hour: {stats.dead_last_hour}")
    if stats.counts.get("dead"):
        click.echo(f"see the dead messages with: {PROG} inbox list --state dead", err=True)


def _inbox_answered_between(conn: Connection, start: datetime, end: datetime) -> int:
    """How many done or sent messages changed state in ``[start, end)``."""
    from sqlalchemy import func, select

    table = _inbox_table()
    return int(conn.execute(select(func.count()).select_from(table).where(
        table.c.state.in_(["done", "sent"]), table.c.updated_at >= start, table.c.updated_at < end,
    )).scalar_one())


@_command(inbox, "purge", yes=True)
@_ttl_option
def inbox_purge(ttl_hours: float | None, yes: bool, as_json: bool, url: str | None) -> None:
    """Delete answered (done and sent) messages older than the TTL.

    Pending, in-flight and dead messages stay. An answered message keeps
    its id refused for the dedup window, so a --ttl-hours shorter than the
    default lets a redelivery in: that asks for confirmation unless --yes.
    """
    from chatflow_sqlalchemy.claims import validate_dedup_ttl

    ttl = _ttl(ttl_hours)
    _checked(validate_dedup_ttl, ttl, what="--ttl-hours: ")  # the store's own bound
    default_ttl = _ttl(None)
    with _inbox(url, write=True, dedup_ttl_hours=ttl) as (_parsed, engine, rows):
        if ttl < default_ttl:
            with _read_conn(engine) as conn:
                unexpired = _inbox_answered_between(conn, _cutoff(default_ttl), _cutoff(ttl))
            if unexpired:
                _confirm(
                    f"Purge {unexpired} answered message(s) still inside the default "
                    f"{default_ttl:g} h dedup window (a redelivery could then be answered "
                    "twice)?",
                    yes,
                )
        removed = rows.purge()
    _emit(as_json, {"ttl_hours": ttl, "removed": removed},
          f"removed {removed} answered inbox message(s) older than {ttl:g} h")


# --------------------------------------------------------------------------- misc


@_command(cli, "backends", url=False)
def backends(as_json: bool) -> None:
    """List installed backends and the store class each opens.

    A row per backend name: where it comes from (built-in, its distribution,
    register()), the store class open_store opens for it, and its
    DialectSupport class, or why it cannot be loaded.
    """
    from chatflow_sqlalchemy.registry import available_backends, backend_sources

    sources = backend_sources()
    rows = [
        _backend_row(name, backend, sources.get(name))
        for name, backend in sorted(available_backends().items())
    ]
    if as_json:
        _emit(True, {"backends": [
            {"name": n, "from": o, "available": not d.startswith("unavailable: "),
             "store_class": s if s != "-" else None, "detail": d}
            for n, o, s, d in rows
        ]})
        return
    if not rows:
        click.echo("no backends installed")
        return
    _table(("BACKEND", "FROM", "STORE CLASS", "DIALECT SUPPORT OR ERROR"), rows)


def _backend_row(name: str, backend: Any, source: Any) -> tuple[str, str, str, str]:
    """One row of ``backends``: name, origin, store class, and the support class or error."""
    if isinstance(backend, Exception):
        store, detail = "-", f"unavailable: {_one_line(str(backend))}"
    else:
        store, detail = _dotted(backend.store_class), _dotted(backend)
    origin = "-"
    if source is not None and source.origin == "built-in":
        origin = "built-in"
    elif source is not None:
        origin = " + ".join(source.distributions) if source.distributions else source.origin
    return clean(name), clean(origin), clean(store), clean(detail)


def _dotted(target: Any) -> str:
    """A class, or its ``"module:Class"`` target, as ``module.Class``."""
    if isinstance(target, str):
        return target.replace(":", ".")
    return f"{target.__module__}.{target.__qualname__}"


@_command(cli, "demo", url=False)
@click.option("--db", "db_path", metavar="PATH", help="new SQLite file (default: a temp folder)")
def demo(db_path: str | None, as_json: bool) -> None:
    """Run the offline demo on a new SQLite file.

    A scripted engine (no API key) drives the real Runner.
    """
    import tempfile

    from chatflow_sqlalchemy.demo import DemoError, run_demo

    default = None if db_path is not None else tempfile.mkdtemp(prefix="chatflow-demo-")
    path = Path(db_path) if db_path is not None else Path(f"{default}/demo.db")
    lines: list[str] = []
    out = lines.append if as_json else (lambda line: click.echo(clean(line)))
    try:
        run_demo(str(path), out)
    except DemoError as exc:
        raise CliError(str(exc), EXIT_FAILED) from exc
    if as_json:
        _emit(True, {"database": str(path), "output": lines})


# --------------------------------------------------------------------------- lifecycle


@cli.group(no_args_is_help=True)
def users() -> None:
    """Export or erase everything held about a user_id.

    For GDPR / LGPD requests.
    """


def _validated(user_id: str) -> None:
    from chatflow_sqlalchemy.lifecycle import validate_user_id

    _checked(validate_user_id, user_id)


@_command(users, "erase", yes=True)
@click.argument("user_id")
def users_erase(user_id: str, yes: bool, as_json: bool, url: str | None) -> None:
    """Erase every session of USER_ID (asks first).

    Its sessions go with their messages and claims, in one transaction.
    Asks first unless --yes. Workers with a live context of an erased
    session get SessionDeletedError on their next read or write.
    """
    from chatflow_sqlalchemy.sql_lifecycle import erase_user_rows, user_session_ids

    _validated(user_id)
    shown = clean(repr(user_id))
    with _database(url, write=True) as (_parsed, engine):
        with _read_conn(engine) as conn:
            found = len(user_session_ids(conn, user_id))
        if found:
            _confirm(f"Erase {found} session(s) of user {shown} and everything stored with them?",
                     yes)
            with engine.begin() as conn:
                found = erase_user_rows(conn, user_id)
    _emit(as_json, {"user_id": user_id, "erased": found},
          f"erased {found} session(s) of user {shown}")


@_command(users, "export")
@click.argument("user_id")
@_output_option
def users_export(user_id: str, output: str | None, as_json: bool, url: str | None) -> None:
    """Export everything held about USER_ID as JSON (read-only).

    {"format", "user_id", "exported_at", "sessions": [{"session_id",
    "user_id", "active_agent_name", "metadata", "created_at", "updated_at",
    "messages", "archived_messages", "webhook_claims"}]} -- what
    store.export_user returns. Encrypted rows are opened with the keys of
    $CHATFLOW_KEYS. A corrupt row stops the export (FILE is then left as it was).
    The document is JSON already; with --output and --json the summary is
    {"user_id", "exported", "output"}.
    """
    target = None if output in (None, "-") else Path(output)
    if target is not None:
        _check_output(target)  # before reading anything
    document = _user_document(user_id, url)
    text = _json_text(document, indent=2) + "\n"
    if target is None:
        sys.stdout.write(text)
        return
    _write_output(target, lambda sink: sink.write(text))
    count = len(document["sessions"])
    _emit(as_json, {"user_id": user_id, "exported": count, "output": str(target)},
          f"exported {count} session(s) of user {clean(repr(user_id))} to {clean(str(target))}")


class _Dumped:
    """A message row in the stores' form as ``export_sessions`` dumps it (``model_dump``)."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document

    def model_dump(self, mode: str = "json") -> dict[str, Any]:
        return self.document


def _parse_for_export(session_id: str, row_id: object, text: str) -> Any:
    """The store's row decoder, without pydantic for rows in the stores' form."""
    from chatflow_sqlalchemy.message_json import plain_message

    plain = plain_message(text)
    if plain is not None:
        return _Dumped(plain)
    from chatflow_sqlalchemy.rows import parse_message

    return parse_message(session_id, row_id, text)


def _user_document(user_id: str, url: str | None) -> dict[str, Any]:
    from chatflow_sqlalchemy.lifecycle import EXPORT_FORMAT
    from chatflow_sqlalchemy.sql_lifecycle import export_sessions, user_session_ids
    from chatflow_sqlalchemy.values import utcnow

    _validated(user_id)
    sealer = _sealer_from_env(os.environ.get("CHATFLOW_KEYS", ""))
    with _database(url) as (_parsed, engine), _read_conn(engine) as conn:
        try:
            sessions = export_sessions(
                conn, user_session_ids(conn, user_id), sealer.parser(_parse_for_export),
                sealer.open_metadata, sealer.open_summary,
            )
        except Exception as exc:  # a CorruptRowError: the errors load chatflow-agent
            _why_closed(exc)  # raises anything else again
            raise CliError(f"export stopped: {clean(str(exc))}", EXIT_FAILED) from None
    exported_at = utcnow().isoformat()
    return {"format": EXPORT_FORMAT, "user_id": user_id, "exported_at": exported_at,
            "sessions": sessions}


@_command(sessions, "sweep", yes=True)
@click.option(
    "--ttl-hours", type=float, required=True, envvar="CHATFLOW_SESSION_TTL_HOURS",
    show_envvar=True,
    help="sessions not updated for this many hours are expired (the store's session_ttl_hours)",
)
@click.option("--limit", type=click.IntRange(min=1), help="remove at most this many")
@click.option("--dry-run", is_flag=True, help="only count what would go (read-only)")
def sessions_sweep(
    ttl_hours: float, limit: int | None, dry_run: bool, yes: bool, as_json: bool,
    url: str | None,
) -> None:
    """Remove expired sessions (asks first).

    Expired sessions go with their messages and claims; asks for
    confirmation unless --yes. Sessions whose turn is in progress or that a
    live webhook claim holds are kept (a later sweep takes them). Safe while
    workers run and while other sweepers run.
    """
    from chatflow_sqlalchemy.lifecycle import validate_session_ttl
    from chatflow_sqlalchemy.sql_lifecycle import count_expired
    from chatflow_sqlalchemy.values import utcnow

    hours = _checked(validate_session_ttl, ttl_hours, what="--ttl-hours: ")
    assert hours is not None
    with _database(url) as (parsed, engine), _read_conn(engine) as conn:
        now = utcnow()
        expired, oldest = count_expired(conn, now - timedelta(hours=hours), now)
    expired = expired if limit is None else min(expired, limit)
    if dry_run:
        _emit(as_json, {"dry_run": True, "expired": expired, "oldest": oldest},
              f"{expired} expired session(s) would be removed",
              *(f"  {clean(session_id)}" for session_id in oldest[:expired]))
        return
    removed = 0
    if expired:
        from chatflow_sqlalchemy.opening import open_store

        _confirm(f"Remove {expired} expired session(s) and their history?", yes)
        with open_store(parsed, session_ttl_hours=hours, auto_migrate=False) as store:
            removed = int(store.sweep(limit))
    _emit(as_json, {"dry_run": False, "removed": removed}, f"removed {removed} expired session(s)")


@cli.group(no_args_is_help=True)
def keys() -> None:
    """Encryption keys: re-encrypt rows with a new key.

    The keys come from $CHATFLOW_KEYS; the first is the primary.
    """


@_command(keys, "rotate", yes=True)
@click.option(
    "--batch", type=click.IntRange(min=1), default=200, show_default=True,
    help="rows per table re-encrypted in one short transaction",
)
def keys_rotate(batch: int, yes: bool, as_json: bool, url: str | None) -> None:
    """Re-encrypt every row with the primary key, online.

    Rows not sealed with the primary key are rewritten in batches.

    Keys come from $CHATFLOW_KEYS ("k2:<base64>,k1:<base64>": the first is
    the primary, the others still decrypt). Plaintext rows are encrypted
    too: on a database holding any, it asks first unless --yes (without a
    terminal it refuses unless --yes), since from then on only these keys
    read them. Workers keep running turns meanwhile; give them the same keys
    first, then rotate, then drop the old key. Exit 0 when done.
    """
    from chatflow_sqlalchemy.crypto import AESGCMCipher
    from chatflow_sqlalchemy.opening import open_store

    cipher = _checked(AESGCMCipher.from_env)
    with _database(url, write=True) as (parsed, engine):
        if _holds_plaintext(engine):
            _confirm(
                f"{_safe_url(parsed)} holds plaintext rows: encrypt them with key "
                f"{clean(repr(cipher.primary))} (only $CHATFLOW_KEYS reads them after)?",
                yes,
            )
    with open_store(parsed, cipher=cipher, auto_migrate=False) as store:
        count = int(store.rotate_keys(batch))
    _emit(as_json, {"primary": cipher.primary, "rewritten": count},
          f"re-encrypted {count} row(s) with key {clean(repr(cipher.primary))}")


def _holds_plaintext(engine: Any) -> bool:
    """True if a message, archived message, session metadata or summary is stored unencrypted."""
    from sqlalchemy import Text, cast, not_, select

    from chatflow_sqlalchemy import tables
    from chatflow_sqlalchemy.crypto import TOKEN_PREFIX

    s = tables.sessions.c
    queries = [
        select(table.c.id).where(
            not_(table.c.message_json.startswith(TOKEN_PREFIX, autoescape=True))
        )
        for table in (tables.messages, tables.message_archive)
    ]
    queries.append(select(s.session_id).where(
        not_(cast(s.metadata_json, Text).contains(TOKEN_PREFIX, autoescape=True))
    ))
    queries.append(select(s.session_id).where(
        s.summary.is_not(None), not_(s.summary.startswith(TOKEN_PREFIX, autoescape=True))
    ))
    with _read_conn(engine) as conn:
        return any(conn.execute(query.limit(1)).first() is not None for query in queries)


# --------------------------------------------------------------------------- main


def _urls_in(argv: Sequence[str]) -> list[str]:
    """Every URL the command line or environment names (for redaction)."""
    found = [os.environ.get("CHATFLOW_DATABASE_URL") or ""]
    for index, arg in enumerate(argv):
        if arg == "--url" and index + 1 < len(argv):
            found.append(argv[index + 1])
        elif arg.startswith("--url="):
            found.append(arg.split("=", 1)[1])
    return [url for url in found if url]


def _password_of(raw: str) -> str | None:
    """The password in ``raw`` (parsed without SQLAlchemy, so a bad port does not hide it)."""
    from urllib.parse import unquote

    match = re.match(r"^[^:/?#]+://[^:@/?#]*:([^@/?#]*)@", raw)
    if match is None:
        return None
    return unquote(match.group(1)) or None


def _redact(message: str, urls: Sequence[str | None]) -> str:
    """Remove the URLs' passwords from ``message`` (in case a driver quotes the URL).

    Short passwords are only masked as ``:password@``, so ordinary words are not mangled.
    """
    from urllib.parse import quote, quote_plus

    for raw in urls:
        password = _password_of(raw) if raw else None
        if not password:
            continue
        for form in {password, quote_plus(password), quote(password, safe="")}:
            message = message.replace(f":{form}@", ":***@")
            if len(form) >= 4:
                message = message.replace(form, "***")
    return message


def _fail(message: str, code: int, urls: Sequence[str]) -> int:
    click.echo(f"error: {clean(_redact(_one_line(message), urls))}", err=True)
    return code


def _known_error(exc: Exception) -> str | None:
    """The one-line message of an expected error (exit 2); None for a bug."""
    from alembic.util.exc import CommandError
    from sqlalchemy import exc as sa_exc

    from chatflow_sqlalchemy.exceptions import ChatflowStoreError

    if isinstance(exc, sa_exc.ArgumentError):
        return f"invalid database URL: {exc}"
    if isinstance(exc, (ChatflowStoreError, CommandError)):
        return str(exc)
    if isinstance(exc, sa_exc.SQLAlchemyError):
        return f"database error: {_db_error_reason(exc)}"
    if isinstance(exc, ImportError):
        return f"{exc}; install the database driver for this URL"
    return str(exc) if isinstance(exc, OSError) else None


def _quiet_broken_pipe() -> int:
    """The reader went away (``sessions export | head``): stop quietly like other tools."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (e.g. under pytest)
        pass
    return EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code (docs/cli.md lists them).

    Args:
        argv: Arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        0 on success, 1 for a failed check/unknown session/corrupt rows,
        2 for a usage or database error (one ``error:`` line on stderr).

    """
    args = list(sys.argv[1:] if argv is None else argv)
    urls = _urls_in(args)
    try:
        result = cli.main(args=args, prog_name=PROG, standalone_mode=False)
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.exceptions.NoArgsIsHelpError as exc:  # a bare group: its help, not an error
        click.echo(exc.ctx.get_help() if exc.ctx is not None else "")
        return EXIT_OK
    except click.UsageError as exc:  # one line, with where to find help
        where = exc.ctx.command_path if exc.ctx is not None else PROG
        click.echo(f"error: {clean(exc.format_message())} (see: {where} --help)", err=True)
        return EXIT_USAGE
    except (click.Abort, KeyboardInterrupt):
        return _fail("interrupted", EXIT_INTERRUPTED, urls)
    except click.ClickException as exc:
        return _fail(exc.format_message(), exc.exit_code, urls)
    except CliError as exc:
        return _fail(str(exc), exc.code, urls)
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except Exception as exc:
        message = _known_error(exc)
        if message is None:
            raise
        return _fail(message, EXIT_USAGE, urls)
    return result if isinstance(result, int) else EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
