"""The ``chatflow-sqlalchemy`` command line.

Commands::

    chatflow-sqlalchemy [--url URL] db upgrade [REVISION] [--chain NAME]   # default: head
    chatflow-sqlalchemy [--url URL] db downgrade REVISION [--chain NAME]
    chatflow-sqlalchemy [--url URL] db current
    chatflow-sqlalchemy [--url URL] db history [--all | --chain NAME]
    chatflow-sqlalchemy [--url URL] db check                # exit 1 if behind or drifted
    chatflow-sqlalchemy [--url URL] db stamp REVISION [--chain NAME]
    chatflow-sqlalchemy [--url URL] sessions list
    chatflow-sqlalchemy [--url URL] sessions show SESSION_ID
    chatflow-sqlalchemy [--url URL] sessions delete SESSION_ID
    chatflow-sqlalchemy [--url URL] sessions export [--output FILE]
    chatflow-sqlalchemy [--url URL] dedup purge
    chatflow-sqlalchemy backends
    chatflow-sqlalchemy demo [--db PATH]

The URL comes from ``--url`` (accepted before or after the command), else
``$CHATFLOW_DATABASE_URL``, else ``sqlite:///chatflow.db``.

The ``db`` commands act on the core migration chain and on every installed
plugin chain that applies to the database (``db upgrade`` to head, ``db
downgrade base``, ``db current``, ``db check``); ``--chain core|NAME`` picks
one. They look at the database as it is (they never migrate it on open);
the ``sessions`` and ``dedup`` commands open a store, which upgrades an old
schema first. Mistakes (a bad URL, an unreachable database, a schema newer
than this package, an unknown revision) print one ``error:`` line and exit 2;
a failed ``db check`` or an unknown session exits 1. Passwords are never printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import IO, Any, TextIO, cast
from urllib.parse import quote, quote_plus

from alembic.util.exc import CommandError
from chatflow_agent import Agent, Message, Role
from sqlalchemy import URL, Engine, Table, func, inspect, make_url, select
from sqlalchemy import exc as sa_exc

from chatflow_sqlalchemy import migrate
from chatflow_sqlalchemy.exceptions import (
    ChatflowStoreError,
    CorruptRowError,
    DatabaseUnavailableError,
)
from chatflow_sqlalchemy.registry import available_backends, backend_sources, open_store
from chatflow_sqlalchemy.store import SQLAlchemySessionStore, database_url_from_env

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "build_parser", "main"]

EXIT_OK = 0
EXIT_FAILED = 1
"""A check failed or the named session does not exist."""
EXIT_USAGE = 2
"""A user mistake: bad URL or arguments, unreachable database, schema ahead, ..."""

PROG = "chatflow-sqlalchemy"


class _Failed(Exception):
    """A command's expected failure: print one line, exit with ``code``."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------- helpers


def _resolve_url(args: argparse.Namespace) -> URL:
    """The URL to use: ``--url``, else the environment, else the default file."""
    return make_url(database_url_from_env(getattr(args, "url", None)))


def _safe_url(url: URL) -> str:
    """``url`` as text with the password masked."""
    return url.render_as_string(hide_password=True)


def _describe(url: URL) -> str:
    """Name the database (and host) without the password."""
    if url.get_backend_name() == "sqlite":
        return f"SQLite database {url.database or ':memory:'!r}"
    host = url.host or "localhost"
    if url.port:
        host = f"{host}:{url.port}"
    user = f" as {url.username!r}" if url.username else ""
    return f"{url.get_backend_name()} database {url.database!r} on {host}{user}"


def _one_line(text: str) -> str:
    """Squash a (possibly multi-line) error message into one readable line."""
    lines = [line.strip() for line in text.splitlines()]
    kept = [line for line in lines if line and not line.startswith("(Background on this error")]
    return " ".join(kept) or "unknown error"


def _db_error_reason(exc: sa_exc.SQLAlchemyError) -> str:
    """The driver's own message (its first line: later ones are hints and SQL)."""
    orig = getattr(exc, "orig", None)
    text = str(orig) if orig is not None else str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


@contextmanager
def _database_errors(url: URL, action: str = "cannot use") -> Iterator[None]:
    """Turn driver errors into :class:`DatabaseUnavailableError` naming the database."""
    try:
        yield
    except (sa_exc.OperationalError, sa_exc.InterfaceError) as exc:
        raise DatabaseUnavailableError(
            f"{action} {_describe(url)}: {_db_error_reason(exc)}"
        ) from exc
    except sa_exc.DBAPIError as exc:
        raise _Failed(
            f"database error on {_describe(url)}: {_db_error_reason(exc)}", EXIT_USAGE
        ) from exc


@contextmanager
def _engine(url: URL) -> Iterator[Engine]:
    """An engine that looks at the database as it is (no migration), disposed after.

    It connects once up front, so an unreachable database is reported as such
    rather than as whatever the first query was.
    """
    engine = migrate.open_engine(url)
    try:
        with _database_errors(url, "cannot reach"), engine.connect():
            pass
        with _database_errors(url):
            yield engine
    finally:
        engine.dispose()


@contextmanager
def _store(url: URL) -> Iterator[SQLAlchemySessionStore]:
    """Open a store (which upgrades an old schema) that knows every stored agent name."""
    with _database_errors(url):
        store = open_store(url)
    try:
        # The CLI only reads contexts: a placeholder agent per stored name avoids the
        # store's "no agent resolver" warning without pretending to know the real one.
        store.set_agent_resolver(lambda name: Agent(name=name, instructions=""))
        with _database_errors(url):
            yield store
    finally:
        store.close()


def _read_revision(engine: Engine, chain: migrate.MigrationChain | None = None) -> str | None:
    with engine.connect() as conn:
        try:
            return migrate.current_revision(conn, chain)
        finally:
            conn.rollback()


def _check_not_ahead(found: str | None, chain: migrate.MigrationChain | None = None) -> None:
    """Raise :class:`SchemaAheadError` if ``found`` is a revision the chain does not know."""
    migrate.check_not_ahead(found, chain)


def _chains(
    engine: Engine, args: argparse.Namespace, *, all_for: str | None = None
) -> list[migrate.MigrationChain]:
    """The chains a command acts on.

    ``--chain NAME`` names one; otherwise the revision ``all_for`` (``head``
    for upgrades, ``base`` for downgrades) means every chain that applies to
    the database, and any other revision means the core chain.
    """
    name = getattr(args, "chain", None)
    if name:
        return [migrate.find_chain(name, engine.dialect.name)]
    if all_for is not None and getattr(args, "revision", None) == all_for:
        return migrate.chains_for(engine.dialect.name)
    return [migrate.core_chain()]


def _prefix(url: URL, chain: migrate.MigrationChain) -> str:
    """``<url>:`` for the core chain, ``<url>: plugin <name>:`` for a plugin's."""
    if chain.is_core:
        return f"{_safe_url(url)}:"
    return f"{_safe_url(url)}: plugin {chain.name}:"


def _label(revision: str | None, chain: migrate.MigrationChain | None = None) -> str:
    if revision is not None:
        return revision
    return "none" if chain is not None and not chain.is_core else "none (empty database)"


def _unversioned_label(engine: Engine) -> str:
    """Describe a database without a revision: empty, or holding unversioned tables."""
    from chatflow_sqlalchemy.models import ChatflowSession

    if inspect(engine).has_table(ChatflowSession.__tablename__):
        return "none (unversioned chatflow tables, e.g. from chatflow-agent; upgrade adopts them)"
    return _label(None)


def _format_time(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.strftime("%Y-%m-%d %H:%M:%S %Z").strip()


def _format_content(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)


def _table(rows: Sequence[Sequence[str]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=True)]
        print("  ".join(cells).rstrip(), file=out)


def _validate_session_id(session_id: str) -> None:
    from chatflow_sqlalchemy.context import validate_session_id

    try:
        validate_session_id(session_id)
    except ValueError as exc:
        raise _Failed(str(exc), EXIT_USAGE) from None


# --------------------------------------------------------------------------- db


def _cmd_db_upgrade(args: argparse.Namespace, out: TextIO) -> int:
    return _move_chains(args, out, "upgraded", migrate.upgrade, plugins_first=False)


def _cmd_db_downgrade(args: argparse.Namespace, out: TextIO) -> int:
    return _move_chains(args, out, "downgraded", migrate.downgrade, plugins_first=True)


def _move_chains(
    args: argparse.Namespace,
    out: TextIO,
    verb: str,
    move: Callable[[Engine, str, str | None], None],
    *,
    plugins_first: bool,
) -> int:
    """Upgrade or downgrade, then report how each chain moved.

    Going down, plugin chains move first: their tables may refer to the core's.
    """
    url = _resolve_url(args)
    with _engine(url) as engine:
        chains = _chains(engine, args, all_for="base" if plugins_first else "head")
        if plugins_first and len(chains) > 1:
            chains = [*chains[1:][::-1], chains[0]]
        before = [_read_revision(engine, chain) for chain in chains]
        for chain, found in zip(chains, before, strict=True):
            _check_not_ahead(found, chain)
        move(engine, args.revision, getattr(args, "chain", None))
        after = [_read_revision(engine, chain) for chain in chains]
    for chain, old, new in zip(chains, before, after, strict=True):
        at_head = not plugins_first and new == migrate.head_revision(chain)
        suffix = " (head)" if at_head else ""
        if old == new:
            moved = f"already at revision {_label(new, chain)}{suffix}"
        else:
            moved = f"{verb} from {_label(old, chain)} to {_label(new, chain)}{suffix}"
        print(f"{_prefix(url, chain)} {moved}", file=out)
    return EXIT_OK


def _cmd_db_current(args: argparse.Namespace, out: TextIO) -> int:
    url = _resolve_url(args)
    with _engine(url) as engine:
        statuses = migrate.chain_status(engine)
        for status in statuses:
            _check_not_ahead(status.current, status.chain)
        label = _unversioned_label(engine) if statuses[0].current is None else statuses[0].current
    print(f"database: {_safe_url(url)}", file=out)
    behind = False
    for status in statuses:
        if status.chain.is_core:
            name, shown = "revision", label
        else:
            name = f"plugin {status.chain.name} ({status.chain.distribution})"
            shown = _label(status.current, status.chain)
        if status.at_head:
            print(f"{name}: {status.current} (head)", file=out)
        else:
            behind = True
            print(f"{name}: {shown}; head is {status.head}", file=out)
    if behind:
        print(f"run: {PROG} db upgrade", file=out)
    return EXIT_OK


def _print_history(chain: migrate.MigrationChain, out: TextIO) -> None:
    for rev in reversed(migrate.history(chain)):
        marker = " (head)" if rev.is_head else ""
        parent = rev.down_revision or "<base>"
        print(f"{parent} -> {rev.revision}{marker}: {rev.doc}", file=out)


def _cmd_db_history(args: argparse.Namespace, out: TextIO) -> int:
    name = getattr(args, "chain", None)
    if name:
        _print_history(migrate.find_chain(name), out)
        return EXIT_OK
    _print_history(migrate.core_chain(), out)
    if not getattr(args, "all", False):
        return EXIT_OK
    for chain in migrate.plugin_chains():
        dialects = ", ".join(sorted(chain.dialects)) if chain.dialects else "every database"
        print("", file=out)
        print(
            f"plugin {chain.name} ({chain.distribution}; version table {chain.version_table}; "
            f"{dialects}):",
            file=out,
        )
        _print_history(chain, out)
    return EXIT_OK


def _cmd_db_check(args: argparse.Namespace, out: TextIO) -> int:
    url = _resolve_url(args)
    head = migrate.head_revision()
    with _engine(url) as engine:
        statuses = migrate.chain_status(engine)
        for status in statuses:
            _check_not_ahead(status.current, status.chain)
        behind = [status for status in statuses if not status.at_head]
        for status in behind:
            what = _safe_url(url) if status.chain.is_core else f"{_safe_url(url)} plugin "
            what += "" if status.chain.is_core else status.chain.name
            print(
                f"behind: {what} is at revision {_label(status.current, status.chain)}, "
                f"the code expects "
                f"{status.head}; run: {PROG} db upgrade",
                file=out,
            )
        if behind:
            return EXIT_FAILED
        diffs = migrate.drift(engine)
    if diffs:
        print(
            f"drift: {_safe_url(url)} is at revision {head} (head), but its schema differs "
            f"from the models ({len(diffs)} difference(s)):",
            file=out,
        )
        for diff in diffs:
            print(f"  - {diff}", file=out)
        return EXIT_FAILED
    plugins = "".join(
        f"; plugin {s.chain.name} at {s.current} (head)" for s in statuses if not s.chain.is_core
    )
    print(
        f"ok: {_safe_url(url)} is at revision {head} (head) and matches the models{plugins}",
        file=out,
    )
    return EXIT_OK


def _cmd_db_stamp(args: argparse.Namespace, out: TextIO) -> int:
    url = _resolve_url(args)
    with _engine(url) as engine:
        chain = _chains(engine, args)[0]
        before = _read_revision(engine, chain)
        _check_not_ahead(before, chain)
        migrate.stamp(engine, args.revision, chain)
        after = _read_revision(engine, chain)
    print(
        f"{_prefix(url, chain)} stamped revision {_label(after, chain)} "
        f"(was {_label(before, chain)}); "
        "no migration was run",
        file=out,
    )
    return EXIT_OK


# --------------------------------------------------------------------------- sessions


def _session_rows(store: SQLAlchemySessionStore) -> list[tuple[str, str, int, datetime | None]]:
    from chatflow_sqlalchemy.models import ChatflowMessage, ChatflowSession

    sessions = cast(Table, ChatflowSession.__table__)
    messages = cast(Table, ChatflowMessage.__table__)
    counts = (
        select(messages.c.session_id, func.count().label("n"))
        .group_by(messages.c.session_id)
        .subquery()
    )
    query = (
        select(
            sessions.c.session_id,
            sessions.c.active_agent_name,
            func.coalesce(counts.c.n, 0),
            sessions.c.updated_at,
        )
        .select_from(sessions.outerjoin(counts, counts.c.session_id == sessions.c.session_id))
        .order_by(sessions.c.updated_at.desc(), sessions.c.session_id)
    )
    with store.engine.connect() as conn:
        return [(row[0], row[1], int(row[2]), row[3]) for row in conn.execute(query)]


def _cmd_sessions_list(args: argparse.Namespace, out: TextIO) -> int:
    with _store(_resolve_url(args)) as store:
        rows = _session_rows(store)
    if not rows:
        print("no sessions", file=out)
        return EXIT_OK
    table = [("SESSION", "ACTIVE AGENT", "MESSAGES", "UPDATED")]
    table += [(sid, agent, str(n), _format_time(ts)) for sid, agent, n, ts in rows]
    _table(table, out)
    return EXIT_OK


def _message_lines(message: Message) -> list[str]:
    role = message.role.value
    lines: list[str] = []
    if message.content:
        first, *rest = message.content.splitlines() or [""]
        lines.append(f"  [{role}] {first}")
        lines.extend(f"  {' ' * (len(role) + 2)} {line}" for line in rest)
    for call in message.tool_calls or []:
        args = json.dumps(call.args, ensure_ascii=False, sort_keys=True, default=str)
        lines.append(f"  [{role}] tool call {call.name} {args} (id {call.id})")
    for result in message.tool_results or []:
        lines.append(
            f"  [{role}] tool result {result.name} is_error={result.is_error}: "
            f"{_format_content(result.content)}"
        )
    return lines or [f"  [{role}] (empty)"]


_Entry = tuple[str, list[str]]
"""One history entry to print: its role value and its rendered lines."""


def _group_turns(entries: Sequence[_Entry]) -> list[tuple[str, list[str]]]:
    """SYSTEM messages first, then one group of lines per user turn."""
    system = [line for role, lines in entries if role == Role.SYSTEM.value for line in lines]
    groups: list[tuple[str, list[str]]] = [("System", system)] if system else []
    turn = 0
    for role, lines in entries:
        if role == Role.SYSTEM.value:
            continue
        if role == Role.USER.value:
            turn += 1
            groups.append((f"Turn {turn}", list(lines)))
        elif turn == 0:
            if not groups or groups[-1][0] != "Before the first turn":
                groups.append(("Before the first turn", []))
            groups[-1][1].extend(lines)
        else:
            groups[-1][1].extend(lines)
    return groups


def _raw_entries(
    store: SQLAlchemySessionStore, session_id: str
) -> tuple[str, dict[str, Any], list[_Entry], list[int]]:
    """Read a session row by row, for a session the store cannot load (corrupt rows).

    Returns:
        The active agent name, the metadata, the entries to print (corrupt rows
        shown raw) and the ids of the corrupt rows.

    """
    from chatflow_sqlalchemy.models import ChatflowMessage, ChatflowSession

    sessions = cast(Table, ChatflowSession.__table__)
    messages = cast(Table, ChatflowMessage.__table__)
    with store.engine.connect() as conn:
        head = conn.execute(
            select(sessions.c.active_agent_name, sessions.c.metadata_json).where(
                sessions.c.session_id == session_id
            )
        ).first()
        rows = conn.execute(
            select(messages.c.id, messages.c.role, messages.c.message_json)
            .where(messages.c.session_id == session_id)
            .order_by(messages.c.seq)
        ).all()
    if head is None:
        raise _Failed(f"no session {session_id!r} in {_describe(store.url)}")
    entries: list[_Entry] = []
    corrupt: list[int] = []
    for row_id, role, raw in rows:
        try:
            message = Message.model_validate_json(raw)
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            corrupt.append(row_id)
            reason = str(exc).splitlines()[0]
            entries.append((role, [f"  [{role}] CORRUPT ROW id {row_id} ({reason}): {raw!r}"]))
            continue
        entries.append((message.role.value, _message_lines(message)))
    metadata = head.metadata_json if isinstance(head.metadata_json, dict) else {}
    return head.active_agent_name, metadata, entries, corrupt


def _cmd_sessions_show(args: argparse.Namespace, out: TextIO) -> int:
    _validate_session_id(args.session_id)
    corrupt: list[int] = []
    with _store(_resolve_url(args)) as store:
        try:
            session = store.get(args.session_id)
        except CorruptRowError:
            # Show what is there, corrupt rows included, so they can be found and fixed.
            agent, metadata, entries, corrupt = _raw_entries(store, args.session_id)
        else:
            if session is None:
                raise _Failed(f"no session {args.session_id!r} in {_describe(store.url)}")
            agent = session.active_agent.name
            metadata = dict(session.metadata)
            entries = [(m.role.value, _message_lines(m)) for m in session.history]
    turns = sum(1 for role, _ in entries if role == Role.USER.value)
    print(f"session: {args.session_id}", file=out)
    print(f"active agent: {agent}", file=out)
    if metadata:
        print(f"metadata: {_format_content(metadata)}", file=out)
    print(f"messages: {len(entries)} in {turns} turn(s)", file=out)
    for title, lines in _group_turns(entries):
        print("", file=out)
        print(title, file=out)
        for line in lines:
            print(line, file=out)
    if corrupt:
        ids = ", ".join(str(row_id) for row_id in corrupt)
        raise _Failed(
            f"session {args.session_id!r} has {len(corrupt)} corrupt row(s) in "
            f"chatflow_messages (id {ids}); fix or delete them, or delete the session"
        )
    return EXIT_OK


def _cmd_sessions_delete(args: argparse.Namespace, out: TextIO) -> int:
    _validate_session_id(args.session_id)
    with _store(_resolve_url(args)) as store:
        if not store.delete(args.session_id):
            raise _Failed(f"no session {args.session_id!r} in {_describe(store.url)}")
    print(f"deleted session {args.session_id!r}", file=out)
    return EXIT_OK


def _export(store: SQLAlchemySessionStore, sink: IO[str]) -> int:
    count = 0
    for session_id in store.list_sessions():
        session = store.get(session_id)
        if session is None:  # deleted meanwhile
            continue
        record = {
            "session_id": session_id,
            "active_agent_name": session.active_agent.name,
            "metadata": dict(session.metadata),
            "messages": [m.model_dump(mode="json") for m in session.history],
        }
        sink.write(json.dumps(record, ensure_ascii=False) + "\n")
        count += 1
    return count


def _cmd_sessions_export(args: argparse.Namespace, out: TextIO) -> int:
    url = _resolve_url(args)
    if args.output in (None, "-"):
        with _store(url) as store:
            _export(store, out)
        return EXIT_OK
    target = Path(args.output)
    partial = target.with_name(f".{target.name}.partial")
    with _store(url) as store:
        try:
            with partial.open("w", encoding="utf-8") as sink:
                count = _export(store, sink)
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
    print(f"exported {count} session(s) to {target}", file=out)
    return EXIT_OK


# --------------------------------------------------------------------------- misc


def _cmd_dedup_purge(args: argparse.Namespace, out: TextIO) -> int:
    with _store(_resolve_url(args)) as store:
        removed = store.purge_processed_messages()
    print(f"removed {removed} expired processed message id(s)", file=out)
    return EXIT_OK


def _cmd_backends(args: argparse.Namespace, out: TextIO) -> int:
    backends = available_backends()
    if not backends:
        print("no backends installed", file=out)
        return EXIT_OK
    sources = backend_sources()
    rows: list[tuple[str, str, str]] = [("BACKEND", "FROM", "STORE CLASS OR ERROR")]
    for name, backend in sorted(backends.items()):
        if isinstance(backend, Exception):
            detail = f"unavailable: {_one_line(str(backend))}"
        else:
            detail = f"{backend.__module__}.{backend.__qualname__}"
        source = sources.get(name)
        origin = "-"
        if source is not None:
            origin = " + ".join(source.distributions) if source.distributions else source.origin
            if source.origin == "built-in":
                origin = "built-in"
        rows.append((name, origin, detail))
    _table(rows, out)
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    from chatflow_sqlalchemy.demo import DemoError, run_demo

    if args.db is None:
        path = Path(tempfile.mkdtemp(prefix="chatflow-demo-")) / "demo.db"
    else:
        path = Path(args.db)

    def emit(line: str) -> None:
        print(line, file=out, flush=True)

    try:
        run_demo(str(path), emit)
    except DemoError as exc:
        raise _Failed(str(exc)) from exc
    return EXIT_OK


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser of the ``chatflow-sqlalchemy`` command."""
    url_help = (
        "SQLAlchemy database URL (default: $CHATFLOW_DATABASE_URL, else sqlite:///chatflow.db)"
    )
    # --url works before the command and after it: the sub-parsers' copy only
    # overrides the global one when it is given.
    url_option = argparse.ArgumentParser(add_help=False)
    url_option.add_argument("--url", default=argparse.SUPPRESS, help=url_help)

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Manage chatflow-sqlalchemy databases: migrations, sessions, dedup ids.",
    )
    parser.add_argument("--url", default=None, help=url_help)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def leaf(
        group: argparse._SubParsersAction[argparse.ArgumentParser],
        name: str,
        handler: Callable[[argparse.Namespace, TextIO], int],
        help_text: str,
        *,
        with_url: bool = True,
    ) -> argparse.ArgumentParser:
        sub = group.add_parser(
            name, help=help_text, description=help_text, parents=[url_option] if with_url else []
        )
        sub.set_defaults(handler=handler)
        return sub

    db = commands.add_parser("db", help="schema migrations (never migrates on its own)")
    db_commands = db.add_subparsers(dest="db_command", required=True, metavar="SUBCOMMAND")
    chain_help = (
        "act on one migration chain: 'core' or an installed plugin's name "
        "(default: head/base move every chain, other revisions the core chain)"
    )
    sub = leaf(
        db_commands,
        "upgrade",
        _cmd_db_upgrade,
        "upgrade the schema (default: the core chain and every plugin chain to head)",
    )
    sub.add_argument("revision", nargs="?", default="head", help="target revision (default head)")
    sub.add_argument("--chain", metavar="NAME", help=chain_help)
    sub = leaf(db_commands, "downgrade", _cmd_db_downgrade, "downgrade the schema to REVISION")
    sub.add_argument(
        "revision", help="target revision, or 'base' to drop the tables (plugins' first)"
    )
    sub.add_argument("--chain", metavar="NAME", help=chain_help)
    leaf(db_commands, "current", _cmd_db_current, "show the database's revision of every chain")
    sub = leaf(
        db_commands, "history", _cmd_db_history, "list the migration chain, newest first"
    )
    sub.add_argument(
        "--chain", metavar="NAME", help="this chain instead of the core's (a plugin's name)"
    )
    sub.add_argument(
        "--all", action="store_true", help="also every installed plugin's chain"
    )
    leaf(
        db_commands,
        "check",
        _cmd_db_check,
        "exit 0 if the schema is at head and matches the models, else 1",
    )
    sub = leaf(db_commands, "stamp", _cmd_db_stamp, "record REVISION without running migrations")
    sub.add_argument("revision", help="revision to record")
    sub.add_argument(
        "--chain", metavar="NAME", help="the chain to stamp: 'core' (default) or a plugin"
    )

    sessions = commands.add_parser("sessions", help="inspect, delete and export sessions")
    session_commands = sessions.add_subparsers(
        dest="sessions_command", required=True, metavar="SUBCOMMAND"
    )
    leaf(session_commands, "list", _cmd_sessions_list, "list sessions, most recently updated first")
    sub = leaf(session_commands, "show", _cmd_sessions_show, "print a conversation turn by turn")
    sub.add_argument("session_id", metavar="SESSION_ID")
    sub = leaf(session_commands, "delete", _cmd_sessions_delete, "delete a session and its history")
    sub.add_argument("session_id", metavar="SESSION_ID")
    sub = leaf(session_commands, "export", _cmd_sessions_export, "export sessions as JSON lines")
    sub.add_argument(
        "--output", "-o", metavar="FILE", help="write to FILE instead of standard output"
    )

    dedup = commands.add_parser("dedup", help="processed webhook ids")
    dedup_commands = dedup.add_subparsers(dest="dedup_command", required=True, metavar="SUBCOMMAND")
    leaf(dedup_commands, "purge", _cmd_dedup_purge, "delete processed ids older than the TTL")

    leaf(commands, "backends", _cmd_backends, "list installed backends", with_url=False)
    sub = leaf(
        commands,
        "demo",
        _cmd_demo,
        "run the offline demo (scripted engine, real Runner) on a new SQLite file",
        with_url=False,
    )
    sub.add_argument(
        "--db", metavar="PATH", help="new SQLite file to create (default: in a temp directory)"
    )
    return parser


# --------------------------------------------------------------------------- main


def _redact(message: str, args: argparse.Namespace | None) -> str:
    """Remove the URL's password from ``message``, whatever produced it.

    Messages built here never contain it; this guards against a driver or
    library quoting the URL. Short passwords are only masked where they appear
    as ``:password@`` so ordinary words are not mangled.
    """
    candidates = [getattr(args, "url", None), os.environ.get("CHATFLOW_DATABASE_URL")]
    for raw in candidates:
        if not raw:
            continue
        try:
            password = make_url(raw).password
        except Exception:  # unparsable URL: nothing to redact from it
            continue
        if not password:
            continue
        for form in {str(password), quote_plus(str(password)), quote(str(password), safe="")}:
            message = message.replace(f":{form}@", ":***@")
            if len(form) >= 4:
                message = message.replace(form, "***")
    return message


def _fail(message: str, code: int, args: argparse.Namespace | None) -> int:
    print(f"error: {_redact(_one_line(message), args)}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code.

    Args:
        argv: Arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        0 on success, 1 for a failed check or unknown session, 2 for a usage
        or database error (reported as one ``error:`` line on stderr).

    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already reported
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    handler = cast(Callable[[argparse.Namespace, TextIO], int], args.handler)
    try:
        return handler(args, sys.stdout)
    except _Failed as exc:
        return _fail(str(exc), exc.code, args)
    except sa_exc.ArgumentError as exc:
        return _fail(f"invalid database URL: {exc}", EXIT_USAGE, args)
    except ChatflowStoreError as exc:
        return _fail(str(exc), EXIT_USAGE, args)
    except CommandError as exc:
        return _fail(str(exc), EXIT_USAGE, args)
    except sa_exc.SQLAlchemyError as exc:
        return _fail(f"database error: {_db_error_reason(exc)}", EXIT_USAGE, args)
    except ImportError as exc:
        return _fail(f"{exc} (is the database driver installed?)", EXIT_USAGE, args)
    except BrokenPipeError:
        # The reader went away (e.g. `sessions export | head`): stop quietly like
        # other Unix tools, and keep the interpreter from complaining at exit.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a real file (e.g. under pytest)
            pass
        return EXIT_FAILED
    except OSError as exc:
        return _fail(str(exc), EXIT_USAGE, args)
    except KeyboardInterrupt:
        return _fail("interrupted", 130, args)


if __name__ == "__main__":
    raise SystemExit(main())
