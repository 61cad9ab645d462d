"""Notebooks: the blocking face in real Jupyter kernels, run by ``nbclient``.

A kernel runs its cells in a thread that also runs an event loop: the blocking face must
work there, and survive what a notebook user does to a kernel (the Stop button, a kernel
killed and restarted) without a second effect.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, DeadKernelError

from itemjournal import sync

pytestmark = [
    pytest.mark.slow,
    # jupyter_client leaves its own event loop and sockets for the garbage collector.
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

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
        with open({ledger!r}, "a") as ledger:
            ledger.write(f"order-7 1250 {{attempt.claim.key}}\\n")
            ledger.flush()
            os.fsync(ledger.fileno())
        time.sleep({pause})
        attempt.complete("ch-7")
        print("charged", attempt.receipt)
"""


def _notebook(location: str, ledger: Path, pause: float) -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(_OPEN.format(location=location)),
        nbformat.v4.new_code_cell(_CHARGE.format(ledger=str(ledger), pause=pause)),
    ]
    return notebook


def _outputs(notebook: nbformat.NotebookNode) -> str:
    return "".join(
        output.get("text", "") for cell in notebook.cells for output in cell.get("outputs", [])
    )


def _client(notebook: nbformat.NotebookNode, tmp_path: Path) -> NotebookClient:
    return NotebookClient(
        notebook,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )


@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_a_notebook_cell_claims_and_a_second_run_reuses(tmp_path: Path, kind: str) -> None:
    location = str(tmp_path / "journal") if kind == "file" else f"sqlite://{tmp_path}/j.db"
    ledger = tmp_path / "ledger"
    first = _notebook(location, ledger, pause=0)
    _client(first, tmp_path).execute()
    assert "charged ch-7" in _outputs(first)
    again = _notebook(location, ledger, pause=0)
    _client(again, tmp_path).execute()
    assert "reused ch-7" in _outputs(again)
    assert len(ledger.read_text().splitlines()) == 1


def test_a_kernel_killed_after_the_effect_never_runs_it_again(tmp_path: Path) -> None:
    """The kernel is SIGKILLed after the effect and before ``complete``; restarted, the
    notebook run again: no second effect, and the cell's error names the item and what to
    do about it."""
    location = str(tmp_path / "journal")
    ledger = tmp_path / "ledger"
    first = _notebook(location, ledger, pause=60)
    client = _client(first, tmp_path)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            client.execute()
        except BaseException as error:  # the kernel's death, which the test causes
            errors.append(error)

    runner = threading.Thread(target=run)
    runner.start()
    deadline = time.monotonic() + 120
    while not (ledger.exists() and ledger.read_text().strip()):
        assert time.monotonic() < deadline, "the effect never ran"
        time.sleep(0.05)
    manager = client.km
    assert manager is not None
    pid = manager.provisioner.pid if manager.provisioner is not None else None  # type: ignore[attr-defined]
    assert isinstance(pid, int)
    os.kill(pid, signal.SIGKILL)
    runner.join(60)
    assert not runner.is_alive()
    assert errors and isinstance(errors[0], (DeadKernelError, CellExecutionError, RuntimeError))

    again = _notebook(location, ledger, pause=0)
    with pytest.raises(CellExecutionError) as refused:
        _client(again, tmp_path).execute()
    assert refused.value.ename == "ConflictError"
    message = refused.value.evalue  # the error's own words, not the cell's source
    assert message.startswith("REVIEW_REQUIRED")
    assert "order-7" in message  # the item
    assert "itemjournal resolve" in message  # and a command that settles it
    assert len(ledger.read_text().splitlines()) == 1  # never charged twice
    with sync.Journal.open(location) as journal:
        view = journal.inspect(("shop", "billing", "charge", "order-7"))
    assert view.status == "needs_review"
    assert view.review_reason is not None and "gone" in view.review_reason
