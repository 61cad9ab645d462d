"""What a journal tells about itself: log records, counters, and the seam for spans.

Every record a journal writes is logged once, on the ``itemjournal`` logger, after the
store acknowledged the write (never while it could still be lost). An answer that writes
nothing (a reuse, a refusal) is logged where the operation knows it. The structured
fields travel as ``LogRecord`` attributes prefixed ``itemjournal_``; inputs are never
logged, and a receipt only in a DEBUG record.

Each log call is guarded by ``isEnabledFor``, so with the logger quiet a transition costs
a few comparisons and counter increments. Spans are opt-in (``itemjournal.otel``): the
journal asks its ``Tracing`` for one per operation, or a shared do-nothing one.

The logger has a ``NullHandler``, as a library's logger should: nothing is printed unless
the application configures logging (without it, Python's last-resort handler would print
every WARNING on the application's stderr). Text from callers, providers and exceptions
(reasons, notes, messages) is in a message only through ``safe_text``, so no handler can
be made to write a forged line or drive a terminal; the ``itemjournal_`` fields keep it
exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

from .._model.conflicts import ConflictError
from .._model.errors import JournalError
from .._model.identity import Identity, identity_digest
from .._model.records import Record
from .._model.text import safe_text

__all__ = ["NO_SPAN", "JournalStatistics", "Observer", "Span", "Tracing", "logger"]

logger = logging.getLogger("itemjournal")
logger.addHandler(logging.NullHandler())

DEBUG, INFO, WARNING = logging.DEBUG, logging.INFO, logging.WARNING

# What each operation's write is called in the log, and at which level it is logged.
# A claim, a completion, a removal are routine (DEBUG); a record going to needs_review is
# what an operator must hear about (WARNING); an operator's decision is INFO.
_WRITES: dict[str, tuple[str, int]] = {
    "begin": ("claimed", DEBUG),
    "complete": ("completed", DEBUG),
    "mark_review": ("marked_review", WARNING),
    "claim_exit": ("marked_review", WARNING),
    "resolve": ("resolved", INFO),
    "sweep": ("swept", WARNING),
    "prune": ("pruned", DEBUG),
    "undo": ("withdrawn", DEBUG),
    "withdraw": ("withdrawn", INFO),
}
# A begin that finds the owner of a started record gone marks it, exactly as a sweep.
_OWNER_GONE = ("owner_gone", WARNING)

# Refusals of begin: waiting for a live claim is ordinary; a record waiting for review was
# announced (WARNING) when it went there; other inputs or code under one identity usually
# mean a caller's mistake.
_BEGIN_REFUSALS = {"IN_PROGRESS": DEBUG, "REVIEW_REQUIRED": INFO}


def _label(identity: Identity) -> str:
    """``scope/program/job/item``: labels never hold a slash, so this is unambiguous."""
    return "/".join(identity)


@dataclass(frozen=True, slots=True)
class JournalStatistics:
    """Counters of one ``Journal`` object since it was made (``journal.statistics()``).

    Other journals and processes on the same location count for themselves.

    - ``claims``: claims granted (``begin`` answered with a ``Claim``).
    - ``reuses``: ``begin`` answered with a ``Reuse`` of a succeeded record.
    - ``completions``: receipts recorded by ``complete``.
    - ``reviews``: records this journal marked ``needs_review``, by any path
      (``mark_review``, a claim block's exit, ``sweep``, ``begin`` finding a dead owner).
    - ``resolutions``: records resolved (``resolve``, ``reconcile``).
    - ``withdrawals``: claims withdrawn by their caller (``Withdraw``, ``preparing()``,
      ``withdraw``): released, their effect declared never started.
    - ``pruned``: records removed by ``prune``.
    - ``refusals``: ``begin`` calls answered with a ``ConflictError`` (``IN_PROGRESS``,
      ``REVIEW_REQUIRED``, ``INPUT_CHANGED``...; a ``begin`` with ``wait=`` counts once).
    - ``storage_failures``: store reads and writes that raised ``StorageFailed``.
    - ``in_flight``: claims granted by this journal whose record it has not yet seen
      leave ``started`` (a gauge, not a counter).
    """

    claims: int = 0
    reuses: int = 0
    completions: int = 0
    reviews: int = 0
    resolutions: int = 0
    pruned: int = 0
    refusals: int = 0
    storage_failures: int = 0
    in_flight: int = 0
    withdrawals: int = 0


class Observer:
    """A journal's counters, and the one place its log records are made."""

    __slots__ = (
        "claims",
        "completions",
        "open_claims",
        "pruned",
        "refusals",
        "resolutions",
        "reuses",
        "reviews",
        "storage_failures",
        "withdrawals",
    )

    def __init__(self) -> None:
        self.claims = 0
        self.reuses = 0
        self.completions = 0
        self.reviews = 0
        self.resolutions = 0
        self.pruned = 0
        self.refusals = 0
        self.storage_failures = 0
        self.withdrawals = 0
        # Identities whose claim this journal wrote and has not yet seen leave started.
        self.open_claims: set[Identity] = set()

    def statistics(self) -> JournalStatistics:
        return JournalStatistics(
            claims=self.claims,
            reuses=self.reuses,
            completions=self.completions,
            reviews=self.reviews,
            resolutions=self.resolutions,
            pruned=self.pruned,
            refusals=self.refusals,
            storage_failures=self.storage_failures,
            in_flight=len(self.open_claims),
            withdrawals=self.withdrawals,
        )

    def wrote(
        self,
        operation: str,
        identity: Identity,
        before: Record | None,
        write: Record | None,
        delete: bool,
    ) -> None:
        """A step's decision landed: the store acknowledged ``write`` (or the removal)."""
        if delete:
            after = None
        elif write is not None:
            after = write
        else:
            return  # the step wrote nothing: nothing happened to log
        event, level = _WRITES[operation]
        status = "absent" if after is None else after.status
        if status == "started":
            self.open_claims.add(identity)
        else:
            self.open_claims.discard(identity)
        if status == "needs_review":
            self.reviews += 1
            if operation == "begin":
                event, level = _OWNER_GONE
        elif status == "started":
            self.claims += 1
        elif operation == "complete":
            self.completions += 1
        elif operation == "resolve":
            self.resolutions += 1
        elif operation == "prune":
            self.pruned += 1
        elif operation == "withdraw":
            self.withdrawals += 1
        if not logger.isEnabledFor(level):
            return
        shown = after if after is not None else before
        assert shown is not None  # a removal always removes a record
        fields: dict[str, object] = {
            "itemjournal_event": event,
            "itemjournal_operation": operation,
            "itemjournal_identity": _label(identity),
            "itemjournal_key": identity_digest(identity),
            "itemjournal_status": status,
            "itemjournal_previous": "absent" if before is None else before.status,
            "itemjournal_attempt": shown.attempt,
            "itemjournal_claim_id": shown.claim_id,
        }
        if status == "needs_review" and after is not None:
            fields["itemjournal_reason"] = after.review_reason
        if operation in ("resolve", "withdraw") and after is not None and after.history:
            fields["itemjournal_note"] = after.history[-1].note
        if level == DEBUG and after is not None and after.receipt is not None:
            fields["itemjournal_receipt"] = after.receipt
        reason = fields.get("itemjournal_reason") or fields.get("itemjournal_note")
        logger.log(
            level,
            "%s %s (attempt %d, %s -> %s)%s",
            event,
            fields["itemjournal_identity"],
            shown.attempt,
            fields["itemjournal_previous"],
            status,
            f": {safe_text(str(reason))}" if reason else "",
            extra=fields,
        )

    def reused(self, identity: Identity, attempt: int, receipt: str) -> None:
        self.reuses += 1
        if not logger.isEnabledFor(DEBUG):
            return
        label = _label(identity)
        logger.debug(
            "reused %s (attempt %d, succeeded)",
            label,
            attempt,
            extra={
                "itemjournal_event": "reused",
                "itemjournal_operation": "begin",
                "itemjournal_identity": label,
                "itemjournal_key": identity_digest(identity),
                "itemjournal_status": "succeeded",
                "itemjournal_attempt": attempt,
                "itemjournal_receipt": receipt,
            },
        )

    def refused(self, operation: str, identity: Identity, refusal: ConflictError) -> None:
        """An operation was refused by the record's state: nothing was written."""
        if operation == "begin":
            self.refusals += 1
            level = _BEGIN_REFUSALS.get(refusal.code, WARNING)
        elif operation == "complete":
            level = WARNING  # an effect that happened could not be recorded as done
        else:
            level = INFO
        if not logger.isEnabledFor(level):
            return
        label = _label(identity)
        view = refusal.view
        fields: dict[str, object] = {
            "itemjournal_event": "refused",
            "itemjournal_operation": operation,
            "itemjournal_identity": label,
            "itemjournal_key": identity_digest(identity),
            "itemjournal_code": refusal.code,
        }
        if view is not None:
            fields["itemjournal_status"] = view.status
            fields["itemjournal_attempt"] = view.attempt
        logger.log(
            level,
            "%s of %s refused: %s",
            operation,
            label,
            safe_text(refusal.message),
            extra=fields,
        )

    def failed(self, operation: str, identity: Identity | None, error: JournalError) -> None:
        """A store call of ``operation`` raised ``StorageFailed``: nothing was acknowledged.

        WARNING, not ERROR: the exception (or the report's problems) reaches the caller,
        who decides how bad it is; the log keeps the trail.
        """
        self.storage_failures += 1
        if not logger.isEnabledFor(WARNING):
            return
        fields: dict[str, object] = {
            "itemjournal_event": "storage_failed",
            "itemjournal_operation": operation,
            "itemjournal_code": error.code,
        }
        where = ""
        if identity is not None:
            fields["itemjournal_identity"] = where = _label(identity)
            fields["itemjournal_key"] = identity_digest(identity)
            where = f" of {where}"
        logger.warning("%s%s failed: %s", operation, where, safe_text(error.message), extra=fields)

    def summary(self, operation: str, message: str, **counts: int | bool) -> None:
        """An operator's bulk operation ended (sweep, prune, reconcile): INFO, with counts."""
        if not logger.isEnabledFor(INFO):
            return
        fields: dict[str, object] = {
            "itemjournal_event": operation,
            "itemjournal_operation": operation,
        }
        for name, value in counts.items():
            fields[f"itemjournal_{name}"] = value
        logger.info("%s", safe_text(message), extra=fields)


class Span(Protocol):
    """One operation's span, as the journal sees it."""

    def set(self, name: str, value: str | int | bool) -> None:
        """Set the attribute ``itemjournal.<name>``."""
        ...

    def failed(self, error: BaseException) -> None:
        """The operation ended with ``error`` (without raising it, or raising it)."""
        ...

    def __enter__(self) -> Span: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...


class Tracing(Protocol):
    """What makes the spans of an instrumented journal (see ``itemjournal.otel``)."""

    def span(self, operation: str, identity: Identity | None) -> Span: ...


class _NoSpan:
    """The span of a journal without tracing: one shared object that does nothing."""

    __slots__ = ()

    def set(self, name: str, value: str | int | bool) -> None:
        pass

    def failed(self, error: BaseException) -> None:
        pass

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        pass


NO_SPAN: Span = _NoSpan()
