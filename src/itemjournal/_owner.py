"""Who owns a started claim, and whether that process still lives.

A pid alone is not enough: pids are reused. The owner is the triple (host, pid,
process start time); on Linux the start time comes from ``/proc`` and tells a
reused pid apart. These functions read ``/proc`` and must run in a worker thread.
"""

from __future__ import annotations

import functools
import os
import socket
from datetime import UTC, datetime

from ._records import Owner

__all__ = ["current_owner", "owner_alive", "process_start"]


@functools.cache
def _boot_time() -> float | None:
    try:
        with open("/proc/stat", "rb") as stream:
            for line in stream:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def process_start(pid: int) -> str | None:
    """The start time of ``pid`` as UTC ISO-8601, '' if unknowable here, None if no such process."""
    boot = _boot_time()
    if boot is None:  # no /proc: fall back to a plain existence check
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return ""
        return ""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stream:
            raw = stream.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return ""
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = raw[raw.rfind(b")") + 2 :].split()
    if len(fields) < 20 or fields[0] == b"Z":  # a zombie has finished its work
        return None
    ticks = int(fields[19])
    seconds = boot + ticks / os.sysconf("SC_CLK_TCK")
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds")


@functools.cache
def _host() -> str:
    return socket.gethostname()


_me: tuple[int, Owner] | None = None


def current_owner() -> Owner:
    """This process as an owner (recomputed after a fork)."""
    global _me
    pid = os.getpid()
    if _me is None or _me[0] != pid:
        _me = (pid, Owner(host=_host(), pid=pid, started_at=process_start(pid) or ""))
    return _me[1]


def owner_alive(owner: Owner | None) -> bool | None:
    """True or False for an owner on this host; None when it is elsewhere or unknown."""
    if owner is None or owner.host != _host():
        return None
    start = process_start(owner.pid)
    if start is None:
        return False
    if start == "" or owner.started_at == "":
        return True  # cannot tell a reused pid apart here; assume the owner lives
    return start == owner.started_at
