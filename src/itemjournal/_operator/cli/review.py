"""The decisions of a person: ``review`` (mark a started record needs_review) and
``resolve`` (settle a needs_review record, one or in bulk). A bulk decision is planned
first and applied only with ``--yes``; every decision is audited with its note."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import click
from rich import box
from rich.table import Table
from rich.text import Text

from ..._journal.journal import Journal
from ..._model.conflicts import ConflictError
from ..._model.errors import InvalidArgument, JournalError
from ..._model.identity import Identity, check_label, identity_digest
from ..._model.records import note_problem
from ..._model.view import RecordView
from .errors import EXIT_OK, EXIT_PROBLEMS, CommandError, _BadValue
from .options import _coerce, _filter_options, _identity_args, _journal_options, _run, _settings
from .progress import _metered
from .receipts import _read_receipts
from .render import (
    _clean,
    _dumps,
    _identity,
    _out_console,
    _problem_json,
    _problem_text,
    _resolved_line,
    _Screen,
    _show_identity,
    _stderr,
    _view_json,
    _when,
    _write,
)

# ------------------------------------------------------------------------------ review


@click.command("review")
@_identity_args
@click.option("--reason", required=True, help="Why the outcome needs a person to look.")
@click.option("--json", "as_json", is_flag=True, help="The record's view as JSON.")
@_journal_options
@click.pass_context
def review_command(
    ctx: click.Context,
    *,
    scope: str,
    program: str,
    job: str,
    item: str,
    reason: str,
    as_json: bool,
    location: str | None,
    input_key_file: str | None,
    trust_shared_root: bool,
) -> int:
    """Mark a started record needs_review."""
    settings = _settings(ctx, location, input_key_file, trust_shared_root)
    identity = _coerce(scope, program, job, item)

    async def body(journal: Journal) -> RecordView:
        return await journal.mark_review(identity, reason)

    view = _run(settings, body)
    if as_json:
        _write([_dumps(_view_json(view))])
    else:
        _write([_clean(f"marked {_show_identity(view.identity)} needs_review: {reason}")])
    return EXIT_OK


# ----------------------------------------------------------------------------- resolve


@dataclasses.dataclass(slots=True)
class _Bulk:
    """A bulk decision: what it would change, what it did, what it could not."""

    planned: list[tuple[RecordView, str | None]] = dataclasses.field(default_factory=list)
    resolved: list[RecordView] = dataclasses.field(default_factory=list)
    failed: list[tuple[Identity, JournalError]] = dataclasses.field(default_factory=list)
    left: list[RecordView] = dataclasses.field(default_factory=list)
    problems: list[JournalError] = dataclasses.field(default_factory=list)


async def _plan_bulk(
    journal: Journal,
    receipts: dict[Identity, str] | None,
    scope: str | None,
    program: str | None,
    job: str | None,
) -> _Bulk:
    bulk = _Bulk()
    filtered = any(value is not None for value in (scope, program, job))
    seen: set[Identity] = set()
    async with (
        _metered(journal, "scanning", "needs_review", filtered=filtered) as tick,
        contextlib.aclosing(
            journal.records("needs_review", scope=scope, program=program, job=job, problems=True)
        ) as items,
    ):
        async for item in items:
            tick()
            if not isinstance(item, RecordView):
                bulk.problems.append(item)
                continue
            if item.status != "needs_review":
                continue
            seen.add(item.identity)
            if receipts is None:
                bulk.planned.append((item, None))
            elif item.identity in receipts:
                bulk.planned.append((item, receipts[item.identity]))
            else:
                bulk.left.append(item)
    for identity in receipts or {}:
        if identity in seen:
            continue
        # A receipt for a record this decision will not change: say why.
        try:
            view = await journal.inspect(identity)
        except JournalError as unreadable:
            bulk.failed.append((identity, unreadable))
            continue
        if view.status == "needs_review":
            refusal = ConflictError(
                "the record is needs_review but outside the --scope/--program/--job filter",
                code="FILTERED_OUT",
                view=view,
            )
        else:
            refusal = ConflictError(
                f"the record is {view.status}, not needs_review", code="NOT_IN_REVIEW", view=view
            )
        bulk.failed.append((identity, refusal))
    return bulk


async def _apply_bulk(journal: Journal, bulk: _Bulk, note: str) -> None:
    for view, receipt in bulk.planned:
        try:
            if receipt is None:
                done = await journal.resolve(view.identity, retry=True, note=note)
            else:
                done = await journal.resolve(view.identity, receipt=receipt, note=note)
        except JournalError as error:
            bulk.failed.append((view.identity, error))
        else:
            bulk.resolved.append(done)


def _bulk_json(bulk: _Bulk, applied: bool) -> dict[str, Any]:
    return {
        "applied": applied,
        "planned": [
            {
                "key": view.key,
                "identity": _identity(view.identity),
                "decision": "retry" if receipt is None else "receipt",
                "receipt": receipt,
            }
            for view, receipt in bulk.planned
        ],
        "resolved": [_view_json(view) for view in bulk.resolved],
        "failed": [
            {
                "key": identity_digest(identity),
                "identity": _identity(identity),
                "error": _problem_json(error),
            }
            for identity, error in bulk.failed
        ],
        "left": [{"key": view.key, "identity": _identity(view.identity)} for view in bulk.left],
        "problems": [_problem_json(problem) for problem in bulk.problems],
    }


def _show_bulk(console: _Screen, bulk: _Bulk, applied: bool, receipt_file: str | None) -> None:
    if not applied and bulk.planned:
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
        for name in ("SCOPE", "PROGRAM", "JOB", "ITEM", "ATTEMPT", "UPDATED (UTC)"):
            table.add_column(name, no_wrap=True)
        table.add_column("REVIEW REASON", overflow="fold")
        table.add_column("DECISION", overflow="fold")
        for view, receipt in bulk.planned:
            decision = "retry: released" if receipt is None else f"receipt {receipt}: succeeded"
            table.add_row(
                *(Text(label) for label in view.identity),
                Text(str(view.attempt)),
                Text(_when(view.updated_at)),
                Text(_clean(view.review_reason or "-")),
                Text(_clean(decision)),
            )
        console.print(table)
    for view in bulk.resolved:
        console.print(Text(_resolved_line(view)))
    for identity, error in bulk.failed:
        console.print(
            Text(_clean(f"not resolved {_show_identity(identity)}: {_problem_text(error)}"))
        )
    for view in bulk.left:
        console.print(
            Text(f"left in review {_show_identity(view.identity)}: no receipt in {receipt_file}")
        )
    planned = len(bulk.planned)
    noun = "record" if planned == 1 else "records"
    if applied:
        summary = f"resolved {len(bulk.resolved)} of {planned} {noun}"
        failed = len(bulk.failed)
        if failed:
            summary += f"; {failed} not resolved"
    else:
        summary = f"would resolve {planned} {noun}; nothing changed: run again with --yes to apply"
    console.print(Text(summary))


@click.command("resolve")
@click.argument("labels", nargs=-1, metavar="[SCOPE PROGRAM JOB ITEM]")
@click.option("--receipt", default=None, help="It happened: the record becomes succeeded.")
@click.option(
    "--retry",
    is_flag=True,
    default=False,
    help="It verifiably did not happen: released, so it may be claimed again.",
)
@click.option(
    "--receipt-from",
    "receipt_file",
    metavar="FILE",
    default=None,
    help="Bulk: receipts per record, lines of 'SCOPE PROGRAM JOB ITEM RECEIPT' or "
    '{"identity": [...], "receipt": "..."} ("-": stdin).',
)
@click.option("--note", required=True, help="Why: kept in the record's history.")
@_filter_options
@click.option("--yes", is_flag=True, default=False, help="Bulk: apply (otherwise only show).")
@click.option("--json", "as_json", is_flag=True, help="The outcome as JSON.")
@_journal_options
@click.pass_context
def resolve_command(
    ctx: click.Context,
    *,
    labels: tuple[str, ...],
    receipt: str | None,
    retry: bool,
    receipt_file: str | None,
    note: str,
    status: str | None,
    scope: str | None,
    program: str | None,
    job: str | None,
    yes: bool,
    as_json: bool,
    location: str | None,
    input_key_file: str | None,
    trust_shared_root: bool,
) -> int:
    """Decide a needs_review record: --receipt R (it happened) or --retry (it did not).

    \b
    One record:  resolve SCOPE PROGRAM JOB ITEM (--receipt R | --retry) --note N
    In bulk:     resolve --status needs_review [--scope/--program/--job X]
                         (--retry | --receipt-from FILE) --note N [--yes]

    In bulk, nothing changes without --yes: the command shows what it would do.
    """
    if labels:
        if len(labels) != 4:
            raise click.UsageError(
                f"one record is named by SCOPE PROGRAM JOB ITEM, got {len(labels)} label(s)",
                ctx,
            )
        for what, value in (
            ("--status", status),
            ("--scope", scope),
            ("--program", program),
            ("--job", job),
            ("--receipt-from", receipt_file),
        ):
            if value is not None:
                raise click.UsageError(f"{what} is for bulk decisions, not one record", ctx)
        if yes:
            raise click.UsageError("--yes is for bulk decisions, not one record", ctx)
        if (receipt is None) == (not retry):
            raise click.UsageError("give exactly one of --receipt R and --retry", ctx)
        try:
            identity = Identity(
                *(
                    check_label(value, name)
                    for value, name in zip(labels, Identity._fields, strict=True)
                )
            )
        except InvalidArgument as error:
            raise _BadValue(error.code, error.message) from None
        settings = _settings(ctx, location, input_key_file, trust_shared_root)

        async def one(journal: Journal) -> RecordView:
            if retry:
                return await journal.resolve(identity, retry=True, note=note)
            return await journal.resolve(identity, receipt=receipt, note=note)

        view = _run(settings, one)
        if as_json:
            _write([_dumps(_view_json(view))])
        else:
            _write([_resolved_line(view)])
        return EXIT_OK

    if status is None:
        raise click.UsageError(
            "name one record (SCOPE PROGRAM JOB ITEM), or decide in bulk with "
            "--status needs_review",
            ctx,
        )
    if status != "needs_review":
        raise _BadValue(
            "INVALID_STATUS", f"only needs_review records can be resolved, not {status}"
        )
    if receipt is not None:
        raise click.UsageError(
            "a bulk decision takes --retry or --receipt-from FILE, not one --receipt", ctx
        )
    if retry == (receipt_file is not None):
        raise click.UsageError("give exactly one of --retry and --receipt-from FILE", ctx)
    blank = note_problem(note, "a resolution note")
    if blank is not None:  # refused before any record is looked at
        raise CommandError("INVALID_ARGUMENT", blank)
    settings = _settings(ctx, location, input_key_file, trust_shared_root)
    receipts = _read_receipts(receipt_file) if receipt_file is not None else None

    async def bulk_body(journal: Journal) -> _Bulk:
        bulk = await _plan_bulk(journal, receipts, scope, program, job)
        if yes:
            await _apply_bulk(journal, bulk, note)
        return bulk

    bulk = _run(settings, bulk_body)
    if as_json:
        _write([_dumps(_bulk_json(bulk, yes), indent=2)])
    else:
        for unreadable in bulk.problems:
            _stderr(f"problem: {_problem_text(unreadable)}")
        _show_bulk(_out_console(), bulk, yes, receipt_file)
    return EXIT_PROBLEMS if bulk.failed or bulk.problems else EXIT_OK
