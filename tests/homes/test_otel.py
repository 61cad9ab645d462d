"""``itemjournal.otel``: one span per operation, with its outcome, through the SDK's
in-memory exporter (a provider of the test's own; the global one is never set)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import anyio
import pytest
from _faults import FaultyFileSystem
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from itemjournal import (
    Claim,
    ConflictError,
    DidNotHappen,
    FileStore,
    Happened,
    Identity,
    Journal,
    RecordView,
    StorageFailed,
    Unknown,
    definition_digest,
)
from itemjournal.otel import instrument, uninstrument
from itemjournal.testing import MemoryStore

pytestmark = pytest.mark.anyio

SECRET_INPUT = "input-77a0d3-must-never-be-traced"
INPUTS: dict[str, str | int] = {"card": SECRET_INPUT, "cents": 1250}
OTHER_INPUTS: dict[str, str | int] = {"card": SECRET_INPUT, "cents": 1251}
DEFINITION = definition_digest("otel-v1")
RECEIPT = "receipt-31c4e9"


def ident(item: str) -> Identity:
    return Identity("shop", "billing", "charge", item)


class Spans:
    """A tracer provider of the test's own, and what it exported."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def finished(self) -> tuple[ReadableSpan, ...]:
        return self.exporter.get_finished_spans()

    def outcomes(self) -> list[tuple[str, object]]:
        return [
            (span.name, (span.attributes or {}).get("itemjournal.outcome"))
            for span in self.finished()
        ]

    def clear(self) -> None:
        self.exporter.clear()


@pytest.fixture
def spans() -> Iterator[Spans]:
    made = Spans()
    yield made
    made.provider.shutdown()


def attributes(span: ReadableSpan) -> dict[str, object]:
    return dict(span.attributes or {})


async def test_one_span_per_operation_with_its_outcome(journal: Journal, spans: Spans) -> None:
    instrument(journal, tracer_provider=spans.provider)
    claim = await journal.begin(ident("a"), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    await journal.complete(claim, RECEIPT, result="the result")
    await journal.begin(ident("a"), INPUTS, DEFINITION)
    with pytest.raises(ConflictError):
        await journal.begin(ident("a"), OTHER_INPUTS, DEFINITION)
    await journal.begin(ident("b"), INPUTS, DEFINITION)
    with pytest.raises(ConflictError):
        await journal.begin(ident("b"), INPUTS, DEFINITION, wait=0.02)
    await journal.mark_review(ident("b"), "the provider timed out")
    await journal.resolve(ident("b"), retry=True, note="no such charge")
    with pytest.raises(RuntimeError):
        async with journal.claim(ident("c"), INPUTS, DEFINITION):
            raise RuntimeError("the connection dropped")
    await journal.inspect(ident("c"))
    await journal.inspect(ident("nothing"))
    await journal.sweep()
    await journal.prune(timedelta(days=1))
    await journal.verify()

    assert spans.outcomes() == [
        ("itemjournal.begin", "claimed"),
        ("itemjournal.complete", "completed"),
        ("itemjournal.begin", "reused"),
        ("itemjournal.begin", "INPUT_CHANGED"),
        ("itemjournal.begin", "claimed"),
        ("itemjournal.begin", "IN_PROGRESS"),  # one span, however long it waited
        ("itemjournal.mark_review", "marked"),
        ("itemjournal.resolve", "resolved"),
        ("itemjournal.begin", "claimed"),
        ("itemjournal.claim_exit", "marked"),
        ("itemjournal.inspect", "found"),
        ("itemjournal.inspect", "absent"),
        ("itemjournal.sweep", "swept"),
        ("itemjournal.prune", "pruned"),
        ("itemjournal.verify", "verified"),
    ]
    finished = spans.finished()
    # A refusal is an answer: no span is an error here.
    assert {span.status.status_code for span in finished} == {StatusCode.UNSET}
    first = attributes(finished[0])
    assert first == {
        "itemjournal.scope": "shop",
        "itemjournal.program": "billing",
        "itemjournal.job": "charge",
        "itemjournal.item": "a",
        "itemjournal.key": claim.key,
        "itemjournal.outcome": "claimed",
        "itemjournal.claim_id": claim.claim_id,
        "itemjournal.attempt": 1,
    }
    refused = attributes(finished[3])
    assert (refused["itemjournal.status"], refused["itemjournal.attempt"]) == ("succeeded", 1)
    resolved = attributes(finished[7])
    assert resolved["itemjournal.status"] == "released"
    assert attributes(finished[12])["itemjournal.marked"] == 0
    assert attributes(finished[13])["itemjournal.dry_run"] is False
    for span in finished:
        text = repr(attributes(span)) + repr(span.events)
        assert SECRET_INPUT not in text
        assert RECEIPT not in text
        assert "the result" not in text


async def test_a_storage_failure_is_an_error_span(
    anyio_backend: str, root: Path, spans: Spans
) -> None:
    fs = FaultyFileSystem()
    store = FileStore(str(root), fs=fs)
    await store.open()
    async with instrument(Journal(store), tracer_provider=spans.provider) as journal:
        claim = await journal.begin(ident("d"), INPUTS, DEFINITION)
        assert isinstance(claim, Claim)
        fs.fail("fsync")
        with pytest.raises(StorageFailed):
            await journal.complete(claim, RECEIPT)
    failed = spans.finished()[-1]
    assert failed.name == "itemjournal.complete"
    assert attributes(failed)["itemjournal.outcome"] == "STORAGE_FAILED"
    assert attributes(failed)["error.type"] == "STORAGE_FAILED"
    assert failed.status.status_code is StatusCode.ERROR
    assert [event.name for event in failed.events] == ["exception"]


async def test_an_unexpected_exception_is_an_error_span(anyio_backend: str, spans: Spans) -> None:
    journal = instrument(Journal(MemoryStore()), tracer_provider=spans.provider)
    await journal.begin(ident("e"), INPUTS, DEFINITION)
    await journal.mark_review(ident("e"), "unsure")

    def broken(view: RecordView) -> Happened:
        raise LookupError("the provider's client broke")

    async def unknown(view: RecordView) -> Unknown:
        return Unknown("not yet")

    report = await journal.reconcile(broken)
    assert len(report.failed) == 1  # a failing check is reported, not raised
    store_spans = spans.finished()
    assert store_spans[-1].status.status_code is StatusCode.UNSET
    spans.clear()

    class Exploding(MemoryStore):
        async def peek(self, identity: object, view: object) -> object:
            raise LookupError("a bug in a store")

    exploding = instrument(Journal(Exploding()), tracer_provider=spans.provider)
    with pytest.raises(LookupError):
        await exploding.inspect(ident("e"))
    [span] = spans.finished()
    assert attributes(span)["itemjournal.outcome"] == "error"
    assert attributes(span)["error.type"] == "LookupError"
    assert span.status.status_code is StatusCode.ERROR
    assert (await journal.reconcile(unknown)).counts()["unknown"] == 1


async def test_reconcile_is_a_span_with_a_child_per_resolution(
    anyio_backend: str, spans: Spans
) -> None:
    journal = instrument(Journal(MemoryStore()), tracer_provider=spans.provider)
    for item in ("f", "g"):
        await journal.begin(ident(item), INPUTS, DEFINITION)
        await journal.mark_review(ident(item), "unsure")
    spans.clear()

    async def check(view: RecordView) -> Happened | DidNotHappen:
        if view.identity.item == "f":
            return Happened("receipt-f")
        return DidNotHappen("no charge in the dashboard")

    await journal.reconcile(check)
    *resolutions, parent = spans.finished()
    assert parent.name == "itemjournal.reconcile"
    assert attributes(parent)["itemjournal.happened"] == 1
    assert attributes(parent)["itemjournal.did_not_happen"] == 1
    assert sorted((span.name, attributes(span)["itemjournal.status"]) for span in resolutions) == [
        ("itemjournal.resolve", "released"),
        ("itemjournal.resolve", "succeeded"),
    ]
    assert parent.context is not None
    for span in resolutions:
        assert span.parent is not None
        assert span.parent.span_id == parent.context.span_id


async def test_a_span_of_the_caller_is_the_parent(anyio_backend: str, spans: Spans) -> None:
    journal = instrument(Journal(MemoryStore()), tracer_provider=spans.provider)
    tracer = spans.provider.get_tracer("the-application")
    with tracer.start_as_current_span("handle-order") as outer:
        await journal.begin(ident("h"), INPUTS, DEFINITION)
    begin, handler = spans.finished()
    assert handler.name == "handle-order"
    assert begin.parent is not None
    assert begin.parent.span_id == outer.get_span_context().span_id


async def test_a_cancelled_operation_ends_its_span(anyio_backend: str, spans: Spans) -> None:
    journal = instrument(Journal(MemoryStore()), tracer_provider=spans.provider)
    claim = await journal.begin(ident("i"), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    with anyio.move_on_after(0.05) as scope:
        await journal.begin(ident("i"), INPUTS, DEFINITION, wait=30)
    assert scope.cancelled_caught
    cancelled = spans.finished()[-1]
    assert (cancelled.name, attributes(cancelled)["itemjournal.outcome"]) == (
        "itemjournal.begin",
        "cancelled",
    )
    assert cancelled.status.status_code is StatusCode.UNSET
    assert cancelled.end_time is not None


async def test_the_exit_of_a_cancelled_claim_block_is_one_span(
    anyio_backend: str, spans: Spans
) -> None:
    journal = instrument(Journal(MemoryStore()), tracer_provider=spans.provider)
    with anyio.CancelScope() as scope:
        async with journal.claim(ident("j"), INPUTS, DEFINITION):
            scope.cancel()
            await anyio.sleep(1)
    assert spans.outcomes() == [
        ("itemjournal.begin", "claimed"),
        ("itemjournal.claim_exit", "marked"),
    ]
    assert (await journal.inspect(ident("j"))).status == "needs_review"


async def test_a_claim_block_completed_inside_then_left_by_an_error(
    anyio_backend: str, spans: Spans
) -> None:
    journal = instrument(Journal(MemoryStore()), tracer_provider=spans.provider)
    with pytest.raises(RuntimeError):
        async with journal.claim(ident("k"), INPUTS, DEFINITION) as attempt:
            await journal.complete(attempt.claim, RECEIPT)  # not through the attempt
            raise RuntimeError("after the completion")
    assert spans.outcomes() == [
        ("itemjournal.begin", "claimed"),
        ("itemjournal.complete", "completed"),
        ("itemjournal.claim_exit", "completed"),
    ]


async def test_a_refused_claim_exit_is_its_code(anyio_backend: str, spans: Spans) -> None:
    journal = instrument(Journal(MemoryStore()), tracer_provider=spans.provider)
    with pytest.raises(RuntimeError) as raised:
        async with journal.claim(ident("l"), INPUTS, DEFINITION):
            await journal.mark_review(ident("l"), "an operator stopped it")
            raise RuntimeError("then the block failed")
    assert "did not mark" in "".join(raised.value.__notes__)
    assert spans.outcomes()[-1] == ("itemjournal.claim_exit", "NOT_STARTED")
    assert spans.finished()[-1].status.status_code is StatusCode.UNSET


async def test_uninstrument_and_the_global_provider(anyio_backend: str, spans: Spans) -> None:
    journal = instrument(Journal(MemoryStore()), tracer_provider=spans.provider)
    uninstrument(journal)
    await journal.begin(ident("m"), INPUTS, DEFINITION)
    assert spans.finished() == ()
    instrument(journal)  # the global provider: none is set, so spans go nowhere
    await journal.begin(ident("n"), INPUTS, DEFINITION)
    assert spans.finished() == ()
    with pytest.raises(TypeError):
        instrument("not a journal")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        uninstrument(None)  # type: ignore[arg-type]


def test_importing_itemjournal_does_not_import_opentelemetry() -> None:
    script = (
        "import sys, itemjournal, itemjournal.testing\n"
        "assert not any(name.startswith('opentelemetry') for name in sys.modules), sorted(\n"
        "    name for name in sys.modules if name.startswith('opentelemetry'))\n"
        "import itemjournal.otel\n"
        "assert 'opentelemetry.trace' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
