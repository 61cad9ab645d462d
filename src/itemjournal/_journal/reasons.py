"""The review reasons and withdrawal notes that the claim block writes when it is left by
an exception, for both faces of the journal.

``cancelled`` is what interrupts a caller of that face: the event loop's cancellation
class for the async face, ``KeyboardInterrupt`` for the blocking one (a thread's only
interruption: Ctrl-C, a notebook's Stop button). Kept apart from ``claim`` and
``withdrawal`` so that the blocking face, generated from them, shares these words
instead of carrying a copy.
"""

from __future__ import annotations

import re

from .._model.records import MAX_NOTE_CHARS
from .._model.withdrawal import Withdraw, fit_note

__all__ = ["block_reason", "preparing_reason"]

# anyio's message on asyncio: "Cancelled via cancel scope <id>[ by <task>][; reason: <r>]".
_ANYIO_CANCEL = re.compile(
    r"Cancelled via cancel scope [0-9a-f]+(?: by <.*?>)?(?:; reason: (?P<reason>.*))?", re.DOTALL
)
_INTERRUPTED = "interrupted (KeyboardInterrupt)"


def block_reason(exc: BaseException, cancelled: type[BaseException]) -> str:
    """A review reason naming the exception: its type and message, made to fit a note.

    An operator must tell "timed out before sending" from "after": the message matters.
    A cancellation says "block cancelled" and, when its canceller gave one, the reason:
    the backends' own words carry task reprs and addresses, which tell an operator nothing.
    Lone surrogates are replaced and the text is cut to the note limit, so the record
    always reads back.
    """
    if isinstance(exc, cancelled):
        if isinstance(exc, KeyboardInterrupt):
            text = f"block {_INTERRUPTED}"
        else:
            given = _cancel_reason(exc)
            text = f"block cancelled: {given}" if given else "block cancelled"
    else:
        try:
            message = str(exc)
        except Exception:  # a broken __str__ must not stop the record being marked
            message = "(its message cannot be shown)"
        text = f"block raised {type(exc).__name__}"
        if message.strip():
            text = f"{text}: {message}"
    text = text.encode("utf-8", "replace").decode("utf-8")
    if len(text) > MAX_NOTE_CHARS:
        text = text[: MAX_NOTE_CHARS - 1] + "\u2026"
    return text


def _cancel_reason(exc: BaseException) -> str | None:
    """The reason a cancellation's canceller gave (a passed deadline says so), if any.

    trio's ``Cancelled`` carries it as ``reason`` and ``source``; on asyncio it is the
    message of ``task.cancel(msg)``, which anyio's cancel scopes fill with their own id and
    the cancelling task's repr before the reason.
    """
    if type(exc).__module__.partition(".")[0] == "trio":
        reason = getattr(exc, "reason", None)
        if isinstance(reason, str) and reason.strip():
            return reason
        return "deadline exceeded" if getattr(exc, "source", None) == "deadline" else None
    try:
        message = str(exc)
    except Exception:  # a broken __str__ must not stop the record being marked
        return None
    anyio_words = _ANYIO_CANCEL.fullmatch(message)
    if anyio_words is not None:
        message = anyio_words["reason"] or ""
    return message if message.strip() else None


def preparing_reason(exc: BaseException, cancelled: type[BaseException]) -> str:
    """Why a preparation ended: a ``Withdraw``'s own reason, "cancelled while preparing"
    (or interrupted), or the exception's type and message, made to fit a note."""
    if isinstance(exc, Withdraw):
        return fit_note(exc.reason)
    if isinstance(exc, cancelled):
        if isinstance(exc, KeyboardInterrupt):
            return f"{_INTERRUPTED} while preparing"
        return "cancelled while preparing"  # never a task's repr or an address
    try:
        message = str(exc)
    except Exception:  # a broken __str__ must not stop the withdrawal
        message = "(its message cannot be shown)"
    text = f"preparing raised {type(exc).__name__}"
    if message.strip():
        text = f"{text}: {message}"
    return fit_note(text)
