"""Stored messages read as plain JSON, without chatflow-agent, when they are in the stores' form.

A stored ``message_json`` is the pydantic dump of a ``chatflow_agent.Message``.
Reading it back through pydantic costs the import of chatflow-agent (its
package loads every model provider), which is most of what the CLI's
``sessions show`` and ``sessions export`` would spend. :func:`plain_message`
reads a document in exactly the form the stores write (every field present,
nothing else, canonical UTC timestamp, finite numbers) and returns what
``Message.model_validate_json(text).model_dump(mode="json")`` returns for it.
Anything else (old rows, hand-edited or corrupt ones) gives None, and the
caller asks pydantic, whose answer (or error) is the reference.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from datetime import datetime
from typing import Any

__all__ = ["plain_message"]

_FIELDS = ("role", "content", "tool_calls", "tool_results", "timestamp")
_CALL_FIELDS = ("id", "name", "args")
_RESULT_FIELDS = ("tool_call_id", "name", "content", "is_error")
_ROLES = frozenset({"user", "model", "system", "tool"})
_TIMESTAMP = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.(?!000000)\d{6})?Z")
"""How pydantic writes a UTC datetime: whole seconds, or six digits of microseconds."""
_INT_BOUND = 2**63


class _NotPlain(Exception):
    """The document is not in the stores' form: pydantic must read it."""


def plain_message(text: str) -> dict[str, Any] | None:
    """The JSON dump of the message ``text`` stores, or None when pydantic must read it.

    The result has the fields in the model's order, as ``model_dump(mode="json")``
    gives them; it is also what ``model_dump()`` gives (no value differs by mode).
    """
    try:
        document = json.loads(text, object_pairs_hook=_unique, parse_constant=_refuse)
        return _message(document)
    except (ValueError, _NotPlain, RecursionError):
        return None


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):
        raise _NotPlain("a key is repeated")
    return found


def _refuse(constant: str) -> Any:
    raise _NotPlain(f"{constant} (pydantic writes it as null)")


def _fields(value: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """``value`` as a dict of exactly ``names``, in that order."""
    if not isinstance(value, dict) or set(value) != set(names):
        raise _NotPlain("not the model's fields")
    return {name: value[name] for name in names}


def _message(value: Any) -> dict[str, Any]:
    message = _fields(value, _FIELDS)
    if message["role"] not in _ROLES:
        raise _NotPlain("unknown role")
    if message["content"] is not None:
        _text(message["content"])
    message["tool_calls"] = _items(message["tool_calls"], _call)
    message["tool_results"] = _items(message["tool_results"], _result)
    _timestamp(message["timestamp"])
    return message


def _items(
    value: Any, read: Callable[[Any], dict[str, Any]]
) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _NotPlain("not a list")
    return [read(item) for item in value]


def _call(value: Any) -> dict[str, Any]:
    call = _fields(value, _CALL_FIELDS)
    _text(call["id"])
    _text(call["name"])
    if not isinstance(call["args"], dict):
        raise _NotPlain("args is not an object")
    _json(call["args"])
    return call


def _result(value: Any) -> dict[str, Any]:
    result = _fields(value, _RESULT_FIELDS)
    _text(result["tool_call_id"])
    _text(result["name"])
    if not isinstance(result["is_error"], bool):
        raise _NotPlain("is_error is not a boolean")
    _json(result["content"])
    return result


def _timestamp(value: Any) -> None:
    if not isinstance(value, str) or _TIMESTAMP.fullmatch(value) is None:
        raise _NotPlain("not a canonical UTC timestamp")
    datetime.fromisoformat(value)  # ValueError for a date or time that does not exist


def _text(value: Any) -> None:
    if not isinstance(value, str):
        raise _NotPlain("not a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: pydantic refuses it
        raise _NotPlain("not UTF-8 text") from None


def _json(value: Any) -> None:
    """Refuse what pydantic could read or write differently: big ints, odd text, inf."""
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if abs(value) >= _INT_BOUND:
            raise _NotPlain("a very large integer")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise _NotPlain("an infinite number")
    elif isinstance(value, str):
        _text(value)
    elif isinstance(value, list):
        for item in value:
            _json(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _text(key)
            _json(item)
    else:
        raise _NotPlain("not a JSON value")
