"""What callers get back: claims, reuses and read-only views of records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .identity import Identity, identity_digest
from .records import Event, Owner, Record

if TYPE_CHECKING:
    from .errors import JournalError

__all__ = ["Claim", "PruneReport", "RecordView", "Reuse", "SweepReport"]


@dataclass(frozen=True, slots=True)
class Claim:
    """Permission to perform the effect once; granted only after ``started`` is durable.

    ``key`` is stable for the identity: pass it to the downstream service as *its*
    idempotency key, so a retried attempt cannot double-charge there either.
    """

    identity: Identity
    input_hash: str
    definition_hash: str
    claim_id: str
    attempt: int
    key: str


@dataclass(frozen=True, slots=True)
class Reuse:
    """The item already succeeded with the same fingerprints: use its receipt (and the
    ``result`` stored with it, if any, to replay what the first run answered)."""

    receipt: str
    identity: Identity | None = None
    attempt: int = 0
    executed_here: bool = False
    result: str | None = None


@dataclass(frozen=True, slots=True)
class RecordView:
    """A read-only picture of one record. ``executed_here`` is always False: the journal
    records what callers declare, it never runs their work."""

    identity: Identity
    status: str
    receipt: str | None = None
    executed_here: bool = False
    attempt: int = 0
    created_at: str | None = None
    updated_at: str | None = None
    owner: Owner | None = None
    owner_alive: bool | None = None
    review_reason: str | None = None
    history: tuple[Event, ...] = ()
    result: str | None = None
    # The identity's stable token, the same as ``Claim.key``: what the downstream service
    # was given as its idempotency key, and the order of listings (``after=``).
    key: str = ""

    @classmethod
    def of(cls, identity: Identity, record: Record | None, owner_alive: bool | None) -> RecordView:
        if record is None:
            return cls(identity=identity, status="absent", key=identity_digest(identity))
        return cls(
            identity=record.identity,
            status=record.status,
            receipt=record.receipt,
            attempt=record.attempt,
            created_at=record.created_at,
            updated_at=record.updated_at,
            owner=record.owner,
            owner_alive=owner_alive,
            review_reason=record.review_reason,
            history=record.history,
            result=record.result,
            key=identity_digest(record.identity),
        )


@dataclass(frozen=True, slots=True)
class SweepReport:
    """What ``Journal.sweep`` did: the records it marked ``needs_review``, and what it
    could not handle (a record that cannot be read strictly, a part of the store that
    cannot be read, a record whose lock or write failed), each as the error it met.

    A problem never stops a sweep: every other record is still looked at.
    """

    marked: tuple[RecordView, ...] = ()
    problems: tuple[JournalError, ...] = ()


@dataclass(frozen=True, slots=True)
class PruneReport:
    """What ``Journal.prune`` removed (or, with ``dry_run``, would remove), and what it met
    that it could not handle. Only ``succeeded`` and ``released`` records are ever removed.

    ``kept`` are the records this process's clock calls old enough that were kept all
    the same because another clock disagrees: a time in the record lies ahead of this
    clock (a writer's clock ran ahead, or this one runs behind), or the store's own clock
    (the kernel's file times, the database server's clock) says the record was written
    more recently than the cutoff. A clock error can make a record look old; it never
    gets one removed unless every clock that saw it agrees.
    """

    removed: tuple[RecordView, ...] = ()
    problems: tuple[JournalError, ...] = ()
    kept: tuple[RecordView, ...] = ()
