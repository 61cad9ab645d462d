"""Durable saves: how a document is created, replaced or removed so a crash cannot tear it.

Create: temp → write → fsync → link (fails if the name exists) → directory fsync.
Replace: temp → write → fsync → link the current version to a backup name → rename the
temp over it → directory fsync → unlink the backup. Remove: unlink → directory fsync.
A failed directory fsync is never repeated (a failed fsync cannot be trusted to tell the
truth a second time): the step is taken back where it can be, and the error says that
what the disk holds is unknown.

``save_step`` is one record's read-decide-write, run with the record's lock held. Each of
these is called from inside one worker-thread trip, never on its own; every call goes
through the store's ``FileSystem``, the seam the crash and fault tests replace.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import TypeVar

from ..._model.codec import decode_record, encode_record
from ..._model.errors import StorageFailed
from ..._model.identity import Identity
from ..._model.records import MAX_RECORD_BYTES
from ..fileio import FileSystem
from ..seam import Step, StepFunction
from .layout import TEMP_FLAGS, fail, quietly, read_document

T = TypeVar("T")


class LostRace(Exception):
    """Another writer created the document between our read and our link."""


class DurableSaves:
    """The save recipes of one worker trip: its ``FileSystem`` (the seam every call goes
    through) and where its temp names come from."""

    __slots__ = ("fs", "new_temp")

    def __init__(self, fs: FileSystem, new_temp: Callable[[], str]) -> None:
        self.fs = fs
        self.new_temp = new_temp

    def save_step(
        self,
        identity: Identity,
        step: StepFunction[T],
        dir_fd: int,
        directory: str,
        digest: str,
    ) -> T:
        """Read, decide and write one record whose lock is held; ``step``'s answer."""
        name = f"{digest}.json"
        target = os.path.join(directory, name)
        for _ in range(8):
            data = read_document(dir_fd, name, target)
            current = None if data is None else decode_record(data, identity, location=target)
            decision: Step[T] = step(current)
            if decision.delete:
                if data is not None:
                    self.delete(dir_fd, directory, name)
                return decision.answer
            if decision.write is None:
                return decision.answer
            encoded = encode_record(decision.write)
            if len(encoded) > MAX_RECORD_BYTES:
                raise StorageFailed(
                    f"the new record would exceed {MAX_RECORD_BYTES} bytes",
                    errno=errno.EFBIG,
                )
            try:
                if data is None:
                    self.create(dir_fd, directory, name, encoded, "record")
                else:
                    self.replace(dir_fd, directory, name, encoded, "record")
            except LostRace:
                continue
            return decision.answer
        raise StorageFailed(f"{target} kept changing under the lock", errno=errno.EAGAIN)

    def write_temp(self, dir_fd: int, directory: str, data: bytes) -> str:
        """A new temp file in ``dir_fd`` holding all of ``data``, synced and closed; its
        name. Removed again on any failure."""
        temp = self.new_temp()
        where = os.path.join(directory, temp)
        try:
            fd = self.fs.open(temp, TEMP_FLAGS, 0o600, dir_fd=dir_fd)
        except OSError as error:
            raise fail(f"cannot create a temp file in {directory}", error) from error
        try:
            view = memoryview(data)
            while view:
                written = self.fs.write(fd, view)
                if written <= 0:
                    raise OSError(errno.EIO, "write made no progress")
                view = view[written:]
            self.fs.fsync(fd)
        except BaseException as error:
            quietly(self.fs.close, fd)
            quietly(self.fs.unlink, temp, dir_fd=dir_fd)
            if isinstance(error, OSError):
                raise fail(f"cannot write {where}", error) from error
            raise
        try:
            self.fs.close(fd)
        except OSError as error:
            quietly(self.fs.unlink, temp, dir_fd=dir_fd)
            raise fail(f"cannot close {where}", error) from error
        return temp

    def _drop(self, dir_fd: int, name: str) -> None:
        """Unlink a temp name, trying twice; one that stays is left for the open-time sweep."""
        if not quietly(self.fs.unlink, name, dir_fd=dir_fd):
            quietly(self.fs.unlink, name, dir_fd=dir_fd)

    def create(
        self,
        dir_fd: int,
        directory: str,
        name: str,
        data: bytes,
        what: str,
    ) -> None:
        """Create-if-absent: temp → fsync → link (fails if it exists) → directory fsync;
        ``LostRace`` when the name exists.

        After a failed directory fsync the new entry is unlinked again, but that fsync is
        never repeated, so the error says that what the disk holds is unknown.
        """
        target = os.path.join(directory, name)
        temp = self.write_temp(dir_fd, directory, data)
        try:
            self.fs.link(temp, name, dir_fd=dir_fd)
        except FileExistsError:
            quietly(self.fs.unlink, temp, dir_fd=dir_fd)
            raise LostRace() from None
        except OSError as error:
            quietly(self.fs.unlink, temp, dir_fd=dir_fd)
            raise fail(f"cannot create {target}", error) from error
        except BaseException:
            quietly(self.fs.unlink, temp, dir_fd=dir_fd)
            raise
        self._drop(dir_fd, temp)  # if it stays, a second link to the new document
        try:
            self.fs.fsync_dir(dir_fd)
        except OSError as error:
            # The new entry may not survive a power loss: nothing may be acknowledged,
            # so take it back (in memory at least) rather than leave an unowned claim.
            if quietly(self.fs.unlink, name, dir_fd=dir_fd):
                outcome = (
                    f"the new {what} was unlinked again, but after a failed directory sync "
                    f"what the disk holds is unknown (durability unknown): after a power "
                    f"loss it may be back"
                )
                if what == "record":
                    outcome += " as an unowned started record, which then needs review"
            else:
                outcome = (
                    f"the new {what} stays at {target} unowned (durability unknown): "
                    f"it needs review"
                )
            raise fail(
                f"cannot sync {directory} after creating {target}; {outcome}", error
            ) from error

    def replace(
        self,
        dir_fd: int,
        directory: str,
        name: str,
        data: bytes,
        what: str,
    ) -> None:
        """Replace: temp → fsync → link the current version to a backup name → rename the
        temp over it → directory fsync → unlink the backup.

        The backup lets a failed directory fsync put the previous version back with one
        rename, which needs no new descriptor (so even ``EMFILE`` cannot stop it). The
        failed fsync is never repeated: the error says the outcome is unknown. A backup
        left behind by a crash is a temp file of a dead writer, swept on open.
        """
        target = os.path.join(directory, name)
        temp = self.write_temp(dir_fd, directory, data)
        backup = self.new_temp()
        try:
            self.fs.link(name, backup, dir_fd=dir_fd)
        except BaseException as error:
            quietly(self.fs.unlink, temp, dir_fd=dir_fd)
            if isinstance(error, OSError):
                raise fail(f"cannot keep the previous version of {target}", error) from error
            raise
        try:
            self.fs.replace(temp, name, dir_fd=dir_fd)
        except BaseException as error:
            quietly(self.fs.unlink, temp, dir_fd=dir_fd)
            self._drop(dir_fd, backup)
            if isinstance(error, OSError):
                raise fail(f"cannot replace {target}", error) from error
            raise
        try:
            self.fs.fsync_dir(dir_fd)
        except OSError as error:
            # The new version is in place but not known durable: put the previous one back.
            try:
                self.fs.replace(backup, name, dir_fd=dir_fd)
                outcome = (
                    f"the previous {what} was put back in place, but after a failed directory "
                    f"sync what the disk holds is unknown (durability unknown): after a power "
                    f"loss it may hold either version"
                )
            except OSError:
                self._drop(dir_fd, backup)
                outcome = (
                    f"the new {what} is in place and may hold either version after a power "
                    f"loss (durability unknown); inspect it"
                )
            raise fail(
                f"cannot sync {directory} after replacing {target}; {outcome}", error
            ) from error
        except BaseException:
            self._drop(dir_fd, backup)
            raise
        self._drop(dir_fd, backup)

    def delete(self, dir_fd: int, directory: str, name: str) -> None:
        """Remove a record: unlink → directory fsync."""
        target = os.path.join(directory, name)
        try:
            self.fs.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return
        except OSError as error:
            raise fail(f"cannot remove {target}", error) from error
        try:
            self.fs.fsync_dir(dir_fd)
        except OSError as error:
            raise fail(
                f"removed {target}, but cannot sync {directory}: whether the removal is on "
                f"disk is unknown (durability unknown)",
                error,
            ) from error
