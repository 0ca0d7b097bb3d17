"""The lifecycle commands: ``users erase|export`` (GDPR) and ``sessions sweep`` (retention).

:func:`register` adds them to the command line when ``chatflow_sqlalchemy.cli``
loads (also when it runs as ``python -m chatflow_sqlalchemy.cli``), and hands
over that module, whose URL handling, confirmation and output helpers the
commands use; this module imports nothing from it, so there is no import cycle. Like the rest of
the command line, importing it loads neither SQLAlchemy nor chatflow-agent.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from chatflow_sqlalchemy.exceptions import CorruptRowError
    from chatflow_sqlalchemy.sealing import Sealer

__all__ = [
    "keys",
    "keys_rotate",
    "open_row",
    "register",
    "sessions_sweep",
    "users",
    "users_erase",
    "users_export",
]

_cli: Any = None
"""The command-line module (set by :func:`register`)."""

_T = TypeVar("_T")


def register(cli_module: Any) -> None:
    """Add ``users`` to the root group and ``sweep`` to ``sessions`` of ``cli_module``."""
    global _cli
    _cli = cli_module
    cli_module.cli.add_command(users)
    cli_module.cli.add_command(keys)
    cli_module.sessions.add_command(sessions_sweep)


def _yes_option(func: Callable[..., _T]) -> Callable[..., _T]:
    return click.option(
        "--yes", "-y", is_flag=True, help="do not ask for confirmation (needed without a terminal)"
    )(func)


def _json_option(func: Callable[..., _T]) -> Callable[..., _T]:
    return click.option(
        "--json", "as_json", is_flag=True, help="print one JSON document (for scripts)"
    )(func)


def _url_option(func: Callable[..., _T]) -> Callable[..., _T]:
    return click.option(
        "--url", metavar="URL", default=None,
        help="database URL (default: $CHATFLOW_DATABASE_URL, else sqlite:///chatflow.db)",
    )(func)


@click.group(no_args_is_help=True)
def users() -> None:
    """Export or erase everything held about a user_id.

    For GDPR / LGPD requests.
    """


def _validated(user_id: str) -> str:
    from chatflow_sqlalchemy.lifecycle import validate_user_id

    try:
        return validate_user_id(user_id)
    except ValueError as exc:
        raise _cli.CliError(_cli.clean(str(exc))) from None


def _count(engine: Any, user_id: str) -> int:
    from chatflow_sqlalchemy.sql_lifecycle import user_session_ids

    with _cli._read_conn(engine) as conn:
        return len(user_session_ids(conn, user_id))


@users.command("erase")
@click.argument("user_id")
@_yes_option
@_json_option
@_url_option
def users_erase(user_id: str, yes: bool, as_json: bool, url: str | None) -> None:
    """Erase every session of USER_ID (asks first).

    Its sessions go with their messages and claims, in one transaction.
    Asks first unless --yes. Workers with a live context of an erased
    session get SessionDeletedError on their next read or write.
    """
    from chatflow_sqlalchemy.sql_lifecycle import erase_user_rows

    _validated(user_id)
    parsed = _cli._resolve_url(url)
    with _cli._writing(parsed) as engine:
        _cli._require_head(engine, parsed)
        found = _count(engine, user_id)
        if found:
            _cli._confirm(
                f"Erase {found} session(s) of user {_cli.clean(repr(user_id))} and everything "
                "stored with them?",
                yes,
            )
            with engine.begin() as conn:
                found = erase_user_rows(conn, user_id)
    if as_json:
        _cli._emit_json({"user_id": user_id, "erased": found})
    else:
        click.echo(f"erased {found} session(s) of user {_cli.clean(repr(user_id))}")


@users.command("export")
@click.argument("user_id")
@click.option("--output", "-o", metavar="FILE", help="write to FILE (mode 0600) instead of stdout")
@_json_option
@_url_option
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
        _cli._check_output(target)  # before reading anything
    document = _export(user_id, url)
    text = _cli._json_text(document, indent=2) + "\n"
    if target is None:
        sys.stdout.write(text)
        return
    _cli._write_output(target, lambda sink: sink.write(text))
    count = len(document["sessions"])
    if as_json:
        _cli._emit_json({"user_id": user_id, "exported": count, "output": str(target)})
        return
    click.echo(f"exported {count} session(s) of user {_cli.clean(repr(user_id))} to "
               f"{_cli.clean(str(target))}")


def open_row(session_id: str, stored: Any) -> tuple[Any, CorruptRowError | None]:
    """A stored ``message_json`` or metadata in clear when ``$CHATFLOW_KEYS`` opens it.

    For the read commands: returns ``(value, None)``, or ``(stored, why)``
    when a sealed value does not open -- a ``MissingKeyError`` when its key
    is not in ``$CHATFLOW_KEYS`` (locked, not corrupt), else the
    ``CorruptRowError`` saying what is wrong with it.
    """
    from chatflow_sqlalchemy.crypto import is_encrypted
    from chatflow_sqlalchemy.exceptions import CorruptRowError

    sealed_dict = isinstance(stored, dict) and set(stored) == {"_enc"}
    if not is_encrypted(stored["_enc"] if sealed_dict else stored):
        return stored, None
    sealer = _sealer_from_env(os.environ.get("CHATFLOW_KEYS", ""))
    try:
        if sealed_dict:
            return sealer.open_metadata(session_id, stored), None
        return sealer.open_text(session_id, None, stored, "chatflow_messages"), None
    except CorruptRowError as exc:
        return stored, exc


@functools.lru_cache(maxsize=4)
def _sealer_from_env(keys: str) -> Sealer:
    """A sealer holding the keys of ``$CHATFLOW_KEYS`` (value ``keys``); none when unset."""
    from chatflow_sqlalchemy.crypto import AESGCMCipher
    from chatflow_sqlalchemy.sealing import Sealer

    if not keys:
        return Sealer(None, False)
    try:
        return Sealer(AESGCMCipher.from_env(keys), False)
    except (ValueError, ImportError) as exc:
        raise _cli.CliError(_cli.clean(str(exc))) from None


def _export(user_id: str, url: str | None) -> dict[str, Any]:
    from chatflow_sqlalchemy.exceptions import CorruptRowError
    from chatflow_sqlalchemy.lifecycle import EXPORT_FORMAT
    from chatflow_sqlalchemy.models import utcnow
    from chatflow_sqlalchemy.rows import parse_message
    from chatflow_sqlalchemy.sql_lifecycle import export_sessions, user_session_ids

    _validated(user_id)
    sealer = _sealer_from_env(os.environ.get("CHATFLOW_KEYS", ""))
    with _cli._reading(url) as (_parsed, engine), _cli._read_conn(engine) as conn:
        try:
            sessions = export_sessions(
                conn, user_session_ids(conn, user_id), sealer.parser(parse_message),
                sealer.open_metadata,
            )
        except CorruptRowError as exc:
            message = f"export stopped: {_cli.clean(str(exc))}"
            raise _cli.CliError(message, _cli.EXIT_FAILED) from None
    return {
        "format": EXPORT_FORMAT,
        "user_id": user_id,
        "exported_at": utcnow().isoformat(),
        "sessions": sessions,
    }


@click.command("sweep")
@click.option(
    "--ttl-hours", type=float, required=True, envvar="CHATFLOW_SESSION_TTL_HOURS",
    show_envvar=True,
    help="sessions not updated for this many hours are expired (the store's session_ttl_hours)",
)
@click.option("--limit", type=click.IntRange(min=1), help="remove at most this many")
@click.option("--dry-run", is_flag=True, help="only count what would go (read-only)")
@_yes_option
@_json_option
@_url_option
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
    from chatflow_sqlalchemy.models import utcnow
    from chatflow_sqlalchemy.sql_lifecycle import count_expired

    try:
        hours = validate_session_ttl(ttl_hours)
    except ValueError as exc:
        raise _cli.CliError(f"--ttl-hours: {_cli.clean(str(exc))}") from None
    assert hours is not None
    with _cli._reading(url) as (parsed, engine), _cli._read_conn(engine) as conn:
        now = utcnow()
        expired, oldest = count_expired(conn, now - timedelta(hours=hours), now)
    expired = expired if limit is None else min(expired, limit)
    if dry_run:
        if as_json:
            _cli._emit_json({"dry_run": True, "expired": expired, "oldest": oldest})
            return
        click.echo(f"{expired} expired session(s) would be removed")
        for session_id in oldest[:expired]:
            click.echo(f"  {_cli.clean(session_id)}")
        return
    removed = 0
    if expired:
        _cli._confirm(f"Remove {expired} expired session(s) and their history?", yes)
        removed = _sweep(parsed, hours, limit)
    if as_json:
        _cli._emit_json({"dry_run": False, "removed": removed})
    else:
        click.echo(f"removed {removed} expired session(s)")


def _sweep(url: Any, hours: float, limit: int | None) -> int:
    from chatflow_sqlalchemy.registry import open_store

    with open_store(url, session_ttl_hours=hours, auto_migrate=False) as store:
        return int(store.sweep(limit))


@click.group(no_args_is_help=True)
def keys() -> None:
    """Encryption keys: re-encrypt rows with a new key.

    The keys come from $CHATFLOW_KEYS; the first is the primary.
    """


@keys.command("rotate")
@click.option(
    "--batch", type=click.IntRange(min=1), default=200, show_default=True,
    help="rows per table re-encrypted in one short transaction",
)
@_yes_option
@_json_option
@_url_option
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
    from chatflow_sqlalchemy.registry import open_store

    try:
        cipher = AESGCMCipher.from_env()
    except (ValueError, ImportError) as exc:
        raise _cli.CliError(_cli.clean(str(exc))) from None
    parsed = _cli._resolve_url(url)
    with _cli._writing(parsed) as engine:
        _cli._require_head(engine, parsed)
        if _holds_plaintext(engine):
            _cli._confirm(
                f"{_cli._safe_url(parsed)} holds plaintext rows: encrypt them with key "
                f"{_cli.clean(repr(cipher.primary))} (only $CHATFLOW_KEYS reads them after)?",
                yes,
            )
    with open_store(parsed, cipher=cipher, auto_migrate=False) as store:
        count = int(store.rotate_keys(batch))
    if as_json:
        _cli._emit_json({"primary": cipher.primary, "rewritten": count})
    else:
        click.echo(f"re-encrypted {count} row(s) with key {_cli.clean(repr(cipher.primary))}")


def _holds_plaintext(engine: Any) -> bool:
    """True if a message, archived message or session metadata is stored unencrypted."""
    from sqlalchemy import Text, cast, not_, select

    from chatflow_sqlalchemy.crypto import TOKEN_PREFIX
    from chatflow_sqlalchemy.models import (
        ChatflowMessage,
        ChatflowMessageArchive,
        ChatflowSession,
    )

    sessions = ChatflowSession.__table__
    queries = [
        select(table.c.id).where(
            not_(table.c.message_json.startswith(TOKEN_PREFIX, autoescape=True))
        )
        for table in (ChatflowMessage.__table__, ChatflowMessageArchive.__table__)
    ]
    queries.append(select(sessions.c.session_id).where(
        not_(cast(sessions.c.metadata_json, Text).contains(TOKEN_PREFIX, autoescape=True))
    ))
    with _cli._read_conn(engine) as conn:
        return any(conn.execute(query.limit(1)).first() is not None for query in queries)
