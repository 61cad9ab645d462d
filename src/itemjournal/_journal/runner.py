"""Running one operation's step through the store, with its identity to ourselves.

Every operation that may write goes through ``Runner.apply``: it takes the identity's
turn, hands the step to the store (which runs it on the record as it found it, under the
record's lock), takes back what a cancelled ``begin`` wrote for a claim nobody will see,
and logs and counts each write once the store acknowledged it. The operations
(``journal``), the claim block (``claim``) and the maintenance (``maintenance``) share
this one way to the store, so that turn-taking, undo and logging are the same for all.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from .._model.conflicts import ConflictError
from .._model.errors import StorageFailed
from .._model.identity import Identity
from .._model.records import Record
from .._model.view import Claim, RecordView, Reuse
from .._stores.seam import Step, Store
from .decisions import BeginSteps, Where, view_of, where_of
from .faces import ASYNC, LoopGuard
from .observe import Observer, Span
from .turns import Turns

__all__ = ["Runner", "to_the_end"]

T = TypeVar("T")
U = TypeVar("U")

# What a step saw and decided, each time the store ran it.
_Seen = list[tuple[Record | None, Step[object]]]


class Runner:
    """A journal's way to its store: turns per identity, steps, undo, and the log."""

    def __init__(
        self,
        store: Store,
        observer: Observer,
        span: Callable[[str, Identity | None], Span],
        input_kind: str,
    ) -> None:
        self.store = store
        self.observer = observer
        # The journal's own: itemjournal.otel may instrument the journal at any time.
        self.span = span
        self.turns = Turns()
        if ASYNC:
            self.guard = LoopGuard()
            awaited = True
        else:
            awaited = False
        # The journal as its refusals name it: where it is, and how its calls are made.
        self.where: Where = where_of(store, input_kind, awaited=awaited)

    async def apply_view(
        self,
        operation: str,
        identity: Identity,
        step: Callable[[Record | None], Step[RecordView]],
        outcome: str,
        *,
        ends_in_status: bool = False,
    ) -> RecordView:
        """``apply`` of a step that answers the record's view, inside the operation's span,
        which is given the outcome and the attempt (and the status, for an operation that
        can end in more than one)."""
        with self.span(operation, identity) as span:
            try:
                view = await self.apply(operation, identity, step)
            except ConflictError as refusal:  # its message says what the frames below would
                raise refusal.with_traceback(None) from None
            span.set("outcome", outcome)
            if ends_in_status:
                span.set("status", view.status)
            span.set("attempt", view.attempt)
            return view

    async def apply_begin(self, identity: Identity, steps: BeginSteps) -> Claim | Reuse:
        """``apply`` of a begin; its answer tells the turns whether a claim is now open
        here (waiters wait for its event) or the record is not ``started`` any more."""
        try:
            outcome = await self.apply("begin", identity, steps.step, steps.undo, steps.decided)
        except ConflictError as refusal:
            if refusal.code != "IN_PROGRESS":
                self.turns.settled(identity)  # not started (any more): nobody needs to wait
            raise
        if isinstance(outcome, ConflictError):
            raise outcome
        if isinstance(outcome, Claim):
            self.turns.granted(identity)
        else:
            self.turns.settled(identity)
        return outcome

    async def apply(
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
        if ASYNC:
            self.guard.check()
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
        observer = self.observer
        if not self.turns.try_acquire(identity):
            await self.turns.wait_turn(identity)
        try:
            try:
                answer = await self.store.apply(identity, watched(step, seen))
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
                    _, error, _ = await to_the_end(
                        functools.partial(self.store.apply, identity, watched(undo, undone))
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
            self.turns.release(identity)
            if left_started:
                self.turns.settled(identity)

    async def inspect(self, identity: Identity) -> RecordView:
        """The record as it is now, read without a turn (a read takes no lock)."""
        if ASYNC:
            self.guard.check()
        alive = self.store.owner_alive
        with self.span("inspect", identity) as span:
            try:
                view = await self.store.peek(
                    identity, lambda record: view_of(identity, record, alive)
                )
            except StorageFailed as failure:
                self.observer.failed("inspect", identity, failure)
                raise
            span.set("outcome", "absent" if view.status == "absent" else "found")
            span.set("status", view.status)
            span.set("attempt", view.attempt)
            return view


async def to_the_end(
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
