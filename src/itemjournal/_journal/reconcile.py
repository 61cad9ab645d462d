"""Reconciliation: settle uncertain records by asking the provider what happened.

Every claim hands the provider a stable idempotency key (``Claim.key``, the same as
``RecordView.key``). A check asks the provider what happened to that key and answers with
a verdict; ``reconcile`` turns each verdict into an ordinary, audited ``resolve`` of the
very record the check looked at, and leaves everything else to a person.

The engine stands on the journal through the two operations it uses (``Reconcilable``),
never on ``Journal`` itself: ``Journal.reconcile`` calls it, and the operator's command
calls it with a progress bar, so it lives in the journal's layer below both.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType
from typing import Protocol, runtime_checkable

import anyio
import anyio.to_thread

from .._model.conflicts import ConflictError
from .._model.errors import InvalidArgument, JournalError, RecordInvalid, StorageFailed
from .._model.identity import Identity, check_label
from .._model.records import MAX_NOTE_CHARS
from .._model.verdicts import (
    VERDICTS,
    Check,
    DidNotHappen,
    Happened,
    ReconcileReport,
    Unknown,
    Verdict,
)
from .._model.view import RecordView
from .arguments import is_async
from .faces import ASYNC, awaited
from .observe import Observer, Span

__all__ = ["Reconcilable", "reconcile", "reconcile_observed", "resolution_note"]


@runtime_checkable
class Reconcilable(Protocol):
    """What reconciliation needs of a journal: its listing, and a resolve of the very
    record a view shows (``NOT_IN_REVIEW`` when it changed since)."""

    def records(
        self,
        status: str | None = None,
        *,
        scope: str | None = None,
        program: str | None = None,
        job: str | None = None,
        after: str | None = None,
        problems: bool,
    ) -> AsyncGenerator[RecordView | RecordInvalid | StorageFailed, None]: ...

    async def _resolve(
        self,
        ident: Identity,
        receipt: str | None,
        note: str,
        result: str | None,
        expect: RecordView | None = None,
    ) -> RecordView: ...


_NAME_CHARS = 100  # how much of the check's name a resolution note carries
_TEXT_CHARS = 1000  # how much of an exception's message the report keeps


def _fit(text: str) -> str:
    if len(text) <= MAX_NOTE_CHARS:
        return text
    return text[: MAX_NOTE_CHARS - 1] + "\u2026"


def _check_name(check: object) -> str:
    """``module.qualname`` of the check, as a resolution note names it."""
    target = check.func if isinstance(check, functools.partial) else check
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    module = getattr(target, "__module__", None)
    text = f"{module}.{name}" if isinstance(module, str) and module else str(name)
    text = text.replace("<locals>.", "")
    return text if len(text) <= _NAME_CHARS else text[: _NAME_CHARS - 1] + "\u2026"


def resolution_note(verdict: Happened | DidNotHappen, name: str) -> str:
    """The note of the ``resolve`` a verdict makes: it names the reconciliation, then
    carries the verdict's note or evidence, cut to the note limit."""
    if isinstance(verdict, Happened):
        text = f"reconciled by {name}: the provider reports it happened"
        if verdict.note is not None:
            text += f": {verdict.note}"
    else:
        text = f"reconciled by {name}: the provider reports it did not happen: {verdict.evidence}"
    return _fit(text)


def _failure_text(error: BaseException) -> str:
    try:
        message = str(error)
    except Exception:  # a broken __str__ must not stop the report
        message = "(its message cannot be shown)"
    text = type(error).__name__
    if message.strip():
        text += f": {message}"
    text = text.encode("utf-8", "replace").decode("utf-8")
    return text if len(text) <= _TEXT_CHARS else text[: _TEXT_CHARS - 1] + "\u2026"


async def reconcile(
    journal: Reconcilable,
    check: Check,
    *,
    status: str = "needs_review",
    scope: str | None = None,
    program: str | None = None,
    job: str | None = None,
    limit: int = 8,
    dry_run: bool = False,
    progress: Callable[[RecordView], None] | None = None,
) -> ReconcileReport:
    """Ask ``check`` what happened to each ``needs_review`` record; settle what it knows.

    ``check(view)`` (an ``async def``, or a plain function, run in a worker thread) gets
    each matching record's ``RecordView`` and answers with a verdict:

    - ``Happened(receipt, result=None, note=None)``: resolved ``succeeded`` with the receipt;
    - ``DidNotHappen(evidence)``: resolved ``released`` (claimable again);
    - ``Unknown(reason)``: left as it is, for a person.

    A check that raises, or returns anything else, is reported in ``failed`` and its
    record left as it is. Each resolution is one atomic, audited ``resolve`` of the very
    record the check saw: a record that changed meanwhile (resolved by someone else, a new
    attempt) is left as it is now and reported in ``left``. Its note names the check and
    carries the verdict's note or evidence.

    At most ``limit`` checks run at once; records are read as they are needed. With
    ``dry_run=True`` the checks are called but nothing is written: the report says what
    would be done. ``scope``, ``program`` and ``job`` narrow the records; ``status`` must
    be ``needs_review``: a ``started`` record is never reconciled (its owner may still
    finish; ``sweep`` or ``begin`` marks a dead owner's record ``needs_review`` first).

    A cancellation ends the run (no report): each record is then either as it was or
    resolved as its verdict says, never half-way, since every resolution is a single
    atomic journal operation.

    ``progress`` (not part of ``Journal.reconcile``; the command's progress bar) is called
    on the event loop once per record, when it has been settled or left.
    """
    if not isinstance(journal, Reconcilable):
        raise InvalidArgument(
            f"reconcile() takes a Journal, not {type(journal).__name__}",
            code="INVALID_ARGUMENT",
        )
    if not callable(check):
        raise InvalidArgument(
            "check is a function of a RecordView returning Happened, DidNotHappen or "
            f"Unknown, not {type(check).__name__}",
            code="INVALID_ARGUMENT",
        )
    if status == "started":
        raise InvalidArgument(
            "started records are not reconciled: a live owner may still finish; run sweep "
            "first, which marks the records of owners that are gone needs_review",
            code="INVALID_ARGUMENT",
        )
    if status != "needs_review":
        raise InvalidArgument(
            f"only needs_review records are reconciled, not {status!r}", code="INVALID_ARGUMENT"
        )
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidArgument(
            f"limit is the number of checks in flight at once, a positive int, not {limit!r}",
            code="INVALID_ARGUMENT",
        )
    if not isinstance(dry_run, bool):
        raise InvalidArgument("dry_run must be True or False", code="INVALID_ARGUMENT")
    if progress is not None and not callable(progress):
        raise InvalidArgument("progress is a function of a RecordView", code="INVALID_ARGUMENT")
    for value, what in ((scope, "scope"), (program, "program"), (job, "job")):
        if value is not None:
            check_label(value, what)

    name = _check_name(check)
    if ASYNC:
        asynchronous = is_async(check)
    happened: list[RecordView] = []
    did_not_happen: list[RecordView] = []
    unknown: list[RecordView] = []
    left: list[RecordView] = []
    failed: list[tuple[RecordView, str]] = []
    problems: list[JournalError] = []
    verdicts: dict[str, Verdict] = {}

    async def ask(view: RecordView) -> object:
        if ASYNC and not asynchronous:
            # A plain function may block (an HTTP client, say): never on the event loop.
            # It only reads, so a cancellation need not wait for it.
            answer: object = await anyio.to_thread.run_sync(check, view, abandon_on_cancel=True)
        else:
            answer = check(view)
        if inspect.isawaitable(answer):
            if ASYNC:
                answer = await answer
            else:  # an async check, called from blocking code: on an event loop of its own
                answer = anyio.run(awaited, answer)
        return answer

    async def settle(view: RecordView, slot: anyio.Semaphore | threading.Semaphore) -> None:
        try:
            try:
                verdict = await ask(view)
            except Exception as error:
                failed.append((view, _failure_text(error)))
                return
            if not isinstance(verdict, VERDICTS):
                failed.append(
                    (
                        view,
                        f"the check returned {type(verdict).__name__}, not Happened, "
                        "DidNotHappen or Unknown",
                    )
                )
                return
            verdicts[view.key] = verdict
            if isinstance(verdict, Unknown):
                unknown.append(view)
                return
            into = happened if isinstance(verdict, Happened) else did_not_happen
            if dry_run:
                into.append(view)
                return
            note = resolution_note(verdict, name)
            try:
                if isinstance(verdict, Happened):
                    done = await journal._resolve(
                        view.identity, verdict.receipt, note, verdict.result, expect=view
                    )
                else:
                    done = await journal._resolve(view.identity, None, note, None, expect=view)
            except ConflictError as changed:  # NOT_IN_REVIEW: not the record the check saw
                left.append(changed.view if changed.view is not None else view)
                return
            except JournalError as error:
                failed.append((view, f"the resolution was not written: {error}"))
                return
            into.append(done)
        finally:
            slot.release()
            if progress is not None:
                progress(view)

    slots = anyio.Semaphore(limit) if ASYNC else threading.Semaphore(limit)
    # The listing is closed as soon as it ends; the checks are then waited for.
    async with (
        _checks(limit) as start,
        contextlib.aclosing(
            journal.records("needs_review", scope=scope, program=program, job=job, problems=True)
        ) as items,
    ):
        async for item in items:
            if isinstance(item, (RecordInvalid, StorageFailed)):
                problems.append(item)
                continue
            await slots.acquire()
            start(settle, item, slots)

    def by_key(view: RecordView) -> str:
        return view.key

    return ReconcileReport(
        happened=tuple(sorted(happened, key=by_key)),
        did_not_happen=tuple(sorted(did_not_happen, key=by_key)),
        unknown=tuple(sorted(unknown, key=by_key)),
        left=tuple(sorted(left, key=by_key)),
        failed=tuple(sorted(failed, key=lambda pair: pair[0].key)),
        problems=tuple(problems),
        dry_run=dry_run,
        verdicts=MappingProxyType(dict(sorted(verdicts.items()))),
    )


@contextlib.asynccontextmanager
async def _checks(limit: int) -> AsyncIterator[Callable[..., object]]:
    """Where the checks run, as many at once as ``limit`` lets the caller start: tasks of
    a task group, or, for blocking code, a pool of threads (a check may block on a
    provider). Leaving waits for every check started."""
    if ASYNC:
        async with anyio.create_task_group() as group:
            yield group.start_soon
    else:
        with ThreadPoolExecutor(limit, thread_name_prefix="itemjournal reconcile") as pool:
            yield pool.submit


async def reconcile_observed(
    journal: Reconcilable,
    span: Span,
    observer: Observer,
    check: Check,
    *,
    status: str,
    scope: str | None,
    program: str | None,
    job: str | None,
    limit: int,
    dry_run: bool,
) -> ReconcileReport:
    """``reconcile``, inside the span ``Journal.reconcile`` opened, with the summary the
    journal logs of it."""
    with span:
        report = await reconcile(
            journal,
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
    observer.summary(
        "reconcile",
        f"reconcile{' (dry run)' if dry_run else ''}: "
        + ", ".join(f"{count} {name}" for name, count in counts.items()),
        dry_run=dry_run,
        **counts,
    )
    return report
