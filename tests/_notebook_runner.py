"""Run a notebook with nbclient in a process of its own, for tests/homes/test_notebooks.py.

``python _notebook_runner.py NOTEBOOK RESULT``: executes the notebook's cells in a fresh
Python 3 kernel and writes, as JSON to RESULT, the text the cells printed and the error
that stopped it (``ename``/``evalue`` of a cell's exception, or ``dead`` when the kernel
died). Kept out of the test's own process: jupyter_client leaves event loops and sockets
for the garbage collector, which would be reported in whatever test ran next.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, DeadKernelError


def main(notebook_path: str, result_path: str) -> None:
    notebook = nbformat.read(notebook_path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(Path(notebook_path).parent)}},
    )
    error: dict[str, str] | None = None
    try:
        client.execute()
    except CellExecutionError as failed:
        error = {"ename": failed.ename, "evalue": failed.evalue}
    except DeadKernelError as dead:
        error = {"ename": "dead", "evalue": str(dead)}
    printed = "".join(
        output.get("text", "") for cell in notebook.cells for output in cell.get("outputs", [])
    )
    Path(result_path).write_text(json.dumps({"printed": printed, "error": error}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
