"""What the numbers were measured on: machine, versions."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import sqlite3
import subprocess
from pathlib import Path

__all__ = ["describe"]

PACKAGES = ("chatflow-agent", "chatflow-sqlalchemy", "SQLAlchemy", "psycopg", "openai-agents",
            "aiosqlite", "asyncpg", "pydantic")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _source() -> str:
    """Where ``chatflow_sqlalchemy`` is imported from, and the repository's commit."""
    import importlib.util

    spec = importlib.util.find_spec("chatflow_sqlalchemy")
    origin = Path(spec.origin).parent if spec and spec.origin else Path("?")
    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "src"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        head, dirty = "unknown", ""
    state = " with uncommitted changes in src/" if dirty else ""
    return f"chatflow_sqlalchemy from {origin} (repository HEAD {head}{state})"


def describe(pg_version: str | None) -> str:
    """A markdown bullet list of date, machine and versions."""
    packages = ", ".join(f"{name} {_version(name)}" for name in PACKAGES)
    lines = [
        f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        f"- machine: nproc={os.cpu_count()}, CPU {_cpu_model()}, {platform.system()} "
        f"{platform.release()}",
        f"- Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}, "
        f"PostgreSQL {pg_version or 'not used'}",
        f"- packages: {packages}",
        f"- code under test: {_source()}",
    ]
    return "\n".join(lines)
