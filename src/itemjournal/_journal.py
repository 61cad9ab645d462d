"""``Journal``: the public operations, on top of the state machine and one store."""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import TypeVar

import anyio
import anyio.lowlevel

from . import _machine as machine
from ._errors import ConflictError, InvalidArgument, JournalError, RecordInvalid, UnresolvedClaim
from ._filestore import FileStore
from ._identity import (
    Identity,
    IdentityLike,
    InputDigester,
    coerce_identity,
    identity_digest,
    require_hash,
)
from ._owner import current_owner, owner_alive
from ._records import Record, note_problem, receipt_problem, utc_now
from ._sqlitestore import SQLiteStore
from ._store import Step, Store
from ._view import Claim, RecordView, Reuse

__all__ = ["Attempt", "Journal"]

T = TypeVar("T")


def _view(identity: Identity, record: Record | None) -> RecordView:
    """Build a view; reads /proc for liveness, so only ever call it in a worker thread."""
    alive = owner_alive(record.owner) if record is not None and record.status == "started" else None
    return RecordView.of(identity, record, alive)


def _refusing(identity: Identity, record: Record | None, call: Callable[[], T]) -> T:
    """Run a state-machine call; a refusal leaves with the record's view attached."""
    try:
        return call()
    except ConflictError as error:
        error.view = _view(identity, record)
        raise


def _check_note(value: object, what: str) -> str:
    problem = note_problem(value, what)
    if problem:
        raise InvalidArgument(problem, code="INVALID_ARGUMENT")
    assert isinstance(value, str)
    return value


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
        self._meta = anyio.Lock(fast_acquire=True)
        self._busy: dict[Identity, anyio.Event] = {}

    @classmethod
    async def open(
        cls, location: str | os.PathLike[str], *, input_key: bytes | None = None
    ) -> Journal:
        """Open (creating if needed) the journal at ``location``.

        ``location`` is an absolute directory (the file store, the default) or
        ``sqlite:///absolute/path.db`` (the SQLite store, for throughput on one host).
        """
        InputDigester(input_key)  # refuses a bad key before anything touches the disk
        if not isinstance(location, (str, os.PathLike)):
            raise InvalidArgument(
                f"location must be an absolute directory path, not {type(location).__name__}",
                code="ABSOLUTE_ROOT_REQUIRED",
            )
        text = os.fspath(location)
        if "\0" in text:
            raise InvalidArgument(
                "the location holds a NUL character", code="ABSOLUTE_ROOT_REQUIRED"
            )
        store: FileStore | SQLiteStore
        if text.startswith(("postgresql:", "postgres:")):
            raise InvalidArgument(
                "the PostgreSQL store is not part of this version of itemjournal; "
                "use an absolute directory or sqlite:///absolute/path.db",
                code="INVALID_ARGUMENT",
            )
        if text.startswith("sqlite:"):
            if not text.startswith("sqlite://"):
                raise InvalidArgument(
                    f"a SQLite location looks like sqlite:///absolute/path.db, not {text!r}",
                    code="ABSOLUTE_ROOT_REQUIRED",
                )
            store = SQLiteStore(text[len("sqlite://") :])
        else:
            store = FileStore(text)
        await store.open()
        return cls(store, input_key=input_key)

    @property
    def store(self) -> Store:
        return self._store

    @property
    def input_kind(self) -> str:
        """How this journal fingerprints inputs: ``sha256`` or ``hmac-sha256:<key id>``."""
        return self._digester.kind

    def __repr__(self) -> str:
        return f"Journal({self._store!r})"

    async def aclose(self) -> None:
        await self._store.aclose()

    async def __aenter__(self) -> Journal:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ one identity at a time

    async def _acquire(self, identity: Identity) -> anyio.Event:
        while True:
            async with self._meta:
                waiting = self._busy.get(identity)
                if waiting is None:
                    mine = self._busy[identity] = anyio.Event()
                    return mine
            await waiting.wait()

    def _release(self, identity: Identity, mine: anyio.Event) -> None:
        del self._busy[identity]
        mine.set()

    async def _apply(
        self,
        identity: Identity,
        step: Callable[[Record | None], Step[T]],
        undo: Callable[[Record | None], Step[None]] | None = None,
    ) -> T:
        """Run ``step`` through the store with this identity to ourselves.

        ``undo`` runs (shielded, before the identity is free again) when the call is
        cancelled after its worker trip began: the answer will never reach the caller,
        so whatever the step wrote for it must be taken back.
        """
        mine = await self._acquire(identity)
        try:
            try:
                return await self._store.apply(identity, step)
            except anyio.get_cancelled_exc_class() as cancelled:
                if undo is not None:
                    try:
                        await _to_the_end(functools.partial(self._store.apply, identity, undo))
                    except JournalError as error:
                        cancelled.add_note(
                            f"itemjournal could not take back the claim on "
                            f"{list(identity)} that the cancelled begin() wrote: {error}"
                        )
                raise
        finally:
            self._release(identity, mine)

    # ------------------------------------------------------------------ operations

    async def begin(
        self, identity: IdentityLike, inputs: Mapping[str, str], definition: str
    ) -> Claim | Reuse:
        """Durably record intent, then grant a ``Claim``; or ``Reuse`` a succeeded record."""
        ident = coerce_identity(identity)
        input_hash = self._digester(inputs)
        definition_hash = require_hash(definition)
        kind = self._digester.kind
        granted: list[tuple[Record | None, str]] = []  # (record before, claim id) per attempt

        def step(current: Record | None) -> Step[Claim | Reuse]:
            new = _refusing(
                ident,
                current,
                lambda: machine.begin(
                    current,
                    identity=ident,
                    input_kind=kind,
                    input_hash=input_hash,
                    definition_hash=definition_hash,
                    claim_id=secrets.token_hex(16),
                    owner=current_owner(),
                    now=utc_now(),
                ),
            )
            if new is None:
                assert current is not None
                assert current.receipt is not None
                return Step(None, Reuse(current.receipt, ident, current.attempt))
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

        def undo(current: Record | None) -> Step[None]:
            # Only a record still carrying the claim we never handed out is taken back:
            # removed if it was new, or returned to the released record it replaced.
            for before, claim_id in granted:
                if current is not None and current.claim_id == claim_id:
                    if current.status != "started":
                        break
                    if before is None:
                        return Step(None, None, delete=True)
                    return Step(before, None)
            return Step(None, None)

        return await self._apply(ident, step, undo)

    async def complete(self, claim: Claim, receipt: str) -> RecordView:
        """Declare the claimed effect done; ``receipt`` is stored and reused by reruns."""
        if not isinstance(claim, Claim):
            raise InvalidArgument(
                f"complete() takes the Claim that begin() returned, not {type(claim).__name__}",
                code="INVALID_CLAIM",
            )
        receipt = _check_receipt(receipt)
        ident = coerce_identity(claim.identity)

        def step(current: Record | None) -> Step[RecordView]:
            new = _refusing(
                ident,
                current,
                lambda: machine.complete(
                    current,
                    claim_id=claim.claim_id,
                    input_hash=claim.input_hash,
                    definition_hash=claim.definition_hash,
                    receipt=receipt,
                    now=utc_now(),
                ),
            )
            return Step(new, _view(ident, new))

        return await self._apply(ident, step)

    async def mark_review(self, identity: IdentityLike, reason: str | None = None) -> RecordView:
        """Say the outcome of a started attempt is uncertain: ``needs_review``."""
        ident = coerce_identity(identity)
        if reason is not None:
            reason = _check_note(reason, "a review reason")
        return await self._mark_review(ident, reason, None)

    async def _mark_review(
        self, ident: Identity, reason: str | None, claim_id: str | None
    ) -> RecordView:
        def step(current: Record | None) -> Step[RecordView]:
            new = _refusing(
                ident,
                current,
                lambda: machine.mark_review(
                    current, reason=reason, claim_id=claim_id, now=utc_now()
                ),
            )
            return Step(new, _view(ident, new))

        return await self._apply(ident, step)

    async def resolve(
        self,
        identity: IdentityLike,
        *,
        receipt: str | None = None,
        retry: bool = False,
        note: str,
    ) -> RecordView:
        """An operator's decision on a ``needs_review`` record, audited in its history.

        With ``receipt``: the effect did happen, the record becomes ``succeeded``.
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
        note = _check_note(note, "a resolution note")

        def step(current: Record | None) -> Step[RecordView]:
            new = _refusing(
                ident,
                current,
                lambda: machine.resolve(current, receipt=receipt, note=note, now=utc_now()),
            )
            return Step(new, _view(ident, new))

        return await self._apply(ident, step)

    async def inspect(self, identity: IdentityLike) -> RecordView:
        """The record as it is now (``status == "absent"`` when there is none)."""
        ident = coerce_identity(identity)
        return await self._store.peek(ident, lambda record: _view(ident, record))

    async def sweep(self) -> list[RecordView]:
        """Mark ``started`` records whose owner process on this host is gone ``needs_review``.

        An explicit call, never a replay: the swept records refuse ``begin`` until an
        operator resolves them. A live owner's claim, or one on another host, is never
        touched. Returns the views of the records it marked.
        """
        swept: list[RecordView] = []
        async with contextlib.aclosing(self._store.scan(status="started")) as records:
            async for record in records:
                if isinstance(record, RecordInvalid) or record.status != "started":
                    continue
                ident = record.identity

                def step(
                    current: Record | None, ident: Identity = ident
                ) -> Step[RecordView | None]:
                    gone = current is not None and owner_alive(current.owner) is False
                    new = machine.sweep(current, owner_gone=gone, now=utc_now())
                    return Step(new, None if new is None else _view(ident, new))

                view = await self._apply(ident, step)
                if view is not None:
                    swept.append(view)
        return swept

    def claim(
        self, identity: IdentityLike, inputs: Mapping[str, str], definition: str
    ) -> ClaimContext:
        """``async with journal.claim(...) as attempt``: begin, then settle on exit.

        Leaving the block by an exception or a cancellation marks the record
        ``needs_review`` (shielded from cancellation) and lets the exception go on;
        leaving it normally without ``complete``/``mark_review`` marks it too and
        raises ``UnresolvedClaim``.
        """
        return ClaimContext(self, identity, inputs, definition)


class Attempt:
    """What ``journal.claim()`` yields: either a fresh claim or a reused receipt."""

    def __init__(self, journal: Journal, outcome: Claim | Reuse) -> None:
        self._journal = journal
        self._claim: Claim | None = outcome if isinstance(outcome, Claim) else None
        self.receipt: str | None = outcome.receipt if isinstance(outcome, Reuse) else None
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

    async def complete(self, receipt: str) -> RecordView:
        claim = self._own_claim("complete")
        self.view = await self._journal.complete(claim, receipt)
        self.settled = True
        self.receipt = receipt
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
        inputs: Mapping[str, str],
        definition: str,
    ) -> None:
        self._journal = journal
        self._args = (identity, inputs, definition)
        self._attempt: Attempt | None = None
        self._entered = False

    async def __aenter__(self) -> Attempt:
        if self._entered:
            raise InvalidArgument(
                "a claim context can be entered only once", code="INVALID_ARGUMENT"
            )
        self._entered = True
        outcome = await self._journal.begin(*self._args)
        self._attempt = Attempt(self._journal, outcome)
        return self._attempt

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        attempt = self._attempt
        if attempt is None or attempt.settled or attempt.reused:
            return False
        claim = attempt.claim
        reason = (
            "block ended without complete or mark_review"
            if exc is None
            else (f"block raised {type(exc).__name__}")
        )
        mark = functools.partial(self._journal._mark_review, claim.identity, reason, claim.claim_id)
        try:
            view, cancelled = await _to_the_end(mark)
        except ConflictError as conflict:
            seen = conflict.view
            if conflict.code == "NOT_STARTED" and seen is not None and seen.status == "succeeded":
                # Completed under this very claim, by journal.complete(attempt.claim, ...).
                attempt.settled = True
                return False
            if exc is None:  # someone else moved the record: the block itself never settled it
                raise UnresolvedClaim(
                    f"the claim on {list(claim.identity)} ended unresolved ({conflict})",
                    view=seen,
                ) from conflict
            exc.add_note(f"itemjournal did not mark {list(claim.identity)}: {conflict}")
            return False
        except JournalError as error:
            if exc is None:
                raise
            exc.add_note(f"itemjournal could not mark {list(claim.identity)} for review: {error}")
            return False
        attempt.settled = True
        attempt.view = view
        if cancelled is not None:
            raise cancelled  # a native cancellation that arrived meanwhile goes on
        if exc is None:
            raise UnresolvedClaim(
                f"the claim on {list(claim.identity)} ended unresolved; it now needs review",
                view=view,
            )
        return False


async def _to_the_end(call: Callable[[], Awaitable[T]]) -> tuple[T, BaseException | None]:
    """Run ``call`` to its end, shielded; retry it after a native asyncio cancellation.

    anyio's shield stops anyio's cancellation, not a bare ``task.cancel()``; ``call``
    must therefore be safe to run again (the steps used here re-check the record).
    Returns the result and the last native cancellation, which the caller re-raises.
    """
    cancelled: BaseException | None = None
    with anyio.CancelScope(shield=True):
        while True:
            try:
                result = await call()
            except anyio.get_cancelled_exc_class() as error:
                cancelled = error
            else:
                return result, cancelled
    raise AssertionError("unreachable")  # pragma: no cover - the loop only returns
