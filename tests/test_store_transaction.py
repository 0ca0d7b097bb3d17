"""``StoreRuntime.transaction`` keeps the contract of a nested ``with``, on real databases.

``with runtime.transaction() as conn:`` promises what ``with conn, conn.begin():``
did: among that, SQLAlchemy refusing a statement after the block's own
transaction was ended inside it, rather than running it in a new transaction
that the connection's close then rolls back without a word.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import InvalidRequestError

from .stores import SQL_KINDS, open_on


@pytest.fixture(params=SQL_KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    with ExitStack() as stack:
        yield open_on(request.param, stack, tmp_path)()


def _rows(store: Any) -> list[int]:
    with store.engine.connect() as conn:
        return [row[0] for row in conn.execute(text("SELECT id FROM review12 ORDER BY id"))]


@pytest.mark.parametrize("end", ["commit", "rollback"])
def test_a_statement_after_the_blocks_transaction_ended_is_refused(
    store: Any, end: str
) -> None:
    """Ending the transaction inside the block, then writing again, raises (as with
    ``with conn.begin():``); the write after it is never run in a transaction the
    connection's close rolls back silently."""
    with store.engine.begin() as conn:
        conn.execute(text("CREATE TABLE review12 (id INTEGER PRIMARY KEY)"))
    refused = pytest.raises(InvalidRequestError, match="closed transaction inside context manager")
    with refused, store.runtime.transaction(write=True) as conn:
        conn.execute(text("INSERT INTO review12 (id) VALUES (1)"))
        getattr(conn, end)()
        conn.execute(text("INSERT INTO review12 (id) VALUES (2)"))
    assert _rows(store) == ([1] if end == "commit" else [])
    assert store.engine.pool.checkedout() == 0
