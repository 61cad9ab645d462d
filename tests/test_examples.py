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
