"""chatflow-agent's WhatsApp channel on the durable inbox: nothing lost after the 200.

Upstream's ``WhatsAppChannel`` records a message id, answers 200 and runs the
turn in a background task, so a crash loses the turn for good.
:class:`DurableWhatsAppChannel` keeps all of it but that step: its webhook
puts each message into ``store.inbox`` before answering 200 (503 if a put
fails, so Meta delivers again), and its workers answer the inbox through the
channel's runner and upstream's sender. The guide (docs/webhooks.md) says
which sends are retried and how media and failed turns are answered.

chatflow-agent has no public hook for the dispatch step, so the private names
of upstream this module uses are all in the "upstream seams" section below,
each checked on the installed version by ``tests/test_durable_whatsapp.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import signal
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from chatflow_agent.channels.base import split_message
from chatflow_agent.channels.whatsapp import WhatsAppChannel
from fastapi import BackgroundTasks, FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from chatflow_sqlalchemy.inbox import (
    Inbox,
    InboxBatch,
    InboxReply,
    check_serve_options,
    parse_sent_at,
)

__all__ = ["WHATSAPP_TEXT_LIMIT", "DurableWhatsAppChannel", "GraphAPIError"]

logger = logging.getLogger("chatflow_sqlalchemy")

WHATSAPP_TEXT_LIMIT = 4096
"""The longest text body WhatsApp accepts: longer replies go out in chunks, as upstream's."""

GRAPH_API_HOST = "graph.facebook.com"  # what graph_api_url replaces (and only it)
_PROGRESS_KEPT = 1024  # replies whose partial send is remembered, so a retry resumes
_UPGRADE = ("this version of chatflow-sqlalchemy does not support the installed chatflow-agent; "
            "install chatflow-agent>=0.3.4,<0.4")


class GraphAPIError(RuntimeError):
    """A reply did not reach the Graph API, and sending it again is safe: the inbox retries."""


class _InboxStore(Protocol):
    """A chatflow-sqlalchemy store: it has ``store.inbox``."""

    inbox: Inbox


# ------------------------------------------------------------------ upstream seams
# Everything of upstream's WhatsAppChannel used here that is not public.

# Set while upstream's webhook runs for us: _extract_messages puts the checked payload here.
_CAPTURE: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "chatflow_whatsapp_capture", default=None
)


def _take_upstream_webhook(app: FastAPI) -> Callable[..., Awaitable[Response]]:
    """Remove upstream's ``POST /webhook`` route; return its endpoint."""
    for route in list(app.router.routes):
        if isinstance(route, APIRoute) and route.path == "/webhook" and "POST" in (
            route.methods or ()
        ):
            app.router.routes.remove(route)
            endpoint: Callable[..., Awaitable[Response]] = route.endpoint
            return endpoint
    raise RuntimeError(f"chatflow-agent's WhatsAppChannel has no POST /webhook: {_UPGRADE}")


def _upstream_extract(
    channel: WhatsAppChannel, payload: dict[str, Any]
) -> list[tuple[str, str, str | None]]:
    """Upstream's ``(wamid, sender_phone, text or None)`` of each message of a payload."""
    messages: list[tuple[str, str, str | None]] = WhatsAppChannel._extract_messages(
        channel, payload
    )
    return messages


async def _upstream_send_chunk(channel: WhatsAppChannel, phone: str, text: str) -> None:
    """Upstream's send of one chunk: its 429 and connect retries, its 24-hour window hook."""
    await WhatsAppChannel._send_single_outbound_whatsapp(channel, to_phone=phone, text=text)


def _install_httpx(channel: WhatsAppChannel, module: Any) -> None:
    """Make upstream build its HTTP clients from ``module`` instead of httpx."""
    channel._httpx = module


# ------------------------------------------------------------------ observing a send
@dataclass
class _Outcome:
    """What became of one chunk's send, as the HTTP client saw it (its last request)."""

    requests: int = 0
    went_out: bool = False
    status: int | None = None

    def started(self) -> None:
        self.requests += 1
        self.went_out = False
        self.status = None

    async def trace(self, name: str, info: Mapping[str, Any]) -> None:
        """The ``trace`` extension of httpcore: note when the request begins to go out."""
        if name.endswith(".send_request_headers.started"):
            self.went_out = True

    def problem(self) -> str | None:
        """Why the chunk must be sent again; None if it arrived or sending again is unsafe."""
        if self.requests == 0:
            return "no request was made"
        if self.status is None:
            return None if self.went_out else "could not connect to the Graph API"
        if self.status == 429 or self.status >= 500:
            return f"the Graph API answered HTTP {self.status}"
        return None


_OUTCOME: contextvars.ContextVar[_Outcome | None] = contextvars.ContextVar(
    "chatflow_whatsapp_outcome", default=None
)


class _ObservedHttpx:
    """httpx as upstream uses it, whose clients report to the running send (and may redirect).

    Every attribute is httpx's; ``AsyncClient`` adds event hooks: the request
    hook points ``graph.facebook.com`` at ``base`` (when set) and records the
    attempt, the response hook records the status. Nothing else of the
    client changes (its transport, proxies from the environment, timeouts).
    """

    def __init__(self, base: httpx.URL | None) -> None:
        self.base = base

    def __getattr__(self, name: str) -> Any:
        return getattr(httpx, name)

    def AsyncClient(self, **kwargs: Any) -> httpx.AsyncClient:
        """An ``httpx.AsyncClient`` with the hooks added to any given."""
        hooks = {key: list(value) for key, value in kwargs.pop("event_hooks", {}).items()}
        hooks.setdefault("request", []).append(self._on_request)
        hooks.setdefault("response", []).append(self._on_response)
        return httpx.AsyncClient(event_hooks=hooks, **kwargs)

    async def _on_request(self, request: httpx.Request) -> None:
        if self.base is not None and request.url.host == GRAPH_API_HOST:
            path = self.base.path.rstrip("/") + request.url.path
            request.url = request.url.copy_with(
                scheme=self.base.scheme, host=self.base.host, port=self.base.port, path=path
            )
            request.headers["Host"] = request.url.netloc.decode("ascii")
        outcome = _OUTCOME.get()
        if outcome is not None:
            outcome.started()
            request.extensions = {**request.extensions, "trace": outcome.trace}

    async def _on_response(self, response: httpx.Response) -> None:
        outcome = _OUTCOME.get()
        if outcome is not None:
            outcome.status = response.status_code


def _graph_base(url: str | None) -> httpx.URL | None:
    if url is None:
        return None
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(
            f"graph_api_url must be an http(s) URL such as 'http://127.0.0.1:8081', got {url!r}"
        )
    return parsed


# ------------------------------------------------------------------ the channel
class DurableWhatsAppChannel(WhatsAppChannel):
    """chatflow-agent's ``WhatsAppChannel`` whose messages go through ``store.inbox``.

    ``channel.app`` is upstream's FastAPI app whose ``POST /webhook`` puts into
    the inbox and whose lifespan runs the workers (``channel.run()``, or any
    ASGI server serving ``channel.app``). The runner must use ``store`` as its
    ``session_store``: its turn then records the reply with the inbox batch.

    Args:
        *args: chatflow-agent's ``WhatsAppChannel`` arguments, unchanged.
        store: The chatflow-sqlalchemy store whose inbox holds the messages.
        graph_api_url: Where to send instead of ``https://graph.facebook.com``
            (e.g. a local stand-in of the Graph API); None sends to Meta.
        in_app_workers: Run the workers in the app's lifespan. False for web
            processes whose workers run elsewhere (:meth:`serve`).
        concurrency: Batches (of distinct phones) answered at once per process.
        coalesce_seconds: Messages of one phone closer than this are one turn.
        max_attempts: Tries of a batch (and of its send) before it is dead.
        retry_seconds: First backoff after a failed turn or send (it doubles).
        **kwargs: chatflow-agent's ``WhatsAppChannel`` keyword arguments.

    Raises:
        TypeError: ``store`` has no durable inbox.
        ValueError: A bad ``graph_api_url`` or worker option.

    """

    def __init__(
        self,
        *args: Any,
        store: _InboxStore,
        graph_api_url: str | None = None,
        in_app_workers: bool = True,
        concurrency: int = 4,
        coalesce_seconds: float = 1.0,
        max_attempts: int = 5,
        retry_seconds: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(getattr(store, "inbox", None), Inbox):
            raise TypeError(
                f"store must be a chatflow-sqlalchemy store (it has store.inbox), got "
                f"{type(store).__name__}; open one with chatflow_sqlalchemy.open_store(url)"
            )
        check_serve_options(concurrency, coalesce_seconds, max_attempts, retry_seconds)
        self.store = store
        self.in_app_workers = in_app_workers
        self.concurrency = concurrency
        self.coalesce_seconds = coalesce_seconds
        self.max_attempts = max_attempts
        self.retry_seconds = retry_seconds
        self._progress: OrderedDict[tuple[str, ...], int] = OrderedDict()
        _install_httpx(self, _ObservedHttpx(_graph_base(graph_api_url)))
        self._upstream_webhook = _take_upstream_webhook(self.app)
        self.app.add_api_route("/webhook", self._receive, methods=["POST"])
        self.app.router.lifespan_context = self._lifespan(self.app.router.lifespan_context)

    def _extract_messages(self, payload: dict[str, Any]) -> list[tuple[str, str, str | None]]:
        """Upstream's extraction; while our webhook runs, capture the checked payload instead.

        Returning nothing makes upstream answer without recording or queueing
        anything; :meth:`_receive` then puts the messages.
        """
        captured = _CAPTURE.get()
        if captured is None:
            return _upstream_extract(self, payload)
        captured.append(payload)
        return []

    async def _receive(self, request: Request) -> Response:
        """``POST /webhook``: upstream's checks, then each message into the inbox, then 200."""
        captured: list[Any] = []
        background = BackgroundTasks()
        reset = _CAPTURE.set(captured)
        try:
            await self._upstream_webhook(request=request, background_tasks=background)
        finally:
            _CAPTURE.reset(reset)
        if background.tasks or len(captured) != 1:
            raise RuntimeError(f"chatflow-agent's webhook gave no payload: {_UPGRADE}")
        payload = captured[0]
        messages = _upstream_extract(self, payload)
        if not messages:
            return JSONResponse(content={"status": "ignored_or_status_update"})
        queued = 0
        raws = _raw_messages(payload, len(messages))
        for (wamid, phone, text), raw in zip(messages, raws, strict=True):
            queued += await self._put(wamid, phone, text, raw)
        return JSONResponse(
            content={"status": "success", "sender": messages[0][1], "messages_queued": queued}
        )

    async def _put(self, wamid: str, phone: str, text: str | None, raw: Mapping[str, Any]) -> bool:
        """Put one message; False for a redelivery or a message no store can hold."""
        marker = {"channel": "whatsapp", "type": str(raw.get("type", "text")),
                  "unsupported": text is None}
        try:
            sent_at = parse_sent_at(raw.get("timestamp"))
        except ValueError:
            sent_at = None
        # No NUL character, no lone surrogate: what every database can hold.
        storable = (text or "").replace("\x00", "").encode("utf-8", "replace").decode("utf-8")
        try:
            return await self.store.inbox.aput(
                wamid, session_id=phone, text=storable, sent_at=sent_at, payload=marker
            )
        except ValueError as exc:  # an id or phone no store can hold: a redelivery would fail too
            logger.error("whatsapp: message %s from %s refused: %s", wamid, _masked(phone), exc)
            return False
        except Exception as exc:
            logger.exception("whatsapp: could not store message %s from %s", wamid,
                             _masked(phone))
            raise HTTPException(
                status_code=503,
                detail="the message could not be stored; deliver it again later",
            ) from exc

    async def serve(self) -> None:
        """Answer the inbox's messages until cancelled: a worker-only process runs this.

        Raises:
            ValueError: No runner is attached, or it does not use ``store``.

        """
        self._check_ready()
        send = self.send if self.access_token and self.phone_number_id else None
        await self.store.inbox.serve(
            self.handle, send=send, concurrency=self.concurrency,
            coalesce_seconds=self.coalesce_seconds, max_attempts=self.max_attempts,
            retry_seconds=self.retry_seconds,
        )

    def run_workers(self) -> None:
        """Run :meth:`serve` until SIGINT or SIGTERM (what ``python -m`` of this package runs)."""
        asyncio.run(_until_signalled(self.serve()))

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Run the workers while the block runs (the app's lifespan uses this).

        Raises:
            ValueError: No runner is attached, or it does not use ``store``.

        """
        self._check_ready()
        task = asyncio.get_running_loop().create_task(self.serve())
        task.add_done_callback(_report_stop)
        try:
            yield
        finally:
            task.cancel()
            await asyncio.wait([task])

    def _lifespan(self, upstream: Callable[[Any], Any]) -> Callable[[Any], Any]:
        @contextlib.asynccontextmanager
        async def lifespan(app: Any) -> AsyncIterator[Any]:
            async with upstream(app) as state, contextlib.AsyncExitStack() as stack:
                if self.in_app_workers:
                    await stack.enter_async_context(self.running())
                yield state

        return lifespan

    def _check_ready(self) -> None:
        if self.runner is None:
            raise ValueError(
                "no runner is attached to the channel: call channel.attach(runner) first"
            )
        if getattr(self.runner, "session_store", None) is not self.store:
            raise ValueError(
                "the runner must use the channel's store: build it with "
                "Runner(..., session_store=store) and the channel with store=store, so that "
                "each turn stores its reply with its inbox batch"
            )

    async def handle(self, batch: InboxBatch) -> str | None:
        """Answer one batch: a turn of the runner on its text messages (the inbox's ``handle``).

        A batch of only unreadable messages gets ``unsupported_media_message``,
        without a turn.

        Raises:
            TimeoutError: The turn ran past ``llm_timeout_seconds``.
            Exception: Whatever the turn raised (the inbox retries the batch).

        """
        texts = [
            item.text for item in batch.items
            if not (isinstance(item.payload, dict) and item.payload.get("unsupported") is True)
        ]
        if not texts:
            return self.unsupported_media_message
        metadata = {"channel": "whatsapp", "phone": batch.session_id,
                    "wamid": batch.items[-1].message_id}
        try:
            response = await asyncio.wait_for(
                self.dispatch_async(session_id=batch.session_id, message="\n".join(texts),
                                    metadata=metadata),
                timeout=self.llm_timeout_seconds,
            )
        except Exception as exc:
            if any(item.attempts >= self.max_attempts for item in batch.items):
                await self._send_fallback(batch.session_id)
            if isinstance(exc, asyncio.TimeoutError):
                raise TimeoutError(
                    f"the turn ran past llm_timeout_seconds ({self.llm_timeout_seconds:g} s)"
                ) from None
            raise
        content: str | None = response.content
        return content

    async def send(self, reply: InboxReply) -> None:
        """Send a reply through upstream's sender, in chunks (the inbox's ``send``).

        A retry of a reply resumes at the chunk that failed.

        Raises:
            GraphAPIError: A chunk did not arrive and sending it again is safe.

        """
        key = reply.message_ids
        chunks = split_message(reply.text, max_len=WHATSAPP_TEXT_LIMIT)
        for index in range(self._progress.pop(key, 0), len(chunks)):
            try:
                await self._send_chunk(reply.session_id, chunks[index])
            except GraphAPIError:
                self._progress[key] = index
                while len(self._progress) > _PROGRESS_KEPT:
                    self._progress.popitem(last=False)
                raise

    async def _send_chunk(self, phone: str, text: str) -> None:
        outcome = _Outcome()
        reset = _OUTCOME.set(outcome)
        try:
            await _upstream_send_chunk(self, phone, text)
        finally:
            _OUTCOME.reset(reset)
        problem = outcome.problem()
        if problem is not None:
            raise GraphAPIError(f"the reply to {_masked(phone)} was not sent: {problem}")

    async def _send_fallback(self, phone: str) -> None:
        """Upstream's answer to a failed turn, sent once, when its messages are about to die."""
        if not (self.access_token and self.phone_number_id):
            return
        try:
            for chunk in split_message(self.fallback_message, max_len=WHATSAPP_TEXT_LIMIT):
                await self._send_chunk(phone, chunk)
        except GraphAPIError as exc:
            logger.warning("whatsapp: could not send the fallback message: %s", exc)


# ------------------------------------------------------------------ helpers
def _raw_messages(payload: Any, count: int) -> Sequence[Mapping[str, Any]]:
    """The message objects behind upstream's extraction, in its order (``{}`` if they differ).

    Upstream keeps only ``(wamid, phone, text)``; ``timestamp`` and ``type``
    are read here by the same walk (messages that have a sender, else the
    generic payload itself).
    """
    found = [
        message
        for entry in _items(payload, "entry")
        for change in _items(entry, "changes")
        for message in _items(change.get("value"), "messages")
        if message.get("from")
    ]
    if not found and isinstance(payload, dict):
        found = [payload]
    if len(found) != count:
        logger.warning("whatsapp: cannot match the payload's messages to chatflow-agent's "
                       "extraction; storing them without timestamps")
        return [{}] * count
    return found


def _items(parent: Any, key: str) -> list[dict[str, Any]]:
    value = parent.get(key) if isinstance(parent, dict) else None
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _masked(phone: str) -> str:
    """A phone number as logs show it (as upstream masks it)."""
    return "***" if len(phone) <= 6 else f"{phone[:4]}***{phone[-3:]}"


def _report_stop(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("whatsapp: the inbox workers stopped", exc_info=task.exception())


async def _until_signalled(work: Awaitable[None]) -> None:
    """Run ``work`` until it ends, or until SIGINT or SIGTERM cancels it (a clean stop)."""
    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # Windows, other threads
            loop.add_signal_handler(signum, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await task
