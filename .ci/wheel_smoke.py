"""Smoke test of the built wheel in a fresh venv WITHOUT extras (run by .ci/run).

What a new user does first, on the base install only (no greenlet, psycopg or
aiosqlite): import every public name, create a database with the CLI, run one
real ``chatflow_agent.Runner`` turn on ``SQLiteSessionStore`` with the offline
scripted engine, use one async twin, and see the optional parts fail with an
error that names the extra to install.

Usage: python wheel_smoke.py WORKDIR   (run from outside the source tree)
"""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
import sysconfig
from pathlib import Path


def check(condition: bool, what: str) -> None:
    """Print ``ok: what``, or exit with the failure."""
    if not condition:
        raise SystemExit(f"wheel smoke FAILED: {what}")
    print(f"ok: {what}")


def main(workdir: Path) -> None:
    """Run every step in ``workdir``; the first failure exits non-zero."""
    import chatflow_sqlalchemy

    where = Path(chatflow_sqlalchemy.__file__).resolve()
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    check(site in where.parents, f"chatflow_sqlalchemy imported from the installed wheel ({where})")
    for module in ("greenlet", "psycopg", "aiosqlite"):
        check(importlib.util.find_spec(module) is None, f"{module} is not installed (no extras)")

    for name in chatflow_sqlalchemy.__all__:
        getattr(chatflow_sqlalchemy, name)
    check(True, f"all {len(chatflow_sqlalchemy.__all__)} public names import")

    db = workdir / "smoke.db"
    cli = Path(sys.executable).with_name("chatflow-sqlalchemy")
    done = subprocess.run(
        [str(cli), "--url", f"sqlite:///{db}", "db", "upgrade"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    check(done.returncode == 0, f"chatflow-sqlalchemy db upgrade exits 0 ({done.stderr.strip()})")
    check(db.exists(), "db upgrade created the database file")

    from chatflow_agent import Runner

    from chatflow_sqlalchemy import SQLiteSessionStore
    from chatflow_sqlalchemy.demo import ScriptedEngine, build_agents

    agents = build_agents()
    with SQLiteSessionStore(db, auto_migrate=False) as store:
        runner = Runner(
            starting_agent=agents["Support"], session_store=store, engine=ScriptedEngine()
        )
        runner.run("whatsapp:+15550100", "Where is my order 42?")
        session = store.get("whatsapp:+15550100")
        check(session is not None and len(session.history) >= 2, "a Runner turn was stored")

    async def async_twin() -> int:
        async with SQLiteSessionStore(db) as store:
            session = await store.aget_or_create("async-user", agents["Support"])
            claimed = await store.arecord_processed_message("wamid.smoke")
            check(claimed, "arecord_processed_message claims a new id")
            return len((await store.aget(session.session_id)).history)  # type: ignore[union-attr]

    check(asyncio.run(async_twin()) == 0, "aget_or_create works on the thread pool")

    with SQLiteSessionStore(db) as store:
        store.set_agent_resolver(agents.get)
        check(len(store.get("whatsapp:+15550100").history) >= 2, "the turn survived a reopen")  # type: ignore[union-attr]

    from chatflow_sqlalchemy import BackendImportError, PostgresSessionStore, open_store

    for open_optional, extra in (
        (lambda: PostgresSessionStore("postgresql://u@127.0.0.1/db"), "postgres"),
        (lambda: open_store("postgresql://u@127.0.0.1/db"), "postgres"),
        (lambda: open_store(f"sqlite+aiosqlite:///{workdir / 'aio.db'}"), "aiosqlite"),
    ):
        try:
            open_optional()
        except BackendImportError as exc:
            hint = f"pip install 'chatflow-sqlalchemy[{extra}]'"
            check(hint in str(exc), f"a missing optional part names {hint}: {exc}")
        else:
            check(False, f"opening an optional part without the {extra} extra raised nothing")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
