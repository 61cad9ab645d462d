"""Notebooks: the blocking face in real Jupyter kernels, run by ``nbclient``.

A kernel runs its cells in a thread that also runs an event loop: the blocking face must
work there, and survive what a notebook user does to a kernel (a kernel killed and
restarted) without a second effect. Each notebook runs in a process of its own
(``tests/_notebook_runner.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nbformat
import pytest

from itemjournal import sync

pytestmark = pytest.mark.slow

RUNNER = Path(__file__).resolve().parent.parent / "_notebook_runner.py"

_OPEN = """\
from itemjournal.sync import Journal
journal = Journal.open({location!r})
"""

_CHARGE = """\
import os, time
item = ("shop", "billing", "charge", "order-7")
with journal.claim(item, {{"amount_cents": 1250}}, "billing-v1") as attempt:
    if attempt.reused:
        print("reused", attempt.receipt)
    else:
        with open({kernel!r}, "w") as kernel:
            kernel.write(str(os.getpid()))
        with open({ledger!r}, "a") as ledger:
            ledger.write(f"order-7 1250 {{attempt.claim.key}}\\n")
            ledger.flush()
            os.fsync(ledger.fileno())
        time.sleep({pause})
        attempt.complete("ch-7")
        print("charged", attempt.receipt)
"""


def _write_notebook(tmp_path: Path, location: str, pause: float) -> Path:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(_OPEN.format(location=location)),
        nbformat.v4.new_code_cell(
            _CHARGE.format(
                kernel=str(tmp_path / "kernel.pid"), ledger=str(tmp_path / "ledger"), pause=pause
            )
        ),
    ]
    path = tmp_path / f"charge-{time.monotonic_ns()}.ipynb"
    nbformat.write(notebook, str(path))
    return path


def _start(notebook: Path) -> tuple[subprocess.Popen[bytes], Path]:
    result = notebook.with_suffix(".json")
    return subprocess.Popen([sys.executable, str(RUNNER), str(notebook), str(result)]), result


def _run(notebook: Path) -> dict[str, Any]:
    process, result = _start(notebook)
    assert process.wait(180) == 0
    return dict(json.loads(result.read_text()))


@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_a_notebook_cell_claims_and_a_second_run_reuses(tmp_path: Path, kind: str) -> None:
    location = str(tmp_path / "journal") if kind == "file" else f"sqlite://{tmp_path}/j.db"
    first = _run(_write_notebook(tmp_path, location, pause=0))
    assert first["error"] is None, first
    assert "charged ch-7" in first["printed"]
    again = _run(_write_notebook(tmp_path, location, pause=0))
    assert again["error"] is None, again
    assert "reused ch-7" in again["printed"]
    assert len((tmp_path / "ledger").read_text().splitlines()) == 1


def test_a_kernel_killed_after_the_effect_never_runs_it_again(tmp_path: Path) -> None:
    """The kernel is SIGKILLed after the effect and before ``complete``; the notebook run
    again in a new kernel: no second effect, and the cell's error names the item and
    what to do about it."""
    location = str(tmp_path / "journal")
    ledger = tmp_path / "ledger"
    process, result = _start(_write_notebook(tmp_path, location, pause=60))
    deadline = time.monotonic() + 120
    while not (ledger.exists() and ledger.read_text().strip()):
        assert time.monotonic() < deadline, "the effect never ran"
        assert process.poll() is None, "the notebook ended before its effect"
        time.sleep(0.05)
    os.kill(int((tmp_path / "kernel.pid").read_text()), signal.SIGKILL)
    assert process.wait(120) == 0
    died = json.loads(result.read_text())
    assert died["error"] is not None and died["error"]["ename"] == "dead", died

    again = _run(_write_notebook(tmp_path, location, pause=0))
    error = again["error"]
    assert error is not None and error["ename"] == "ConflictError", again
    message = error["evalue"]  # the error's own words, not the cell's source
    assert message.startswith("REVIEW_REQUIRED")
    assert "order-7" in message  # the item
    assert "itemjournal resolve" in message  # and a command that settles it
    assert len(ledger.read_text().splitlines()) == 1  # never charged twice
    with sync.Journal.open(location) as journal:
        view = journal.inspect(("shop", "billing", "charge", "order-7"))
    assert view.status == "needs_review"
    assert view.review_reason is not None and "gone" in view.review_reason
