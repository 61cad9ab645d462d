"""The kernel's own idea of the time, for witnesses that no process's clock can skew.

A process's clock can be wrong on its own: libfaketime, a debugger, a sandbox that moves
time. What the kernel records is not: the modification time it stamps on a file when a
write lands, and the time it reports in ``/proc``. ``kernel_time()`` is the boot time
the kernel reports (``btime`` in ``/proc/stat``, whole seconds) plus its uptime
(``/proc/uptime``, hundredths). Neither file goes through the C library's clock calls,
and a time namespace shifts the two in opposite directions, so their sum stays the
host's wall time.

Precision is about a second (``btime`` is whole seconds, and read once per process), so
a witness built on it may only refuse what it calls younger by more than ``PRECISION``.
It does not survive the host's clock being wrong: a kernel whose clock is stepped
moves its file times and its ``btime`` with it.

Reads ``/proc``: call it in a worker thread.
"""

from __future__ import annotations

import os
import threading
from typing import Final

__all__ = ["PRECISION", "kernel_time"]

PRECISION: Final = 2.0
"""Seconds a kernel time may be off by (whole-second ``btime``, coarse file times)."""

_lock = threading.Lock()
_state: tuple[int, float] | None = None  # (/proc/uptime descriptor, btime); a forked
# child keeps both: the descriptor stays valid, and the boot is the same


def _open() -> tuple[int, float] | None:
    global _state
    if _state is not None:
        return _state
    with _lock:
        if _state is None:
            try:
                with open("/proc/stat", "rb") as stream:
                    btime = next(
                        int(line.split()[1]) for line in stream if line.startswith(b"btime ")
                    )
                fd = os.open("/proc/uptime", os.O_RDONLY | os.O_CLOEXEC)
            except (OSError, StopIteration, ValueError, IndexError):
                return None
            _state = (fd, float(btime))
        return _state


def kernel_time() -> float | None:
    """Seconds since the epoch as the kernel tells them, or None without ``/proc``."""
    opened = _open()
    if opened is None:
        return None
    fd, btime = opened
    try:
        uptime = float(os.pread(fd, 64, 0).split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return btime + uptime
