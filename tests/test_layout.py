"""``tools/check_layout.py`` on small trees of its own: each kind of violation is reported.

The real tree is checked by ``make lint``; here the script must find what it is for (a
module too long, a class too long, an import circle however the import is written, a
private import from public code) and pass a tree that has none of it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "check_layout.py"

pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="tools/ is not in this tree")


def _limits() -> tuple[int, int]:
    namespace: dict[str, object] = {}
    source = SCRIPT.read_text(encoding="utf-8")
    for line in source.splitlines():
        if line.startswith(("MAX_MODULE_LINES =", "MAX_CLASS_LINES =")):
            exec(line, namespace)
    module, klass = namespace["MAX_MODULE_LINES"], namespace["MAX_CLASS_LINES"]
    assert isinstance(module, int) and isinstance(klass, int)
    return module, klass


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def _check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--package",
            str(root / "src" / "itemjournal"),
            "--public",
            str(root / "benchmarks"),
            str(root / "examples"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )


def _clean_tree(root: Path) -> None:
    _write(
        root,
        {
            "src/itemjournal/__init__.py": "from ._model.base import Base\n",
            "src/itemjournal/_model/__init__.py": "",
            "src/itemjournal/_model/base.py": "class Base:\n    pass\n",
            "src/itemjournal/_journal/__init__.py": "",
            "src/itemjournal/_journal/journal.py": "from .._model.base import Base\n",
            "benchmarks/bench.py": "import itemjournal\nfrom itemjournal import Base\n",
            "examples/demo.py": "from itemjournal.testing import MemoryStore\n",
        },
    )


def test_a_tree_in_order_passes(tmp_path: Path) -> None:
    _clean_tree(tmp_path)
    checked = _check(tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.strip().endswith("are in order")


def test_each_violation_is_reported(tmp_path: Path) -> None:
    _clean_tree(tmp_path)
    module_limit, class_limit = _limits()
    long_class = "class Big:\n" + "    x = 1\n" * class_limit
    _write(
        tmp_path,
        {
            "src/itemjournal/_model/long.py": "x = 1\n" * (module_limit + 1),
            "src/itemjournal/_model/shapes.py": "class Small:\n    pass\n\n\n" + long_class,
            # A circle through a relative import, a type-only one and one in a function.
            "src/itemjournal/_journal/a.py": "from . import b\n",
            "src/itemjournal/_journal/b.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from ..operator import c\n"
            ),
            "src/itemjournal/operator.py": (
                "def later():\n    from itemjournal._journal.a import name\n    return name\n"
            ),
            # Not a circle: a package importing its own module.
            "src/itemjournal/_stores/__init__.py": "from . import seam\n",
            "src/itemjournal/_stores/seam.py": "import itemjournal._model.base\n",
            "benchmarks/seed.py": "from itemjournal._model.records import encode_record\n",
            "benchmarks/deep.py": "import itemjournal._stores.seam as seam\n",
            "examples/private.py": "from itemjournal import Base, _check_platform\n",
        },
    )
    checked = _check(tmp_path)
    assert checked.returncode == 1
    lines = checked.stdout.splitlines()
    report = "\n".join(lines)
    assert any(
        f"module itemjournal._model.long has {module_limit + 1} lines" in line for line in lines
    ), report
    assert any(f"shapes.py:5: class Big has {class_limit + 1} lines" in line for line in lines), (
        report
    )
    assert not any("Small" in line for line in lines), report
    # The c in "from ..operator import c" is no module: the edge goes to operator itself.
    assert (
        "import circle: itemjournal._journal.a -> itemjournal._journal.b -> "
        "itemjournal.operator -> itemjournal._journal.a"
    ) in lines, report
    assert sum(line.startswith("import circle") for line in lines) == 1, report
    assert any(
        line.endswith("seed.py:1: imports the private itemjournal._model.records") for line in lines
    ), report
    assert any(
        line.endswith("deep.py:1: imports the private itemjournal._stores.seam") for line in lines
    ), report
    assert any(
        line.endswith("private.py:1: imports the private itemjournal._check_platform")
        for line in lines
    ), report
    assert len(lines) == 6, report
    assert "6 violation(s)" in checked.stderr
