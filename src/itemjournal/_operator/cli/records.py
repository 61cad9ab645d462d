"""The commands that read records: ``list``, ``show``, ``counts`` and ``export``.

None of them changes the journal. ``list`` and ``export`` stream in key order and go on
past a record that cannot be read (one ``problem:`` line on stderr, exit 1)."""

from __future__ import annotations

import contextlib

import click
from rich import box
from rich.table import Table
from rich.text import Text

from ..._journal.journal import Journal
from ..._model.records import STATUSES
from ..._model.view import RecordView
from .errors import EXIT_OK, EXIT_PROBLEMS
from .options import _filter_options, _journal_options, _run, _settings
from .progress import _metered, _Stream
from .render import (
    _dumps,
    _full_json,
    _out_console,
    _row,
    _status_text,
    _table,
    _view_json,
    _write,
)

# -------------------------------------------------------------------------------- list


@click.command("list")
@_filter_options
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Show at most N records.")
@click.option("--json", "as_json", is_flag=True, help="One JSON view per line.")
@_journal_options
@click.pass_context
def list_command(
    ctx: click.Context,
    *,
    status: str | None,
    scope: str | None,
    program: str | None,
    job: str | None,
    limit: int | None,
    as_json: bool,
    location: str | None,
    input_key_file: str | None,
    trust_shared_root: bool,
) -> int:
    """List records in key order, with filters."""
    settings = _settings(ctx, location, input_key_file, trust_shared_root)
    filtered = any(value is not None for value in (scope, program, job))

    async def body(journal: Journal) -> tuple[list[tuple[Text, ...]], int, bool]:
        stream = _Stream()
        rows: list[tuple[Text, ...]] = []
        shown = 0
        cut = False
        async with (
            _metered(journal, "listing", status, filtered=filtered, limit=limit) as tick,
            contextlib.aclosing(
                journal.records(status, scope=scope, program=program, job=job)
            ) as items,
        ):
            async for item in items:
                if isinstance(item, RecordView):
                    if limit is not None and shown >= limit:
                        cut = True
                        break
                    shown += 1
                    if as_json:
                        stream.lines.append(_dumps(_view_json(item)))
                    else:
                        rows.append(_row(item))
                else:
                    stream.problem(item)
                tick()
                await stream.maybe_flush()
        await stream.flush()
        return rows, stream.problem_count, cut

    rows, problems, cut = _run(settings, body)
    if not as_json:
        console = _out_console()
        if rows:
            console.print(_table(rows))
        noun = "record" if len(rows) == 1 else "records"
        more = f" (--limit {limit} reached; more match)" if cut else ""
        console.print(Text(f"{len(rows)} {noun}{more}"))
    return EXIT_PROBLEMS if problems else EXIT_OK


# ------------------------------------------------------------------------------ counts


@click.command("counts")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@_journal_options
@click.pass_context
def counts_command(
    ctx: click.Context,
    *,
    as_json: bool,
    location: str | None,
    input_key_file: str | None,
    trust_shared_root: bool,
) -> int:
    """Count records per status (and those that cannot be read)."""
    settings = _settings(ctx, location, input_key_file, trust_shared_root)

    async def body(journal: Journal) -> dict[str, int]:
        return await journal.counts()

    counts = _run(settings, body)
    shape = {name: counts.get(name, 0) for name in (*STATUSES, "invalid")}
    shape["total"] = sum(shape.values())
    if as_json:
        _write([_dumps(shape)])
    else:
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
        table.add_column("STATUS")
        table.add_column("RECORDS", justify="right")
        for name, number in shape.items():
            label = Text(name, style="bold") if name == "total" else _status_text(name)
            if name == "invalid" and number:
                label = Text(name, style="bold red")
            table.add_row(label, Text(str(number)))
        _out_console().print(table)
    return EXIT_OK


# ------------------------------------------------------------------------------ export


@click.command("export")
@_filter_options
@click.option("--no-results", is_flag=True, default=False, help="Leave stored results out (null).")
@_journal_options
@click.pass_context
def export_command(
    ctx: click.Context,
    *,
    status: str | None,
    scope: str | None,
    program: str | None,
    job: str | None,
    no_results: bool,
    location: str | None,
    input_key_file: str | None,
    trust_shared_root: bool,
) -> int:
    """Write every record as a JSON full view, one per line, in key order."""
    settings = _settings(ctx, location, input_key_file, trust_shared_root)
    filtered = any(value is not None for value in (scope, program, job))

    async def body(journal: Journal) -> int:
        stream = _Stream()
        async with (
            _metered(journal, "exporting", status, filtered=filtered) as tick,
            contextlib.aclosing(
                journal.records(status, scope=scope, program=program, job=job)
            ) as items,
        ):
            async for item in items:
                if isinstance(item, RecordView):
                    stream.lines.append(_dumps(_full_json(item, with_result=not no_results)))
                else:
                    stream.problem(item)
                tick()
                await stream.maybe_flush()
        await stream.flush()
        return stream.problem_count

    problems = _run(settings, body)
    return EXIT_PROBLEMS if problems else EXIT_OK
