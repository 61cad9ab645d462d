"""``reconcile``: settle needs_review records by asking the provider, through a check
function the operator names as ``module:function``. Here: finding and loading the check,
and showing what each check said; the settling itself is ``itemjournal's``
``reconcile`` (the operator tools' ``reconcile`` module)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import click
from rich import box
from rich.table import Table
from rich.text import Text

from ..._journal.journal import Journal
from ..._journal.reconcile import reconcile
from ..._model.verdicts import DidNotHappen, Happened, ReconcileReport, Unknown, Verdict
from ..._model.view import RecordView
from .errors import EXIT_OK, EXIT_PROBLEMS, CommandError
from .options import _journal_options, _label_option, _run, _settings
from .progress import _checks_meter
from .render import (
    _clean,
    _dumps,
    _identity,
    _out_console,
    _problem_json,
    _problem_text,
    _Screen,
    _stderr,
    _view_json,
    _write,
)

_CHECK_SPEC = re.compile(
    r"(?P<module>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)"
    r":(?P<attribute>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)"
)
_ARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OUTCOMES = ("happened", "did_not_happen", "unknown", "left", "failed")
_OUTCOME_STYLE = {
    "happened": "green",
    "did_not_happen": "magenta",
    "unknown": "yellow",
    "left": "cyan",
    "failed": "bold red",
}


def _failure(error: BaseException) -> str:
    try:
        message = str(error)
    except Exception:  # a broken __str__ must not hide which error it was
        message = ""
    return f"{type(error).__name__}: {message}" if message.strip() else type(error).__name__


def _load_check(spec: str) -> Callable[..., Any]:
    """The function ``module:function`` names (``module:Class.method`` too).

    The module is imported as ``python -m`` would find it: from the current directory,
    which is put first on the module path for this command, or from ``PYTHONPATH`` and
    the installed packages.
    """
    match = _CHECK_SPEC.fullmatch(spec)
    if match is None:
        raise CommandError(
            "INVALID_CHECK",
            f"--check is package.module:function, not {spec!r}",
        )
    module_name, attribute = match["module"], match["attribute"]
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and (
            module_name == error.name or module_name.startswith(f"{error.name}.")
        ):
            raise CommandError(
                "INVALID_CHECK",
                f"cannot import {module_name} for --check {spec}: no module named {error.name} "
                "(run from the directory that holds it, or set PYTHONPATH)",
            ) from None
        raise CommandError(
            "INVALID_CHECK", f"importing {module_name} for --check failed: {_failure(error)}"
        ) from None
    except Exception as error:  # the module itself raised while being imported
        raise CommandError(
            "INVALID_CHECK", f"importing {module_name} for --check failed: {_failure(error)}"
        ) from None
    target: object = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise CommandError(
                "INVALID_CHECK", f"{module_name} has no attribute {attribute} (--check {spec})"
            ) from None
    if not callable(target) or isinstance(target, type):
        raise CommandError(
            "INVALID_CHECK",
            f"--check {spec} is a {type(target).__name__}, not a function of a record's view",
        )
    return target


def _check_args(given: tuple[str, ...]) -> dict[str, str]:
    """``--check-arg NAME=VALUE``, each once: NAME a Python identifier, VALUE the rest
    after the first ``=`` (it may hold ``=`` itself, or be empty)."""
    args: dict[str, str] = {}
    for text in given:
        name, equals, value = text.partition("=")
        if not equals or _ARG_NAME.fullmatch(name) is None:
            raise CommandError(
                "INVALID_CHECK_ARG",
                f"--check-arg is NAME=VALUE, NAME a Python identifier, not {text!r}",
            )
        if name in args:
            raise CommandError("INVALID_CHECK_ARG", f"--check-arg {name} is given more than once")
        args[name] = value
    return args


def _with_args(check: Callable[..., Any], spec: str, args: dict[str, str]) -> Callable[..., Any]:
    """The check, its ``--check-arg`` values bound as keyword arguments; refused up front
    when it cannot take them (or needs one not given), before any record is checked."""
    try:
        signature = inspect.signature(check)
    except (TypeError, ValueError):  # no signature to hold the arguments against
        signature = None
    if signature is not None:
        try:
            signature.bind(None, **args)
        except TypeError as error:
            given = ", ".join(sorted(args)) or "none"
            raise CommandError(
                "INVALID_CHECK_ARG",
                f"--check {spec} cannot be called as check(view, **args) with the "
                f"--check-arg names given ({given}): {error}",
            ) from None
    return functools.partial(check, **args) if args else check


@dataclasses.dataclass(frozen=True, slots=True)
class _Entry:
    """One checked record, for the table and the JSON document."""

    outcome: str
    view: RecordView
    verdict: Verdict | None
    error: str | None


def _entries(report: ReconcileReport) -> list[_Entry]:
    entries = [
        _Entry(outcome, view, report.verdicts.get(view.key), None)
        for outcome, views in (
            ("happened", report.happened),
            ("did_not_happen", report.did_not_happen),
            ("unknown", report.unknown),
            ("left", report.left),
        )
        for view in views
    ]
    entries.extend(_Entry("failed", view, None, text) for view, text in report.failed)
    entries.sort(key=lambda entry: entry.view.key)
    return entries


def _verdict_json(verdict: Verdict | None) -> dict[str, Any] | None:
    if verdict is None:
        return None
    if isinstance(verdict, Happened):
        size = None if verdict.result is None else len(verdict.result.encode("utf-8"))
        return {
            "kind": "happened",
            "receipt": verdict.receipt,
            "result_size": size,
            "note": verdict.note,
        }
    if isinstance(verdict, DidNotHappen):
        return {
            "kind": "did_not_happen",
            "receipt": None,
            "result_size": None,
            "note": verdict.evidence,
        }
    return {"kind": "unknown", "receipt": None, "result_size": None, "note": verdict.reason}


def _reconcile_json(report: ReconcileReport, check: str) -> dict[str, Any]:
    counts = report.counts()
    return {
        "dry_run": report.dry_run,
        "check": check,
        "counts": {"checked": report.checked, **counts},
        "records": [
            {
                "key": entry.view.key,
                "identity": _identity(entry.view.identity),
                "outcome": entry.outcome,
                "verdict": _verdict_json(entry.verdict),
                "error": entry.error,
                "view": _view_json(entry.view),
            }
            for entry in _entries(report)
        ],
        "problems": [_problem_json(problem) for problem in report.problems],
    }


def _entry_detail(entry: _Entry, dry_run: bool) -> str:
    verdict = entry.verdict
    if entry.outcome == "failed":
        return f"check failed: {entry.error}"
    if entry.outcome == "left":
        return f"changed meanwhile, left as it is: now {entry.view.status}"
    done = "would resolve" if dry_run else "resolved"
    if isinstance(verdict, Happened):
        text = f"{done} succeeded, receipt {verdict.receipt}"
        return text if verdict.note is None else f"{text}: {verdict.note}"
    if isinstance(verdict, DidNotHappen):
        return f"{done} released: {verdict.evidence}"
    assert isinstance(verdict, Unknown)
    return f"left in review: {verdict.reason}"


def _show_reconcile(console: _Screen, report: ReconcileReport) -> None:
    entries = _entries(report)
    if entries:
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
        for name in ("OUTCOME", "SCOPE", "PROGRAM", "JOB", "ITEM", "ATTEMPT"):
            table.add_column(name, no_wrap=True)
        table.add_column("WHAT THE CHECK SAID", overflow="fold")
        for entry in entries:
            table.add_row(
                Text(entry.outcome, style=_OUTCOME_STYLE[entry.outcome]),
                *(Text(label) for label in entry.view.identity),
                Text(str(entry.view.attempt)),
                Text(_clean(_entry_detail(entry, report.dry_run))),
            )
        console.print(table)
    summary = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    summary.add_column("OUTCOME")
    summary.add_column("RECORDS", justify="right")
    counts = report.counts()
    for name in (*_OUTCOMES, "problems"):
        style = _OUTCOME_STYLE.get(name, "bold red" if counts[name] else "")
        summary.add_row(Text(name, style=style), Text(str(counts[name])))
    summary.add_row(Text("checked", style="bold"), Text(str(report.checked)))
    console.print(summary)
    settled = len(report.happened) + len(report.did_not_happen)
    noun = "record" if report.checked == 1 else "records"
    if report.dry_run:
        line = (
            f"would resolve {settled} of {report.checked} checked {noun}; nothing changed: "
            "run again with --yes to apply"
        )
    else:
        line = f"resolved {settled} of {report.checked} checked {noun}"
        if report.failed:
            line += f"; {len(report.failed)} check(s) failed"
    console.print(Text(line))


@click.command("reconcile")
@click.option(
    "--check",
    "check_spec",
    required=True,
    metavar="MODULE:FUNCTION",
    help="The check: a function of a record's view returning Happened, DidNotHappen or "
    "Unknown (an async def, or a plain function run in a worker thread).",
)
@click.option(
    "--check-arg",
    "check_args",
    multiple=True,
    metavar="NAME=VALUE",
    help="Passed to every call of the check as the keyword argument NAME (a str); may be "
    "repeated, each NAME once; VALUE is all after the first '='.",
)
@click.option("--scope", callback=_label_option, metavar="LABEL", help="Only this scope.")
@click.option("--program", callback=_label_option, metavar="LABEL", help="Only this program.")
@click.option("--job", callback=_label_option, metavar="LABEL", help="Only this job.")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Checks in flight at once.",
)
@click.option("--dry-run", is_flag=True, default=False, help="Call the checks; change nothing.")
@click.option("--yes", is_flag=True, default=False, help="Resolve as the checks say.")
@click.option("--json", "as_json", is_flag=True, help="The report as JSON.")
@_journal_options
@click.pass_context
def reconcile_command(
    ctx: click.Context,
    *,
    check_spec: str,
    check_args: tuple[str, ...],
    scope: str | None,
    program: str | None,
    job: str | None,
    limit: int,
    dry_run: bool,
    yes: bool,
    as_json: bool,
    location: str | None,
    input_key_file: str | None,
    trust_shared_root: bool,
) -> int:
    """Settle needs_review records by asking the provider, through a check function.

    \b
    itemjournal reconcile --check billing.checks:charge_status --dry-run
    itemjournal reconcile --check billing.checks:charge_status --yes
    itemjournal reconcile --check billing.checks:charge_status --check-arg region=eu --yes

    The check gets each record's view (view.key is the idempotency key the provider was
    given) and answers Happened(receipt) (resolved succeeded), DidNotHappen(evidence)
    (resolved released: claimable again) or Unknown(reason) (left for a person). Each
    resolution is an audited resolve whose note names the check. MODULE is imported from
    the current directory or PYTHONPATH. Each --check-arg NAME=VALUE is passed on every
    call as a keyword argument, check(view, NAME=VALUE, ...), values as strings; a check
    that cannot take them is refused before any record is checked (INVALID_CHECK_ARG).
    Exit 1 when a check failed.
    """
    if dry_run == yes:
        raise click.UsageError(
            "give exactly one of --dry-run (show what it would do) and --yes (resolve)", ctx
        )
    args = _check_args(check_args)
    settings = _settings(ctx, location, input_key_file, trust_shared_root)
    check = _with_args(_load_check(check_spec), check_spec, args)
    filtered = any(value is not None for value in (scope, program, job))

    async def body(journal: Journal) -> ReconcileReport:
        async with _checks_meter(journal, shown=not as_json, filtered=filtered) as tick:
            return await reconcile(
                journal,
                check,
                scope=scope,
                program=program,
                job=job,
                limit=limit,
                dry_run=dry_run,
                progress=tick,
            )

    report = _run(settings, body)
    if as_json:
        _write([_dumps(_reconcile_json(report, check_spec), indent=2)])
    else:
        for problem in report.problems:
            _stderr(f"problem: {_problem_text(problem)}")
        _show_reconcile(_out_console(), report)
    return EXIT_PROBLEMS if report.failed or report.problems else EXIT_OK
