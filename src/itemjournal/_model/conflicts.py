"""The errors that carry the record's view: ``ConflictError`` and ``UnresolvedClaim``.

They belong to the error family of ``errors`` (one base, a stable ``code``), but each
shows the record as it stands, so they stand above the view: ``errors`` needs nothing of
the model, ``view`` reads records, and these two need both.
"""

from __future__ import annotations

from .errors import JournalError
from .view import RecordView

__all__ = ["ConflictError", "UnresolvedClaim"]


class ConflictError(JournalError):
    """The record's state refuses the request; ``view`` shows the record as it is.

    Codes: ``INPUT_CHANGED``, ``DEFINITION_CHANGED``, ``IN_PROGRESS``, ``REVIEW_REQUIRED``,
    ``CLAIM_MISMATCH``, ``NOT_STARTED``, ``NOT_IN_REVIEW``, ``INPUT_KEY_MISMATCH``. The
    message names the identity's labels and the record's key, says what the record says
    and ends with the next step, as a call or an ``itemjournal`` command (``refusals``).
    """

    code = "CONFLICT"

    def __init__(self, message: str, *, code: str, view: RecordView | None = None) -> None:
        super().__init__(message, code=code)
        self.view = view


class UnresolvedClaim(JournalError):
    """A ``claim()`` block ended without ``complete`` or ``mark_review`` (``UNRESOLVED_CLAIM``).

    The record was marked ``needs_review`` before this was raised.
    """

    code = "UNRESOLVED_CLAIM"

    def __init__(self, message: str, *, view: RecordView | None = None) -> None:
        super().__init__(message)
        self.view = view
