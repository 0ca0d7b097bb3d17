"""A TCP fault proxy for PostgreSQL tests: pass-through, delay, black hole, cuts at COMMIT.

Runs in threads on a loopback port of its own, in front of one upstream
``host:port``. Its mode can change at any time and applies to live
connections at once::

    with FaultProxy("127.0.0.1", 5432) as proxy:
        store = PostgresSessionStore(proxy.url(pg_url))
        proxy.set_mode(Mode.BLACK_HOLE)

Modes:

* ``PASS``: bytes are relayed unchanged.
* ``DELAY``: every chunk waits ``delay_ms`` before it is relayed, each way.
* ``BLACK_HOLE``: connections are accepted and kept open, nothing is relayed
  either way (what is received is read and dropped), not even a close: a
  side that closes its socket is not seen to do so by the other until the
  mode changes, as in a network partition. New connections are accepted
  too and never reach the server. Note the proxy's kernel still
  acknowledges every segment, so the client's TCP keepalives and
  ``tcp_user_timeout`` never fire; only application-level or server-side
  bounds end the wait.
* ``CUT_BEFORE_COMMIT``: the client-to-server stream is parsed as the
  PostgreSQL frontend protocol; when a ``Query`` or ``Parse`` message whose
  SQL is ``COMMIT`` arrives, the connection is cut (both sockets closed)
  without forwarding it, so the server rolls the transaction back. The
  store's one-statement write on PostgreSQL (``WITH ... swapped AS
  (UPDATE ...``, sent in autocommit) commits by itself and counts as a
  ``COMMIT`` here.
* ``CUT_AFTER_COMMIT``: that ``COMMIT`` (and what follows it in the same
  read, e.g. the ``Sync`` of a pipeline) is forwarded, nothing the server
  says after it is relayed, and the connection is cut once the server
  answered (or after ``reply_wait`` seconds): the transaction committed but
  the client never learns it.

Counting (any mode that relays): :attr:`FaultProxy.counts` holds, over every
connection, ``round_trips`` (times a client sent after the server had
answered: one per request/response exchange, however many messages a
pipeline packs into it), ``syncs`` (``Sync`` and simple ``Query`` messages:
each ends in a ``ReadyForQuery``) and ``commits`` (``COMMIT`` sent as a
``Query`` or ``Parse``). :meth:`FaultProxy.reset_counts` zeroes them.

Each cut is counted in :attr:`FaultProxy.cuts`; ``cut_limit`` makes a cut
mode one-shot (or n-shot) after which the proxy passes through again.
Reusable by any test that needs a misbehaving network in front of a server
(a latency benchmark, PgBouncer behind it).
"""

from __future__ import annotations

import contextlib
import enum
import re
import select
import socket
import struct
import threading
import time
from types import TracebackType

from sqlalchemy import URL, make_url

__all__ = ["FaultProxy", "Mode"]

_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104
_CANCEL_REQUEST = 80877102
_POLL = 0.05
"""Seconds a pump waits on its socket before looking at the proxy's state again.

Sockets stay in blocking mode and reads wait in ``select()``: toggling a
socket's timeout while the other pump uses it makes reads fail spuriously."""


class Mode(str, enum.Enum):
    """What the proxy does with the traffic (see the module docstring)."""

    PASS = "pass"
    DELAY = "delay"
    BLACK_HOLE = "black-hole"
    CUT_BEFORE_COMMIT = "cut-before-commit"
    CUT_AFTER_COMMIT = "cut-after-commit"


class _FrontendParser:
    """Splits the client's byte stream into PostgreSQL frontend messages."""

    def __init__(self) -> None:
        self._buffer = b""
        self._startup = True  # untyped messages until the StartupMessage went by

    def feed(self, data: bytes) -> list[bytes]:
        """Append ``data``; return the complete messages it finished, in order."""
        self._buffer += data
        messages: list[bytes] = []
        while True:
            message = self._next()
            if message is None:
                return messages
            messages.append(message)

    def rest(self) -> bytes:
        """Bytes of an incomplete message still held."""
        return self._buffer

    def _next(self) -> bytes | None:
        buffer = self._buffer
        if self._startup:
            if len(buffer) < 8:
                return None
            length, code = struct.unpack("!ii", buffer[:8])
            if len(buffer) < length:
                return None
            if code not in (_SSL_REQUEST, _GSSENC_REQUEST):
                self._startup = False  # StartupMessage (or CancelRequest): typed from now on
            self._buffer = buffer[length:]
            return buffer[:length]
        if len(buffer) < 5:
            return None
        length = struct.unpack("!i", buffer[1:5])[0]
        if len(buffer) < 1 + length:
            return None
        self._buffer = buffer[1 + length:]
        return buffer[: 1 + length]


_AUTOCOMMIT_WRITE = re.compile(r"^WITH\b.*\bswapped AS\s*\(UPDATE chatflow_sessions\b", re.S)
"""The store's one-statement write (``backends/postgresql_write.py``): it commits itself."""


def is_commit(message: bytes) -> bool:
    """True for a ``Query`` or ``Parse`` message whose SQL commits (see the module docstring)."""
    if not message or message[:1] not in (b"Q", b"P"):
        return False
    body = message[5:]
    if message[:1] == b"P":
        body = body[body.index(b"\0") + 1:]  # skip the statement name
    sql = body.split(b"\0", 1)[0].decode("utf-8", "replace")
    statement = sql.strip().rstrip(";").strip()
    if statement.upper() in ("COMMIT", "COMMIT TRANSACTION", "END"):
        return True
    return _AUTOCOMMIT_WRITE.match(statement) is not None


class _Link:
    """One client connection and its upstream connection, pumped by two threads."""

    def __init__(self, proxy: FaultProxy, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.server: socket.socket | None = None
        self.closed = threading.Event()
        self.drop_replies = threading.Event()
        self.replied_after_commit = threading.Event()
        self._close_lock = threading.Lock()
        self.server_answered = True
        """The server sent something since the client last did (the next send is a new trip)."""

    def start(self) -> None:
        threading.Thread(target=self._run, name="faultproxy-link", daemon=True).start()

    def _run(self) -> None:
        try:
            while self.proxy.mode is Mode.BLACK_HOLE and not self.closed.is_set():
                self._drain(self.client)  # a black-holed newcomer never reaches the server
            if self.closed.is_set():
                return
            self.server = socket.create_connection(self.proxy.upstream, timeout=10)
            self.server.settimeout(None)  # blocking sockets; reads wait in select()
            for sock in (self.client, self.server):
                # As libpq and the server do: without it Nagle holds a small write back
                # until the previous one is acknowledged (up to 40 ms of delayed ACK).
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            self.close()
            return
        back = threading.Thread(target=self._server_to_client, name="faultproxy-s2c", daemon=True)
        back.start()
        self._client_to_server()
        back.join()

    def _drain(self, sock: socket.socket) -> bytes | None:
        """Read what is there (dropped by the caller if it wants); None at EOF/error.

        At EOF the link is closed, except in a black hole: there the other side
        must not learn it (a partition carries no FIN either), so the link stays
        open until the mode changes.
        """
        try:
            ready, _, _ = select.select([sock], [], [], _POLL)
            if not ready:
                return b""
            data = sock.recv(65536)
        except (OSError, ValueError):  # ValueError: closed by the other pump meanwhile
            data = b""
        if data:
            return data
        while self.proxy.mode is Mode.BLACK_HOLE and not self.closed.is_set():
            time.sleep(_POLL)
        self.close()
        return None

    def _client_to_server(self) -> None:
        parser = _FrontendParser()
        assert self.server is not None
        while not self.closed.is_set():
            data = self._drain(self.client)
            if data is None:
                return
            if not data:
                continue
            mode = self.proxy.mode
            if mode is Mode.BLACK_HOLE:
                continue
            if mode is Mode.DELAY:
                time.sleep(self.proxy.delay_ms / 1000)
            if mode in (Mode.CUT_BEFORE_COMMIT, Mode.CUT_AFTER_COMMIT):
                if self._forward_until_commit(parser, data, mode):
                    return
                continue
            self._count(parser.feed(data))  # the parser also stays in step for a cut mode
            if not self._send(self.server, data):
                return

    def _count(self, messages: list[bytes]) -> None:
        trip = self.server_answered and bool(messages)
        if trip:
            self.server_answered = False
        self.proxy._add_counts(
            round_trips=int(trip),
            syncs=sum(1 for m in messages if m[:1] in (b"S", b"Q")),
            commits=sum(1 for m in messages if is_commit(m)),
        )

    def _forward_until_commit(self, parser: _FrontendParser, data: bytes, mode: Mode) -> bool:
        """Relay ``data`` message by message; act on a COMMIT. True when the link was cut."""
        assert self.server is not None
        messages = parser.feed(data)
        for index, message in enumerate(messages):
            if not is_commit(message) or not self.proxy._take_cut():
                continue
            before = b"".join(messages[:index])
            if mode is Mode.CUT_BEFORE_COMMIT:
                self._send(self.server, before)
                self.close()
                return True
            self.drop_replies.set()
            self._send(self.server, before + b"".join(messages[index:]) + parser.rest())
            self.replied_after_commit.wait(self.proxy.reply_wait)
            self.close()
            return True
        self._send(self.server, b"".join(messages))
        return False

    def _server_to_client(self) -> None:
        assert self.server is not None
        while not self.closed.is_set():
            data = self._drain(self.server)
            if data is None:
                return
            if not data:
                continue
            self.server_answered = True
            if self.drop_replies.is_set():
                self.replied_after_commit.set()
                continue
            mode = self.proxy.mode
            if mode is Mode.BLACK_HOLE:
                continue
            if mode is Mode.DELAY:
                time.sleep(self.proxy.delay_ms / 1000)
            if not self._send(self.client, data):
                return

    def _send(self, sock: socket.socket, data: bytes) -> bool:
        if not data:
            return True
        try:
            sock.sendall(data)
        except OSError:
            self.close()
            return False
        return True

    def close(self) -> None:
        with self._close_lock:
            if self.closed.is_set():
                return
            self.closed.set()
        for sock in (self.client, self.server):
            if sock is None:
                continue
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self.proxy._forget(self)


class FaultProxy:
    """A loopback TCP proxy in front of ``upstream_host:upstream_port`` (see module docs).

    Args:
        upstream_host: Server host.
        upstream_port: Server port.
        mode: Initial mode.
        delay_ms: Delay of each relayed chunk in :attr:`Mode.DELAY`.

    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        mode: Mode = Mode.PASS,
        delay_ms: float = 0.0,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.mode = mode
        self.delay_ms = delay_ms
        self.reply_wait = 5.0
        """Seconds a cut-after-commit waits for the server's answer before cutting anyway."""
        self.cuts = 0
        """Connections cut at a COMMIT so far."""
        self.cut_limit: int | None = None
        """Cuts left before a cut mode passes through (None: cut every COMMIT)."""
        self.counts = {"round_trips": 0, "syncs": 0, "commits": 0}
        """Frontend traffic relayed so far (see the module docstring)."""
        self._links: set[_Link] = set()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL)
        self.host, self.port = self._listener.getsockname()[:2]
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="faultproxy", daemon=True)

    @classmethod
    def for_url(cls, url: str | URL, **kwargs: object) -> FaultProxy:
        """A proxy in front of the server of a database URL."""
        parsed = make_url(url)
        return cls(parsed.host or "127.0.0.1", parsed.port or 5432, **kwargs)  # type: ignore[arg-type]

    def url(self, url: str | URL) -> str:
        """``url`` pointed at the proxy (same user, password, database, query)."""
        return make_url(url).set(host=self.host, port=self.port).render_as_string(
            hide_password=False
        )

    def set_mode(
        self, mode: Mode, *, delay_ms: float | None = None, cuts: int | None = None
    ) -> None:
        """Switch mode (live connections included); ``cuts`` limits a cut mode's cuts."""
        if delay_ms is not None:
            self.delay_ms = delay_ms
        with self._lock:
            self.cut_limit = cuts
        self.mode = mode

    def reset_counts(self) -> dict[str, int]:
        """Zero :attr:`counts`; return what they were."""
        with self._lock:
            before, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        return before

    def _add_counts(self, **deltas: int) -> None:
        with self._lock:
            for key, delta in deltas.items():
                self.counts[key] += delta

    def _take_cut(self) -> bool:
        with self._lock:
            if self.cut_limit is not None:
                if self.cut_limit <= 0:
                    return False
                self.cut_limit -= 1
            self.cuts += 1
            return True

    @property
    def connections(self) -> int:
        """Client connections open through the proxy now."""
        with self._lock:
            return len(self._links)

    def cut_all(self) -> None:
        """Close every open connection now (both sides), as a crashed middlebox would."""
        with self._lock:
            links = list(self._links)
        for link in links:
            link.close()

    def start(self) -> FaultProxy:
        """Start accepting; returns the proxy."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting and close every connection."""
        self._stopping.set()
        self._thread.join(timeout=5)
        self._listener.close()
        self.cut_all()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            link = _Link(self, client)
            with self._lock:
                self._links.add(link)
            link.start()

    def _forget(self, link: _Link) -> None:
        with self._lock:
            self._links.discard(link)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
