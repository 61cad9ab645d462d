"""Reading records without their lock: the scan in batches, and the single-record probes.

A scan lists fan-outs as it gets to them, each worker trip (``scan_step``) listing as
many as its batch needs, so a caller that stops after its first page has listed a fan-out
or two, not the whole store. What cannot be read is returned as a value, never raised:
a damaged record as ``RecordInvalid``, a fan-out that cannot be listed as
``StorageFailed`` where its records would come. ``peek_record`` reads one record for a
view; ``record_ages`` asks the kernel how long ago records were written. Each of these is
one worker trip.
"""

from __future__ import annotations

import os
import re
from bisect import bisect_left
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

from ..._model.codec import decode_record
from ..._model.errors import RecordInvalid, StorageFailed
from ..._model.identity import Identity, identity_digest
from ..._model.records import Record
from ..kernelclock import kernel_time
from .layout import FANOUT, RECORD_NAME, fail, open_fanout_for_reading, read_document

T = TypeVar("T")

Scanned = Record | RecordInvalid | StorageFailed

_STATUS_FIELD = re.compile(rb'"status": "([a-z_]{1,32})", "updated_at": "')


def _shows_other_status(data: bytes, status: str) -> bool:
    """Whether ``data``, laid out exactly as ``encode_record`` lays a record out, names a
    status other than ``status``; a status scan passes such a document over unparsed.

    The encoder writes sorted keys with ``", "`` and ``": "`` between them, so the
    top-level ``status`` is the only one followed by ``updated_at`` (an event's status is
    its last key), and ``updated_at`` occurs once. Inside a JSON string every ``"`` is
    escaped, so these bytes cannot come from a label or a receipt. Anything else (no
    match, another layout) says False: the document is then read strictly.
    """
    if not data.startswith(b'{"attempt": ') or not data.endswith(b"}\n"):
        return False
    if data.count(b'"updated_at": ') != 1:
        return False
    match = _STATUS_FIELD.search(data)
    return match is not None and match[1] != status.encode("ascii", "replace")


def list_fanouts(location: str) -> list[str]:
    """The names of the fan-out directories, sorted."""
    try:
        return sorted(name for name in os.listdir(location) if FANOUT.fullmatch(name))
    except OSError as error:
        raise fail(f"cannot list the records in {location}", error) from error


def _list_fanout(
    location: str, fanout: str, after: str | None, trust_shared_root: bool
) -> list[tuple[str, str]]:
    """(fan-out, name) of every file in ``fanout`` named like a record (after
    ``after``), sorted; ``StorageFailed`` when it cannot be listed."""
    directory = os.path.join(location, fanout)
    fd = open_fanout_for_reading(directory, trust_shared_root=trust_shared_root)
    if fd is None:  # removed since the listing
        return []
    try:
        names = os.listdir(fd)
    except OSError as error:
        raise fail(f"cannot list {directory}", error) from error
    finally:
        os.close(fd)
    bound = None if after is None or after[:2] != fanout else f"{after}.json"
    return [
        (fanout, name)
        for name in sorted(names)
        if RECORD_NAME.fullmatch(name) and (bound is None or name > bound)
    ]


def scan_step(
    location: str,
    fanouts: list[str],
    pending: list[tuple[str, str]],
    batch: int,
    *,
    status: str | None,
    after: str | None,
    trust_shared_root: bool,
) -> tuple[list[Scanned], list[tuple[str, str]]]:
    """One batch of a scan: what is pending read first, then fan-outs listed (taken
    from the end of ``fanouts``) and read until ``batch`` names (or problems) are done
    or no fan-out is left. Returns what was read and the names still pending."""
    items: list[Scanned] = []
    done = 0
    while True:
        if pending:
            chunk, pending = pending[: batch - done], pending[batch - done :]
            items.extend(_load(location, chunk, status, trust_shared_root))
            done += len(chunk)
        if done >= batch or not fanouts:
            return items, pending
        try:
            pending = _list_fanout(location, fanouts.pop(), after, trust_shared_root)
        except StorageFailed as problem:
            items.append(problem)
            done += 1


class ScanCursor:
    """Where one scan is between its batches: the fan-outs not listed yet (taken from the
    end) and the names listed but not read yet. ``start`` and each ``next_batch`` are one
    worker trip of the awaited scan, or one step of the blocking one, so both faces read
    the same items in the same order."""

    __slots__ = (
        "_after",
        "_batch",
        "_fanouts",
        "_location",
        "_pending",
        "_status",
        "_trust_shared_root",
    )

    def __init__(
        self,
        location: str,
        *,
        status: str | None,
        after: str | None,
        batch: int,
        trust_shared_root: bool,
    ) -> None:
        self._location = location
        self._status = status
        self._after = after
        self._batch = batch
        self._trust_shared_root = trust_shared_root
        self._fanouts: list[str] = []
        self._pending: list[tuple[str, str]] = []

    def start(self) -> None:
        """List the fan-outs (those at or after ``after``'s); a root that cannot be listed
        raises: that ends the scan."""
        fanouts = list_fanouts(self._location)
        if self._after is not None:
            fanouts = fanouts[bisect_left(fanouts, self._after[:2]) :]
        fanouts.reverse()  # taken from the end, in order
        self._fanouts = fanouts

    @property
    def done(self) -> bool:
        return not self._fanouts and not self._pending

    def next_batch(self) -> list[Scanned]:
        """The next batch's items: records of the status asked for, and the problems."""
        items, self._pending = scan_step(
            self._location,
            self._fanouts,
            self._pending,
            self._batch,
            status=self._status,
            after=self._after,
            trust_shared_root=self._trust_shared_root,
        )
        status = self._status
        if status is None:
            return items
        return [item for item in items if not isinstance(item, Record) or item.status == status]


def _load(
    location: str, names: list[tuple[str, str]], status: str | None, trust_shared_root: bool
) -> list[Scanned]:
    loaded: list[Scanned] = []
    fanout: str | None = None
    fd: int | None = None
    broken = False
    try:
        directory = location
        for prefix, name in names:
            if prefix != fanout:
                directory = os.path.join(location, prefix)
                if fd is not None:
                    os.close(fd)
                fanout, fd, broken = prefix, None, False
                try:
                    fd = open_fanout_for_reading(directory, trust_shared_root=trust_shared_root)
                except StorageFailed as problem:  # changed since the listing
                    loaded.append(problem)
                    broken = True
            if broken or fd is None:
                continue
            loaded.extend(_load_one(fd, directory, name, status))
    finally:
        if fd is not None:
            os.close(fd)
    return loaded


def _load_one(
    fd: int, directory: str, name: str, status: str | None
) -> list[Record | RecordInvalid]:
    path = f"{directory}/{name}"  # both already normalised; cheaper than os.path.join
    digest = name[:-5]
    try:
        data = read_document(fd, name, path)
        if data is None:  # removed since the listing
            return []
        if status is not None and _shows_other_status(data, status):
            return []
        if os.path.basename(directory) != digest[:2]:
            raise RecordInvalid(f"record at {path} is in the wrong directory", location=path)
        return [decode_record(data, digest, location=path)]
    except RecordInvalid as error:
        return [error]
    except StorageFailed as error:  # unreadable: its status is unknown, like an invalid one
        problem = RecordInvalid(f"record at {path} cannot be read: {error.message}", location=path)
        problem.__cause__ = error.__cause__
        return [problem]


def peek_record(
    location: str,
    identity: Identity,
    view: Callable[[Record | None], T],
    trust_shared_root: bool,
) -> T:
    """``view`` of the record of ``identity`` as it is now (None when there is none)."""
    digest = identity_digest(identity)
    directory = os.path.join(location, digest[:2])
    name = f"{digest}.json"
    path = os.path.join(directory, name)
    data: bytes | None = None
    fd = open_fanout_for_reading(directory, trust_shared_root=trust_shared_root)
    if fd is not None:
        try:
            data = read_document(fd, name, path)
        finally:
            os.close(fd)
    record = None if data is None else decode_record(data, identity, location=path)
    return view(record)


def record_ages(location: str, identities: list[Identity]) -> list[timedelta | None]:
    """How long ago each record file was last written, by the kernel: the modification
    time it stamped when the write landed, against ``kernel_time()``."""
    now = kernel_time()
    ages: list[timedelta | None] = []
    for identity in identities:
        digest = identity_digest(identity)
        path = os.path.join(location, digest[:2], f"{digest}.json")
        try:
            written = os.stat(path, follow_symlinks=False).st_mtime
        except OSError:
            ages.append(None)
            continue
        ages.append(None if now is None else timedelta(seconds=now - written))
    return ages
