"""Owners of other machines met through a shared state directory: their boot ids in the
boot log prove nothing, and a live owner on another machine is never judged gone.

An owner runs in a mount namespace where the boot id (and, for "another machine", every
file that names this machine) reads as someone else's, with the judge's state directory
(``ITEMJOURNAL_STATE_DIR``): as a persistent volume that moved between nodes, a network
file system, or a machine cloned after it logged. The judge runs on this machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from itemjournal._stores.owners import GONE_REBOOTED

SCRIPT = str(Path(__file__).parents[1] / "_ns_owner.py")

pytestmark = pytest.mark.slow


def _mount_refused() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    if os.geteuid() != 0:
        return "mount namespaces need root here"
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        return f"unshare refused: {done.stderr.decode(errors='replace').strip()}"
    return None


REFUSED = _mount_refused()
if REFUSED is not None and os.environ.get("CI") == "true":
    pytest.fail(f"the mount namespace tests must run under CI: {REFUSED}", pytrace=False)
skip_without_unshare = pytest.mark.skipif(REFUSED is not None, reason=REFUSED or "")


def _identity_files() -> list[str]:
    """Every file that names this machine (beyond its boot), as a namespace could fake it."""
    found = [
        path
        for path in (
            "/etc/machine-id",
            "/var/lib/dbus/machine-id",
            "/sys/class/dmi/id/product_uuid",
            "/sys/hypervisor/uuid",
            "/sys/firmware/devicetree/base/serial-number",
        )
        if os.path.isfile(path)
    ]
    for device in sorted(Path("/sys/class/net").iterdir()):
        if (device / "device").exists():
            found.append(str(device / "address"))
    return found


def _as(where: Path, boot: str, *, other_machine: bool) -> list[str]:
    """The command prefix of a process whose boot id is ``boot`` and, with
    ``other_machine``, whose machine identity files all read as another machine's."""
    fakes = {"/proc/sys/kernel/random/boot_id": f"{boot}\n"}
    if other_machine:
        for n, path in enumerate(_identity_files()):
            if path.endswith("/address"):
                fakes[path] = f"02:00:00:00:{n // 256:02x}:{n % 256:02x}\n"
            else:
                fakes[path] = f"{uuid.uuid4().hex}\n"
    mounts = []
    for n, (path, text) in enumerate(fakes.items()):
        fake = where / f"fake-{n}"
        fake.write_text(text)
        mounts.append(f"mount --bind {fake} {path}")
    script = " && ".join([*mounts, 'exec "$@"'])
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "-"]


def _claim_and_die(prefix: list[str], location: str, env: dict[str, str]) -> str:
    """An owner claims ``item-1`` under ``prefix`` and is killed; its process name."""
    owner = subprocess.Popen(
        [*prefix, sys.executable, SCRIPT, "owner", location, "0", "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert owner.stdout is not None
        claimed = owner.stdout.readline().split()
        assert claimed[:1] == ["claimed"], claimed
    finally:
        owner.kill()
        owner.wait(timeout=30)
        for stream in (owner.stdin, owner.stdout):
            if stream is not None:
                stream.close()
    return claimed[2]


def _judge(location: str, env: dict[str, str]) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, SCRIPT, "judge", location, "asyncio"],
        input="1\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    verdict: dict[str, object] = json.loads(done.stdout.splitlines()[0])
    return verdict


def _command_sweep(location: str, env: dict[str, str]) -> list[object]:
    done = subprocess.run(
        [sys.executable, "-m", "itemjournal", "-L", location, "sweep", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    marked: list[object] = json.loads(done.stdout)["marked"]
    return marked


@skip_without_unshare
@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_a_boot_logged_by_another_machine_in_a_shared_state_directory_proves_nothing(
    kind: str, tmp_path: Path
) -> None:
    shared = tmp_path / "state"
    shared.mkdir(mode=0o700)
    env = {**os.environ, "ITEMJOURNAL_STATE_DIR": str(shared)}
    fakes = tmp_path / "fakes"
    fakes.mkdir()

    def location(name: str) -> str:
        return f"sqlite://{tmp_path}/{name}.db" if kind == "sqlite" else str(tmp_path / name)

    # Another machine's owner, with its boot logged in the shared directory.
    elsewhere = location("elsewhere")
    other_boot = str(uuid.uuid4())
    process = _claim_and_die(_as(fakes, other_boot, other_machine=True), elsewhere, env)
    assert process.startswith(other_boot)
    verdict = _judge(elsewhere, env)
    assert verdict == {"begin": "IN_PROGRESS", "alive": None, "reason": None, "marked": 0}
    assert _command_sweep(elsewhere, env) == []
    assert _judge(elsewhere, env)["begin"] == "IN_PROGRESS"  # still nothing marked

    # The same record from an earlier boot of this very machine is found gone.
    here = location("here")
    earlier_boot = str(uuid.uuid4())
    process = _claim_and_die(_as(fakes, earlier_boot, other_machine=False), here, env)
    assert process.startswith(earlier_boot)
    verdict = _judge(here, env)
    assert verdict["begin"] == "REVIEW_REQUIRED", verdict
    assert verdict["reason"] == GONE_REBOOTED  # (marked by that begin: no longer started)
