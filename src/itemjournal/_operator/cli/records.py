"""The commands that read records: ``list``, ``counts`` and ``export`` (``show`` has a
module of its own).

None of them changes the journal. ``export`` and ``list --json`` stream in key order
(``list --sort`` reads every record first, then sorts) and go on past a record that
cannot be read (one ``problem:`` line on stderr, exit 1)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import click
from rich import box
from rich.table import Table
from rich.text import Text

from ..._journal.journal import Journal
from ..._model.records import STATUSES
from ..._model.view import RecordView
from . import listing
from .errors import EXIT_OK, EXIT_PROBLEMS
from .options import _filter_options, _journal_options, _run, _settings
from .progress import _metered, _Stream
from .render import (
    _dumps,
    _event_json,
    _full_json,
    _out_console,
    _status_text,
    _view_json,
    _write,
)

# -------------------------------------------------------------------------------- list

_SORTS = ("updated", "created", "key")


def _sort_key(sort: str) -> Callable[[RecordView], tuple[str, str]]:
    if sort == "updated":
        return lambda view: (view.updated_at or "", view.key)
    if sort == "created":
        return lambda view: (view.created_at or "", view.key)
    return lambda view: ("", view.key)


def _list_json(view: RecordView, history: bool) -> str:
    shape = _view_json(view)
    if history:
        shape["history"] = [_event_json(event) for event in view.history]
    return _dumps(shape)


@click.command("list")
@_filter_options
@click.option(
    "--sort",
    type=click.Choice(_SORTS),
    default=None,
    help="The order: by last change (the table's default: oldest first, the newest next to "
    "the prompt), by creation, or by key (--json's default: streamed as read).",
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Show at most N records.")
@click.option(
    "--wide",
    is_flag=True,
    help="Every label and the key whole, each label in its own column, however wide the "
    "table gets (as it is written to a pipe).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON view per line.")
@click.option("--history", is_flag=True, help="With --json: each view with its history.")
@_journal_options
@click.pass_context
def list_command(
    ctx: click.Context,
    *,
    status: str | None,
    scope: str | None,
    program: str | None,
    job: str | None,
    sort: str | None,
    limit: int | None,
    wide: bool,
    as_json: bool,
    history: bool,
    location: str | None,
    input_key_file: str | None,
    trust_shared_root: bool,
) -> int:
    """List records, with filters, as a table that fits the terminal (or --json).

    On a terminal, long labels are shortened in the middle (start…end) to fit; the KEY
    column is the start of each record's key, which show takes to find it (show KEY).
    --wide, or a pipe, shows everything whole.
    """
    if history and not as_json:
        raise click.UsageError("--history goes with --json (show S P J I has the history)", ctx)
    settings = _settings(ctx, location, input_key_file, trust_shared_root)
    filtered = any(value is not None for value in (scope, program, job))
    order = sort or ("key" if as_json else "updated")
    streamed = order == "key"  # key order is the order the journal reads records in

    async def body(journal: Journal) -> tuple[list[RecordView], int, bool]:
        stream = _Stream()
        kept: list[RecordView] = []
        cut = False
        async with (
            _metered(
                journal, "listing", status, filtered=filtered, limit=limit if streamed else None
            ) as tick,
            contextlib.aclosing(
                journal.records(status, scope=scope, program=program, job=job, problems=True)
            ) as items,
        ):
            async for item in items:
                if isinstance(item, RecordView):
                    if streamed and limit is not None and len(kept) >= limit:
                        cut = True
                        break
                    if streamed and as_json:
                        stream.lines.append(_list_json(item, history))
                    kept.append(item)
                else:
                    stream.problem(item)
                tick()
                await stream.maybe_flush()
        if not streamed:
            kept.sort(key=_sort_key(order))
            if limit is not None and len(kept) > limit:
                kept, cut = kept[:limit], True
            if as_json:
                stream.lines.extend(_list_json(view, history) for view in kept)
        await stream.flush()
        return kept, stream.problem_count, cut

    views, problems, cut = _run(settings, body)
    if not as_json:
        console = _out_console()
        if views:
            rows = [listing.row(view) for view in views]
            if wide or not console.terminal:
                table, needed = listing.wide(rows)
                console.print(table, width=needed)
            else:
                console.print(listing.fitted(rows, console.width))
        noun = "record" if len(views) == 1 else "records"
        more = f" (--limit {limit} reached; more match)" if cut else ""
        console.print(Text(f"{len(views)} {noun}{more}"))
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
                journal.records(status, scope=scope, program=program, job=job, problems=True)
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
