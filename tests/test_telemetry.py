"""The store's OpenTelemetry spans and metrics (``chatflow_sqlalchemy.telemetry``).

With the OpenTelemetry SDK's in-memory span exporter and metric reader, and
OpenTelemetry's SQLAlchemy instrumentation on the store's engine: a webhook
answered the documented way (claim, Runner turn, reply) leaves the store's
spans in the request's trace, the statements SQLAlchemy runs nested under them,
and the metrics count what happened. OpenTelemetry's global providers can be
set once per process: the first test here sets them, and a gate lets spans
through only while a test of this module runs (pytest-xdist may interleave
this module with others in one worker).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from chatflow_agent import Agent, Message, Role, Runner
from sqlalchemy.exc import InvalidRequestError

from chatflow_sqlalchemy import SQLiteSessionStore, telemetry
from chatflow_sqlalchemy.backends.postgresql import PostgresSessionStore
from chatflow_sqlalchemy.exceptions import SessionDeletedError
from chatflow_sqlalchemy.testing import ScriptedEngine

from .pg_util import fresh_schema, postgres_url, schema_connect_args

pytest.importorskip("opentelemetry.sdk", reason="the dev extra is not installed")
pytest.importorskip("opentelemetry.instrumentation.sqlalchemy",
                    reason="the dev extra is not installed")

from opentelemetry import metrics, trace
from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor
from opentelemetry.instrumentation.sqlalchemy.engine import EngineTracer
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

BOT = Agent(name="Bot", instructions="")


class Gate(SpanProcessor):
    """Exports finished spans while a test of this module runs; can break the store's spans."""

    def __init__(self, exporter: InMemorySpanExporter) -> None:
        self.exporter = exporter
        self.open = False
        self.broken = False

    def on_end(self, span: ReadableSpan) -> None:
        if self.broken and span.name.startswith("chatflow."):  # the store's spans only
            raise RuntimeError("a broken span exporter")
        if self.open:
            self.exporter.export([span])


class Recorded:
    """The spans and metric points recorded since the test began."""

    def __init__(
        self, exporter: InMemorySpanExporter, reader: InMemoryMetricReader, gate: Gate
    ) -> None:
        self.exporter = exporter
        self.reader = reader
        self.gate = gate

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, name: str) -> list[ReadableSpan]:
        return [span for span in self.spans() if span.name == name]

    def points(self, metric: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        if data is None:  # nothing recorded yet in this process
            return []
        return [
            point
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            if scope.scope.name == telemetry.INSTRUMENTATION_NAME
            for found in scope.metrics
            if found.name == metric
            for point in found.data.data_points
        ]

    def total(self, metric: str, **attributes: str) -> int:
        return sum(
            int(point.value)
            for point in self.points(metric)
            if all(point.attributes.get(key) == value for key, value in attributes.items())
        )


_INSTALLED: tuple[InMemorySpanExporter, InMemoryMetricReader, Gate] | None = None


def _install_providers() -> tuple[InMemorySpanExporter, InMemoryMetricReader, Gate]:
    global _INSTALLED
    if _INSTALLED is None:
        exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
        gate = Gate(exporter)
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(gate)
        trace.set_tracer_provider(tracer_provider)
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        if trace.get_tracer_provider() is not tracer_provider:
            pytest.fail("another test set OpenTelemetry's global tracer provider first")
        _INSTALLED = exporter, reader, gate
    return _INSTALLED


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    exporter, reader, gate = _install_providers()
    exporter.clear()
    gate.open, gate.broken = True, False
    try:
        yield Recorded(exporter, reader, gate)
    finally:
        gate.open, gate.broken = False, False
        exporter.clear()


@pytest.fixture(
    params=["sqlite-file", pytest.param("postgresql", marks=pytest.mark.postgres)]
)
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    with ExitStack() as stack:
        instrumentor = SQLAlchemyInstrumentor()
        stack.callback(_uninstrument, instrumentor)
        if request.param == "sqlite-file":
            def opener(**options: Any) -> Any:
                return stack.enter_context(SQLiteSessionStore(tmp_path / "otel.db", **options))
        else:
            url = postgres_url()
            schema = stack.enter_context(fresh_schema(url))

            def opener(**options: Any) -> Any:
                return stack.enter_context(
                    PostgresSessionStore(url, connect_args=schema_connect_args(schema), **options)
                )

        def instrumented(**options: Any) -> Any:
            store = opener(**options)
            # The instrumentation declares "sqlalchemy < 2.1"; its engine events are 2.1's too.
            instrumentor.instrument(engine=store.engine, skip_dep_check=True)
            return store

        yield instrumented


def _uninstrument(instrumentor: SQLAlchemyInstrumentor) -> None:
    """Take the instrumentation off again, so the next test can put it on.

    An AsyncEngine created while it is on gets two tracers (through both
    ``create_engine`` and ``create_async_engine``, which it wraps), and
    ``uninstrument`` then fails removing the second one's listeners, leaving
    the instrumentor on: the next test's ``instrument`` would do nothing and
    trace nothing. Its bookkeeping is cleared then (the engines are closed).
    """
    try:
        instrumentor.uninstrument()
    except InvalidRequestError:
        EngineTracer._remove_event_listener_params.clear()
        instrumentor._is_instrumented_by_opentelemetry = False


def _phone() -> str:
    """A session id as WhatsApp bots use them (a phone number), unique to the test."""
    return f"whatsapp:+1555{uuid.uuid4().int % 10**7:07d}"


def _webhook(store: Any, message_id: str, text: str, session_id: str) -> None:
    """Answer one webhook the documented way (claim, Runner turn, reply) in a request span."""
    runner = Runner(starting_agent=BOT, session_store=store, engine=ScriptedEngine())
    tracer = trace.get_tracer("the-web-app")

    async def handle() -> None:
        with tracer.start_as_current_span("POST /webhook"):
            async with store.claim(message_id, session_id=session_id) as claim:
                if claim.acquired:
                    result = await runner.run_async(session_id, text)
                    claim.response = result.content

    asyncio.run(handle())


def _no_session_id_in(spans: list[ReadableSpan], session_id: str) -> None:
    """Session ids are often phone numbers: not in any attribute, status or event."""
    for span in spans:
        if not span.name.startswith("chatflow."):
            continue
        seen = repr((
            dict(span.attributes or {}),
            span.status.description,
            [(event.name, dict(event.attributes or {})) for event in span.events],
        ))
        assert session_id not in seen and session_id.split(":")[1] not in seen, span.name


def _parent_chain(span: ReadableSpan, by_id: dict[int, ReadableSpan]) -> list[str]:
    names = []
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        names.append(span.name)
    return names


def test_a_runner_turn_leaves_the_stores_spans_in_the_requests_trace(
    open_store: Callable[..., Any], recorded: Recorded
) -> None:
    store, phone = open_store(), _phone()
    _webhook(store, "m-1", "hello", phone)
    spans = recorded.spans()
    (request,) = recorded.named("POST /webhook")
    trace_id = request.context.trace_id
    by_id = {span.context.span_id: span for span in spans}

    (claim,) = recorded.named("chatflow.claim")
    assert claim.attributes["chatflow.claim.status"] == "acquired"
    assert claim.attributes["db.system.name"] == store.engine.dialect.name
    loads = recorded.named("chatflow.load")
    commits = recorded.named("chatflow.turn.commit")
    assert loads and len(commits) == 1
    (lease,) = recorded.named("chatflow.turn.lease")
    assert lease.attributes["chatflow.lease.attempts"] == 1
    assert lease.attributes["db.system.name"] == store.engine.dialect.name
    for span in [claim, *loads, lease, *commits]:
        assert span.context.trace_id == trace_id, f"{span.name} is not in the request's trace"
        assert "POST /webhook" in _parent_chain(span, by_id)

    # SQLAlchemy's spans: the claim's, the load's and the lease's statements nest under them.
    sql = [span for span in spans if span.instrumentation_scope.name.startswith(
        "opentelemetry.instrumentation.sqlalchemy")]
    under_claim = [s for s in sql if "chatflow.claim" in _parent_chain(s, by_id)]
    under_load = [s for s in sql if "chatflow.load" in _parent_chain(s, by_id)]
    under_lease = [s for s in sql if "chatflow.turn.lease" in _parent_chain(s, by_id)]
    assert under_claim, "no statement of the claim was traced under chatflow.claim"
    assert under_load, "no statement of the load was traced under chatflow.load"
    assert under_lease, "no statement of the lease was traced under chatflow.turn.lease"
    assert all(s.context.trace_id == trace_id for s in sql
               if s in under_claim + under_load + under_lease)
    _no_session_id_in(recorded.spans(), phone)


def test_a_turns_write_is_traced_by_sqlalchemys_instrumentation(
    open_store: Callable[..., Any], recorded: Recorded
) -> None:
    store = open_store()
    _webhook(store, "m-1", "hello", _phone())
    by_id = {span.context.span_id: span for span in recorded.spans()}
    inserts = [
        span for span in recorded.spans()
        if "chatflow.turn.commit" in _parent_chain(span, by_id)
        and "INSERT" in str((span.attributes or {}).get("db.statement", ""))
    ]
    assert inserts, "the turn's INSERT INTO chatflow_messages was not traced"


def test_metrics_count_operations_conflicts_and_pruned_rows(
    open_store: Callable[..., Any], recorded: Recorded
) -> None:
    store = open_store()
    system = store.engine.dialect.name
    counts_before = {
        name: recorded.total(name, **{"db.system.name": system})
        for name in ("chatflow.version_conflicts", "chatflow.messages.pruned")
    }
    phone = _phone()
    _webhook(store, "m-2", "hello", phone)
    durations = {
        op: sum(
            p.count for p in recorded.points("chatflow.operation.duration")
            if p.attributes["chatflow.operation"] == op and p.attributes["db.system.name"] == system
            and "error.type" not in p.attributes
        )
        for op in ("claim", "load", "turn.commit")
    }
    assert all(durations[op] > 0 for op in durations), durations

    # A second store writes the session; the first one's next write rebases on it.
    other = open_store()
    mine = store.get(phone)
    other.get(phone).add_message(Message(role=Role.USER, content="from elsewhere"))
    mine.add_message(Message(role=Role.USER, content="from here"))
    assert recorded.total("chatflow.version_conflicts", **{"db.system.name": system}) == (
        counts_before["chatflow.version_conflicts"] + 1
    )
    rows = len(store.get(phone).history)
    store.get(phone).clear_history()
    assert recorded.total("chatflow.messages.pruned", **{"db.system.name": system}) == (
        counts_before["chatflow.messages.pruned"] + rows
    )


def test_a_failed_operation_is_marked_as_an_error(
    open_store: Callable[..., Any], recorded: Recorded
) -> None:
    store, other, phone = open_store(), open_store(), _phone()
    ctx = store.get_or_create(phone, BOT)
    other.delete(phone)
    with pytest.raises(SessionDeletedError, match="whatsapp"):  # the error names the session
        ctx.add_message(Message(role=Role.USER, content="too late"))
    (commit,) = recorded.named("chatflow.turn.commit")
    assert commit.status.status_code == trace.StatusCode.ERROR
    assert commit.status.description == "SessionDeletedError"
    assert commit.attributes["error.type"] == "SessionDeletedError"
    _no_session_id_in(recorded.spans(), phone)  # ... its span does not
    errors = [
        p for p in recorded.points("chatflow.operation.duration")
        if p.attributes["chatflow.operation"] == "turn.commit" and "error.type" in p.attributes
    ]
    assert errors and errors[0].attributes["error.type"] == "SessionDeletedError"


def test_a_broken_exporter_never_breaks_a_turn(
    open_store: Callable[..., Any], recorded: Recorded, caplog: pytest.LogCaptureFixture
) -> None:
    """Telemetry is best effort: a span processor that raises on every span end is logged;
    the webhook is answered, the turn stored and its lease given back."""
    store, phone = open_store(), _phone()
    recorded.gate.broken = True
    _webhook(store, "m-broken", "hello", phone)
    recorded.gate.broken = False
    assert store.get(phone).history[0].content == "hello"
    assert "OpenTelemetry failed" in caplog.text or telemetry._warned
    other = open_store()  # the lease was given back: another store takes it at once
    lease = other.turns.leases.take(phone)
    assert lease is not None, "the turn left its lease held"
    other.turns.leases.release(lease)


def test_the_inbox_reports_put_batch_and_send(
    open_store: Callable[..., Any], recorded: Recorded
) -> None:
    """Spans ``chatflow.inbox.put/batch/send`` and the inbox counters; no message text."""
    import asyncio

    from chatflow_sqlalchemy.inbox import InboxBatch, InboxReply

    store = open_store()
    system = store.engine.dialect.name
    before = {
        name: recorded.total(name, **{"db.system.name": system})
        for name in ("chatflow.inbox.received", "chatflow.inbox.answered",
                     "chatflow.inbox.failed", "chatflow.inbox.send_failures")
    }
    phone = _phone()
    for mid in ("i-1", "i-2"):
        store.inbox.put(mid, session_id=phone, text=f"secret {mid}")
    store.inbox.put("i-1", session_id=phone, text="redelivered")  # refused: not counted
    sends: list[InboxReply] = []
    failures = {"handle": 1, "send": 1}

    async def handle(batch: InboxBatch) -> str:
        if failures["handle"]:
            failures["handle"] -= 1
            raise RuntimeError("once")
        return "ok"

    async def send(reply: InboxReply) -> None:
        if failures["send"]:
            failures["send"] -= 1
            raise ConnectionError("once")
        sends.append(reply)

    async def serve_until_sent() -> None:
        serving = asyncio.ensure_future(
            store.inbox.serve(handle, send=send, coalesce_seconds=0, retry_seconds=0)
        )
        for _ in range(3000):  # a 60 s hang guard
            if sends:
                break
            await asyncio.sleep(0.02)
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)

    asyncio.run(serve_until_sent())
    assert len(sends) == 1
    after = {name: recorded.total(name, **{"db.system.name": system}) - count
             for name, count in before.items()}
    assert after == {"chatflow.inbox.received": 2, "chatflow.inbox.answered": 2,
                     "chatflow.inbox.failed": 2, "chatflow.inbox.send_failures": 1}
    assert len(recorded.named("chatflow.inbox.put")) == 3
    batches = recorded.named("chatflow.inbox.batch")
    assert [span.attributes["chatflow.inbox.items"] for span in batches] == [2, 2]
    assert [span.status.is_ok for span in batches] == [False, True]
    assert len(recorded.named("chatflow.inbox.send")) == 2
    _no_session_id_in(recorded.spans(), phone)
    assert not any("secret" in str(span.attributes) for span in recorded.spans())
