"""The raw floors: the least a Python process can do per turn on each backend.

One persistent connection, one transaction per turn: the dedup claim
(``INSERT .. ON CONFLICT``, TTL-aware like the stores'), the session upsert,
the four messages (serialised with ``Message.model_dump_json`` like every
chatflow store), and the window prune as one ``DELETE``. The driver's own
I/O runs directly on the event loop: no thread hop, no ORM, no pool. The
window the Runner reads is kept in memory, as a store's context would.

``raw-sqlite-hop`` is not a floor: the SQLite floor plus the one thread hop
per turn that the 0.4.0rc1 contract imposes on on-disk stores.

``raw-pg-claim`` is the guarantee-equivalent floor of a claimed turn: what
``async with store.claim(...)`` promises (a durable claim with a lease and a
fencing token, claims of a session in ticket order, the session's lease, a
fenced compare-and-swap write that stores the reply), in two autocommit
statements per turn.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from chatflow_agent import Message, Role

from benchmarks import MAX_TURNS
from benchmarks.pg import libpq_url, schema_connect_args
from benchmarks.stores.base import Adapter, Target
from benchmarks.workload import Tag, TurnRef, build_messages, message_tag
from chatflow_sqlalchemy.iopool import IOPool

__all__ = [
    "RawMemory",
    "RawPostgres",
    "RawPostgresClaim",
    "RawSQLite",
    "RawSQLiteHop",
    "RawSQLiteMemory",
    "RawSQLiteOurs",
]

TTL = timedelta(hours=192)
PRUNE_OFFSET = MAX_TURNS - 1
BLOCKING_IO_WORKERS = 4
"""Threads of ``raw-sqlite-hop``'s private pool (``_BLOCKING_IO_WORKERS`` of the store)."""

SQLITE_DDL = (
    """CREATE TABLE IF NOT EXISTS sessions (
        session_id TEXT PRIMARY KEY, active_agent_name TEXT NOT NULL,
        metadata_json TEXT NOT NULL DEFAULT '{}', created_at TEXT, updated_at TEXT)""",
    """CREATE TABLE IF NOT EXISTS messages (
        id INTEGER PRIMARY KEY, session_id TEXT NOT NULL
            REFERENCES sessions(session_id) ON DELETE CASCADE,
        role TEXT NOT NULL, content TEXT, message_json TEXT NOT NULL, created_at TEXT)""",
    "CREATE INDEX IF NOT EXISTS ix_messages_session ON messages(session_id, id)",
    "CREATE TABLE IF NOT EXISTS processed (message_id TEXT PRIMARY KEY, processed_at TEXT)",
    "CREATE INDEX IF NOT EXISTS ix_processed_at ON processed(processed_at)",
)
PG_DDL = (
    """CREATE TABLE IF NOT EXISTS sessions (
        session_id VARCHAR(255) PRIMARY KEY, active_agent_name VARCHAR(255) NOT NULL,
        metadata_json JSONB NOT NULL DEFAULT '{}', created_at TIMESTAMPTZ,
        updated_at TIMESTAMPTZ)""",
    """CREATE TABLE IF NOT EXISTS messages (
        id BIGSERIAL PRIMARY KEY, session_id VARCHAR(255) NOT NULL
            REFERENCES sessions(session_id) ON DELETE CASCADE,
        role VARCHAR(16) NOT NULL, content TEXT, message_json TEXT NOT NULL,
        created_at TIMESTAMPTZ)""",
    "CREATE INDEX IF NOT EXISTS ix_messages_session ON messages(session_id, id)",
    """CREATE TABLE IF NOT EXISTS processed (
        message_id VARCHAR(255) PRIMARY KEY, processed_at TIMESTAMPTZ)""",
    "CREATE INDEX IF NOT EXISTS ix_processed_at ON processed(processed_at)",
)

CLAIM = (
    "INSERT INTO processed (message_id, processed_at) VALUES ({p}, {p}) "
    "ON CONFLICT (message_id) DO UPDATE SET processed_at = excluded.processed_at "
    "WHERE processed.processed_at < {p} RETURNING 1"
)
UPSERT_SESSION = (
    "INSERT INTO sessions (session_id, active_agent_name, metadata_json, created_at, updated_at) "
    "VALUES ({p}, {p}, '{{}}', {p}, {p}) "
    "ON CONFLICT (session_id) DO UPDATE SET updated_at = excluded.updated_at"
)
INSERT_MESSAGE = (
    "INSERT INTO messages (session_id, role, content, message_json, created_at) "
    "VALUES ({p}, {p}, {p}, {p}, {p})"
)
PRUNE = (
    "DELETE FROM messages WHERE session_id = {p} AND id < ("
    "SELECT id FROM messages WHERE session_id = {p} AND role = 'user' "
    f"ORDER BY id DESC LIMIT 1 OFFSET {PRUNE_OFFSET})"
)
READ = "SELECT message_json FROM messages WHERE session_id = {p} ORDER BY id"


def _sql(template: str, placeholder: str) -> str:
    return template.format(p=placeholder)


class _Windows:
    """What a floor keeps in memory: each session's window of turns and its lock."""

    def __init__(self) -> None:
        self.turns: defaultdict[str, deque[list[Message]]] = defaultdict(
            lambda: deque(maxlen=MAX_TURNS)
        )
        self.locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)


def _read_tags(
    conn: sqlite3.Connection, sql: str, session_ids: Sequence[str]
) -> dict[str, list[Tag]]:
    """Every session's stored messages, in order, as tags (``sql`` selects message_json)."""
    return {
        sid: [message_tag(Message.model_validate_json(row[0])) for row in conn.execute(sql, (sid,))]
        for sid in session_ids
    }


def _rows(session_id: str, payload: list[Message], now: Any) -> list[tuple[Any, ...]]:
    return [
        (session_id, m.role.value, m.content, m.model_dump_json(), now) for m in payload
    ]


class _TransactionPerTurn(Adapter):
    """A floor: one driver transaction per turn (``_write``), run on the loop."""

    windows: _Windows

    def _write(self, ref: TurnRef, payload: list[Message]) -> bool:
        raise NotImplementedError

    async def turn(self, ref: TurnRef, payload: list[Message]) -> bool:
        async with self.windows.locks[ref.session_id]:
            _checkpoint = len(self.windows.turns[ref.session_id])
            if not self._write(ref, payload):
                return False
            self.windows.turns[ref.session_id].append(payload)
        return True


class RawSQLite(_TransactionPerTurn):
    """stdlib ``sqlite3``: WAL, ``synchronous=NORMAL``, ``BEGIN IMMEDIATE`` per turn."""

    name = "raw-sqlite"
    backend = "sqlite-file"
    multiprocess = True
    floor = True
    database: str | None = None

    def __init__(self, target: Target) -> None:
        super().__init__(target)
        self.windows = _Windows()
        self.conn: sqlite3.Connection | None = None
        self.sql = {key: _sql(value, "?") for key, value in _TEMPLATES.items()}

    @classmethod
    def prepare(cls, target: Target) -> None:
        cls._connect(target.path or "").close()

    @staticmethod
    def _connect(database: str, check_same_thread: bool = True) -> sqlite3.Connection:
        conn = sqlite3.connect(database, isolation_level=None, timeout=30,
                               check_same_thread=check_same_thread)
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("PRAGMA busy_timeout = 30000")
        if database != ":memory:":
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
        for statement in SQLITE_DDL:
            conn.execute(statement)
        return conn

    async def open(self) -> None:
        self.conn = self._connect(self.database or self.target.path or "")

    def payload(self, ref: TurnRef) -> list[Message]:
        return build_messages(ref.session_id, ref.turn)

    def _write(self, ref: TurnRef, payload: list[Message]) -> bool:
        conn, sql = self.conn, self.sql
        assert conn is not None
        now = datetime.now(timezone.utc)
        stamp, cutoff = now.isoformat(), (now - TTL).isoformat()
        conn.execute("BEGIN IMMEDIATE")
        try:
            if not conn.execute(sql["claim"], (ref.webhook_id, stamp, cutoff)).fetchall():
                conn.execute("ROLLBACK")
                return False
            sid = ref.session_id
            conn.execute(sql["upsert"], (sid, "Support", stamp, stamp))
            conn.executemany(sql["insert"], _rows(sid, payload, stamp))
            conn.execute(sql["prune"], (sid, sid))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return True

    async def read_windows(self, session_ids: Sequence[str]) -> dict[str, list[Tag]]:
        assert self.conn is not None
        return _read_tags(self.conn, self.sql["read"], session_ids)

    async def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


class RawSQLiteHop(RawSQLite):
    """The SQLite floor with each turn's transaction run on a private pool of 4 threads.

    Not a floor: what the 0.4.0rc1 contract (on-disk stores dispatch their
    blocking I/O to a private pool of ``_BLOCKING_IO_WORKERS = 4`` threads)
    costs on top of ``raw-sqlite``, which runs the same SQL on the loop. The
    hop is the cheapest one known here, this project's
    :class:`~chatflow_sqlalchemy.iopool.IOPool` (``run_in_executor`` on a
    ``ThreadPoolExecutor`` costs ~25 us more a turn), so this is the best a
    store bound by the contract can do. The one connection is shared by the
    pool's threads: safe because a process runs one turn at a time, as every
    store under test here does.
    """

    name = "raw-sqlite-hop"
    floor = False

    def __init__(self, target: Target) -> None:
        super().__init__(target)
        self.pool: IOPool | None = None

    async def open(self) -> None:
        self.conn = self._connect(self.database or self.target.path or "",
                                  check_same_thread=False)
        self.pool = IOPool(BLOCKING_IO_WORKERS, thread_name_prefix="raw-sqlite-hop")

    async def turn(self, ref: TurnRef, payload: list[Message]) -> bool:
        assert self.pool is not None
        async with self.windows.locks[ref.session_id]:
            _checkpoint = len(self.windows.turns[ref.session_id])
            if not await self.pool.run(self._write, ref, payload):
                return False
            self.windows.turns[ref.session_id].append(payload)
        return True

    async def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        await super().close()


class RawSQLiteOurs(Adapter):
    """This project's statements and transactions on raw ``sqlite3``, with the thread hop.

    Not a floor: what ``ours-sqlite`` would cost with no SQLAlchemy and no
    Python bookkeeping. On the store's own schema (created by its migrations),
    per turn: the claim as its own autocommit statement, the version check
    as another, then on a private pool thread one ``BEGIN IMMEDIATE``
    transaction with the compare-and-swap of the session's version, the
    pruned rows' ``DELETE`` by seq and the four-row ``INSERT``. The gap from
    ``raw-sqlite-hop`` to here is what the store's structure (three
    transactions instead of one) costs; from here to ``ours-sqlite``, what its
    Python and SQLAlchemy layers cost.
    """

    name = "raw-sqlite-ours"
    backend = "sqlite-file"
    multiprocess = False

    def __init__(self, target: Target) -> None:
        super().__init__(target)
        self.windows = _Windows()
        self.conn: sqlite3.Connection | None = None
        self.pool: IOPool | None = None
        self.state: dict[str, tuple[int, int]] = {}  # session -> (version, next seq)

    @classmethod
    def prepare(cls, target: Target) -> None:
        from chatflow_sqlalchemy import SQLiteSessionStore

        SQLiteSessionStore(target.path or "", default_max_turns=MAX_TURNS).close()

    async def open(self) -> None:
        conn = sqlite3.connect(self.target.path or "", isolation_level=None, timeout=30,
                               check_same_thread=False)
        for pragma in ("foreign_keys = ON", "busy_timeout = 30000", "journal_mode = WAL",
                       "synchronous = NORMAL"):
            conn.execute(f"PRAGMA {pragma}")
        self.conn = conn
        self.pool = IOPool(BLOCKING_IO_WORKERS, thread_name_prefix="raw-sqlite-ours")

    def payload(self, ref: TurnRef) -> list[Message]:
        return build_messages(ref.session_id, ref.turn)

    def _claim_and_check(self, ref: TurnRef) -> bool:
        conn = self.conn
        assert conn is not None
        now = datetime.now(timezone.utc)
        stamp, cutoff = now.isoformat(), (now - TTL).isoformat()
        if not conn.execute(OURS_SQL["claim"], (ref.webhook_id, stamp, cutoff)).fetchall():
            return False
        row = conn.execute(OURS_SQL["version"], (ref.session_id,)).fetchone()
        if row is None:
            conn.execute(OURS_SQL["create"], (ref.session_id, "Support", stamp, stamp))
            self.state[ref.session_id] = (0, 1)
        return True

    def _write(self, ref: TurnRef, payload: list[Message], pruned: list[int]) -> None:
        conn = self.conn
        assert conn is not None
        sid = ref.session_id
        version, seq = self.state[sid]
        stamp = datetime.now(timezone.utc).isoformat()
        conn.execute("BEGIN IMMEDIATE")
        try:
            bumped = conn.execute(OURS_SQL["bump"], (version + 1, stamp, sid, version))
            if bumped.rowcount != 1:
                raise RuntimeError(f"{sid}: version moved (one process owns its sessions)")
            conn.executemany(OURS_SQL["delete"], [(sid, old) for old in pruned])
            conn.executemany(OURS_SQL["insert"], [
                (sid, seq + i, m.role.value, m.content, m.model_dump_json(), stamp)
                for i, m in enumerate(payload)
            ])
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        self.state[sid] = (version + 1, seq + len(payload))

    async def turn(self, ref: TurnRef, payload: list[Message]) -> bool:
        if not self._claim_and_check(ref):
            return False
        assert self.pool is not None
        async with self.windows.locks[ref.session_id]:
            window = self.windows.turns[ref.session_id]
            _checkpoint = len(window)
            first = self.state[ref.session_id][1] - len(window) * len(payload)
            pruned = list(range(first, first + len(payload))) if len(window) == MAX_TURNS else []
            await self.pool.run(self._write, ref, payload, pruned)
            window.append(payload)
        return True

    async def read_windows(self, session_ids: Sequence[str]) -> dict[str, list[Tag]]:
        assert self.conn is not None
        return _read_tags(self.conn, OURS_SQL["read"], session_ids)

    async def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        if self.conn is not None:
            self.conn.close()


OURS_SQL = {
    "claim": (
        "INSERT INTO chatflow_processed_messages (message_id, processed_at) VALUES (?, ?) "
        "ON CONFLICT (message_id) DO UPDATE SET processed_at = excluded.processed_at "
        "WHERE chatflow_processed_messages.processed_at < ? RETURNING message_id"
    ),
    "version": "SELECT version FROM chatflow_sessions WHERE session_id = ?",
    "create": (
        "INSERT INTO chatflow_sessions (session_id, active_agent_name, metadata_json, version, "
        "created_at, updated_at) VALUES (?, ?, '{}', 0, ?, ?) ON CONFLICT DO NOTHING"
    ),
    "bump": (
        "UPDATE chatflow_sessions SET version = ?, updated_at = ? "
        "WHERE session_id = ? AND version = ?"
    ),
    "delete": "DELETE FROM chatflow_messages WHERE session_id = ? AND seq = ?",
    "insert": (
        "INSERT INTO chatflow_messages (session_id, seq, role, content, message_json, "
        "created_at) VALUES (?, ?, ?, ?, ?, ?)"
    ),
    "read": "SELECT message_json FROM chatflow_messages WHERE session_id = ? ORDER BY seq",
}
"""The SQL ``ours-sqlite`` sends per turn (as its dialect compiles it), by hand."""


class RawSQLiteMemory(RawSQLite):
    """stdlib ``sqlite3`` on ``:memory:``."""

    name = "raw-sqlite-mem"
    backend = "sqlite-memory"
    ephemeral = True
    multiprocess = False
    database = ":memory:"


class RawPostgres(_TransactionPerTurn):
    """``psycopg`` 3, one connection: claim, then upsert + insert + prune pipelined, commit."""

    name = "raw-pg"
    backend = "postgres"
    multiprocess = True
    floor = True

    def __init__(self, target: Target) -> None:
        super().__init__(target)
        self.windows = _Windows()
        self.conn: Any = None
        self.sql = {key: _sql(value, "%s") for key, value in _TEMPLATES.items()}

    @staticmethod
    def _connect(target: Target) -> Any:
        import psycopg

        return psycopg.connect(
            libpq_url(target.pg_url or ""), **schema_connect_args(target.schema or "public")
        )

    @classmethod
    def prepare(cls, target: Target) -> None:
        with cls._connect(target) as conn:
            for statement in PG_DDL:
                conn.execute(statement)

    async def open(self) -> None:
        self.conn = self._connect(self.target)

    def payload(self, ref: TurnRef) -> list[Message]:
        return build_messages(ref.session_id, ref.turn)

    def _write(self, ref: TurnRef, payload: list[Message]) -> bool:
        conn, sql = self.conn, self.sql
        now = datetime.now(timezone.utc)
        try:
            with conn.cursor() as cur:
                cur.execute(sql["claim"], (ref.webhook_id, now, now - TTL))
                if cur.fetchone() is None:
                    conn.rollback()
                    return False
                sid = ref.session_id
                with conn.pipeline():
                    cur.execute(sql["upsert"], (sid, "Support", now, now))
                    cur.executemany(sql["insert"], _rows(sid, payload, now))
                    cur.execute(sql["prune"], (sid, sid))
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
        return True

    async def read_windows(self, session_ids: Sequence[str]) -> dict[str, list[Tag]]:
        windows: dict[str, list[Tag]] = {}
        for sid in session_ids:
            rows = self.conn.execute(self.sql["read"], (sid,)).fetchall()
            windows[sid] = [message_tag(Message.model_validate_json(row[0])) for row in rows]
        self.conn.rollback()
        return windows

    async def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


LEASE = timedelta(seconds=30)
"""The claim's and the session's lease (the store's default ``turn_lease_seconds``)."""
RETAKE_BACKOFF = (0.001, 0.05)
"""First and longest pause between two tries of a waiting claim for the session's lease."""

CLAIM_DDL = (
    "CREATE SEQUENCE IF NOT EXISTS lease_tickets",
    """CREATE TABLE IF NOT EXISTS lease_sessions (
        session_id VARCHAR(255) PRIMARY KEY, active_agent_name VARCHAR(255) NOT NULL,
        metadata_json JSONB NOT NULL DEFAULT '{}', version BIGINT NOT NULL DEFAULT 0,
        lease_owner VARCHAR(64), lease_fence BIGINT NOT NULL DEFAULT 0,
        lease_expires_at TIMESTAMPTZ, created_at TIMESTAMPTZ, updated_at TIMESTAMPTZ)""",
    """CREATE TABLE IF NOT EXISTS lease_messages (
        session_id VARCHAR(255) NOT NULL
            REFERENCES lease_sessions(session_id) ON DELETE CASCADE,
        seq BIGINT NOT NULL, role VARCHAR(16) NOT NULL, content TEXT,
        message_json TEXT NOT NULL, created_at TIMESTAMPTZ, PRIMARY KEY (session_id, seq))""",
    """CREATE TABLE IF NOT EXISTS lease_claims (
        message_id VARCHAR(255) PRIMARY KEY, session_id VARCHAR(255) NOT NULL,
        ticket BIGINT NOT NULL, state VARCHAR(16) NOT NULL, owner VARCHAR(64),
        fence BIGINT NOT NULL, lease_expires_at TIMESTAMPTZ,
        processed_at TIMESTAMPTZ NOT NULL, response TEXT)""",
    "CREATE INDEX IF NOT EXISTS ix_lease_claims_in_flight "
    "ON lease_claims (session_id, ticket) WHERE state = 'in_flight'",
)

_ACQUIRE_CLAIM = """
    INSERT INTO lease_claims AS c (message_id, session_id, ticket, state, owner, fence,
                                   lease_expires_at, processed_at)
    VALUES (%(mid)s, %(sid)s, nextval('lease_tickets'), 'in_flight', %(owner)s, 1,
            now() + %(lease)s, now())
    ON CONFLICT (message_id) DO UPDATE SET
        ticket = CASE WHEN c.state = 'in_flight' THEN c.ticket ELSE excluded.ticket END,
        state = 'in_flight', owner = excluded.owner, fence = c.fence + 1,
        lease_expires_at = excluded.lease_expires_at, processed_at = excluded.processed_at,
        response = NULL
    WHERE (c.state = 'in_flight' AND c.lease_expires_at < now())
       OR c.processed_at < now() - %(ttl)s
    RETURNING c.ticket, c.fence"""
"""Take the claim: a fresh id, an expired in-flight claim (fence + 1), or an id past the TTL."""

_RENEW_CLAIM = """
    UPDATE lease_claims SET lease_expires_at = now() + %(lease)s
    WHERE message_id = %(mid)s AND fence = %(fence)s AND state = 'in_flight'
    RETURNING ticket, fence"""
"""A waiting claim's next try: still ours (fence), its lease renewed."""

_LEASE_AND_CATCH_UP = """
), earlier AS (
    SELECT EXISTS (
        SELECT 1 FROM lease_claims e, claim a
        WHERE e.session_id = %(sid)s AND e.state = 'in_flight' AND e.ticket < a.ticket
          AND e.lease_expires_at >= now()) AS waits
), leased AS (
    INSERT INTO lease_sessions AS s (session_id, active_agent_name, lease_owner, lease_fence,
                                     lease_expires_at, created_at, updated_at)
    SELECT %(sid)s, %(agent)s, %(owner)s, 1, now() + %(lease)s, now(), now()
    FROM claim WHERE NOT (SELECT waits FROM earlier)
    ON CONFLICT (session_id) DO UPDATE SET
        lease_owner = excluded.lease_owner, lease_fence = s.lease_fence + 1,
        lease_expires_at = excluded.lease_expires_at
    WHERE s.lease_owner IS NULL OR s.lease_expires_at < now()
    RETURNING s.version, s.lease_fence
), seen AS (
    SELECT coalesce((SELECT version FROM lease_sessions WHERE session_id = %(sid)s), 0)
        AS version
)
SELECT a.fence, l.lease_fence, l.version, (SELECT version FROM seen),
       ARRAY(SELECT m.seq FROM lease_messages m WHERE m.session_id = %(sid)s
             AND (SELECT version FROM seen) IS DISTINCT FROM %(known)s ORDER BY m.seq),
       ARRAY(SELECT m.message_json FROM lease_messages m WHERE m.session_id = %(sid)s
             AND (SELECT version FROM seen) IS DISTINCT FROM %(known)s ORDER BY m.seq)
FROM claim a LEFT JOIN leased l ON true"""
"""After the claim: wait for an earlier live claim of the session, else take the session's
lease (creating the session), and read its history when the session moved since ``known``.

The history is read in the statement's snapshot; the lease's version is the newest
committed (the upsert waits for a writer): when they differ the caller reads again."""

CLAIM_SQL = {
    "acquire": f"WITH claim AS ({_ACQUIRE_CLAIM}{_LEASE_AND_CATCH_UP}",
    "retake": f"WITH claim AS ({_RENEW_CLAIM}{_LEASE_AND_CATCH_UP}",
    "history": "SELECT seq, message_json FROM lease_messages WHERE session_id = %(sid)s "
               "ORDER BY seq",
    "write": """
WITH claim AS (
    SELECT 1 FROM lease_claims
    WHERE message_id = %(mid)s AND fence = %(fence)s AND state = 'in_flight' FOR UPDATE
), written AS (
    UPDATE lease_sessions SET version = version + 1, updated_at = now(),
        lease_owner = NULL, lease_expires_at = NULL
    WHERE session_id = %(sid)s AND version = %(version)s AND lease_fence = %(lease_fence)s
      AND lease_owner = %(owner)s AND EXISTS (SELECT 1 FROM claim)
    RETURNING version
), done AS (
    UPDATE lease_claims SET state = 'done', response = %(reply)s, processed_at = now(),
        lease_expires_at = NULL
    WHERE message_id = %(mid)s AND EXISTS (SELECT 1 FROM written)
), pruned AS (
    DELETE FROM lease_messages
    WHERE session_id = %(sid)s AND seq < %(keep)s AND EXISTS (SELECT 1 FROM written)
), appended AS (
    INSERT INTO lease_messages (session_id, seq, role, content, message_json, created_at)
    SELECT %(sid)s, t.seq, t.role, t.content, t.message_json, now()
    FROM unnest(%(seqs)s::bigint[], %(roles)s::text[], %(contents)s::text[],
                %(jsons)s::text[]) AS t(seq, role, content, message_json)
    WHERE EXISTS (SELECT 1 FROM written)
)
SELECT version FROM written""",
    "read": "SELECT message_json FROM lease_messages WHERE session_id = %s ORDER BY seq",
}
"""The floor's SQL: ``acquire`` and ``write`` per turn; ``retake`` only while a claim
waits for the session, ``history`` only when a writer committed in between."""


@dataclass
class _Session:
    """What the floor knows of one session: its version and window (first seq, messages)."""

    version: int | None = None
    next_seq: int = 1
    turns: deque[tuple[int, list[Message]]] = field(
        default_factory=lambda: deque(maxlen=MAX_TURNS)
    )

    def load(self, version: int, seqs: Sequence[int], jsons: Sequence[str]) -> None:
        """Replace the window by the stored one (a turn starts at each user message)."""
        self.version, self.turns = version, deque(maxlen=MAX_TURNS)
        for seq, raw in zip(seqs, jsons, strict=True):
            message = Message.model_validate_json(raw)
            if message.role == Role.USER or not self.turns:
                self.turns.append((seq, []))
            self.turns[-1][1].append(message)
        self.next_seq = seqs[-1] + 1 if seqs else self.next_seq


class LeaseLostError(RuntimeError):
    """The claim or the session's lease was taken over: the turn wrote nothing."""


@dataclass(frozen=True)
class _Held:
    """A turn's claim fence, session lease fence and the session version it expects."""

    fence: int
    lease_fence: int
    version: int


class RawPostgresClaim(Adapter):
    """``psycopg`` 3 in autocommit: a claimed turn with the store's guarantees, 2 statements.

    (1) ``acquire``: the claim with its lease and fencing token (taking over an
    expired one), the check for an earlier live claim of the session by
    ticket, the session's lease and the catch-up read of its history when it
    moved; (2) ``write``: the claim's fence and the session's version checked,
    the turn appended, the window pruned, the claim done with its reply and
    the lease released. Lease times are the database's clock. A claim that
    finds the session busy retries (``retake``) with backoff. No lease is
    renewed during a turn: the workload's turns are far shorter than a lease.
    """

    name = "raw-pg-claim"
    backend = "postgres"
    multiprocess = True

    def __init__(self, target: Target) -> None:
        super().__init__(target)
        self.conn: Any = None
        self.owner = uuid.uuid4().hex
        self.sessions: defaultdict[str, _Session] = defaultdict(_Session)
        self.locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    @staticmethod
    def _connect(target: Target) -> Any:
        import psycopg

        return psycopg.connect(libpq_url(target.pg_url or ""), autocommit=True,
                               **schema_connect_args(target.schema or "public"))

    @classmethod
    def prepare(cls, target: Target) -> None:
        with cls._connect(target) as conn:
            for statement in CLAIM_DDL:
                conn.execute(statement)

    async def open(self) -> None:
        self.conn = self._connect(self.target)

    def payload(self, ref: TurnRef) -> list[Message]:
        return build_messages(ref.session_id, ref.turn)

    async def turn(self, ref: TurnRef, payload: list[Message]) -> bool:
        async with self.locks[ref.session_id]:
            held = await self._acquire(ref)
            if held is None:
                return False
            self._write(ref, payload, held)
        return True

    def _params(self, ref: TurnRef, **more: Any) -> dict[str, Any]:
        return {"mid": ref.webhook_id, "sid": ref.session_id, "owner": self.owner,
                "lease": LEASE, "agent": "Support",
                "known": self.sessions[ref.session_id].version, **more}

    async def _acquire(self, ref: TurnRef) -> _Held | None:
        """Statement (1); while the session is busy, ``retake`` with backoff."""
        row = self.conn.execute(CLAIM_SQL["acquire"], self._params(ref, ttl=TTL)).fetchone()
        if row is None:
            return None  # a duplicate: done, or live in flight elsewhere
        pause = RETAKE_BACKOFF[0]
        while row[1] is None:
            await asyncio.sleep(pause)
            pause = min(pause * 2, RETAKE_BACKOFF[1])
            row = self.conn.execute(CLAIM_SQL["retake"],
                                    self._params(ref, fence=row[0])).fetchone()
            if row is None:
                raise LeaseLostError(f"{ref.webhook_id}: claim taken over while waiting")
        fence, lease_fence, version, seen, seqs, jsons = row
        state = self.sessions[ref.session_id]
        if version != seen:  # a writer committed after the statement's snapshot
            stored = self.conn.execute(CLAIM_SQL["history"], {"sid": ref.session_id}).fetchall()
            seqs, jsons = [r[0] for r in stored], [r[1] for r in stored]
        if version != state.version:
            state.load(version, seqs, jsons)
        return _Held(fence, lease_fence, version)

    def _write(self, ref: TurnRef, payload: list[Message], held: _Held) -> None:
        """Statement (2): fenced compare-and-swap, append, prune, claim done, lease released."""
        state = self.sessions[ref.session_id]
        first = state.next_seq
        seqs = list(range(first, first + len(payload)))
        kept = [*state.turns, (first, payload)][-MAX_TURNS:]
        row = self.conn.execute(CLAIM_SQL["write"], self._params(
            ref, fence=held.fence, version=held.version, lease_fence=held.lease_fence,
            reply=payload[-1].content, keep=kept[0][0], seqs=seqs,
            roles=[m.role.value for m in payload], contents=[m.content for m in payload],
            jsons=[m.model_dump_json() for m in payload],
        )).fetchone()
        if row is None:
            state.version = None  # read the session again next time
            raise LeaseLostError(f"{ref.webhook_id}: fence or version moved; nothing written")
        state.version, state.next_seq = row[0], first + len(payload)
        state.turns.append((first, payload))

    async def read_windows(self, session_ids: Sequence[str]) -> dict[str, list[Tag]]:
        return {sid: [message_tag(Message.model_validate_json(r[0]))
                      for r in self.conn.execute(CLAIM_SQL["read"], (sid,))]
                for sid in session_ids}

    async def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


class RawMemory(Adapter):
    """Plain dicts: a claimed-id dict with TTL, a deque of turns and an asyncio.Lock per session."""

    name = "raw-memory"
    backend = "memory"
    ephemeral = True
    floor = True

    def __init__(self, target: Target) -> None:
        super().__init__(target)
        self.windows = _Windows()
        self.claimed: dict[str, float] = {}
        self.ttl = TTL.total_seconds()

    async def open(self) -> None:
        """Nothing to open."""

    def payload(self, ref: TurnRef) -> list[Message]:
        return build_messages(ref.session_id, ref.turn)

    async def turn(self, ref: TurnRef, payload: list[Message]) -> bool:
        now = time.monotonic()
        stamp = self.claimed.get(ref.webhook_id)
        if stamp is not None and now - stamp <= self.ttl:
            return False
        self.claimed[ref.webhook_id] = now
        async with self.windows.locks[ref.session_id]:
            window = self.windows.turns[ref.session_id]
            _checkpoint = len(window)
            window.append(payload)
        return True

    async def read_windows(self, session_ids: Sequence[str]) -> dict[str, list[Tag]]:
        return {
            sid: [message_tag(m) for turn in self.windows.turns[sid] for m in turn]
            for sid in session_ids
        }


_TEMPLATES = {
    "claim": CLAIM,
    "upsert": UPSERT_SESSION,
    "insert": INSERT_MESSAGE,
    "prune": PRUNE,
    "read": READ,
}
