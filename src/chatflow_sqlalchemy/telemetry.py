"""OpenTelemetry spans and metrics of the store's operations (the ``otel`` extra).

What is reported is listed in docs/observability.md. Spans nest in the
caller's trace (also on the store's I/O threads) and carry no session id,
user id or text, and a failure's type only, never its message: telemetry
cannot be erased with ``erase_user``. Telemetry never changes what the store
does: a failing SDK or exporter is logged, never raised. Without
``opentelemetry-api`` everything here does nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

try:
    from opentelemetry import context, metrics, trace
except ImportError:  # the otel extra is not installed: no-op
    context = metrics = trace = None  # type: ignore[assignment]

from chatflow_sqlalchemy import __version__

__all__ = ["INSTRUMENTATION_NAME", "Operation", "count", "enabled", "operation"]

INSTRUMENTATION_NAME = "chatflow_sqlalchemy"
"""The tracer's and the meter's name (the instrumentation scope)."""

AttributeValue = str | int | float | bool

logger = logging.getLogger("chatflow_sqlalchemy")


class Operation:
    """The span of one operation in progress; :meth:`set` adds what it found out."""

    __slots__ = ("_span",)

    def __init__(self, span: Any = None) -> None:
        self._span = span

    def set(self, key: str, value: AttributeValue) -> None:
        """Record ``key`` on the operation's span (nothing without OpenTelemetry)."""
        if self._span is not None:
            _safely(self._span.set_attribute, key, value)


_NO_OP = Operation()


_COUNTERS = (
    ("chatflow.version_conflicts", "{conflict}",
     "Turns that found their session moved by another writer and rebased"),
    ("chatflow.messages.pruned", "{message}", "History rows deleted by a turn's write"),
    ("chatflow.sessions.swept", "{session}", "Sessions removed by the retention sweep"),
    ("chatflow.inbox.received", "{message}",
     "Messages the inbox accepted (redeliveries refused are not counted)"),
    ("chatflow.inbox.answered", "{message}",
     "Inbox messages whose batch was handled and its reply stored"),
    ("chatflow.inbox.failed", "{message}",
     "Inbox messages whose batch raised (retried later, or dead)"),
    ("chatflow.inbox.send_failures", "{reply}",
     "Calls of the inbox's send that raised (each retry counts)"),
    ("chatflow.summaries.written", "{summary}", "Session summaries made and stored"),
    ("chatflow.summaries.failed", "{summary}",
     "Summarizer calls that raised, timed out or returned no str"),
)
"""The counters: name, unit, description."""


class _Instruments:
    """The tracer and the metric instruments, made on first use."""

    def __init__(self) -> None:
        assert trace is not None and metrics is not None
        self.tracer = trace.get_tracer(INSTRUMENTATION_NAME, __version__)
        meter = metrics.get_meter(INSTRUMENTATION_NAME, __version__)
        self.duration = meter.create_histogram(
            "chatflow.operation.duration",
            unit="s",
            description="How long a store operation took (claim, load, turn lease, turn commit)",
        )
        self.counters = {
            name: meter.create_counter(name, unit=unit, description=description)
            for name, unit, description in _COUNTERS
        }


_instruments: _Instruments | None = None


def _get() -> _Instruments:
    global _instruments
    if _instruments is None:
        _instruments = _Instruments()
    return _instruments


_warned = False


def _safely(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``; an error is logged (the first at WARNING, then DEBUG), never raised."""
    global _warned
    try:
        return call(*args)
    except Exception:
        level = logging.DEBUG if _warned else logging.WARNING
        _warned = True
        logger.log(level, "OpenTelemetry failed; the store goes on without it", exc_info=True)
        return None


_tracing = False
"""A tracer provider was set (it stays set): the store's spans are recorded."""


def _tracer_provider_set() -> bool:
    """Whether a tracer provider is set; until then the store starts no span.

    Without one, the tracer is the API's no-op tracer: its spans record
    nothing and carry the caller's span on unchanged, so not starting them
    changes nothing but the work. ``_get`` already asked for the provider
    (loading one named by the environment), so this only reads it.
    """
    global _tracing
    _tracing = not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    return _tracing


def enabled() -> bool:
    """True if ``opentelemetry-api`` is installed (the store then reports through it)."""
    return trace is not None


def operation(name: str, system: str, **attributes: AttributeValue) -> _Operating:
    """Run the block as the store operation ``name``: a span and a duration sample.

    Use it as ``with operation(...) as op:``; ``op`` is an :class:`Operation`.

    Args:
        name: ``claim``, ``load``, ``turn.lease``, ``turn.commit``, ``inbox.put``,
            ``inbox.batch``, ``inbox.send`` or ``summary`` (the span is ``chatflow.<name>``).
        system: The database (``db.system.name``): ``sqlite``, ``postgresql``...
        **attributes: More span attributes, keyed ``chatflow.<key>``.

    """
    return _Operating(name, system, attributes)


class _Operating:
    """:func:`operation`'s context manager: a class, since each turn runs several.

    A ``@contextmanager`` generator would cost a wrapper and a step into
    the generator on the way in and out of every store operation.
    """

    __slots__ = ("_attributes", "_instruments", "_metric", "_name", "_span", "_started",
                 "_system", "_token")

    def __init__(self, name: str, system: str, attributes: dict[str, AttributeValue]) -> None:
        self._name = name
        self._system = system
        self._attributes = attributes
        self._instruments: _Instruments | None = None
        self._metric: dict[str, AttributeValue] = {}
        self._span: Any = None
        self._token: Any = None
        self._started = 0.0

    def __enter__(self) -> Operation:
        if trace is None:
            return _NO_OP
        instruments = _instruments if _instruments is not None else _safely(_get)
        if instruments is None:
            return _NO_OP
        self._instruments = instruments
        name, system = self._name, self._system
        self._metric = {"chatflow.operation": name, "db.system.name": system}
        if _tracing or _safely(_tracer_provider_set):
            span_attributes: dict[str, AttributeValue] = {"db.system.name": system}
            span_attributes.update(
                {f"chatflow.{key}": value for key, value in self._attributes.items()}
            )
            span = self._span = _safely(_start_span, instruments, f"chatflow.{name}",
                                        span_attributes)
            if span is not None:
                self._token = _safely(context.attach, trace.set_span_in_context(span))
        self._started = time.perf_counter()
        return Operation(self._span)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        failure: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        instruments = self._instruments
        if instruments is None:  # nothing was started
            return
        elapsed = time.perf_counter() - self._started
        if self._token is not None:
            _safely(context.detach, self._token)
        if self._span is not None:
            _safely(_end_span, self._span, failure)
        if failure is not None:
            self._metric["error.type"] = type(failure).__qualname__
        _safely(instruments.duration.record, elapsed, self._metric)


def _start_span(instruments: _Instruments, name: str, attributes: dict[str, AttributeValue]) -> Any:
    return instruments.tracer.start_span(name, kind=trace.SpanKind.CLIENT, attributes=attributes)


def _end_span(span: Any, failure: BaseException | None) -> None:
    """End ``span``; a failure sets ERROR and ``error.type``, never the exception's text."""
    if failure is not None:
        kind = type(failure).__qualname__
        span.set_attribute("error.type", kind)
        span.set_status(trace.Status(trace.StatusCode.ERROR, kind))
    span.end()


def count(name: str, amount: int, system: str) -> None:
    """Add ``amount`` to the counter ``name`` (``chatflow.version_conflicts``...)."""
    if trace is None or amount <= 0:
        return
    instruments = _safely(_get)
    if instruments is not None:
        _safely(instruments.counters[name].add, amount, {"db.system.name": system})
