"""Long scans on a terminal: a progress bar on stderr, and output streamed in batches.

The bar shows only when stderr is a terminal and the journal holds more records than
``PROGRESS_THRESHOLD`` (a reconcile shows one for any number: each check asks a
provider). Lines go to stdout in worker threads, ``_FLUSH_EVERY`` at a time, so the
event loop never waits on a slow pipe."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable

import anyio
import anyio.to_thread
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..._journal.journal import Journal
from ..._model.errors import JournalError
from ..._model.view import RecordView
from .render import _problem_text, _stderr, _write

PROGRESS_THRESHOLD = 1000  # records: shorter scans finish before a bar would help
_FLUSH_EVERY = 256  # lines written per worker-thread trip while streaming


def _err_console() -> Console:
    return Console(stderr=True)


class _Stream:
    """Lines for stdout and problems for stderr, written in worker threads in batches, so
    the event loop never waits on a slow pipe."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.problems: list[str] = []
        self.problem_count = 0

    def problem(self, problem: JournalError) -> None:
        self.problem_count += 1
        self.problems.append(f"problem: {_problem_text(problem)}")

    async def maybe_flush(self) -> None:
        if len(self.lines) + len(self.problems) >= _FLUSH_EVERY:
            await self.flush()

    async def flush(self) -> None:
        lines, problems = self.lines, self.problems
        self.lines, self.problems = [], []
        if lines or problems:
            await anyio.to_thread.run_sync(functools.partial(_emit, lines, problems))


def _emit(lines: list[str], problems: list[str]) -> None:
    for line in problems:
        _stderr(line)
    _write(lines)


class _Meter:
    """A progress bar on stderr for long scans on a terminal; nothing otherwise."""

    def __init__(self, what: str, total: int | None) -> None:
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=_err_console(),
            transient=True,
            # stdout is the command's data: never sent to the terminal the bar is on.
            redirect_stdout=False,
        )
        self.task = self.progress.add_task(what, total=total)

    def advance(self) -> None:
        self.progress.advance(self.task)


@contextlib.asynccontextmanager
async def _metered(
    journal: Journal, what: str, status: str | None, *, filtered: bool, limit: int | None = None
) -> AsyncIterator[Callable[[], None]]:
    """Yield a function to call once per record scanned; it drives a bar only when stderr
    is a terminal and the journal holds more than ``PROGRESS_THRESHOLD`` such records (the
    count is asked for first, so only then)."""
    if not _err_console().is_terminal or (limit is not None and limit <= PROGRESS_THRESHOLD):
        yield lambda: None
        return
    counts = await journal.counts()
    expected = counts[status] if status is not None else sum(counts.values())
    if expected <= PROGRESS_THRESHOLD:
        yield lambda: None
        return
    total = None if filtered else (expected if limit is None else min(expected, limit))
    meter = _Meter(what, total)
    await anyio.to_thread.run_sync(meter.progress.start)
    try:
        yield meter.advance
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(meter.progress.stop)


@contextlib.asynccontextmanager
async def _checks_meter(
    journal: Journal, *, shown: bool, filtered: bool
) -> AsyncIterator[Callable[[RecordView], None]]:
    """Yield a function to call once per record settled; on a terminal it drives a bar
    (checks ask a provider, so even a few are worth one)."""
    if not shown or not _err_console().is_terminal:
        yield lambda view: None
        return
    total = None if filtered else (await journal.counts())["needs_review"]
    meter = _Meter("reconciling", total)
    await anyio.to_thread.run_sync(meter.progress.start)
    try:
        yield lambda view: meter.advance()
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(meter.progress.stop)
