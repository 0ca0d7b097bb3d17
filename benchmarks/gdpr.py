"""GDPR round trip on PostgreSQL: export a user, erase them, check nothing else moved.

Run: ``python -m benchmarks.gdpr [--sessions 50] [--turns 20] [--others 200] [--url URL]``.

In a fresh schema, one user gets ``--sessions`` sessions of ``--turns`` turns
(USER + MODEL, every fifth with a tool call and result), each with a done
webhook claim, and ``--others`` other users get one such session each. The
store runs with ``archive_pruned=True`` and a window of 10 turns, so part of
every conversation sits in the archive. Reported: export time and size, that
the export is JSON-serialisable and holds every message of the user
(archive + window = everything written), erase time and count, that a second
export is empty, and that the other users' exports are unchanged.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from chatflow_agent import Agent, Message, Role, ToolCall, ToolResult

from benchmarks.pg import create_schema, drop_schema, pg_url_from_env, schema_connect_args

__all__ = ["main", "run_gdpr"]


def _conversation(store: Any, session_id: str, user: str, turns: int) -> int:
    ctx = store.get_or_create(session_id, Agent(name="support", instructions=""), user_id=user)
    written = 0
    for n in range(turns):
        ctx.add_message(Message(role=Role.USER, content=f"{user} question {n}"))
        written += 1
        if n % 5 == 0:
            call = ToolCall(id=f"{session_id}-{n}", name="lookup", args={"n": n})
            ctx.add_message(Message(role=Role.MODEL, tool_calls=[call]))
            result = ToolResult(tool_call_id=call.id, name="lookup", content={"n": n})
            ctx.add_message(Message(role=Role.TOOL, tool_results=[result]))
            written += 2
        ctx.add_message(Message(role=Role.MODEL, content=f"answer {n}"))
        written += 1
    with store.claim(f"{session_id}-wamid", session_id=session_id) as claim:
        claim.response = "sent"
    return written


def run_gdpr(url: str, sessions: int, turns: int, others: int) -> dict[str, Any]:
    """Load, export, erase, check; return the figures."""
    from chatflow_sqlalchemy.backends.postgresql import PostgresSessionStore

    schema = create_schema(url, "gdpr")
    try:
        store = PostgresSessionStore(
            url, default_max_turns=10, archive_pruned=True,
            connect_args=schema_connect_args(schema),
        )
        try:
            written = sum(
                _conversation(store, f"alice-{i}", "alice", turns) for i in range(sessions)
            )
            for i in range(others):
                _conversation(store, f"other-{i}", f"user-{i}", turns)
            before = [store.export_user(f"user-{i}") for i in range(others)]
            started = time.perf_counter()
            exported = store.export_user("alice")
            export_seconds = time.perf_counter() - started
            text = json.dumps(exported)
            held = sum(
                len(s["archived_messages"]) + len(s["messages"]) for s in exported["sessions"]
            )
            started = time.perf_counter()
            erased = store.erase_user("alice")
            erase_seconds = time.perf_counter() - started
            after = [store.export_user(f"user-{i}") for i in range(others)]
            unchanged = all(
                a["sessions"] == b["sessions"] for a, b in zip(before, after, strict=True)
            )
            return {
                "user_sessions": sessions,
                "messages_written": written,
                "messages_exported": held,
                "export_complete": held == written
                and len(exported["sessions"]) == sessions
                and all(s["webhook_claims"] for s in exported["sessions"]),
                "export_seconds": round(export_seconds, 3),
                "export_bytes": len(text.encode()),
                "erased": erased,
                "erase_seconds": round(erase_seconds, 3),
                "export_after_erase_empty": store.export_user("alice")["sessions"] == [],
                "other_users_unchanged": unchanged,
            }
        finally:
            store.close()
    finally:
        drop_schema(url, schema)


def main(argv: list[str] | None = None) -> None:
    """Command line: print the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None)
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--others", type=int, default=200)
    args = parser.parse_args(argv)
    print(json.dumps(run_gdpr(pg_url_from_env(args.url), args.sessions, args.turns, args.others),
                     indent=2))


if __name__ == "__main__":
    main()
