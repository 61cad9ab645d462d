"""The error family: stable codes, the right built-in bases, pickling, and a store's
failure chained to the operating system's error that caused it."""

from __future__ import annotations

import errno
import os
import pickle
from pathlib import Path

import anyio.to_thread
import pytest

from itemjournal import (
    ConflictError,
    Identity,
    InvalidArgument,
    Journal,
    JournalError,
    RecordInvalid,
    StorageFailed,
    UnresolvedClaim,
    definition_digest,
)
from itemjournal._model.identity import identity_digest


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


IDENTITY = Identity("shop", "billing", "charge", "order-1")
DEFINITION = definition_digest("billing-v1")
IN_THE_WAY = b"a regular file, not a directory\n"


def assert_chains_the_os_error(error: StorageFailed, code: int, filename: str) -> None:
    """``error`` is the store's, and its cause is the operating system's own error."""
    cause = error.__cause__
    assert isinstance(cause, OSError), repr(cause)
    assert not isinstance(cause, JournalError), repr(cause)  # the OS error, not a rewrap
    assert cause.errno == code, cause
    assert cause.filename == filename, cause
    assert error.errno == code
    assert error.strerror == os.strerror(code)
    assert error.code == "STORAGE_FAILED"


@pytest.fixture
def fanout_in_the_way(root: Path) -> Path:
    """A journal root in which IDENTITY's fan-out name is taken by a regular file."""
    root.mkdir(mode=0o700)
    fanout = root / identity_digest(IDENTITY)[:2]
    fanout.write_bytes(IN_THE_WAY)
    return fanout


@pytest.mark.anyio
async def test_a_failed_save_chains_the_os_error(
    anyio_backend: str, root: Path, fanout_in_the_way: Path
) -> None:
    journal = await Journal.open(str(root))
    try:
        with pytest.raises(StorageFailed) as caught:
            await journal.begin(IDENTITY, {}, DEFINITION)
    finally:
        await journal.aclose()

    assert_chains_the_os_error(caught.value, errno.ENOTDIR, str(fanout_in_the_way))
    assert str(fanout_in_the_way) in str(caught.value)
    assert await anyio.to_thread.run_sync(fanout_in_the_way.read_bytes) == IN_THE_WAY


@pytest.mark.anyio
async def test_a_failed_open_chains_the_os_error(
    anyio_backend: str, tmp_path: Path, store_kind: str
) -> None:
    """Every store on a path: a location below a regular file cannot be made, and says why."""
    if store_kind == "postgres":
        pytest.skip("a PostgreSQL location is not a path")
    blocker = tmp_path / "blocker"
    await anyio.to_thread.run_sync(blocker.write_bytes, IN_THE_WAY)
    directory = blocker / "journal"
    location = f"sqlite://{directory}/journal.db" if store_kind == "sqlite" else str(directory)

    with pytest.raises(StorageFailed) as caught:
        await Journal.open(location)

    assert_chains_the_os_error(caught.value, errno.ENOTDIR, str(directory))
    assert await anyio.to_thread.run_sync(blocker.read_bytes) == IN_THE_WAY


# The codes of the contract (SPEC, section 4). The command's own codes (NOT_FOUND, ...)
# are listed in its table of exit and error codes, tested with the command.
CONTRACT_CODES = frozenset(
    [
        "INVALID_LABEL",
        "INVALID_IDENTITY",
        "INVALID_HASH",
        "INVALID_INPUTS",
        "INVALID_RECEIPT",
        "INVALID_CLAIM",
        "INVALID_ARGUMENT",
        "ABSOLUTE_ROOT_REQUIRED",
        "RECORD_INVALID",
        "INPUT_CHANGED",
        "DEFINITION_CHANGED",
        "IN_PROGRESS",
        "REVIEW_REQUIRED",
        "CLAIM_MISMATCH",
        "NOT_STARTED",
        "NOT_IN_REVIEW",
        "INPUT_KEY_MISMATCH",
        "UNRESOLVED_CLAIM",
        "STORAGE_FAILED",
    ]
)


def test_every_code_the_library_raises_is_a_code_of_the_contract() -> None:
    import re

    import itemjournal

    package = Path(itemjournal.__file__).parent
    found: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        if "_operator" in path.relative_to(package).parts:
            continue
        for code in re.findall(r"""code=["']([A-Za-z_]+)["']""", path.read_text("utf-8")):
            found.setdefault(code, []).append(str(path.relative_to(package)))
    assert found, "no code= literal found: the scan reads the wrong files"
    assert {code: paths for code, paths in found.items() if code not in CONTRACT_CODES} == {}


def test_a_fixed_scope_that_is_no_label_is_invalid_label() -> None:
    from itemjournal.asgi import IdempotencyMiddleware

    async def app(scope: object, receive: object, send: object) -> None:
        raise AssertionError("never called")

    with pytest.raises(InvalidArgument) as caught:
        IdempotencyMiddleware(app, location="/tmp/never-opened", scope="not a label")
    assert caught.value.code == "INVALID_LABEL"
