"""The ``chatflow-sqlalchemy`` command line (Click, with Rich output on a terminal).

docs/cli.md is the reference: every command and option, the JSON documents, the exit
codes. Read commands never create, migrate or write anything; expected errors are one
``error:`` line without the URL's password; output is cleaned of terminal controls.
Importing this module loads neither SQLAlchemy, Alembic, chatflow-agent nor Rich, so
``--help`` answers at once: each command imports what it needs.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from chatflow_agent import Message
    from rich.console import Console
    from sqlalchemy import URL, Connection, Engine

    from chatflow_sqlalchemy.inbox import Inbox
    from chatflow_sqlalchemy.migrate import ChainStatus, MigrationChain
    from chatflow_sqlalchemy.sealing import Sealer

__all__ = [
    "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "UPSTREAM_LABEL", "CliError",
    "clean", "cli", "main", "plain_rst", "run",
]

EXIT_OK = 0
EXIT_FAILED = 1
"""The command ran and failed: check failed, no such session, corrupt rows, answered no."""
EXIT_USAGE = 2
"""A user mistake: bad arguments or URL, missing database, unreachable server, ..."""
EXIT_INTERRUPTED = 130
"""Interrupted with Ctrl-C."""

PROG = "chatflow-sqlalchemy"
CLI_GC_THRESHOLD = 50_000
"""Allocations between two young collections in the console script (Python's default: 700)."""
UPGRADE_HINT = f"run: {PROG} db upgrade"
UPSTREAM_LABEL = "chatflow-agent 0.3.4 tables (unversioned)"
"""How a database holding upstream's tables without a revision is described, everywhere."""
INBOX_STATES = ("pending", "in_flight", "done", "sent", "dead")
"""The inbox's states (``chatflow_sqlalchemy.values.INBOX_STATES``, not imported here:
click builds the option when the CLI loads)."""

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


# --------------------------------------------------------------------------- output

_UNSAFE_ABOVE_C0 = "\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069"
"""DEL, the C1 controls (CSI is \x9b), line/paragraph separators, bidi overrides."""
_CONTROL = re.compile(f"[\x00-\x1f{_UNSAFE_ABOVE_C0}]")
_CONTROL_BUT_NEWLINE = re.compile(f"[\x00-\x09\x0b-\x1f{_UNSAFE_ABOVE_C0}]")
_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}
_JSON_UNSAFE = re.compile(f"[{_UNSAFE_ABOVE_C0}]")
_RST_ROLE = re.compile(r":[a-z]+(?::[a-z]+)*:`~?([^`<]*?)(?:\s*<[^>]*>)?`")
_RST_LITERAL = re.compile(r"``(.+?)``|`([^`]+)`")


def _escape_char(match: re.Match[str]) -> str:
    char, code = match.group(), ord(match.group())
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def clean(text: object, *, newlines: bool = False) -> str:
    r"""``text`` safe for a terminal: C0/C1 controls, DEL and bidi overrides as ``\x1b``-style text.

    Stored chat content can then neither drive the terminal nor spoof a line. With
    ``newlines=True`` a newline stays a newline (message bodies printed on their own lines).
    """
    return (_CONTROL_BUT_NEWLINE if newlines else _CONTROL).sub(_escape_char, str(text))


def _json_text(value: Any, **kwargs: Any) -> str:
    """JSON for output: readable non-ASCII text, C1 and bidi characters escaped (as C0)."""
    text = json.dumps(value, ensure_ascii=False, default=str, **kwargs)
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def plain_rst(text: str) -> str:
    """``text`` written in reStructuredText, as plain text: roles and literals keep their text."""
    text = _RST_ROLE.sub(lambda m: m.group(1), text)
    return _RST_LITERAL.sub(lambda m: m.group(1) or m.group(2), text)


def _opt(name: str) -> Any:
    """A shared option (``url``, ``as_json``, ``yes``), kept for the whole command line."""
    return click.get_current_context().meta.get(name)


def _emit(document: Any, *lines: str) -> bool:
    """A result: ``document`` as JSON with ``--json``, else ``lines``; True if it was JSON."""
    as_json = bool(_opt("as_json"))
    for line in [_json_text(document, indent=2)] if as_json else lines:
        click.echo(line)
    return as_json


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
            click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        return
    from rich.table import Table
    from rich.text import Text

    table = Table(header_style="bold", show_lines=False)
    for name in header:
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))
    console.print(table)


def _listing(
    document: Any, header: Sequence[str], rows: Sequence[Sequence[str]], none: str, total: int = 0
) -> bool:
    """``document`` with ``--json``, else a table (saying if ``total`` is more), else ``none``.

    True if no table was printed.
    """
    if _emit(document):
        return True
    if not rows:
        click.echo(none)
        return True
    _table(header, rows)
    if total > len(rows):
        click.echo(f"showing {len(rows)} of {total}; use --limit to see more")
    return False


def _format_time(value: datetime | None) -> str:
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M:%S %Z").strip()


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _format_content(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)


# --------------------------------------------------------------------------- databases


def _safe_url(url: URL) -> str:
    return clean(url.render_as_string(hide_password=True))


def _describe(url: URL) -> str:
    """Name the database (and host) without the password."""
    if url.get_backend_name() == "sqlite":
        return clean(f"SQLite database {url.database or ':memory:'!r}")
    host = f"{url.host or 'localhost'}:{url.port}" if url.port else url.host or "localhost"
    user = f" as {url.username!r}" if url.username else ""
    return clean(f"{url.get_backend_name()} database {url.database!r} on {host}{user}")


def _one_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines()]
    kept = [line for line in lines if line and not line.startswith("(Background on this error")]
    return " ".join(kept) or "unknown error"


def _db_error_reason(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None)
    lines = [line.strip() for line in str(exc if orig is None else orig).splitlines()]
    return next((line for line in lines if line), type(exc).__name__)


def _checked(check: Callable[..., _T], *args: Any, what: str = "", **kwargs: Any) -> _T:
    """``check(*args, **kwargs)``, a validator of the stores: its refusal is a usage error.

    A ValueError (or an ImportError naming a missing extra) is one ``error:`` line,
    after ``what`` (the option it is about).
    """
    try:
        return check(*args, **kwargs)
    except (ValueError, ImportError) as exc:
        raise CliError(f"{what}{clean(str(exc))}") from None


def _resolve_url() -> URL:
    """``--url`` (after the command, else before it), env, default file; read as the stores do.

    A refused URL (``DatabaseURLError``) is a usage error, as every store error (``_failure``).
    """
    from chatflow_sqlalchemy.urls import parse_database_url

    return parse_database_url(_opt("url"))


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


def _sqlite_file(url: URL) -> Path | None:
    """The file a SQLite URL names; None for in-memory databases and other backends."""
    from chatflow_sqlalchemy.backends.sqlite_files import is_ephemeral_sqlite

    if url.get_backend_name() != "sqlite" or is_ephemeral_sqlite(url):
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
    Each transaction begins with ``BEGIN`` (pysqlite would run every ``SELECT`` on its
    own), so the reads of one :func:`_read_conn` see one snapshot, as in a store.
    """
    import sqlite3
    from urllib.parse import quote

    from sqlalchemy import create_engine, event
    from sqlalchemy.pool import NullPool

    from chatflow_sqlalchemy.backends.sqlite_files import BUSY_TIMEOUT_MS

    uri = f"file:{quote(str(path.resolve()))}?mode=rw"

    def connect() -> sqlite3.Connection:
        conn = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA query_only = ON")
        return conn

    engine = create_engine(url.set(database=str(path), query={}), creator=connect,
                           poolclass=NullPool)
    event.listen(engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN"))
    return engine


@contextmanager
def _engine(url: URL, *, read_only: bool) -> Iterator[Engine]:
    """An engine on the database as it is (never migrated; connected once up front).

    A SQLite file opened to read needs no backend: only the sqlite3 module.
    """
    path = _sqlite_file(url)
    if path is not None and not path.is_file():  # SQLite would create it on connect
        raise CliError(
            f"no SQLite database at {clean(str(path))!r} (nothing was created); "
            f"check the URL, or create it with: {PROG} db upgrade"
        )
    if read_only and path:
        engine = _read_only_sqlite(url, path)
    else:
        from chatflow_sqlalchemy import migrate
        from chatflow_sqlalchemy.registry import backend_name_for_url, support_for

        support_for(backend_name_for_url(url))  # first, as a store: names a missing driver's extra
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


def _label(revision: str | None, chain: MigrationChain, upstream: bool = False) -> str:
    """A revision for messages; a core chain without one is empty or upstream's tables."""
    if revision is not None:
        return revision
    if not chain.is_core:
        return "none"
    return UPSTREAM_LABEL if upstream else "none (empty database)"


def _statuses(engine: Engine) -> list[ChainStatus]:
    """Every chain's status, refusing a database ahead of this package."""
    from chatflow_sqlalchemy import migrate

    statuses = list(migrate.chain_status(engine))
    for status in statuses:
        migrate.check_not_ahead(status.current, status.chain)
    return statuses


@contextmanager
def _database(*, write: bool = False) -> Iterator[tuple[URL, Engine]]:
    """An existing database whose every chain is at head (read-only unless ``write``)."""
    url = _resolve_url()
    with _engine(url, read_only=not write) as engine:
        behind = [status for status in _statuses(engine) if not status.at_head]
        if behind:  # read commands never migrate
            first, chain = behind[0], behind[0].chain
            upstream = chain.is_core and first.current is None and _has_upstream_tables(engine)
            what = "the schema" if chain.is_core else f"the schema of plugin {chain.name}"
            raise CliError(
                f"{_describe(url)}: {what} is at {_label(first.current, chain, upstream)}, "
                f"this package needs revision {first.head}; nothing was changed; {UPGRADE_HINT}"
            )
        yield url, engine


@contextmanager
def _read_conn(engine: Engine) -> Iterator[Connection]:
    """One connection (one snapshot) whose transaction is rolled back: reads only."""
    with engine.connect() as conn:
        try:
            yield conn
        finally:
            conn.rollback()


@contextmanager
def _reading() -> Iterator[tuple[URL, Connection]]:
    """A read connection on an existing database at head."""
    with _database() as (url, engine), _read_conn(engine) as conn:
        yield url, conn


def _count(conn: Connection, table: Any, *where: Any) -> int:
    from sqlalchemy import func, select

    return int(conn.execute(select(func.count()).select_from(table).where(*where)).scalar_one())


def _confirm(question: str) -> None:
    """Ask before a destructive step; refuse without a terminal unless ``--yes``."""
    if _opt("yes"):
        return
    if not sys.stdin.isatty():
        raise CliError(f"{question} -- refusing without confirmation: pass --yes to confirm")
    if not click.confirm(question, default=False, err=True):
        raise CliError("not confirmed; nothing was changed", EXIT_FAILED)


# --------------------------------------------------------------------------- commands

_SHARED_OPTIONS: dict[str, tuple[list[str], dict[str, Any]]] = {
    "yes": (["--yes", "-y"], {"help": "do not ask for confirmation (needed without a terminal)"}),
    "json": (["--json", "as_json"], {"help": "print one JSON document (for scripts)"}),
    "url": (["--url"], {
        "metavar": "URL", "is_flag": False, "default": None,
        "help": "database URL (default: $CHATFLOW_DATABASE_URL, else sqlite:///chatflow.db)",
    }),
}


def _remember(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    """Keep a shared option in ``ctx.meta`` (shared by every context) for ``_opt`` to read.

    A ``--url`` after the command wins over one before it.
    """
    if value is not None:
        ctx.meta[str(param.name)] = value


def _shared_option(name: str) -> click.Option:
    decls, attrs = _SHARED_OPTIONS[name]
    extra = {"is_flag": True, "expose_value": False, "callback": _remember}
    return click.Option(decls, **{**extra, **attrs})


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


@click.group(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=EXIT_CODES_EPILOG, no_args_is_help=True, invoke_without_command=True,
)
@click.version_option(
    package_name="chatflow-sqlalchemy", prog_name=PROG, message="%(prog)s %(version)s"
)
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Manage chatflow-sqlalchemy databases: migrations, sessions, dedup ids, the inbox."""
    if ctx.invoked_subcommand is None:  # only options (--url X): the help, not an error
        click.echo(ctx.get_help())


cli.params.append(_shared_option("url"))


def _group(name: str, *paragraphs: str) -> click.Group:
    group = click.Group(name, help="\n\n".join(paragraphs), no_args_is_help=True)
    cli.add_command(group)
    return group


db = _group("db", "Schema migrations. Only upgrade, downgrade and stamp change the schema.")
sessions = _group(
    "sessions", "Inspect, delete, sweep, export, rewind and fork sessions.",
    "The read commands (list, show, export) never create or migrate anything.",
)
dedup = _group("dedup", "Processed webhook ids (the dedup window).")
inbox = _group(
    "inbox", "The durable inbox: messages, retries, counts.",
    "list and stats never change anything; retry and purge write.",
)
users = _group(
    "users", "Export or erase everything held about a user_id.", "For GDPR / LGPD requests."
)
keys = _group(
    "keys", "Encryption keys: re-encrypt rows with a new key.",
    "The keys come from $CHATFLOW_KEYS; the first is the primary.",
)

# --------------------------------------------------------------------------- db


def _chains(
    engine: Engine, chain_name: str | None, revision: str, all_for: str | None
) -> list[MigrationChain]:
    """The chains a command acts on: ``--chain``, else every chain for head/base, else core."""
    from chatflow_sqlalchemy import migrate

    if chain_name:
        return [migrate.find_chain(chain_name, engine.dialect.name)]
    if all_for is not None and revision == all_for:
        return migrate.chains_for(engine.dialect.name)
    return [migrate.core_chain()]


def _check_revision(revision: str, chains: Sequence[MigrationChain]) -> None:
    """Refuse a revision no chain knows before asking or touching anything."""
    from chatflow_sqlalchemy import migrate

    if revision in ("head", "base", "heads") or any(mark in revision for mark in "@:+-"):
        return  # relative and branch forms: Alembic checks them
    known = [rev.revision for chain in chains for rev in migrate.history(chain)]
    if not any(rev.startswith(revision) for rev in known):
        raise CliError(
            f"unknown revision {clean(revision)!r}; known: {', '.join(known)}, head, base "
            f"(see: {PROG} db history)"
        )


def _read_revision(engine: Engine, chain: MigrationChain) -> str | None:
    from chatflow_sqlalchemy import migrate

    with _read_conn(engine) as conn:
        return migrate.current_revision(conn, chain)


def _prepare_new_sqlite_file(url: URL) -> None:
    """``db upgrade`` may create a SQLite file: make it private (0600, folder 0700)."""
    path = _sqlite_file(url)
    if path is None or path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
    except OSError as exc:
        raise CliError(f"cannot create {clean(str(path))!r}: {exc.strerror}") from None


def _migrate(revision: str, chain_name: str | None, action: str) -> None:
    """Upgrade, downgrade or stamp; report how each chain moved (plugins first going down)."""
    from chatflow_sqlalchemy import migrate

    url, down = _resolve_url(), action == "downgrade"
    if action == "upgrade":
        _prepare_new_sqlite_file(url)
    with _engine(url, read_only=False) as engine:
        all_for = {"upgrade": "head", "downgrade": "base"}.get(action)
        chains = _chains(engine, chain_name, revision, all_for)
        _check_revision(revision, chains)
        if down and len(chains) > 1:
            chains = [*chains[1:][::-1], chains[0]]
        before = [_read_revision(engine, chain) for chain in chains]
        for chain, found in zip(chains, before, strict=True):
            migrate.check_not_ahead(found, chain)
        upstream = before[0] is None and chains[0].is_core and _has_upstream_tables(engine)
        if down:
            what = "the tables (data is lost)" if revision == "base" else f"revision {revision}"
            _confirm(f"Downgrade {_safe_url(url)} to {clean(what)}?")
            migrate.downgrade(engine, revision, chain_name)
        elif action == "stamp":
            migrate.stamp(engine, revision, chains[0])
        else:
            migrate.upgrade(engine, revision, chain_name)
        after = [_read_revision(engine, chain) for chain in chains]
    moves = [
        (chain, old, new, _safe_url(url) + (":" if chain.is_core else f": plugin {chain.name}:"))
        for chain, old, new in zip(chains, before, after, strict=True)
    ]
    if action == "stamp":
        chain, old, new, prefix = moves[0]
        _emit({"database": _safe_url(url), "chain": chain.name, "from": old, "to": new},
              f"{prefix} stamped revision {_label(new, chain)} "
              f"(was {_label(old, chain, upstream)}); no migration was run")
        return
    heads = [migrate.head_revision(chain) for chain in chains]
    if _emit({"database": _safe_url(url), "chains": [
        {"chain": chain.name, "from": old, "to": new, "at_head": new == head}
        for (chain, old, new, _), head in zip(moves, heads, strict=True)
    ]}):
        return
    for (chain, old, new, prefix), head in zip(moves, heads, strict=True):
        suffix = " (head)" if not down and new == head else ""
        if old == new:
            click.echo(f"{prefix} already at revision {_label(old, chain, upstream)}{suffix}")
        else:
            verb, shown_old = "downgraded" if down else "upgraded", _label(old, chain, upstream)
            click.echo(f"{prefix} {verb} from {shown_old} to {_label(new, chain)}{suffix}")


_chain_option = click.option(
    "--chain", "chain_name", metavar="NAME",
    help="act on one migration chain: 'core' or an installed plugin's name "
    "(default: head/base move every chain, other revisions the core chain)",
)


@_command(db, "upgrade")
@click.argument("revision", default="head")
@_chain_option
def db_upgrade(revision: str, chain_name: str | None) -> None:
    """Upgrade the schema (default: every chain to head).

    Moves the core chain and every plugin chain that applies to the database.
    Creates the SQLite file (mode 0600) if it does not exist.
    """
    _migrate(revision, chain_name, "upgrade")


@_command(db, "downgrade", yes=True)
@click.argument("revision")
@_chain_option
def db_downgrade(revision: str, chain_name: str | None) -> None:
    """Downgrade the schema to REVISION (asks first).

    'base' drops the tables, plugins' first. Asks for confirmation unless
    --yes. 'db downgrade 0001' makes a file readable by chatflow-agent 0.3.4
    again.
    """
    _migrate(revision, chain_name, "downgrade")


@_command(db, "stamp")
@click.argument("revision")
@click.option(
    "--chain", "chain_name", metavar="NAME", help="the chain: 'core' (default) or a plugin"
)
def db_stamp(revision: str, chain_name: str | None) -> None:
    """Record REVISION without running any migration."""
    _migrate(revision, chain_name, "stamp")


def _db_status(*, drift: bool = False) -> tuple[URL, list[ChainStatus], bool, list[str], Any]:
    """(URL, chain statuses, upstream tables?, drift at head, JSON document), read-only."""
    from chatflow_sqlalchemy import migrate

    url = _resolve_url()
    with _engine(url, read_only=True) as engine:
        statuses = _statuses(engine)
        upstream = statuses[0].current is None and _has_upstream_tables(engine)
        at_head = all(s.at_head for s in statuses)
        diffs = migrate.drift(engine) if drift and at_head else []
    document = {"database": _safe_url(url), "chains": [
        {"chain": s.chain.name, "distribution": s.chain.distribution or None,
         "current": s.current, "head": s.head, "at_head": s.at_head,
         "description": _label(s.current, s.chain, upstream)}
        for s in statuses
    ], "at_head": at_head}
    return url, statuses, upstream, diffs, document


@_command(db, "current")
def db_current() -> None:
    """Show the database's revision of every chain."""
    url, statuses, upstream, _, document = _db_status()
    if _emit(document):
        return
    click.echo(f"database: {_safe_url(url)}")
    for s in statuses:
        name = "revision" if s.chain.is_core else f"plugin {s.chain.name} ({s.chain.distribution})"
        if s.at_head:
            click.echo(f"{name}: {s.current} (head)")
        else:
            click.echo(f"{name}: {_label(s.current, s.chain, upstream)}; head is {s.head}")
    if not document["at_head"]:
        click.echo(UPGRADE_HINT)


@_command(db, "history")
@click.option("--chain", "chain_name", metavar="NAME", help="this chain instead of the core's")
@click.option("--all", "show_all", is_flag=True, help="also every installed plugin's chain")
def db_history(chain_name: str | None, show_all: bool) -> None:
    """List the migration chain, newest first.

    Reads no database: it shows the revisions this installation knows.
    """
    from chatflow_sqlalchemy import migrate

    chains = [migrate.find_chain(chain_name)] if chain_name else [
        migrate.core_chain(), *(migrate.plugin_chains() if show_all else [])
    ]
    if _emit({"chains": [{
        "chain": chain.name, "distribution": chain.distribution or None,
        "version_table": chain.version_table,
        "revisions": [
            {"revision": rev.revision, "down_revision": rev.down_revision,
             "is_head": rev.is_head, "doc": plain_rst(rev.doc)}
            for rev in reversed(migrate.history(chain))
        ],
    } for chain in chains]}):
        return
    for index, chain in enumerate(chains):
        if index:
            dialects = ", ".join(sorted(chain.dialects)) if chain.dialects else "every database"
            click.echo(f"\nplugin {chain.name} ({chain.distribution}; version table "
                       f"{chain.version_table}; {dialects}):")
        for rev in reversed(migrate.history(chain)):
            marker = " (head)" if rev.is_head else ""
            doc = clean(plain_rst(rev.doc))
            click.echo(f"{rev.down_revision or '<base>'} -> {rev.revision}{marker}: {doc}")


@_command(db, "check")
def db_check() -> int:
    """Check the schema is at head and matches the models.

    Exit 0 if it is, else 1 (read-only).
    """
    url, statuses, upstream, diffs, document = _db_status(drift=True)
    behind = [status for status in statuses if not status.at_head]
    failed = EXIT_FAILED if behind or diffs else EXIT_OK
    if _emit({**document, "ok": not failed, "drift": diffs}):
        return failed
    for s in behind:
        what = _safe_url(url) + ("" if s.chain.is_core else f" plugin {s.chain.name}")
        shown = _label(s.current, s.chain, upstream)
        shown = shown if s.current is None else f"revision {shown}"
        click.echo(f"behind: {what} is at {shown}, the code expects {s.head}; {UPGRADE_HINT}")
    if behind:
        return EXIT_FAILED
    head = statuses[0].head
    if diffs:
        click.echo(
            f"drift: {_safe_url(url)} is at revision {head} (head), but its schema differs "
            f"from the models ({len(diffs)} difference(s)):"
        )
        for diff in diffs:
            click.echo(f"  - {clean(diff)}")
        return EXIT_FAILED
    plugins = "".join(
        f"; plugin {s.chain.name} at {s.current} (head)" for s in statuses if not s.chain.is_core
    )
    click.echo(f"ok: {_safe_url(url)} is at revision {head} (head) and matches the models{plugins}")
    return EXIT_OK


# --------------------------------------------------------------------------- reading sessions


@dataclass
class _Part:
    """A stored value read with ``$CHATFLOW_KEYS``: ``value`` in clear, else why it is not.

    A value sealed with a key not in ``$CHATFLOW_KEYS`` is intact, not corrupt: ``locked_by``
    names that key. A message row's value is its JSON document (``model_dump(mode="json")``).
    """

    value: Any = None
    raw: Any = None
    error: str | None = None
    locked_by: str | None = None
    row: Any = None
    table: str = ""

    def flags(self, prefix: str = "") -> dict[str, Any]:
        """The ``corrupt`` and ``locked`` members of a JSON document (each None if not)."""
        corrupt = None if self.error is None else {"reason": self.error, "raw": self.raw}
        locked = None if self.locked_by is None else {"key_id": self.locked_by}
        return {f"{prefix}corrupt": corrupt, f"{prefix}locked": locked}


def _locked(key_id: str) -> str:
    return f"encrypted with key {clean(repr(key_id))}, not in CHATFLOW_KEYS"


@functools.lru_cache(maxsize=4)
def _sealer_for(keys: str) -> Sealer:
    from chatflow_sqlalchemy.crypto import AESGCMCipher
    from chatflow_sqlalchemy.sealing import Sealer

    return Sealer(_checked(AESGCMCipher.from_env, keys) if keys else None, False)


def _sealer() -> Sealer:
    """A sealer holding the keys of ``$CHATFLOW_KEYS`` (none when unset)."""
    return _sealer_for(os.environ.get("CHATFLOW_KEYS", ""))


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


def open_row(session_id: str, stored: Any) -> _Part:
    """A stored ``message_json``, summary or metadata in clear when ``$CHATFLOW_KEYS`` opens it."""
    from chatflow_sqlalchemy.values import is_encrypted

    sealed_dict = isinstance(stored, dict) and set(stored) == {"_enc"}
    if not is_encrypted(stored["_enc"] if sealed_dict else stored):
        return _Part(stored, stored)
    try:
        if sealed_dict:
            return _Part(_sealer().open_metadata(session_id, stored), stored)
        return _Part(_sealer().open_text(session_id, None, stored, "chatflow_messages"), stored)
    except Exception as exc:
        locked_by, error = _why_closed(exc)
        return _Part(None, stored, error, locked_by)


def _read_message(session_id: str, row: Any, table: Any) -> _Part:
    """A message row opened and decoded; a row not in the stores' form is left to pydantic."""
    from chatflow_sqlalchemy.message_json import plain_message

    part = open_row(session_id, row.message_json)
    part.row, part.table = row, table.name
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


def _read_metadata(session_id: str, text: str | None) -> _Part:
    """Metadata from its stored JSON text (never raises): a dict, else why not."""
    if text is None:
        return _Part(error="metadata_json is NULL")
    try:
        value = json.loads(text)
    except ValueError as exc:
        return _Part(raw=text, error=f"invalid JSON: {exc}")
    if not isinstance(value, dict):
        return _Part(raw=text, error=f"not a JSON object (a {type(value).__name__})")
    part = open_row(session_id, value)
    part.raw = text
    return part


@dataclass
class _Record:
    """One session as stored: its ``row`` (of ``_session_query``) and its parts, read or not.

    ``rows``: the window (for ``show --all``, the transcript); ``archived``: for ``export``.
    """

    row: Any
    metadata: _Part
    summary: _Part
    rows: list[_Part] = field(default_factory=list)
    archived: list[_Part] = field(default_factory=list)

    def _parts(self) -> list[tuple[str, str, _Part]]:
        """(what, where, part) per part: named for a locked part, ``what + where`` if corrupt."""
        sid = clean(repr(self.row.session_id))
        return [
            (f"session {sid}: metadata_json", " in chatflow_sessions", self.metadata),
            (f"session {sid}: summary", " in chatflow_sessions", self.summary),
            *((f"session {sid}: {p.table} row id {p.row.id}", "", p)
              for p in [*self.rows, *self.archived]),
        ]

    def locked(self) -> list[tuple[str, str]]:
        """(key id, what) per part encrypted with a key not in ``$CHATFLOW_KEYS``."""
        return [(p.locked_by, what) for what, _, p in self._parts() if p.locked_by is not None]

    def problems(self) -> list[str]:
        """One line per corrupt part, naming the session, the table and the row id."""
        return [f"{what}{where} is corrupt ({clean(p.error)})"
                for what, where, p in self._parts() if p.error is not None]


def _session_query(session_ids: Sequence[str] | None = None, *, columns: Any = None) -> Any:
    """Sessions, most recently updated first; none without an agent yet (as ``get``).

    Their ids, agents, times and ``columns`` (default: what ``show`` and ``export`` read).
    """
    from sqlalchemy import Text, cast, select

    from chatflow_sqlalchemy import tables
    from chatflow_sqlalchemy.values import UNBORN_AGENT

    c = tables.sessions.c
    if columns is None:
        text = cast(c.metadata_json, Text).label("metadata_text")
        columns = (text, c.summary, c.forked_from, c.forked_at_turn)
    query = select(c.session_id, c.active_agent_name, c.created_at, c.updated_at, *columns)
    query = query.where(c.active_agent_name != UNBORN_AGENT)  # the inbox's, before a turn
    query = query.order_by(c.updated_at.desc(), c.session_id)
    return query if session_ids is None else query.where(c.session_id.in_(session_ids))


def _record(conn: Connection, row: Any, *, whole: bool = False, archived: bool = False) -> _Record:
    """Read one session (``row`` of ``_session_query``) with its messages.

    ``whole``: ``rows`` is the transcript (archive + window, one row per seq, as
    ``store.transcript``); ``archived``: the archive is also read into ``archived``.
    """
    from sqlalchemy import case, select

    from chatflow_sqlalchemy import tables

    sid = row.session_id
    summary = _Part() if row.summary is None else open_row(sid, row.summary)
    record = _Record(row, _read_metadata(sid, row.metadata_text), summary)

    window, archive = tables.messages, tables.message_archive

    def rows(table: Any) -> list[Any]:  # the window: SYSTEM first, then by seq
        c = table.c
        first = case((c.role == "system", 0), else_=1)
        query = select(c.id, c.seq, c.role, c.created_at, c.message_json)
        order = (c.seq, c.id) if table is archive else (first, c.seq)
        return list(conn.execute(query.where(c.session_id == sid).order_by(*order)))

    if whole:
        by_seq = {msg.seq: (msg, table) for table in (archive, window) for msg in rows(table)}
        record.rows.extend(_read_message(sid, *by_seq[seq]) for seq in sorted(by_seq))
        return record
    record.rows.extend(_read_message(sid, msg, window) for msg in rows(window))
    if archived:
        record.archived.extend(_read_message(sid, msg, archive) for msg in rows(archive))
    return record


def _no_session(session_id: str, url: URL) -> CliError:
    return CliError(f"no session {clean(repr(session_id))} in {_describe(url)}", EXIT_FAILED)


# --------------------------------------------------------------------------- sessions


def _list_filters(meta: Sequence[str], updated_after: str | None, **given: Any) -> Any:
    """``sessions list`` options as the store's ``ListFilters`` (None: the plain listing)."""
    from chatflow_sqlalchemy.lifecycle import ListFilters

    if not meta and updated_after is None and all(v is None for v in given.values()):
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
    return _checked(ListFilters.build, metadata=wanted, updated_after=since, **given)


@_command(sessions, "list")
@click.option("--user", "user_id", metavar="ID", help="only the sessions of this user_id")
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
def sessions_list(meta: tuple[str, ...], updated_after: str | None, **given: Any) -> None:
    """List sessions, most recently updated first.

    With --limit or --after the list is paged by session id (ascending), so
    that walking the pages returns every session once even while they are
    written: pass the last id shown as --after for the next page.
    """
    from sqlalchemy import func, select

    from chatflow_sqlalchemy import tables
    from chatflow_sqlalchemy.sql_lifecycle import session_page

    filters = _list_filters(meta, updated_after, **given)
    s, m = tables.sessions.c, tables.messages.c
    # Counted per listed session (an index range each), not over the whole table.
    count = select(func.count()).where(m.session_id == s.session_id).correlate(tables.sessions)
    query = _session_query(columns=[count.scalar_subquery().label("messages")])
    with _reading() as (_url, conn):
        if filters is None:
            rows = list(conn.execute(query))
        else:
            ids = session_page(conn, filters)  # the store's own filters and order
            found = {row.session_id: row for i in range(0, len(ids), 500)
                     for row in conn.execute(query.where(s.session_id.in_(ids[i : i + 500])))}
            rows = [found[sid] for sid in ids if sid in found]
    limit = given["limit"]
    next_after = rows[-1].session_id if limit is not None and len(rows) == limit else None
    document: dict[str, Any] = {"sessions": [
        {"session_id": row.session_id, "active_agent_name": row.active_agent_name,
         "messages": int(row.messages), "created_at": _iso(row.created_at),
         "updated_at": _iso(row.updated_at)}
        for row in rows
    ]}
    if limit is not None:  # paging: where the next page starts (None: this was the last)
        document["next_after"] = next_after
    if next_after is not None and not _opt("as_json"):
        click.echo(f"next page: --after {clean(repr(next_after))}", err=True)
    _listing(document, ("SESSION", "ACTIVE AGENT", "MESSAGES", "UPDATED"), [
        (clean(r.session_id), clean(r.active_agent_name), str(r.messages),
         _format_time(r.updated_at))
        for r in rows
    ], "no sessions")


_Line = tuple[str, str, bool]
"""One printable part of a message: its role, its (cleaned) text, and whether it is corrupt."""


def _lines(part: _Part) -> list[_Line]:
    """The printable parts of a message row; an unreadable row is one line naming it."""
    row, message = part.row, part.value
    role = str(row.role)
    if message is None:
        text = (f"row id {row.id} in {part.table} is {_locked(part.locked_by)}"
                if part.locked_by is not None
                else f"CORRUPT ROW id {row.id} in {part.table} ({part.error}): {part.raw!r}")
        return [(role, clean(text), True)]
    lines = [(role, clean(message["content"], newlines=True), False)] if message["content"] else []
    for call in message["tool_calls"] or []:
        args = json.dumps(call["args"], ensure_ascii=False, sort_keys=True, default=str)
        lines.append((role, clean(f"tool call {call['name']} {args} (id {call['id']})"), False))
    for result in message["tool_results"] or []:
        text = f"tool result {result['name']} is_error={result['is_error']}: "
        text += _format_content(result["content"])
        lines.append((role, clean(text, newlines=True), False))
    return lines or [(role, "(empty)", False)]


def _group_turns(parts: Sequence[_Part]) -> list[tuple[str, list[_Part]]]:
    """SYSTEM messages first, then one group per user turn."""
    system = [part for part in parts if part.row.role == "system"]
    groups = [("System", system)] if system else []
    turn = 0
    for part in parts:
        if part.row.role == "user":
            turn += 1
            groups.append((f"Turn {turn}", []))
        elif part.row.role == "system":
            continue
        elif turn == 0 and (not groups or groups[-1][0] != "Before the first turn"):
            groups.append(("Before the first turn", []))
        groups[-1][1].append(part)
    return groups


def _header(record: _Record, turns: int) -> list[tuple[str, str, str]]:
    """The lines above the conversation: (name, cleaned value, Rich style)."""
    row = record.row
    lines = [
        ("session", clean(row.session_id), ""),
        ("active agent", clean(row.active_agent_name), "bold"),
        ("created", _format_time(row.created_at), ""),
        ("updated", _format_time(row.updated_at), ""),
    ]
    if row.forked_from is not None:
        lines.append(("forked from", f"{clean(row.forked_from)} at turn {row.forked_at_turn}", ""))
    for name, part in (("metadata", record.metadata), ("summary", record.summary)):
        if part.locked_by is not None:
            lines.append((name, f"({_locked(part.locked_by)})", "bold red"))
        elif part.error is not None:
            lines.append((name, clean(f"CORRUPT ({part.error}): {part.raw!r}"), "bold red"))
        elif part.value and name == "metadata":
            lines.append((name, clean(_format_content(part.value)), ""))
        elif part.value is not None and name == "summary":  # a readable one keeps its newlines
            lines.append((name, clean(part.value, newlines=True), ""))
    return [*lines, ("messages", f"{len(record.rows)} in {turns} turn(s)", "")]


def _show_plain(record: _Record, turns: int) -> None:
    for name, value, _style in _header(record, turns):
        if name == "summary" and record.summary.value is not None:  # a block: may span lines
            click.echo("summary:\n  " + value.replace("\n", "\n  "))
        else:
            click.echo(f"{name}: {value}")
    for title, parts in _group_turns(record.rows):
        click.echo(f"\n{title}")
        for part in parts:
            for role, text, _corrupt in _lines(part):  # later lines aligned under the first
                label = f"  {_format_time(part.row.created_at)}  [{role}] "
                click.echo(label + text.replace("\n", "\n" + " " * len(label)))


_ROLE_STYLES = {"user": "bold green", "model": "bold cyan", "tool": "magenta", "system": "yellow"}


def _show_rich(console: Console, record: _Record, turns: int) -> None:
    from rich.rule import Rule
    from rich.table import Table
    from rich.text import Text

    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    for name, value, style in _header(record, turns):
        head.add_row(name, Text(value, style=style))
    console.print(head)
    for title, parts in _group_turns(record.rows):
        console.print(Rule(Text(title, style="bold")))
        body = Table.grid(padding=(0, 1))
        body.add_column(style="dim", no_wrap=True)
        body.add_column(no_wrap=True)
        body.add_column(overflow="fold")
        for part in parts:
            for role, text, corrupt in _lines(part):
                body.add_row(
                    Text(_format_time(part.row.created_at)),
                    Text(f"[{role}]", style=_ROLE_STYLES.get(role, "bold")),
                    Text(text, style="bold red" if corrupt else ""),
                )
        console.print(body)


@_command(sessions, "show")
@click.argument("session_id")
@click.option(
    "--all", "whole", is_flag=True,
    help="the whole transcript: archived (pruned) messages too, in order",
)
def sessions_show(session_id: str, whole: bool) -> None:
    """Print a conversation turn by turn (read-only).

    Without --all: the window the model sees. With --all: the transcript
    (messages pruned from the window and kept by a store opened with
    archive_pruned=True, then the window). Corrupt rows (and corrupt
    metadata) are shown raw and named, with exit code 1.
    """
    from chatflow_sqlalchemy.values import validate_session_id

    _checked(validate_session_id, session_id)
    with _reading() as (url, conn):
        row = conn.execute(_session_query([session_id])).first()
        if row is None:
            raise _no_session(session_id, url)
        record = _record(conn, row, whole=whole)
    turns = sum(1 for part in record.rows if part.row.role == "user")
    if not _emit({
        "session_id": row.session_id, "active_agent_name": row.active_agent_name,
        "created_at": _iso(row.created_at), "updated_at": _iso(row.updated_at),
        "metadata": record.metadata.value, **record.metadata.flags("metadata_"),
        "summary": record.summary.value, **record.summary.flags("summary_"),
        "forked_from": row.forked_from, "forked_at_turn": row.forked_at_turn, "turns": turns,
        "messages": [
            {"id": p.row.id, "table": p.table, "role": str(p.row.role),
             "created_at": _iso(p.row.created_at), "message": p.value, **p.flags()}
            for p in record.rows
        ],
    }):
        console = _rich_console()
        if console is None:
            _show_plain(record, turns)
        else:
            _show_rich(console, record, turns)
    failures, problems, locked = [], record.problems(), record.locked()
    if problems:
        failures.append(
            f"{len(problems)} corrupt part(s): {'; '.join(problems)}; fix or delete them, "
            "or delete the session"
        )
    if locked:  # what to do about parts encrypted with keys not in $CHATFLOW_KEYS
        key_ids = sorted({key for key, _ in locked})
        named = ", ".join(clean(repr(key)) for key in key_ids)
        failures.append(
            f"{len(locked)} part(s) encrypted with key {named}, not in CHATFLOW_KEYS "
            f"({locked[0][1]}{', ...' if len(locked) > 1 else ''}): to read them, add the key "
            f"to CHATFLOW_KEYS ('{clean(key_ids[0])}:<base64 key>', after the primary)"
        )
    if failures:
        raise CliError("; ".join(failures), EXIT_FAILED)


@_command(sessions, "delete", yes=True)
@click.argument("session_id")
def sessions_delete(session_id: str) -> None:
    """Delete a session and everything stored with it (asks first).

    Its history, archive, webhook claims and inbox messages, in one transaction,
    as store.delete does; also the claims and inbox messages of an id that has
    no session (yet). Asks for confirmation unless --yes.
    """
    from sqlalchemy import select, union_all

    from chatflow_sqlalchemy import tables
    from chatflow_sqlalchemy.sql_lifecycle import delete_session
    from chatflow_sqlalchemy.values import validate_session_id

    _checked(validate_session_id, session_id)
    shown = clean(repr(session_id))
    holders = (tables.sessions, tables.processed_messages, tables.inbox)
    held = union_all(*(
        select(table.c.session_id).where(table.c.session_id == session_id).limit(1)
        .subquery().select() for table in holders
    ))
    with _database(write=True) as (url, engine):
        with _read_conn(engine) as conn:
            if conn.execute(held).first() is None:
                raise _no_session(session_id, url)
        _confirm(f"Delete session {shown} with its history, claims and inbox messages?")
        with engine.begin() as conn:
            existed = delete_session(conn, session_id)
    shown_done = (f"deleted session {shown}" if existed else
                  f"deleted the claims and inbox messages of {shown} (it had no session row)")
    _emit({"session_id": session_id, "deleted": True, "session_existed": existed}, shown_done)


@contextmanager
def _history_store(session_id: str, **options: Any) -> Iterator[tuple[URL, Any]]:
    """(URL, a store) that changes an existing session's history as workers do.

    With the keys of ``$CHATFLOW_KEYS``; a stored agent name stands for itself (the CLI
    runs no agent); a row that cannot be read is exit 1, naming it.
    """
    from chatflow_sqlalchemy.values import validate_session_id

    _checked(validate_session_id, session_id)
    with _reading() as (url, conn):
        if conn.execute(_session_query([session_id])).first() is None:
            raise _no_session(session_id, url)
    from chatflow_agent import Agent

    from chatflow_sqlalchemy.exceptions import CorruptRowError
    from chatflow_sqlalchemy.opening import open_store

    with open_store(url, cipher=_sealer().cipher, auto_migrate=False, **options) as store:
        store.set_agent_resolver(lambda name: Agent(name=name, instructions=""))
        try:
            yield url, store
        except CorruptRowError as exc:
            raise CliError(f"nothing was changed: {clean(str(exc))}", EXIT_FAILED) from None
        except ValueError as exc:  # the store's refusal of an argument, naming the fix
            raise CliError(clean(str(exc))) from None


def _turns_in(history: Sequence[Message]) -> int:
    """How many turns a history window holds (each opens with a USER message)."""
    return sum(1 for message in history if message.role == "user")


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
def sessions_rewind(session_id: str, turns: int, archive: bool) -> None:
    """Remove the last turns of a session (asks first).

    Runs as a turn of the session, as ctx.rewind does: it waits for a turn
    running on the session elsewhere, and workers show the shorter history
    from their next turn on. Edit-and-regenerate is a rewind, then a new
    turn. Asks for confirmation unless --yes. Encrypted rows are read and
    written with the keys of $CHATFLOW_KEYS.
    """
    shown = clean(repr(session_id))
    with _history_store(session_id, archive_pruned=archive) as (url, store):
        ctx = store.get(session_id)
        if ctx is None:
            raise _no_session(session_id, url)
        held = _turns_in(ctx.history)
        if turns > held:
            fix = f"pass --turns from 1 to {held}" if held else "there is nothing to rewind"
            raise CliError(
                f"cannot rewind {turns} turn(s) of session {shown}: its window holds "
                f"{held}; {fix} (nothing was changed)"
            )
        _confirm(f"Remove the last {turns} turn(s) of session {shown}?")
        ctx.rewind(turns)
        left = _turns_in(ctx.history)
    _emit({"session_id": session_id, "rewound": turns, "turns": left},
          f"rewound {turns} turn(s) of session {shown}: {left} turn(s) left")


@_command(sessions, "fork")
@click.argument("session_id")
@click.argument("new_session_id")
@click.option(
    "--at-turn", type=click.IntRange(min=0), metavar="K",
    help="take only the first K complete turns of the window (default: all of them)",
)
def sessions_fork(session_id: str, new_session_id: str, at_turn: int | None) -> None:
    """Copy a session into a new one, whole or up to a turn.

    NEW_SESSION_ID gets the SYSTEM messages and the first K complete turns
    of SESSION_ID's window (all of them without --at-turn), with its
    summary, active agent, metadata and user_id, in one transaction; the
    session is unchanged. An existing NEW_SESSION_ID is refused and nothing
    is written. sessions list --forked-from SESSION_ID lists the forks.
    Encrypted rows are read and written with the keys of $CHATFLOW_KEYS.
    """
    with _history_store(session_id) as (_url, store):
        ctx = store.fork(session_id, new_session_id, at_turn=at_turn)
        taken = ctx.forked_at_turn
        copied = len(ctx.history) - (ctx.summary is not None)  # the summary is no row
    _emit(
        {"session_id": new_session_id, "forked_from": session_id, "forked_at_turn": taken,
         "messages": copied},
        f"forked session {clean(repr(session_id))} into {clean(repr(new_session_id))}: "
        f"{taken} turn(s), {copied} message(s)",
    )


def _export(engine: Engine, sink: IO[str], skip_corrupt: bool) -> tuple[int, list[str]]:
    """Write every readable session as one JSON line; return (count, skipped problems)."""
    exported, skipped = 0, []
    with _read_conn(engine) as conn:  # one snapshot for the whole export
        for row in list(conn.execute(_session_query())):
            record = _record(conn, row, archived=True)
            problems = [*record.problems(), *(f"{w} is {_locked(k)}" for k, w in record.locked())]
            if problems and not skip_corrupt:
                # plain `show` reads the window only: an archived row needs --all
                whole = " --all" if any(p.value is None for p in record.archived) else ""
                raise CliError(
                    f"export stopped: {problems[0]}; pass --skip-corrupt to export the "
                    f"other sessions, or see: {PROG} sessions show "
                    f"{clean(repr(row.session_id))}{whole}",
                    EXIT_FAILED,
                )
            skipped.extend(problems)
            if problems:
                continue
            document = {
                "session_id": row.session_id, "active_agent_name": row.active_agent_name,
                "metadata": record.metadata.value, "summary": record.summary.value,
                "forked_from": row.forked_from, "forked_at_turn": row.forked_at_turn,
                "messages": [p.value for p in record.rows if p.value is not None],
            }
            if record.archived:  # only sessions with an archive (archive_pruned=True)
                document["archived_messages"] = [
                    p.value for p in record.archived if p.value is not None
                ]
            sink.write(_json_text(document) + "\n")
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


def _write_output(target: Path | None, write: Callable[[IO[str]], _T]) -> _T:
    """Run ``write`` on a private (0600) file beside ``target``, then rename it over ``target``.

    ``target`` is replaced only if ``write`` succeeds and it is still absent or a regular file.
    Without a ``target``, ``write`` writes to stdout.
    """
    import tempfile

    if target is None:
        return write(sys.stdout)
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


def _output_path(_ctx: click.Context, _param: click.Parameter, value: str | None) -> Path | None:
    return None if value in (None, "-") else Path(value)


_output_option = click.option(
    "--output", "-o", "target", metavar="FILE", callback=_output_path,
    help="write to FILE (mode 0600) instead of stdout",
)


@_command(sessions, "export")
@_output_option
@click.option(
    "--skip-corrupt", is_flag=True,
    help="export the readable sessions; report the others on stderr (corrupt, or encrypted "
    "with a key not in CHATFLOW_KEYS)",
)
def sessions_export(target: Path | None, skip_corrupt: bool) -> None:
    """Export sessions as JSON lines (read-only).

    Each line: {"session_id", "active_agent_name", "metadata", "summary",
    "forked_from", "forked_at_turn", "messages"} (+ "archived_messages" for a
    session with an archive). A session with a corrupt row (in the window or
    the archive, or a corrupt summary) stops the export (FILE is then left as
    it was) unless --skip-corrupt, which names each bad row (session, table,
    row id) on stderr and exports the other sessions. With --json,
    the summary after writing FILE is a JSON document.
    """
    with _database() as (_url, engine):
        count, skipped = _write_output(target, lambda f: _export(engine, f, skip_corrupt))
    for problem in skipped:
        click.echo(f"skipped: {problem}", err=True)
    if target is not None:
        extra = f"; skipped {len(skipped)} corrupt part(s), see above" if skipped else ""
        _emit({"exported": count, "output": str(target), "skipped": skipped},
              f"exported {count} session(s) to {clean(str(target))}{extra}")


@_command(sessions, "sweep", yes=True)
@click.option(
    "--ttl-hours", type=float, required=True, envvar="CHATFLOW_SESSION_TTL_HOURS",
    show_envvar=True,
    help="sessions not updated for this many hours are expired (the store's session_ttl_hours)",
)
@click.option("--limit", type=click.IntRange(min=1), help="remove at most this many")
@click.option("--dry-run", is_flag=True, help="only count what would go (read-only)")
def sessions_sweep(ttl_hours: float, limit: int | None, dry_run: bool) -> None:
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
    with _reading() as (url, conn):
        now = utcnow()
        expired, oldest = count_expired(conn, now - timedelta(hours=hours), now)
    expired = expired if limit is None else min(expired, limit)
    if dry_run:
        _emit({"dry_run": True, "expired": expired, "oldest": oldest},
              f"{expired} expired session(s) would be removed",
              *(f"  {clean(session_id)}" for session_id in oldest[:expired]))
        return
    removed = 0
    if expired:
        from chatflow_sqlalchemy.opening import open_store

        _confirm(f"Remove {expired} expired session(s) and their history?")
        with open_store(url, session_ttl_hours=hours, auto_migrate=False) as store:
            removed = int(store.sweep(limit))
    _emit({"dry_run": False, "removed": removed}, f"removed {removed} expired session(s)")


# --------------------------------------------------------------------------- dedup


def _ttl(hours: float | None = None) -> float:
    """The dedup TTL in hours: ``--ttl-hours`` (checked), else the store's default window."""
    from chatflow_sqlalchemy.values import DEFAULT_DEDUP_TTL_HOURS

    if hours is None:
        return float(DEFAULT_DEDUP_TTL_HOURS)
    if not hours > 0 or hours == float("inf") or hours > 24 * 365 * 1000:
        raise CliError(f"--ttl-hours must be a positive number of hours, got {hours!r}")
    return hours


_ttl_option = click.option(
    "--ttl-hours", "ttl", type=float, metavar="HOURS", callback=lambda _c, _p, hours: _ttl(hours),
    help="dedup window in hours (default: the stores' default, 192 = 8 days)",
)


def _cutoff(ttl_hours: float) -> datetime:
    from chatflow_sqlalchemy.values import utcnow

    return utcnow() - timedelta(hours=ttl_hours)


def _confirm_purge(
    engine: Engine, ttl: float, rows: str, risk: str, when: Any, *where: Any
) -> None:
    """Ask before a purge whose TTL is below the default window: a redelivery may need its rows.

    ``when`` is the rows' time column, ``where`` what else selects them.
    """
    default = _ttl()
    if ttl < default:
        with _read_conn(engine) as conn:
            kept = (when >= _cutoff(default), when < _cutoff(ttl), *where)
            unexpired = _count(conn, when.table, *kept)
        if unexpired:
            _confirm(f"Purge {unexpired} {rows} still inside the default {default:g} h dedup "
                     f"window ({risk})?")


@_command(dedup, "list")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True, help="rows")
@_ttl_option
def dedup_list(limit: int, ttl: float) -> None:
    """List processed ids and their claim state, newest first.

    States: in_flight (a worker holds it, lease live), expired (its worker
    stopped renewing: the next delivery takes it over), done, released (the
    next delivery acquires it).
    """
    from chatflow_sqlalchemy import tables
    from chatflow_sqlalchemy.sql_claims import read_claims

    with _reading() as (_url, conn):
        claims = read_claims(conn, limit=limit)
        total = _count(conn, tables.processed_messages)
    cutoff, window = _cutoff(ttl), timedelta(hours=ttl)
    _listing({"ttl_hours": ttl, "total": total, "ids": [
        {"message_id": c.message_id, "state": c.state, "session_id": c.session_id,
         "lease_age": c.lease_age, "lease_left": c.lease_left, "has_response": c.has_response,
         "processed_at": _iso(c.updated_at), "expires_at": _iso(c.updated_at + window),
         "expired": c.updated_at < cutoff}
        for c in claims
    ]}, ("MESSAGE ID", "STATE", "SESSION", "CLAIMED AT", "EXPIRES AT", "EXPIRED"), [
        (clean(c.message_id),
         c.state if c.lease_age is None else f"{c.state} (lease renewed {c.lease_age:.0f} s ago)",
         clean(c.session_id or "-"), _format_time(c.updated_at),
         _format_time(c.updated_at + window), "yes" if c.updated_at < cutoff else "no")
        for c in claims
    ], "no processed ids", total)


@_command(dedup, "release", yes=True)
@click.argument("message_id")
def dedup_release(message_id: str) -> None:
    """Free a webhook id held by a stuck or dead worker.

    The next delivery of the id acquires it at once. If the old holder is
    alive after all, its turn gets ClaimLostError at commit and writes
    nothing. Asks for confirmation unless --yes.
    """
    from chatflow_sqlalchemy.sql_claims import free_claim

    shown = clean(message_id)
    with _database(write=True) as (_url, engine):
        _confirm(f"Release the claim on {shown}? The next delivery of it runs its turn.")
        with engine.begin() as conn:
            freed = free_claim(conn, message_id)
    if not freed:
        raise CliError(
            f"{shown} is not held by any worker (unknown, done or released)", EXIT_FAILED
        )
    _emit({"message_id": message_id, "released": True},
          f"released {shown}: the next delivery acquires it")


@_command(dedup, "count")
@_ttl_option
def dedup_count(ttl: float) -> None:
    """Count processed ids, live and expired (read-only)."""
    from chatflow_sqlalchemy import tables

    table = tables.processed_messages
    with _reading() as (_url, conn):
        total = _count(conn, table)
        expired = _count(conn, table, table.c.processed_at < _cutoff(ttl))
    live = total - expired
    _emit({"ttl_hours": ttl, "total": total, "expired": expired, "live": live},
          f"{total} processed id(s): {live} live, {expired} expired (TTL {ttl:g} h)")


@_command(dedup, "purge", yes=True)
@_ttl_option
def dedup_purge(ttl: float) -> None:
    """Delete processed ids older than the TTL.

    A --ttl-hours shorter than the default window removes ids a webhook
    retry may still need: that asks for confirmation unless --yes.
    """
    from sqlalchemy import delete

    from chatflow_sqlalchemy import tables
    from chatflow_sqlalchemy.registry import backend_name_for_url, support_for
    from chatflow_sqlalchemy.values import utcnow

    table = tables.processed_messages
    with _database(write=True) as (url, engine):
        risk = "a retried webhook could then run twice"
        _confirm_purge(engine, ttl, "id(s)", risk, table.c.processed_at)
        now = utcnow()
        cutoff = now - timedelta(hours=ttl)
        with engine.begin() as conn:  # whole days first (PostgreSQL's day partitions)
            support = support_for(backend_name_for_url(url))
            removed = support.drop_expired_processed(conn, cutoff, now)
        with engine.begin() as conn:
            removed += conn.execute(delete(table).where(table.c.processed_at < cutoff)).rowcount
    _emit({"ttl_hours": ttl, "removed": removed},
          f"removed {removed} expired processed message id(s) (TTL {ttl:g} h)")


# --------------------------------------------------------------------------- inbox


@contextmanager
def _inbox(*, ttl: float | None = None) -> Iterator[tuple[URL, Engine, Inbox]]:
    """The inbox of an existing database at head, to write, through a store on the CLI's engine.

    The store never migrates. ``inbox list`` and ``stats`` read the rows without a store.
    """
    from chatflow_sqlalchemy.store import SQLAlchemySessionStore

    with (
        _database(write=True) as (url, engine),
        SQLAlchemySessionStore(
            engine=engine, auto_migrate=False, dedup_ttl_hours=ttl or _ttl()
        ) as store,
    ):
        yield url, engine, store.inbox


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
@click.option("--state", type=click.Choice(INBOX_STATES), help="only the messages in this state")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True, help="rows")
def inbox_list(state: str | None, limit: int) -> None:
    """List inbox messages in arrival order, oldest first (read-only).

    States: pending (waiting for a worker), in_flight (a worker's batch),
    done (answered, no send), sent (answered and sent), dead (failed
    max_attempts times; the error says why: retry it with inbox retry).
    """
    from chatflow_sqlalchemy.inbox_reads import read_entries, read_stats

    with _reading() as (_url, conn):
        entries = read_entries(conn, state, limit)
        counts = read_stats(conn).counts
    total = counts.get(state, 0) if state is not None else sum(counts.values())
    if _listing(
        {"state": state, "total": total, "messages": [e.as_dict() for e in entries]},
        ("MESSAGE ID", "SESSION", "STATE", "ATTEMPTS", "RECEIVED", "UPDATED", "ERROR"),
        [(clean(e.message_id), clean(e.session_id), e.state, str(e.attempts),
          _format_time(e.received_at), _format_time(e.updated_at), clean(e.error or "-"))
         for e in entries],
        f"no {state} messages in the inbox" if state else "no messages in the inbox", total,
    ):
        return
    if any(entry.state == "dead" for entry in entries):
        click.echo(f"give a dead message another try with: {PROG} inbox retry MESSAGE_ID", err=True)


_NOT_DEAD = {"pending": "it waits for a worker", "in_flight": "a worker is answering it",
             "done": "it was answered", "sent": "it was answered and its reply sent"}
"""Why ``inbox retry`` leaves a message of each state alone."""


@_command(inbox, "retry")
@click.argument("message_id")
def inbox_retry(message_id: str) -> None:
    """Give a dead message another try, with the rest of its batch.

    Its batch's dead messages are pending again with their attempts reset;
    the next worker of inbox.serve answers them. Only dead messages are
    retried: see them with inbox list --state dead.
    """
    from sqlalchemy import select

    from chatflow_sqlalchemy import tables
    from chatflow_sqlalchemy.claims import validate_message_id

    _checked(validate_message_id, message_id)
    shown, c = clean(repr(message_id)), tables.inbox.c
    with _inbox() as (url, engine, rows):
        if not rows.retry(message_id):  # why not: no such message, or it is not dead
            with _read_conn(engine) as conn:
                state = conn.execute(select(c.state).where(c.message_id == message_id)).scalar()
            if state is None:
                raise CliError(f"no message {shown} in the inbox of {_describe(url)}; see: "
                               f"{PROG} inbox list", EXIT_FAILED)
            raise CliError(
                f"message {shown} is {clean(state)}, not dead "
                f"({_NOT_DEAD.get(state, 'nothing to retry')}): only dead messages are "
                f"retried; see them with: {PROG} inbox list --state dead",
                EXIT_FAILED,
            )
    _emit({"message_id": message_id, "retried": True},
          f"retried {shown}: it is pending again with the rest of its batch; "
          "the next worker of inbox.serve answers it")


@_command(inbox, "stats")
def inbox_stats() -> None:
    """Count inbox messages per state (read-only).

    Also the age of the oldest pending message (by the database's clock)
    and how many messages died in the last hour.
    """
    from chatflow_sqlalchemy.inbox_reads import read_stats

    with _reading() as (_url, conn):
        stats = read_stats(conn)
    if _emit(stats.as_dict()):
        return
    _table(("STATE", "MESSAGES"), [(state, str(n)) for state, n in stats.counts.items()])
    oldest = stats.oldest_pending_seconds
    click.echo("no pending messages" if oldest is None
               else f"oldest pending message: waiting {_age(oldest)}")
    click.echo(f"dead in the last hour: {stats.dead_last_hour}")
    if stats.counts.get("dead"):
        click.echo(f"see the dead messages with: {PROG} inbox list --state dead", err=True)


@_command(inbox, "purge", yes=True)
@_ttl_option
def inbox_purge(ttl: float) -> None:
    """Delete answered (done and sent) messages older than the TTL.

    Pending, in-flight and dead messages stay. An answered message keeps
    its id refused for the dedup window, so a --ttl-hours shorter than the
    default lets a redelivery in: that asks for confirmation unless --yes.
    """
    from chatflow_sqlalchemy import tables
    from chatflow_sqlalchemy.claims import validate_dedup_ttl

    _checked(validate_dedup_ttl, ttl, what="--ttl-hours: ")  # the store's own bound
    c = tables.inbox.c
    with _inbox(ttl=ttl) as (_url, engine, rows):
        risk = "a redelivery could then be answered twice"
        answered = c.state.in_(["done", "sent"])
        _confirm_purge(engine, ttl, "answered message(s)", risk, c.updated_at, answered)
        removed = rows.purge()
    _emit({"ttl_hours": ttl, "removed": removed},
          f"removed {removed} answered inbox message(s) older than {ttl:g} h")


# --------------------------------------------------------------------------- users, keys, misc


@_command(users, "erase", yes=True)
@click.argument("user_id")
def users_erase(user_id: str) -> None:
    """Erase every session of USER_ID (asks first).

    Its sessions go with their messages, claims and inbox messages, in one transaction.
    Asks first unless --yes. Workers with a live context of an erased
    session get SessionDeletedError on their next read or write.
    """
    from chatflow_sqlalchemy.lifecycle import validate_user_id
    from chatflow_sqlalchemy.sql_lifecycle import erase_user_rows, user_session_ids

    _checked(validate_user_id, user_id)
    shown = clean(repr(user_id))
    with _database(write=True) as (_url, engine):
        with _read_conn(engine) as conn:
            found = len(user_session_ids(conn, user_id))
        if found:
            _confirm(f"Erase {found} session(s) of user {shown} and everything stored with them?")
            with engine.begin() as conn:
                found = erase_user_rows(conn, user_id)
    _emit({"user_id": user_id, "erased": found}, f"erased {found} session(s) of user {shown}")


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


@_command(users, "export")
@click.argument("user_id")
@_output_option
def users_export(user_id: str, target: Path | None) -> None:
    """Export everything held about USER_ID as JSON (read-only).

    {"format", "user_id", "exported_at", "sessions": [{"session_id",
    "user_id", "active_agent_name", "metadata", "created_at", "updated_at",
    "messages", "archived_messages", "webhook_claims"}], "inbox": [{"message_id",
    "session_id", "state", "text", "payload", ...}]} -- what store.export_user
    returns: what users erase removes. Encrypted rows are opened with the keys of
    $CHATFLOW_KEYS. A corrupt row stops the export (FILE is then left as it was).
    The document is JSON already; with --output and --json the summary is
    {"user_id", "exported", "output"}.
    """
    from chatflow_sqlalchemy.lifecycle import validate_user_id
    from chatflow_sqlalchemy.sql_lifecycle import export_user_document

    if target is not None:
        _check_output(target)  # before reading anything
    _checked(validate_user_id, user_id)
    sealer = _sealer()
    with _reading() as (_url, conn):
        try:
            document = export_user_document(conn, user_id, sealer, _parse_for_export)
        except Exception as exc:  # a CorruptRowError: the errors load chatflow-agent
            _why_closed(exc)  # raises anything else again
            raise CliError(f"export stopped: {clean(str(exc))}", EXIT_FAILED) from None
    _write_output(target, lambda sink: sink.write(_json_text(document, indent=2) + "\n"))
    if target is None:
        return
    found = len(document["sessions"])
    _emit({"user_id": user_id, "exported": found, "output": str(target)},
          f"exported {found} session(s) and {len(document['inbox'])} inbox message(s) of "
          f"user {clean(repr(user_id))} to {clean(str(target))}")


def _holds_plaintext(engine: Engine) -> bool:
    """True if a message, archived message, session metadata or summary is stored unencrypted."""
    from sqlalchemy import Text, cast, not_, select

    from chatflow_sqlalchemy import tables
    from chatflow_sqlalchemy.crypto import TOKEN_PREFIX

    s = tables.sessions.c
    queries = [
        *(select(t.c.id).where(not_(t.c.message_json.startswith(TOKEN_PREFIX, autoescape=True)))
          for t in (tables.messages, tables.message_archive)),
        select(s.session_id).where(
            not_(cast(s.metadata_json, Text).contains(TOKEN_PREFIX, autoescape=True))
        ),
        select(s.session_id).where(
            s.summary.is_not(None), not_(s.summary.startswith(TOKEN_PREFIX, autoescape=True))
        ),
    ]
    with _read_conn(engine) as conn:
        return any(conn.execute(query.limit(1)).first() is not None for query in queries)


@_command(keys, "rotate", yes=True)
@click.option(
    "--batch", type=click.IntRange(min=1), default=200, show_default=True,
    help="rows per table re-encrypted in one short transaction",
)
def keys_rotate(batch: int) -> None:
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
    primary = clean(repr(cipher.primary))
    with _database(write=True) as (url, engine):
        if _holds_plaintext(engine):
            _confirm(f"{_safe_url(url)} holds plaintext rows: encrypt them with key {primary} "
                     "(only $CHATFLOW_KEYS reads them after)?")
    with open_store(url, cipher=cipher, auto_migrate=False) as store:
        count = int(store.rotate_keys(batch))
    _emit({"primary": cipher.primary, "rewritten": count},
          f"re-encrypted {count} row(s) with key {primary}")


def _dotted(target: Any) -> str:
    """A class, or its ``"module:Class"`` target, as ``module.Class``."""
    if isinstance(target, str):
        return target.replace(":", ".")
    return f"{target.__module__}.{target.__qualname__}"


@_command(cli, "backends", url=False)
def backends() -> None:
    """List installed backends and the store class each opens.

    A row per backend name: where it comes from (built-in, its distribution,
    register()), the store class open_store opens for it, and its
    DialectSupport class, or why it cannot be loaded.
    """
    from chatflow_sqlalchemy.registry import backend_availability, backend_sources

    sources, rows = backend_sources(), []
    for name, backend in sorted(backend_availability().items()):
        if isinstance(backend, str):
            store, detail = "-", f"unavailable: {_one_line(backend)}"
        else:
            store, detail = _dotted(backend.store_class), _dotted(backend)
        source, origin = sources.get(name), "-"
        if source is not None and source.origin == "built-in":
            origin = "built-in"
        elif source is not None:
            origin = " + ".join(source.distributions) if source.distributions else source.origin
        rows.append((clean(name), clean(origin), clean(store), clean(detail)))
    _listing({"backends": [
        {"name": n, "from": o, "available": not d.startswith("unavailable: "),
         "store_class": s if s != "-" else None, "detail": d}
        for n, o, s, d in rows
    ]}, ("BACKEND", "FROM", "STORE CLASS", "DIALECT SUPPORT OR ERROR"), rows,
        "no backends installed")


@_command(cli, "demo", url=False)
@click.option("--db", "db_path", metavar="PATH", help="new SQLite file (default: a temp folder)")
def demo(db_path: str | None) -> None:
    """Run the offline demo on a new SQLite file.

    A scripted engine (no API key) drives the real Runner.
    """
    import tempfile

    from chatflow_sqlalchemy.demo import DemoError, run_demo

    if db_path is None:
        db_path = f"{tempfile.mkdtemp(prefix='chatflow-demo-')}/demo.db"
    lines: list[str] = []
    out = lines.append if _opt("as_json") else (lambda line: click.echo(clean(line)))
    try:
        run_demo(str(Path(db_path)), out)
    except DemoError as exc:
        raise CliError(str(exc), EXIT_FAILED) from exc
    _emit({"database": str(Path(db_path)), "output": lines})  # the lines are out already


# --------------------------------------------------------------------------- main


def _redact(message: str, urls: Sequence[str | None]) -> str:
    """Remove the URLs' passwords from ``message`` (in case a driver quotes the URL).

    The password is found without SQLAlchemy, so a bad port does not hide it. Short
    passwords are only masked as ``:password@``, so ordinary words are not mangled.
    """
    from urllib.parse import quote, quote_plus, unquote

    for raw in urls:
        match = re.match(r"^[^:/?#]+://[^:@/?#]*:([^@/?#]*)@", raw or "")
        password = unquote(match.group(1)) if match else ""
        for form in {password, quote_plus(password), quote(password, safe="")} - {""}:
            message = message.replace(f":{form}@", ":***@")
            if len(form) >= 4:
                message = message.replace(form, "***")
    return message


def _failure(exc: Exception) -> tuple[str, int]:
    """(message, exit code) of an expected error; a bug is raised again."""
    if isinstance(exc, click.Abort):
        return "interrupted", EXIT_INTERRUPTED
    if isinstance(exc, click.ClickException):
        return exc.format_message(), exc.exit_code
    if isinstance(exc, CliError):
        return str(exc), exc.code
    from chatflow_sqlalchemy.exceptions import ChatflowStoreError  # only now: they are heavy

    if isinstance(exc, ChatflowStoreError):  # a refused URL, a missing driver's extra, ...
        return str(exc), EXIT_USAGE
    from alembic.util.exc import CommandError
    from sqlalchemy import exc as sa_exc

    if isinstance(exc, sa_exc.ArgumentError):
        return f"invalid database URL: {exc}", EXIT_USAGE
    if isinstance(exc, (CommandError, OSError)):
        return str(exc), EXIT_USAGE
    if isinstance(exc, sa_exc.SQLAlchemyError):
        return f"database error: {_db_error_reason(exc)}", EXIT_USAGE
    if isinstance(exc, ImportError):
        return f"{exc}; install the database driver for this URL", EXIT_USAGE
    raise exc


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code (docs/cli.md lists them).

    Args:
        argv: Arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        0 on success, 1 for a failed check/unknown session/corrupt rows,
        2 for a usage or database error (one ``error:`` line on stderr).

    """
    args = list(sys.argv[1:] if argv is None else argv)
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
    except BrokenPipeError:  # the reader went away (`sessions export | head`): stop quietly
        with suppress(OSError, ValueError):  # stdout is not a real file (e.g. under pytest)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    except KeyboardInterrupt:
        click.echo("error: interrupted", err=True)
        return EXIT_INTERRUPTED
    except Exception as exc:
        message, code = _failure(exc)
        urls = [os.environ.get("CHATFLOW_DATABASE_URL"), *(  # their passwords are hidden
            value for flag, value in zip(args, [*args[1:], ""], strict=True) if flag == "--url"
        ), *(arg.split("=", 1)[1] for arg in args if arg.startswith("--url="))]
        click.echo(f"error: {clean(_redact(_one_line(message), urls))}", err=True)
        return code
    return result if isinstance(result, int) else EXIT_OK


def run() -> None:
    """The ``chatflow-sqlalchemy`` console script: :func:`main` as a process of its own.

    A command's start-up creates a great many objects that live until exit (SQLAlchemy's,
    Alembic's), and with the collector's default threshold Python searches
    them for cycles again and again as they pile up, then once more at exit. A higher
    threshold keeps collections rare while the collector still runs for a long command
    (``keys rotate``, ``demo``); freezing what is left before exit spares the last search.
    Callers in a process that goes on (tests, an app) call :func:`main`, which leaves the
    collector alone.
    """
    gc.set_threshold(CLI_GC_THRESHOLD)
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
