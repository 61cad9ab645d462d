"""The whole demo (``make demo``): a worker loop, a rerun, then an operator's session.

1. The worker loop charges four orders; the provider never answers for order-3, so its
   outcome is unknown and the journal marks it ``needs_review``.
2. A rerun reuses the three receipts and refuses to charge order-3 again.
3. The operator lists the journal, looks at order-3, checks the provider's dashboard
   (no charge there) and releases it with an audited note.
4. The worker loop runs again and charges order-3 once; a last ``itemjournal list``
   shows every order succeeded.

    python examples/demo.py --root /tmp/demo-journal
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ITEM = ("demo-shop", "billing", "charge", "order-3")
NOTE = "provider dashboard shows no charge for order-3: safe to charge again"


def itemjournal_command() -> list[str]:
    """The installed ``itemjournal`` script beside this Python, or ``python -m itemjournal``."""
    found = shutil.which("itemjournal", path=os.path.dirname(sys.executable))
    return [found] if found else [sys.executable, "-m", "itemjournal"]


def run(argv: list[str], shown: list[str], env: dict[str, str], *, check: bool = True) -> None:
    print(f"\n$ {shlex.join(shown)}", flush=True)
    result = subprocess.run(argv, env=env, check=False)
    if check and result.returncode != 0:
        raise SystemExit(f"{shown[0]} exited with {result.returncode}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.abspath("demo-journal"))
    root = os.path.abspath(parser.parse_args().root)
    env = dict(os.environ, ITEMJOURNAL_LOCATION=root)
    worker = [sys.executable, str(HERE / "worker_loop.py")]  # its --root: the variable
    tool = itemjournal_command()

    def worker_loop(*extra: str) -> None:
        run([*worker, *extra], ["python", "examples/worker_loop.py", *extra], env)

    def operator(*args: str) -> None:
        run([*tool, *args], ["itemjournal", *args], env)

    print(f"$ export ITEMJOURNAL_LOCATION={shlex.quote(root)}")
    worker_loop("--fresh")
    worker_loop()
    print("\n# order-3 is stuck in review; the operator looks, decides, and says why:")
    operator("list")
    operator("show", *ITEM)
    operator("resolve", *ITEM, "--retry", "--note", NOTE)
    print("\n# released: the next run may charge order-3, with the same idempotency key")
    worker_loop()
    operator("list")


if __name__ == "__main__":
    main()
