"""examples/task_group.py runs as documented: a batch in which three items fail, then a
rerun that reuses every receipt and refuses the three without calling the provider."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "task_group.py"


def run(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "Traceback" not in result.stderr
    return result.stdout


def test_task_group_example_twice(tmp_path: Path) -> None:
    root = str(tmp_path / "refunds")
    first = run("--root", root, "--fresh")
    assert "20 items: 17 succeeded, 0 reused, 3 failed, 0 refused" in first
    failed = [line.strip() for line in first.splitlines() if "failed: " in line]
    assert failed == [
        "failed: refund-07  [needs_review: block raised ProviderError: "
        "502 Bad Gateway after the request was sent]",
        "failed: refund-13  [needs_review: block raised TimeoutError]",
        "failed: refund-18  [needs_review: block raised ConnectionResetError: "
        "connection reset by peer]",
    ]
    assert "called 20 time(s), at most 8 at once (limit 8)" in first
    assert "0 refund(s) cancelled by another's failure" in first

    second = run("--root", root)
    assert "20 items: 0 succeeded, 17 reused, 0 failed, 3 refused" in second
    refused = [line.strip() for line in second.splitlines() if "refused: " in line]
    assert refused == [
        "refused: refund-07  [REVIEW_REQUIRED]",
        "refused: refund-13  [REVIEW_REQUIRED]",
        "refused: refund-18  [REVIEW_REQUIRED]",
    ]
    assert "the provider was called 0 time(s)" in second
