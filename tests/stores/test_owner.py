"""Owners and liveness: a process named exactly by (boot id, pid namespace, start ticks).

The same exact name marks the file store's temp files, so a sweep can tell whether
their writer lives.
"""

from __future__ import annotations

import io
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from itemjournal import FileStore, Owner
from itemjournal._model.records import parse_process
from itemjournal._stores import owners as owner_module
from itemjournal._stores.files import temps as filestore_module
from itemjournal._stores.owners import (
    GONE_NAMESPACE,
    GONE_PROCESS,
    GONE_REBOOTED,
    assess,
    current_owner,
    local_process_space,
    own_process,
    owner_alive,
    process_alive,
    start_ticks,
)

NO_SUCH_PID = 2**22 + 1  # above the kernel's pid_max limit: never a process
HOST = socket.gethostname()


def boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def time_namespace() -> int:
    return os.stat("/proc/self/ns/time").st_ino


def ticks_of(pid: int) -> int:
    raw = Path(f"/proc/{pid}/stat").read_bytes()
    return int(raw[raw.rfind(b")") + 2 :].split()[19])


def other_boot() -> str:
    other = str(uuid.uuid4())
    assert other != boot_id()
    return other


def named(
    pid: int, boot: str, namespace: int, ticks: int, host: str = HOST, time_ns: int | None = None
) -> Owner:
    """An owner built by hand, as another process would have written it."""
    time_ns = time_namespace() if time_ns is None else time_ns
    return Owner(host, pid, "", f"{boot}:{namespace}:{time_ns}:{ticks}")


def legacy(pid: int, boot: str, namespace: int, ticks: int) -> Owner:
    """An owner as a version that did not record time namespaces wrote it."""
    return Owner(HOST, pid, "", f"{boot}:{namespace}:{ticks}")


@pytest.fixture(autouse=True)
def fresh_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test computes this process's identity afresh (and leaves no patched one)."""
    monkeypatch.setattr(owner_module, "_space", None)
    monkeypatch.setattr(owner_module, "_me", None)
    monkeypatch.setattr(owner_module, "_boot", None)


def stepped_proc_stat() -> io.BytesIO:
    """``/proc/stat`` after the wall clock was stepped 1 s forward: ``btime`` is 1 s later."""
    text = Path("/proc/stat").read_bytes()
    btime = next(line for line in text.splitlines() if line.startswith(b"btime "))
    return io.BytesIO(text.replace(btime, b"btime %d" % (int(btime.split()[1]) + 1)))


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every path ``_owner`` opens, while ``/proc/stat`` shows a clock stepped by 1 s."""
    paths: list[str] = []
    real_open = open

    def stepped_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        paths.append(str(path))
        if str(path) == "/proc/stat":
            return stepped_proc_stat()
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(owner_module, "open", stepped_open, raising=False)
    return paths


# ---------------------------------------------------------------------- this process


def test_current_owner_is_this_process_named_exactly() -> None:
    me = current_owner()
    assert me.pid == os.getpid()
    assert me.host == HOST
    assert me.started_at  # for people: a UTC time
    assert parse_process(me.process) == (
        boot_id(),
        pid_namespace(),
        time_namespace(),
        ticks_of(os.getpid()),
    )
    assert me.process == (
        f"{boot_id()}:{pid_namespace()}:{time_namespace()}:{ticks_of(os.getpid())}"
    )
    assert own_process() == (boot_id(), pid_namespace(), ticks_of(os.getpid()))
    assert owner_alive(me) is True
    assert current_owner() is me  # remembered


def test_started_at_is_never_compared() -> None:
    me = current_owner()
    assert owner_alive(Owner(me.host, me.pid, "2001-01-01T00:00:00.000+00:00", me.process))
    assert owner_alive(Owner(me.host, me.pid, "", me.process)) is True


# ---------------------------------------------------------------------- clock steps


def test_a_clock_step_changes_nothing_liveness_reads(opened: list[str]) -> None:
    """Liveness never reads the boot time, which moves when the clock is stepped."""
    me = named(os.getpid(), boot_id(), pid_namespace(), ticks_of(os.getpid()))

    assert owner_alive(me) is True
    assert owner_alive(named(os.getpid(), boot_id(), pid_namespace(), 1)) is False
    assert f"/proc/{os.getpid()}/stat" in opened  # it did look the process up...
    assert "/proc/stat" not in opened  # ...but never at the boot time


def test_an_owner_named_before_a_clock_step_stays_alive_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The claim was made before the step; the sweep runs after it (btime moved by 1 s)."""
    before = current_owner()  # real btime
    monkeypatch.setattr(owner_module, "_me", None)
    monkeypatch.setattr(owner_module, "_space", None)
    real_open = open

    def stepped_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path) == "/proc/stat":
            return stepped_proc_stat()
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(owner_module, "open", stepped_open, raising=False)
    after = current_owner()

    assert after.started_at != before.started_at  # what people see moved with the clock
    assert after.process == before.process  # the exact name did not
    assert owner_alive(before) is True
    assert owner_alive(after) is True


def test_a_temp_writer_token_ignores_clock_steps(opened: list[str]) -> None:
    token = filestore_module._writer_token()
    assert token.isdigit()
    assert "/proc/stat" not in opened
    assert FileStore._writer_lives(os.getpid(), token) is True
    assert "/proc/stat" not in opened


# ---------------------------------------------------------------------- other boots and namespaces


def test_an_owner_of_another_boot_is_unknown_not_dead() -> None:
    for pid in (os.getpid(), NO_SUCH_PID, 1):
        assert owner_alive(named(pid, other_boot(), pid_namespace(), ticks_of(os.getpid()))) is None


def test_an_owner_in_another_pid_namespace_is_unknown_while_a_process_is_in_it() -> None:
    """Its pids are not ours: no pid of it is looked up here. Whether its namespace still
    holds a process is what decides (see test_owner_namespaces for real ones)."""
    in_use = os.stat("/proc/self/ns/mnt").st_ino  # an nsfs inode, but of no pid namespace
    for pid in (os.getpid(), NO_SUCH_PID, 1):
        owner = named(pid, boot_id(), in_use + 10**9, ticks_of(os.getpid()))
        provable = pid_namespace() == owner_module.INITIAL_PID_NAMESPACE
        assert assess(owner) == ((False, GONE_NAMESPACE) if provable else (None, ""))


def test_the_host_name_is_never_compared() -> None:
    """A UTS namespace gives a process another hostname on the same kernel: what names
    the process (boot, namespaces, start) decides, never what it calls its host."""
    me = current_owner()
    assert owner_alive(Owner("elsewhere.invalid", os.getpid(), "", me.process)) is True
    gone = named(NO_SUCH_PID, boot_id(), pid_namespace(), 1, host="elsewhere.invalid")
    assert owner_alive(gone) is False
    assert owner_alive(Owner("elsewhere.invalid", NO_SUCH_PID, "")) is None
    assert owner_alive(None) is None


def test_a_malformed_hand_made_process_is_unknown() -> None:
    for process in ("x", f"{boot_id()}:{pid_namespace()}", f"{boot_id().upper()}:1:1"):
        assert owner_alive(Owner(HOST, NO_SUCH_PID, "", process)) is None


def unshare_available() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, check=False
    )
    return done.returncode == 0


@pytest.mark.skipif(not unshare_available(), reason="needs root and unshare(1)")
def test_a_live_owner_in_a_real_container_namespace_is_never_dead() -> None:
    """A process in its own pid namespace (a container sharing this hostname) is pid 1
    there; here pid 1 is init, with another start. Judged by pid it would look dead."""
    script = (
        "import sys; from itemjournal._stores.owners import current_owner; o = current_owner(); "
        "print(o.pid, o.process, flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        pid, process = child.stdout.readline().split()
        owner = Owner(HOST, int(pid), "", process)
        boot, namespace, _, _ = parse_process(process) or ("", 0, 0, 0)
        assert boot == boot_id()
        assert namespace != pid_namespace()
        assert owner_alive(owner) is None
    finally:
        child.stdin.close()
        child.wait(timeout=10)
        child.stdout.close()
    # Gone now, and with it its pid namespace, which the host's own namespace can see.
    provable = pid_namespace() == owner_module.INITIAL_PID_NAMESPACE
    assert assess(owner) == ((False, GONE_NAMESPACE) if provable else (None, ""))


# ---------------------------------------------------------------------- gone, reused, zombie


def test_a_dead_pid_is_not_alive() -> None:
    assert start_ticks(NO_SUCH_PID) is None
    assert owner_alive(named(NO_SUCH_PID, boot_id(), pid_namespace(), 1)) is False


def test_a_reused_pid_is_not_alive() -> None:
    """Same pid, same boot and namespace, another start: another process has the pid."""
    mine = ticks_of(os.getpid())
    for other in (mine + 1, mine - 1, 0):
        assert owner_alive(named(os.getpid(), boot_id(), pid_namespace(), other)) is False


@pytest.fixture
def waiting_child() -> Iterator[subprocess.Popen[bytes]]:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1)
    yield child
    if child.stdin is not None and not child.stdin.closed:
        child.stdin.close()
    child.wait(timeout=10)


def test_a_zombie_is_not_alive(waiting_child: subprocess.Popen[bytes]) -> None:
    child = waiting_child
    owner = named(child.pid, boot_id(), pid_namespace(), ticks_of(child.pid))
    assert owner_alive(owner) is True
    assert child.stdin is not None
    child.stdin.close()
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
    assert start_ticks(child.pid) is None
    assert owner_alive(owner) is False
    assert owner_alive(Owner(HOST, child.pid, "")) is None  # unnamed: never by its pid


def test_an_unreadable_proc_entry_is_unknown(
    monkeypatch: pytest.MonkeyPatch, waiting_child: subprocess.Popen[bytes]
) -> None:
    """With ``hidepid`` /proc hides other users' processes; they still exist."""
    owner = named(waiting_child.pid, boot_id(), pid_namespace(), ticks_of(waiting_child.pid))
    real_open = open

    def hiding_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path) == f"/proc/{waiting_child.pid}/stat":
            raise FileNotFoundError(2, "hidden", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(owner_module, "open", hiding_open, raising=False)
    assert start_ticks(waiting_child.pid) == owner_module.HIDDEN
    assert owner_alive(owner) is None
    assert start_ticks(NO_SUCH_PID) is None  # what does not exist is still gone


def test_an_unnamed_owner_is_never_judged_by_its_pid() -> None:
    """Its pid may be of another pid namespace: no pid of ours says anything of it."""
    for pid in (os.getpid(), NO_SUCH_PID, 2**63 - 1):
        assert owner_alive(Owner(HOST, pid, "")) is None
        assert owner_alive(Owner(HOST, pid, "", boot_id())) is None  # its boot alone


def test_an_owner_in_another_time_namespace_is_judged_only_by_its_pid_being_gone() -> None:
    """Start ticks read in another time namespace are shifted: unequal ticks prove
    nothing there; a pid that no process has proves the owner gone."""
    other = time_namespace() + 1
    mine = ticks_of(os.getpid())
    assert owner_alive(named(os.getpid(), boot_id(), pid_namespace(), mine, time_ns=other)) is True
    shifted = named(os.getpid(), boot_id(), pid_namespace(), mine + 500_000, time_ns=other)
    assert owner_alive(shifted) is None
    gone = named(NO_SUCH_PID, boot_id(), pid_namespace(), mine, time_ns=other)
    assert assess(gone) == (False, GONE_PROCESS)


def test_an_owner_written_before_time_namespaces_were_recorded_is_judged_conservatively() -> None:
    mine = ticks_of(os.getpid())
    assert owner_alive(legacy(os.getpid(), boot_id(), pid_namespace(), mine)) is True
    assert owner_alive(legacy(os.getpid(), boot_id(), pid_namespace(), mine + 1)) is None
    assert owner_alive(legacy(NO_SUCH_PID, boot_id(), pid_namespace(), mine)) is False


def test_an_owner_of_an_earlier_boot_of_this_machine_is_gone(tmp_path: Path) -> None:
    """This machine's boot log names the boot: its processes are certainly gone."""
    earlier = other_boot()
    log = owner_module.boot_log_path()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as stream:
        stream.write(f"{earlier}\n")
    for owner in (
        named(os.getpid(), earlier, pid_namespace(), ticks_of(os.getpid())),
        Owner("renamed-since", 1, "", earlier),  # it knew only its boot
        legacy(1, earlier, 4026532999, 7),
    ):
        assert assess(owner) == (False, GONE_REBOOTED)
    stranger = other_boot()  # a boot this machine never logged: another machine's
    assert owner_alive(named(NO_SUCH_PID, stranger, pid_namespace(), 1)) is None


def test_a_boot_log_others_could_write_proves_nothing(tmp_path: Path) -> None:
    earlier = other_boot()
    log = owner_module.boot_log_path()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as stream:
        stream.write(f"{earlier}\n")
    os.chmod(log, 0o622)
    try:
        assert owner_alive(Owner(HOST, 1, "", earlier)) is None
    finally:
        os.chmod(log, 0o600)


def test_an_owner_logs_its_boot_before_it_claims() -> None:
    me = current_owner()
    assert boot_id() in owner_module.boot_log_path().read_text().split()
    assert me.process.startswith(boot_id())


# ---------------------------------------------------------------------- no /proc


@pytest.fixture
def no_proc(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a system without /proc: no boot id, so no exact names."""
    monkeypatch.setattr(owner_module, "BOOT_ID_PATH", "/nonexistent/boot_id")
    monkeypatch.setattr(owner_module, "_space", None)
    monkeypatch.setattr(owner_module, "_me", None)
    monkeypatch.setattr(owner_module, "_boot", None)


def test_without_proc_only_existence_is_known(no_proc: None) -> None:
    assert local_process_space() is None
    assert own_process() is None
    me = current_owner()
    assert me.pid == os.getpid()
    assert me.process == ""
    assert owner_alive(me) is None  # unnamed: never judged by a pid
    assert process_alive(NO_SUCH_PID, None) is False  # temp files: existence only


def test_without_proc_an_exactly_named_owner_is_unknown(no_proc: None) -> None:
    """It was named where /proc worked; here its boot and namespace cannot be checked."""
    assert owner_alive(named(NO_SUCH_PID, other_boot(), 1, 1)) is None
    assert owner_alive(named(os.getpid(), other_boot(), 1, 1)) is None


def test_a_passing_proc_failure_is_not_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(owner_module, "BOOT_ID_PATH", "/nonexistent/boot_id")
    assert local_process_space() is None
    assert current_owner().process == ""
    monkeypatch.undo()
    monkeypatch.setattr(owner_module, "_space", None)
    monkeypatch.setattr(owner_module, "_boot", None)
    assert local_process_space() == (boot_id(), pid_namespace())
    assert current_owner().process == (
        f"{boot_id()}:{pid_namespace()}:{time_namespace()}:{ticks_of(os.getpid())}"
    )


# ---------------------------------------------------------------------- temp-file writers


def token(boot: str, namespace: int, ticks: int) -> str:
    return f"{uuid.UUID(boot).int:039d}{namespace:020d}{ticks}"


def test_the_writer_token_is_this_process_in_digits() -> None:
    mine = filestore_module._writer_token()
    assert mine == token(boot_id(), pid_namespace(), ticks_of(os.getpid()))
    assert filestore_module._parse_writer_token(mine) == (
        uuid.UUID(boot_id()).int,
        pid_namespace(),
        ticks_of(os.getpid()),
    )


@pytest.mark.parametrize(
    ("make", "lives"),
    [
        (lambda: token(boot_id(), pid_namespace(), ticks_of(os.getpid())), True),
        (lambda: token(boot_id(), pid_namespace(), ticks_of(os.getpid()) + 1), False),
        (lambda: token(other_boot(), pid_namespace(), ticks_of(os.getpid())), False),
        (lambda: token(boot_id(), pid_namespace() + 1, ticks_of(os.getpid())), True),
        (lambda: "", True),
        (lambda: "1", False),
        (lambda: "20240101000000123", False),
        (lambda: token(boot_id(), pid_namespace(), 0) + "0", False),
    ],
    ids=[
        "this process",
        "reused pid",
        "earlier boot",
        "other namespace",
        "unknown",
        "short",
        "old date format",
        "leading zero",
    ],
)
def test_which_temp_writers_of_this_pid_live(make: Callable[[], str], lives: bool) -> None:
    assert FileStore._writer_lives(os.getpid(), make()) is lives


def test_a_temp_writer_that_is_gone() -> None:
    assert FileStore._writer_lives(NO_SUCH_PID, "") is False
    assert FileStore._writer_lives(NO_SUCH_PID, filestore_module._writer_token()) is False
    other = token(boot_id(), pid_namespace() + 1, 5)
    assert FileStore._writer_lives(NO_SUCH_PID, other) is True  # another namespace: keep


def test_without_proc_a_named_temp_writer_is_kept(no_proc: None) -> None:
    assert filestore_module._writer_token() == ""
    assert FileStore._writer_lives(NO_SUCH_PID, token(other_boot(), 1, 1)) is True
    assert FileStore._writer_lives(NO_SUCH_PID, "") is False
    assert FileStore._writer_lives(os.getpid(), "") is True


def test_open_sweeps_exactly_the_temps_of_gone_writers(tmp_path: Path) -> None:
    root = tmp_path / "journal"
    fanout = root / "ab"
    fanout.mkdir(parents=True)
    me, ticks = os.getpid(), ticks_of(os.getpid())
    names = {
        "live": f".{me}-{token(boot_id(), pid_namespace(), ticks)}-{'1' * 32}.tmp",
        "reused": f".{me}-{token(boot_id(), pid_namespace(), ticks + 1)}-{'2' * 32}.tmp",
        "earlier boot": f".{me}-{token(other_boot(), pid_namespace(), ticks)}-{'3' * 32}.tmp",
        "container": f".{me}-{token(boot_id(), pid_namespace() + 1, 1)}-{'4' * 32}.tmp",
        "gone": f".{NO_SUCH_PID}-{token(boot_id(), pid_namespace(), 1)}-{'5' * 32}.tmp",
    }
    old = time.time() - 3600
    for name in names.values():
        (fanout / name).write_text("x")
        os.utime(fanout / name, (old, old))
    store = FileStore(str(root))
    store._open_sync()
    left = {kind for kind, name in names.items() if (fanout / name).exists()}
    assert left == {"live", "container"}
    prefix = f".{me}-{token(boot_id(), pid_namespace(), ticks)}-"
    assert os.path.basename(store._temp_name()).startswith(prefix)
