"""``run_each``: process items concurrently, each through the claim block, so that one
item's failure marks only that item for review and never cancels its siblings."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, Literal, TypeAlias, TypeVar

import anyio

from .._journal.arguments import check_definitions, check_wait, definition_hashes, is_async
from .._journal.journal import Journal
from .._model.conflicts import ConflictError
from .._model.errors import InvalidArgument, JournalError
from .._model.identity import DefinitionLike, Identity, IdentityLike, InputValue, coerce_identity
from .._model.view import Claim, RecordView
from .once import _AS_STORED, _name, _unpack

__all__ = ["EachDone", "EachFailure", "EachReport", "run_each"]

T = TypeVar("T")

Inputs: TypeAlias = "Mapping[str, InputValue]"


@dataclass(frozen=True, slots=True)
class EachDone(Generic[T]):
    """An item whose record succeeded: in this run (``fn`` ran) or before (reused)."""

    item: T
    identity: Identity
    receipt: str
    result: str | None = None


@dataclass(frozen=True, slots=True)
class EachFailure(Generic[T]):
    """An item that did not succeed, with the exception that says why.

    ``identity`` is None when the item's identity could not be made. ``view`` is the
    record as this run left it (``needs_review`` for a failure), or as it was found (for
    a refusal by the journal); None when there is no record to show.
    """

    item: T
    identity: Identity | None
    error: Exception
    view: RecordView | None = None

    @property
    def code(self) -> str | None:
        """The error's stable code for an itemjournal error (``REVIEW_REQUIRED``...), else None."""
        return self.error.code if isinstance(self.error, JournalError) else None


@dataclass(frozen=True, slots=True)
class EachReport(Generic[T]):
    """What ``run_each`` did, each list in the order the items came.

    - ``succeeded``: ``fn`` ran and its receipt is stored.
    - ``reused``: the item had succeeded before with the same inputs and definition; its
      stored receipt (and result) is returned and ``fn`` was not called.
    - ``failed``: ``fn`` was called under a fresh claim and raised, or returned no valid
      receipt, or the receipt could not be stored. The outcome is uncertain, so the record
      now needs review (should even that write fail, the record is left ``started`` and
      the error carries a note saying so).
    - ``refused``: ``fn`` was not called and no claim was left: the journal refused the
      item at entry (``REVIEW_REQUIRED``, ``IN_PROGRESS``, ``INPUT_CHANGED``,
      ``DEFINITION_CHANGED``, ``RECORD_INVALID``, ``STORAGE_FAILED``...) or its
      identity or inputs could not be made.
    - ``withdrawn``: ``fn`` raised ``Withdraw`` (it declared nothing was sent): the
      claim was withdrawn, the record is ``released`` (``view``) and the next run calls
      ``fn`` for the item again. ``counts()`` and ``summary()`` name this list only
      when it holds an item.
    """

    succeeded: tuple[EachDone[T], ...] = ()
    reused: tuple[EachDone[T], ...] = ()
    failed: tuple[EachFailure[T], ...] = ()
    refused: tuple[EachFailure[T], ...] = ()
    withdrawn: tuple[EachFailure[T], ...] = ()

    @property
    def total(self) -> int:
        """How many items were taken from the source."""
        return (
            len(self.succeeded)
            + len(self.reused)
            + len(self.failed)
            + len(self.refused)
            + len(self.withdrawn)
        )

    @property
    def ok(self) -> bool:
        """True when every item succeeded, here or before."""
        return not self.failed and not self.refused and not self.withdrawn

    def counts(self) -> dict[str, int]:
        """``{"succeeded": n, "reused": n, "failed": n, "refused": n}``, and
        ``"withdrawn": n`` when an item was withdrawn."""
        counts = {
            "succeeded": len(self.succeeded),
            "reused": len(self.reused),
            "failed": len(self.failed),
            "refused": len(self.refused),
        }
        if self.withdrawn:
            counts["withdrawn"] = len(self.withdrawn)
        return counts

    def summary(self) -> str:
        """One line for a log: ``20 items: 17 succeeded, 0 reused, 3 failed, 0 refused``."""
        parts = ", ".join(f"{count} {name}" for name, count in self.counts().items())
        return f"{self.total} item{'' if self.total == 1 else 's'}: {parts}"


_Kind = Literal["succeeded", "reused", "failed", "refused", "withdrawn"]


async def run_each(
    journal: Journal,
    items: Iterable[T] | AsyncIterable[T],
    fn: Callable[[T, Claim], Awaitable[str | tuple[str, str | None]]],
    *,
    identity: Callable[[T], IdentityLike],
    inputs: Callable[[T], Inputs] | Inputs | None = None,
    definition: DefinitionLike | None = None,
    limit: int,
    wait: float | None = None,
    compatible: Iterable[DefinitionLike] = (),
) -> EachReport[T]:
    """Run ``fn`` once per item, at most ``limit`` items at a time, each in its own claim.

    ::

        report = await itemjournal.run_each(
            journal,
            orders,
            charge,                       # async def charge(order, claim) -> receipt
            identity=lambda order: ("shop", "billing", "charge", order.id),
            inputs=lambda order: {"amount_cents": order.amount_cents},
            definition="charge-v3",
            limit=16,
        )
        for failure in report.failed:     # these records now need review
            log.error("%s: %r", failure.identity, failure.error)

    Each item is claimed in ``journal`` first: ``identity(item)`` names its record,
    ``inputs`` (a function of the item, a fixed mapping, or None for none) its inputs.
    Under a fresh claim, ``await fn(item, claim)`` performs the effect (pass
    ``claim.key`` to the provider as its idempotency key) and returns the receipt
    ``str``, or a ``(receipt, result)`` pair whose ``result`` is stored for replay; the
    receipt is then stored. An item that succeeded before is reused without calling
    ``fn``.

    ``definition``: what ``begin`` takes, with the same meaning: a 64-character
    lowercase hex string is the definition digest itself, any other string a version
    (``definition_digest(version)``), a callable its source. Omitted: the digest of
    ``fn``'s source. Sources are read once, in a worker thread, before any item starts.
    ``compatible``: earlier definitions (same forms) ``fn`` is compatible with, passed to
    each claim: an item that succeeded under one of them is reused.

    One item's exception never cancels another item: it is caught for that item only
    (the claim block has marked its record ``needs_review``, the reason naming the
    exception; or, for a ``Withdraw``, withdrawn the claim) and collected in the report,
    as are the journal's refusals. See
    ``EachReport`` for which list an item lands in. ``wait`` is passed to each claim
    (seconds to wait for an item in progress elsewhere); an identity that comes twice in
    one run is, the second time, reused, refused ``IN_PROGRESS``, or waited for.

    Only ``Exception``s are caught. A cancellation of the caller's scope, or a
    ``KeyboardInterrupt``, ends the whole run: every item in flight is cancelled, its
    record marked ``needs_review`` by the claim block, no new item is started, and the
    exception goes on (there is no report): a cancellation as it came, any other
    ``BaseException`` in an exception group, as anyio task groups raise it. An async
    generator cut short this way is closed.

    ``items`` may be an iterable or an async iterable, of any length: an item is taken
    from it only when one of the ``limit`` places is free, so at most ``limit`` items are
    held at once. A plain iterable is read on the event loop, so taking an item must not
    block (read a file or a queue through an async iterable). If taking the next item
    raises, no further item is started, the items in flight finish (and are recorded as
    usual), and then that exception is raised.

    Raises ``InvalidArgument`` before any item starts for a bad argument (``limit`` not a
    positive int, ``fn`` not an ``async def``, a definition that is not usable...).
    """
    if not isinstance(journal, Journal):
        raise InvalidArgument(
            f"run_each() takes a Journal, not {type(journal).__name__}", code="INVALID_ARGUMENT"
        )
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidArgument(
            f"limit is the number of items in flight at once, a positive int, not {limit!r}",
            code="INVALID_ARGUMENT",
        )
    if not is_async(fn):
        raise InvalidArgument(
            f"run_each() calls an async def function; {_name(fn)} is not one",
            code="INVALID_ARGUMENT",
        )
    if not callable(identity):
        raise InvalidArgument(
            "identity is a function of the item returning its four labels",
            code="INVALID_IDENTITY",
        )
    inputs_of = _inputs_function(inputs)
    wait = check_wait(wait)
    source = _source(items)
    forms = check_definitions(fn if definition is None else definition, compatible)
    digest, accepted = await definition_hashes(forms)
    name = _name(fn)

    slots = anyio.Semaphore(limit)
    finished: list[tuple[int, _Kind, EachDone[T] | EachFailure[T]]] = []
    source_error: Exception | None = None

    async def run_one(index: int, item: T) -> None:
        try:
            kind, entry = await _one(
                item,
                journal=journal,
                fn=fn,
                identity_of=identity,
                inputs_of=inputs_of,
                digest=digest,
                accepted=accepted,
                wait=wait,
                name=name,
            )
            finished.append((index, kind, entry))
        finally:
            slots.release()

    async with anyio.create_task_group() as group:
        index = 0
        exhausted = False
        try:
            while True:
                await slots.acquire()  # a place first, then the item: nothing waits in memory
                try:
                    item = await source.__anext__()
                except StopAsyncIteration:
                    slots.release()
                    exhausted = True
                    break
                except Exception as error:
                    slots.release()
                    exhausted = True
                    source_error = error
                    break
                group.start_soon(run_one, index, item, name=f"run_each item {index}")
                index += 1
        finally:
            if not exhausted:  # cut short by a cancellation: close an async generator
                aclose = getattr(source, "aclose", None)
                if aclose is not None:
                    await aclose()

    finished.sort(key=lambda entry: entry[0])
    lists: dict[_Kind, list[EachDone[T] | EachFailure[T]]] = {
        "succeeded": [],
        "reused": [],
        "failed": [],
        "refused": [],
        "withdrawn": [],
    }
    for _, kind, entry in finished:
        lists[kind].append(entry)
    report = EachReport(
        succeeded=tuple(_done(entry) for entry in lists["succeeded"]),
        reused=tuple(_done(entry) for entry in lists["reused"]),
        failed=tuple(_failure(entry) for entry in lists["failed"]),
        refused=tuple(_failure(entry) for entry in lists["refused"]),
        withdrawn=tuple(_failure(entry) for entry in lists["withdrawn"]),
    )
    if source_error is not None:
        source_error.add_note(
            f"run_each() stopped taking items after {index}; those finished: {report.summary()}"
        )
        raise source_error
    return report


async def _one(
    item: T,
    *,
    journal: Journal,
    fn: Callable[[T, Claim], Awaitable[str | tuple[str, str | None]]],
    identity_of: Callable[[T], IdentityLike],
    inputs_of: Callable[[T], Inputs],
    digest: str,
    accepted: frozenset[str],
    wait: float | None,
    name: str,
) -> tuple[_Kind, EachDone[T] | EachFailure[T]]:
    """One item through the claim block; its ``Exception``s become a report entry."""
    try:
        ident = coerce_identity(identity_of(item))
        item_inputs = inputs_of(item)
    except Exception as error:
        return "refused", EachFailure(item, None, error)
    claimed = None
    try:
        async with journal.claim(
            ident, item_inputs, digest, wait=wait, compatible=accepted
        ) as attempt:
            if attempt.reused:
                return "reused", EachDone(item, ident, attempt.receipt, attempt.result)
            claimed = attempt
            value: object = await fn(item, attempt.claim)
            receipt, result, problem = _unpack(value, _AS_STORED, name)
            if problem is not None:
                # The effect may have happened: only an operator can say what it left.
                with anyio.CancelScope(shield=True):
                    await attempt.mark_review(problem)
                raise InvalidArgument(
                    f"{problem}; {list(ident)} now needs review", code="INVALID_RECEIPT"
                )
            await attempt.complete(receipt, result=result)
        return "succeeded", EachDone(item, ident, receipt, result)
    except Exception as error:
        if claimed is None:  # refused at entry: nothing was claimed
            view = error.view if isinstance(error, ConflictError) else None
            return "refused", EachFailure(item, ident, error, view)
        if _withdrawn(claimed.view):
            return "withdrawn", EachFailure(item, ident, error, claimed.view)
        return "failed", EachFailure(item, ident, error, claimed.view)


def _withdrawn(view: RecordView | None) -> bool:
    """Whether this run's claim ended withdrawn (its ``fn`` raised ``Withdraw``)."""
    return (
        view is not None
        and view.status == "released"
        and bool(view.history)
        and view.history[-1].event == "withdrawn"
    )


def _done(entry: EachDone[T] | EachFailure[T]) -> EachDone[T]:
    assert isinstance(entry, EachDone)
    return entry


def _failure(entry: EachDone[T] | EachFailure[T]) -> EachFailure[T]:
    assert isinstance(entry, EachFailure)
    return entry


def _inputs_function(inputs: Callable[[T], Inputs] | Inputs | None) -> Callable[[T], Inputs]:
    if inputs is None:
        return lambda _item: {}
    if isinstance(inputs, Mapping):
        fixed = dict(inputs)  # a copy: later edits of the caller's dict change nothing
        return lambda _item: fixed
    if callable(inputs):
        return inputs
    raise InvalidArgument(
        f"inputs is a function of the item, a mapping or None, not {type(inputs).__name__}",
        code="INVALID_INPUTS",
    )


def _source(items: Iterable[T] | AsyncIterable[T]) -> AsyncIterator[T]:
    """An async iterator over ``items``, whichever kind they are."""
    if isinstance(items, AsyncIterable):
        return aiter(items)
    if isinstance(items, Iterable):
        return _SyncSource(iter(items))
    raise InvalidArgument(
        f"items is an iterable or an async iterable, not {type(items).__name__}",
        code="INVALID_ARGUMENT",
    )


class _SyncSource(Generic[T]):
    """An async iterator over a plain iterator, without an ``aclose`` to call."""

    def __init__(self, iterator: Iterable[T]) -> None:
        self._iterator = iter(iterator)

    def __aiter__(self) -> _SyncSource[T]:  # pragma: no cover - the protocol asks for it
        return self

    async def __anext__(self) -> T:
        try:
            return next(self._iterator)
        except StopIteration:
            raise StopAsyncIteration from None
