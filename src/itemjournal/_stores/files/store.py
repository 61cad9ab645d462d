"""The file store: one JSON document per identity, written durably.

``FileStore`` is the seam (``..seam``) over a directory; the work lives in the modules
beside this one, each of one topic: ``layout`` (where things are, and opening them
without following a symlink out of the root), ``locks`` (the record and settings locks,
taken without blocking and waited for on the loop or in the caller's thread), ``kept``
(fan-out descriptors kept open while saves overlap), ``saves`` (the durable create,
replace and remove), ``scans`` (the scan and the single-record probes), ``temps`` (temp
names, their writers, the sweep), ``settings`` (the location's settings document) and
``blocking`` (the store's blocking face, for ``itemjournal.sync``).

Every operation's disk work (lock, read, decide, write, sync) is one function run in
one worker thread (or, through the blocking face, in the caller's thread); this class
only chooses which and hands it the store's state.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import anyio.lowlevel

from ..._model.errors import InvalidArgument, RecordInvalid, StorageFailed
from ..._model.identity import Identity, IdentityLike, coerce_identity, identity_digest
from ..._model.records import Record
from ..dirs import make_dirs, sync_dir
from ..fileio import FileSystem
from ..owners import ProcessOwners, current_owner
from ..seam import StepFunction
from ..threads import Trips, run_in_thread
from .blocking import BlockingFace
from .kept import KeptFanout, KeptFanouts
from .layout import fail, open_fanout_for_writing, quietly
from .locks import (
    BUSY,
    LOCKS_SURVIVE_KEPT_DESCRIPTORS,
    Busy,
    close_call_lock_file,
    open_call_lock_file,
    retry_while_busy,
    try_lock_record,
    unlock_record,
)
from .saves import DurableSaves
from .scans import ScanCursor, peek_record, record_ages
from .settings import check_setting_text, check_settings, record_setting
from .temps import TempNames, find_strays, sweep_temps, writer_lives

__all__ = ["FileStore"]

T = TypeVar("T")


class _Named:
    """What a store's ``repr`` says, standing in for the store in messages."""

    __slots__ = ("_text",)

    def __init__(self, text: str) -> None:
        self._text = text

    def __repr__(self) -> str:
        return self._text


class FileStore(BlockingFace, ProcessOwners):
    """Record documents in a directory the caller owns and trusts.

    ``trust_shared_root=True`` skips the check that the root and its fan-out directories
    are owned by this user and not writable by group or others. Only use it when every
    user who can write there is trusted: such a user can move a record aside (a rerun
    then claims the work again) or plant one (a rerun reuses a forged receipt).

    ``trips_at_once``: how many of the store's worker-thread trips (a save, a read, a page
    of a scan) run at once; the others wait their turn on the event loop, in the order
    they came (a call cancelled meanwhile has written nothing and ends at once). A save
    is mostly system calls with a little Python between them, and more threads doing
    that pass the GIL around more than they save, while the event loop waits its turn
    for it: at 16 tasks on 2 CPUs, 8 at once made about as many cycles per second as 40
    with half the event-loop lag (``benchmarks/README.md``). A disk whose fsync takes
    milliseconds may want more: set it on the class, or a subclass, before the store is
    made.
    """

    trips_at_once: ClassVar[int] = 8

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fs: FileSystem | None = None,
        lock_timeout: float = 30.0,
        temp_grace: float = 60.0,
        trust_shared_root: bool = False,
    ) -> None:
        path = os.fspath(root)
        if not os.path.isabs(path):
            raise InvalidArgument(
                f"the journal directory must be an absolute path, got {path!r}",
                code="ABSOLUTE_ROOT_REQUIRED",
            )
        self.root = Path(os.path.normpath(path))
        self.location = str(self.root)
        self.fs = fs if fs is not None else FileSystem()
        self.lock_timeout = lock_timeout
        self.temp_grace = temp_grace
        self.trust_shared_root = trust_shared_root
        self._known_dirs: set[str] = set()  # fan-outs whose entry in the root is synced
        self._temps = TempNames()
        # Fan-out and lock descriptors kept open from save to save while saves overlap
        # (Linux, plain file system only: a replaced ``fs`` sees every call of every
        # save, as it always did).
        self._keeps_descriptors = LOCKS_SURVIVE_KEPT_DESCRIPTORS and type(self.fs) is FileSystem
        self._fanouts = KeptFanouts()
        self._applying = 0  # ``apply`` calls under way (on the event loop)
        # Worker trips under way; closing waits for them. Trips names the store by a
        # stand-in, not the store itself: without that cycle a store nobody holds is
        # freed at once, and its kept descriptors closed with it (see ``_fanouts``).
        # No timeout for a turn: the trips ahead wait for nothing but the disk (a record
        # lock held elsewhere is a cancellable sleep on the event loop, not in a trip),
        # and a timer per waiting call cost the loop a tenth of the store's rate.
        self._trips = Trips(_Named(repr(self)), at_once=self.trips_at_once)

    @classmethod
    def from_location(
        cls, location: str, *, lock_timeout: float, trust_shared_root: bool
    ) -> FileStore:
        """The store for ``Journal.open``'s location (an absolute directory)."""
        return cls(location, lock_timeout=lock_timeout, trust_shared_root=trust_shared_root)

    def __repr__(self) -> str:
        return f"FileStore({self.location!r})"

    def path_for(self, identity: IdentityLike) -> Path:
        """Where the record of ``identity`` lives (derived from its digest only)."""
        digest = identity_digest(coerce_identity(identity))
        return self.root / digest[:2] / f"{digest}.json"

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        """Create the root if needed, check that it is this user's alone and that its
        settings document (if any) is an itemjournal one, and sweep temp files no live
        writer can own."""
        await self._trip(self._open_sync)

    def _open_sync(self) -> None:
        # Each missing component 0700, its parent synced after each mkdir. Through a plain
        # FileSystem, not ``self.fs``: that seam covers the store's calls inside its root
        # (a recording one rejects paths outside it), and these sync the root's parents.
        try:  # fails with ENOTDIR when something other than a directory is in the way
            outside = FileSystem()
            make_dirs(self.location, outside)
            # Sync the root's entry in its parent on every open, not only when this open
            # created it: a process may have died between another open's mkdir and sync.
            sync_dir(outside, os.path.dirname(self.location) or "/")
        except OSError as error:
            raise fail(f"cannot create the journal directory {self.location}", error) from error
        self.sweep_temps_sync()
        check_settings(self.location)
        current_owner()  # named now: a process short of descriptors later still names itself

    async def aclose(self) -> None:
        """Refuse new calls, then wait for the calls under way (their worker trips) to end.

        The wait is shielded: a cancelled ``aclose`` still returns only after every trip
        under way has ended, and then lets the cancellation go on. The fan-out and
        lock-file descriptors kept while saves overlap are closed when the last one ends;
        closing closes them again, in case.
        """
        try:
            await self._trips.close()
        finally:
            self._fanouts.close_all()

    async def _trip(self, function: Callable[..., T], *args: Any) -> T:
        """One worker trip, counted so that ``aclose`` can wait for it."""
        return await self._trips.run(function, *args)

    def sweep_temps_sync(self, now: float | None = None) -> list[str]:
        """Check the root and its fan-outs are private; remove temp files whose writer is
        gone and that are older than the grace period (``temps.sweep_temps``)."""
        return sweep_temps(
            self.location,
            temp_grace=self.temp_grace,
            now=time.time() if now is None else now,
            trust_shared_root=self.trust_shared_root,
        )

    async def check(self) -> list[str]:
        """Orphan temp files (their writer is gone, whatever their age) and entries that
        have no business in the root or a fan-out, one line each. Changes nothing."""
        self._trips.check_open()
        return await run_in_thread(find_strays, self.location)

    # Whether a temp file's writer lives; a name of the store's, as the sweep's rule.
    _writer_lives = staticmethod(writer_lives)

    def _temp_name(self) -> str:
        """A new temp file name (no directory), naming this process as its writer."""
        return self._temps.new()

    # ------------------------------------------------------------------ the seam

    async def apply(self, identity: Identity, step: StepFunction[T]) -> T:
        self._applying += 1
        try:
            return await retry_while_busy(
                self._trip,
                f"the record lock of {list(identity)}",
                self.lock_timeout,
                self._apply_sync,
                identity,
                step,
            )
        finally:
            self._applying -= 1
            if not self._applying and self._fanouts.entries:
                # No save under way, none waiting for its lock: keep nothing open while
                # idle. No worker thread uses an entry now; a non-blocking acquire
                # cannot fail then, and if it ever did the next idle moment closes them.
                self._fanouts.close_all(blocking=False)

    async def setting(self, name: str, value: str) -> str:
        """The location's recorded value of ``name``; records ``value`` first if none is.

        Kept in ``root/itemjournal.json``, changed only under a lock on ``root/.lock`` and
        written like a record (temp, fsync, link or replace, directory fsync), so of two
        first openers one value wins and both are told which.
        """
        check_setting_text(name, value)
        return await retry_while_busy(
            self._trip,
            f"the settings lock of {self.location}",
            self.lock_timeout,
            self._setting_sync,
            name,
            value,
        )

    def _setting_sync(self, name: str, value: str) -> str | Busy:
        return record_setting(self._saves(), self.location, name, value)

    async def peek(self, identity: Identity, view: Callable[[Record | None], T]) -> T:
        return await self._trip(peek_record, self.location, identity, view, self.trust_shared_root)

    async def scan(
        self, *, status: str | None = None, after: str | None = None, batch: int = 256
    ) -> AsyncGenerator[Record | RecordInvalid | StorageFailed, None]:
        """Every record in digest order (after ``after``), in batches; what cannot be read
        is yielded, never raised.

        A record that cannot be read comes as ``RecordInvalid``; a fan-out name that cannot
        be listed (not a directory, a symlink, shared with other users) as
        ``StorageFailed``, where its records would come. Only a root that cannot be listed
        at all ends the scan (raised). Fan-outs are listed as the scan gets to them
        (``scans.scan_step``), not all at once.

        With ``status``, a document whose bytes are laid out exactly as the store writes
        them and name another status is passed over unread (``scans._shows_other_status``):
        the strict reader runs on every record yielded and on every document whose status
        cannot be seen so, but a document of another status that is damaged past its
        status is reported only by a scan without ``status`` (``verify``, ``list``).
        """
        cursor = self._scan_cursor(status, after, batch)
        await self._trip(cursor.start)
        while not cursor.done:
            for item in await self._trip(cursor.next_batch):
                yield item

    def _scan_cursor(self, status: str | None, after: str | None, batch: int) -> ScanCursor:
        return ScanCursor(
            self.location,
            status=status,
            after=after,
            batch=batch,
            trust_shared_root=self.trust_shared_root,
        )

    async def ages(self, identities: Sequence[Identity]) -> list[timedelta | None]:
        """How long ago each record file was last written, by the kernel: the modification
        time it stamped when the write landed, against ``kernel_time()`` (``/proc``; no
        process's clock enters either). One worker trip."""
        return await self._trip(record_ages, self.location, list(identities))

    async def tally(self) -> None:
        """None: the file store keeps no index, so counting its records is a full scan
        (every fan-out listed, every record read)."""
        await anyio.lowlevel.checkpoint()

    # ------------------------------------------------------------------ the apply trip

    def _apply_sync(self, identity: Identity, step: StepFunction[T]) -> T | Busy:
        """Lock the record (without blocking), then read, decide and write it."""
        if self._keeps_descriptors:
            return self._apply_cached(identity, step)
        return self._apply_fresh(identity, step)

    def _apply_fresh(self, identity: Identity, step: StepFunction[T]) -> T | Busy:
        """``_apply_sync`` through descriptors of its own, opened for this save alone: its
        lock is on an open file description no other save, thread or process shares."""
        digest = identity_digest(identity)
        directory = os.path.join(self.location, digest[:2])
        fs = self.fs
        dir_fd, _ = self._open_fanout_for_writing(digest[:2], directory)
        lock_fd: int | None = None
        try:
            lock_fd = open_call_lock_file(dir_fd, directory)
            if not self._try_lock(lock_fd, digest, directory):
                return BUSY
            return self._saves().save_step(identity, step, dir_fd, directory, digest)
        finally:
            # The directory first: the save's every call, up to its last on the fan-out,
            # is made under the record's lock, which closing its file then releases.
            quietly(fs.close_dir, dir_fd)
            if lock_fd is not None:
                close_call_lock_file(lock_fd)

    def _apply_cached(self, identity: Identity, step: StepFunction[T]) -> T | Busy:
        """``_apply_sync`` through the fan-out's kept descriptors.

        Saves of this store share one open file description of ``.lock``, so the kernel
        does not exclude them from one another: ``held`` does, for the digests locked
        here. The record's byte is unlocked explicitly, as the descriptor stays open.
        """
        digest = identity_digest(identity)
        directory = os.path.join(self.location, digest[:2])
        cache = self._fanouts
        with cache.lock:
            if digest in cache.held:
                return BUSY
            cache.held.add(digest)
        try:
            entry = self._acquire_fanout(digest[:2], directory)
            try:
                if not self._try_lock(entry.lock_fd, digest, directory):
                    return BUSY
                try:
                    return self._saves().save_step(identity, step, entry.dir_fd, directory, digest)
                finally:
                    try:
                        unlock_record(entry.lock_fd, digest)
                    except OSError:  # closing the descriptor releases it, once unused
                        with cache.lock:
                            cache.retire(entry)
            finally:
                self._release_fanout(entry)
        finally:
            with cache.lock:
                cache.held.discard(digest)

    @staticmethod
    def _try_lock(lock_fd: int, digest: str, directory: str) -> bool:
        try:
            return try_lock_record(lock_fd, digest)
        except OSError as error:
            raise fail(f"cannot lock {os.path.join(directory, f'{digest}.json')}", error) from error

    def _saves(self) -> DurableSaves:
        # Made per trip, not kept: ``fs`` may be replaced between calls, and an object
        # holding this store's bound method would tie the store in a reference cycle.
        return DurableSaves(self.fs, self._temps.new)

    def _acquire_fanout(self, prefix: str, directory: str) -> KeptFanout:
        """The fan-out's kept descriptors, for one save (``kept.KeptFanouts.acquire``);
        give them back with ``_release_fanout``."""
        return self._fanouts.acquire(prefix, directory, self._open_fanout_for_writing, self.fs)

    def _release_fanout(self, entry: KeptFanout) -> None:
        self._fanouts.release(entry)

    def _open_fanout_for_writing(self, prefix: str, directory: str) -> tuple[int, os.stat_result]:
        return open_fanout_for_writing(
            self.fs,
            self.location,
            prefix,
            directory,
            trust_shared_root=self.trust_shared_root,
            known_dirs=self._known_dirs,
        )
