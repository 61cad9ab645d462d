"""Who may write where the journal lives: the root must be this user's alone.

A directory that another local user can write to lets that user move a record aside
(a rerun then gets a fresh claim: the work runs twice) or plant one (a rerun reuses a
forged receipt). ``open`` therefore refuses a location that is not owned by the running
user or that group or others can write, as ssh refuses such a key directory, unless the
caller says the other writers are trusted (``trust_shared_root=True``).
"""

from __future__ import annotations

import errno
import os
import stat

from .._model.errors import StorageFailed

__all__ = ["require_private", "sharing_problem"]


def sharing_problem(info: os.stat_result, path: str, what: str) -> str | None:
    """Why ``path`` (whose ``stat`` is ``info``) is not private to this user, or None."""
    uid = os.geteuid()
    if info.st_uid != uid:
        return (
            f"{what} {path} is owned by uid {info.st_uid}, not by this process's uid {uid}; "
            f"another user could move or plant records there. Use a location of your own, "
            f"or `chown {uid} {path}`"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (
            f"{what} {path} is writable by group or others "
            f"(mode {stat.S_IMODE(info.st_mode):04o}); another user could move or plant "
            f"records there. Run `chmod go-w {path}`"
        )
    return None


def require_private(info: os.stat_result, path: str, what: str) -> None:
    """Raise ``STORAGE_FAILED`` naming the fix when ``path`` is shared with other users."""
    problem = sharing_problem(info, path, what)
    if problem is not None:
        raise StorageFailed(
            f"{problem}, or open the journal with trust_shared_root=True if every user "
            f"who can write there is trusted",
            errno=errno.EPERM,
        )
