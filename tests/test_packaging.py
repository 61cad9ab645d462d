"""What is shipped: the core needs only anyio, the package carries its typing marker and
templates, and the built sdist and wheel hold what they should (``make dist`` and
``make test-dist`` point ``ITEMJOURNAL_TEST_DIST`` at the files they built)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import textwrap
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from conftest import INSTALLED_VARIABLE, installed_problem

import itemjournal

REPOSITORY = Path(__file__).resolve().parent.parent
PACKAGE = Path(str(itemjournal.__file__)).parent
DIST_VARIABLE = "ITEMJOURNAL_TEST_DIST"
VERSION = itemjournal.__version__

# What the extras bring; the core must import none of it.
EXTRA_MODULES = (
    "click",
    "rich",
    "starlette",
    "uvicorn",
    "jinja2",
    "psycopg",
    "psycopg_pool",
    "opentelemetry",
    "fastapi",
    "httpx",
    "trio",
    "celery",
    "kombu",
    "billiard",
    "redis",
    "flask",
    "django",
    "gunicorn",
    "nbclient",
)


def pyproject() -> dict[str, object]:
    with (REPOSITORY / "pyproject.toml").open("rb") as stream:
        return tomllib.load(stream)


def package_files() -> set[str]:
    """The package's files as the wheel names them (``itemjournal/…``), caches aside."""
    return {
        f"itemjournal/{path.relative_to(PACKAGE).as_posix()}"
        for path in PACKAGE.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


# ------------------------------------------------------------------- the source tree check


def test_the_source_tree_is_told_from_an_installed_copy(tmp_path: Path) -> None:
    source = tmp_path / "repo" / "src"
    site = tmp_path / "venv" / "lib" / "site-packages"
    inside = installed_problem(str(source / "itemjournal" / "__init__.py"), source=source)
    assert inside is not None
    assert "source tree" in inside
    installed = site / "itemjournal" / "__init__.py"
    assert installed_problem(str(installed), source=source, site=site) is None
    elsewhere = installed_problem(str(tmp_path / "x.py"), source=source, site=site)
    assert elsewhere is not None
    assert "outside site-packages" in elsewhere
    assert installed_problem(None) is not None


def test_an_installed_run_imports_the_installed_copy() -> None:
    if os.environ.get(INSTALLED_VARIABLE) != "1":
        assert installed_problem(itemjournal.__file__) is not None  # src/, editable
        pytest.skip(f"{INSTALLED_VARIABLE} is not set: make test-dist runs this part")
    assert installed_problem(itemjournal.__file__) is None
    assert not PACKAGE.is_relative_to(REPOSITORY)


# ------------------------------------------------------------------------ the package


def test_the_package_carries_its_typing_marker_and_templates() -> None:
    assert (PACKAGE / "py.typed").is_file()
    templates = {path.name for path in (PACKAGE / "_viewer_templates").iterdir()}
    assert {"base.html", "index.html", "detail.html", "viewer.css"} <= templates


def test_the_core_needs_only_anyio() -> None:
    requires = metadata.requires("itemjournal") or []
    core = [line for line in requires if "extra ==" not in line]
    assert [re.split(r"[<>=!~ ;\[]", line, maxsplit=1)[0] for line in core] == ["anyio"]
    assert pyproject()["project"]["dependencies"] == core  # type: ignore[index]


def test_the_core_imports_no_extra(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        import anyio
        import itemjournal
        from itemjournal.testing import MemoryStore

        async def main():
            for location in ({str(tmp_path / "files")!r}, "sqlite://{tmp_path}/j.db"):
                async with await itemjournal.Journal.open(location) as journal:
                    claim = await journal.begin(
                        ("s", "p", "j", "i"), {{}}, itemjournal.definition_digest("v1")
                    )
                    await journal.complete(claim, "receipt")
            async with itemjournal.Journal(MemoryStore()) as journal:
                await journal.begin(("s", "p", "j", "i"), {{}}, "0" * 64)

        anyio.run(main)
        print(" ".join(sorted({{name.split(".")[0] for name in sys.modules}})))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    imported = set(done.stdout.split())
    assert "itemjournal" in imported
    assert imported.isdisjoint(EXTRA_MODULES), sorted(imported & set(EXTRA_MODULES))


def test_every_extra_is_named_in_the_readme() -> None:
    extras = pyproject()["project"]["optional-dependencies"]  # type: ignore[index]
    readme = (REPOSITORY / "README.md").read_text(encoding="utf-8")
    install = readme.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    for extra in extras:
        assert f"`{extra}`" in install or f"[{extra}]" in install, extra


def test_the_changelog_keeps_a_changelog() -> None:
    text = (REPOSITORY / "CHANGELOG.md").read_text(encoding="utf-8")
    assert text.startswith("# Changelog\n")
    versions = re.findall(r"^## (.*)$", text, re.MULTILINE)
    assert versions[0] == "[Unreleased]"
    for heading in versions[1:]:
        assert re.fullmatch(r"\[\d+\.\d+\.\d+\] - \d{4}-\d{2}-\d{2}", heading), heading
    kinds = set(re.findall(r"^### (.*)$", text, re.MULTILINE))
    assert kinds <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
    # The newest release named there is the version the package says it is.
    assert versions[1].startswith(f"[{itemjournal.__version__}] - "), versions[1]


def test_the_version_lives_in_one_place() -> None:
    project = pyproject()["project"]
    assert "version" not in project  # type: ignore[operator]
    assert "version" in project["dynamic"]  # type: ignore[index]
    hatch = pyproject()["tool"]["hatch"]["version"]  # type: ignore[index]
    assert hatch == {"path": "src/itemjournal/__init__.py"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION)
    assert metadata.version("itemjournal") == VERSION


# ------------------------------------------------------------------ the built files


def built(suffix: str) -> Path:
    """The one file of the built distribution ending in ``suffix``; skip when none was
    built (``make dist`` and ``make test-dist`` build them and set the variable)."""
    folder = os.environ.get(DIST_VARIABLE)
    if not folder:
        if os.environ.get(INSTALLED_VARIABLE) == "1":
            pytest.fail(f"{INSTALLED_VARIABLE}=1 needs {DIST_VARIABLE}: the folder it built")
        pytest.skip(f"{DIST_VARIABLE} is not set: make dist checks the built files")
    found = sorted(Path(folder).glob(f"itemjournal-*{suffix}"))
    assert len(found) == 1, found
    return found[0]


def test_the_wheel_holds_the_package_and_no_tests() -> None:
    wheel = built("-py3-none-any.whl")
    assert wheel.name == f"itemjournal-{VERSION}-py3-none-any.whl"
    info = f"itemjournal-{VERSION}.dist-info"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        wheel_metadata = archive.read(f"{info}/METADATA").decode()
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    shipped = {name for name in names if not name.startswith(f"{info}/")}
    assert shipped == package_files()
    assert "itemjournal/py.typed" in shipped
    assert "itemjournal/_viewer_templates/base.html" in shipped
    assert not any(name.startswith(("tests/", "itemjournal/tests/")) for name in names)
    assert f"{info}/licenses/LICENSE" in names
    assert f"Version: {VERSION}\n" in wheel_metadata
    assert "License-Expression: MIT\n" in wheel_metadata
    assert "Requires-Dist: anyio" in wheel_metadata
    assert "itemjournal = itemjournal._operator.cli.app:main" in entry_points


def test_the_sdist_holds_sources_tests_and_documents() -> None:
    sdist = built(".tar.gz")
    assert sdist.name == f"itemjournal-{VERSION}.tar.gz"
    top = f"itemjournal-{VERSION}"
    with tarfile.open(sdist) as archive:
        names = {name.removeprefix(f"{top}/") for name in archive.getnames()}
    for needed in (
        "PKG-INFO",
        "pyproject.toml",
        "README.md",
        "CHANGELOG.md",
        "LICENSE",
        "mkdocs.yml",
        "src/itemjournal/__init__.py",
        "src/itemjournal/py.typed",
        "src/itemjournal/_viewer_templates/base.html",
        "tests/conftest.py",
        "tests/typing/user_code.py",
        "examples/demo.py",
        "docs/durability.md",
    ):
        assert needed in names, needed
    for path in names:
        assert not path.startswith((".ci/", "benchmarks/", "site/", "dist/", ".venv/")), path
        assert "__pycache__" not in path, path
