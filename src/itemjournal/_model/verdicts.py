"""The verdicts of a reconciliation check, and the report of a reconciliation.

A check answers ``Happened``, ``DidNotHappen`` or ``Unknown`` about one record; the
``ReconcileReport`` says what became of every record. They are values, like the views
and the prune and sweep reports, so they live in the model: the journal's reconciliation
makes them and the operator's command renders them, and neither needs the other for it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, TypeAlias

from .errors import InvalidArgument, JournalError
from .records import receipt_problem, result_problem
from .view import RecordView

__all__ = [
    "VERDICTS",
    "Check",
    "DidNotHappen",
    "Happened",
    "ReconcileReport",
    "Unknown",
    "Verdict",
]


def _text_problem(value: object, what: str) -> str | None:
    """Why ``value`` is not a usable verdict text (a non-blank, valid Unicode str).

    Its length is not limited: a resolution note carries as much of it as fits.
    """
    if not isinstance(value, str):
        return f"{what} is a str, not {type(value).__name__}"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return f"{what} must be valid Unicode (no lone surrogates)"
    if not value.strip():
        return f"{what} must not be blank"
    return None


def _refuse(problem: str | None, code: str = "INVALID_ARGUMENT") -> None:
    if problem is not None:
        raise InvalidArgument(problem, code=code)


@dataclass(frozen=True, slots=True)
class Happened:
    """The provider shows the effect happened: the record is resolved ``succeeded``.

    ``receipt`` follows the rules of ``complete`` (a str, not blank, at most 200
    characters; else ``INVALID_RECEIPT``), as does ``result`` (stored for replay). ``note``
    (optional) goes into the resolution note, after the words naming the reconciliation.
    """

    receipt: str
    result: str | None = None
    note: str | None = None

    def __post_init__(self) -> None:
        _refuse(receipt_problem(self.receipt), "INVALID_RECEIPT")
        _refuse(result_problem(self.result))
        if self.note is not None:
            _refuse(_text_problem(self.note, "a verdict's note"))


@dataclass(frozen=True, slots=True)
class DidNotHappen:
    """The provider shows the effect did not happen: the record is resolved ``released``,
    so the identity may be claimed again.

    ``evidence`` is required and not blank: what the provider showed (it goes into the
    resolution note). Safe only with a provider that honours ``Claim.key`` as its
    idempotency key: should the effect land late after all, the retry's charge under the
    same key is answered with the first one, never made twice.
    """

    evidence: str

    def __post_init__(self) -> None:
        _refuse(_text_problem(self.evidence, "the evidence that it did not happen"))


@dataclass(frozen=True, slots=True)
class Unknown:
    """The provider cannot tell (yet): the record is left ``needs_review`` for a person."""

    reason: str

    def __post_init__(self) -> None:
        _refuse(_text_problem(self.reason, "the reason it is unknown"))


Verdict: TypeAlias = Happened | DidNotHappen | Unknown


class Check(Protocol):
    """A reconciliation check: asked about one record's view, it answers with a verdict.

    ``journal.reconcile(check)`` takes an ``async def check(view)`` or a plain function
    (run in a worker thread) returning ``Happened``, ``DidNotHappen`` or ``Unknown``;
    ``view.key`` is the idempotency key the provider was given.
    """

    def __call__(self, view: RecordView, /) -> Awaitable[Verdict] | Verdict: ...


VERDICTS = (Happened, DidNotHappen, Unknown)


@dataclass(frozen=True, slots=True)
class ReconcileReport:
    """What ``reconcile`` did (or, with ``dry_run``, would do), each tuple in key order.

    - ``happened``: the check answered ``Happened``; the record as resolved
      (``succeeded``), or with ``dry_run`` as the check saw it.
    - ``did_not_happen``: the check answered ``DidNotHappen``; the record as resolved
      (``released``), or with ``dry_run`` as the check saw it.
    - ``unknown``: the check answered ``Unknown``; left as it was.
    - ``left``: the check gave a verdict, but the record changed meanwhile (resolved by
      someone else, another attempt...): left as it is, shown as it is now.
    - ``failed``: the check raised (the text names the exception's type and message) or
      returned something that is not a verdict, or the resolution could not be written;
      each as ``(view, text)``. The record is left as it was.
    - ``problems``: what the listing met that it could not read (``RecordInvalid``,
      ``StorageFailed``); those records were not checked.
    - ``verdicts``: every verdict a check gave, by record key (``view.key``).
    """

    happened: tuple[RecordView, ...] = ()
    did_not_happen: tuple[RecordView, ...] = ()
    unknown: tuple[RecordView, ...] = ()
    left: tuple[RecordView, ...] = ()
    failed: tuple[tuple[RecordView, str], ...] = ()
    problems: tuple[JournalError, ...] = ()
    dry_run: bool = False
    verdicts: Mapping[str, Verdict] = field(
        default_factory=lambda: MappingProxyType({}), compare=False, hash=False
    )

    @property
    def checked(self) -> int:
        """How many records the check was called for."""
        return (
            len(self.happened)
            + len(self.did_not_happen)
            + len(self.unknown)
            + len(self.left)
            + len(self.failed)
        )

    @property
    def ok(self) -> bool:
        """True when no check failed and every record could be read."""
        return not self.failed and not self.problems

    def counts(self) -> dict[str, int]:
        """``{"happened", "did_not_happen", "unknown", "left", "failed", "problems"}``."""
        return {
            "happened": len(self.happened),
            "did_not_happen": len(self.did_not_happen),
            "unknown": len(self.unknown),
            "left": len(self.left),
            "failed": len(self.failed),
            "problems": len(self.problems),
        }
