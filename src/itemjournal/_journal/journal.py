"""``Journal``: the public operations, on top of the state machine and one store.

Each method checks what it was given, asks its step (``decisions``) of the store through
the journal's ``Runner`` (one identity at a time, undo after a cancelled ``begin``, each
write logged), and reports the outcome on its span. What lives beside it: the checks of
arguments (``arguments``), the turn-taking and waiting (``turns``), the claim block
(``claim``), the whole-journal listing and maintenance (``maintenance``) and the
reconciliation engine (``reconcile``), to which the methods of those names delegate.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncGenerator, Awaitable, Iterable, Mapping
from datetime import timedelta
from typing import Literal, Unpack, overload

import anyio

from .._model.conflicts import ConflictError
from .._model.errors import RecordInvalid, StorageFailed
from .._model.identity import (
    DefinitionLike,
    Identity,
    IdentityLike,
    InputDigester,
    InputValue,
    coerce_identity,
)
from .._model.records import Record
from .._model.verdicts import Check, ReconcileReport
from .._model.view import Claim, PruneReport, RecordView, Reuse, SweepReport
from .._stores.seam import Store
from .arguments import (
    check_claim,
    check_definitions,
    check_note,
    check_receipt,
    check_resolution,
    check_result,
    check_wait,
    definition_hashes,
    plain_hashes,
)
from .claim import ClaimContext
from .decisions import (
    BeginSteps,
    complete_step,
    mark_review_step,
    resolve_step,
    withdraw_step,
)
from .faces import ASYNC, require_blocking
from .maintenance import Filters, Maintenance
from .observe import NO_SPAN, JournalStatistics, Observer, Span, Tracing
from .opening import locate_store, require_input_kind
from .reconcile import reconcile_observed
from .runner import Runner
from .waiting import wait_while_in_progress

__all__ = ["Journal"]


class Journal:
    """Durable intent before an external effect; the caller's declaration after it.

    One ``Journal`` serves any number of tasks. Operations on one identity run one at
    a time; operations on different identities run in parallel.
    """

    def __init__(self, store: Store, *, input_key: bytes | None = None) -> None:
        if not ASYNC:
            require_blocking(store)
        self._store = store
        self._alive = store.owner_alive
        self._digester = InputDigester(input_key)
        self._observer = Observer()
        # Set by ``itemjournal.otel.instrument``: what wraps each operation in a span.
        self._tracing: Tracing | None = None
        self._runner = Runner(store, self._observer, self._span, self._digester.kind)
        self._where = self._runner.where  # this journal, as its refusals name it
        self._maintenance = Maintenance(self._runner)
        # Identities in flight, and open claims this journal granted: empty when at rest.
        self._busy = self._runner.turns.busy
        self._live = self._runner.turns.live

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
        store = await locate_store(location, lock_timeout, trust_shared_root)
        journal = cls(store, input_key=input_key)
        try:
            await store.open()
            await require_input_kind(store, journal.input_kind)
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

    # ------------------------------------------------------------------ operations

    async def begin(
        self,
        identity: IdentityLike,
        inputs: Mapping[str, InputValue],
        definition: DefinitionLike,
        *,
        wait: float | None = None,
        compatible: Iterable[DefinitionLike] = (),
    ) -> Claim | Reuse:
        """Durably record intent, then grant a ``Claim``; or ``Reuse`` a succeeded record.

        ``definition``: a digest, a version string or a callable (``definition_digest``).
        ``compatible``: earlier definitions, same forms; a ``succeeded`` record made under
        one of them is reused, any other record of another one is ``DEFINITION_CHANGED``.

        A ``started`` record whose owner lives (or cannot be known) is ``IN_PROGRESS``;
        with ``wait=seconds`` the call waits for it to leave ``started`` and then answers
        as usual (a ``Reuse``, a ``Claim`` after a release, ``REVIEW_REQUIRED``...), or
        raises ``IN_PROGRESS`` when the time is up. A ``started`` record whose owner is
        provably gone is marked ``needs_review`` and refused with ``REVIEW_REQUIRED``.
        """
        ident = coerce_identity(identity)
        input_hash = self._digester(inputs)
        forms = check_definitions(definition, compatible)
        limit = check_wait(wait)
        definition_hash, accepted = plain_hashes(forms) or await definition_hashes(forms)

        def attempt() -> Awaitable[Claim | Reuse]:
            steps = BeginSteps(
                ident,
                input_kind=self._digester.kind,
                input_hash=input_hash,
                definition_hash=definition_hash,
                store=self._store,
                where=self._where,
                compatible=accepted,
            )
            return self._runner.apply_begin(ident, steps)

        with self._span("begin", ident) as span:
            try:
                if limit is None:
                    outcome = await attempt()
                else:
                    turns = self._runner.turns
                    outcome = await wait_while_in_progress(turns, ident, attempt, limit)
            except ConflictError as refusal:
                self._observer.refused("begin", ident, refusal)
                raise refusal.with_traceback(None) from None  # its message tells it all
            if isinstance(outcome, Claim):
                span.set("outcome", "claimed")
                span.set("claim_id", outcome.claim_id)
            else:
                self._observer.reused(ident, outcome.attempt, outcome.receipt)
                span.set("outcome", "reused")
            span.set("attempt", outcome.attempt)
            return outcome

    async def complete(
        self, claim: Claim, receipt: str, *, result: str | None = None
    ) -> RecordView:
        """Declare the claimed effect done; ``receipt`` is stored and reused by reruns.

        ``receipt`` is a short reference (at most 200 characters); ``result``, optional,
        is what a rerun should replay (at most 64 KiB of UTF-8), returned as
        ``Reuse.result`` and ``RecordView.result``.
        """
        check_claim(claim)
        receipt = check_receipt(receipt)
        result = check_result(result)
        ident = coerce_identity(claim.identity)
        step = complete_step(ident, claim, receipt, result, self._alive, where=self._where)
        return await self._runner.apply_view("complete", ident, step, "completed")

    async def mark_review(self, identity: IdentityLike, reason: str | None = None) -> RecordView:
        """Say the outcome of a started attempt is uncertain: ``needs_review``."""
        ident = coerce_identity(identity)
        if reason is not None:
            reason = check_note(reason, "a review reason")
        return await self._mark_review(ident, reason, None)

    async def _mark_review(
        self, ident: Identity, reason: str | None, claim_id: str | None
    ) -> RecordView:
        step = mark_review_step(ident, reason, claim_id, self._alive, self._where)
        return await self._runner.apply_view("mark_review", ident, step, "marked")

    async def withdraw(self, claim: Claim, reason: str) -> RecordView:
        """Declare the effect never started (only where nothing was sent): ``released``,
        event ``withdrawn``; keyed like ``complete``, never forced (see ``Withdraw``)."""
        check_claim(claim)
        return await self._withdraw(claim, check_note(reason, "a withdrawal reason"))

    async def _withdraw(
        self, claim: Claim, reason: str, own: list[Record] | None = None
    ) -> RecordView:
        ident = coerce_identity(claim.identity)
        step = withdraw_step(ident, claim, reason, self._alive, where=self._where, own=own)
        return await self._runner.apply_view("withdraw", ident, step, "withdrawn")

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
        receipt, note, result = check_resolution(receipt, retry, note, result)
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
        step = resolve_step(
            ident, receipt, note, result, expect=expect, alive=self._alive, where=self._where
        )
        return await self._runner.apply_view(
            "resolve", ident, step, "resolved", ends_in_status=True
        )

    async def inspect(self, identity: IdentityLike) -> RecordView:
        """The record as it is now (``status == "absent"`` when there is none)."""
        return await self._runner.inspect(coerce_identity(identity))

    def claim(
        self,
        identity: IdentityLike,
        inputs: Mapping[str, InputValue],
        definition: DefinitionLike,
        *,
        wait: float | None = None,
        compatible: Iterable[DefinitionLike] = (),
    ) -> ClaimContext:
        """``async with journal.claim(...) as attempt``: begin, then settle on exit.

        ``definition``, ``wait`` and ``compatible`` are ``begin``'s. Leaving the block by
        an exception or a cancellation marks the record ``needs_review`` (shielded from
        cancellation) and lets the exception go on; leaving it normally without
        ``complete``/``mark_review`` marks it too and raises ``UnresolvedClaim``.
        """
        definition, *earlier = check_definitions(definition, compatible)  # read once, now
        check_wait(wait)
        return ClaimContext(
            self, identity, inputs, definition, runner=self._runner, wait=wait, compatible=earlier
        )

    # ------------------------------------------------------------------ the whole journal

    @overload
    def records(
        self,
        status: str | None = None,
        *,
        problems: Literal[False] = False,
        **filters: Unpack[Filters],
    ) -> AsyncGenerator[RecordView, None]: ...
    @overload
    def records(
        self, status: str | None = None, *, problems: bool, **filters: Unpack[Filters]
    ) -> AsyncGenerator[RecordView | RecordInvalid | StorageFailed, None]: ...

    async def records(
        self,
        status: str | None = None,
        *,
        scope: str | None = None,
        program: str | None = None,
        job: str | None = None,
        after: str | None = None,
        problems: bool = False,
    ) -> AsyncGenerator[RecordView | RecordInvalid | StorageFailed, None]:
        """Stream the journal's records as ``RecordView``s, in key order (``view.key``).

        ``status`` and the labels filter; ``after`` (a key) starts after that record, for
        keyset pagination. A record (or a part of the store) that cannot be read is left
        out; with ``problems=True`` it comes as its ``RecordInvalid`` (``StorageFailed``)
        and the listing goes on. Reads in batches; nothing beyond one is held in memory.
        """
        listing = self._maintenance.records(status, scope, program, job, after, problems=problems)
        async with contextlib.aclosing(listing) as items:
            async for item in items:
                yield item

    async def counts(self) -> dict[str, int]:
        """How many records there are per status, and how many cannot be read (``invalid``)."""
        return await self._maintenance.counts()

    async def prune(self, older_than: timedelta, *, dry_run: bool = False) -> PruneReport:
        """Remove ``succeeded`` and ``released`` records last changed before ``older_than``.

        Each removal is one atomic step that checks the record again (a crash leaves every
        record either whole or gone). Nothing else is ever removed. A pruned identity is
        forgotten: a later ``begin`` claims it afresh, so prune only what no caller can
        ask about again. With ``dry_run=True`` nothing changes and the report lists what
        would be removed.
        """
        return await self._maintenance.prune(older_than, dry_run)

    async def verify(self) -> tuple[str, ...]:
        """Check the whole journal; one line per problem, nothing when all is well.

        Every record must read strictly and be fingerprinted with the location's input
        kind; the store adds its own checks (orphan temp files, its metadata).
        """
        return await self._maintenance.verify(self.input_kind)

    async def sweep(self) -> SweepReport:
        """Mark ``started`` records whose owner is proven gone (a process of this host
        that ended; with PostgreSQL, an owner on any host whose session ended)
        ``needs_review``: an explicit call, never a replay; they refuse ``begin`` until
        resolved. A live owner's claim, or one that cannot be judged, is never touched.
        A record that cannot be read or written is reported in ``problems`` and skipped.
        """
        return await self._maintenance.sweep()

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
        return await reconcile_observed(
            self,
            self._span("reconcile", None),
            self._observer,
            check,
            status=status,
            scope=scope,
            program=program,
            job=job,
            limit=limit,
            dry_run=dry_run,
        )
