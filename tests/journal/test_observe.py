"""What a journal tells about itself: its log records on the ``itemjournal`` logger, and
``journal.statistics()``."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from _faults import FaultyFileSystem

from itemjournal import (
    Claim,
    ConflictError,
    FileStore,
    Identity,
    Journal,
    JournalStatistics,
    Owner,
    Reuse,
    StorageFailed,
    UnresolvedClaim,
    definition_digest,
    input_digest,
)
from itemjournal._model.codec import encode_record
from itemjournal._model.records import Record
from itemjournal.testing import MemoryStore

pytestmark = pytest.mark.anyio

# A distinctive input: no log record may ever carry it, at any level.
SECRET_INPUT = "input-4be1c0-must-never-be-logged"
INPUTS: dict[str, str | int] = {"card": SECRET_INPUT, "cents": 1250}
OTHER_INPUTS: dict[str, str | int] = {"card": SECRET_INPUT, "cents": 1251}
DEFINITION = definition_digest("observe-v1")
RECEIPT = "receipt-9d27ab"
RESOLVED_RECEIPT = "receipt-5e80f3"


def ident(item: str) -> Identity:
    return Identity("shop", "billing", "charge", item)


def label(item: str) -> str:
    return f"shop/billing/charge/{item}"


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Capture every record of the ``itemjournal`` logger, DEBUG and up."""
    caplog.set_level(logging.DEBUG, logger="itemjournal")
    return caplog


def ours(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    return [record for record in records if record.name == "itemjournal"]


def everything_in(record: logging.LogRecord) -> str:
    """The record's message and every attribute, as text: what any handler could write."""
    return record.getMessage() + repr(vars(record))


def fields(record: logging.LogRecord) -> dict[str, object]:
    return {
        name.removeprefix("itemjournal_"): value
        for name, value in vars(record).items()
        if name.startswith("itemjournal_")
    }


async def dead_owner_record(store: MemoryStore, identity: Identity) -> None:
    """Plant a started record of ``identity`` whose owner (on this host) has exited."""
    me = await anyio.to_thread.run_sync(store.owner)
    gone = await anyio.to_thread.run_sync(_pid_of_an_exited_process)
    now = "2026-11-30T00:00:00.000000+00:00"
    record = Record(
        identity=identity,
        input_kind="sha256",
        input_hash=input_digest(INPUTS),
        definition_hash=DEFINITION,
        claim_id="c" * 32,
        status="started",
        receipt=None,
        attempt=1,
        created_at=now,
        updated_at=now,
        owner=Owner(me.host, gone, me.started_at, me.process),
        review_reason=None,
    ).advance("begin", "started", now)
    store.put_document(identity, encode_record(record))


def _pid_of_an_exited_process() -> int:
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


async def scripted_mix(journal: Journal) -> Claim:
    """A little of everything; returns the one claim it leaves open."""
    claim = await journal.begin(ident("a"), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    await journal.complete(claim, RECEIPT, result="the result")
    assert isinstance(await journal.begin(ident("a"), INPUTS, DEFINITION), Reuse)
    with pytest.raises(ConflictError, match="INPUT_CHANGED"):
        await journal.begin(ident("a"), OTHER_INPUTS, DEFINITION)

    assert isinstance(await journal.begin(ident("b"), INPUTS, DEFINITION), Claim)
    with pytest.raises(ConflictError, match="IN_PROGRESS"):
        await journal.begin(ident("b"), INPUTS, DEFINITION)
    await journal.mark_review(ident("b"), "the provider timed out")
    with pytest.raises(ConflictError, match="REVIEW_REQUIRED"):
        await journal.begin(ident("b"), INPUTS, DEFINITION)
    await journal.resolve(ident("b"), retry=True, note="the provider has no such charge")
    second = await journal.begin(ident("b"), INPUTS, DEFINITION)
    assert isinstance(second, Claim)
    with pytest.raises(ConflictError, match="IN_PROGRESS"):  # one answer after waiting
        await journal.begin(ident("b"), INPUTS, DEFINITION, wait=0.05)

    with pytest.raises(RuntimeError):
        async with journal.claim(ident("c"), INPUTS, DEFINITION):
            raise RuntimeError("the connection dropped")
    await journal.resolve(ident("c"), receipt=RESOLVED_RECEIPT, note="found in the dashboard")
    report = await journal.prune(timedelta(microseconds=1))
    assert sorted(view.identity.item for view in report.removed) == ["a", "c"]
    return second


# ------------------------------------------------------------------------ log records


async def test_every_transition_is_logged_after_it_landed_with_its_fields(
    journal: Journal, logged: pytest.LogCaptureFixture
) -> None:
    claim = await journal.begin(ident("first"), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    [claimed] = ours(logged.records)
    assert claimed.levelno == logging.DEBUG
    assert fields(claimed) == {
        "event": "claimed",
        "operation": "begin",
        "identity": label("first"),
        "key": claim.key,
        "status": "started",
        "previous": "absent",
        "attempt": 1,
        "claim_id": claim.claim_id,
    }
    assert claimed.getMessage() == f"claimed {label('first')} (attempt 1, absent -> started)"

    logged.clear()
    await scripted_mix(journal)
    seen = [
        (
            record.levelname,
            record.itemjournal_event,  # type: ignore[attr-defined]
            getattr(record, "itemjournal_identity", None),
            getattr(record, "itemjournal_status", None),
            getattr(record, "itemjournal_code", None),
        )
        for record in ours(logged.records)
    ]
    assert seen[:-3] == [
        ("DEBUG", "claimed", label("a"), "started", None),
        ("DEBUG", "completed", label("a"), "succeeded", None),
        ("DEBUG", "reused", label("a"), "succeeded", None),
        ("WARNING", "refused", label("a"), "succeeded", "INPUT_CHANGED"),
        ("DEBUG", "claimed", label("b"), "started", None),
        ("DEBUG", "refused", label("b"), "started", "IN_PROGRESS"),
        ("WARNING", "marked_review", label("b"), "needs_review", None),
        ("INFO", "refused", label("b"), "needs_review", "REVIEW_REQUIRED"),
        ("INFO", "resolved", label("b"), "released", None),
        ("DEBUG", "claimed", label("b"), "started", None),
        ("DEBUG", "refused", label("b"), "started", "IN_PROGRESS"),
        ("DEBUG", "claimed", label("c"), "started", None),
        ("WARNING", "marked_review", label("c"), "needs_review", None),
        ("INFO", "resolved", label("c"), "succeeded", None),
    ]
    assert sorted(seen[-3:-1]) == [  # removed in the store's order
        ("DEBUG", "pruned", label("a"), "absent", None),
        ("DEBUG", "pruned", label("c"), "absent", None),
    ]
    assert seen[-1] == ("INFO", "prune", None, None, None)

    by_event = {
        (fields(record)["event"], fields(record).get("identity")): record
        for record in ours(logged.records)
    }
    completed = fields(by_event["completed", label("a")])
    assert completed["receipt"] == RECEIPT
    assert (completed["previous"], completed["attempt"]) == ("started", 1)
    assert fields(by_event["reused", label("a")])["receipt"] == RECEIPT
    marked = fields(by_event["marked_review", label("c")])
    assert marked["operation"] == "claim_exit"
    assert marked["reason"] == "block raised RuntimeError: the connection dropped"
    resolved = fields(by_event["resolved", label("c")])
    assert resolved["note"] == "found in the dashboard"
    assert "receipt" not in resolved  # an INFO record: receipts only at DEBUG
    summary = fields(by_event["prune", None])
    assert (summary["removed"], summary["problems"], summary["dry_run"]) == (2, 0, False)


async def test_inputs_never_appear_and_receipts_only_at_debug(
    journal: Journal, logged: pytest.LogCaptureFixture
) -> None:
    await scripted_mix(journal)
    records = ours(logged.records)
    assert {record.levelno for record in records} == {logging.DEBUG, logging.INFO, logging.WARNING}
    for record in records:
        text = everything_in(record)
        assert SECRET_INPUT not in text
        assert "the result" not in text  # results are never logged either
        if record.levelno > logging.DEBUG:
            assert RECEIPT not in text
            assert RESOLVED_RECEIPT not in text
            assert not hasattr(record, "itemjournal_receipt")
    assert any(RECEIPT in everything_in(record) for record in records)


async def test_a_service_at_info_sees_no_receipt(
    journal: Journal, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="itemjournal")
    await scripted_mix(journal)
    records = ours(caplog.records)
    assert records
    assert all(record.levelno >= logging.INFO for record in records)
    assert not any(RECEIPT in everything_in(record) for record in records)
    assert not any(SECRET_INPUT in everything_in(record) for record in records)


async def test_a_quiet_logger_makes_no_record_and_still_counts(
    journal: Journal, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.CRITICAL, logger="itemjournal")
    await scripted_mix(journal)
    assert ours(caplog.records) == []
    assert journal.statistics().claims == 4


async def test_a_dead_owner_found_at_begin_and_a_sweep_are_warnings(
    anyio_backend: str, logged: pytest.LogCaptureFixture
) -> None:
    store = MemoryStore()
    journal = Journal(store)
    await dead_owner_record(store, ident("gone-at-begin"))
    with pytest.raises(ConflictError, match="REVIEW_REQUIRED"):
        await journal.begin(ident("gone-at-begin"), INPUTS, DEFINITION)
    await dead_owner_record(store, ident("gone-at-sweep"))
    report = await journal.sweep()
    assert [view.identity.item for view in report.marked] == ["gone-at-sweep"]

    seen = [(record.levelname, fields(record)) for record in ours(logged.records)]
    owner_gone, refused, swept, summary = seen
    assert owner_gone[0] == "WARNING"
    assert owner_gone[1] == {
        "event": "owner_gone",
        "operation": "begin",
        "identity": label("gone-at-begin"),
        "key": owner_gone[1]["key"],
        "status": "needs_review",
        "previous": "started",
        "attempt": 1,
        "claim_id": "c" * 32,
        "reason": "owner process gone",
    }
    assert (refused[0], refused[1]["code"]) == ("INFO", "REVIEW_REQUIRED")
    assert swept[0] == "WARNING"
    assert (swept[1]["event"], swept[1]["identity"]) == ("swept", label("gone-at-sweep"))
    assert swept[1]["reason"] == "owner process gone"
    assert summary == ("INFO", {"event": "sweep", "operation": "sweep", "marked": 1, "problems": 0})
    statistics = journal.statistics()
    assert (statistics.reviews, statistics.refusals, statistics.claims) == (2, 1, 0)


async def test_refused_completions_and_resolutions_are_logged(
    journal: Journal, logged: pytest.LogCaptureFixture
) -> None:
    claim = await journal.begin(ident("d"), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    await journal.mark_review(ident("d"), "operator stopped it")
    with pytest.raises(ConflictError, match="NOT_STARTED"):
        await journal.complete(claim, RECEIPT)
    with pytest.raises(ConflictError, match="NOT_IN_REVIEW"):
        await journal.resolve(ident("never"), retry=True, note="nothing there")
    refusals = [
        (record.levelname, fields(record)["operation"], fields(record)["code"])
        for record in ours(logged.records)
        if fields(record)["event"] == "refused"
    ]
    assert refusals == [
        ("WARNING", "complete", "NOT_STARTED"),  # an effect that may have happened, unrecorded
        ("INFO", "resolve", "NOT_IN_REVIEW"),
    ]
    assert journal.statistics().refusals == 0  # only begin's refusals are counted


class GatedSync(FaultyFileSystem):
    """Each armed fsync waits until the test lets it go, so a cancel lands mid-save; the
    faults of a ``FaultyFileSystem`` can be armed too."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.proceed = threading.Event()
        self.armed = False

    def fsync(self, fd: int) -> None:
        if self.armed:
            self.entered.set()
            self.proceed.wait(10)
        super().fsync(fd)


async def cancel_a_begin_mid_save(journal: Journal, fs: GatedSync, identity: Identity) -> None:
    """Begin; cancel it (natively, as asyncio web servers do) while its record is being
    saved: the claim never reaches the caller, so the journal takes it back."""
    import asyncio

    fs.armed = True
    task = asyncio.ensure_future(journal.begin(identity, INPUTS, DEFINITION))
    await anyio.to_thread.run_sync(fs.entered.wait)
    task.cancel()
    fs.armed = False
    fs.proceed.set()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_claim_taken_back_after_a_cancelled_begin(
    anyio_backend: str, root: Path, logged: pytest.LogCaptureFixture
) -> None:
    fs = GatedSync()
    store = FileStore(str(root), fs=fs)
    await store.open()
    async with Journal(store) as journal:
        await cancel_a_begin_mid_save(journal, fs, ident("cancelled"))
        assert (await journal.inspect(ident("cancelled"))).status == "absent"
        [withdrawn] = ours(logged.records)
        assert withdrawn.levelno == logging.DEBUG
        assert fields(withdrawn)["event"] == "withdrawn"
        assert (fields(withdrawn)["previous"], fields(withdrawn)["status"]) == ("started", "absent")
        assert journal.statistics() == JournalStatistics()  # never handed out: not a claim


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_claim_that_cannot_be_taken_back_is_a_storage_failure(
    anyio_backend: str, root: Path, logged: pytest.LogCaptureFixture
) -> None:
    fs = GatedSync()
    store = FileStore(str(root), fs=fs)
    await store.open()
    async with Journal(store) as journal:
        fs.fail("unlink", path=store.path_for(ident("stuck")), times=-1)
        await cancel_a_begin_mid_save(journal, fs, ident("stuck"))
        fs.heal()
        [failed] = ours(logged.records)
        assert failed.levelno == logging.WARNING
        assert fields(failed) == {
            "event": "storage_failed",
            "operation": "undo",
            "code": "STORAGE_FAILED",
            "identity": label("stuck"),
            "key": fields(failed)["key"],
        }
        assert journal.statistics().storage_failures == 1


async def test_every_operation_on_a_closed_store_is_a_storage_failure(
    anyio_backend: str, logged: pytest.LogCaptureFixture
) -> None:
    journal = Journal(MemoryStore())
    await journal.aclose()
    with pytest.raises(StorageFailed):
        await journal.begin(ident("z"), INPUTS, DEFINITION)
    with pytest.raises(StorageFailed):
        await journal.inspect(ident("z"))
    with pytest.raises(StorageFailed):
        await journal.sweep()
    with pytest.raises(StorageFailed):
        await journal.prune(timedelta(days=1))
    with pytest.raises(StorageFailed):
        await journal.verify()
    assert [
        (record.levelname, fields(record)["operation"], fields(record).get("identity"))
        for record in ours(logged.records)
    ] == [
        ("WARNING", "begin", label("z")),
        ("WARNING", "inspect", label("z")),
        ("WARNING", "sweep", None),
        ("WARNING", "prune", None),
        ("WARNING", "verify", None),
    ]
    assert ours(logged.records)[2].getMessage().startswith("sweep failed: MemoryStore(")
    logged.set_level(logging.ERROR, logger="itemjournal")
    with pytest.raises(StorageFailed):
        await journal.sweep()
    assert len(ours(logged.records)) == 5
    assert journal.statistics() == JournalStatistics(storage_failures=6)


async def test_a_storage_failure_is_counted_and_logged(
    anyio_backend: str, root: Path, logged: pytest.LogCaptureFixture
) -> None:
    fs = FaultyFileSystem()
    store = FileStore(str(root), fs=fs)
    await store.open()
    async with Journal(store) as journal:
        claim = await journal.begin(ident("e"), INPUTS, DEFINITION)
        assert isinstance(claim, Claim)
        fs.fail("fsync")
        with pytest.raises(StorageFailed):
            await journal.complete(claim, RECEIPT)
        fs.heal()
        failed = [record for record in ours(logged.records) if record.levelno == logging.WARNING]
        [record] = failed
        assert fields(record) == {
            "event": "storage_failed",
            "operation": "complete",
            "code": "STORAGE_FAILED",
            "identity": label("e"),
            "key": claim.key,
        }
        assert RECEIPT not in everything_in(record)
        statistics = journal.statistics()
        assert (statistics.storage_failures, statistics.in_flight) == (1, 1)
        await journal.complete(claim, RECEIPT)
        assert journal.statistics().in_flight == 0


# ------------------------------------------------------------------------ statistics


async def test_statistics_count_a_scripted_mix_exactly(journal: Journal) -> None:
    assert journal.statistics() == JournalStatistics()
    open_claim = await scripted_mix(journal)
    assert journal.statistics() == JournalStatistics(
        claims=4,  # a, b, b again after its release, c
        reuses=1,
        completions=1,
        reviews=2,  # b by mark_review, c by the claim block's exit
        resolutions=2,
        pruned=2,
        refusals=4,  # INPUT_CHANGED, IN_PROGRESS, REVIEW_REQUIRED, IN_PROGRESS after waiting
        storage_failures=0,
        in_flight=1,  # b's second claim
    )
    await journal.complete(open_claim, RECEIPT)
    after = journal.statistics()
    assert (after.completions, after.in_flight) == (2, 0)


async def test_statistics_are_a_frozen_snapshot(journal: Journal) -> None:
    before = journal.statistics()
    claim = await journal.begin(ident("f"), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    assert before.claims == 0  # a snapshot: it does not move with the journal
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.claims = 1  # type: ignore[misc]
    assert journal.statistics().in_flight == 1


async def test_each_journal_counts_for_itself(anyio_backend: str) -> None:
    store = MemoryStore()
    first, second = Journal(store), Journal(store)
    claim = await first.begin(ident("g"), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    with pytest.raises(ConflictError, match="IN_PROGRESS"):
        await second.begin(ident("g"), INPUTS, DEFINITION)
    assert (first.statistics().claims, first.statistics().refusals) == (1, 0)
    assert (second.statistics().claims, second.statistics().refusals) == (0, 1)


async def test_an_unresolved_claim_block_counts_as_a_review(journal: Journal) -> None:
    with pytest.raises(UnresolvedClaim):
        async with journal.claim(ident("h"), INPUTS, DEFINITION):
            pass
    statistics = journal.statistics()
    assert (statistics.claims, statistics.reviews, statistics.in_flight) == (1, 1, 0)


# ------------------------------------------------------------------- safe log messages

HOSTILE_REASON = "timeout\x1b]0;owned\x07\x1b[2J\r\nINFO fake: all fine\u202e\u200b\u2028"


async def test_log_messages_carry_hostile_text_escaped_and_fields_exact(
    journal: Journal, logged: pytest.LogCaptureFixture
) -> None:
    """A reason, a note or an exception's message reaches a log line only escaped: no log
    handler can be made to write a forged line or drive the terminal it writes to. The
    structured fields keep the text exactly, for programs."""
    claim = await journal.begin(ident("hostile"), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    await journal.mark_review(ident("hostile"), HOSTILE_REASON)
    with pytest.raises(ConflictError, match="REVIEW_REQUIRED"):
        await journal.begin(ident("hostile"), INPUTS, DEFINITION)
    await journal.resolve(ident("hostile"), retry=True, note=f"note {HOSTILE_REASON}")
    with pytest.raises(UnresolvedClaim):
        async with journal.claim(ident("raised"), INPUTS, DEFINITION):
            pass
    with pytest.raises(RuntimeError):
        async with journal.claim(ident("raised-too"), INPUTS, DEFINITION):
            raise RuntimeError(HOSTILE_REASON)
    records = ours(logged.records)
    assert len(records) >= 6
    for record in records:
        message = record.getMessage()
        assert message.isprintable(), repr(message)
    marked = next(r for r in records if fields(r)["event"] == "marked_review")
    assert marked.getMessage().endswith(
        ": timeout\\x1b]0;owned\\x07\\x1b[2J\\r\\nINFO fake: all fine\\u202e\\u200b\\u2028"
    )
    assert fields(marked)["reason"] == HOSTILE_REASON
    resolved = next(r for r in records if fields(r)["event"] == "resolved")
    assert fields(resolved)["note"] == f"note {HOSTILE_REASON}"
    assert "\\x1b]0;owned" in resolved.getMessage()


def _script_with_a_review_and_a_refusal(location: str, logging_setup: str) -> str:
    return f"""
import anyio, logging, itemjournal
{logging_setup}
async def main():
    async with await itemjournal.Journal.open({location!r}) as journal:
        identity = ("shop", "billing", "charge", "order-1")
        definition = itemjournal.definition_digest("v1")
        claim = await journal.begin(identity, {{"cents": 1}}, definition)
        await journal.mark_review(identity, "provider timed out")
        try:
            await journal.begin(identity, {{"cents": 2}}, definition)
        except itemjournal.ConflictError as refusal:
            assert refusal.code == "INPUT_CHANGED"
anyio.run(main)
"""


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_nothing_is_printed_unless_the_application_configures_logging(
    anyio_backend: str, tmp_path: Path
) -> None:
    """A library logs through a ``NullHandler``: without any logging set up, Python's
    last-resort handler never prints the journal's warnings on the application's stderr."""
    assert any(
        isinstance(handler, logging.NullHandler)
        for handler in logging.getLogger("itemjournal").handlers
    )
    quiet = await anyio.run_process(
        [sys.executable, "-c", _script_with_a_review_and_a_refusal(str(tmp_path / "a"), "")],
        check=False,
    )
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == b""
    configured = await anyio.run_process(
        [
            sys.executable,
            "-c",
            _script_with_a_review_and_a_refusal(str(tmp_path / "b"), "logging.basicConfig()"),
        ],
        check=False,
    )
    assert configured.returncode == 0, configured.stderr
    lines = configured.stderr.decode().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("WARNING:itemjournal:marked_review shop/billing/charge/order-1")
    assert lines[1].startswith("WARNING:itemjournal:begin of shop/billing/charge/order-1 refused")
