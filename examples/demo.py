"""The whole demo (``make demo``): a worker loop that dies, a rerun, then an operator.

1. Three workers charge five orders. The provider never answers for order-3, so its
   outcome is unknown and the journal marks it ``needs_review``. Order-5 is charged by the
   provider, then the worker process is killed (SIGKILL) before it records the receipt:
   this run is expected to die, with return code -9.
2. A rerun reuses the three receipts, finds order-5's owner process gone and refuses it
   (``REVIEW_REQUIRED``), refuses order-3, and asks the provider nothing.
3. The operator lists what needs review, looks at order-5, checks the provider's
   dashboard (its ledger): order-5 was charged, order-3 was not. Order-5 is resolved with
   the provider's charge id as its receipt; order-3 is released for a retry.
4. The worker loop runs again: it charges order-3 once (with the same idempotency key) and
   reuses every other receipt; a last ``itemjournal list`` shows every order succeeded.

    python examples/demo.py --root /tmp/demo-journal
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from worker_loop import ledger_path, read_ledger  # noqa: E402

ORDER_3 = ("demo-shop", "billing", "charge", "order-3")
ORDER_5 = ("demo-shop", "billing", "charge", "order-5")
NOTE_5 = "the provider shows the charge {charge} for order-5: it happened"
NOTE_3 = "no charge at the provider for order-3: safe to charge again"


def itemjournal_command() -> list[str]:
    """The installed ``itemjournal`` script beside this Python, or ``python -m itemjournal``."""
    found = shutil.which("itemjournal", path=os.path.dirname(sys.executable))
    return [found] if found else [sys.executable, "-m", "itemjournal"]


def run(argv: list[str], shown: list[str], env: dict[str, str], *, expect: int = 0) -> None:
    print(f"\n$ {shlex.join(shown)}", flush=True)
    result = subprocess.run(argv, env=env, check=False)
    if result.returncode != expect:
        raise SystemExit(f"{shown[0]} exited with {result.returncode}, expected {expect}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.abspath("demo-journal"))
    root = os.path.abspath(parser.parse_args().root)
    env = dict(os.environ, ITEMJOURNAL_LOCATION=root)
    worker = [sys.executable, str(HERE / "worker_loop.py")]  # its --root: the variable
    tool = itemjournal_command()

    def worker_loop(*extra: str, expect: int = 0) -> None:
        run([*worker, *extra], ["python", "examples/worker_loop.py", *extra], env, expect=expect)

    def operator(*args: str) -> None:
        run([*tool, *args], ["itemjournal", *args], env)

    def key_of(identity: tuple[str, ...]) -> str:
        shown = subprocess.run(
            [*tool, "show", *identity, "--json"], env=env, capture_output=True, check=True
        )
        return str(json.loads(shown.stdout)["key"])

    print(f"$ export ITEMJOURNAL_LOCATION={shlex.quote(root)}")
    killed = -signal.SIGKILL
    worker_loop("--fresh", expect=killed)
    print(f"# the worker process died by SIGKILL (return code {killed}), as intended:")
    print("# order-5 was charged at the provider but its receipt was never recorded")
    worker_loop()
    print("\n# order-3 and order-5 are stuck in review; the operator looks:")
    operator("list", "--status", "needs_review")
    operator("show", *ORDER_5)

    ledger = read_ledger(ledger_path(root))
    print(f"\n# the provider's dashboard ({ledger_path(root)}), by idempotency key:")
    charges: dict[str, str] = {}
    for identity in (ORDER_5, ORDER_3):
        key = key_of(identity)
        lines = [line for line in ledger if line["idempotency_key"] == key]
        for line in lines:
            charges[identity[3]] = line["charge"]
            print(f"  {identity[3]}: {json.dumps(line)}")
        if not lines:
            print(f"  {identity[3]}: no charge for key {key}")
    charge_5 = charges["order-5"]

    print("\n# order-5 was charged: record the provider's charge id as its receipt")
    operator("resolve", *ORDER_5, "--receipt", charge_5, "--note", NOTE_5.format(charge=charge_5))
    print("\n# order-3 was not: release it, the next run charges it with the same key")
    operator("resolve", *ORDER_3, "--retry", "--note", NOTE_3)
    worker_loop()
    operator("list")


if __name__ == "__main__":
    main()
