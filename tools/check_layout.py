"""Check the layout of the package: rooms of one topic, no import circles, public names only.

Run by ``make lint`` on the real tree; ``tests/test_layout.py`` runs it on trees of its own.
What it checks, each violation printed on a line of its own (exit status 1 if any):

* every module of the package has at most ``MAX_MODULE_LINES`` lines, and every class (a
  nested one too) at most ``MAX_CLASS_LINES``;
* no import circle among the package's modules, counting every import the AST holds: at
  module level, under ``if TYPE_CHECKING:`` and inside functions (a type-only circle is still
  a circle a reader must hold in mind); relative imports are resolved; each circle is
  reported once, as one path through it;
* ``benchmarks/`` and ``examples/`` import no private name: neither ``import pkg._x`` nor
  ``from pkg._x import ...`` nor ``from pkg import _x``.

Usage: ``python tools/check_layout.py [--package DIR] [--public DIR ...]``; by default the
package is ``src/itemjournal`` and the public code ``benchmarks`` and ``examples``, beside
this folder.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

MAX_MODULE_LINES = 520
MAX_CLASS_LINES = 360

_REPOSITORY = Path(__file__).resolve().parent.parent


def module_name(package: Path, path: Path) -> str:
    """The dotted name of ``path``, a file of the package rooted at ``package``."""
    parts = [package.name, *path.relative_to(package).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules_of(package: Path) -> dict[str, Path]:
    return {module_name(package, path): path for path in sorted(package.rglob("*.py"))}


def size_violations(modules: dict[str, Path]) -> Iterator[str]:
    for name, path in modules.items():
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            yield f"{path}: module {name} has {lines} lines (at most {MAX_MODULE_LINES})"
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ClassDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_CLASS_LINES:
                    yield (
                        f"{path}:{node.lineno}: class {node.name} has {length} lines "
                        f"(at most {MAX_CLASS_LINES})"
                    )


def imported_modules(name: str, path: Path, known: Iterable[str]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its file."""
    known = set(known)
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = here.split(".")
                if node.level > 1:
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts)
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            found.add(source)
            # ``from pkg import sub`` imports the module ``pkg.sub`` when there is one.
            found.update(f"{source}.{alias.name}" for alias in node.names)
    # A package's own ``from . import x`` names the package too: that is no circle.
    return {target for target in found if target in known and target != name}


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One path around each group of modules that import one another (Tarjan's components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_path_around(graph, component) for component in sorted(components)]


def _path_around(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest circle from the component's first module back to it, within the component."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for target in sorted(graph[node] & members):
                if target == start:
                    back = [node]  # from the last module before the start, back to it
                    while back[-1] != start:
                        back.append(previous[back[-1]])
                    return [*reversed(back), start]
                if target not in previous:
                    previous[target] = node
                    following.append(target)
        frontier = following
    return [*component, start]  # unreachable for a real component; kept total


def private_imports(package_name: str, folders: Iterable[Path]) -> Iterator[str]:
    private = package_name + "._"
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names if alias.name.startswith(private)]
                elif not node.level and node.module:
                    if node.module.startswith(private):
                        names = [node.module]
                    elif node.module == package_name:
                        names = [
                            f"{package_name}.{alias.name}"
                            for alias in node.names
                            if alias.name.startswith("_")
                        ]
                for name in names:
                    yield f"{path}:{node.lineno}: imports the private {name}"


def violations(package: Path, public: Iterable[Path]) -> list[str]:
    modules = modules_of(package)
    found = list(size_violations(modules))
    found.extend(
        "import circle: " + " -> ".join(circle) for circle in circles(import_graph(modules))
    )
    found.extend(private_imports(package.name, public))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--package", type=Path, default=_REPOSITORY / "src" / "itemjournal")
    parser.add_argument(
        "--public",
        type=Path,
        nargs="*",
        default=[_REPOSITORY / "benchmarks", _REPOSITORY / "examples"],
    )
    args = parser.parse_args(argv)
    found = violations(args.package, args.public)
    for line in found:
        print(line)
    if found:
        print(f"layout: {len(found)} violation(s)", file=sys.stderr)
        return 1
    print(f"layout: {args.package} and its public users are in order")
    return 0


if __name__ == "__main__":
    sys.exit(main())
