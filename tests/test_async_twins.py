"""The stores' ``a``-methods are async methods of their own, as callers introspect them.

Each is an ``async def`` with its twin's parameters: a call with the wrong
arguments fails at the call, naming the ``a``-method (not later, on a pool
thread, naming the sync one); ``typing.get_type_hints`` and ``inspect.unwrap``
see a coroutine function with the twin's types, as frameworks that inspect
handlers (dependency injection, validators, ``help()``) rely on.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

import pytest
from chatflow_agent import BaseSessionStore

from chatflow_sqlalchemy import SessionStore, SQLiteSessionStore

TWINS = [
    "aget", "adelete", "alist_sessions", "afork", "aerase_user", "atranscript", "asweep",
    "aexport_user", "aclear", "ais_message_processed", "amark_message_processed",
    "arecord_processed_message", "apurge_processed_messages",
]


@pytest.mark.parametrize("store", [SessionStore, SQLiteSessionStore])
@pytest.mark.parametrize("name", TWINS)
def test_a_twin_is_introspected_as_an_async_method_with_its_twins_types(
    store: type[BaseSessionStore], name: str
) -> None:
    twin = getattr(store, name)
    assert inspect.iscoroutinefunction(inspect.unwrap(twin))
    hints = typing.get_type_hints(twin)
    expected = {
        param.name for param in inspect.signature(twin).parameters.values()
        if param.name != "self"
    } | {"return"}
    assert set(hints) == expected
    assert not any(isinstance(hint, typing.TypeVar) for hint in hints.values())


def test_a_twin_called_with_the_wrong_arguments_fails_at_the_call() -> None:
    store: Any = SessionStore()
    try:
        with pytest.raises(TypeError, match="aget"):
            store.aget()
        with pytest.raises(TypeError, match="alist_sessions"):
            store.alist_sessions("u1")  # its filters are keyword-only
        with pytest.raises(TypeError, match="asweep"):
            store.asweep(limit=1, batch=2)
    finally:
        store.close()
