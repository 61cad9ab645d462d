"""The maintenance commands: ``sweep`` (mark records whose owner is gone needs_review),
``verify`` (check every record and the store) and ``prune`` (remove old settled records)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import click

from ..._journal.journal import Journal
from ..._model.view import PruneReport, SweepReport
from .errors import EXIT_OK, EXIT_PROBLEMS
from .location import _shown_location
from .options import _duration_option, _journal_options, _run, _settings
from .render import (
    _clean,
    _dumps,
    _problem_json,
    _problem_text,
    _stderr,
    _view_json,
    _view_lines,
    _write,
)

# ------------------------------------------------------------------------------- sweep


@click.command("sweep")
@click.option("--json", "as_json", is_flag=True, help="The report as JSON.")
@_journal_options
@click.pass_context
def sweep_command(
    ctx: click.Context,
    *,
    as_json: bool,
    location: str | None,
    input_key_file: str | None,
    trust_shared_root: bool,
) -> int:
    """Mark started records whose owner is proven gone needs_review (a process of this host
    that ended; with PostgreSQL, an owner on any host whose session ended).

    Nothing is run again: the marked records wait for an operator's resolve.
    """
    settings = _settings(ctx, location, input_key_file, trust_shared_root)

    async def body(journal: Journal) -> SweepReport:
        return await journal.sweep()

    report = _run(settings, body)
    if as_json:
        shape = {
            "marked": [_view_json(view) for view in report.marked],
            "problems": [_problem_json(problem) for problem in report.problems],
        }
        _write([_dumps(shape, indent=2)])
    else:
        for problem in report.problems:
            _stderr(f"problem: {_problem_text(problem)}")
        lines = _view_lines(report.marked, "marked")
        noun = "record" if len(report.marked) == 1 else "records"
        lines.append(f"marked {len(report.marked)} {noun} needs_review")
        _write(lines)
    return EXIT_PROBLEMS if report.problems else EXIT_OK


# ------------------------------------------------------------------------------ verify


@click.command("verify")
@click.option("--json", "as_json", is_flag=True, help="The findings as JSON.")
@_journal_options
@click.pass_context
def verify_command(
    ctx: click.Context,
    *,
    as_json: bool,
    location: str | None,
    input_key_file: str | None,
    trust_shared_root: bool,
) -> int:
    """Check every record and the store; one line per problem, exit 1 if any."""
    settings = _settings(ctx, location, input_key_file, trust_shared_root)

    async def body(journal: Journal) -> tuple[str, ...]:
        return await journal.verify()

    problems = _run(settings, body)
    if as_json:
        _write([_dumps({"ok": not problems, "problems": list(problems)}, indent=2)])
    elif problems:
        _write(_clean(problem) for problem in problems)
    else:
        _write([_clean(f"ok: no problems in {_shown_location(settings.location)}")])
    return EXIT_PROBLEMS if problems else EXIT_OK


# ------------------------------------------------------------------------------- prune


@click.command("prune")
@click.option(
    "--older-than",
    "older_than",
    callback=_duration_option,
    metavar="DURATION",
    required=True,
    help="Only records last changed longer ago than this: 30d, 12h, 90m, 45s, 2w, 1d12h.",
)
@click.option("--dry-run", is_flag=True, default=False, help="Show what would go; remove nothing.")
@click.option("--json", "as_json", is_flag=True, help="The report as JSON.")
@_journal_options
@click.pass_context
def prune_command(
    ctx: click.Context,
    *,
    older_than: timedelta,
    dry_run: bool,
    as_json: bool,
    location: str | None,
    input_key_file: str | None,
    trust_shared_root: bool,
) -> int:
    """Remove succeeded and released records last changed before a cutoff.

    Each removal is atomic; nothing else is ever removed. A pruned identity is forgotten:
    a later claim of it runs afresh, so prune only what no caller can ask about again.
    """
    settings = _settings(ctx, location, input_key_file, trust_shared_root)
    cutoff = datetime.now(UTC) - older_than

    async def body(journal: Journal) -> PruneReport:
        return await journal.prune(older_than, dry_run=dry_run)

    report = _run(settings, body)
    if as_json:
        shape = {
            "dry_run": dry_run,
            "older_than": older_than.total_seconds(),
            "cutoff": cutoff.isoformat(timespec="seconds"),
            "removed": [_view_json(view) for view in report.removed],
            "problems": [_problem_json(problem) for problem in report.problems],
            "kept": [_view_json(view) for view in report.kept],
        }
        _write([_dumps(shape, indent=2)])
    else:
        for problem in report.problems:
            _stderr(f"problem: {_problem_text(problem)}")
        verb = "would remove" if dry_run else "removed"
        lines = _view_lines(report.removed, verb)
        noun = "record" if len(report.removed) == 1 else "records"
        lines.append(
            f"{verb} {len(report.removed)} {noun} last changed before "
            f"{cutoff.strftime('%Y-%m-%d %H:%M:%SZ')}"
        )
        if report.kept:
            lines.extend(_view_lines(report.kept, "kept"))
            lines.append(
                f"kept {len(report.kept)} that look old to this clock: another clock disagrees "
                "(a time ahead of this clock, or the store's own clock says written since)"
            )
        _write(lines)
    return EXIT_PROBLEMS if report.problems else EXIT_OK
