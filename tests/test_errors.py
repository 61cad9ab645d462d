"""The error family: stable codes, the right built-in bases, pickling."""

from __future__ import annotations

import errno
import os
import pickle

import pytest

from itemjournal import (
    ConflictError,
    InvalidArgument,
    JournalError,
    RecordInvalid,
    StorageFailed,
    UnresolvedClaim,
)


def test_codes_and_bases() -> None:
    argument = InvalidArgument("bad label", code="INVALID_LABEL")
    assert isinstance(argument, ValueError)
    assert isinstance(argument, JournalError)
    assert str(argument) == "INVALID_LABEL: bad label"
    assert RecordInvalid("x").code == "RECORD_INVALID"
    assert UnresolvedClaim("x").code == "UNRESOLVED_CLAIM"
    assert ConflictError("x", code="REVIEW_REQUIRED").view is None
    storage = StorageFailed("disk full", errno=errno.ENOSPC)
    assert isinstance(storage, OSError)
    assert storage.code == "STORAGE_FAILED"
    assert storage.errno == errno.ENOSPC
    assert storage.strerror == os.strerror(errno.ENOSPC)
    assert not isinstance(storage, ValueError)


@pytest.mark.parametrize(
    "error",
    [
        InvalidArgument("bad", code="INVALID_HASH"),
        RecordInvalid("bad", location="/x/y.json"),
        ConflictError("busy", code="REVIEW_REQUIRED"),
        UnresolvedClaim("open"),
        StorageFailed("gone", errno=errno.EIO),
    ],
)
def test_errors_survive_pickling(error: JournalError) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert copy.code == error.code
    assert str(copy) == str(error)
    assert copy.__dict__ == error.__dict__
    assert getattr(copy, "errno", None) == getattr(error, "errno", None)


def test_storage_failed_chains_its_cause() -> None:
    try:
        try:
            raise OSError(errno.EIO, "Input/output error")
        except OSError as cause:
            raise StorageFailed("cannot write", errno=cause.errno) from cause
    except StorageFailed as error:
        assert isinstance(error.__cause__, OSError)
        assert error.errno == errno.EIO
