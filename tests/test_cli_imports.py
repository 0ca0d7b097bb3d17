"""The CLI's read commands start quickly: they import neither chatflow-agent nor Alembic.

chatflow-agent's package loads its model providers (google-genai, httpx, ...) and
Alembic its autogenerate machinery: either costs more than the read itself. So
the read commands query ``chatflow_sqlalchemy.tables`` with SQLAlchemy Core and
read the schema version without Alembic (CONTRIBUTING.md, "CLI start-up"). These
tests run each command in a fresh interpreter and look at ``sys.modules``.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory

from chatflow_sqlalchemy import migrate
from chatflow_sqlalchemy.backends.sqlite import SQLiteSessionStore
from chatflow_sqlalchemy.crypto import AESGCMCipher
from chatflow_sqlalchemy.testing import ScriptedEngine

KEYS = f"k1:{base64.b64encode(os.urandom(32)).decode()}"
"""``$CHATFLOW_KEYS`` of the encrypted database."""

HEAVY = (
    "chatflow_agent", "alembic", "pydantic", "sqlalchemy.orm", "sqlalchemy.ext.asyncio",
    "psycopg", "chatflow_sqlalchemy.store", "chatflow_sqlalchemy.runtime",
    "chatflow_sqlalchemy.inbox", "chatflow_sqlalchemy.sql_inbox",
)
"""What a read command must not import (a module or its package): a store and its runtime too,
and the inbox's worker and store rows (``inbox list`` and ``stats`` need only their reads)."""

READ_COMMANDS = (
    ["sessions", "list"],
    ["sessions", "list", "--json"],
    ["db", "current"],
    ["db", "current", "--json"],
    ["dedup", "count"],
    ["dedup", "count", "--json"],
    ["sessions", "show", "wa:1"],
    ["sessions", "show", "wa:1", "--all", "--json"],
    ["sessions", "export"],
    ["backends"],
    ["backends", "--json"],
    ["dedup", "list"],
    ["dedup", "list", "--json"],
    ["users", "export", "u1"],
    ["sessions", "sweep", "--dry-run", "--ttl-hours", "1"],
    ["inbox", "list"],
    ["inbox", "list", "--state", "pending", "--json"],
    ["inbox", "stats"],
    ["inbox", "stats", "--json"],
)

ENCRYPTED_READ_COMMANDS = (
    ["sessions", "show", "wa:1"],
    ["sessions", "show", "wa:1", "--all", "--json"],
    ["sessions", "export"],
    ["users", "export", "u1"],
    ["dedup", "list"],
    ["inbox", "list"],
)
"""Read on a database whose rows are sealed, with their key in ``$CHATFLOW_KEYS``."""

_PROBE = (
    "import json, sys\n"
    "from chatflow_sqlalchemy.cli import main\n"
    "code = main(json.loads(sys.argv[1]))\n"
    "heavy = json.loads(sys.argv[2])\n"
    "loaded = sorted(m for m in sys.modules if any(m == h or m.startswith(h + '.') "
    "for h in heavy))\n"
    "print(json.dumps({'code': code, 'loaded': loaded}))\n"
)


def _conversation(path: Path, cipher: AESGCMCipher | None = None) -> str:
    """A SQLite file at head: a conversation of user u1 by the real Runner, a claim, an inbox."""
    import asyncio

    from chatflow_agent import Agent, Runner

    with SQLiteSessionStore(str(path), cipher=cipher) as store:
        agent = Agent(name="Support", instructions="")
        store.get_or_create("wa:1", agent, user_id="u1")
        runner = Runner(starting_agent=agent, session_store=store, engine=ScriptedEngine())
        asyncio.run(runner.run_async("wa:1", "hello", metadata={"plan": "pro"}))
        with store.claim("wamid.1", session_id="wa:1"):
            pass
        store.inbox.put("wamid.2", session_id="wa:1", text="later", sent_at=1700000000)
    return f"sqlite:///{path}"


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _conversation(tmp_path_factory.mktemp("imports") / "chat.db")


@pytest.fixture(scope="module")
def encrypted(tmp_path_factory: pytest.TempPathFactory) -> str:
    cipher = AESGCMCipher.from_env(KEYS)
    return _conversation(tmp_path_factory.mktemp("imports") / "sealed.db", cipher)


def _loaded(argv: list[str], **env: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(argv), json.dumps(HEAVY)],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["code"] == 0, (argv, result.stderr)
    return list(report["loaded"])


@pytest.mark.parametrize("argv", READ_COMMANDS, ids=" ".join)
def test_a_read_command_imports_nothing_heavy(database: str, argv: list[str]) -> None:
    assert _loaded(["--url", database, *argv]) == []


@pytest.mark.parametrize("argv", ENCRYPTED_READ_COMMANDS, ids=" ".join)
def test_a_read_command_on_sealed_rows_imports_nothing_heavy(
    encrypted: str, argv: list[str]
) -> None:
    assert _loaded(["--url", encrypted, *argv], CHATFLOW_KEYS=KEYS) == []


def test_the_probe_sees_what_a_command_imports(database: str) -> None:
    """The same probe on a command that opens a store finds chatflow-agent (the test can fail)."""
    loaded = _loaded(["--url", database, "inbox", "purge"])  # removes nothing: none answered
    assert "chatflow_agent" in loaded
    assert "chatflow_sqlalchemy.store" in loaded


def test_the_core_revisions_are_the_scripts() -> None:
    """``CORE_REVISIONS`` (read without Alembic) lists the core chain's scripts, oldest first."""
    scripts = ScriptDirectory(migrate.core_chain().directory())
    walked = [rev.revision for rev in reversed(list(scripts.walk_revisions()))]
    assert list(migrate.CORE_REVISIONS) == walked
    assert migrate.head_revision() == scripts.get_current_head()


def test_the_version_is_read_as_alembic_reads_it(tmp_path: Path) -> None:
    """None without a version table or row, the row's revision, and Alembic's refusal of two."""
    from alembic.runtime.migration import MigrationContext
    from alembic.util.exc import CommandError
    from sqlalchemy import create_engine, text

    engine = create_engine(f"sqlite:///{tmp_path / 'v.db'}")
    table = migrate.VERSION_TABLE
    with engine.begin() as conn:
        assert migrate.current_revision(conn) is None
        conn.execute(text(f"CREATE TABLE {table} (version_num VARCHAR(32) NOT NULL)"))
        assert migrate.current_revision(conn) is None
        conn.execute(text(f"INSERT INTO {table} VALUES ('0004')"))
        assert migrate.current_revision(conn) == "0004"
        context = MigrationContext.configure(conn, opts={"version_table": table})
        assert context.get_current_revision() == "0004"
        conn.execute(text(f"INSERT INTO {table} VALUES ('0005')"))
        with pytest.raises(CommandError, match="more than one head"):
            migrate.current_revision(conn)
    engine.dispose()


def test_backends_lists_a_missing_driver_without_loading_chatflow_agent() -> None:
    """A base install lacks psycopg: the row says so, and the error class's module stays out."""
    probe = (
        "import json, sys\n"
        "sys.modules['psycopg'] = None\n"  # as if not installed
        "from chatflow_sqlalchemy.cli import main\n"
        "code = main(['backends', '--json'])\n"
        "print(json.dumps({'code': code, 'agent': 'chatflow_agent' in sys.modules}))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    *listing, last = result.stdout.strip().splitlines()
    report = json.loads(last)
    rows = {row["name"]: row for row in json.loads("\n".join(listing))["backends"]}
    assert report == {"code": 0, "agent": False}
    assert not rows["postgresql"]["available"]
    assert "pip install 'chatflow-sqlalchemy[postgres]'" in rows["postgresql"]["detail"]
    assert rows["sqlite"]["available"]
