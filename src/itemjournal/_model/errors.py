"""The error family: one base with a stable ``code``, a few flat subclasses.

The errors here need nothing of the model, so every other module may raise them. The two
that carry a record's view (``ConflictError``, ``UnresolvedClaim``) live beside the view,
in ``conflicts``.
"""

from __future__ import annotations

import os

__all__ = ["InvalidArgument", "JournalError", "RecordInvalid", "StorageFailed"]


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
