"""I/O-error loops, in the manner of SQLite's: fail the Nth filesystem call of an operation.

For each journal operation (begin new, begin after release, complete, mark_review,
resolve, sweep) and each fault (EIO, ENOSPC, EDQUOT, EPERM; a short write of half the
bytes; a write of zero bytes), the loop runs the operation on a fresh copy of the same
durable pre-state with the Nth call through the ``FileSystem`` seam failing, for
N = 1, 2, … until the operation ends without the fault firing. Each N runs twice: the
fault *transient* (only the Nth call fails) and *persistent* (the Nth and every later
call fail, as on a disk that went away). Short-write faults count write calls only.

After every attempt:

* no false acknowledgement: an operation that raised raised ``StorageFailed`` with the
  injected errno and left the record byte-identical; one that returned left the new
  state on disk, and the seam log shows the new bytes were fsynced before the link or
  rename and the directory was fsynced after it;
* the record is intact (a strict read accepts it, with the decode cache cleared first,
  as a new process would read it);
* no file descriptor leaked (``/proc/self/fd`` counted before and after);
* no temp file is left, except one whose removal itself failed (only possible when the
  faults persist: the store cannot unlink what the disk refuses to unlink);
* a failed fsync is never followed by another fsync of the same open file;
* after a transient fault, the same operation retried without faults succeeds.

The clean run that ends each loop is held to the same promises: the new state, made
durable before it was acknowledged, no temp file, no descriptor leaked. A sweep reports a
record it could not mark rather than raising; the loop raises that report's error, so a
sweep is checked like the other operations.

The one outcome that is not "as before" is documented in ``docs/durability.md``: when
the faults persist from the directory fsync after a link or rename onwards, the store
cannot take the new record back; it says so in the error ("unowned: it needs review",
"may hold either version") and the record holds the old or the new version, whole.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import AsyncGeneratorType
from typing import Any

import anyio.to_thread
import pytest
from _faults import FaultyFileSystem

import itemjournal
from itemjournal import (
    Claim,
    FileStore,
    FileSystem,
    Identity,
    Journal,
    RecordInvalid,
    RecordView,
    StorageFailed,
    definition_digest,
)
from itemjournal._model.codec import clear_decode_cache
from itemjournal._model.records import Record
from itemjournal._stores.files.temps import (
    _BOOT_DIGITS,
    _NAMESPACE_DIGITS,
    _parse_writer_token,
    _writer_token,
)

pytestmark = pytest.mark.anyio

IDENTITY = Identity("shop", "billing", "charge", "order-1")
INPUTS = {"amount": "10"}
DEFINITION = definition_digest("v1")
DEAD_PID = 2**22 + 1  # above the largest Linux pid_max: no such process
BOUND = 10.0  # seconds a child process is given to start or end
_TEMP = re.compile(r"\..*\.tmp")

ERRNOS = {
    "EIO": errno.EIO,
    "ENOSPC": errno.ENOSPC,
    "EDQUOT": errno.EDQUOT,
    "EPERM": errno.EPERM,
}
SHORT = ("short-write", "zero-write")
FAULTS = (*ERRNOS, *SHORT)
UNCERTAIN = ("needs review", "may hold either version")


# ---------------------------------------------------------------------- the seam


@dataclass
class Call:
    method: str
    path: str | None
    handle: int | None
    failed: bool
    source: str | None = None


@dataclass(eq=False)
class NthCallFaults(FileSystem):
    """Fails the ``nth`` call through the seam (all later ones too when ``persistent``).

    ``fault`` is an errno name, or ``short-write`` / ``zero-write``: then only write
    calls are counted, and the chosen ones write half their bytes, or none. A failing
    close still releases the descriptor, as Linux does. A call made relative to a
    directory descriptor (``dir_fd``) is logged by its full path: the directory's path
    joined with the name.
    """

    nth: int
    fault: str
    persistent: bool
    calls: list[Call] = field(default_factory=list)
    counted: int = 0
    fired: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: dict[int, tuple[int, str]] = {}
        self._next_handle = 0

    def _hit(self, method: str) -> bool:
        """Count this call; True when it is one to break."""
        if self.fault in SHORT and method != "write":
            return False
        self.counted += 1
        hit = self.counted == self.nth or (self.persistent and self.counted > self.nth)
        self.fired += hit
        return hit

    def _call(
        self,
        method: str,
        run: Callable[[], object],
        *,
        path: str | None = None,
        fd: int | None = None,
        source: str | None = None,
    ) -> object:
        with self._lock:
            handle = None
            if fd is not None and fd in self._handles:
                handle, path = self._handles[fd]
            hit = self.fault not in SHORT and self._hit(method)
        if hit:
            self.calls.append(Call(method, path, handle, True, source))
            if method in ("close", "close_dir") and fd is not None:
                self._forget(fd)
                os.close(fd)
            code = ERRNOS[self.fault]
            raise OSError(code, f"{os.strerror(code)} (injected on {method})", path)
        try:
            result = run()
        except OSError:
            self.calls.append(Call(method, path, handle, True, source))
            raise
        self.calls.append(Call(method, path, handle, False, source))
        return result

    def _opened(self, fd: int, path: str) -> int:
        with self._lock:
            self._next_handle += 1
            self._handles[fd] = (self._next_handle, path)
        return fd

    def _forget(self, fd: int) -> None:
        with self._lock:
            self._handles.pop(fd, None)

    def _at(self, path: str, dir_fd: int | None) -> str:
        """The full path of ``path``, a name inside the directory ``dir_fd`` when given."""
        if dir_fd is None:
            return path
        with self._lock:
            opened = self._handles.get(dir_fd)
        directory = opened[1] if opened is not None else f"/proc/self/fd/{dir_fd}"
        return os.path.join(directory, path)

    # the seam (every call passes through to FileSystem unless it is the one to fail) --

    def open(self, path: str, flags: int, mode: int = 0o600, *, dir_fd: int | None = None) -> int:
        full = self._at(path, dir_fd)
        fd = self._call(
            "open", lambda: FileSystem.open(self, path, flags, mode, dir_fd=dir_fd), path=full
        )
        assert isinstance(fd, int)
        return self._opened(fd, full)

    def write(self, fd: int, data: memoryview) -> int:
        if self.fault in SHORT:
            with self._lock:
                hit = self._hit("write")
            if hit:
                if self.fault == "zero-write":
                    return 0
                data = data[: max(1, len(data) // 2)]
        written = self._call("write", lambda: FileSystem.write(self, fd, data), fd=fd)
        assert isinstance(written, int)
        return written

    def fsync(self, fd: int) -> None:
        self._call("fsync", lambda: FileSystem.fsync(self, fd), fd=fd)

    def close(self, fd: int) -> None:
        self._call("close", lambda: FileSystem.close(self, fd), fd=fd)
        self._forget(fd)

    def link(self, source: str, destination: str, *, dir_fd: int | None = None) -> None:
        self._call(
            "link",
            lambda: FileSystem.link(self, source, destination, dir_fd=dir_fd),
            path=self._at(destination, dir_fd),
            source=self._at(source, dir_fd),
        )

    def replace(self, source: str, destination: str, *, dir_fd: int | None = None) -> None:
        self._call(
            "replace",
            lambda: FileSystem.replace(self, source, destination, dir_fd=dir_fd),
            path=self._at(destination, dir_fd),
            source=self._at(source, dir_fd),
        )

    def unlink(self, path: str, *, dir_fd: int | None = None) -> None:
        self._call(
            "unlink",
            lambda: FileSystem.unlink(self, path, dir_fd=dir_fd),
            path=self._at(path, dir_fd),
        )

    def mkdir(self, path: str, mode: int = 0o700, *, dir_fd: int | None = None) -> None:
        self._call(
            "mkdir",
            lambda: FileSystem.mkdir(self, path, mode, dir_fd=dir_fd),
            path=self._at(path, dir_fd),
        )

    def rmdir(self, path: str, *, dir_fd: int | None = None) -> None:
        self._call(
            "rmdir",
            lambda: FileSystem.rmdir(self, path, dir_fd=dir_fd),
            path=self._at(path, dir_fd),
        )

    def open_dir(
        self, path: str, *, dir_fd: int | None = None, follow_symlinks: bool = True
    ) -> int:
        full = self._at(path, dir_fd)
        fd = self._call(
            "open_dir",
            lambda: FileSystem.open_dir(self, path, dir_fd=dir_fd, follow_symlinks=follow_symlinks),
            path=full,
        )
        assert isinstance(fd, int)
        return self._opened(fd, full)

    def fsync_dir(self, fd: int) -> None:
        self._call("fsync_dir", lambda: FileSystem.fsync_dir(self, fd), fd=fd)

    def close_dir(self, fd: int) -> None:
        self._call("close_dir", lambda: FileSystem.close_dir(self, fd), fd=fd)
        self._forget(fd)

    # queries -----------------------------------------------------------

    def fsyncs_after_failure(self) -> list[Call]:
        failed: set[int] = set()
        repeats = []
        for call in self.calls:
            if call.method in ("fsync", "fsync_dir") and call.handle is not None:
                if call.handle in failed:
                    repeats.append(call)
                if call.failed:
                    failed.add(call.handle)
        return repeats

    def failed_unlinks(self) -> set[str]:
        return {c.path for c in self.calls if c.method == "unlink" and c.failed and c.path}

    def durable_before_acknowledged(self, target: str) -> list[str]:
        """Why the last successful link/rename to ``target`` was not made durable, if so."""
        calls = self.calls
        moves = [
            i
            for i, c in enumerate(calls)
            if c.method in ("link", "replace") and c.path == target and not c.failed
        ]
        if not moves:
            return ["no successful link or rename to the record"]
        move = moves[-1]
        source = calls[move].source
        problems = []
        if not any(c.method == "fsync" and c.path == source and not c.failed for c in calls[:move]):
            problems.append("the new bytes were not fsynced before the link/rename")
        directory = os.path.dirname(target)
        if not any(
            c.method == "fsync_dir" and c.path == directory and not c.failed
            for c in calls[move + 1 :]
        ):
            problems.append("the directory was not fsynced after the link/rename")
        made = [i for i, c in enumerate(calls) if c.method == "mkdir" and not c.failed]
        if made and not any(
            c.method == "fsync_dir" and c.path == os.path.dirname(directory) and not c.failed
            for c in calls[made[-1] + 1 : move]
        ):
            problems.append("a new fan-out directory was not made durable first")
        return problems


class ScanTracking(FileStore):
    """A ``FileStore`` that keeps the scan generators it hands out, to check they get closed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scans: list[AsyncGeneratorType[Any, None]] = []

    def scan(
        self, *, status: str | None = None, batch: int = 256
    ) -> AsyncGenerator[Record | RecordInvalid | StorageFailed, None]:
        generator = super().scan(status=status, batch=batch)
        assert isinstance(generator, AsyncGeneratorType)
        self.scans.append(generator)
        return generator

    async def close_scans(self) -> bool:
        """Close what the journal left open; True when it had closed everything itself."""
        closed = all(scan.ag_frame is None for scan in self.scans)
        for scan in self.scans:
            await scan.aclose()
        return closed


# ---------------------------------------------------------------------- the operations


@dataclass
class Operation:
    """Sets up a durable pre-state, runs one journal call on it, says what success looks like."""

    name: str
    setup: Callable[[Journal, Path], Awaitable[Claim | None]]
    run: Callable[[Journal, Claim | None], Awaitable[object]]
    status: str  # the record's status after success


async def nothing(journal: Journal, root: Path) -> None:
    return None


async def started(journal: Journal, root: Path) -> Claim:
    claim = await journal.begin(IDENTITY, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    return claim


async def in_review(journal: Journal, root: Path) -> None:
    await started(journal, root)
    await journal.mark_review(IDENTITY, "timeout")


async def released(journal: Journal, root: Path) -> None:
    await in_review(journal, root)
    await journal.resolve(IDENTITY, retry=True, note="not charged")


def orphan(path: Path) -> None:
    """Make the started record's owner a process that is gone."""
    document = json.loads(path.read_bytes())
    document["owner"]["pid"] = DEAD_PID
    path.write_text(json.dumps(document, ensure_ascii=False, sort_keys=True, indent=1) + "\n")


async def orphaned(journal: Journal, root: Path) -> None:
    await started(journal, root)
    path = journal.store.path_for(IDENTITY)  # type: ignore[attr-defined]
    await anyio.to_thread.run_sync(orphan, path)


async def begin(journal: Journal, claim: Claim | None) -> object:
    outcome = await journal.begin(IDENTITY, INPUTS, DEFINITION)
    assert isinstance(outcome, Claim)
    return outcome


async def complete(journal: Journal, claim: Claim | None) -> object:
    assert claim is not None
    return await journal.complete(claim, "ch_1")


async def mark_review(journal: Journal, claim: Claim | None) -> object:
    return await journal.mark_review(IDENTITY, "timeout")


async def resolve(journal: Journal, claim: Claim | None) -> object:
    return await journal.resolve(IDENTITY, receipt="ch_1", note="charged after all")


async def sweep(journal: Journal, claim: Claim | None) -> object:
    """A sweep reports what it could not do rather than raising: raise it here, so that
    the loop checks it like any other operation's failure."""
    report = await journal.sweep()
    if report.problems:
        [problem] = report.problems
        assert isinstance(problem, StorageFailed), problem
        assert report.marked == ()
        raise problem
    [view] = report.marked
    assert view.identity == IDENTITY
    return view


OPERATIONS = [
    Operation("begin new", nothing, begin, "started"),
    Operation("begin after release", released, begin, "started"),
    Operation("complete", started, complete, "succeeded"),
    Operation("mark_review", started, mark_review, "needs_review"),
    Operation("resolve", in_review, resolve, "succeeded"),
    Operation("sweep", orphaned, sweep, "needs_review"),
]


# ---------------------------------------------------------------------- one attempt


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def temps_in(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("*") if _TEMP.fullmatch(p.name))


def read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def status_of(data: bytes | None) -> str:
    return "absent" if data is None else str(json.loads(data)["status"])


@dataclass
class Loop:
    attempts: int = 0
    injected: int = 0  # attempts in which the fault fired
    raised: int = 0
    uncertain: int = 0  # raised with the documented "cannot take it back" outcome
    problems: list[str] = field(default_factory=list)


async def attempt(
    operation: Operation,
    template: Path,
    claim: Claim | None,
    root: Path,
    fs: NthCallFaults,
    loop: Loop,
) -> bool:
    """One run with the fault armed; records problems; False once the fault no longer fires."""
    await anyio.to_thread.run_sync(shutil.copytree, template, root)
    record = FileStore(str(root)).path_for(IDENTITY)
    before = await anyio.to_thread.run_sync(read, record)
    fds = open_fds()
    store = ScanTracking(str(root), fs=fs)
    await store.open()
    journal = Journal(store)
    error: StorageFailed | None = None
    outcome: object = None
    try:
        outcome = await operation.run(journal, claim)
    except StorageFailed as caught:
        error = caught
    # Every scan must be closed by now (test_a_sweep_meeting_a_failing_write_closes_its_scan
    # checks the sweep itself); closing again is harmless.
    await store.close_scans()
    after = await anyio.to_thread.run_sync(read, record)
    leaked = open_fds() - fds
    temps = await anyio.to_thread.run_sync(temps_in, root)
    if not fs.fired:  # the clean run: the same promises hold without a fault
        assert error is None, error
        assert leaked == 0 and temps == [], (leaked, temps)
        clear_decode_cache()
        assert (await Journal(FileStore(str(root))).inspect(IDENTITY)).status == operation.status
        assert fs.durable_before_acknowledged(str(record)) == []
        return False

    loop.attempts += 1
    loop.injected += 1
    what = f"{operation.name}, {fs.fault} {'from' if fs.persistent else 'at'} call {fs.nth}"

    def problem(text: str) -> None:
        loop.problems.append(f"{what}: {text}")

    if leaked:
        problem(f"{leaked} file descriptor(s) leaked")
    if fs.fsyncs_after_failure():
        problem("an fsync was repeated on a file whose fsync had failed")
    stray = [t for t in temps if t not in fs.failed_unlinks()]
    if stray or (temps and not fs.persistent):
        problem(f"temp files left behind: {temps}")

    # the record must read strictly, whatever happened, as a new process reads it: the
    # writer's decode cache must not answer for bytes the strict reader never saw
    clear_decode_cache()
    checker = Journal(FileStore(str(root)))
    try:
        view = await checker.inspect(IDENTITY)
    except Exception as caught:
        problem(f"the record no longer reads: {caught!r}")
        return True

    if error is not None:
        loop.raised += 1
        expected = errno.EIO if fs.fault in SHORT else ERRNOS[fs.fault]
        if error.errno != expected:
            problem(f"raised errno {error.errno}, injected {expected}: {error}")
        if after == before:
            pass
        elif fs.persistent and any(text in str(error) for text in UNCERTAIN):
            loop.uncertain += 1  # the documented case: old or new version, whole
            if view.status not in (status_of(before), operation.status):
                problem(f"uncertain outcome left an unexpected {view.status} record")
        else:
            problem(
                f"raised ({error}) but the record changed: {status_of(before)} -> {view.status}"
            )
        if not fs.persistent and after == before:
            # transient: the disk is fine again, so the same call now simply works
            await operation.run(checker, claim)
            clear_decode_cache()
            if (await checker.inspect(IDENTITY)).status != operation.status:
                problem("the retry after a transient fault did not reach the new state")
    else:
        if view.status != operation.status:
            problem(f"returned but the record is {view.status}, not {operation.status}")
        if (
            isinstance(outcome, Claim)
            and json.loads(after or b"{}").get("claim_id") != outcome.claim_id
        ):
            problem("returned a claim that is not the one on disk")
        if isinstance(outcome, RecordView) and outcome.status != view.status:
            problem("returned a view that differs from the record on disk")
        for reason in fs.durable_before_acknowledged(str(record)):
            problem(f"acknowledged, but {reason}")
    return True


async def run_loops(operation: Operation, workdir: Path) -> tuple[Loop, int]:
    template = workdir / "template"
    setup_store = FileStore(str(template))
    await setup_store.open()
    setup_journal = Journal(setup_store)
    claim = await operation.setup(setup_journal, template)
    loop = Loop()
    clean_calls = 0
    number = 0
    await anyio.to_thread.run_sync(open_fds)  # warm the worker thread before counting fds
    for fault in FAULTS:
        for persistent in (False, True):
            nth = 1
            while True:
                number += 1
                fs = NthCallFaults(nth, fault, persistent)
                root = workdir / f"a{number}"
                fired = await attempt(operation, template, claim, root, fs, loop)
                await anyio.to_thread.run_sync(shutil.rmtree, root)
                if not fired:
                    clean_calls = max(clean_calls, len(fs.calls))
                    break
                nth += 1
                assert nth < 200, "the operation never ran to the end"
    return loop, clean_calls


# ---------------------------------------------------------------------- the tests


@pytest.mark.parametrize("operation", OPERATIONS, ids=[op.name for op in OPERATIONS])
async def test_every_failing_call_of_an_operation_acknowledges_nothing_false(
    anyio_backend: str, tmp_path: Path, operation: Operation
) -> None:
    loop, calls = await run_loops(operation, tmp_path)

    print(
        f"\nerror loop [{anyio_backend}] {operation.name}: {calls} seam calls when clean, "
        f"{loop.injected} injected faults checked ({len(FAULTS)} kinds x transient/persistent), "
        f"{loop.raised} raised, {loop.uncertain} documented uncertain outcomes, "
        f"{len(loop.problems)} problems"
    )
    assert loop.problems == []
    assert loop.injected >= calls * len(ERRNOS) * 2


# ---------------------------------------------------------------------- temp files and writers


_WRITER = """
import os, sys
from itemjournal._stores.files.temps import _writer_token
print(os.getpid(), _writer_token(), flush=True)
sys.stdin.read()
"""


@dataclass
class Writer:
    """Another process, named as a writer names itself in its temp files."""

    process: subprocess.Popen[str]
    pid: int
    token: str

    def end(self) -> None:
        """Let it exit, and reap it: from then on it is surely gone."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        assert self.process.wait(BOUND) == 0


@pytest.fixture
def writer() -> Iterator[Writer]:
    """A live process of this host, boot and pid namespace; ``end()`` ends it."""
    source = os.path.dirname(os.path.dirname(itemjournal.__file__))
    path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
    process = subprocess.Popen(
        [sys.executable, "-c", _WRITER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
    )
    try:
        assert process.stdout is not None
        pid, token = process.stdout.readline().split()
        assert int(pid) == process.pid
        yield Writer(process, process.pid, token)
    finally:
        process.kill()
        process.wait(BOUND)
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()


def temp_name(pid: int, token: str) -> str:
    return f".{pid}-{token}-{secrets.token_hex(16)}.tmp"


def names_in(directory: Path) -> set[str]:
    return {path.name for path in directory.iterdir() if _TEMP.fullmatch(path.name)}


def plant(directory: Path, names: list[str]) -> None:
    for name in names:
        (directory / name).write_bytes(b'{"version": 1, "identity": ["shop", "bil')


def age(directory: Path, names: list[str], seconds: float) -> None:
    then = time.time() - seconds
    for name in names:
        os.utime(directory / name, (then, then))


async def test_open_sweeps_a_temp_only_when_its_writer_is_surely_gone(
    anyio_backend: str, root: Path, writer: Writer
) -> None:
    """Each temp name below reaches one branch of the writer check, by construction."""
    store = FileStore(str(root))
    await store.open()
    journal = Journal(store)
    await started(journal, root)
    fanout = store.path_for(IDENTITY).parent
    mine = await anyio.to_thread.run_sync(_writer_token)
    head = _BOOT_DIGITS + _NAMESPACE_DIGITS
    boot, namespace = mine[:_BOOT_DIGITS], mine[_BOOT_DIGITS:head]
    other_boot = f"{(int(boot) + 1) % 2**128:0{_BOOT_DIGITS}d}{mine[_BOOT_DIGITS:]}"
    other_namespace = f"{boot}{int(namespace) % (2**64 - 2) + 1:0{_NAMESPACE_DIGITS}d}0"
    assert other_namespace[_BOOT_DIGITS:head] != namespace
    for token in (mine, writer.token, other_boot, other_namespace):
        assert _parse_writer_token(token) is not None, token  # well-formed
    assert _parse_writer_token("1") is None

    kept = {
        "this process": temp_name(os.getpid(), mine),
        "another live writer": temp_name(writer.pid, writer.token),
        "a writer in another pid namespace": temp_name(DEAD_PID, other_namespace),
        "an unnamed writer whose pid lives": temp_name(os.getpid(), ""),
    }
    swept = {
        # the pid lives: only the token can condemn these
        "a token no writer makes": temp_name(os.getpid(), "1"),
        "a writer of an earlier boot": temp_name(os.getpid(), other_boot),
        "an unnamed writer whose pid is gone": temp_name(DEAD_PID, ""),
    }
    every = [*kept.values(), *swept.values()]
    await anyio.to_thread.run_sync(plant, fanout, every)

    await FileStore(str(root)).open()  # all younger than the grace period: all kept
    assert await anyio.to_thread.run_sync(names_in, fanout) == set(every)

    await anyio.to_thread.run_sync(age, fanout, every, 3600)
    await FileStore(str(root)).open()
    assert await anyio.to_thread.run_sync(names_in, fanout) == set(kept.values())

    # The same writer, once it has exited: its token still parses, its process is gone.
    await anyio.to_thread.run_sync(writer.end)
    await FileStore(str(root)).open()
    del kept["another live writer"]
    assert await anyio.to_thread.run_sync(names_in, fanout) == set(kept.values())
    clear_decode_cache()
    assert (await journal.inspect(IDENTITY)).status == "started"


async def test_a_temp_that_cannot_be_removed_after_the_link_stays_harmless(
    anyio_backend: str, root: Path, writer: Writer
) -> None:
    """The documented leftover: the record is linked and durable, the temp name is not gone.

    The store tries the unlink twice; if both fail, the claim is still granted (the record
    is complete and, after the directory fsync, durable), and the temp stays as a second
    name of the record's first version. It is never read as a record, a later transition
    replaces only the record's name, and a sweep removes it once its writer is gone.
    """
    fs = FaultyFileSystem()
    store = FileStore(str(root), fs=fs, temp_grace=0)
    await store.open()
    journal = Journal(store)
    fs.fail("unlink", times=2)

    claim = await journal.begin(IDENTITY, INPUTS, DEFINITION)

    assert isinstance(claim, Claim)
    record = store.path_for(IDENTITY)
    [temp] = await anyio.to_thread.run_sync(temps_in, root)
    assert os.path.samefile(temp, record)
    assert (await journal.complete(claim, "ch_1")).status == "succeeded"
    assert not os.path.samefile(temp, record)
    assert status_of(await anyio.to_thread.run_sync(read, Path(temp))) == "started"
    clear_decode_cache()
    assert (await journal.inspect(IDENTITY)).receipt == "ch_1"

    await FileStore(str(root), temp_grace=0).open()  # its writer (this process) lives: kept
    assert await anyio.to_thread.run_sync(temps_in, root) == [temp]
    # The same file, as if another writer had left it, which then exited.
    await anyio.to_thread.run_sync(writer.end)
    orphaned_temp = os.path.join(os.path.dirname(temp), temp_name(writer.pid, writer.token))
    await anyio.to_thread.run_sync(os.rename, temp, orphaned_temp)
    await FileStore(str(root), temp_grace=0).open()  # its writer is gone: swept
    assert await anyio.to_thread.run_sync(temps_in, root) == []
    clear_decode_cache()
    assert (await journal.inspect(IDENTITY)).receipt == "ch_1"


async def test_a_sweep_meeting_a_failing_write_closes_its_scan(
    anyio_backend: str, root: Path
) -> None:
    fs = FaultyFileSystem()
    store = ScanTracking(str(root), fs=fs)
    await store.open()
    journal = Journal(store)
    await orphaned(journal, root)
    fs.fail("fsync")

    report = await journal.sweep()

    assert report.marked == ()
    [problem] = report.problems
    assert isinstance(problem, StorageFailed)
    assert problem.errno == errno.EIO
    assert len(store.scans) == 1
    assert await store.close_scans(), "sweep left the scan generator open"
