"""The whole demo (``make demo``): a worker loop that dies, a rerun, then reconciliation.

1. Three workers charge five orders. The provider never answers for order-3, so its
   outcome is unknown and the journal marks it ``needs_review``. Order-5 is charged by the
   provider, then the worker process is killed (SIGKILL) before it records the receipt:
   this run is expected to die, with return code -9.
2. A rerun reuses the three receipts, finds order-5's owner process gone and refuses it
   (``REVIEW_REQUIRED``), refuses order-3, and asks the provider nothing.
3. The operator lists what needs review and looks at order-5. Then ``itemjournal
   reconcile`` asks the provider what happened to each record's idempotency key (the check
   ``worker_loop:what_happened``, given the provider's ledger with ``--check-arg``): first
   with ``--dry-run``, then with ``--yes``. Order-5
   was charged: it is resolved ``succeeded`` with the provider's charge id as its receipt.
   Order-3 was not: it is released for a retry. Both resolutions are audited.
4. The worker loop runs again: it charges order-3 once (with the same idempotency key) and
   reuses every other receipt; a last ``itemjournal list`` shows every order succeeded.

    python examples/demo.py --root /tmp/demo-journal
"""

from __future__ import annotations

import argparse
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

ORDER_5 = ("demo-shop", "billing", "charge", "order-5")
CHECK = "worker_loop:what_happened"  # examples/worker_loop.py, found through PYTHONPATH


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
    search = [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, ITEMJOURNAL_LOCATION=root, PYTHONPATH=os.pathsep.join(search))
    worker = [sys.executable, str(HERE / "worker_loop.py")]  # its --root: the variable
    tool = itemjournal_command()

    def worker_loop(*extra: str, expect: int = 0) -> None:
        run([*worker, *extra], ["python", "examples/worker_loop.py", *extra], env, expect=expect)

    def operator(*args: str) -> None:
        run([*tool, *args], ["itemjournal", *args], env)

    print(f"$ export ITEMJOURNAL_LOCATION={shlex.quote(root)}")
    print("$ export PYTHONPATH=examples  # where the reconciliation check lives")
    killed = -signal.SIGKILL
    worker_loop("--fresh", expect=killed)
    print(f"# the worker process died by SIGKILL (return code {killed}), as intended:")
    print("# order-5 was charged at the provider but its receipt was never recorded")
    worker_loop()
    print("\n# order-3 and order-5 are stuck in review; the operator looks:")
    operator("list", "--status", "needs_review")
    operator("show", *ORDER_5)

    print(
        "\n# the provider answers what happened to an idempotency key: ask it about every"
        "\n# record in review, first without changing anything"
    )
    ledger = f"ledger={ledger_path(root)}"  # the check's argument: the provider's ledger
    operator("reconcile", "--check", CHECK, "--dry-run", "--check-arg", ledger)
    print("\n# order-5 was charged: it succeeds with that charge; order-3 was not: released")
    operator("reconcile", "--check", CHECK, "--yes", "--check-arg", ledger)
    operator("show", *ORDER_5)
    charges = len(read_ledger(ledger_path(root)))
    print(f"\n# the provider holds {charges} charges; the next run charges order-3 once")
    worker_loop()
    operator("list")


if __name__ == "__main__":
    main()
