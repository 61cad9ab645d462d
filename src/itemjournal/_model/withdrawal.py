"""``Withdraw``: the caller's declaration that a claim's effect never started.

Raised from code under a claim (a claim block, a ``once`` or ``run_each`` function, a
handler behind the ``Idempotency-Key`` middleware), it withdraws the claim: the record
becomes ``released`` under the event ``withdrawn``, and the next ``begin`` grants a fresh
claim. Like a receipt it is an assertion the journal cannot check, so it belongs only
where nothing was sent. Here too: how a reason is made to fit a record's note.
"""

from __future__ import annotations

from .errors import InvalidArgument
from .records import MAX_NOTE_CHARS

__all__ = ["Withdraw", "fit_note"]


class Withdraw(Exception):
    """Raise it under a claim to say nothing was sent: the claim is withdrawn.

    The record becomes ``released`` with the history event ``withdrawn`` and ``reason``
    as its note (cut to 500 characters), so the next ``begin`` of the identity grants a
    fresh claim (attempt + 1); then the exception goes on like any other. A record
    someone else changed meanwhile (swept for review, claimed again) is left as it is,
    and the exception carries a note saying so. Raised after ``complete`` or
    ``mark_review`` it changes nothing.

    Use it only where the effect has not started: like a receipt, it is the caller's
    declaration, and the journal takes it on trust. ``reason`` is a non-blank ``str``.
    """

    def __init__(self, reason: str) -> None:
        if not isinstance(reason, str) or not reason.strip():
            raise InvalidArgument(
                f"a withdrawal reason is a non-blank str, not {reason!r}",
                code="INVALID_ARGUMENT",
            )
        super().__init__(reason)
        self.reason = reason


def fit_note(text: str) -> str:
    """``text`` as a record's note can hold it: lone surrogates replaced, cut to the limit."""
    text = text.encode("utf-8", "replace").decode("utf-8")
    if len(text) > MAX_NOTE_CHARS:
        text = text[: MAX_NOTE_CHARS - 1] + "\u2026"
    return text
