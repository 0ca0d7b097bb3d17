"""Without the extras: every public name imports, SQLite works sync and async, optional
parts name the extra to install. Each test runs a fresh interpreter in which the extras'
modules cannot be imported (``sys.modules[name] = None``), as in a base install.

CI also installs the built wheel alone in a fresh venv (.ci/wheel_smoke.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_PRELUDE = (
    "import sys\n"
    "for blocked in ('greenlet', 'psycopg', 'aiosqlite', 'opentelemetry'):\n"
    "    sys.modules[blocked] = None\n"
)


def run_without_extras(code: str, cwd: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-c", _PRELUDE + code],
        capture_output=True, text=True, timeout=300, check=False, cwd=cwd,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_every_public_name_imports_and_sqlite_runs_sync_and_async(tmp_path: Path) -> None:
    out = run_without_extras(
        "import asyncio, chatflow_sqlalchemy\n"
        "from chatflow_agent import Agent, Message, Role\n"
        "for name in chatflow_sqlalchemy.__all__:\n"
        "    getattr(chatflow_sqlalchemy, name)\n"
        "from chatflow_sqlalchemy import SQLiteSessionStore\n"
        "bot = Agent(name='Bot', instructions='')\n"
        "from chatflow_sqlalchemy import telemetry\n"
        "assert not telemetry.enabled()  # no otel extra: nothing reported, nothing fails\n"
        "with SQLiteSessionStore('x.db') as store:\n"
        "    with store.claim('m1', session_id='s') as claim:\n"
        "        store.get_or_create('s', bot).add_message(Message(role=Role.USER, content='hi'))\n"
        "async def main():\n"
        "    async with SQLiteSessionStore('x.db') as store:\n"
        "        ctx = await store.aget_or_create('s', bot)\n"
        "        await ctx.aadd_message(Message(role=Role.USER, content='again'))\n"
        "        assert store.runtime.pool is not None  # the private thread pool, not greenlets\n"
        "        return [m.content for m in ctx.history]\n"
        "print(asyncio.run(main()))\n"
        "assert 'sqlalchemy.ext.asyncio' not in sys.modules\n",
        tmp_path,
    )
    assert out.strip() == "['hi', 'again']"


def test_optional_parts_name_their_extra(tmp_path: Path) -> None:
    out = run_without_extras(
        "from chatflow_sqlalchemy import BackendImportError, PostgresSessionStore, open_store\n"
        "for attempt in (lambda: PostgresSessionStore('postgresql://u@127.0.0.1/db'),\n"
        "                lambda: open_store('postgresql://u@127.0.0.1/db'),\n"
        "                lambda: open_store('sqlite+aiosqlite:///aio.db')):\n"
        "    try:\n"
        "        attempt()\n"
        "    except BackendImportError as exc:\n"
        "        print(exc)\n"
        "    else:\n"
        "        raise SystemExit('no error')\n",
        tmp_path,
    )
    lines = out.strip().splitlines()
    assert len(lines) == 3
    assert all("pip install 'chatflow-sqlalchemy[postgres]'" in line for line in lines[:2])
    assert "pip install 'chatflow-sqlalchemy[aiosqlite]'" in lines[2]
    assert not (tmp_path / "aio.db").exists()


def test_the_in_memory_store_runs_without_sqlalchemy(tmp_path: Path) -> None:
    """The in-memory store shares the contract's rules, not the SQL stores' code."""
    out = run_without_extras(
        "sys.modules['sqlalchemy'] = None  # importing it anywhere now fails\n"
        "import asyncio\n"
        "from chatflow_agent import Agent, Runner\n"
        "from chatflow_sqlalchemy import SessionStore\n"
        "from chatflow_sqlalchemy.testing import ScriptedEngine\n"
        "bot = Agent(name='Bot', instructions='')\n"
        "async def main():\n"
        "    async with SessionStore(session_ttl_hours=1, archive_pruned=True) as store:\n"
        "        runner = Runner(starting_agent=bot, session_store=store,\n"
        "                        engine=ScriptedEngine())\n"
        "        async with store.claim('m1', session_id='s') as claim:\n"
        "            claim.response = (await runner.run_async('s', 'hello')).content\n"
        "        ctx = await store.aget('s')\n"
        "        return [len(ctx.history), await store.alist_sessions(), await store.asweep()]\n"
        "print(asyncio.run(main()))\n",
        tmp_path,
    )
    assert out.strip() == "[2, ['s'], 0]"
