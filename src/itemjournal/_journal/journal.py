"""``Journal``: the public operations, on top of the state machine and one store."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import random
import re
import secrets
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Literal, TypeVar

import anyio
import anyio.lowlevel

from .._model import machine
from .._model.errors import (
    ConflictError,
    InvalidArgument,
    JournalError,
    RecordInvalid,
    StorageFailed,
    UnresolvedClaim,
)
from .._model.identity import (
    Identity,
    IdentityLike,
    InputDigester,
    InputValue,
    check_label,
    coerce_identity,
    identity_digest,
    require_hash,
)
from .._model.records import (
    MAX_NOTE_CHARS,
    STATUSES,
    Owner,
    Record,
    note_problem,
    receipt_problem,
    result_problem,
    utc_now,
)
from .._model.view import Claim, PruneReport, RecordView, Reuse, SweepReport
from .._stores.registry import open_store
from .._stores.seam import Step, Store
from .._stores.threads import run_in_thread
from .observe import NO_SPAN, JournalStatistics, Observer, Span, Tracing

if TYPE_CHECKING:
    from .._operator.reconcile import Check, ReconcileReport

__all__ = ["Attempt", "Journal"]

T = TypeVar("T")
U = TypeVar("U")

_VIEW_BATCH = 64  # records per worker trip when listings compute views
_PRUNABLE = ("succeeded", "released")
# Seconds a store's own clock may be off by (the kernel's whole-second boot time, coarse
# file times): it keeps a record only when it calls it younger by more than that.
_WITNESS_SLACK = 2.0
_KEY = re.compile(r"[0-9a-f]{64}")
_KEY_IN = re.compile(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")
_FIRST_POLL = 0.01  # seconds: the first pause of a waiter polling another process's claim
_LAST_POLL = 1.0  # the longest pause (and how often a waiter on our own claim re-checks)

# What a step saw and decided, each time the store ran it.
_Seen = list[tuple[Record | None, Step[object]]]

# The location's setting that names how its inputs are fingerprinted (SPEC section 1).
_INPUT_KIND: str = "input_kind"


Liveness = Callable[[Owner | None], "bool | None"]


def _view(identity: Identity, record: Record | None, alive: Liveness) -> RecordView:
    """Build a view; liveness reads /proc or asks the database, so only ever call it in a
    worker thread."""
    known = alive(record.owner) if record is not None and record.status == "started" else None
    return RecordView.of(identity, record, known)


def _refusing(
    identity: Identity, record: Record | None, alive: Liveness, call: Callable[[], T]
) -> T:
    """Run a state-machine call; a refusal leaves with the record's view attached."""
    try:
        return call()
    except ConflictError as error:
        error.view = _view(identity, record, alive)
        raise


def _check_note(value: object, what: str) -> str:
    problem = note_problem(value, what)
    if problem:
        raise InvalidArgument(problem, code="INVALID_ARGUMENT")
    assert isinstance(value, str)
    return value


def _check_status(value: object) -> None:
    if value is not None and value not in STATUSES:
        raise InvalidArgument(
            f"status is one of {', '.join(STATUSES)}, not {value!r}", code="INVALID_ARGUMENT"
        )


def _problem_key(problem: JournalError) -> str | None:
    """The key of the record a problem is about, when its location names one."""
    location = getattr(problem, "location", None)
    found = _KEY_IN.findall(location) if isinstance(location, str) else []
    return found[-1] if found else None


async def _views(records: list[Record], alive: Liveness) -> list[RecordView]:
    """Views of a batch of records; liveness reads /proc, so in one worker trip."""
    if not records:
        return []
    return await run_in_thread(
        lambda: [_view(record.identity, record, alive) for record in records]
    )


def _record_times(record: Record) -> list[datetime]:
    """Every time a record holds: when it was made, last changed, and each event."""
    texts = {record.created_at, record.updated_at, *(event.at for event in record.history)}
    return [datetime.fromisoformat(text) for text in texts]


def _check_wait(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(
            f"wait is a number of seconds or None, not {type(value).__name__}",
            code="INVALID_ARGUMENT",
        )
    if not (math.isfinite(value) and value >= 0):
        raise InvalidArgument(
            f"wait must be a finite number of seconds, at least 0, got {value}",
            code="INVALID_ARGUMENT",
        )
    return float(value)


def _check_result(value: object) -> str | None:
    problem = result_problem(value)
    if problem:
        raise InvalidArgument(problem, code="INVALID_ARGUMENT")
    assert value is None or isinstance(value, str)
    return value


def _same(record: Record, view: RecordView) -> bool:
    """Whether ``record`` is still the one ``view`` shows: every transition moves
    ``updated_at`` and appends to the history, and a new attempt changes ``attempt``."""
    return (
        record.status == view.status
        and record.attempt == view.attempt
        and record.updated_at == view.updated_at
        and record.review_reason == view.review_reason
        and record.history == view.history
    )


def _check_receipt(value: object) -> str:
    problem = receipt_problem(value)
    if problem:
        raise InvalidArgument(problem, code="INVALID_RECEIPT")
    assert isinstance(value, str)
    return value


class Journal:
    """Durable intent before an external effect; the caller's declaration after it.

    One ``Journal`` serves any number of tasks. Operations on one identity run one at
    a time; operations on different identities run in parallel.
    """

    def __init__(self, store: Store, *, input_key: bytes | None = None) -> None:
        self._store = store
        self._digester = InputDigester(input_key)
        # Identities in flight, each with the tasks waiting for it in arrival order. The
        # event loop runs this bookkeeping without awaiting, so it needs no lock.
        self._busy: dict[Identity, deque[anyio.Event]] = {}
        # Claims this journal granted that are still open: waiters (wait=...) on one of
        # them are woken when it settles, instead of polling.
        self._live: dict[Identity, anyio.Event] = {}
        self._observer = Observer()
        # Set by ``itemjournal.otel.instrument``: what wraps each operation in a span.
        self._tracing: Tracing | None = None

    @classmethod
    async def open(
        cls,
        location: str | os.PathLike[str],
        *,
        input_key: bytes | None = None,
        lock_timeout: float = 30.0,
        trust_shared_root: bool = False,
    ) -> Journal:
        """Open (creating if needed) the journal at ``location``.

        ``location`` is an absolute directory (the file store, the default),
        ``sqlite:///absolute/path.db`` (the SQLite store, for throughput on one host) or
        ``postgresql://user@host/database`` (the PostgreSQL store, for many hosts; needs
        the ``postgres`` extra).
        ``lock_timeout`` bounds, in seconds, how long one operation waits for a record
        lock (or the database's write lock) that another process holds. The location
        must be this user's alone (not writable by group or others); pass
        ``trust_shared_root=True`` only when every user who can write there is trusted.
        A location records how its inputs are fingerprinted when it is created; opening
        it with another ``input_key`` (or without the one it was made with) raises
        ``INPUT_KEY_MISMATCH``.
        """
        InputDigester(input_key)  # refuses a bad key before anything touches the disk
        if isinstance(lock_timeout, bool) or not isinstance(lock_timeout, (int, float)):
            raise InvalidArgument(
                f"lock_timeout is a number of seconds, not {type(lock_timeout).__name__}",
                code="INVALID_ARGUMENT",
            )
        if not (math.isfinite(lock_timeout) and lock_timeout > 0):
            raise InvalidArgument(
                f"lock_timeout must be a positive, finite number of seconds, got {lock_timeout}",
                code="INVALID_ARGUMENT",
            )
        if not isinstance(trust_shared_root, bool):
            raise InvalidArgument(
                "trust_shared_root must be True or False", code="INVALID_ARGUMENT"
            )
        if not isinstance(location, (str, os.PathLike)):
            raise InvalidArgument(
                f"location must be an absolute directory path, not {type(location).__name__}",
                code="ABSOLUTE_ROOT_REQUIRED",
            )
        text = os.fspath(location)
        if not isinstance(text, str):
            raise InvalidArgument(
                f"location must be a text path; {type(location).__name__} gave "
                f"{type(text).__name__} (decode it with os.fsdecode first)",
                code="ABSOLUTE_ROOT_REQUIRED",
            )
        if "\0" in text:
            raise InvalidArgument(
                "the location holds a NUL character", code="ABSOLUTE_ROOT_REQUIRED"
            )
        # A store's module is imported on first use, and imports read files: in a thread.
        store = await run_in_thread(
            functools.partial(
                open_store,
                text,
                lock_timeout=float(lock_timeout),
                trust_shared_root=trust_shared_root,
            )
        )
        journal = cls(store, input_key=input_key)
        try:
            await store.open()
            kind = journal.input_kind
            recorded = await store.setting(_INPUT_KIND, kind)
            if recorded != kind:
                raise ConflictError(
                    f"{store.location} fingerprints inputs with {recorded!r}, but it was "
                    f"opened with {kind!r}; open it with the input_key it was created with",
                    code="INPUT_KEY_MISMATCH",
                )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await store.aclose()
            raise
        return journal

    @property
    def store(self) -> Store:
        return self._store

    @property
    def input_kind(self) -> str:
        """How this journal fingerprints inputs: ``sha256`` or ``hmac-sha256:<key id>``."""
        return self._digester.kind

    def __repr__(self) -> str:
        return f"Journal({self._store!r})"

    def statistics(self) -> JournalStatistics:
        """Counters of what this ``Journal`` object did since it was made (no I/O).

        See ``itemjournal.JournalStatistics`` for what each counts; other journals and
        processes on the same location count for themselves.
        """
        return self._observer.statistics()

    def _span(self, operation: str, identity: Identity | None) -> Span:
        """The span of one operation: a real one once ``itemjournal.otel`` instrumented
        this journal, else a shared one that does nothing."""
        tracing = self._tracing
        return NO_SPAN if tracing is None else tracing.span(operation, identity)

    async def aclose(self) -> None:
        await self._store.aclose()

    async def __aenter__(self) -> Journal:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ one identity at a time

    async def _acquire(self, identity: Identity) -> None:
        """Have ``identity`` to ourselves; waiters are served first come, first served.

        A release hands the identity straight to the oldest waiter (one wake-up, not a
        stampede of every waiter re-checking), so N calls on one identity cost O(N).
        """
        waiters = self._busy.get(identity)
        if waiters is None:
            self._busy[identity] = deque()
            return
        turn = anyio.Event()
        waiters.append(turn)
        try:
            await turn.wait()
        except BaseException:
            if turn.is_set():  # handed to us as the cancellation landed: pass it on
                self._release(identity)
            else:
                waiters.remove(turn)
            raise

    def _release(self, identity: Identity) -> None:
        waiters = self._busy[identity]
        if waiters:
            waiters.popleft().set()  # the identity now belongs to that waiter
        else:
            del self._busy[identity]

    async def _apply_view(
        self,
        operation: str,
        identity: Identity,
        step: Callable[[Record | None], Step[RecordView]],
        outcome: str,
        *,
        ends_in_status: bool = False,
    ) -> RecordView:
        """``_apply`` of a step that answers the record's view, inside the operation's span,
        which is given the outcome and the attempt (and the status, for an operation that
        can end in more than one)."""
        with self._span(operation, identity) as span:
            view = await self._apply(operation, identity, step)
            span.set("outcome", outcome)
            if ends_in_status:
                span.set("status", view.status)
            span.set("attempt", view.attempt)
            return view

    async def _apply(
        self,
        operation: str,
        identity: Identity,
        step: Callable[[Record | None], Step[T]],
        undo: Callable[[Record | None], Step[str]] | None = None,
        decided: Callable[[], bool] = lambda: True,
    ) -> T:
        """Run ``step`` through the store with this identity to ourselves.

        ``undo`` runs (shielded, before the identity is free again) when the call is
        cancelled after ``step`` decided to write (``decided()``): the answer will never
        reach the caller, so whatever the step wrote for it must be taken back. A call
        cancelled before its step ever ran (waiting for a lock, say) wrote nothing and
        ends at once.

        Every write is logged and counted here, under ``operation``'s name, once the store
        acknowledged it: only then did it happen.
        """
        left_started: list[bool] = []  # a write took the record out of ``started``

        def watched(
            run: Callable[[Record | None], Step[U]], seen: _Seen
        ) -> Callable[[Record | None], Step[U]]:
            def watching(current: Record | None) -> Step[U]:
                decision = run(current)
                if decision.delete or (
                    decision.write is not None and decision.write.status != "started"
                ):
                    left_started.append(True)
                seen.append((current, decision))  # a store that re-runs a step writes the last
                return decision

            return watching

        seen: _Seen = []
        observer = self._observer
        await self._acquire(identity)
        try:
            try:
                answer = await self._store.apply(identity, watched(step, seen))
            except ConflictError as refusal:
                if operation != "begin":  # begin logs its final answer, after any waiting
                    observer.refused(operation, identity, refusal)
                raise
            except StorageFailed as failure:
                observer.failed(operation, identity, failure)
                raise
            except anyio.get_cancelled_exc_class() as cancelled:
                if undo is not None and decided():
                    undone: _Seen = []
                    _, error, _ = await _to_the_end(
                        functools.partial(self._store.apply, identity, watched(undo, undone))
                    )
                    if error is None and undone:
                        before, decision = undone[-1]
                        observer.wrote("undo", identity, before, decision.write, decision.delete)
                    elif isinstance(error, StorageFailed):
                        observer.failed("undo", identity, error)
                    if error is not None:
                        cancelled.add_note(
                            f"itemjournal could not check whether the cancelled begin() left "
                            f"a started record on {list(identity)}: {error}"
                        )
                raise
            if seen:
                before, decision = seen[-1]
                observer.wrote(operation, identity, before, decision.write, decision.delete)
            return answer
        finally:
            self._release(identity)
            if left_started:
                self._settled(identity)

    # ------------------------------------------------------------------ operations

    async def begin(
        self,
        identity: IdentityLike,
        inputs: Mapping[str, InputValue],
        definition: str,
        *,
        wait: float | None = None,
    ) -> Claim | Reuse:
        """Durably record intent, then grant a ``Claim``; or ``Reuse`` a succeeded record.

        A ``started`` record whose owner lives (or cannot be known) is ``IN_PROGRESS``;
        with ``wait=seconds`` the call waits for it to leave ``started`` and then answers
        as usual (a ``Reuse``, a ``Claim`` after a release, ``REVIEW_REQUIRED``...), or
        raises ``IN_PROGRESS`` when the time is up. A ``started`` record whose owner is
        provably gone is marked ``needs_review`` and refused with ``REVIEW_REQUIRED``.
        """
        ident = coerce_identity(identity)
        input_hash = self._digester(inputs)
        definition_hash = require_hash(definition)
        limit = _check_wait(wait)
        with self._span("begin", ident) as span:
            try:
                if limit is None:
                    outcome = await self._begin(ident, input_hash, definition_hash)
                else:
                    outcome = await self._begin_waiting(ident, input_hash, definition_hash, limit)
            except ConflictError as refusal:
                self._observer.refused("begin", ident, refusal)
                raise
            if isinstance(outcome, Claim):
                span.set("outcome", "claimed")
                span.set("claim_id", outcome.claim_id)
            else:
                self._observer.reused(ident, outcome.attempt, outcome.receipt)
                span.set("outcome", "reused")
            span.set("attempt", outcome.attempt)
            return outcome

    async def _begin_waiting(
        self, ident: Identity, input_hash: str, definition_hash: str, limit: float
    ) -> Claim | Reuse:
        """``_begin``, again and again while the record is ``IN_PROGRESS``, for at most
        ``limit`` seconds."""
        deadline = anyio.current_time() + limit
        delay = _FIRST_POLL
        while True:
            try:
                return await self._begin(ident, input_hash, definition_hash)
            except ConflictError as refusal:
                if refusal.code != "IN_PROGRESS":
                    raise
                remaining = deadline - anyio.current_time()
                if remaining <= 0:
                    raise
            # Our own claim: its settlement sets an event. Another process's (or another
            # journal's): poll, with jittered, lengthening pauses.
            settled = self._live.get(ident)
            pause = min(remaining, delay * (0.5 + random.random() / 2))
            if settled is not None:
                with anyio.move_on_after(min(remaining, _LAST_POLL)):
                    await settled.wait()
            else:
                await anyio.sleep(pause)
                delay = min(delay * 1.5, _LAST_POLL)

    async def _begin(self, ident: Identity, input_hash: str, definition_hash: str) -> Claim | Reuse:
        kind = self._digester.kind
        granted: list[tuple[Record | None, str]] = []  # (record before, claim id) per attempt

        alive = self._store.owner_alive
        why = self._store.gone_reason

        def step(current: Record | None) -> Step[Claim | Reuse | ConflictError]:
            gone = (
                why(current.owner)
                if current is not None
                and current.status == "started"
                and alive(current.owner) is False
                else None
            )
            new = _refusing(
                ident,
                current,
                alive,
                lambda: machine.begin(
                    current,
                    identity=ident,
                    input_kind=kind,
                    input_hash=input_hash,
                    definition_hash=definition_hash,
                    claim_id=secrets.token_hex(16),
                    owner=self._store.owner(),
                    now=utc_now(),
                    owner_gone=gone,
                ),
            )
            if new is None:
                assert current is not None
                assert current.receipt is not None
                return Step(
                    None, Reuse(current.receipt, ident, current.attempt, result=current.result)
                )
            if new.status != "started":  # a dead owner's claim, marked: write, then refuse
                refusal = machine.refusal_after(new)
                refusal.view = _view(ident, new, alive)
                return Step(new, refusal)
            granted.append((current, new.claim_id))
            claim = Claim(
                identity=ident,
                input_hash=new.input_hash,
                definition_hash=new.definition_hash,
                claim_id=new.claim_id,
                attempt=new.attempt,
                key=identity_digest(ident),
            )
            return Step(new, claim)

        def undo(current: Record | None) -> Step[str]:
            # Only a record still carrying the claim we never handed out is taken back:
            # removed if it was new, or returned to the released record it replaced.
            for before, claim_id in granted:
                if current is not None and current.claim_id == claim_id:
                    if current.status != "started":
                        return Step(None, "moved on")
                    if before is None:
                        return Step(None, "removed", delete=True)
                    return Step(before, "restored")
            return Step(None, "never written")

        try:
            outcome = await self._apply("begin", ident, step, undo, lambda: bool(granted))
        except ConflictError as refusal:
            if refusal.code != "IN_PROGRESS":
                self._settled(ident)  # not started (any more): nobody needs to wait here
            raise
        if isinstance(outcome, ConflictError):
            raise outcome
        if isinstance(outcome, Claim):
            self._live[ident] = anyio.Event()
        else:
            self._settled(ident)
        return outcome

    def _settled(self, ident: Identity) -> None:
        """Wake the waiters of a claim this journal granted: its record left ``started``."""
        event = self._live.pop(ident, None)
        if event is not None:
            event.set()

    async def complete(
        self, claim: Claim, receipt: str, *, result: str | None = None
    ) -> RecordView:
        """Declare the claimed effect done; ``receipt`` is stored and reused by reruns.

        ``receipt`` is a short reference (at most 200 characters); ``result``, optional,
        is what a rerun should replay (at most 64 KiB of UTF-8), returned as
        ``Reuse.result`` and ``RecordView.result``.
        """
        if not isinstance(claim, Claim):
            raise InvalidArgument(
                f"complete() takes the Claim that begin() returned, not {type(claim).__name__}",
                code="INVALID_CLAIM",
            )
        receipt = _check_receipt(receipt)
        result = _check_result(result)
        ident = coerce_identity(claim.identity)

        alive = self._store.owner_alive

        def step(current: Record | None) -> Step[RecordView]:
            new = _refusing(
                ident,
                current,
                alive,
                lambda: machine.complete(
                    current,
                    claim_id=claim.claim_id,
                    input_hash=claim.input_hash,
                    definition_hash=claim.definition_hash,
                    receipt=receipt,
                    now=utc_now(),
                    result=result,
                ),
            )
            return Step(new, _view(ident, new, alive))

        return await self._apply_view("complete", ident, step, "completed")

    async def mark_review(self, identity: IdentityLike, reason: str | None = None) -> RecordView:
        """Say the outcome of a started attempt is uncertain: ``needs_review``."""
        ident = coerce_identity(identity)
        if reason is not None:
            reason = _check_note(reason, "a review reason")
        return await self._mark_review(ident, reason, None)

    async def _mark_review(
        self, ident: Identity, reason: str | None, claim_id: str | None
    ) -> RecordView:
        alive = self._store.owner_alive

        def step(current: Record | None) -> Step[RecordView]:
            new = _refusing(
                ident,
                current,
                alive,
                lambda: machine.mark_review(
                    current, reason=reason, claim_id=claim_id, now=utc_now()
                ),
            )
            return Step(new, _view(ident, new, alive))

        return await self._apply_view("mark_review", ident, step, "marked")

    async def resolve(
        self,
        identity: IdentityLike,
        *,
        receipt: str | None = None,
        retry: bool = False,
        note: str,
        result: str | None = None,
    ) -> RecordView:
        """An operator's decision on a ``needs_review`` record, audited in its history.

        With ``receipt``: the effect did happen, the record becomes ``succeeded`` (with
        ``result``, if given, stored for replay as ``complete`` stores it).
        With ``retry=True``: it verifiably did not, the record becomes ``released`` and
        the identity may be claimed again.
        """
        ident = coerce_identity(identity)
        if not isinstance(retry, bool):
            raise InvalidArgument("retry must be True or False", code="INVALID_ARGUMENT")
        if (receipt is None) == (not retry):
            raise InvalidArgument(
                "resolve() takes either receipt=... (it happened) or retry=True "
                "(it verifiably did not), exactly one of them",
                code="INVALID_ARGUMENT",
            )
        if receipt is not None:
            receipt = _check_receipt(receipt)
        result = _check_result(result)
        if retry and result is not None:
            raise InvalidArgument(
                "a result is stored only with a receipt, not with retry=True",
                code="INVALID_ARGUMENT",
            )
        note = _check_note(note, "a resolution note")
        return await self._resolve(ident, receipt, note, result)

    async def _resolve(
        self,
        ident: Identity,
        receipt: str | None,
        note: str,
        result: str | None,
        expect: RecordView | None = None,
    ) -> RecordView:
        """Resolve, with checked arguments. With ``expect``, only the very record that
        view shows: one that changed since (another attempt, another decision) is refused
        ``NOT_IN_REVIEW`` in the same atomic step that would have written it."""
        alive = self._store.owner_alive

        def step(current: Record | None) -> Step[RecordView]:
            if expect is not None and current is not None and not _same(current, expect):
                error = ConflictError(
                    f"the record changed since it was looked at (attempt {expect.attempt}, "
                    f"updated {expect.updated_at}); it is left as it is now",
                    code="NOT_IN_REVIEW",
                )
                error.view = _view(ident, current, alive)
                raise error
            new = _refusing(
                ident,
                current,
                alive,
                lambda: machine.resolve(
                    current, receipt=receipt, note=note, now=utc_now(), result=result
                ),
            )
            return Step(new, _view(ident, new, alive))

        return await self._apply_view("resolve", ident, step, "resolved", ends_in_status=True)

    async def inspect(self, identity: IdentityLike) -> RecordView:
        """The record as it is now (``status == "absent"`` when there is none)."""
        ident = coerce_identity(identity)
        alive = self._store.owner_alive
        with self._span("inspect", ident) as span:
            try:
                view = await self._store.peek(ident, lambda record: _view(ident, record, alive))
            except StorageFailed as failure:
                self._observer.failed("inspect", ident, failure)
                raise
            span.set("outcome", "absent" if view.status == "absent" else "found")
            span.set("status", view.status)
            span.set("attempt", view.attempt)
            return view

    async def records(
        self,
        status: str | None = None,
        *,
        scope: str | None = None,
        program: str | None = None,
        job: str | None = None,
        after: str | None = None,
    ) -> AsyncGenerator[RecordView | RecordInvalid | StorageFailed, None]:
        """Stream the journal's records as ``RecordView``s, in key order (``view.key``).

        ``status`` and the labels filter; ``after`` (a key) starts after that record, for
        keyset pagination. A record that cannot be read comes as its ``RecordInvalid``, a
        part of the store that cannot be read as ``StorageFailed``; neither stops the
        listing. Reads in batches; nothing beyond one batch is held in memory.
        """
        _check_status(status)
        labels = tuple(
            None if value is None else check_label(value, what)
            for value, what in ((scope, "scope"), (program, "program"), (job, "job"))
        )
        if after is not None and (not isinstance(after, str) or _KEY.fullmatch(after) is None):
            raise InvalidArgument(
                "after is a record key: 64 lowercase hex characters", code="INVALID_ARGUMENT"
            )
        alive = self._store.owner_alive
        batch: list[Record] = []
        # The store starts after ``after`` itself: a page deep in a large journal reads
        # no record before it. The checks below stay, cheap, for problems without a key.
        scan = (
            self._store.scan(status=status)
            if after is None
            else self._store.scan(status=status, after=after)
        )
        async with contextlib.aclosing(scan) as items:
            async for item in items:
                if isinstance(item, (RecordInvalid, StorageFailed)):
                    key = _problem_key(item)
                    if after is None or key is None or key > after:
                        for view in await _views(batch, alive):
                            yield view
                        batch.clear()
                        yield item
                    continue
                if (status is not None and item.status != status) or any(
                    wanted is not None and wanted != have
                    for wanted, have in zip(labels, item.identity[:3], strict=True)
                ):
                    continue
                if after is not None and identity_digest(item.identity) <= after:
                    continue
                batch.append(item)
                if len(batch) >= _VIEW_BATCH:
                    for view in await _views(batch, alive):
                        yield view
                    batch.clear()
        for view in await _views(batch, alive):
            yield view

    async def counts(self) -> dict[str, int]:
        """How many records there are per status, and how many cannot be read (``invalid``)."""
        counted = dict.fromkeys((*STATUSES, "invalid"), 0)
        async with contextlib.aclosing(self._store.scan()) as items:
            async for item in items:
                if isinstance(item, (RecordInvalid, StorageFailed)):
                    counted["invalid"] += 1
                else:
                    counted[item.status] += 1
        return counted

    async def prune(self, older_than: timedelta, *, dry_run: bool = False) -> PruneReport:
        """Remove ``succeeded`` and ``released`` records last changed before ``older_than``.

        Each removal is one atomic step that checks the record again (a crash leaves every
        record either whole or gone). Nothing else is ever removed. A pruned identity is
        forgotten: a later ``begin`` claims it afresh, so prune only what no caller can
        ask about again. With ``dry_run=True`` nothing changes and the report lists what
        would be removed.
        """
        if not isinstance(older_than, timedelta) or older_than <= timedelta(0):
            raise InvalidArgument(
                "older_than is a positive datetime.timedelta", code="INVALID_ARGUMENT"
            )
        if not isinstance(dry_run, bool):
            raise InvalidArgument("dry_run must be True or False", code="INVALID_ARGUMENT")
        now = datetime.now(UTC)
        cutoff = now - older_than
        with self._span("prune", None) as span:
            try:
                report = await self._prune(now, older_than, dry_run)
            except StorageFailed as failure:
                self._observer.failed("prune", None, failure)
                raise
            removed, problems = len(report.removed), len(report.problems)
            span.set("outcome", "pruned")
            span.set("removed", removed)
            span.set("problems", problems)
            span.set("dry_run", dry_run)
        self._observer.summary(
            "prune",
            f"prune {'would remove' if dry_run else 'removed'} {removed} records last changed "
            f"before {cutoff.isoformat(timespec='seconds')}; {problems} problems",
            removed=removed,
            problems=problems,
            dry_run=dry_run,
        )
        return report

    async def _prune(self, now: datetime, older_than: timedelta, dry_run: bool) -> PruneReport:
        alive = self._store.owner_alive
        cutoff = now - older_than
        removed: list[RecordView] = []
        kept: list[Record] = []
        problems: list[JournalError] = []

        async def settle(batch: list[Record]) -> None:
            """Remove those of ``batch`` the store's own clock calls old too."""
            ages = await self._store.ages([record.identity for record in batch])
            old = []
            for record, age in zip(batch, ages, strict=True):
                if age is not None and age < older_than - timedelta(seconds=_WITNESS_SLACK):
                    kept.append(record)
                else:
                    old.append(record)
            if dry_run:
                removed.extend(await _views(old, alive))
                return
            for record in old:
                ident = record.identity

                def step(
                    current: Record | None, ident: Identity = ident, seen: Record = record
                ) -> Step[RecordView | None]:
                    # Only the very record whose age was judged: a record written since
                    # (by any clock) is another record, and stays.
                    if current != seen:
                        return Step(None, None)
                    return Step(None, _view(ident, current, alive), delete=True)

                try:
                    view = await self._apply("prune", ident, step)
                except (RecordInvalid, StorageFailed) as error:
                    problems.append(error)
                    continue
                if view is not None:
                    removed.append(view)

        batch: list[Record] = []
        for status in _PRUNABLE:
            async with contextlib.aclosing(self._store.scan(status=status)) as items:
                async for item in items:
                    if isinstance(item, (RecordInvalid, StorageFailed)):
                        if status == _PRUNABLE[0]:  # each problem once, not once per status
                            problems.append(item)
                        continue
                    if item.status not in _PRUNABLE:
                        continue
                    times = _record_times(item)
                    if max(times) > now:  # written by a clock ahead of this one: keep
                        kept.append(item)
                        continue
                    if datetime.fromisoformat(item.updated_at) >= cutoff:
                        continue
                    batch.append(item)
                    if len(batch) >= _VIEW_BATCH:
                        await settle(batch)
                        batch = []
        await settle(batch)
        return PruneReport(tuple(removed), tuple(problems), tuple(await _views(kept, alive)))

    async def verify(self) -> tuple[str, ...]:
        """Check the whole journal; one line per problem, nothing when all is well.

        Every record must read strictly and be fingerprinted with the location's input
        kind; the store adds its own checks (orphan temp files, its metadata).
        """
        with self._span("verify", None) as span:
            try:
                problems = await self._verify()
            except StorageFailed as failure:
                self._observer.failed("verify", None, failure)
                raise
            span.set("outcome", "verified")
            span.set("problems", len(problems))
            return problems

    async def _verify(self) -> tuple[str, ...]:
        problems: list[str] = []
        kind = await self._store.setting(_INPUT_KIND, self.input_kind)
        async with contextlib.aclosing(self._store.scan()) as items:
            async for item in items:
                if isinstance(item, (RecordInvalid, StorageFailed)):
                    problems.append(str(item))
                elif item.input_kind != kind:
                    problems.append(
                        f"INPUT_KEY_MISMATCH: the record of {list(item.identity)} fingerprints "
                        f"inputs with {item.input_kind!r}, the location with {kind!r}"
                    )
        problems.extend(await self._store.check())
        return tuple(problems)

    async def sweep(self) -> SweepReport:
        """Mark ``started`` records whose owner process on this host is gone ``needs_review``.

        An explicit call, never a replay: the swept records refuse ``begin`` until an
        operator resolves them. A live owner's claim, or one on another host, is never
        touched. A record that cannot be read or written is skipped and reported in the
        report's ``problems``; it never stops the sweep.
        """
        with self._span("sweep", None) as span:
            try:
                report = await self._sweep()
            except StorageFailed as failure:
                self._observer.failed("sweep", None, failure)
                raise
            marked, problems = len(report.marked), len(report.problems)
            span.set("outcome", "swept")
            span.set("marked", marked)
            span.set("problems", problems)
        self._observer.summary(
            "sweep",
            f"sweep marked {marked} records needs_review; {problems} problems",
            marked=marked,
            problems=problems,
        )
        return report

    async def _sweep(self) -> SweepReport:
        alive = self._store.owner_alive
        why = self._store.gone_reason
        marked: list[RecordView] = []
        problems: list[JournalError] = []
        async with contextlib.aclosing(self._store.scan(status="started")) as records:
            async for record in records:
                if isinstance(record, (RecordInvalid, StorageFailed)):
                    problems.append(record)
                    continue
                if record.status != "started":
                    continue
                ident = record.identity

                def step(
                    current: Record | None, ident: Identity = ident
                ) -> Step[RecordView | None]:
                    gone = (
                        why(current.owner)
                        if current is not None and alive(current.owner) is False
                        else None
                    )
                    new = machine.sweep(current, owner_gone=gone, now=utc_now())
                    return Step(new, None if new is None else _view(ident, new, alive))

                try:
                    view = await self._apply("sweep", ident, step)
                except (RecordInvalid, StorageFailed) as error:
                    problems.append(error)
                    continue
                if view is not None:
                    marked.append(view)
        return SweepReport(tuple(marked), tuple(problems))

    def claim(
        self,
        identity: IdentityLike,
        inputs: Mapping[str, InputValue],
        definition: str,
        *,
        wait: float | None = None,
    ) -> ClaimContext:
        """``async with journal.claim(...) as attempt``: begin, then settle on exit.

        Leaving the block by an exception or a cancellation marks the record
        ``needs_review`` (shielded from cancellation) and lets the exception go on;
        leaving it normally without ``complete``/``mark_review`` marks it too and
        raises ``UnresolvedClaim``.
        """
        _check_wait(wait)
        return ClaimContext(self, identity, inputs, definition, wait)

    async def reconcile(
        self,
        check: Check,
        *,
        status: str = "needs_review",
        scope: str | None = None,
        program: str | None = None,
        job: str | None = None,
        limit: int = 8,
        dry_run: bool = False,
    ) -> ReconcileReport:
        """Settle ``needs_review`` records by asking ``check`` what happened to each.

        ``await check(view)`` answers ``Happened(receipt)`` (resolved ``succeeded``),
        ``DidNotHappen(evidence)`` (resolved ``released``) or ``Unknown(reason)`` (left
        for a person); at most ``limit`` checks run at once. Every resolution is an
        audited ``resolve`` whose note names the reconciliation. See
        ``itemjournal.ReconcileReport`` for what comes back.
        """
        from .._operator.reconcile import reconcile

        with self._span("reconcile", None) as span:
            report = await reconcile(
                self,
                check,
                status=status,
                scope=scope,
                program=program,
                job=job,
                limit=limit,
                dry_run=dry_run,
            )
            counts = report.counts()
            span.set("outcome", "reconciled")
            span.set("dry_run", dry_run)
            for name, count in counts.items():
                span.set(name, count)
        self._observer.summary(
            "reconcile",
            f"reconcile{' (dry run)' if dry_run else ''}: "
            + ", ".join(f"{count} {name}" for name, count in counts.items()),
            dry_run=dry_run,
            **counts,
        )
        return report


class Attempt:
    """What ``journal.claim()`` yields: either a fresh claim or a reused receipt."""

    def __init__(self, journal: Journal, outcome: Claim | Reuse) -> None:
        self._journal = journal
        self._claim: Claim | None = outcome if isinstance(outcome, Claim) else None
        self.receipt: str | None = outcome.receipt if isinstance(outcome, Reuse) else None
        # The result stored with a reused receipt (or given to ``complete``), if any.
        self.result: str | None = outcome.result if isinstance(outcome, Reuse) else None
        self.settled = isinstance(outcome, Reuse)
        self.view: RecordView | None = None

    @property
    def reused(self) -> bool:
        """True when the item already succeeded and ``receipt`` holds its receipt."""
        return self._claim is None

    @property
    def claim(self) -> Claim:
        """The claim granted by this attempt (``INVALID_CLAIM`` when it reused a receipt)."""
        return self._own_claim("claim")

    def _own_claim(self, what: str) -> Claim:
        if self._claim is None:
            raise InvalidArgument(
                f"nothing to {what}: this attempt reused a receipt", code="INVALID_CLAIM"
            )
        return self._claim

    async def complete(self, receipt: str, result: str | None = None) -> RecordView:
        """Declare this attempt's effect done (see ``Journal.complete``)."""
        claim = self._own_claim("complete")
        self.view = await self._journal.complete(claim, receipt, result=result)
        self.settled = True
        self.receipt = receipt
        self.result = result
        return self.view

    async def mark_review(self, reason: str | None = None) -> RecordView:
        claim = self._own_claim("mark for review")
        if reason is not None:
            reason = _check_note(reason, "a review reason")
        self.view = await self._journal._mark_review(claim.identity, reason, claim.claim_id)
        self.settled = True
        return self.view


class ClaimContext:
    """The async context manager behind ``Journal.claim``."""

    def __init__(
        self,
        journal: Journal,
        identity: IdentityLike,
        inputs: Mapping[str, InputValue],
        definition: str,
        wait: float | None = None,
    ) -> None:
        self._journal = journal
        self._args = (identity, inputs, definition)
        self._wait = wait
        self._attempt: Attempt | None = None
        self._entered = False

    async def __aenter__(self) -> Attempt:
        if self._entered:
            raise InvalidArgument(
                "a claim context can be entered only once", code="INVALID_ARGUMENT"
            )
        self._entered = True
        outcome = await self._journal.begin(*self._args, wait=self._wait)
        self._attempt = Attempt(self._journal, outcome)
        return self._attempt

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> Literal[False]:  # never swallows an exception: code after the block type-checks
        attempt = self._attempt
        if attempt is None or attempt.settled or attempt.reused:
            return False
        claim = attempt.claim
        ident = coerce_identity(claim.identity)
        reason = "block ended without complete or mark_review" if exc is None else _reason(exc)
        written: list[Record] = []

        alive = self._journal._store.owner_alive

        def settle(current: Record | None) -> Step[tuple[bool, RecordView]]:
            """(completed by this claim?, view): mark it, unless this claim settled it.

            A try cut short by a native cancellation may have written already; its own
            record, found again, counts as marked (the retry must not report otherwise).
            """
            if current is not None and current in written:
                return Step(None, (False, _view(ident, current, alive)))
            if (
                current is not None
                and current.claim_id == claim.claim_id
                and current.status == "succeeded"
                and current.history
                and current.history[-1].event == "complete"
            ):  # completed under this very claim, by journal.complete(attempt.claim, ...)
                return Step(None, (True, _view(ident, current, alive)))
            new = _refusing(
                ident,
                current,
                alive,
                lambda: machine.mark_review(
                    current, reason=reason, claim_id=claim.claim_id, now=utc_now()
                ),
            )
            written.append(new)
            return Step(new, (False, _view(ident, new, alive)))

        with self._journal._span("claim_exit", ident) as span:
            outcome, error, cancelled = await _to_the_end(
                functools.partial(self._journal._apply, "claim_exit", ident, settle)
            )
            if outcome is not None:
                span.set("outcome", "completed" if outcome[0] else "marked")
                span.set("attempt", outcome[1].attempt)
            else:
                assert error is not None
                span.failed(error)
            if cancelled is not None:
                span.set("cancelled", True)
        # A native cancellation that arrived meanwhile goes on, whatever else happened:
        # the task must end cancelled. What the exit did travels with it as a note.
        carrier = cancelled if cancelled is not None else exc
        if outcome is not None:
            completed, view = outcome
            attempt.settled = True
            attempt.view = view
            if completed:
                if cancelled is not None:
                    raise cancelled
                return False
            if cancelled is not None:
                cancelled.add_note(
                    f"itemjournal marked {list(claim.identity)} needs_review: {reason}"
                )
                raise cancelled
            if exc is None:
                raise UnresolvedClaim(
                    f"the claim on {list(claim.identity)} ended unresolved; it now needs review",
                    view=view,
                )
            return False
        assert error is not None
        if isinstance(error, ConflictError):
            note = f"itemjournal did not mark {list(claim.identity)}: {error}"
        else:
            note = f"itemjournal could not mark {list(claim.identity)} for review: {error}"
        if carrier is not None:
            carrier.add_note(note)
            if cancelled is not None:
                raise cancelled
            return False
        if isinstance(error, ConflictError):  # someone else moved the record
            raise UnresolvedClaim(
                f"the claim on {list(claim.identity)} ended unresolved ({error})",
                view=error.view,
            ) from error
        raise error


def _reason(exc: BaseException) -> str:
    """A review reason naming the exception: its type and message, made to fit a note.

    An operator must tell "timed out before sending" from "after": the message matters.
    Lone surrogates are replaced and the text is cut to the note limit, so the record
    always reads back.
    """
    try:
        message = str(exc)
    except Exception:  # a broken __str__ must not stop the record being marked
        message = "(its message cannot be shown)"
    text = f"block raised {type(exc).__name__}"
    if message.strip():
        text = f"{text}: {message}"
    text = text.encode("utf-8", "replace").decode("utf-8")
    if len(text) > MAX_NOTE_CHARS:
        text = text[: MAX_NOTE_CHARS - 1] + "\u2026"
    return text


async def _to_the_end(
    call: Callable[[], Awaitable[T]],
) -> tuple[T | None, Exception | None, BaseException | None]:
    """Run ``call`` to its end, shielded; retry it after a native asyncio cancellation.

    anyio's shield stops anyio's cancellation, not a bare ``task.cancel()``; ``call``
    must therefore be safe to run again (the steps used here re-check the record).
    Returns ``(result, None, cancelled)`` or ``(None, error, cancelled)``, where
    ``cancelled`` is the last native cancellation seen, which the caller must re-raise:
    an error from a retry never swallows it.
    """
    cancelled: BaseException | None = None
    with anyio.CancelScope(shield=True):
        while True:
            try:
                result = await call()
            except anyio.get_cancelled_exc_class() as error:
                cancelled = error
            except Exception as error:
                return None, error, cancelled
            else:
                return result, None, cancelled
    raise AssertionError("unreachable")  # pragma: no cover - the loop only returns
