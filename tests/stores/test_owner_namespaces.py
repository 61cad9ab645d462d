"""Owner liveness across real namespaces, made with ``unshare``: a live owner is never
judged gone from another namespace, and a dead one is found wherever the facts prove it.

Each case runs an owner (``_ns_owner.py``) inside the namespaces ``unshare`` makes, and a
judge (the same script) in the host's or in namespaces of its own. The owner holds a
claim while the judge calls ``begin``, ``inspect`` and ``sweep`` again and again; then
it completes the claim, takes another, and is killed with everything in its namespaces.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from itemjournal._stores.owners import GONE_NAMESPACE, GONE_PROCESS

SCRIPT = str(Path(__file__).parents[1] / "_ns_owner.py")
HOLD = 2.5  # seconds the owner holds its first claim while the judge looks

pytestmark = pytest.mark.slow


def _unshare_refused() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    if os.geteuid() != 0:
        return "namespaces need root here"
    done = subprocess.run(
        ["unshare", "--pid", "--time", "--uts", "--fork", "--mount-proc", "true"],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        return f"unshare refused: {done.stderr.decode(errors='replace').strip()}"
    return None


REFUSED = _unshare_refused()
if REFUSED is not None and os.environ.get("CI") == "true":
    pytest.fail(f"the namespace tests must run under CI: {REFUSED}", pytrace=False)
skip_without_unshare = pytest.mark.skipif(REFUSED is not None, reason=REFUSED or "")

PID = ["unshare", "--pid", "--fork", "--kill-child"]
CONTAINER = [*PID, "--mount-proc"]
TIME = ["unshare", "--time", "--fork", "--kill-child", "--boottime", "5000"]
UTS = [
    "unshare",
    "--uts",
    "--fork",
    "--kill-child",
    "sh",
    "-c",
    'hostname other-host && exec "$@"',
    "-",
]


@dataclass(frozen=True)
class Case:
    owner: list[str]  # the namespaces the owner runs in
    judge: list[str]  # and the judge
    own_pids: bool  # the owner has a pid namespace of its own (give it an unused pid)
    emfile: bool  # the owner claims with no descriptor left
    after: tuple[str, str | None]  # begin's answer and the reason once the owner is dead


CASES = {
    # /proc is the host's: the owner cannot name its process (only its boot).
    "pid namespace without its own /proc": Case(PID, [], True, False, ("IN_PROGRESS", None)),
    # A container: the host's judge sees that no process is left in its pid namespace.
    "pid namespace with its own /proc": Case(
        CONTAINER, [], True, False, ("REVIEW_REQUIRED", GONE_NAMESPACE)
    ),
    "EMFILE at claim time in a container": Case(
        CONTAINER, [], True, True, ("REVIEW_REQUIRED", GONE_NAMESPACE)
    ),
    # A judge in a sibling container cannot see the host's processes: never "gone".
    "two sibling pid namespaces": Case(CONTAINER, CONTAINER, True, False, ("IN_PROGRESS", None)),
    # Start ticks read in another time namespace are shifted: only a gone pid is proof.
    "time namespace with a boottime offset": Case(
        TIME, [], False, False, ("REVIEW_REQUIRED", GONE_PROCESS)
    ),
    # Another hostname, the same kernel and namespaces: the facts are all there.
    "UTS namespace with another hostname": Case(
        UTS, [], False, False, ("REVIEW_REQUIRED", GONE_PROCESS)
    ),
}


def _unused_pid() -> int:
    """A pid no process of the host has now (so a pid-only judge would call it gone)."""
    for pid in range(400, 30000):
        if not os.path.exists(f"/proc/{pid}"):
            return pid
    raise AssertionError("no unused pid")


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            found.append(child)
            todo.append(child)
    return found


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return True
    return state[state.rfind(b")") + 2 :].startswith((b"Z", b"X"))


class Judge:
    def __init__(self, prefix: list[str], location: str, backend: str) -> None:
        self.process = subprocess.Popen(
            [*prefix, sys.executable, SCRIPT, "judge", location, backend],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def __call__(self, item: str) -> dict[str, object]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{item}\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, "the judge ended"
        verdict: dict[str, object] = json.loads(line)
        return verdict

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)
        assert self.process.stdout is not None
        self.process.stdout.close()


# With no descriptor left the file store cannot write a record at all; the SQLite store
# writes through the descriptors it already holds.
PARAMS = [
    pytest.param(name, kind, backend, id=f"{name}-{kind}-{backend}")
    for name, case in CASES.items()
    for kind in (("sqlite",) if case.emfile else ("file", "sqlite"))
    for backend in ("asyncio", "trio")
]


@skip_without_unshare
@pytest.mark.parametrize(("name", "kind", "backend"), PARAMS)
def test_a_live_owner_is_never_gone_and_a_dead_one_is_found_where_provable(
    name: str, kind: str, backend: str, tmp_path: Path
) -> None:
    case = CASES[name]
    location = f"sqlite://{tmp_path}/journal.db" if kind == "sqlite" else str(tmp_path / "j")
    target = _unused_pid() if case.own_pids else 0
    owner = subprocess.Popen(
        [
            *case.owner,
            sys.executable,
            SCRIPT,
            "owner",
            location,
            str(target),
            str(int(case.emfile)),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert owner.stdin is not None and owner.stdout is not None
    judge = Judge(case.judge, location, backend)
    try:
        claimed = owner.stdout.readline().split()
        assert claimed[:1] == ["claimed"], claimed
        if case.own_pids:
            assert int(claimed[1]) >= target
        # Held for a while: every look from the judge says "in progress", none "gone".
        deadline = time.monotonic() + HOLD
        looks = 0
        while time.monotonic() < deadline or looks < 3:
            verdict = judge("1")
            assert verdict == {
                "begin": "IN_PROGRESS",
                "alive": verdict["alive"],
                "reason": None,
                "marked": 0,
            }
            assert verdict["alive"] is not False
            looks += 1
        owner.stdin.write("complete\n")
        owner.stdin.flush()
        assert owner.stdout.readline().strip() == "completed"
        assert owner.stdout.readline().split()[:1] == ["claimed"]
        assert judge("2")["begin"] == "IN_PROGRESS"
        # Killed with everything in its namespaces.
        inside = _descendants(owner.pid)
        owner.kill()
        owner.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not all(_gone(pid) for pid in inside):
            assert time.monotonic() < deadline, "the owner's namespace did not end"
            time.sleep(0.05)
        code, reason = case.after
        verdict = judge("2")
        assert verdict["begin"] == code, verdict
        assert verdict["reason"] == reason
        if code == "IN_PROGRESS":
            assert verdict["alive"] is None and verdict["marked"] == 0
        if case.judge:  # the host's judge sees what the sibling cannot
            host = Judge([], location, backend)
            try:
                verdict = host("2")
                assert (verdict["begin"], verdict["reason"]) == ("REVIEW_REQUIRED", GONE_NAMESPACE)
            finally:
                host.close()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=30)
        owner.stdin.close()
        owner.stdout.close()
        judge.close()
