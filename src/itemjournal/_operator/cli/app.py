"""The ``itemjournal`` command: find what is stuck, see why, and decide, audited.

Every command works on one journal location, given once to the group (``itemjournal -L
/var/lib/app/journal list``) or to the command (``itemjournal list -L ...``), or taken from
``ITEMJOURNAL_LOCATION``. The command never creates a journal: a location that holds none
is refused (``NO_JOURNAL``), so a typo cannot leave an empty journal behind.

Exit codes and error codes: one table each, in ``errors`` (``EXIT_CODES``,
``ERROR_CODES``), printed at the end of ``itemjournal --help`` and repeated in docs/cli.md.
Every error is one line on stderr, ``error: CODE: message``; a record met along the way
that cannot be read is one line, ``problem: CODE: message``, and the command goes on.

``--json`` output (stable; every object has exactly these keys, in this order):

* a *view* (``list --json`` one per line; ``review``/``resolve --json``; inside the
  reports below): ``key`` (64 hex, the identity's digest and ``Claim.key``),
  ``identity`` (``[scope, program, job, item]``), ``status``, ``receipt`` (str or null),
  ``attempt`` (int), ``created_at``, ``updated_at`` (ISO-8601 UTC or null), ``owner``
  (null or ``{"host", "pid", "started_at", "process"}``), ``owner_alive`` (true, false or
  null: not started, or not decidable from this host), ``review_reason`` (str or null),
  ``result_size`` (UTF-8 bytes of the stored result, or null when there is none).
* a *full view* (``show --json``; ``export``, one per line): a view, then ``result`` (str
  or null; ``export --no-results`` writes null and keeps ``result_size``) and
  ``history`` (a list of ``{"at", "event", "status", "attempt", "note"}``).
* a *problem*: ``{"code", "message", "location"}`` (``location``: the file or row that
  cannot be read, or null).
* ``counts --json``: ``{"started", "succeeded", "needs_review", "released", "invalid",
  "total"}``.
* ``sweep --json``: ``{"marked": [view], "problems": [problem]}``; ``prune --json``:
  ``{"dry_run", "older_than", "cutoff", "removed": [view], "problems": [problem]}``;
  ``verify --json``: ``{"ok": bool, "problems": [str]}``.
* bulk ``resolve --json``: ``{"applied": bool, "planned": [{"key", "identity",
  "decision", "receipt"}], "resolved": [view], "failed": [{"key", "identity", "error":
  problem}], "left": [{"key", "identity"}], "problems": [problem]}``.
* ``reconcile --json``: ``{"dry_run", "check", "counts": {"checked", "happened",
  "did_not_happen", "unknown", "left", "failed", "problems"}, "records": [{"key",
  "identity", "outcome", "verdict", "error", "view": view}], "problems": [problem]}``, the
  records in key order; ``outcome`` is one of ``happened``, ``did_not_happen``,
  ``unknown``, ``left`` (the record changed meanwhile; ``view`` shows it now) and
  ``failed`` (``error`` says why; ``verdict`` is null); ``verdict`` is ``{"kind",
  "receipt", "result_size", "note"}`` (``note``: the note, the evidence or the reason).

Inputs never appear anywhere: the journal stores only their fingerprint.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

try:
    import click
    import rich  # noqa: F401  (every command renders with it: refused here, up front)
except ModuleNotFoundError as missing:  # this module is the command: say what to install
    sys.stderr.write(
        f"error: CLI_UNAVAILABLE: the itemjournal command needs {missing.name}: "
        "pip install 'itemjournal[cli]'\n"
    )
    raise SystemExit(1) from None

from ..._model.errors import JournalError
from ..._model.text import safe_text
from .checks import reconcile_command
from .errors import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    _BadValue,
    _exit_code_of,
    codes_epilog,
)
from .maintenance import prune_command, sweep_command, verify_command
from .options import _GroupOptions
from .records import counts_command, export_command, list_command
from .render import _error_line, _stderr
from .review import resolve_command, review_command
from .serve import serve_command
from .show import show_command

__all__ = ["cli", "main"]


class _Group(click.Group):
    """Click's group, with errors shown as one ``error: CODE: message`` line and exit codes
    0, 1 and 2 (see the module's docstring). A reader that goes away (``| head``) ends the
    command quietly with 1, as click does."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        code = self._guarded(args, prog_name, complete_var, windows_expand_args, extra)
        if standalone_mode:
            sys.exit(code)
        return code

    def _guarded(
        self,
        args: Sequence[str] | None,
        prog_name: str | None,
        complete_var: str | None,
        windows_expand_args: bool,
        extra: dict[str, Any],
    ) -> int:
        try:
            result = super().main(
                args,
                prog_name,
                complete_var,
                standalone_mode=False,
                windows_expand_args=windows_expand_args,
                **extra,
            )
        except click.exceptions.NoArgsIsHelpError as error:
            if error.ctx is not None:
                click.echo(error.ctx.get_help())
            return EXIT_USAGE
        except click.UsageError as error:
            code = error.error_code if isinstance(error, _BadValue) else "USAGE"
            message = error.format_message()
            if error.ctx is not None and not isinstance(error, _BadValue):
                message += f" (see {error.ctx.command_path} --help)"
            _stderr(_error_line(code, message))
            return EXIT_USAGE
        except CommandError as error:
            _stderr(_error_line(error.code, error.message))
            return error.exit_code
        except JournalError as error:
            _stderr(_error_line(error.code, error.message))
            return _exit_code_of(error)
        except (click.Abort, KeyboardInterrupt):
            _stderr(_error_line("INTERRUPTED", "stopped before the end"))
            return EXIT_INTERRUPTED
        except click.ClickException as error:
            _stderr(_error_line("USAGE", error.format_message()))
            return error.exit_code
        if isinstance(result, int):
            return result
        return EXIT_OK


@click.group(
    cls=_Group,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=codes_epilog(),
)
@click.option(
    "-L",
    "--location",
    envvar="ITEMJOURNAL_LOCATION",
    metavar="LOCATION",
    default=None,
    help="The journal: /absolute/directory, sqlite:///absolute/path.db or "
    "postgresql://user@host/database [env: ITEMJOURNAL_LOCATION].",
)
@click.option(
    "--input-key-file",
    envvar="ITEMJOURNAL_INPUT_KEY_FILE",
    metavar="FILE",
    default=None,
    help="The input key of a keyed journal: the file's exact bytes "
    "[env: ITEMJOURNAL_INPUT_KEY_FILE].",
)
@click.option(
    "--trust-shared-root",
    is_flag=True,
    default=False,
    help="Accept a location others can write to (only if every such user is trusted).",
)
@click.option(
    "-v",
    "--verbose",
    count=True,
    help="Also print the journal's log records on stderr: -v from INFO, -vv from DEBUG.",
)
@click.version_option(package_name="itemjournal", prog_name="itemjournal")
@click.pass_context
def cli(
    ctx: click.Context,
    location: str | None,
    input_key_file: str | None,
    trust_shared_root: bool,
    verbose: int,
) -> None:
    """Look at an itemjournal journal and decide what is stuck.

    \b
    itemjournal -L /var/lib/app/journal list --status needs_review
    itemjournal -L sqlite:///var/lib/app/journal.db show shop billing charge order-3
    itemjournal resolve shop billing charge order-3 --retry --note "provider shows no charge"
    """
    ctx.obj = _GroupOptions(location, input_key_file, trust_shared_root)
    ctx.call_on_close(_show_log_records(verbose))


class _SafeFormatter(logging.Formatter):
    """Log lines for a terminal: whatever a record carries (a message of any logger, the
    lines of a traceback) is shown escaped, one line per line, never interpreted."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return safe_text(super().formatMessage(record))

    def formatException(self, ei: Any) -> str:
        return "\n".join(safe_text(line) for line in super().formatException(ei).splitlines())


def _show_log_records(verbosity: int) -> Callable[[], None]:
    """Route the journal's own log records for one command; return what undoes it.

    Every write the command makes is also a record on the ``itemjournal`` logger. The
    command's own lines are the output, and the journal's records are shown only when
    asked for (the logger's ``NullHandler`` keeps them quiet otherwise; the filter also
    holds them back from any handler an imported check module may have set up).
    The filter sits on the ``itemjournal`` logger itself, so it holds back the journal's
    events and never the records of its children (``itemjournal.viewer`` under ``serve``).
    """
    logger = logging.getLogger("itemjournal")
    threshold = {0: logging.CRITICAL + 1, 1: logging.INFO}.get(verbosity, logging.DEBUG)

    def shown(record: logging.LogRecord) -> bool:
        return record.levelno >= threshold

    level = logger.level
    logger.addFilter(shown)
    handler: logging.Handler | None = None
    if verbosity:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_SafeFormatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(threshold)

    def undo() -> None:
        logger.removeFilter(shown)
        if handler is not None:
            logger.removeHandler(handler)
            logger.setLevel(level)

    return undo


for command in (
    list_command,
    show_command,
    counts_command,
    export_command,
    review_command,
    resolve_command,
    reconcile_command,
    sweep_command,
    verify_command,
    prune_command,
    serve_command,
):
    cli.add_command(command)


def main() -> None:
    """The console script: ``itemjournal``, or ``python -m itemjournal``."""
    cli.main(prog_name="itemjournal")
