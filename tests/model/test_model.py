"""The journal against a small pure-Python model of the operations table (SPEC §3).

A Hypothesis ``RuleBasedStateMachine`` drives one ``Journal`` through begin, complete
(with granted, stale and forged claims), mark_review, resolve, inspect, an orderly
reopen and a simulated crash, on a few identities, two input sets and two definitions.
After every step the outcome (what came back, or the error code) and ``inspect`` of the
identity involved must be exactly what the model says; after a reopen or a crash every
identity must be, since every acknowledged operation is durable. Every such ``inspect``
reads the record strictly, as a new process would (the decode cache is cleared first).

The journal is async and the state machine is not: each machine talks to its journal
through an anyio blocking portal, whose event loop runs in another thread, once per
anyio backend. Every example gets a fresh directory, removed in teardown, outside the loop.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import _builders
import pytest
from _builders import NOW, started_record
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    rule,
    run_state_machine_as_test,
)

from itemjournal import (
    Claim,
    ConflictError,
    Identity,
    InvalidArgument,
    Journal,
    JournalError,
    RecordView,
    Reuse,
    definition_digest,
    input_digest,
)
from itemjournal._model import machine
from itemjournal._model.codec import clear_decode_cache
from itemjournal._model.identity import identity_digest
from itemjournal._model.records import HISTORY_LIMIT
from itemjournal._stores.files.temps import _parse_writer_token, _writer_token

IDENTITIES = (
    Identity("shop", "billing", "charge", "order-1"),
    Identity("shop", "mail", "send", "welcome.7"),
)
# Two input sets; the first one spelled in two key orders (key order never matters),
# the second differs from it only by a space (whitespace inside values does).
INPUT_SETS: tuple[tuple[Mapping[str, str], ...], ...] = (
    ({"amount": "10.00", "currency": "EUR"}, {"currency": "EUR", "amount": "10.00"}),
    ({"amount": "10.00 ", "currency": "EUR"},),
)
INPUT_HASHES = tuple(input_digest(spellings[0]) for spellings in INPUT_SETS)
DEFINITIONS = (definition_digest("billing-v1"), definition_digest("billing-v2"))
# Choices weighted toward the usual case, a rerun with the same fingerprints, so that
# runs get past the first claim; the other set and definition still come up often.
INPUT_CHOICES = (
    (0, INPUT_SETS[0][0]),
    (0, INPUT_SETS[0][1]),
    (0, INPUT_SETS[0][0]),
    (1, INPUT_SETS[1][0]),
)
DEFINITION_CHOICES = (DEFINITIONS[0], DEFINITIONS[0], DEFINITIONS[0], DEFINITIONS[1])
RECEIPTS = ("ch_1", "ch_2", "  padded  ", "reçu-✓ №7", "r" * 200)
BAD_RECEIPTS = ("", "   ", "\n\t", "r" * 201)
REASONS = (None, "timeout", "gateway said 502 ✗")
NOTES = ("checked the gateway: charged", "no charge found; retry")

# How complete() is given its arguments: a claim as granted (most often), a claim forged
# in one field, a bad receipt, or something that is not a Claim at all.
FORGERIES = (
    *("granted",) * 4,
    "claim_id",
    "input_hash",
    "definition_hash",
    "identity",
    "bad receipt",
    "not a claim",
)

# Every API takes an Identity, a plain 4-tuple or a 4-list.
SHAPES: tuple[Callable[[Identity], object], ...] = (lambda i: i, tuple, list)
AIM = st.sampled_from((True, True, True, False))  # aim a call at a record it can change
PICK = st.integers(min_value=0, max_value=63)  # which remembered claim, modulo their number

MAX_EXAMPLES = 500  # per backend
STEPS = 20
SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    database=None,  # no example database: every run explores afresh and writes nothing
    suppress_health_check=[HealthCheck.too_slow],
)

ANY = object()  # a model value that matches whatever the journal chose


# ---------------------------------------------------------------------- the model


@dataclass
class ModelRecord:
    status: str
    input_hash: str
    definition_hash: str
    attempt: int
    claim_id: str
    receipt: str | None = None
    review_reason: object = None
    history: list[tuple[str, str, int, object]] = field(default_factory=list)
    created_at: str | None = None  # learned from the journal's first view

    def advance(self, event: str, status: str, note: object = None) -> None:
        self.status = status
        self.history.append((event, status, self.attempt, note))
        del self.history[:-HISTORY_LIMIT]


@dataclass(frozen=True)
class Outcome:
    """What the model expects from one call: a kind and its detail."""

    kind: str  # "claim", "reuse", "view" or "error"
    detail: Any = None  # attempt, receipt, status or error code


class Model:
    """The operations table of SPEC §3, nothing more."""

    def __init__(self) -> None:
        self.records: dict[Identity, ModelRecord] = {}

    def status(self, identity: Identity) -> str:
        record = self.records.get(identity)
        return "absent" if record is None else record.status

    def begin(
        self, identity: Identity, input_hash: str, definition_hash: str, claim_id: str | None
    ) -> Outcome:
        """``claim_id`` is what the journal granted (None when it granted nothing)."""
        current = self.records.get(identity)
        if current is None or current.status == "released":
            if claim_id is None:
                return Outcome("claim")
            if current is None:
                current = self.records[identity] = ModelRecord(
                    "absent", input_hash, definition_hash, 0, claim_id
                )
            # A released record's next attempt carries its own fingerprints.
            current.input_hash = input_hash
            current.definition_hash = definition_hash
            current.claim_id = claim_id
            current.attempt += 1
            current.receipt = None
            current.review_reason = None
            current.advance("begin", "started")
            return Outcome("claim", current.attempt)
        if current.input_hash != input_hash:  # checked before definition and status
            return Outcome("error", "INPUT_CHANGED")
        if current.definition_hash != definition_hash:
            return Outcome("error", "DEFINITION_CHANGED")
        if current.status == "succeeded":
            return Outcome("reuse", current.receipt)
        if current.status == "started":  # its owner, this process, lives
            return Outcome("error", "IN_PROGRESS")
        return Outcome("error", "REVIEW_REQUIRED")

    def complete(self, claim: object, receipt: str, receipt_ok: bool) -> Outcome:
        if not isinstance(claim, Claim):
            return Outcome("error", "INVALID_CLAIM")
        if not receipt_ok:
            return Outcome("error", "INVALID_RECEIPT")
        current = self.records.get(claim.identity)
        if current is None or (
            current.claim_id,
            current.input_hash,
            current.definition_hash,
        ) != (claim.claim_id, claim.input_hash, claim.definition_hash):
            return Outcome("error", "CLAIM_MISMATCH")
        if current.status != "started":
            return Outcome("error", "NOT_STARTED")
        current.receipt = receipt
        current.advance("complete", "succeeded")
        return Outcome("view", "succeeded")

    def mark_review(self, identity: Identity, reason: str | None) -> Outcome:
        current = self.records.get(identity)
        if current is None or current.status != "started":
            return Outcome("error", "NOT_STARTED")
        current.review_reason = ANY if reason is None else reason
        current.advance("mark_review", "needs_review", current.review_reason)
        return Outcome("view", "needs_review")

    def resolve(self, identity: Identity, receipt: str | None, note: str) -> Outcome:
        current = self.records.get(identity)
        if current is None or current.status != "needs_review":
            return Outcome("error", "NOT_IN_REVIEW")
        if receipt is not None:
            current.receipt = receipt
            current.advance("resolve", "succeeded", note)
            return Outcome("view", "succeeded")
        current.advance("resolve", "released", note)
        return Outcome("view", "released")


def same(expected: object, actual: object) -> bool:
    return expected is ANY or expected == actual


# ---------------------------------------------------------------------- the machine


async def cold_inspect(journal: Journal, identity: Identity) -> RecordView:
    """``inspect`` as a new process would read the record: strictly, not from memory.

    The writing process remembers every document it wrote (the decode cache), and a
    read of the same bytes would be answered from there; a record the writer produced
    but the strict reader refuses would go unnoticed. Every read that checks what was
    written therefore forgets first.
    """
    clear_decode_cache()
    return await journal.inspect(identity)


COUNTS = {"examples": 0, "steps": 0}
SEEN: Counter[str] = Counter()  # outcomes reached, so a run shows it covered the table

# Every row of the table a run must have reached at least once.
ROWS = (
    "claim",
    "claim after release",
    "reuse",
    "succeeded",
    "needs_review",
    "released",
    "INPUT_CHANGED",
    "DEFINITION_CHANGED",
    "IN_PROGRESS",
    "REVIEW_REQUIRED",
    "CLAIM_MISMATCH",
    "NOT_STARTED",
    "NOT_IN_REVIEW",
    "INVALID_CLAIM",
    "INVALID_RECEIPT",
)


class JournalMachine(RuleBasedStateMachine):
    portal: ClassVar[BlockingPortal]
    scratch: ClassVar[str | None] = None  # where temp directories go (tmpfs when present)

    def __init__(self) -> None:
        super().__init__()
        COUNTS["examples"] += 1
        self.root = tempfile.mkdtemp(prefix="itemjournal-model-", dir=self.scratch)
        self.model = Model()
        self.claims: list[Claim] = []
        self.journal: Journal | None = None

    # ------------------------------------------------------------------ plumbing

    def call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        async def run() -> Any:
            return await function(*args, **kwargs)

        return self.portal.call(run)

    @property
    def open_journal(self) -> Journal:
        assert self.journal is not None
        return self.journal

    def attempt(
        self, identity: Identity, function: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> tuple[Any, RecordView]:
        """The call's return value (or the JournalError it raised), then ``inspect(identity)``.

        Both in one trip through the portal: a step costs one hand-off to the loop.
        """
        COUNTS["steps"] += 1
        journal = self.open_journal

        async def run() -> tuple[Any, RecordView]:
            try:
                outcome = await function(*args, **kwargs)
            except JournalError as error:
                outcome = error
            return outcome, await cold_inspect(journal, identity)

        result: tuple[Any, RecordView] = self.portal.call(run)
        return result

    def check_outcome(self, identity: Identity, expected: Outcome, actual: object) -> None:
        self.check_outcome_kind(identity, expected, actual)
        if expected.kind == "error":
            SEEN[expected.detail] += 1
        elif expected.kind == "claim":
            SEEN["claim" if expected.detail == 1 else "claim after release"] += 1
        else:
            SEEN["reuse" if expected.kind == "reuse" else expected.detail] += 1

    def check_outcome_kind(self, identity: Identity, expected: Outcome, actual: object) -> None:
        if expected.kind == "error":
            assert isinstance(actual, JournalError), (expected, actual)
            assert actual.code == expected.detail, (expected, actual)
            if isinstance(actual, ConflictError):  # conflict errors carry the record's view
                assert isinstance(actual.view, RecordView)
                assert actual.view.status == self.model.status(identity)
            else:
                assert isinstance(actual, InvalidArgument)
                assert isinstance(actual, ValueError)
        elif expected.kind == "claim":
            assert isinstance(actual, Claim), (expected, actual)
            record = self.model.records[identity]
            assert actual.identity == identity
            assert type(actual.identity) is Identity
            assert actual.attempt == expected.detail == record.attempt
            assert actual.claim_id == record.claim_id
            assert (actual.input_hash, actual.definition_hash) == (
                record.input_hash,
                record.definition_hash,
            )
            assert actual.key == identity_digest(identity)  # stable across attempts
        elif expected.kind == "reuse":
            assert isinstance(actual, Reuse), (expected, actual)
            assert actual.receipt == expected.detail
            assert actual.executed_here is False
            assert actual.attempt == self.model.records[identity].attempt
        else:
            assert isinstance(actual, RecordView), (expected, actual)
            assert actual.status == expected.detail
            self.check_view(identity, actual)

    def check_view(self, identity: Identity, view: RecordView) -> None:
        assert view.executed_here is False
        record = self.model.records.get(identity)
        if record is None:
            assert view == RecordView(
                identity=identity, status="absent", key=identity_digest(identity)
            )
            return
        assert view.identity == identity
        assert (view.status, view.receipt, view.attempt) == (
            record.status,
            record.receipt,
            record.attempt,
        )
        assert same(record.review_reason, view.review_reason)
        if record.review_reason is ANY:
            assert isinstance(view.review_reason, str)
            assert view.review_reason.strip()
        history = [(e.event, e.status, e.attempt, e.note) for e in view.history]
        assert len(history) == len(record.history)
        for want, got in zip(record.history, history, strict=True):
            assert want[:3] == got[:3], (record.history, history)
            assert same(want[3], got[3]), (record.history, history)
        if record.created_at is None:
            record.created_at = view.created_at
        assert view.created_at == record.created_at  # kept across attempts and reopens
        assert view.history[-1].at == view.updated_at
        if view.status == "started":
            assert view.owner is not None
            assert view.owner.pid == os.getpid()
            assert view.owner_alive is True
        else:
            assert view.owner_alive is None

    def check(self, identity: Identity) -> None:
        view = self.call(cold_inspect, self.open_journal, identity)
        assert isinstance(view, RecordView)
        self.check_view(identity, view)

    # ------------------------------------------------------------------ rules

    @initialize(first=st.lists(st.sampled_from(IDENTITIES), unique=True, max_size=2))
    def start(self, first: list[Identity]) -> None:
        """Open the journal; usually claim an identity or two right away.

        Hypothesis leaves some rules out of whole examples (swarm testing); a claim made
        here gives even an example without ``begin`` a record to complete, review and
        resolve.
        """
        self.journal = self.call(Journal.open, self.root)
        for which in first:
            self.begin(which, False, tuple, INPUT_CHOICES[0], DEFINITIONS[0])

    @rule(
        which=st.sampled_from(IDENTITIES),
        aim=AIM,
        shape=st.sampled_from(SHAPES),
        inputs=st.sampled_from(INPUT_CHOICES),
        definition=st.sampled_from(DEFINITION_CHOICES),
    )
    def begin(
        self,
        which: Identity,
        aim: bool,
        shape: Callable[[Identity], object],
        inputs: tuple[int, Mapping[str, str]],
        definition: str,
    ) -> None:
        which = self.aimed(which, "released") if aim else which
        input_hash = INPUT_HASHES[inputs[0]]
        outcome, view = self.attempt(
            which, self.open_journal.begin, shape(which), inputs[1], definition
        )
        granted = outcome.claim_id if isinstance(outcome, Claim) else None
        expected = self.model.begin(which, input_hash, definition, granted)
        if isinstance(outcome, Claim):
            self.claims.append(outcome)
        self.check_outcome(which, expected, outcome)
        self.check_view(which, view)

    @rule(
        pick=PICK,
        latest=st.booleans(),
        forgery=st.sampled_from(FORGERIES),
        receipt=st.sampled_from(RECEIPTS),
    )
    def complete(self, pick: int, latest: bool, forgery: str, receipt: str) -> None:
        """With the latest claim or a stale one from an earlier attempt, or a forged one."""
        claim: object
        if not self.claims or forgery == "not a claim":
            which = IDENTITIES[pick % len(IDENTITIES)]
            claim = {"identity": which, "claim_id": "f" * 32}  # looks like one; is not
            outcome, view = self.attempt(which, self.open_journal.complete, claim, receipt)
            self.check_outcome(which, self.model.complete(claim, receipt, True), outcome)
            self.check_view(which, view)
            return
        granted = self.claims[-1 if latest else pick % len(self.claims)]
        claim = granted
        receipt_ok = True
        if forgery == "bad receipt":
            receipt, receipt_ok = BAD_RECEIPTS[pick % len(BAD_RECEIPTS)], False
        elif forgery == "claim_id":
            claim = dataclasses.replace(granted, claim_id="f" * 32)
        elif forgery == "input_hash":
            other = INPUT_HASHES[1 - INPUT_HASHES.index(granted.input_hash)]
            claim = dataclasses.replace(granted, input_hash=other)
        elif forgery == "definition_hash":
            other = DEFINITIONS[1 - DEFINITIONS.index(granted.definition_hash)]
            claim = dataclasses.replace(granted, definition_hash=other)
        elif forgery == "identity":
            others = [i for i in IDENTITIES if i != granted.identity]
            claim = dataclasses.replace(granted, identity=others[pick % len(others)])
        assert isinstance(claim, Claim)
        expected = self.model.complete(claim, receipt, receipt_ok)
        outcome, view = self.attempt(claim.identity, self.open_journal.complete, claim, receipt)
        self.check_outcome(claim.identity, expected, outcome)
        self.check_view(claim.identity, view)

    @rule(which=st.sampled_from(IDENTITIES), aim=AIM, reason=st.sampled_from(REASONS))
    def mark_review(self, which: Identity, aim: bool, reason: str | None) -> None:
        which = self.aimed(which, "started") if aim else which
        expected = self.model.mark_review(which, reason)
        outcome, view = self.attempt(which, self.open_journal.mark_review, list(which), reason)
        self.check_outcome(which, expected, outcome)
        self.check_view(which, view)

    @rule(
        which=st.sampled_from(IDENTITIES),
        aim=AIM,
        receipt=st.sampled_from((None, None, *RECEIPTS[:2])),  # retry, retry, receipts
        note=st.sampled_from(NOTES),
    )
    def resolve(self, which: Identity, aim: bool, receipt: str | None, note: str) -> None:
        which = self.aimed(which, "needs_review") if aim else which
        expected = self.model.resolve(which, receipt, note)
        if receipt is None:
            outcome, view = self.attempt(
                which, self.open_journal.resolve, which, retry=True, note=note
            )
        else:
            outcome, view = self.attempt(
                which, self.open_journal.resolve, which, receipt=receipt, note=note
            )
        self.check_outcome(which, expected, outcome)
        self.check_view(which, view)

    @rule(which=st.sampled_from(IDENTITIES))
    def inspect(self, which: Identity) -> None:
        COUNTS["steps"] += 1
        self.check(which)

    @rule()
    def reopen(self) -> None:
        """An orderly restart: close, then open a new Journal over the same directory."""
        COUNTS["steps"] += 1
        self.call(self.open_journal.aclose)
        self.journal = self.call(Journal.open, self.root)
        self.check_all()

    @rule(torn_save=st.booleans())
    def crash(self, torn_save: bool) -> None:
        """The process dies between operations: the Journal is dropped, never closed.

        With ``torn_save`` it died inside a save that was never acknowledged, leaving the
        temp file of a writer that is gone. A new process opens the directory: the state
        is exactly what was acknowledged, and the torn temp file is swept.
        """
        COUNTS["steps"] += 1
        self.journal = None  # no aclose, nothing flushed on the way out
        if torn_save:
            self.plant_torn_temp()
        self.journal = self.call(Journal.open, self.root)
        self.check_all()
        assert self.temp_files() == []

    # ------------------------------------------------------------------ helpers

    def aimed(self, which: Identity, status: str) -> Identity:
        """An identity whose record is in ``status``, if there is one; else ``which``.

        Left to chance, most calls would hit a record in the wrong state (Hypothesis also
        leaves some rules out of whole examples); aiming most of them at a record they can
        change reaches the deeper rows of the table: a release, and the attempt after it.
        """
        candidates = [i for i in IDENTITIES if self.model.status(i) == status]
        return candidates[IDENTITIES.index(which) % len(candidates)] if candidates else which

    def check_all(self) -> None:
        journal = self.open_journal

        async def views() -> list[RecordView]:
            return [await cold_inspect(journal, identity) for identity in IDENTITIES]

        for identity, view in zip(IDENTITIES, self.portal.call(views), strict=True):
            self.check_view(identity, view)

    def plant_torn_temp(self) -> None:
        directory = Path(self.root, identity_digest(IDENTITIES[0])[:2])
        directory.mkdir(mode=0o700, exist_ok=True)
        # A writer of this boot and pid namespace, named the way writers name themselves,
        # whose pid is beyond any Linux pid_max: well-formed, and surely gone.
        token = _writer_token()
        assert _parse_writer_token(token) is not None
        dead_pid = 2**22 + 1
        torn = directory / f".{dead_pid}-{token}-{'cd' * 16}.tmp"
        torn.write_bytes(b'{"version": 1, "identity": ["shop", "bil')
        old = time.time() - 3600
        os.utime(torn, (old, old))

    def temp_files(self) -> list[str]:
        return [
            name
            for _, _, names in os.walk(self.root)
            for name in names
            if name.startswith(".") and name.endswith(".tmp")
        ]

    def teardown(self) -> None:
        try:
            if self.journal is not None:
                self.call(self.journal.aclose)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)  # in this thread, not in the loop


def scratch_directory() -> str | None:
    """tmpfs when there is one (fsync costs nothing there), else the default temp dir.

    Durability across real crashes is the crash simulator's business; this test checks
    the operations table and that a new Journal reads back what was acknowledged.
    """
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


def test_journal_matches_the_model(anyio_backend: str) -> None:
    COUNTS.update(examples=0, steps=0)
    SEEN.clear()
    started = time.perf_counter()
    with start_blocking_portal(anyio_backend) as portal:
        JournalMachine.portal = portal
        JournalMachine.scratch = scratch_directory()
        run_state_machine_as_test(JournalMachine, settings=SETTINGS)
    elapsed = time.perf_counter() - started
    print(
        f"\n[model/{anyio_backend}] {COUNTS['examples']} examples, "
        f"{COUNTS['steps']} steps in {elapsed:.1f} s; outcomes: "
        + ", ".join(f"{row} {SEEN[row]}" for row in ROWS)
    )
    assert COUNTS["examples"] >= MAX_EXAMPLES
    assert COUNTS["steps"] >= MAX_EXAMPLES * 5
    assert [row for row in ROWS if not SEEN[row]] == []


# ---------------------------------------------------------------------- compatible definitions
#
# The begin decision of the state machine itself, given the set of earlier definitions a
# call declares compatible: only a succeeded record made under one of them is reused.

V3 = definition_digest("billing-v3")
V4 = definition_digest("billing-v4")
SAME_INPUTS = "a" * 64  # what ``started_record`` is made from


def record_in(status: str, definition_hash: str = V3) -> Any:
    record = dataclasses.replace(started_record(IDENTITIES[0]), definition_hash=definition_hash)
    if status == "succeeded":
        return record.advance("complete", "succeeded", NOW, receipt="ch_3", result="{}")
    if status == "needs_review":
        return record.advance("mark_review", "needs_review", NOW, "t", review_reason="t")
    if status == "released":
        reviewed = record.advance("mark_review", "needs_review", NOW, "t", review_reason="t")
        return reviewed.advance("resolve", "released", NOW, "no charge")
    return record


def begin_v4(current: Any, compatible: frozenset[str], input_hash: str = SAME_INPUTS) -> Any:
    return machine.begin(
        current,
        identity=IDENTITIES[0],
        input_kind="sha256",
        input_hash=input_hash,
        definition_hash=V4,
        compatible=compatible,
        claim_id="c" * 32,
        owner=current.owner,
        now=NOW,
    )


def refusal_code(call: Callable[[], object]) -> str:
    try:
        call()
    except ConflictError as refusal:
        return refusal.code
    raise AssertionError("the call was not refused")


def test_model_reuses_a_succeeded_record_of_a_compatible_definition() -> None:
    assert begin_v4(record_in("succeeded"), frozenset({V3})) is None
    assert begin_v4(record_in("succeeded"), frozenset({V3, definition_digest("x")})) is None


def test_model_refuses_a_succeeded_record_of_a_definition_not_declared_compatible() -> None:
    made_by_v2 = record_in("succeeded", definition_digest("billing-v2"))
    assert refusal_code(lambda: begin_v4(made_by_v2, frozenset({V3}))) == "DEFINITION_CHANGED"
    assert refusal_code(lambda: begin_v4(made_by_v2, frozenset())) == "DEFINITION_CHANGED"


def test_model_names_compatible_in_the_refusal_of_a_succeeded_record() -> None:
    with pytest.raises(ConflictError) as caught:
        begin_v4(record_in("succeeded"), frozenset())
    assert caught.value.code == "DEFINITION_CHANGED"
    assert "compatible=" in caught.value.message
    assert V3 in caught.value.message  # the definition that made it, to compare with


@pytest.mark.parametrize("status", ["started", "needs_review"])
def test_model_compatible_never_touches_unfinished_records(status: str) -> None:
    current = record_in(status)
    assert refusal_code(lambda: begin_v4(current, frozenset({V3}))) == "DEFINITION_CHANGED"
    with pytest.raises(ConflictError) as caught:
        begin_v4(current, frozenset({V3}))
    assert "compatible=" not in caught.value.message  # it would not help there


def test_model_a_released_record_is_claimed_afresh_under_the_new_definition() -> None:
    fresh = begin_v4(record_in("released"), frozenset({V3}))
    assert fresh is not None
    assert (fresh.status, fresh.definition_hash, fresh.attempt) == ("started", V4, 2)


def test_model_other_inputs_are_refused_before_compatibility_is_asked() -> None:
    other = "b" * 64
    refused = refusal_code(lambda: begin_v4(record_in("succeeded"), frozenset({V3}), other))
    assert refused == "INPUT_CHANGED"


# ---------------------------------------------------------------------------- withdrawal
# The state machine's own transition for a claim withdrawn by its caller: started ->
# released under the event ``withdrawn``, keyed by the claim's id and fingerprints.


def _withdrawn_from(current: Any, **changes: str) -> Any:
    from itemjournal._model import machine

    request = {
        "claim_id": "b" * 32,
        "input_hash": "a" * 64,
        "definition_hash": _builders.DEFINITION,
        "reason": "validation failed: amount is negative",
        "now": "2026-11-30T00:00:01.000000+00:00",
    }
    request.update(changes)
    return machine.withdraw(current, **request)


def test_machine_withdraw_releases_a_started_record_under_the_withdrawn_event() -> None:
    started = _builders.started_record(IDENTITIES[0])
    released = _withdrawn_from(started)
    assert released.status == "released"
    assert released.claim_id == started.claim_id
    assert released.attempt == started.attempt
    assert released.receipt is None and released.review_reason is None
    assert released.updated_at == "2026-11-30T00:00:01.000000+00:00"
    assert released.history[:-1] == started.history
    last = released.history[-1]
    assert (last.event, last.status, last.attempt) == ("withdrawn", "released", 1)
    assert last.note == "validation failed: amount is negative"


def test_machine_withdraw_refuses_another_claim_or_other_fingerprints() -> None:
    started = _builders.started_record(IDENTITIES[0])
    for changes in (
        {"claim_id": "c" * 32},
        {"input_hash": "d" * 64},
        {"definition_hash": "e" * 64},
    ):
        try:
            _withdrawn_from(started, **changes)
        except ConflictError as refusal:
            assert refusal.code == "CLAIM_MISMATCH"
        else:
            raise AssertionError(f"withdrawn with {changes}")
    try:
        _withdrawn_from(None)
    except ConflictError as refusal:
        assert refusal.code == "CLAIM_MISMATCH"
    else:
        raise AssertionError("an absent record was withdrawn")


def test_machine_withdraw_refuses_a_record_that_left_started() -> None:
    from itemjournal._model import machine

    started = _builders.started_record(IDENTITIES[0])
    swept = machine.sweep(started, owner_gone="owner process gone", now=_builders.NOW)
    assert swept is not None
    done = machine.complete(
        started,
        claim_id=started.claim_id,
        input_hash=started.input_hash,
        definition_hash=started.definition_hash,
        receipt="ch_1",
        now=_builders.NOW,
    )
    withdrawn = _withdrawn_from(started)
    for moved in (swept, done, withdrawn):
        try:
            _withdrawn_from(moved)
        except ConflictError as refusal:
            assert refusal.code == "NOT_STARTED"
        else:
            raise AssertionError(f"a {moved.status} record was withdrawn")


def test_a_withdrawn_record_reads_back_and_its_identity_is_claimed_afresh() -> None:
    from itemjournal._model import codec, machine

    started = _builders.started_record(IDENTITIES[0])
    withdrawn = _withdrawn_from(started)
    assert codec.decode_record(codec.encode_record(withdrawn), IDENTITIES[0]) == withdrawn
    again = machine.begin(
        withdrawn,
        identity=IDENTITIES[0],
        input_kind="sha256",
        input_hash="f" * 64,  # a released record's next attempt carries its own fingerprints
        definition_hash=_builders.DEFINITION,
        claim_id="9" * 32,
        owner=started.owner,  # type: ignore[arg-type]
        now="2026-11-30T00:00:02.000000+00:00",
    )
    assert again is not None
    assert (again.status, again.attempt, again.claim_id) == ("started", 2, "9" * 32)
    assert [event.event for event in again.history] == ["begin", "withdrawn", "begin"]
