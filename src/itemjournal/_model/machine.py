"""The state machine: given the current record and a request, the next record or a refusal.

Pure functions. They know nothing of files, databases or threads; a store calls them
with what it read and writes what they return (``None`` means: write nothing).
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

from .conflicts import ConflictError
from .identity import Identity
from .records import HISTORY_LIMIT, Event, Owner, Record

__all__ = ["begin", "complete", "mark_review", "refusal_after", "resolve", "sweep", "withdraw"]


def begin(
    current: Record | None,
    *,
    identity: Identity,
    input_kind: str,
    input_hash: str,
    definition_hash: str,
    claim_id: str,
    owner: Owner,
    now: str,
    owner_gone: str | None = None,
    compatible: AbstractSet[str] = frozenset(),
) -> Record | None:
    """A new ``started`` record (a claim), or None when a succeeded record is reused.

    ``compatible``: digests of earlier definitions the caller's code is compatible with.
    A ``succeeded`` record made under one of them (from the same inputs) is reused as if
    made under ``definition_hash``; every other status under another definition is still
    ``DEFINITION_CHANGED``, since only finished work has a receipt to hand back.

    On a ``started`` record with the same fingerprints: ``IN_PROGRESS`` while its owner
    lives or cannot be known; when ``owner_gone`` (the owner is provably dead: why), the
    record marked ``needs_review`` with that reason under ``begin``'s own event (no sweep
    ran), which the caller writes and then refuses with ``REVIEW_REQUIRED`` (see
    ``refusal_after``).
    """
    if current is None or current.status == "released":
        attempt = 1 if current is None else current.attempt + 1
        event = Event(now, "begin", "started", attempt)
        return Record(
            identity=identity,
            input_kind=input_kind,
            input_hash=input_hash,
            definition_hash=definition_hash,
            claim_id=claim_id,
            status="started",
            receipt=None,
            attempt=attempt,
            created_at=now if current is None else current.created_at,
            updated_at=now,
            owner=owner,
            review_reason=None,
            # What ``advance("begin", ...)`` of the record before would append, built once.
            history=(event,) if current is None else (*current.history, event)[-HISTORY_LIMIT:],
        )
    if current.input_kind != input_kind:
        raise ConflictError(
            f"the record's inputs were fingerprinted with {current.input_kind!r}, this journal "
            f"uses {input_kind!r}; open it with the input_key that wrote the record",
            code="INPUT_KEY_MISMATCH",
        )
    if current.input_hash != input_hash:
        raise ConflictError(
            f"{current.status} record was made from other inputs", code="INPUT_CHANGED"
        )
    if current.definition_hash != definition_hash:
        if current.status == "succeeded":
            if current.definition_hash in compatible:
                return None
            made_by = current.definition_hash
            raise ConflictError(
                f"succeeded record was made by another definition ({made_by}); if this code "
                f'is compatible with it, pass `compatible=("{made_by}",)` to reuse its receipt',
                code="DEFINITION_CHANGED",
            )
        raise ConflictError(
            f"{current.status} record was made by another definition ({current.definition_hash})",
            code="DEFINITION_CHANGED",
        )
    if current.status == "succeeded":
        return None
    if current.status == "started":
        if owner_gone:
            reason = owner_gone
            return current.advance("begin", "needs_review", now, reason, review_reason=reason)
        raise ConflictError(f"attempt {current.attempt} is in progress", code="IN_PROGRESS")
    raise ConflictError(
        f"attempt {current.attempt} is {current.status}; an operator must resolve it",
        code="REVIEW_REQUIRED",
    )


def refusal_after(marked: Record) -> ConflictError:
    """The refusal ``begin`` raises after writing a dead owner's record as ``needs_review``."""
    return ConflictError(
        f"attempt {marked.attempt} was started by an owner that is gone; it now needs "
        f"review; an operator must resolve it",
        code="REVIEW_REQUIRED",
    )


def complete(
    current: Record | None,
    *,
    claim_id: str,
    input_hash: str,
    definition_hash: str,
    receipt: str,
    now: str,
    result: str | None = None,
) -> Record:
    if current is None or (current.claim_id, current.input_hash, current.definition_hash) != (
        claim_id,
        input_hash,
        definition_hash,
    ):
        raise ConflictError("the claim does not own this record", code="CLAIM_MISMATCH")
    if current.status != "started":
        raise ConflictError(f"the record is {current.status}, not started", code="NOT_STARTED")
    return current.advance("complete", "succeeded", now, receipt=receipt, result=result)


def mark_review(
    current: Record | None, *, reason: str | None, claim_id: str | None, now: str
) -> Record:
    if current is None:
        raise ConflictError("no record: nothing was started", code="NOT_STARTED")
    if claim_id is not None and current.claim_id != claim_id:
        raise ConflictError("the claim does not own this record", code="CLAIM_MISMATCH")
    if current.status != "started":
        raise ConflictError(f"the record is {current.status}, not started", code="NOT_STARTED")
    reason = reason or "marked for review"
    return current.advance("mark_review", "needs_review", now, reason, review_reason=reason)


def resolve(
    current: Record | None,
    *,
    receipt: str | None,
    note: str,
    now: str,
    result: str | None = None,
) -> Record:
    """With a receipt: ``succeeded`` (with ``result``, if given, for replay); without one
    (the caller asked to retry): ``released``."""
    if current is None or current.status != "needs_review":
        status = "absent" if current is None else current.status
        raise ConflictError(f"the record is {status}, not needs_review", code="NOT_IN_REVIEW")
    if receipt is not None:
        return current.advance("resolve", "succeeded", now, note, receipt=receipt, result=result)
    return current.advance("resolve", "released", now, note)


def sweep(current: Record | None, *, owner_gone: str | None, now: str) -> Record | None:
    """Mark a started record whose owner is gone (``owner_gone``: why) for review;
    anything else stays."""
    if current is None or current.status != "started" or not owner_gone:
        return None
    reason = owner_gone
    return current.advance("sweep", "needs_review", now, reason, review_reason=reason)


def withdraw(
    current: Record | None,
    *,
    claim_id: str,
    input_hash: str,
    definition_hash: str,
    reason: str,
    now: str,
) -> Record:
    """The caller declares its claim's effect never started: ``released`` under the event
    ``withdrawn``, so the next ``begin`` grants a fresh claim.

    Keyed like ``complete``: only the very claim that owns a ``started`` record may
    withdraw it. A record someone else changed meanwhile is refused, never forced.
    """
    if current is None or (current.claim_id, current.input_hash, current.definition_hash) != (
        claim_id,
        input_hash,
        definition_hash,
    ):
        raise ConflictError("the claim does not own this record", code="CLAIM_MISMATCH")
    if current.status != "started":
        raise ConflictError(f"the record is {current.status}, not started", code="NOT_STARTED")
    return current.advance("withdrawn", "released", now, reason)
