"""The docs site is the manual: a guide for every home, an API page for every public
module, the extras complete, and the README a front door that links them."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAV_ENTRY = re.compile(r"^\s+- (?P<title>[^:]+): (?P<page>\S+\.md)\s*$", re.MULTILINE)
# Where user code lives, and the guide each must have (the README's table links them).
HOMES = {
    "synchronous code": "sync.md",
    "worker loops and task groups": "workers.md",
    "web apps (ASGI)": "web.md",
    "WSGI apps": "wsgi.md",
    "message brokers (RabbitMQ, NATS)": "brokers.md",
    "Celery tasks": "celery.md",
    "agent tools (MCP)": "agents.md",
    "notebooks": "notebooks.md",
    "unit tests": "testing.md",
}
# Extras for work on itemjournal itself, not for its users.
DEVELOPMENT_EXTRAS = {"test", "lint", "dist", "docs", "bench", "peers"}


def nav() -> dict[str, str]:
    """Page → title, from mkdocs.yml's navigation."""
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    section = text.split("\nnav:\n", 1)[1].split("\n\n", 1)[0]
    return {m["page"]: m["title"] for m in NAV_ENTRY.finditer(section)}


def public_modules() -> list[str]:
    package = ROOT / "src" / "itemjournal"
    names = [p.stem for p in package.glob("*.py") if not p.stem.startswith("_")]
    return ["itemjournal", *(f"itemjournal.{name}" for name in sorted(names))]


def section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def extras_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(r"^\| `[a-z]+` \|", line)]


def test_every_page_of_docs_is_in_the_navigation_and_exists() -> None:
    pages = nav()
    docs = ROOT / "docs"
    written = {str(p.relative_to(docs)) for p in docs.rglob("*.md") if "_ext" not in p.parts}
    assert set(pages) == written


def test_every_home_has_a_guide_in_the_navigation_linked_from_the_readme() -> None:
    pages = nav()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = section(readme, "Where it runs")
    for home, page in HOMES.items():
        assert page in pages, home
        assert f"(docs/{page})" in table, f"the README's table does not link {page} ({home})"
        guide = (ROOT / "docs" / page).read_text(encoding="utf-8")
        assert guide.startswith("# ") and len(guide.splitlines()) > 30, f"{page} is a stub"


def test_every_public_module_has_an_api_page() -> None:
    pages = nav()
    for module in public_modules():
        page = f"reference/{module.removeprefix('itemjournal.') if '.' in module else module}.md"
        assert page in pages, module
        assert pages[page] == module
        text = (ROOT / "docs" / page).read_text(encoding="utf-8")
        assert f"::: {module}\n" in text, page


def test_the_extras_table_is_complete_and_one_in_the_readme_and_the_site() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    for_users = set(project["optional-dependencies"]) - DEVELOPMENT_EXTRAS
    readme = extras_rows(section((ROOT / "README.md").read_text(encoding="utf-8"), "Install"))
    site = extras_rows((ROOT / "docs" / "index.md").read_text(encoding="utf-8"))
    assert readme == site
    assert {row.split("`")[1] for row in readme} == for_users


def test_the_readme_is_a_front_door() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 400
    quick_start = section(readme, "Quick start")
    assert "pip install" in quick_start and "make demo" in quick_start
    assert "make test" in quick_start
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), link
