"""A stand-in for Meta's Graph API on loopback, for the WhatsApp channel's sends.

It answers ``POST /{version}/{phone-number-id}/messages`` as the Cloud API
does (200 with a message id) and records every request, so a test can count
what reached "WhatsApp": replies delivered exactly once, chunks in order.
Statuses given to :meth:`FakeGraphAPI.answer_next` are used first (a 500, a
429 with ``Retry-After: 0``, :data:`DROP`), one per request. No network: it binds
127.0.0.1 on a free port, in a thread of the test process.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HANG_GUARD = 60.0
DROP = 0
"""A status for :meth:`FakeGraphAPI.answer_next`: read the request, hang up without answering."""


@dataclass(frozen=True)
class GraphRequest:
    """One request the fake received, and the status it answered."""

    path: str
    authorization: str
    body: dict[str, Any]
    status: int

    @property
    def to(self) -> str:
        return str(self.body.get("to"))

    @property
    def text(self) -> str:
        return str(self.body.get("text", {}).get("body"))


class FakeGraphAPI:
    """The Graph API's messages endpoint on ``self.url`` (``with`` stops it)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._script: list[int] = []
        self.requests: list[GraphRequest] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                status = fake._answer(self.path, self.headers.get("Authorization", ""), body)
                if status == DROP:
                    self.close_connection = True  # hang up without an answer
                    return
                payload = (
                    {"messaging_product": "whatsapp",
                     "messages": [{"id": f"wamid.out.{len(fake.requests)}"}]}
                    if status < 400 else {"error": {"code": status, "message": "scripted"}}
                )
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status == 429:
                    self.send_header("Retry-After", "0")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def answer_next(self, *statuses: int) -> None:
        """Answer the next requests with these statuses, in order (then 200 again)."""
        with self._lock:
            self._script.extend(statuses)

    def _answer(self, path: str, authorization: str, body: dict[str, Any]) -> int:
        with self._lock:
            status = self._script.pop(0) if self._script else 200
            self.requests.append(GraphRequest(path, authorization, body, status))
            self._lock.notify_all()
            return status

    def delivered(self) -> list[GraphRequest]:
        """The requests answered with success, in arrival order."""
        with self._lock:
            return [r for r in self.requests if 0 < r.status < 400]

    def wait_delivered(self, count: int, timeout: float = HANG_GUARD) -> list[GraphRequest]:
        """Wait until ``count`` requests were answered with success; return them all."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                done = [r for r in self.requests if 0 < r.status < 400]
                if len(done) >= count:
                    return done
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"the fake Graph API got {len(done)} of {count} replies in {timeout:g} s: "
                        f"{self.requests!r}"
                    )
                self._lock.wait(left)

    async def until_delivered(self, count: int, timeout: float = HANG_GUARD) -> list[GraphRequest]:
        """:meth:`wait_delivered` for a test whose event loop runs the workers (it polls)."""
        import asyncio

        deadline = time.monotonic() + timeout
        while len(done := self.delivered()) < count:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the fake Graph API got {len(done)} of {count} replies in {timeout:g} s: "
                    f"{self.requests!r}"
                )
            await asyncio.sleep(0.02)
        return done

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(HANG_GUARD)

    def __enter__(self) -> FakeGraphAPI:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
