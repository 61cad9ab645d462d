"""A host that dies inside a write transaction: its row lock goes within the documented
bound (docs/durability.md), and another host's ``begin`` then answers.

The dying host is a process of the test's own in a network namespace, joined to a
cluster of the test's own by a veth pair. It claims an item, then pauses inside the
transaction of its ``complete`` (the row locked, the commit not sent); the test cuts its
link and kills it, so that no packet of its ever reaches the server again, as when a
machine loses power. Another host keeps calling ``begin`` on the identity.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import _pg
import anyio
import pytest

from itemjournal import ConflictError, Identity, Journal, StorageFailed, definition_digest

pytestmark = pytest.mark.slow

DEFINITION = definition_digest("pg-dead-host-v1")
# The bound docs/durability.md states for a dead host's row lock on a direct connection
# (the keepalives and tcp_user_timeout of the store's connections), with a margin for a
# loaded machine.
BOUND = 20.0
GIVE_UP = 60.0  # how long the test watches before it calls the lock held for good

CHILD = """
import sys, time, anyio
from itemjournal import Identity, Journal, definition_digest
from itemjournal._stores.postgres.store import PostgresStore

def paused(self, connection, digest, before, data):
    print("paused", flush=True)
    time.sleep(3600)

async def main():
    journal = await Journal.open(sys.argv[1])
    identity = Identity("deadhost", "test", "x", sys.argv[2])
    claim = await journal.begin(identity, {}, definition_digest("pg-dead-host-v1"))
    print("claimed", flush=True)
    PostgresStore._commit = paused
    await journal.complete(claim, "done")

anyio.run(main)
"""


def _netns_refused() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root here"
    if shutil.which("ip") is None:
        return "ip(8) is not installed"
    name = f"ij-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, check=False)
    if made.returncode != 0:
        return f"ip netns refused: {made.stderr.decode(errors='replace').strip()}"
    subprocess.run(["ip", "netns", "delete", name], check=False)
    return None


REFUSED = _netns_refused()
if REFUSED is not None and os.environ.get("CI") == "true":
    pytest.fail(f"the dead-host test must run under CI: {REFUSED}", pytrace=False)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def host() -> Iterator[tuple[str, str, str]]:
    """A network namespace joined to this one by a veth pair: (namespace, the veth's end
    here, this end's address)."""
    if REFUSED is not None:
        pytest.skip(REFUSED)
    tag = secrets.token_hex(3)
    namespace, here, there = f"ij-{tag}", f"ijh{tag}", f"ijn{tag}"
    subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
    _ip("netns", "add", namespace)
    try:
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", namespace)
        _ip("addr", "add", f"{subnet}.1/24", "dev", here)
        _ip("link", "set", here, "up")
        _ip("-n", namespace, "addr", "add", f"{subnet}.2/24", "dev", there)
        _ip("-n", namespace, "link", "set", there, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        yield namespace, here, f"{subnet}.1"
    finally:
        subprocess.run(["ip", "link", "delete", here], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "delete", namespace], check=False)


def _reachable_from(server: _pg.Cluster, address: str) -> None:
    """``server`` listening on ``address`` too, trusting the namespace's connections."""
    with (server.data / "postgresql.conf").open("a") as conf:
        conf.write(f"listen_addresses = '127.0.0.1,{address}'\n")
    with (server.data / "pg_hba.conf").open("a") as hba:
        hba.write(f"host all all {address.rsplit('.', 1)[0]}.0/24 trust\n")
    server.stop()
    server.start()


@pytest.mark.anyio
async def test_a_host_dead_inside_a_write_transaction_frees_its_row_within_the_bound(
    host: tuple[str, str, str],
) -> None:
    namespace, link, address = host
    with _pg.cluster() as server:
        _reachable_from(server, address)
        schema = f"ij_{secrets.token_hex(4)}"
        item = "item"
        there = f"postgresql://postgres@{address}:{server.port}/test?schema={schema}"
        child = subprocess.Popen(
            ["ip", "netns", "exec", namespace, sys.executable, "-c", CHILD, there, item],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "claimed"
            assert child.stdout.readline().strip() == "paused"
            # The row is locked now: the link goes, then the process (no FIN, no RST).
            _ip("link", "set", link, "down")
            child.kill()
            child.wait(timeout=30)
            died = time.monotonic()
            here = f"{server.url}?schema={schema}"
            answers: list[str] = []
            async with await Journal.open(here, lock_timeout=2) as other:
                while True:
                    waited = time.monotonic() - died
                    assert waited < GIVE_UP, (waited, answers[-3:])
                    try:
                        await other.begin(Identity("deadhost", "test", "x", item), {}, DEFINITION)
                    except ConflictError as answer:
                        answers.append(answer.code)
                        break
                    except StorageFailed as failed:
                        answers.append(f"STORAGE_FAILED after {waited:.1f} s: {failed}")
                        await anyio.sleep(0.2)
                        continue
                    answers.append("granted")
                    break
            freed = time.monotonic() - died
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            if child.stdout is not None:
                child.stdout.close()
    print(f"\nrow of a dead host answered {answers[-1]} after {freed:.1f} s")
    assert answers[-1] in ("REVIEW_REQUIRED", "IN_PROGRESS"), answers
    assert freed < BOUND, (freed, answers[-3:])
