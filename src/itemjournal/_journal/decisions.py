"""What each operation asks the store to run: its ``Step`` for the record as found.

A step is called by the store, in a worker thread, under the record's lock, with the
record as it is now; it asks the state machine (``_model.machine``) for the next record
and answers with what the caller gets back (a claim, a reuse, the record's view). A
refusal leaves with the record's view attached. Liveness reads ``/proc`` or asks the
database, which is why views are built here, in the step, and never on the event loop.
Kept apart from ``Journal`` so that the journal's methods say what an operation checks
and reports, and this module what it decides.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import TypeVar

from .._model import machine
from .._model.conflicts import ConflictError
from .._model.identity import Identity, identity_digest
from .._model.records import Owner, Record, parse_process, utc_now
from .._model.refusals import Where, explain
from .._model.view import Claim, RecordView, Reuse
from .._stores.owners import known_own_owner
from .._stores.registry import redact
from .._stores.seam import Step, Store

__all__ = [
    "BeginSteps",
    "Liveness",
    "Where",
    "complete_step",
    "explained",
    "mark_review_step",
    "prune_step",
    "refusing",
    "resolve_step",
    "same",
    "sweep_step",
    "this_process",
    "view_of",
    "where_of",
    "withdraw_step",
]

T = TypeVar("T")

Liveness = Callable[[Owner | None], "bool | None"]


def view_of(identity: Identity, record: Record | None, alive: Liveness) -> RecordView:
    """Build a view; liveness reads /proc or asks the database, so only ever call it in a
    worker thread."""
    known = alive(record.owner) if record is not None and record.status == "started" else None
    return RecordView.of(identity, record, known)


# The schemes of the locations an ``itemjournal`` command opens (an absolute directory too).
_COMMAND_SCHEMES = ("sqlite://", "postgresql://", "postgres://")


def where_of(store: Store, input_kind: str, *, awaited: bool) -> Where:
    """Where the journal over ``store`` is, as its refusals name it: the location with its
    secrets hidden, or None when it is not one a command can open (a store in memory);
    ``awaited``: the journal is the async one."""
    location = store.location
    reachable = location.startswith("/") or location.startswith(_COMMAND_SCHEMES)
    return Where(
        location=redact(location) if reachable else None,
        keyed=input_kind != "sha256",
        trust_shared_root=getattr(store, "trust_shared_root", False) is True,
        awaited=awaited,
    )


def this_process(owner: Owner | None) -> bool | None:
    """Whether ``owner`` is this very process; None when that cannot be told here.

    This process knows its exact name once it has named itself for a claim
    (``known_own_owner``, which reads nothing); a record that names its owner exactly
    was written by another process when this one never named itself so."""
    name = None if owner is None else parse_process(owner.process)
    if owner is None or name is None or name.ticks is None:
        return None  # not named exactly: no process can be told from another
    me = known_own_owner()
    if me is None:
        return False
    return (owner.process, owner.pid) == (me.process, me.pid)


def explained(
    error: ConflictError,
    identity: Identity,
    record: Record | None,
    alive: Liveness,
    where: Where,
) -> ConflictError:
    """``error`` with the record's view attached and its message made whole: what the
    record says and the next step (``refusals.explain``). Liveness and whether the owner
    is this process are judged here, in the worker trip."""
    view = view_of(identity, record, alive)
    own = this_process(view.owner) if view.status == "started" else None
    error.view = view
    error.message = explain(error.message, error.code, view, own=own, where=where)
    error.args = (error.message,)
    return error


def refusing(
    identity: Identity,
    record: Record | None,
    alive: Liveness,
    call: Callable[[], T],
    where: Where,
) -> T:
    """Run a state-machine call; a refusal leaves with the record's view attached and its
    message made whole (``explained``)."""
    try:
        return call()
    except ConflictError as error:
        raise explained(error, identity, record, alive, where) from None


def same(record: Record, view: RecordView) -> bool:
    """Whether ``record`` is still the one ``view`` shows: every transition moves
    ``updated_at`` and appends to the history, and a new attempt changes ``attempt``."""
    return (
        record.status == view.status
        and record.attempt == view.attempt
        and record.updated_at == view.updated_at
        and record.review_reason == view.review_reason
        and record.history == view.history
    )


class BeginSteps:
    """``begin``'s step, and the undo of what it wrote when its caller never sees the claim."""

    def __init__(
        self,
        identity: Identity,
        *,
        input_kind: str,
        input_hash: str,
        definition_hash: str,
        store: Store,
        where: Where,
        compatible: frozenset[str] = frozenset(),
    ) -> None:
        self._identity = identity
        self._where = where
        self._input_kind = input_kind
        self._input_hash = input_hash
        self._definition_hash = definition_hash
        self._compatible = compatible
        self._store = store
        self._alive = store.owner_alive
        self._why = store.gone_reason
        self._granted: list[tuple[Record | None, str]] = []  # (record before, claim id) per try

    def decided(self) -> bool:
        """Whether a try decided to grant a claim (and so may have written one)."""
        return bool(self._granted)

    def step(self, current: Record | None) -> Step[Claim | Reuse | ConflictError]:
        ident = self._identity
        alive = self._alive
        gone = (
            self._why(current.owner)
            if current is not None and current.status == "started" and alive(current.owner) is False
            else None
        )
        new = refusing(
            ident,
            current,
            alive,
            lambda: machine.begin(
                current,
                identity=ident,
                input_kind=self._input_kind,
                input_hash=self._input_hash,
                definition_hash=self._definition_hash,
                claim_id=secrets.token_hex(16),
                owner=self._store.owner(),
                now=utc_now(),
                owner_gone=gone,
                compatible=self._compatible,
            ),
            self._where,
        )
        if new is None:
            assert current is not None
            assert current.receipt is not None
            return Step(None, Reuse(current.receipt, ident, current.attempt, result=current.result))
        if new.status != "started":  # a dead owner's claim, marked: write, then refuse
            refusal = explained(machine.refusal_after(new), ident, new, alive, self._where)
            return Step(new, refusal)
        self._granted.append((current, new.claim_id))
        claim = Claim(
            identity=ident,
            input_hash=new.input_hash,
            definition_hash=new.definition_hash,
            claim_id=new.claim_id,
            attempt=new.attempt,
            key=identity_digest(ident),
        )
        return Step(new, claim)

    def undo(self, current: Record | None) -> Step[str]:
        # Only a record still carrying the claim we never handed out is taken back:
        # removed if it was new, or returned to the released record it replaced.
        for before, claim_id in self._granted:
            if current is not None and current.claim_id == claim_id:
                if current.status != "started":
                    return Step(None, "moved on")
                if before is None:
                    return Step(None, "removed", delete=True)
                return Step(before, "restored")
        return Step(None, "never written")


def complete_step(
    identity: Identity,
    claim: Claim,
    receipt: str,
    result: str | None,
    alive: Liveness,
    *,
    where: Where,
) -> Callable[[Record | None], Step[RecordView]]:
    def step(current: Record | None) -> Step[RecordView]:
        new = refusing(
            identity,
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
            where,
        )
        return Step(new, view_of(identity, new, alive))

    return step


def mark_review_step(
    identity: Identity, reason: str | None, claim_id: str | None, alive: Liveness, where: Where
) -> Callable[[Record | None], Step[RecordView]]:
    def step(current: Record | None) -> Step[RecordView]:
        new = refusing(
            identity,
            current,
            alive,
            lambda: machine.mark_review(current, reason=reason, claim_id=claim_id, now=utc_now()),
            where,
        )
        return Step(new, view_of(identity, new, alive))

    return step


def withdraw_step(
    identity: Identity,
    claim: Claim,
    reason: str,
    alive: Liveness,
    *,
    where: Where,
    own: list[Record] | None = None,
) -> Callable[[Record | None], Step[RecordView]]:
    """The claim's record ``released`` under ``withdrawn``, unless someone changed it.

    With ``own``, the records this withdrawal wrote are kept there, and a record found
    again that is one of them counts as withdrawn: a try cut short by a native
    cancellation may have written already, and its retry must not be refused for it.
    """

    def step(current: Record | None) -> Step[RecordView]:
        if own is not None and current is not None and current in own:
            return Step(None, view_of(identity, current, alive))
        new = refusing(
            identity,
            current,
            alive,
            lambda: machine.withdraw(
                current,
                claim_id=claim.claim_id,
                input_hash=claim.input_hash,
                definition_hash=claim.definition_hash,
                reason=reason,
                now=utc_now(),
            ),
            where,
        )
        if own is not None:
            own.append(new)
        return Step(new, view_of(identity, new, alive))

    return step


def resolve_step(
    identity: Identity,
    receipt: str | None,
    note: str,
    result: str | None,
    *,
    expect: RecordView | None,
    alive: Liveness,
    where: Where,
) -> Callable[[Record | None], Step[RecordView]]:
    """With ``expect``, only the very record that view shows: one that changed since is
    refused ``NOT_IN_REVIEW`` in the same atomic step that would have written it."""

    def step(current: Record | None) -> Step[RecordView]:
        if expect is not None and current is not None and not same(current, expect):
            error = ConflictError(
                f"the record changed since it was looked at (attempt {expect.attempt}, "
                f"updated {expect.updated_at}); it is left as it is now",
                code="NOT_IN_REVIEW",
            )
            raise explained(error, identity, current, alive, where)
        new = refusing(
            identity,
            current,
            alive,
            lambda: machine.resolve(
                current, receipt=receipt, note=note, now=utc_now(), result=result
            ),
            where,
        )
        return Step(new, view_of(identity, new, alive))

    return step


def sweep_step(
    identity: Identity, alive: Liveness, why: Callable[[Owner | None], str]
) -> Callable[[Record | None], Step[RecordView | None]]:
    def step(current: Record | None) -> Step[RecordView | None]:
        gone = why(current.owner) if current is not None and alive(current.owner) is False else None
        new = machine.sweep(current, owner_gone=gone, now=utc_now())
        return Step(new, None if new is None else view_of(identity, new, alive))

    return step


def prune_step(
    identity: Identity, seen: Record, alive: Liveness
) -> Callable[[Record | None], Step[RecordView | None]]:
    def step(current: Record | None) -> Step[RecordView | None]:
        # Only the very record whose age was judged: a record written since (by any
        # clock) is another record, and stays.
        if current != seen:
            return Step(None, None)
        return Step(None, view_of(identity, current, alive), delete=True)

    return step
