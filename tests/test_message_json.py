"""``plain_message`` reads what pydantic reads, or leaves the row to pydantic.

The CLI prints ``plain_message(text)`` where it printed
``Message.model_validate_json(text).model_dump(mode="json")`` (and, for text
output, ``model_dump()`` but the timestamp): for every document it accepts, they agree.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

import pytest
from chatflow_agent import Message, Role, ToolCall, ToolResult
from hypothesis import given, settings
from hypothesis import strategies as st

from chatflow_sqlalchemy.context import dump_message
from chatflow_sqlalchemy.message_json import plain_message

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63) + 1, 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
_moments = st.datetimes(
    min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31), timezones=st.just(timezone.utc)
)
_calls = st.builds(ToolCall, id=st.text(), name=st.text(),
                   args=st.dictionaries(st.text(), _json_values, max_size=4))
_results = st.builds(ToolResult, tool_call_id=st.text(), name=st.text(), content=_json_values,
                     is_error=st.booleans())
_messages = st.builds(
    Message,
    role=st.sampled_from(list(Role)),
    content=st.none() | st.text(),
    tool_calls=st.none() | st.lists(_calls, max_size=3),
    tool_results=st.none() | st.lists(_results, max_size=3),
    timestamp=_moments,
)


def _pydantic(text: str) -> tuple[dict[str, Any], dict[str, Any]]:
    message = Message.model_validate_json(text)
    values = message.model_dump()
    values["role"] = message.role.value
    return message.model_dump(mode="json"), values


def _agrees(text: str) -> bool:
    """True when ``plain_message`` read ``text``; then it equals pydantic's two dumps."""
    plain = plain_message(text)
    if plain is None:
        return False
    document, values = _pydantic(text)
    assert json.dumps(plain) == json.dumps(document)
    assert {**plain, "timestamp": None} == {**values, "timestamp": None}  # text shows no time
    return True


@settings(max_examples=300, deadline=None)
@given(_messages)
def test_what_a_store_writes_is_read_plain_as_pydantic_reads_it(message: Message) -> None:
    text = dump_message(message)
    if any("\ud800" <= ch <= "\udfff" for ch in text):
        return  # a lone surrogate: the store refuses it before writing
    assert _agrees(text), text


@pytest.mark.parametrize(
    "text",
    [
        '{"role":"user","content":"x","tool_calls":null,"tool_results":null}',
        '{"role":"user","content":"x","tool_calls":null,"tool_results":null,'
        '"timestamp":"2026-01-02T03:04:05+00:00"}',
        '{"role":"user","content":"x","tool_calls":null,"tool_results":null,'
        '"timestamp":"2026-01-02T03:04:05.000000Z"}',
        '{"role":"user","content":"x","tool_calls":null,"tool_results":null,'
        '"timestamp":"2026-01-02T03:04:05.1Z"}',
        '{"role":"user","content":"x","tool_calls":null,"tool_results":null,'
        '"timestamp":"2026-02-30T03:04:05Z"}',
        '{"role":"user","content":"x","tool_calls":null,"tool_results":null,'
        '"timestamp":"2026-01-02T03:04:05Z","extra":1}',
        '{"role":"user","content":"x","content":"y","tool_calls":null,"tool_results":null,'
        '"timestamp":"2026-01-02T03:04:05Z"}',
        '{"role":"bogus","content":"x","tool_calls":null,"tool_results":null,'
        '"timestamp":"2026-01-02T03:04:05Z"}',
        '{"role":"user","content":7,"tool_calls":null,"tool_results":null,'
        '"timestamp":"2026-01-02T03:04:05Z"}',
        '{"role":"tool","content":null,"tool_calls":null,"tool_results":[{"tool_call_id":"a",'
        '"name":"b","content":{"x":NaN},"is_error":false}],"timestamp":"2026-01-02T03:04:05Z"}',
        '{"role":"tool","content":null,"tool_calls":null,"tool_results":[{"tool_call_id":"a",'
        '"name":"b","content":1,"is_error":"no"}],"timestamp":"2026-01-02T03:04:05Z"}',
        '{"role":"model","content":null,"tool_calls":[{"id":"a","name":"b"}],'
        '"tool_results":null,"timestamp":"2026-01-02T03:04:05Z"}',
        '{"role":"user","content":"\\ud800","tool_calls":null,"tool_results":null,'
        '"timestamp":"2026-01-02T03:04:05Z"}',
        '{"role":"user","content":"x","tool_calls":null,"tool_results":null,'
        '"timestamp":"2026-01-02T03:04:05Z"',
    ],
)
def test_other_documents_are_left_to_pydantic(text: str) -> None:
    assert plain_message(text) is None


def test_key_order_does_not_matter() -> None:
    text = ('{"timestamp":"2026-01-02T03:04:05.120000Z","tool_results":null,"tool_calls":'
            '[{"args":{"b":1,"a":[1.5,"x"]},"name":"n","id":"i"}],"content":null,"role":"model"}')
    assert _agrees(text)
