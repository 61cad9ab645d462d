"""Owners and liveness: (host, pid, process start time)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from itemjournal import Owner
from itemjournal import _owner as owner_module
from itemjournal._owner import current_owner, owner_alive, process_start

NO_SUCH_PID = 2**22 + 1  # above the kernel's pid_max limit: never a process


def test_current_owner_is_this_process() -> None:
    me = current_owner()
    assert me.pid == os.getpid()
    assert me.host == socket.gethostname()
    assert me.started_at
    assert me.started_at == process_start(os.getpid())
    assert owner_alive(me) is True


def test_a_dead_or_reused_pid_is_not_alive() -> None:
    me = current_owner()
    assert process_start(NO_SUCH_PID) is None
    assert owner_alive(Owner(me.host, NO_SUCH_PID, me.started_at)) is False
    reused = Owner(me.host, me.pid, "2001-01-01T00:00:00.000+00:00")
    assert owner_alive(reused) is False


def test_an_owner_elsewhere_or_none_is_unknown() -> None:
    assert owner_alive(Owner("elsewhere.invalid", os.getpid(), "")) is None
    assert owner_alive(None) is None


def test_a_zombie_is_not_alive() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
    try:
        assert process_start(child.pid) is None
    finally:
        child.wait()


def test_an_unknown_start_time_trusts_the_pid() -> None:
    me = current_owner()
    assert owner_alive(Owner(me.host, me.pid, "")) is True


def test_without_proc_only_existence_is_known(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(owner_module, "_boot_time", lambda: None)
    assert process_start(os.getpid()) == ""
    assert process_start(NO_SUCH_PID) is None
    assert process_start(1) == ""  # exists; as root it may also be signalled
    me = current_owner()
    assert owner_alive(Owner(me.host, me.pid, me.started_at)) is True
