"""Who owns a started claim, and whether that process still lives.

A pid alone names no process: pids are reused, and a pid means something only inside one
pid namespace (containers that share a hostname each number their own processes) during
one boot. On Linux these values name a process exactly, and none of them moves while it
runs:

* the boot id, ``/proc/sys/kernel/random/boot_id``, new at every boot of the kernel;
* the inode of its pid namespace, ``/proc/self/ns/pid``;
* the inode of its time namespace, ``/proc/self/ns/time`` (``0`` on a kernel without
  time namespaces): the start ticks a process reads are shifted by the *reader's* time
  namespace, so two readings compare only within one;
* its start time in clock ticks after boot, field 22 of ``/proc/<pid>/stat``.

None depends on the wall clock (the boot *time* in ``/proc/stat`` does, and is used only
for the human-readable ``started_at``, which is never compared).

The judgement (``assess``) answers "gone" only from facts that prove it here:

* the same boot, the same pid namespace, and no process with the pid, or one with another
  start (read in the same time namespace);
* the same boot, a pid namespace of which no process of this host is left (provable only
  from the host's own pid namespace, with permission to look at every process);
* an earlier boot of *this machine*: the owner's boot id is in this machine's boot log
  (``boot_log_path``), which every owner appends its boot id to before its first claim.

What proves "this machine"? Not the log's directory: a state directory can be shared (a
volume that follows its pod to another node, a network file system, a disk image cloned
after it logged), and then it holds other machines' boot ids. Nor a hostname or
``/etc/machine-id`` alone: images and clones copy them. So each machine keeps a log of
its own name: a digest of what its kernel reports of its hardware (the DMI or hypervisor
uuid, a device-tree serial, the permanent addresses of its physical network devices) and
of its machine id, read outside the state directory (once per process). Another machine's
boots land in another machine's log, whatever the directory; a machine whose kernel shows
no hardware (a container with a network namespace of its own and no DMI) has no name,
logs nothing and proves no reboot; a changed machine (a network card replaced) proves
nothing about its earlier boots. Everything else is unknown (None), never gone. These
functions read ``/proc`` and must run in a worker thread.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import socket
import stat
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

from .._model.records import Owner, ProcessName, parse_process

__all__ = [
    "GONE_NAMESPACE",
    "GONE_PROCESS",
    "GONE_REBOOTED",
    "ProcessKey",
    "ProcessOwners",
    "assess",
    "boot_log_path",
    "current_owner",
    "current_pid",
    "gone_reason",
    "known_own_owner",
    "local_process_space",
    "own_process",
    "owner_alive",
    "process_alive",
    "start_ticks",
]

ProcessKey = tuple[str, int, int]
"""A process, exactly, within one time namespace: (boot id, pid-namespace inode, ticks)."""

BOOT_ID_PATH: Final = "/proc/sys/kernel/random/boot_id"
HIDDEN: Final = -1
"""``start_ticks`` of a process that exists but whose ``/proc`` entry cannot be read."""
_PID_T_MAX: Final = 2**31 - 1  # larger pids cannot exist, and os.kill would overflow
INITIAL_PID_NAMESPACE: Final = 0xEFFFFFFC
"""The inode of the host's own pid namespace (``PROC_PID_INIT_INO``, fixed by the kernel)."""
STATE_VARIABLE: Final = "ITEMJOURNAL_STATE_DIR"
_BOOT_LOG_LIMIT: Final = 1024 * 1024  # 37 bytes a boot: tens of thousands of reboots

GONE_PROCESS: Final = "owner process gone"
GONE_NAMESPACE: Final = "owner's pid namespace gone"
GONE_REBOOTED: Final = "owner's machine rebooted since"


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


def _read_time_namespace() -> int | None:
    """The inode of this process's time namespace; 0 on a kernel without them."""
    try:
        inode = os.stat("/proc/self/ns/time").st_ino
    except FileNotFoundError:
        # A kernel before 5.6 (if /proc is there): every reader sees the same ticks.
        return 0 if os.path.isdir("/proc/self/ns") else None
    except OSError:
        return None
    return inode if inode > 0 else None


_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def current_pid() -> int:
    """``os.getpid()`` without a system call, kept by an ``os.register_at_fork`` hook (a raw
    ``fork`` bypassing CPython's hooks is not seen; ``os.fork``, ``subprocess`` are fine)."""
    return _pid


_Space = tuple[str, int, int]  # boot id, pid-namespace inode, time-namespace inode
_space: tuple[int, _Space] | None = None
_boot: str | None = None


def _boot_id() -> str | None:
    """This boot's id; remembered once read (a process does not outlive its boot)."""
    global _boot
    if _boot is None:
        _boot = _read_boot_id()
    return _boot


def _local_space() -> _Space | None:
    global _space
    pid = _pid
    if _space is not None and _space[0] == pid:
        return _space[1]
    boot, pid_ns, time_ns = _boot_id(), _read_pid_namespace(), _read_time_namespace()
    if boot is None or pid_ns is None or time_ns is None:
        return None
    _space = (pid, (boot, pid_ns, time_ns))
    return _space[1]


def local_process_space() -> tuple[str, int] | None:
    """(boot id, pid-namespace inode) of this process; None when ``/proc`` cannot say. Only
    a success is remembered (per pid): a passing failure (no descriptors) must not stick."""
    space = _local_space()
    return None if space is None else (space[0], space[1])


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
    """Field 22 of ``/proc/<pid>/stat``: the start of ``pid`` in clock ticks after boot;
    None when no such process lives (a zombie counts as gone); ``HIDDEN`` when its entry
    cannot be read. Only meaningful when ``local_process_space()`` is known."""
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
    space = _local_space()
    if space is None:
        return None
    ticks = start_ticks(_pid)
    if ticks is None or ticks == HIDDEN:
        return None
    return space[0], space[1], ticks


def process_alive(pid: int, key: ProcessKey | None) -> bool | None:
    """Whether the process ``key`` with ``pid`` still runs; None when this process cannot
    judge. For the file store's temp files (removed only when old as well, so a wrong
    answer costs a failed save at worst): ``key`` None, existence of ``pid`` decides;
    else None unless ``key`` is of this boot and pid namespace."""
    space = _local_space()
    if key is None:
        if space is None:
            return _exists(pid)
        return start_ticks(pid) is not None
    if space is None or (key[0], key[1]) != (space[0], space[1]):
        return None  # another boot or pid namespace, or no /proc here: never "dead"
    ticks = start_ticks(pid)
    if ticks is None:
        return False
    if ticks == HIDDEN:
        return None
    return ticks == key[2]


# ---------------------------------------------------------------------- the boot log


_HARDWARE: Final = (
    "/sys/class/dmi/id/product_uuid",  # readable by root only
    "/sys/hypervisor/uuid",
    "/sys/firmware/devicetree/base/serial-number",
)
_MACHINE_IDS: Final = ("/etc/machine-id", "/var/lib/dbus/machine-id")
_NET: Final = "/sys/class/net"


def _fact(path: str) -> str:
    try:
        with open(path, "rb") as stream:
            return stream.read(256).decode("ascii", "replace").strip("\x00\n ")
    except OSError:
        return ""


def _machine_name() -> str | None:
    """This machine's name for its boot log: a digest of its hardware facts and machine
    id (see above); None when its kernel shows no hardware fact."""
    facts = [f"{path}={value}" for path in _HARDWARE if (value := _fact(path))]
    with contextlib.suppress(OSError):
        for device in os.listdir(_NET):
            # Physical devices (a container's veth has no ``device``), by the address they
            # were made with (type 0), never a random one.
            base = f"{_NET}/{device}"
            address = _fact(f"{base}/address")
            if os.path.exists(f"{base}/device") and _fact(f"{base}/addr_assign_type") == "0":
                facts.extend([f"net={address}"] if address.strip("0:") else [])
    if not facts:
        return None
    machine_id = next(filter(None, map(_fact, _MACHINE_IDS)), "")
    return hashlib.sha256("\n".join([machine_id, *sorted(facts)]).encode()).hexdigest()[:32]


_machine = _machine_name()  # read once, at import: no process outlives its machine


def boot_log_path() -> Path | None:
    """This machine's boot log, ``boots.<its name>`` in ``$ITEMJOURNAL_STATE_DIR`` when
    set; else in ``/var/lib/itemjournal`` for root, ``$XDG_STATE_HOME/itemjournal``
    (``~/.local/state``) for anyone else. None when this machine has no name."""
    if _machine is None:
        return None
    chosen = os.environ.get(STATE_VARIABLE)
    if not chosen:
        home = os.path.expanduser("~")
        state = os.environ.get("XDG_STATE_HOME") or os.path.join(home, ".local", "state")
        chosen = "/var/lib/itemjournal" if os.geteuid() == 0 else f"{state}/itemjournal"
    return Path(chosen) / f"boots.{_machine}"


def _trusted(fd: int) -> bool:  # a log is evidence only if no one else could write it
    info = os.fstat(fd)
    return (
        stat.S_ISREG(info.st_mode)
        and info.st_uid == os.geteuid()
        and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def _read_boots(path: Path | None) -> set[str] | None:
    """The boot ids the log names; None when there is no log this process can trust."""
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not _trusted(fd):
            return None
        data = os.read(fd, _BOOT_LOG_LIMIT)
    except OSError:
        return None
    finally:
        os.close(fd)
    boots: set[str] = set()
    for line in data.decode("ascii", "replace").splitlines():
        with contextlib.suppress(ValueError):
            if len(line) == 36:  # a torn last line is no boot id
                boots.add(str(uuid.UUID(line)))
    return boots


_logged: str | None = None  # the boot id this process has seen in the log


def _log_boot(boot: str) -> None:
    """Append ``boot`` to this machine's boot log unless it is there, durably. A failure
    leaves records of this boot unknown after a reboot, nothing worse."""
    global _logged
    path = boot_log_path()
    if path is None:
        return
    key = f"{path}\n{boot}"
    if _logged == key:
        return
    boots = _read_boots(path)
    if boots is not None and boot in boots:
        _logged = key
        return
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(
            path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            if not _trusted(fd):
                return
            os.write(fd, f"{boot}\n".encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError:
        return
    _logged = key


# ---------------------------------------------------------------------- owners


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
    """This process as an owner (recomputed after a fork), its boot logged first. Only an
    exact name is remembered (after a passing ``/proc`` failure the next claim asks again);
    an owner that knows only its boot records it alone, so a reboot can prove it gone."""
    global _me
    pid = _pid
    if _me is not None and _me[0] == pid:
        return _me[1]
    boot = _boot_id()
    if boot is not None:
        _log_boot(boot)
    space = _local_space()
    ticks = start_ticks(pid) if space is not None else None
    if space is None or ticks is None or ticks == HIDDEN:
        return Owner(host=_host(), pid=pid, started_at="", process=boot or "")
    name = f"{space[0]}:{space[1]}:{space[2]}:{ticks}"
    owner = Owner(_host(), pid, _started_at(ticks), name)
    _me = (pid, owner)
    return owner


def known_own_owner() -> Owner | None:
    """This process as an owner when ``current_owner`` has already named it exactly (and
    no fork happened since); None otherwise. Reads nothing, so it may run anywhere."""
    me = _me
    if me is not None and me[0] == _pid:
        return me[1]
    return None


def _namespace_gone(inode: int) -> bool:
    """Whether no process of this host is in the pid namespace ``inode``, provably (only
    the host's own pid namespace sees every process)."""
    space = _local_space()
    if space is None or space[1] != INITIAL_PID_NAMESPACE:
        return False
    try:
        entries = os.listdir("/proc")
    except OSError:
        return False
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            inside = os.stat(f"/proc/{entry}/ns/pid").st_ino == inode
            if inside and start_ticks(int(entry)) is not None:
                return False  # a process lives there (a zombie, not yet reaped, does not)
        except (FileNotFoundError, ProcessLookupError):
            continue  # it ended meanwhile
        except OSError:
            # Not ours to look at. Its status (readable by anyone) still says whether it
            # is in this very namespace (one pid in ``NSpid``), so in none other.
            if _nested_depth(entry) != 1:
                return False  # in some namespace below this one: cannot prove anything
    return True


def _nested_depth(pid: str) -> int | None:
    """How many pid namespaces ``pid`` has a number in, seen from ours (``NSpid``)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as stream:
            for line in stream:
                if line.startswith(b"NSpid:"):
                    return len(line.split()) - 1
    except OSError:
        return None
    return None


def _assess_name(pid: int, name: ProcessName) -> tuple[bool | None, str]:
    boot = _boot_id()
    if boot is None:
        return None, ""
    if name.boot != boot:
        boots = _read_boots(boot_log_path())
        if boots is not None and name.boot in boots:
            return False, GONE_REBOOTED
        return None, ""  # another machine's boot, or one this machine cannot vouch for
    space = _local_space()
    if name.pid_namespace is None or space is None:
        return None, ""  # its namespace, or ours, is not known: pids cannot be compared
    if name.pid_namespace != space[1]:
        if _namespace_gone(name.pid_namespace):
            return False, GONE_NAMESPACE
        return None, ""
    ticks = start_ticks(pid)
    if ticks is None:
        return False, GONE_PROCESS  # no process has the pid in its own namespace
    if ticks == HIDDEN:
        return None, ""
    if name.time_namespace is None or name.time_namespace != space[2]:
        # Ticks read in another time namespace are shifted: only equality proves anything.
        return (True, "") if ticks == name.ticks else (None, "")
    return (True, "") if ticks == name.ticks else (False, GONE_PROCESS)


def assess(owner: Owner | None) -> tuple[bool | None, str]:
    """Whether ``owner`` lives (True, False, or None: unknown here), and when it is gone,
    the reason a person reads. Neither the host name nor ``started_at`` is compared; an
    owner recorded without its process's name is found gone only by a reboot."""
    if owner is None or not owner.process:
        return None, ""
    name = parse_process(owner.process)
    if name is None:  # not a name any owner writes (the record reader refuses it)
        return None, ""
    return _assess_name(owner.pid, name)


def owner_alive(owner: Owner | None) -> bool | None:
    """True or False for an owner this process can judge; None when elsewhere or unknown."""
    return assess(owner)[0]


def gone_reason(owner: Owner | None) -> str:
    """Why ``owner`` is judged gone (for a review reason); the generic one if it is not."""
    alive, reason = assess(owner)
    return reason if alive is False else GONE_PROCESS


class ProcessOwners:
    """Owners as the file, SQLite and in-memory stores know them: a claim belongs to this
    process, judged by ``assess``. Call them in a worker thread."""

    __slots__ = ()

    def owner(self) -> Owner:
        return current_owner()

    def owner_alive(self, owner: Owner | None) -> bool | None:
        return owner_alive(owner)

    def gone_reason(self, owner: Owner | None) -> str:
        return gone_reason(owner)
