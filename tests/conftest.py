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


JournalFactory = Callable[..., Awaitable[Journal]]


@pytest.fixture
async def make_journal(root: Path) -> AsyncIterator[JournalFactory]:
    """Open journals over the test's location; all are closed at the end."""
    opened: list[Journal] = []

    async def factory(**options: object) -> Journal:
        journal = await Journal.open(str(root), **options)  # type: ignore[arg-type]
        opened.append(journal)
        return journal

    yield factory
    for journal in opened:
        await journal.aclose()


@pytest.fixture
async def journal(make_journal: JournalFactory) -> Journal:
    return await make_journal()
