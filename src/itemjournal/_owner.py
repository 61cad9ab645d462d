"""Who owns a started claim, and whether that process still lives.

A pid alone names no process: pids are reused, and a pid means something only inside one
pid namespace (containers that share a hostname each number their own processes) during
one boot. On Linux three values name a process exactly, and none of them moves while it
runs:

* the boot id, ``/proc/sys/kernel/random/boot_id``, new at every boot;
* the inode of its pid namespace, ``/proc/self/ns/pid``;
* its start time in clock ticks after boot, field 22 of ``/proc/<pid>/stat``.

None of them depends on the wall clock. (The boot *time* in ``/proc/stat`` does: it is
the clock minus the uptime, so it moves when the clock is stepped. It is used only for
the human-readable ``started_at``, which is never compared.)

These functions read ``/proc`` and must run in a worker thread.
"""

from __future__ import annotations

import functools
import os
import socket
import uuid
from datetime import UTC, datetime
from typing import Final

from ._records import Owner, parse_process

__all__ = [
    "ProcessKey",
    "ProcessOwners",
    "current_owner",
    "current_pid",
    "local_process_space",
    "own_process",
    "owner_alive",
    "process_alive",
    "start_ticks",
]

ProcessKey = tuple[str, int, int]
"""A process, exactly: (boot id, pid-namespace inode, start ticks)."""

BOOT_ID_PATH: Final = "/proc/sys/kernel/random/boot_id"
HIDDEN: Final = -1
"""``start_ticks`` of a process that exists but whose ``/proc`` entry cannot be read."""
_PID_T_MAX: Final = 2**31 - 1  # larger pids cannot exist, and os.kill would overflow


def _read_boot_id() -> str | None:
    try:
        with open(BOOT_ID_PATH, "rb") as stream:
            text = stream.read(64).decode("ascii").strip()
        return str(uuid.UUID(text))  # canonical: lowercase, with dashes
    except (OSError, ValueError):
        return None


def _read_pid_namespace() -> int | None:
    try:
        # /proc may be mounted for another pid namespace; then its pids are not ours.
        if os.readlink("/proc/self") != str(os.getpid()):
            return None
        inode = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return inode if inode > 0 else None


_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def current_pid() -> int:
    """``os.getpid()`` without a system call: kept up to date in a forked child by an
    ``os.register_at_fork`` hook (a child made by a raw ``fork`` that bypasses CPython's
    hooks is not seen; ``multiprocessing``, ``os.fork`` and ``subprocess`` are fine)."""
    return _pid


_space: tuple[int, tuple[str, int]] | None = None


def local_process_space() -> tuple[str, int] | None:
    """(boot id, pid-namespace inode) of this process; None when ``/proc`` cannot say.

    Only a success is remembered (per pid, so a forked child asks again): a passing
    failure, such as running out of file descriptors, must not stick.
    """
    global _space
    pid = _pid
    if _space is not None and _space[0] == pid:
        return _space[1]
    boot, namespace = _read_boot_id(), _read_pid_namespace()
    if boot is None or namespace is None:
        return None
    _space = (pid, (boot, namespace))
    return _space[1]


def _exists(pid: int) -> bool:
    """Whether a process (zombies included) has ``pid`` in this namespace: ``kill(pid, 0)``."""
    if not 0 < pid <= _PID_T_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists but is not ours to signal
        return True
    return True


def start_ticks(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat``: the start of ``pid`` in clock ticks after boot.

    None when no such process lives (a zombie has finished its work and counts as gone);
    ``HIDDEN`` when it exists but its entry cannot be read (``hidepid``, no descriptors).
    Only meaningful when ``local_process_space()`` is known (``/proc`` is ours).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as stream:
            raw = stream.read()
    except OSError:
        return HIDDEN if _exists(pid) else None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = raw[raw.rfind(b")") + 2 :].split()
    if fields and fields[0] in (b"Z", b"X"):
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return HIDDEN


def own_process() -> ProcessKey | None:
    """This process, exactly; None when ``/proc`` cannot say."""
    space = local_process_space()
    if space is None:
        return None
    ticks = start_ticks(_pid)
    if ticks is None or ticks == HIDDEN:
        return None
    return space[0], space[1], ticks


def process_alive(pid: int, key: ProcessKey | None) -> bool | None:
    """Whether the process ``key`` with ``pid`` still runs; None when this process cannot judge.

    ``key`` None (the process could not name itself): existence of ``pid`` is all there
    is to go by. Otherwise the answer is None unless ``key`` is of this boot and this pid
    namespace, which must be known here; then True iff ``pid`` lives with the same start.
    """
    space = local_process_space()
    if key is None:
        if space is None:
            return _exists(pid)
        return start_ticks(pid) is not None
    if space is None or (key[0], key[1]) != space:
        return None  # another boot or pid namespace, or no /proc here: never "dead"
    ticks = start_ticks(pid)
    if ticks is None:
        return False
    if ticks == HIDDEN:
        return None
    return ticks == key[2]


def _started_at(ticks: int) -> str:
    """``ticks`` as a UTC time, for people only: derived from the (steppable) clock."""
    try:
        with open("/proc/stat", "rb") as stream:
            for line in stream:
                if line.startswith(b"btime "):
                    seconds = int(line.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")
                    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds")
    except (OSError, ValueError, IndexError):
        pass
    return ""


@functools.cache
def _host() -> str:
    return socket.gethostname()


_me: tuple[int, Owner] | None = None


def current_owner() -> Owner:
    """This process as an owner (recomputed after a fork).

    Only an exactly named owner is remembered: if ``/proc`` failed this time, the next
    claim asks again rather than going unnamed for the rest of the process's life.
    """
    global _me
    pid = _pid
    if _me is not None and _me[0] == pid:
        return _me[1]
    key = own_process()
    if key is None:
        return Owner(host=_host(), pid=pid, started_at="")
    owner = Owner(_host(), pid, _started_at(key[2]), f"{key[0]}:{key[1]}:{key[2]}")
    _me = (pid, owner)
    return owner


def owner_alive(owner: Owner | None) -> bool | None:
    """True or False for an owner this process can judge; None when elsewhere or unknown.

    The host must be this one; an exactly named owner must also be of this boot and pid
    namespace. ``started_at`` is never compared.
    """
    if owner is None or owner.host != _host():
        return None
    if not owner.process:
        return process_alive(owner.pid, None)
    key = parse_process(owner.process)
    if key is None:  # not a name any owner writes (the record reader refuses it)
        return None
    return process_alive(owner.pid, key)


class ProcessOwners:
    """Owners as the stores of one host know them: a claim belongs to a process.

    The file, SQLite and in-memory stores take this as their ``owner`` and
    ``owner_alive``: the owner is this process, and it is alive while a process with its
    exact name runs on this host (unknown on another host). Call both in a worker thread.
    """

    __slots__ = ()

    def owner(self) -> Owner:
        return current_owner()

    def owner_alive(self, owner: Owner | None) -> bool | None:
        return owner_alive(owner)
