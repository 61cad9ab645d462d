"""Every row of the operations table (SPEC §3), on asyncio and trio."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from itemjournal import (
    Claim,
    ConflictError,
    FileStore,
    Identity,
    InvalidArgument,
    Journal,
    RecordView,
    Reuse,
    StorageFailed,
    definition_digest,
    input_digest,
)
from itemjournal._model.identity import identity_digest

if TYPE_CHECKING:
    from conftest import JournalFactory

pytestmark = pytest.mark.anyio
# The contract holds on both faces of the journal (tests/_faces.py).
FACES = ("async", "sync")

ITEM = ("shop", "billing", "charge", "order-1")
INPUTS = {"amount": "10.00", "currency": "EUR"}
V1 = definition_digest("billing-v1")
V2 = definition_digest("billing-v2")


async def claimed(journal: Journal, item: tuple[str, ...] = ITEM) -> Claim:
    outcome = await journal.begin(list(item), INPUTS, V1)
    assert isinstance(outcome, Claim)
    return outcome


async def in_review(journal: Journal) -> Claim:
    claim = await claimed(journal)
    await journal.mark_review(ITEM, "timeout")
    return claim


async def succeeded(journal: Journal) -> Claim:
    claim = await claimed(journal)
    await journal.complete(claim, "ch_1")
    return claim


async def expect(code: str, awaitable: object) -> ConflictError:
    with pytest.raises(ConflictError) as caught:
        await awaitable  # type: ignore[misc]
    assert caught.value.code == code
    assert isinstance(caught.value.view, RecordView)
    return caught.value


# ---------------------------------------------------------------- begin


async def test_begin_absent_makes_a_durable_started_record_first(journal: Journal) -> None:
    claim = await claimed(journal)
    assert claim.identity == Identity(*ITEM)
    assert claim.input_hash == input_digest(INPUTS)
    assert claim.definition_hash == V1
    assert len(claim.claim_id) == 32
    assert int(claim.claim_id, 16) >= 0
    assert claim.attempt == 1
    view = await journal.inspect(ITEM)
    assert view.status == "started"
    assert view.owner is not None
    assert view.owner.pid == os.getpid()
    assert view.owner_alive is True
    assert view.executed_here is False
    assert [e.event for e in view.history] == ["begin"]


async def test_claim_key_is_stable_per_identity(journal: Journal) -> None:
    first = await claimed(journal)
    await journal.mark_review(ITEM)
    await journal.resolve(ITEM, retry=True, note="provider says no charge")
    second = await claimed(journal)
    assert first.key == second.key
    assert first.claim_id != second.claim_id
    other = await claimed(journal, ("shop", "billing", "charge", "order-2"))
    assert other.key != first.key


async def test_begin_succeeded_same_fingerprints_reuses(journal: Journal) -> None:
    await succeeded(journal)
    outcome = await journal.begin(ITEM, dict(reversed(INPUTS.items())), V1)
    assert isinstance(outcome, Reuse)
    assert outcome.receipt == "ch_1"
    assert outcome.executed_here is False


@pytest.mark.parametrize("setup", [claimed, in_review, succeeded])
async def test_other_inputs_is_input_changed_before_anything_else(
    journal: Journal, setup: object
) -> None:
    await setup(journal)  # type: ignore[operator]
    error = await expect("INPUT_CHANGED", journal.begin(ITEM, {"amount": "11.00"}, V2))
    assert error.view is not None
    assert error.view.identity == Identity(*ITEM)


@pytest.mark.parametrize("setup", [claimed, in_review, succeeded])
async def test_other_definition_is_definition_changed(journal: Journal, setup: object) -> None:
    await setup(journal)  # type: ignore[operator]
    await expect("DEFINITION_CHANGED", journal.begin(ITEM, INPUTS, V2))


@pytest.mark.parametrize(
    ("setup", "status", "code"),
    [(claimed, "started", "IN_PROGRESS"), (in_review, "needs_review", "REVIEW_REQUIRED")],
)
async def test_running_work_is_in_progress_and_uncertain_work_needs_review(
    journal: Journal, setup: object, status: str, code: str
) -> None:
    await setup(journal)  # type: ignore[operator]
    error = await expect(code, journal.begin(ITEM, INPUTS, V1))
    assert error.view is not None
    assert error.view.status == status


async def test_released_record_is_claimable_with_its_own_fingerprints(journal: Journal) -> None:
    first = await in_review(journal)
    released = await journal.resolve(ITEM, retry=True, note="refund desk confirmed no charge")
    assert released.status == "released"
    second = await journal.begin(ITEM, {"amount": "12.00"}, V2)
    assert isinstance(second, Claim)
    assert second.attempt == 2
    assert second.input_hash == input_digest({"amount": "12.00"})
    view = await journal.complete(second, "ch_2")
    assert view.status == "succeeded"
    assert view.attempt == 2
    assert [e.event for e in view.history] == [
        "begin",
        "mark_review",
        "resolve",
        "begin",
        "complete",
    ]
    await expect("CLAIM_MISMATCH", journal.complete(first, "ch_1"))


# ---------------------------------------------------------------- complete


async def test_complete_stores_the_receipt(journal: Journal) -> None:
    claim = await claimed(journal)
    view = await journal.complete(claim, "ch_1")
    assert view.status == "succeeded"
    assert view.receipt == "ch_1"
    assert view.owner_alive is None
    assert view == await journal.inspect(ITEM)


@pytest.mark.parametrize("claim", [None, "claim", ITEM, {"claim_id": "x"}])
async def test_complete_needs_a_claim(journal: Journal, claim: object) -> None:
    with pytest.raises(InvalidArgument) as caught:
        await journal.complete(claim, "ch_1")  # type: ignore[arg-type]
    assert caught.value.code == "INVALID_CLAIM"


@pytest.mark.parametrize("receipt", ["", "   ", "r" * 201, None, 5, b"ch"])
async def test_complete_refuses_bad_receipts_and_writes_nothing(
    journal: Journal, receipt: object
) -> None:
    claim = await claimed(journal)
    with pytest.raises(InvalidArgument) as caught:
        await journal.complete(claim, receipt)  # type: ignore[arg-type]
    assert caught.value.code == "INVALID_RECEIPT"
    assert (await journal.inspect(ITEM)).status == "started"


async def test_longest_receipt_is_accepted(journal: Journal) -> None:
    view = await journal.complete(await claimed(journal), "r" * 200)
    assert view.receipt == "r" * 200


async def test_complete_of_absent_record_is_claim_mismatch(
    journal: Journal, make_journal: JournalFactory, tmp_path: Path
) -> None:
    claim = await claimed(journal)
    elsewhere = await Journal.open(str(tmp_path / "elsewhere"))
    await expect("CLAIM_MISMATCH", elsewhere.complete(claim, "ch_1"))


@pytest.mark.parametrize(
    "forgery",
    [
        {"claim_id": "0" * 32},
        {"input_hash": input_digest({"amount": "99"})},
        {"definition_hash": V2},
    ],
)
async def test_forged_claims_are_claim_mismatch(journal: Journal, forgery: dict[str, str]) -> None:
    claim = await claimed(journal)
    before = await journal.inspect(ITEM)
    await expect("CLAIM_MISMATCH", journal.complete(dataclasses.replace(claim, **forgery), "x"))
    assert await journal.inspect(ITEM) == before


async def test_second_completion_is_not_started(journal: Journal) -> None:
    claim = await succeeded(journal)
    error = await expect("NOT_STARTED", journal.complete(claim, "ch_again"))
    assert error.view is not None
    assert error.view.receipt == "ch_1"


async def test_completion_after_review_is_not_started(journal: Journal) -> None:
    claim = await in_review(journal)
    await expect("NOT_STARTED", journal.complete(claim, "ch_late"))


# ---------------------------------------------------------------- mark_review


async def test_mark_review_of_started(journal: Journal) -> None:
    await claimed(journal)
    view = await journal.mark_review(ITEM, "gateway timeout")
    assert view.status == "needs_review"
    assert view.review_reason == "gateway timeout"
    assert view.history[-1].note == "gateway timeout"


async def test_mark_review_without_reason(journal: Journal) -> None:
    await claimed(journal)
    view = await journal.mark_review(ITEM)
    assert view.status == "needs_review"
    assert view.review_reason


@pytest.mark.parametrize("setup", [None, in_review, succeeded])
async def test_mark_review_of_anything_else_is_not_started(journal: Journal, setup: object) -> None:
    if setup is not None:
        await setup(journal)  # type: ignore[operator]
    await expect("NOT_STARTED", journal.mark_review(ITEM))


@pytest.mark.parametrize("reason", ["", " ", "x" * 501, 3])
async def test_mark_review_refuses_bad_reasons(journal: Journal, reason: object) -> None:
    await claimed(journal)
    with pytest.raises(InvalidArgument) as caught:
        await journal.mark_review(ITEM, reason)  # type: ignore[arg-type]
    assert caught.value.code == "INVALID_ARGUMENT"
    assert (await journal.inspect(ITEM)).status == "started"


# ---------------------------------------------------------------- resolve


async def test_resolve_with_receipt_succeeds_and_is_audited(journal: Journal) -> None:
    await in_review(journal)
    view = await journal.resolve(ITEM, receipt="ch_found", note="found in provider dashboard")
    assert view.status == "succeeded"
    assert view.receipt == "ch_found"
    assert view.history[-1].event == "resolve"
    assert view.history[-1].note == "found in provider dashboard"
    assert isinstance(await journal.begin(ITEM, INPUTS, V1), Reuse)


async def test_resolve_with_retry_releases(journal: Journal) -> None:
    await in_review(journal)
    view = await journal.resolve(ITEM, retry=True, note="no charge at provider")
    assert view.status == "released"
    assert view.receipt is None


@pytest.mark.parametrize("setup", [None, claimed, succeeded])
async def test_resolve_outside_review_is_not_in_review(journal: Journal, setup: object) -> None:
    if setup is not None:
        await setup(journal)  # type: ignore[operator]
    await expect("NOT_IN_REVIEW", journal.resolve(ITEM, retry=True, note="n"))


@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({"note": "n"}, "INVALID_ARGUMENT"),
        ({"receipt": "r", "retry": True, "note": "n"}, "INVALID_ARGUMENT"),
        ({"retry": 1, "note": "n"}, "INVALID_ARGUMENT"),
        ({"retry": True, "note": ""}, "INVALID_ARGUMENT"),
        ({"retry": True, "note": None}, "INVALID_ARGUMENT"),
        ({"receipt": " ", "note": "n"}, "INVALID_RECEIPT"),
    ],
)
async def test_resolve_argument_errors(
    journal: Journal, kwargs: dict[str, object], code: str
) -> None:
    await in_review(journal)
    with pytest.raises(InvalidArgument) as caught:
        await journal.resolve(ITEM, **kwargs)  # type: ignore[arg-type]
    assert caught.value.code == code
    assert (await journal.inspect(ITEM)).status == "needs_review"


# ---------------------------------------------------------------- inspect, open, keys


async def test_inspect_absent(journal: Journal) -> None:
    view = await journal.inspect(ITEM)
    key = identity_digest(Identity(*ITEM))
    assert view == RecordView(identity=Identity(*ITEM), status="absent", key=key)
    assert (view.receipt, view.attempt, view.history, view.owner) == (None, 0, (), None)
    assert view.key == key  # the same token a Claim would carry


async def test_open_needs_an_absolute_directory() -> None:
    for location in ("relative/dir", "", Path("rel")):
        with pytest.raises(InvalidArgument) as caught:
            await Journal.open(location)
        assert caught.value.code == "ABSOLUTE_ROOT_REQUIRED"
    with pytest.raises(InvalidArgument):
        await Journal.open(42)  # type: ignore[arg-type]


async def test_files_are_private(journal: Journal, root: Path, file_only: None) -> None:
    claim = await claimed(journal)
    path = journal.store.path_for(claim.identity)  # type: ignore[attr-defined]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.parent.parent == root
    assert path.name == f"{claim.key}.json"
    assert sorted(p.name for p in path.parent.iterdir()) == [".lock", path.name]


async def test_inputs_are_never_stored_in_plain_text(
    journal: Journal, root: Path, on_disk: None
) -> None:
    secret = "4242-4242-4242-4242"
    claim = await journal.begin(ITEM, {"card": secret}, V1)
    assert isinstance(claim, Claim)
    await journal.complete(claim, "ch_1")
    stored = [path.read_bytes() for path in root.rglob("*") if path.is_file()]
    assert any(b"ch_1" in data for data in stored)  # the search does see what is stored
    assert not any(secret.encode() in data for data in stored)


async def test_keyed_and_plain_journals_do_not_mistake_each_other(
    make_journal: JournalFactory, location: str
) -> None:
    keyed = await make_journal(input_key=b"k" * 32)
    assert keyed.input_kind.startswith("hmac-sha256:")
    claim = await keyed.begin(ITEM, INPUTS, V1)
    assert isinstance(claim, Claim)
    assert claim.input_hash != input_digest(INPUTS)
    await keyed.complete(claim, "ch_1")
    assert isinstance(await keyed.begin(ITEM, INPUTS, V1), Reuse)
    await expect("INPUT_CHANGED", keyed.begin(ITEM, {"amount": "1"}, V1))
    # The location itself refuses another kind at open...
    for other in (None, b"o" * 32):
        with pytest.raises(ConflictError) as refused:
            await Journal.open(location, input_key=other)
        assert refused.value.code == "INPUT_KEY_MISMATCH"
    # ...and each record still names its own kind, for a journal made over the store
    # directly (or a location older than its recorded kind).
    plain = Journal(keyed.store)
    other_key = Journal(keyed.store, input_key=b"o" * 32)
    await expect("INPUT_KEY_MISMATCH", plain.begin(ITEM, INPUTS, V1))
    await expect("INPUT_KEY_MISMATCH", other_key.begin(ITEM, INPUTS, V1))


async def test_bad_input_key_is_refused_before_touching_disk(root: Path) -> None:
    with pytest.raises(InvalidArgument):
        await Journal.open(str(root), input_key=b"short")
    assert not root.exists()


async def test_reopening_through_a_second_journal(make_journal: JournalFactory) -> None:
    first = await make_journal()
    claim = await claimed(first)
    second = await make_journal()
    await expect("IN_PROGRESS", second.begin(ITEM, INPUTS, V1))
    view = await second.complete(claim, "ch_1")
    assert view.status == "succeeded"
    outcome = await first.begin(ITEM, INPUTS, V1)
    assert isinstance(outcome, Reuse)
    assert outcome.receipt == "ch_1"


async def test_a_new_process_reuses_the_receipt_and_refuses_unresolved_work(
    journal: Journal, location: str, anyio_backend: str
) -> None:
    await succeeded(journal)
    await journal.begin(("shop", "billing", "charge", "order-2"), INPUTS, V1)
    script = textwrap.dedent(
        f"""
        import anyio, itemjournal as ij
        async def main():
            journal = await ij.Journal.open({location!r})
            done = await journal.begin({ITEM!r}, {INPUTS!r}, {V1!r})
            print(type(done).__name__, done.receipt, done.executed_here)
            try:
                await journal.begin(("shop", "billing", "charge", "order-2"), {INPUTS!r}, {V1!r})
            except ij.ConflictError as error:
                print(error.code, error.view.status, error.view.owner_alive)
        anyio.run(main, backend={anyio_backend!r})
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.split("\n")[:2] == [
        "Reuse ch_1 False",
        "IN_PROGRESS started True",
    ]


async def test_every_public_call_is_a_checkpoint(journal: Journal) -> None:
    import anyio

    await succeeded(journal)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await journal.begin(ITEM, INPUTS, V1)
        pytest.fail("begin did not checkpoint")  # pragma: no cover


async def test_store_accepts_pathlike_and_normalises(root: Path) -> None:
    store = FileStore(root / "a" / ".." / "b")
    assert store.location == str(root / "b")
    assert repr(store) == f"FileStore({str(root / 'b')!r})"


async def test_journal_as_async_context_manager(root: Path) -> None:
    async with await Journal.open(str(root)) as journal:
        assert repr(journal) == f"Journal(FileStore({str(root)!r}))"
        assert journal.input_kind == "sha256"
        await claimed(journal)


async def test_claim_block_settled_through_the_journal_directly(journal: Journal) -> None:
    async with journal.claim(ITEM, INPUTS, V1) as attempt:
        assert attempt.claim is not None
        await journal.complete(attempt.claim, "ch_direct")
    assert (await journal.inspect(ITEM)).receipt == "ch_direct"


class Unwritable(FileStore):
    """A store whose saves fail after the claim was granted."""

    broken = False

    async def apply(self, identity, step):  # type: ignore[no-untyped-def]
        if self.broken:
            raise StorageFailed("disk gone")
        return await super().apply(identity, step)


async def test_claim_block_whose_review_mark_fails(root: Path) -> None:
    store = Unwritable(str(root))
    await store.open()
    journal = Journal(store)
    with pytest.raises(ValueError, match="body") as caught:
        async with journal.claim(ITEM, INPUTS, V1):
            store.broken = True
            raise ValueError("body")
    assert any("could not mark" in note for note in caught.value.__notes__)
    store.broken = False
    assert (await journal.inspect(ITEM)).status == "started"
    with pytest.raises(StorageFailed):
        async with journal.claim(("shop", "billing", "charge", "order-9"), INPUTS, V1):
            store.broken = True
    store.broken = False


@pytest.mark.parametrize(
    ("location", "code"),
    [
        ("/tmp/with\0nul", "ABSOLUTE_ROOT_REQUIRED"),
        ("sqlite:///tmp/with\0nul.db", "ABSOLUTE_ROOT_REQUIRED"),
        ("https://example.invalid/journal", "ABSOLUTE_ROOT_REQUIRED"),
        ("sqlite:relative.db", "ABSOLUTE_ROOT_REQUIRED"),
    ],
)
async def test_locations_that_cannot_be_opened(location: str, code: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        await Journal.open(location)
    assert caught.value.code == code


async def test_path_for_takes_any_identity_shape(root: Path) -> None:
    store = FileStore(str(root))
    assert store.path_for(list(ITEM)) == store.path_for(Identity(*ITEM))
    with pytest.raises(InvalidArgument):
        store.path_for(("a", "b", "c"))


async def test_a_closed_journal_refuses_calls(journal: Journal) -> None:
    claim = await claimed(journal)
    await journal.aclose()
    await journal.aclose()  # closing twice is fine
    for call in (
        lambda: journal.inspect(ITEM),
        lambda: journal.begin(ITEM, INPUTS, V1),
        lambda: journal.complete(claim, "r"),
        journal.sweep,
    ):
        with pytest.raises(StorageFailed, match="closed"):
            await call()
