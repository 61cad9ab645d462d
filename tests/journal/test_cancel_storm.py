"""Random cancellation of ``begin`` and of the claim block, on every store and backend.

Each round cancels one call at a random moment: before it starts, while its worker trip
runs, while it waits for a lock another process holds, inside the block, or during the
block's exit. Afterwards the record must be in a state the caller's view allows, every
note the journal attached must be true, and a cancel that lands while nothing can be
written (another process holds the lock) must end the call within 100 ms.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from itemjournal import Claim, Identity, Journal, definition_digest
from itemjournal._model.identity import identity_digest

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

DEFINITION = definition_digest("storm-v1")
INPUTS = {"n": "1"}
ROUNDS = 500
# Seconds from a cancel to the call's end while another process holds the lock. The file
# and SQLite stores stop waiting on a local lock; the PostgreSQL store must first reach the
# server with a cancel request, a connection of its own (forked by the server), which a
# loaded machine can delay beyond 100 ms.
CANCEL_BUDGET = {"file": 0.1, "sqlite": 0.1, "postgres": 0.5}

# A second process that takes and gives back, on request, the lock a begin needs: the
# record's byte of its fan-out's lock file, SQLite's write lock, or the record's row.
_HOLDER = textwrap.dedent(
    """
    import os, sqlite3, sys
    from itemjournal._stores.files.locks import try_lock_record

    location = sys.argv[1]
    sys.path.insert(0, sys.argv[2])
    held = None
    for line in sys.stdin:
        command, _, digest = line.strip().partition(" ")
        if command == "lock":
            if location.startswith("postgresql://"):
                from _pg import hold_row

                held = hold_row(location, digest)
            elif location.startswith("sqlite://"):
                held = sqlite3.connect(location[len("sqlite://"):], isolation_level=None)
                held.execute("BEGIN IMMEDIATE")
            else:
                fanout = os.path.join(location, digest[:2])
                os.makedirs(fanout, mode=0o700, exist_ok=True)
                held = os.open(os.path.join(fanout, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
                assert try_lock_record(held, digest)
        elif command == "unlock":
            if isinstance(held, int):
                os.close(held)
            elif location.startswith("postgresql://"):
                held.close()
            else:
                held.execute("ROLLBACK")
                held.close()
            held = None
        print("ok", flush=True)
    """
)


class Holder:
    def __init__(self, location: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, location, str(Path(__file__).parents[1])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def say(self, line: str) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        assert self.process.stdout.readline().strip() == "ok"

    def close(self) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.close()
        self.process.wait(10)
        self.process.stdout.close()


@pytest.fixture
def holder(location: str) -> Iterator[Holder]:
    process = Holder(location)
    yield process
    process.close()


async def test_random_cancels_leave_true_states_and_true_notes(
    location: str, holder: Holder, store_kind: str, anyio_backend: str
) -> None:
    journal = await Journal.open(location, lock_timeout=10.0)
    chance = random.Random(f"{store_kind}-{anyio_backend}")
    worst_blocked = worst_free = 0.0
    kinds: dict[str, int] = {}
    try:
        for n in range(ROUNDS):
            identity = Identity("storm", store_kind, anyio_backend, f"i{n}")
            blocked = chance.random() < 0.25
            use_block = chance.random() < 0.5
            delay = 0.0 if chance.random() < 0.15 else chance.uniform(0, 0.008)
            body = chance.choice(["complete", "raise", "sleep"])
            if blocked:
                await anyio.to_thread.run_sync(holder.say, f"lock {identity_digest(identity)}")
            granted: list[Claim] = []
            notes: list[str] = []
            deadline = anyio.current_time() + delay
            try:
                with anyio.CancelScope(deadline=deadline):
                    try:
                        if use_block:
                            async with journal.claim(identity, INPUTS, DEFINITION) as attempt:
                                granted.append(attempt.claim)
                                if body == "complete":
                                    await attempt.complete("r")
                                elif body == "raise":
                                    raise LookupError("declined")
                                else:
                                    await anyio.sleep(1)
                        else:
                            outcome = await journal.begin(identity, INPUTS, DEFINITION)
                            assert isinstance(outcome, Claim)
                            granted.append(outcome)
                    except anyio.get_cancelled_exc_class() as cancelled:
                        notes.extend(getattr(cancelled, "__notes__", ()))
                        raise
            except LookupError as raised:
                notes.extend(getattr(raised, "__notes__", ()))
            late = anyio.current_time() - deadline
            if blocked:
                await anyio.to_thread.run_sync(holder.say, "unlock")
                worst_blocked = max(worst_blocked, late)
                budget = CANCEL_BUDGET[store_kind]
                assert late < budget, f"round {n}: the cancel took {late * 1000:.0f} ms"
                assert granted == []
            else:
                worst_free = max(worst_free, late)
            view = await journal.inspect(identity)
            # A cancelled begin either returned its claim or left nothing behind.
            if not granted:
                assert view.status == "absent", (n, view)
                kind = "no claim"
            elif not use_block:
                assert view.status == "started", (n, view)
                kind = "claim returned"
            elif body == "complete" and view.status == "succeeded":
                kind = "completed"
            else:
                # Left by a cancel or an exception: marked, with the reason naming it.
                assert view.status == "needs_review", (n, view)
                assert view.review_reason is not None
                assert view.review_reason.startswith(("block raised ", "block cancelled"))
                kind = "marked"
            kinds[kind] = kinds.get(kind, 0) + 1
            for note in notes:  # every note is true
                assert "could not" not in note and "did not" not in note, (n, note)
                if "needs_review" in note:
                    assert view.status == "needs_review", (n, note, view)
    finally:
        await journal.aclose()
    print(
        f"\n{store_kind}/{anyio_backend}: {ROUNDS} rounds {dict(sorted(kinds.items()))}; "
        f"worst cancel {worst_blocked * 1000:.1f} ms while another process held the lock, "
        f"{worst_free * 1000:.1f} ms otherwise"
    )
