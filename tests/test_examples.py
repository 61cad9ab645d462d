"""The examples run as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "worker_loop.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout


def test_worker_loop_twice(tmp_path: Path) -> None:
    root = str(tmp_path / "demo")
    first = run("--root", root, "--fresh")
    assert first.count("charged, receipt") == 3
    assert "order-3: provider timed out" in first
    assert "[needs_review, reason: block raised TimeoutError]" in first
    assert "made 3 charge(s)" in first
    second = run("--root", root)
    assert second.count("reused receipt") == 3
    assert "order-3: refused (REVIEW_REQUIRED)" in second
    assert "made 0 charge(s)" in second


def test_demo_ends_with_the_operator_resolving_the_stuck_item(tmp_path: Path) -> None:
    root = str(tmp_path / "demo")
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "demo.py"), "--root", root],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    out = result.stdout
    assert "Traceback" not in result.stderr
    steps = [
        "$ python examples/worker_loop.py --fresh",
        "$ python examples/worker_loop.py",
        "$ itemjournal list",
        "$ itemjournal show demo-shop billing charge order-3",
        "$ itemjournal resolve demo-shop billing charge order-3 --retry --note",
        "$ python examples/worker_loop.py",
        "$ itemjournal list",
    ]
    at = 0
    for step in steps:  # each step shown, in this order
        at = out.index(step, at) + len(step)
    before_resolve, after_resolve = out.split("$ itemjournal resolve", 1)
    first_list = before_resolve.split("$ itemjournal list", 1)[1]
    assert "needs_review" in first_list and "block raised TimeoutError" in first_list
    assert "resolved demo-shop/billing/charge/order-3: released" in after_resolve
    assert "order-3: charged, receipt ch_order-3_99.90" in after_resolve
    assert "the provider made 1 charge(s) in this run" in after_resolve
    last_list = out.rsplit("$ itemjournal list", 1)[1]
    assert last_list.count("succeeded") == 4
    assert "needs_review" not in last_list
    assert last_list.rstrip().endswith("4 records")
