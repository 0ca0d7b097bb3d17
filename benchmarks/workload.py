"""The "webhook turns" workload: what a turn writes, who runs which turn, what must remain.

A turn is what ``chatflow_agent.Runner`` does for one inbound webhook: claim
the webhook id, fetch the session, and under ``session.lock`` append four
messages (USER, MODEL with one tool call, TOOL with its result, final MODEL).
Every message carries a tag ``<session>|<turn>`` so a verifier can read any
store back and check that it holds whole turns, in order, and how many.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from chatflow_agent import Message, Role, ToolCall, ToolResult

from benchmarks import MAX_TURNS

__all__ = [
    "KINDS",
    "MODES",
    "Plan",
    "Tag",
    "TurnRef",
    "build_items",
    "build_messages",
    "expected_turns",
    "item_tag",
    "message_tag",
    "plan_for",
    "session_ids",
    "verify_windows",
]

USER_FILLER = "Olá! Meu pedido ainda não chegou, podem verificar o status da entrega, por favor?"
ANSWER_FILLER = (
    "Verifiquei o seu pedido no sistema: ele saiu do centro de distribuição ontem e está em "
    "trânsito com a transportadora. A previsão de entrega é amanhã até as 18h. Posso ajudar "
    "com mais alguma coisa?"
)
TOOL_NAME = "lookup_order"

KINDS = ("U", "C", "R", "A")
"""The four messages of a turn: User, tool Call, tool Result, Answer."""

MODES = ("single", "disjoint", "contention", "redelivery")

Tag = tuple[str, str, int]
"""(kind, session id, turn index) of one stored message."""


@dataclass(frozen=True)
class TurnRef:
    """One webhook: which session, which turn of it, which webhook id."""

    session_id: str
    turn: int
    webhook_id: str


@dataclass(frozen=True)
class Plan:
    """The turns one worker process drives, in order."""

    turns: list[TurnRef]


def session_ids(sessions: int, prefix: str = "+55119") -> list[str]:
    """Phone-number-like session ids, stable across processes."""
    return [f"{prefix}{index:08d}" for index in range(sessions)]


def _padded(prefix: str, filler: str, length: int) -> str:
    text = f"{prefix} {filler}"
    while len(text) < length:
        text += " " + filler
    return text[:length]


def build_messages(session_id: str, turn: int) -> list[Message]:
    """The four chatflow messages of one turn (~100-char question, ~200-char answer)."""
    tag = f"{session_id}|{turn}"
    call = ToolCall(id=tag, name=TOOL_NAME, args={"order_id": f"PED-{turn:06d}"})
    result = ToolResult(
        tool_call_id=tag,
        name=TOOL_NAME,
        content={"status": "in_transit", "eta": "amanhã 18h", "order_id": f"PED-{turn:06d}"},
    )
    return [
        Message(role=Role.USER, content=_padded(f"{tag}|", USER_FILLER, 100)),
        Message(role=Role.MODEL, tool_calls=[call]),
        Message(role=Role.TOOL, tool_results=[result]),
        Message(role=Role.MODEL, content=_padded(f"{tag}|", ANSWER_FILLER, 200)),
    ]


def build_items(session_id: str, turn: int) -> list[dict[str, Any]]:
    """The same turn as openai-agents input items (user, function call, output, assistant)."""
    tag = f"{session_id}|{turn}"
    args = json.dumps({"order_id": f"PED-{turn:06d}"})
    output = json.dumps({"status": "in_transit", "eta": "amanhã 18h"})
    return [
        {"role": "user", "content": _padded(f"{tag}|", USER_FILLER, 100)},
        {"type": "function_call", "call_id": tag, "name": TOOL_NAME, "arguments": args},
        {"type": "function_call_output", "call_id": tag, "output": output},
        {"role": "assistant", "content": _padded(f"{tag}|", ANSWER_FILLER, 200)},
    ]


def _split_tag(tag: str) -> tuple[str, int]:
    session_id, turn, *_ = tag.split("|")
    return session_id, int(turn)


def message_tag(message: Message) -> Tag:
    """Read the tag back from a chatflow message."""
    if message.role == Role.USER:
        return ("U", *_split_tag(message.content or ""))
    if message.role == Role.TOOL:
        results = message.tool_results or []
        return ("R", *_split_tag(results[0].tool_call_id))
    if message.tool_calls:
        return ("C", *_split_tag(message.tool_calls[0].id))
    return ("A", *_split_tag(message.content or ""))


def item_tag(item: dict[str, Any]) -> Tag:
    """Read the tag back from an openai-agents item."""
    kind = item.get("type")
    if kind == "function_call":
        return ("C", *_split_tag(item["call_id"]))
    if kind == "function_call_output":
        return ("R", *_split_tag(item["call_id"]))
    code = "U" if item.get("role") == "user" else "A"
    return (code, *_split_tag(item["content"]))


def expected_turns(turns: int) -> int:
    """How many whole turns a session must hold after ``turns`` turns."""
    return min(turns, MAX_TURNS)


def plan_for(mode: str, sessions: Sequence[str], turns: int, worker: int, workers: int) -> Plan:
    """The turns worker ``worker`` of ``workers`` drives in ``mode`` (round-robin over sessions).

    * single/disjoint: the worker owns sessions ``i % workers == worker`` and runs all
      their turns;
    * contention: every worker touches every session; it runs turns ``t % workers == worker``;
    * redelivery: every worker receives every webhook (same ids, same order); only the
      winner of the claim runs the turn.
    """
    if mode in ("single", "disjoint"):
        mine = [sid for index, sid in enumerate(sessions) if index % workers == worker]
        order: Iterable[tuple[int, str]] = ((t, sid) for t in range(turns) for sid in mine)
    elif mode == "contention":
        order = ((t, sid) for t in range(worker, turns, workers) for sid in sessions)
    elif mode == "redelivery":
        order = ((t, sid) for t in range(turns) for sid in sessions)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return Plan([TurnRef(sid, t, f"wamid.{sid}.{t}") for t, sid in order])


def _check_whole(session_id: str, tags: list[Tag]) -> tuple[list[int], str | None]:
    """Split a history into turns; the error says what is broken (or None)."""
    if len(tags) % 4:
        return [], f"{session_id}: {len(tags)} messages is not whole turns"
    turns: list[int] = []
    for start in range(0, len(tags), 4):
        chunk = tags[start : start + 4]
        kinds = tuple(kind for kind, _, _ in chunk)
        owners = {(sid, turn) for _, sid, turn in chunk}
        if kinds != KINDS or len(owners) != 1:
            return [], f"{session_id}: broken/interleaved turn at message {start}: {chunk}"
        sid, turn = owners.pop()
        if sid != session_id:
            return [], f"{session_id}: holds a message of {sid}"
        turns.append(turn)
    if len(set(turns)) != len(turns):
        return [], f"{session_id}: a turn is stored twice: {sorted(turns)}"
    return turns, None


def _check_order(
    session_id: str, mode: str, turns: list[int], total: int, workers: int
) -> str | None:
    if mode in ("single", "disjoint"):
        want = list(range(total - len(turns), total))
        return None if turns == want else f"{session_id}: turns {turns} != newest {want}"
    if mode == "contention":
        for worker in range(workers):
            own = [t for t in turns if t % workers == worker]
            if own != sorted(own):
                return f"{session_id}: worker {worker}'s turns out of order: {own}"
    return None


def verify_windows(
    windows: dict[str, list[Tag]], mode: str, turns: int, workers: int
) -> list[str]:
    """Check every session's stored window; return the problems (empty when all is right)."""
    problems: list[str] = []
    want = expected_turns(turns)
    for session_id, tags in windows.items():
        stored, error = _check_whole(session_id, tags)
        if error is None and len(stored) != want:
            error = f"{session_id}: {len(stored)} turns stored, expected {want}"
        if error is None:
            error = _check_order(session_id, mode, stored, turns, workers)
        if error is not None:
            problems.append(error)
    return problems
