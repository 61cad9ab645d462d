"""The error family: one base with a stable ``code``, a few flat subclasses."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .view import RecordView

__all__ = [
    "ConflictError",
    "InvalidArgument",
    "JournalError",
    "RecordInvalid",
    "StorageFailed",
    "UnresolvedClaim",
]


class JournalError(Exception):
    """Base of every error itemjournal raises on purpose.

    ``code`` is a stable string meant for programs; the message is for people.
    """

    code: str = "JOURNAL_ERROR"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code if code is not None else type(self).code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), self.message, self.code, self.__dict__))


def _rebuild(
    cls: type[JournalError], message: str, code: str, state: dict[str, object]
) -> JournalError:
    error = cls.__new__(cls)
    JournalError.__init__(error, message, code=code)
    for name, value in state.items():
        setattr(error, name, value)
    return error


class InvalidArgument(JournalError, ValueError):
    """A caller passed something the contract does not accept (nothing was read or written).

    Codes: ``INVALID_LABEL``, ``INVALID_IDENTITY``, ``INVALID_HASH``, ``INVALID_INPUTS``,
    ``INVALID_RECEIPT``, ``INVALID_CLAIM``, ``INVALID_ARGUMENT``, ``ABSOLUTE_ROOT_REQUIRED``.
    """

    code = "INVALID_ARGUMENT"


class RecordInvalid(JournalError):
    """The stored record cannot be trusted; it is left exactly as found (``RECORD_INVALID``)."""

    code = "RECORD_INVALID"

    def __init__(self, message: str, *, location: str | None = None) -> None:
        super().__init__(message)
        self.location = location


class ConflictError(JournalError):
    """The record's state refuses the request; ``view`` shows the record as it is.

    Codes: ``INPUT_CHANGED``, ``DEFINITION_CHANGED``, ``REVIEW_REQUIRED``,
    ``CLAIM_MISMATCH``, ``NOT_STARTED``, ``NOT_IN_REVIEW``, ``INPUT_KEY_MISMATCH``.
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


class StorageFailed(JournalError, OSError):
    """The store could not do what was asked (``STORAGE_FAILED``).

    Nothing was acknowledged. The original error is chained as ``__cause__``;
    ``errno`` copies its errno when it had one.
    """

    code = "STORAGE_FAILED"

    def __init__(self, message: str, *, errno: int | None = None) -> None:
        JournalError.__init__(self, message)
        self.errno = errno
        self.strerror = os.strerror(errno) if errno is not None else None

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def __reduce__(self) -> tuple[object, ...]:
        state = dict(self.__dict__, errno=self.errno, strerror=self.strerror)
        return (_rebuild, (type(self), self.message, self.code, state))
