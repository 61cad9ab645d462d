"""Temp files: their names, the writer each names, and the sweep of those no one owns.

Temp files are named ``.<pid>-<writer>-<unique>.tmp``, ``<writer>`` naming the writing
process exactly (boot, pid namespace, start ticks; see ``_writer_token``), so a sweep can
tell whether it lives. A temp file is used only for the few milliseconds of one save (or
as the backup of a replace); one left behind by a crash belongs to a dead writer. The
open-time sweep removes such files once they are older than a grace period; ``check``
reports them, and any entry that has no business in the root or a fan-out.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import uuid
from typing import Final

from ..owners import current_pid, local_process_space, own_process, process_alive
from .layout import (
    FANOUT,
    FANOUT_FLAGS,
    LOCK_NAME,
    RECORD_NAME,
    SETTINGS_NAME,
    check_private,
    fail,
    open_root,
)

_TEMP = re.compile(r"\.(\d+)-(\d*)-[0-9a-f]{32}\.tmp")

# Temp names: the writer's pid and token, then 16 random hex digits drawn once per process
# and a 16-digit counter, so a save draws no randomness of its own.
_temp_counter = itertools.count()
_temp_nonce = secrets.token_hex(8)


def _new_temp_nonce() -> None:
    global _temp_counter, _temp_nonce
    _temp_counter = itertools.count()
    _temp_nonce = secrets.token_hex(8)


os.register_at_fork(after_in_child=_new_temp_nonce)


_BOOT_DIGITS: Final = 39  # 2**128-1, the largest boot id as a number, has 39 digits
_NAMESPACE_DIGITS: Final = 20  # 2**64-1, the largest inode, has 20
_TICKS = re.compile(r"0|[1-9][0-9]{0,19}")


def _writer_token() -> str:
    """This process in digits, for temp names; '' when ``/proc`` cannot name it.

    The boot id as a 39-digit number, the pid-namespace inode as a 20-digit number, then
    the start ticks: digits only, so old names stay parseable, and no wall-clock time, so
    stepping the clock cannot make a live writer look gone.
    """
    key = own_process()
    if key is None:
        return ""
    boot, namespace, ticks = key
    return f"{uuid.UUID(boot).int:0{_BOOT_DIGITS}d}{namespace:0{_NAMESPACE_DIGITS}d}{ticks}"


def _parse_writer_token(token: str) -> tuple[int, int, int] | None:
    """(boot id as a number, pid-namespace inode, start ticks), or None if not a token."""
    head = _BOOT_DIGITS + _NAMESPACE_DIGITS
    if not token.isascii() or not token.isdigit() or _TICKS.fullmatch(token[head:]) is None:
        return None
    boot, namespace, ticks = (
        int(token[:_BOOT_DIGITS]),
        int(token[_BOOT_DIGITS:head]),
        int(token[head:]),
    )
    if boot >= 2**128 or not 0 < namespace < 2**64 or ticks >= 2**64:
        return None
    return boot, namespace, ticks


def writer_lives(pid: int, token: str) -> bool:
    """False only when the temp's writer is surely gone; when in doubt, it lives."""
    if not token:  # the writer could not name itself: trust the pid
        return process_alive(pid, None) is not False
    parsed = _parse_writer_token(token)
    if parsed is None:  # no writer of this version names itself so
        return False
    boot, namespace, ticks = parsed
    space = local_process_space()
    if space is None:  # cannot tell which boot or namespace this is
        return True
    if boot != uuid.UUID(space[0]).int:  # an earlier boot: none of its processes lives
        return False
    # In another pid namespace the answer is None (unknown): keep the file.
    return process_alive(pid, (space[0], namespace, ticks)) is not False


class TempNames:
    """New temp names for one store, its ``.<pid>-<writer>-`` prefix worked out once per
    process (asking ``/proc`` again only while it cannot name the writer)."""

    __slots__ = ("_prefix",)

    def __init__(self) -> None:
        self._prefix: tuple[int, str] | None = None  # (pid, prefix with a known token)

    def new(self) -> str:
        """A new temp file name (no directory): ``.<pid>-<writer>-<unique>.tmp``, where
        ``<unique>`` is this process's random nonce and a counter (32 hex digits)."""
        pid = current_pid()
        if self._prefix is not None and self._prefix[0] == pid:
            prefix = self._prefix[1]
        else:
            token = _writer_token()
            prefix = f".{pid}-{token}-"
            if token:  # an unknown token is asked again next time, not kept for good
                self._prefix = (pid, prefix)
        return f"{prefix}{_temp_nonce}{next(_temp_counter):016x}.tmp"


def sweep_temps(
    location: str, *, temp_grace: float, now: float, trust_shared_root: bool
) -> list[str]:
    """Check the root and its fan-outs are private; remove temp files whose writer is
    gone and that are older than ``temp_grace`` seconds; the paths removed.

    A temp file's name carries its writer's pid and exact identity, so a live writer's
    file is never taken. A fan-out name that is a symlink (or anything but a directory)
    is never followed: nothing outside the root is listed or removed. The operations
    that need it fail.
    """
    removed: list[str] = []
    root_fd = open_root(location)
    try:
        check_private(
            root_fd, location, "the journal directory", trust_shared_root=trust_shared_root
        )
        try:
            names = sorted(os.listdir(root_fd))
        except OSError as error:
            raise fail(f"cannot list {location}", error) from error
        removed += _sweep_dir(root_fd, location, names, now, temp_grace)
        for name in names:
            if not FANOUT.fullmatch(name):
                continue
            directory = os.path.join(location, name)
            try:
                fd = os.open(name, FANOUT_FLAGS, dir_fd=root_fd)
            except OSError:
                continue
            try:
                check_private(
                    fd, directory, "the fan-out directory", trust_shared_root=trust_shared_root
                )
                try:
                    entries = sorted(os.listdir(fd))
                except OSError:
                    continue
                removed += _sweep_dir(fd, directory, entries, now, temp_grace)
            finally:
                os.close(fd)
    finally:
        os.close(root_fd)
    return removed


def _sweep_dir(
    dir_fd: int, directory: str, names: list[str], now: float, temp_grace: float
) -> list[str]:
    removed: list[str] = []
    for name in names:
        match = _TEMP.fullmatch(name)
        if match is None:
            continue
        try:
            age = now - os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mtime
        except OSError:
            continue
        if age < temp_grace or writer_lives(int(match[1]), match[2]):
            continue
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            continue
        removed.append(os.path.join(directory, name))
    return removed


def find_strays(location: str) -> list[str]:
    """Orphan temp files (their writer is gone, whatever their age) and entries that
    have no business in the root or a fan-out, one line each. Changes nothing."""
    problems: list[str] = []
    root_fd = open_root(location)
    try:
        try:
            names = sorted(os.listdir(root_fd))
        except OSError as error:
            raise fail(f"cannot list {location}", error) from error
        expected_root = {LOCK_NAME, SETTINGS_NAME}
        problems += _strays_in(location, names, expected_root, fanouts=True)
        for name in names:
            if not FANOUT.fullmatch(name):
                continue
            directory = os.path.join(location, name)
            try:
                fd = os.open(name, FANOUT_FLAGS, dir_fd=root_fd)
            except OSError:
                continue  # the scan reports a fan-out it cannot open
            try:
                entries = sorted(os.listdir(fd))
            except OSError:
                continue
            finally:
                os.close(fd)
            problems += _strays_in(directory, entries, {LOCK_NAME}, fanouts=False)
    finally:
        os.close(root_fd)
    return problems


def _strays_in(directory: str, names: list[str], expected: set[str], *, fanouts: bool) -> list[str]:
    problems: list[str] = []
    for name in names:
        path = os.path.join(directory, name)
        match = _TEMP.fullmatch(name)
        if match is not None:
            if not writer_lives(int(match[1]), match[2]):
                problems.append(
                    f"STORAGE_FAILED: orphan temp file {path}: its writer is gone "
                    f"(the next open removes it once it is a minute old)"
                )
        elif name in expected or (fanouts and FANOUT.fullmatch(name)):
            continue
        elif not fanouts and RECORD_NAME.fullmatch(name):
            if name[:2] != os.path.basename(directory):
                problems.append(f"RECORD_INVALID: {path} is in the wrong fan-out directory")
        else:
            problems.append(f"STORAGE_FAILED: unexpected entry {path} in the journal")
    return problems
