"""Every Python block of README.md and docs/*.md type-checks under ``mypy --strict`` and
pyright, as a user's code would.

A block is checked as the body of an ``async def`` (it may ``await`` and ``return`` at its
top level), after ``import anyio``, ``import itemjournal``, ``from itemjournal import *``
and the stand-ins for the application around it in ``tests/typing/docs_names.py``. Each
block is its own case; both checkers run once, over all of them.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
NAMES = ROOT / "tests" / "typing" / "docs_names.py"
BIN = Path(sys.executable).parent
# A fence that opens a Python block, at any indent (a block inside a list item), and the
# fence that closes it at the same indent.
OPENING = re.compile(r"^(?P<indent>[ ]*)```python[ ]*$")
HEADER = """\
from __future__ import annotations

import anyio
import itemjournal
from itemjournal import *
from docs_names import *


async def _block() -> object:
"""


@dataclass(frozen=True)
class Block:
    source: str  # README.md:55, the line of its opening fence
    code: str

    @property
    def module(self) -> str:
        return "block_" + re.sub(r"\W", "_", self.source)


def python_blocks(path: Path) -> list[Block]:
    blocks: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    number = 0
    while number < len(lines):
        opening = OPENING.match(lines[number])
        number += 1
        if opening is None:
            continue
        start, indent = number, opening["indent"]
        while lines[number] != f"{indent}```":
            number += 1
        code = textwrap.dedent("\n".join(lines[start:number]))
        blocks.append(Block(f"{path.relative_to(ROOT)}:{start}", code))
    return blocks


BLOCKS = [
    block
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for block in python_blocks(path)
]


def test_the_docs_have_python_blocks() -> None:
    assert len(BLOCKS) >= 15
    assert any(block.source.startswith("docs/") for block in BLOCKS)


@pytest.fixture(scope="module")
def problems(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """What each checker says, by block module: both run once, over every block."""
    folder = tmp_path_factory.mktemp("docs-blocks")
    shutil.copy(NAMES, folder / NAMES.name)
    files = []
    for block in BLOCKS:
        body = textwrap.indent(block.code, "    ", lambda line: True) + "\n    return None\n"
        (folder / f"{block.module}.py").write_text(HEADER + body, encoding="utf-8")
        files.append(f"{block.module}.py")
    found: dict[str, list[str]] = {block.module: [] for block in BLOCKS}
    found[NAMES.stem] = []
    mypy = subprocess.run(
        [BIN / "mypy", "--strict", "--no-color-output", "--cache-dir", ".mypy_cache", *files],
        cwd=folder,
        capture_output=True,
        text=True,
        check=False,
    )
    for line in mypy.stdout.splitlines():
        where, _, message = line.partition(": ")
        module = Path(where.split(":")[0]).stem
        if module in found and not message.startswith("note"):
            found[module].append(f"mypy: {line}")
    assert mypy.returncode in (0, 1), mypy.stdout + mypy.stderr
    pyright = subprocess.run(
        [BIN / "pyright", "--outputjson", "--pythonpath", sys.executable, *files],
        cwd=folder,
        capture_output=True,
        text=True,
        check=False,
    )
    report = json.loads(pyright.stdout)
    for diagnostic in report["generalDiagnostics"]:
        if diagnostic["severity"] != "error":
            continue
        module = Path(diagnostic["file"]).stem
        line = diagnostic["range"]["start"]["line"] + 1
        found.setdefault(module, []).append(f"pyright: {line}: {diagnostic['message']}")
    return found


def test_the_names_the_docs_assume_check(problems: dict[str, list[str]]) -> None:
    assert problems[NAMES.stem] == []


@pytest.mark.parametrize("block", BLOCKS, ids=[block.source for block in BLOCKS])
def test_a_python_block_type_checks(block: Block, problems: dict[str, list[str]]) -> None:
    lines = HEADER.count("\n")
    assert problems[block.module] == [], (
        f"{block.source} (its line n is line n + {lines} of the module checked):\n"
        + "\n".join(problems[block.module])
    )
