"""OpenTelemetry spans and metrics of the store's operations (the ``otel`` extra).

The store reports its work in the units a bot's operator reasons about: a
webhook claim, a session load, the wait for a turn's lock, a turn's commit.
The statements inside them are SQLAlchemy's to report (its engine events, and
OpenTelemetry's SQLAlchemy instrumentation built on them): started inside an
operation's span, they nest under it, in the caller's trace, also when the
store runs them on its I/O threads (the caller's context travels with them).

Spans (tracer ``chatflow_sqlalchemy``), each with ``db.system.name``:

- ``chatflow.claim``: acquiring a webhook claim; ``chatflow.claim.status``
  is ``acquired``, ``done`` or ``in_flight``.
- ``chatflow.load``: reading a session's row and messages;
  ``chatflow.messages`` is how many were read.
- ``chatflow.turn.lock``: waiting for the cross-process turn lock (stores
  with turn locks); ``chatflow.lock.attempts`` counts the tries.
- ``chatflow.turn.commit``: writing a turn in one transaction.

Metrics (meter ``chatflow_sqlalchemy``): ``chatflow.operation.duration``
(histogram, seconds, by ``chatflow.operation`` and ``db.system.name``, with
``error.type`` when it failed); counters ``chatflow.version_conflicts``
(a turn found its session moved by another writer and rebased),
``chatflow.messages.pruned`` (history rows deleted by a write) and
``chatflow.sessions.swept`` (sessions removed by the retention sweep).

No session id, user id or message text is put in a span or a metric: session
ids are often phone numbers, and telemetry cannot be erased with
:meth:`~chatflow_sqlalchemy.SQLAlchemySessionStore.erase_user`.

Without ``opentelemetry-api`` every function here does nothing. With it and
no SDK configured, OpenTelemetry's own no-op providers answer; an SDK set up
later (``trace.set_tracer_provider``) is picked up, as the API's proxies do.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

try:
    from opentelemetry import metrics, trace
except ImportError:  # the otel extra is not installed: no-op
    metrics = trace = None  # type: ignore[assignment]

from chatflow_sqlalchemy import __version__

__all__ = [
    "INSTRUMENTATION_NAME",
    "Operation",
    "count",
    "enabled",
    "operation",
]

INSTRUMENTATION_NAME = "chatflow_sqlalchemy"
"""The tracer's and the meter's name (the instrumentation scope)."""

AttributeValue = str | int | float | bool


class Operation:
    """The span of one operation in progress; :meth:`set` adds what it found out."""

    __slots__ = ("_span",)

    def __init__(self, span: Any = None) -> None:
        self._span = span

    def set(self, key: str, value: AttributeValue) -> None:
        """Record ``key`` on the operation's span (nothing without OpenTelemetry)."""
        if self._span is not None:
            self._span.set_attribute(key, value)


_NO_OP = Operation()


class _Instruments:
    """The tracer and the metric instruments, made on first use."""

    def __init__(self) -> None:
        assert trace is not None and metrics is not None
        self.tracer = trace.get_tracer(INSTRUMENTATION_NAME, __version__)
        meter = metrics.get_meter(INSTRUMENTATION_NAME, __version__)
        self.duration = meter.create_histogram(
            "chatflow.operation.duration",
            unit="s",
            description="How long a store operation took (claim, load, turn lock, turn commit)",
        )
        self.counters = {
            "chatflow.version_conflicts": meter.create_counter(
                "chatflow.version_conflicts",
                unit="{conflict}",
                description="Turns that found their session moved by another writer and rebased",
            ),
            "chatflow.messages.pruned": meter.create_counter(
                "chatflow.messages.pruned",
                unit="{message}",
                description="History rows deleted by a turn's write",
            ),
            "chatflow.sessions.swept": meter.create_counter(
                "chatflow.sessions.swept",
                unit="{session}",
                description="Sessions removed by the retention sweep",
            ),
        }


_instruments: _Instruments | None = None


def _get() -> _Instruments:
    global _instruments
    if _instruments is None:
        _instruments = _Instruments()
    return _instruments


def enabled() -> bool:
    """True if ``opentelemetry-api`` is installed (the store then reports through it)."""
    return trace is not None


@contextmanager
def operation(name: str, system: str, **attributes: AttributeValue) -> Iterator[Operation]:
    """Run the block as the store operation ``name``: a span and a duration sample.

    Args:
        name: ``claim``, ``load``, ``turn.lock`` or ``turn.commit`` (the span is
            ``chatflow.<name>``).
        system: The database (``db.system.name``): ``sqlite``, ``postgresql``...
        **attributes: More span attributes, keyed ``chatflow.<key>``.

    """
    if trace is None:
        yield _NO_OP
        return
    instruments = _get()
    span_attributes: dict[str, AttributeValue] = {"db.system.name": system}
    span_attributes.update({f"chatflow.{key}": value for key, value in attributes.items()})
    metric_attributes: dict[str, AttributeValue] = {
        "chatflow.operation": name,
        "db.system.name": system,
    }
    started = time.perf_counter()
    try:
        with instruments.tracer.start_as_current_span(
            f"chatflow.{name}", kind=trace.SpanKind.CLIENT, attributes=span_attributes
        ) as span:
            yield Operation(span)
    except BaseException as exc:
        metric_attributes["error.type"] = type(exc).__qualname__
        raise
    finally:
        instruments.duration.record(time.perf_counter() - started, metric_attributes)


def count(name: str, amount: int, system: str) -> None:
    """Add ``amount`` to the counter ``name`` (``chatflow.version_conflicts``...)."""
    if trace is None or amount <= 0:
        return
    _get().counters[name].add(amount, {"db.system.name": system})
