"""OpenTelemetry spans for a journal's operations (the ``otel`` extra).

::

    from itemjournal import Journal
    from itemjournal.otel import instrument

    journal = instrument(await Journal.open(location))  # the global tracer provider
    journal = instrument(journal, tracer_provider=provider)  # or a provider of yours

From then on every operation of that journal is one span, a child of whatever span is
current where it was called: ``itemjournal.begin``, ``itemjournal.complete``,
``itemjournal.mark_review``, ``itemjournal.claim_exit`` (a claim block's own settlement
on exit), ``itemjournal.resolve`` (also each resolution made by ``reconcile``),
``itemjournal.inspect``, ``itemjournal.sweep``, ``itemjournal.prune``,
``itemjournal.verify`` and ``itemjournal.reconcile``. The listings (``records``,
``counts``) make no span.

Attributes: the identity's labels (``itemjournal.scope``, ``.program``, ``.job``,
``.item``) and key (``itemjournal.key``), ``itemjournal.attempt``, and
``itemjournal.outcome``: ``claimed``, ``reused``, ``completed``, ``marked``,
``resolved``, ``found``/``absent``, ``swept``, ``pruned``, ``verified``,
``reconciled``, or the ``code`` of the error the operation ended with
(``IN_PROGRESS``, ``REVIEW_REQUIRED``, ``STORAGE_FAILED``...), or ``cancelled``. A
refusal (a ``ConflictError``) is an answer, not a failure: its span's status stays
unset. Any other error (``STORAGE_FAILED``, ``RECORD_INVALID``, an unexpected
exception) sets the status to ERROR and records the exception. Inputs, receipts and
results never go into a span.

Importing ``itemjournal`` never imports OpenTelemetry; only this module does.
"""

from __future__ import annotations

from types import TracebackType

import anyio
from opentelemetry import context, trace
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer, TracerProvider

from . import __version__
from ._journal.journal import Journal
from ._model.conflicts import ConflictError
from ._model.errors import JournalError
from ._model.identity import Identity, identity_digest

__all__ = ["instrument", "uninstrument"]


def instrument(journal: Journal, *, tracer_provider: TracerProvider | None = None) -> Journal:
    """Wrap each operation of ``journal`` in a span; returns the same journal.

    ``tracer_provider`` defaults to the global one (as set with
    ``opentelemetry.trace.set_tracer_provider``, even after this call). Instrumenting a
    journal again replaces its provider.
    """
    if not isinstance(journal, Journal):
        raise TypeError(f"instrument() takes a Journal, not {type(journal).__name__}")
    tracer = trace.get_tracer("itemjournal", __version__, tracer_provider=tracer_provider)
    journal._tracing = _Tracing(tracer)
    return journal


def uninstrument(journal: Journal) -> None:
    """Stop making spans for ``journal``'s operations."""
    if not isinstance(journal, Journal):
        raise TypeError(f"uninstrument() takes a Journal, not {type(journal).__name__}")
    journal._tracing = None


class _Tracing:
    """The ``Tracing`` a journal asks for its spans."""

    __slots__ = ("_tracer",)

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer

    def span(self, operation: str, identity: Identity | None) -> _OperationSpan:
        return _OperationSpan(self._tracer, operation, identity)


class _OperationSpan:
    """One operation's span: started and made current on entry, ended on exit."""

    __slots__ = ("_identity", "_operation", "_span", "_token", "_tracer")

    def __init__(self, tracer: Tracer, operation: str, identity: Identity | None) -> None:
        self._tracer = tracer
        self._operation = operation
        self._identity = identity

    def __enter__(self) -> _OperationSpan:
        attributes: dict[str, str] = {}
        identity = self._identity
        if identity is not None:
            for name, label in zip(Identity._fields, identity, strict=True):
                attributes[f"itemjournal.{name}"] = label
            attributes["itemjournal.key"] = identity_digest(identity)
        self._span = self._tracer.start_span(
            f"itemjournal.{self._operation}",
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        )
        self._token = context.attach(trace.set_span_in_context(self._span))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if exc is not None:
                self.failed(exc)
        finally:
            context.detach(self._token)
            self._span.end()

    def set(self, name: str, value: str | int | bool) -> None:
        self._span.set_attribute(f"itemjournal.{name}", value)

    def failed(self, error: BaseException) -> None:
        span = self._span
        if isinstance(error, ConflictError):  # a refusal: the operation's answer
            span.set_attribute("itemjournal.outcome", error.code)
            view = error.view
            if view is not None:
                span.set_attribute("itemjournal.status", view.status)
                span.set_attribute("itemjournal.attempt", view.attempt)
            return
        if not isinstance(error, Exception):  # a cancellation, an interrupt: not a failure
            span.set_attribute("itemjournal.outcome", _interruption(error))
            return
        code = error.code if isinstance(error, JournalError) else "error"
        span.set_attribute("itemjournal.outcome", code)
        span.set_attribute(
            "error.type", code if isinstance(error, JournalError) else type(error).__qualname__
        )
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))


def _interruption(error: BaseException) -> str:
    try:
        cancelled = anyio.get_cancelled_exc_class()
    except Exception:  # pragma: no cover - spans end inside a running event loop
        return type(error).__name__
    return "cancelled" if isinstance(error, cancelled) else type(error).__name__
