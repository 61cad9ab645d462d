"""Shared fixtures: every async test runs on asyncio and on trio; on asyncio a
blocking-call detector fails any test in which itemjournal touches the disk from
the event loop thread."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from blockbuster import BlockBuster, BlockBusterFunction, blockbuster_ctx

from itemjournal import Journal

# Calls blockbuster does not watch by itself but that a store makes on every save.
_EXTRA_BLOCKING = ("open", "fsync", "fdatasync", "fstat", "lstat", "makedirs")


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(autouse=True)
def blockbuster() -> Iterator[BlockBuster]:
    """Active in every test; it only fires inside a running asyncio loop."""
    with blockbuster_ctx("itemjournal") as detector:
        for name in _EXTRA_BLOCKING:
            function = BlockBusterFunction(
                os,
                name,
                scanned_modules="itemjournal",
                # coverage's tracer looks up each new source file on the loop thread
                can_block_functions=[("coverage/control.py", {"_should_trace"})],
            )
            detector.functions[f"os.{name}"] = function
            function.activate()
        yield detector


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """An absolute directory for one file journal (not yet created)."""
    return tmp_path / "journal"


STORE_KINDS = ("file", "sqlite")


@pytest.fixture(params=STORE_KINDS)
def store_kind(request: pytest.FixtureRequest) -> str:
    """Which store the conformance tests run on (every test using ``journal``)."""
    return str(request.param)


@pytest.fixture
def location(store_kind: str, root: Path) -> str:
    """The ``Journal.open`` location of the test's journal, for the store under test."""
    if store_kind == "sqlite":
        return f"sqlite://{root}/journal.db"
    return str(root)


@pytest.fixture
def file_only(store_kind: str) -> None:
    """Skip (for the other stores) a test about the file store's on-disk layout."""
    if store_kind != "file":
        pytest.skip("about the file store's files")


JournalFactory = Callable[..., Awaitable[Journal]]


@pytest.fixture
async def make_journal(location: str) -> AsyncIterator[JournalFactory]:
    """Open journals over the test's location; all are closed at the end."""
    opened: list[Journal] = []

    async def factory(**options: object) -> Journal:
        journal = await Journal.open(location, **options)  # type: ignore[arg-type]
        opened.append(journal)
        return journal

    yield factory
    for journal in opened:
        await journal.aclose()


@pytest.fixture
async def journal(make_journal: JournalFactory) -> Journal:
    return await make_journal()


# Figures: tests that measure something (crash states, injected faults, races, commits)
# print one line each; those lines are gathered here and shown at the end of every run.
_FIGURES: list[tuple[str, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.passed and report.capstdout.strip():
        _FIGURES.append((report.nodeid, report.capstdout.strip()))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _FIGURES:
        return
    terminalreporter.section("figures measured by the tests")
    for nodeid, text in _FIGURES:
        terminalreporter.write_line(nodeid)
        for line in text.splitlines():
            if line.strip():
                terminalreporter.write_line(f"    {line.strip()}")
