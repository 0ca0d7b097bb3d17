"""Benchmarks for chatflow-sqlalchemy: ``python -m benchmarks``.

One command, one run: the "webhook turns" workload is driven through this
project's stores, chatflow-agent's own stores, openai-agents' sessions and a
raw-driver floor (stdlib ``sqlite3`` / ``psycopg``), each store in its own
subprocess, every result verified from a fresh store instance afterwards.
See ``benchmarks/RESULTS.md`` for a measured table and its explanation.
"""

__all__ = ["MAX_TURNS"]

MAX_TURNS = 40
"""History window (complete user turns) of every store under test."""
