"""The CLI's read commands start quickly: they import neither chatflow-agent nor Alembic.

chatflow-agent's package loads its model providers (google-genai, httpx, ...) and
Alembic its autogenerate machinery: either costs more than the read itself. So
the read commands query ``chatflow_sqlalchemy.tables`` with SQLAlchemy Core and
read the schema version without Alembic (CONTRIBUTING.md, "CLI start-up"). These
tests run each command in a fresh interpreter and look at ``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory

from chatflow_sqlalchemy import migrate
from chatflow_sqlalchemy.backends.sqlite import SQLiteSessionStore
from chatflow_sqlalchemy.testing import ScriptedEngine

HEAVY = ("chatflow_agent", "alembic", "pydantic", "sqlalchemy.orm", "chatflow_sqlalchemy.store")
"""What a read command must not import (a module or its package)."""

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
)

_PROBE = (
    "import json, sys\n"
    "from chatflow_sqlalchemy.cli import main\n"
    "code = main(json.loads(sys.argv[1]))\n"
    "heavy = json.loads(sys.argv[2])\n"
    "loaded = sorted(m for m in sys.modules if any(m == h or m.startswith(h + '.') "
    "for h in heavy))\n"
    "print(json.dumps({'code': code, 'loaded': loaded}))\n"
)


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A SQLite file at head holding one conversation written by the real Runner."""
    import asyncio

    from chatflow_agent import Agent, Runner

    path = tmp_path_factory.mktemp("imports") / "chat.db"
    with SQLiteSessionStore(str(path)) as store:
        agent = Agent(name="Support", instructions="")
        runner = Runner(starting_agent=agent, session_store=store, engine=ScriptedEngine())
        asyncio.run(runner.run_async("wa:1", "hello", metadata={"user_id": "u1"}))
    return f"sqlite:///{path}"


def _loaded(argv: list[str]) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(argv), json.dumps(HEAVY)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["code"] == 0, (argv, result.stderr)
    return list(report["loaded"])


@pytest.mark.parametrize("argv", READ_COMMANDS, ids=" ".join)
def test_a_read_command_imports_nothing_heavy(database: str, argv: list[str]) -> None:
    assert _loaded(["--url", database, *argv]) == []


def test_the_probe_sees_what_a_command_imports(database: str) -> None:
    """The same probe on a command that opens a store finds chatflow-agent (the test can fail)."""
    loaded = _loaded(["--url", database, "inbox", "stats"])
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
