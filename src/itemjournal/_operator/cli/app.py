"""The ``itemjournal`` command: find what is stuck, see why, and decide, audited.

Every command works on one journal location, given once to the group (``itemjournal -L
/var/lib/app/journal list``) or to the command (``itemjournal list -L ...``), or taken from
``ITEMJOURNAL_LOCATION``. The command never creates a journal: a location that holds none
is refused (``NO_JOURNAL``), so a typo cannot leave an empty journal behind.

Exit codes: 0 when all is well; 1 when the command ran and found or met a problem (a
record that cannot be read, a record not in the state the decision needs, ``verify``
findings, a bulk decision with failures); 2 for bad usage or bad input (an unknown
option, a bad label, status or duration, a missing or relative location, a key file or
receipt file that cannot be used); 130 when interrupted. Every error is one line on
stderr, ``error: CODE: message``; a record met along the way that cannot be read is one
line, ``problem: CODE: message``, and the command goes on.

Codes of the command itself, besides the journal's own (``INVALID_LABEL``,
``ABSOLUTE_ROOT_REQUIRED``, ``NOT_IN_REVIEW``, ``RECORD_INVALID``, …): ``USAGE``,
``INVALID_STATUS``, ``INVALID_DURATION``, ``NO_JOURNAL``, ``INVALID_KEY_FILE``,
``INVALID_RECEIPT_FILE``, ``TOKEN_REQUIRED``, ``INVALID_CHECK`` (a ``reconcile --check``
that cannot be imported, found or called) (exit 2); ``NOT_FOUND``, ``FILTERED_OUT``,
``VIEWER_UNAVAILABLE``, ``CLI_UNAVAILABLE`` (the ``cli`` extra is not installed) (exit 1);
``INTERRUPTED`` (exit 130).

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

import contextlib
import dataclasses
import functools
import importlib
import ipaddress
import json
import logging
import os
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import anyio
import anyio.to_thread

try:
    import click
    from rich import box
    from rich.console import Console, RenderableType
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.table import Table
    from rich.text import Text
except ModuleNotFoundError as missing:  # this module is the command: say what to install
    sys.stderr.write(
        f"error: CLI_UNAVAILABLE: the itemjournal command needs {missing.name}: "
        "pip install 'itemjournal[cli]'\n"
    )
    raise SystemExit(1) from None

from ..._journal.journal import Journal
from ..._journal.reconcile import reconcile
from ..._model.conflicts import ConflictError
from ..._model.errors import InvalidArgument, JournalError
from ..._model.identity import Identity, check_label, identity_digest
from ..._model.records import STATUSES, Event, note_problem, receipt_problem
from ..._model.verdicts import DidNotHappen, Happened, ReconcileReport, Unknown, Verdict
from ..._model.view import PruneReport, RecordView, SweepReport
from ..._stores.files.layout import SETTINGS_NAME
from ..._stores.registry import redact

__all__ = ["cli", "main"]

T = TypeVar("T")

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2

PROGRESS_THRESHOLD = 1000  # records: shorter scans finish before a bar would help
_FLUSH_EVERY = 256  # lines written per worker-thread trip while streaming
_MAX_KEY_FILE_BYTES = 4096
_MAX_RECEIPT_FILE_BYTES = 64 * 1024 * 1024

# C0 and C1 controls, DEL, and the bidirectional overrides that can make a terminal show
# text other than what is stored: shown escaped, never passed to the terminal.
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_DURATION = re.compile(r"(?:\d+[smhdw])+")
_DURATION_PART = re.compile(r"(\d+)([smhdw])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_STATUS_STYLE = {
    "started": "cyan",
    "succeeded": "green",
    "needs_review": "bold yellow",
    "released": "magenta",
}


# ---------------------------------------------------------------------------------- errors


class CommandError(Exception):
    """A refusal of the command itself; shown as ``error: CODE: message``."""

    def __init__(self, code: str, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.exit_code = exit_code


class _BadValue(click.BadParameter):
    """A parameter click parsed but that the journal would refuse, with its code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.error_code = code


def _clean(text: str) -> str:
    """Text safe to put on a terminal: control characters are shown escaped."""

    def escape(match: re.Match[str]) -> str:
        char = match.group()
        return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"

    return _UNSAFE.sub(escape, text)


def _exit_code_of(error: JournalError) -> int:
    """Bad input is 2 (an argument the journal refused, a key that does not fit the
    location); anything the journal found or met while doing its work is 1."""
    if isinstance(error, InvalidArgument) or error.code == "INPUT_KEY_MISMATCH":
        return EXIT_USAGE
    return EXIT_PROBLEMS


def _error_line(code: str, message: str) -> str:
    return _clean(f"error: {code}: {message}")


def _problem_text(problem: JournalError) -> str:
    text = f"{problem.code}: {problem.message}"
    location = getattr(problem, "location", None)
    if isinstance(location, str) and location and location not in problem.message:
        text += f" ({location})"
    return _clean(text)


def _stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


# -------------------------------------------------------------------------- json shapes


def _identity(identity: Identity) -> list[str]:
    return list(identity)


def _view_json(view: RecordView) -> dict[str, Any]:
    owner = view.owner
    return {
        "key": view.key,
        "identity": _identity(view.identity),
        "status": view.status,
        "receipt": view.receipt,
        "attempt": view.attempt,
        "created_at": view.created_at,
        "updated_at": view.updated_at,
        "owner": None
        if owner is None
        else {
            "host": owner.host,
            "pid": owner.pid,
            "started_at": owner.started_at,
            "process": owner.process,
        },
        "owner_alive": view.owner_alive,
        "review_reason": view.review_reason,
        "result_size": None if view.result is None else len(view.result.encode("utf-8")),
    }


def _event_json(event: Event) -> dict[str, Any]:
    return {
        "at": event.at,
        "event": event.event,
        "status": event.status,
        "attempt": event.attempt,
        "note": event.note,
    }


def _full_json(view: RecordView, *, with_result: bool = True) -> dict[str, Any]:
    shape = _view_json(view)
    shape["result"] = view.result if with_result else None
    shape["history"] = [_event_json(event) for event in view.history]
    return shape


def _problem_json(problem: JournalError) -> dict[str, Any]:
    location = getattr(problem, "location", None)
    return {
        "code": problem.code,
        "message": problem.message,
        "location": location if isinstance(location, str) else None,
    }


def _dumps(value: object, *, indent: int | None = None) -> str:
    # ASCII only: whatever a record holds, the output cannot drive a terminal.
    if indent is None:
        return json.dumps(value, separators=(",", ":"))
    return json.dumps(value, indent=indent)


# ------------------------------------------------------------------------------- input


def _parse_duration(text: str) -> timedelta:
    """``30d``, ``12h``, ``90m``, ``45s``, ``2w``, or a sum like ``1d12h``; more than 0."""
    if _DURATION.fullmatch(text) is None:
        raise _BadValue(
            "INVALID_DURATION",
            f"{text!r} is not a duration: a number and a unit (s, m, h, d, w), as in 30d, "
            "12h, 90m, 45s or 1d12h",
        )
    seconds = sum(
        int(number) * _UNIT_SECONDS[unit] for number, unit in _DURATION_PART.findall(text)
    )
    if seconds <= 0:
        raise _BadValue("INVALID_DURATION", f"the duration must be more than 0, got {text!r}")
    try:
        return timedelta(seconds=seconds)
    except OverflowError:
        raise _BadValue("INVALID_DURATION", f"the duration {text!r} is too long") from None


def _duration_option(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    return None if value is None else _parse_duration(str(value))


def _status_option(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    if value is not None and value not in STATUSES:
        raise _BadValue(
            "INVALID_STATUS", f"{value!r} is not a status; one of {', '.join(STATUSES)}"
        )
    return value


def _label_option(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    if value is None:
        return None
    try:
        return check_label(value, (param.name or "label").lower())
    except InvalidArgument as error:
        raise _BadValue(error.code, error.message) from None


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """Where the journal is and how to open it."""

    location: str
    input_key: bytes | None
    trust_shared_root: bool


def _missing_postgres_journal(location: str) -> str | None:
    """Why a PostgreSQL location holds no journal, when its server says so: the command
    never creates one (``Journal.open`` would make the schema). None when there is one,
    or when the server or the driver is not there (``Journal.open`` then says why)."""
    try:
        from ..._stores.postgres.store import missing_journal
    except ImportError:
        return None
    try:
        return missing_journal(location)
    except InvalidArgument:
        return None  # a bad parameter: Journal.open refuses it with its own code


def _check_location(value: str | None) -> str:
    """The location, refused unless it names an existing journal (never created here)."""
    if not value:
        raise CommandError(
            "ABSOLUTE_ROOT_REQUIRED",
            "no journal location: pass --location/-L or set ITEMJOURNAL_LOCATION",
        )
    if value.startswith(("postgresql:", "postgres:")):
        if not value.startswith(("postgresql://", "postgres://")):
            raise CommandError(
                "ABSOLUTE_ROOT_REQUIRED",
                "a PostgreSQL location is a URL, postgresql://user@host/database, "
                f"not {redact(value)!r}",
            )
        missing = _missing_postgres_journal(value)
        if missing is not None:
            raise CommandError("NO_JOURNAL", missing)
        return value  # given to Journal.open unchanged; only ever shown redacted
    if value.startswith("sqlite:"):
        path = value[len("sqlite://") :] if value.startswith("sqlite://") else ""
        if not os.path.isabs(path):
            raise CommandError(
                "ABSOLUTE_ROOT_REQUIRED",
                f"a SQLite location looks like sqlite:///absolute/path.db, not {value!r}",
            )
        if not os.path.isfile(path):
            raise CommandError("NO_JOURNAL", f"no SQLite journal at {path}: no such file")
        return value
    if not os.path.isabs(value):
        raise CommandError(
            "ABSOLUTE_ROOT_REQUIRED",
            f"the location is an absolute directory, sqlite:///absolute/path.db or "
            f"postgresql://user@host/database, not {value!r}",
        )
    if not os.path.isdir(value):
        raise CommandError("NO_JOURNAL", f"no journal at {value}: no such directory")
    if not os.path.isfile(os.path.join(value, SETTINGS_NAME)):
        raise CommandError(
            "NO_JOURNAL", f"{value} holds no itemjournal journal (no {SETTINGS_NAME})"
        )
    return value


def _shown_location(value: str) -> str:
    """The location as output may show it: a database URL without its password."""
    return redact(value) if value.startswith(("postgresql:", "postgres:")) else value


def _read_key_file(path: str) -> bytes:
    """The key file's exact bytes, as the application passes them to ``Journal.open``."""
    try:
        with open(path, "rb") as file:
            key = file.read(_MAX_KEY_FILE_BYTES + 1)
    except OSError as error:
        raise CommandError(
            "INVALID_KEY_FILE", f"cannot read the input key file {path}: {error.strerror}"
        ) from None
    if len(key) > _MAX_KEY_FILE_BYTES:
        raise CommandError(
            "INVALID_KEY_FILE",
            f"the input key file {path} holds more than {_MAX_KEY_FILE_BYTES} bytes",
        )
    if not key:
        raise CommandError("INVALID_KEY_FILE", f"the input key file {path} is empty")
    return key


def _settings(
    ctx: click.Context, location: str | None, key_file: str | None, trust: bool
) -> Settings:
    """Merge a command's own options over the group's (which fall back to the environment)."""
    group = ctx.find_object(_GroupOptions) or _GroupOptions(None, None, False)
    key_path = key_file or group.input_key_file
    return Settings(
        location=_check_location(location or group.location),
        input_key=_read_key_file(key_path) if key_path else None,
        trust_shared_root=trust or group.trust_shared_root,
    )


def _coerce(scope: str, program: str, job: str, item: str) -> Identity:
    return Identity(scope, program, job, item)


def _show_identity(identity: Sequence[str]) -> str:
    return "/".join(identity)


def _read_receipts(path: str) -> dict[Identity, str]:
    """Receipts for a bulk decision, one record a line.

    A line is either ``SCOPE PROGRAM JOB ITEM RECEIPT`` (whitespace between the labels;
    the receipt is the rest of the line, its outer whitespace dropped) or a JSON object
    ``{"identity": [scope, program, job, item], "receipt": "..."}``. Blank lines and lines
    starting with ``#`` are skipped. ``-`` reads standard input. Any bad line refuses the
    whole file, and an identity may appear once.
    """

    def bad(number: int, why: str) -> CommandError:
        return CommandError("INVALID_RECEIPT_FILE", f"{path} line {number}: {why}")

    try:
        if path == "-":
            data = sys.stdin.buffer.read(_MAX_RECEIPT_FILE_BYTES + 1)
        else:
            with open(path, "rb") as file:
                data = file.read(_MAX_RECEIPT_FILE_BYTES + 1)
    except OSError as error:
        raise CommandError(
            "INVALID_RECEIPT_FILE", f"cannot read the receipt file {path}: {error.strerror}"
        ) from None
    if len(data) > _MAX_RECEIPT_FILE_BYTES:
        raise CommandError("INVALID_RECEIPT_FILE", f"the receipt file {path} is too large")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CommandError(
            "INVALID_RECEIPT_FILE", f"the receipt file {path} is not UTF-8 ({error.reason})"
        ) from None
    receipts: dict[Identity, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("{"):
            try:
                entry = json.loads(line)
            except ValueError as error:
                raise bad(number, f"not a JSON object ({error})") from None
            if not isinstance(entry, dict) or set(entry) != {"identity", "receipt"}:
                raise bad(number, 'a JSON line has exactly the keys "identity" and "receipt"')
            labels, receipt = entry["identity"], entry["receipt"]
            if not isinstance(labels, list) or len(labels) != 4:
                raise bad(number, '"identity" is a list of four labels')
        else:
            fields = line.split(maxsplit=4)
            if len(fields) != 5:
                raise bad(number, "expected SCOPE PROGRAM JOB ITEM RECEIPT")
            labels, receipt = fields[:4], fields[4].strip()
        try:
            identity = Identity(
                *(
                    check_label(label, name)
                    for label, name in zip(labels, Identity._fields, strict=True)
                )
            )
        except InvalidArgument as error:
            raise bad(number, f"{error.code}: {error.message}") from None
        problem = receipt_problem(receipt)
        if problem is not None:
            raise bad(number, f"INVALID_RECEIPT: {problem}")
        if identity in receipts:
            raise bad(number, f"{_show_identity(identity)} appears more than once")
        receipts[identity] = receipt
    if not receipts:
        raise CommandError("INVALID_RECEIPT_FILE", f"the receipt file {path} names no record")
    return receipts


# ------------------------------------------------------------------------------ output


class _Screen:
    """Human output on stdout: rich on a terminal; piped, plain lines as wide as they need
    to be (not cut at 80 columns) and without trailing blanks, for grep and diff."""

    def __init__(self) -> None:
        console = Console()
        self.terminal = console.is_terminal
        self.console = console if self.terminal else Console(width=240, no_color=True)

    def print(self, renderable: RenderableType) -> None:
        if self.terminal:
            self.console.print(renderable)
            return
        with self.console.capture() as captured:
            self.console.print(renderable)
        _write(line.rstrip() for line in captured.get().splitlines())


def _out_console() -> _Screen:
    return _Screen()


def _err_console() -> Console:
    return Console(stderr=True)


def _write(lines: Iterable[str]) -> None:
    text = "".join(f"{line}\n" for line in lines)
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


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


def _status_text(status: str) -> Text:
    return Text(status, style=_STATUS_STYLE.get(status, ""))


def _when(stamp: str | None) -> str:
    """A timestamp for people: UTC to the second."""
    if not stamp:
        return "-"
    try:
        moment = datetime.fromisoformat(stamp).astimezone(UTC)
    except ValueError:
        return _clean(stamp)
    return moment.strftime("%Y-%m-%d %H:%M:%SZ")


def _owner_text(view: RecordView) -> str:
    owner = view.owner
    if owner is None:
        return "-"
    text = f"pid {owner.pid} on {owner.host}"
    if view.status == "started":
        text += {True: " (alive)", False: " (gone)", None: " (alive? unknown here)"}[
            view.owner_alive
        ]
    return _clean(text)


def _detail(view: RecordView) -> str:
    if view.status == "needs_review":
        return _clean(view.review_reason or "-")
    if view.status == "started":
        return _owner_text(view)
    if view.receipt is not None:
        return _clean(f"receipt {view.receipt}")
    return "-"


def _row(view: RecordView) -> tuple[Text, ...]:
    return (
        _status_text(view.status),
        *(Text(label) for label in view.identity),
        Text(str(view.attempt)),
        Text(_when(view.updated_at)),
        Text(_detail(view)),
    )


def _table(rows: Sequence[tuple[Text, ...]]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name in ("STATUS", "SCOPE", "PROGRAM", "JOB", "ITEM", "ATTEMPT", "UPDATED (UTC)"):
        table.add_column(name, no_wrap=True)
    table.add_column("RECEIPT / REASON / OWNER", overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def _view_lines(views: Iterable[RecordView], verb: str) -> list[str]:
    lines = []
    for view in views:
        detail = _detail(view)
        more = "" if detail == "-" else f": {detail}"
        lines.append(_clean(f"{verb} {_show_identity(view.identity)} [{view.status}]{more}"))
    return lines


def _resolved_line(view: RecordView) -> str:
    outcome = view.status
    if view.receipt is not None and view.status == "succeeded":
        outcome += f", receipt {view.receipt}"
    return _clean(f"resolved {_show_identity(view.identity)}: {outcome}")


# ------------------------------------------------------------------------------ running


def _run(settings: Settings, body: Callable[[Journal], Awaitable[T]]) -> T:
    """Open the journal, run ``body`` on it in one event loop, close it."""

    async def go() -> T:
        journal = await Journal.open(
            settings.location,
            input_key=settings.input_key,
            trust_shared_root=settings.trust_shared_root,
        )
        async with journal:
            return await body(journal)

    try:
        return anyio.run(go)
    except JournalError as error:
        # A database URL may carry a password: an error never shows it.
        shown = _shown_location(settings.location)
        if shown != settings.location and settings.location in error.message:
            error.message = error.message.replace(settings.location, shown)
        raise


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
            return 130
        except click.ClickException as error:
            _stderr(_error_line("USAGE", error.format_message()))
            return error.exit_code
        if isinstance(result, int):
            return result
        return EXIT_OK


# ----------------------------------------------------------------------------- options


@dataclasses.dataclass(frozen=True, slots=True)
class _GroupOptions:
    location: str | None
    input_key_file: str | None
    trust_shared_root: bool


def _journal_options(function: Callable[..., Any]) -> Callable[..., Any]:
    """The location options, also accepted after a command's name (they win there)."""
    function = click.option(
        "--trust-shared-root",
        is_flag=True,
        default=False,
        help="Accept a location others can write to (only if every such user is trusted).",
    )(function)
    function = click.option(
        "--input-key-file",
        metavar="FILE",
        default=None,
        help="The input key of a keyed journal: the file's exact bytes.",
    )(function)
    return click.option(
        "-L",
        "--location",
        metavar="LOCATION",
        default=None,
        help="The journal: /absolute/directory, sqlite:///absolute/path.db or "
        "postgresql://user@host/database.",
    )(function)


def _filter_options(function: Callable[..., Any]) -> Callable[..., Any]:
    for name in ("job", "program", "scope"):
        function = click.option(
            f"--{name}",
            callback=_label_option,
            metavar="LABEL",
            help=f"Only records with this {name}.",
        )(function)
    return click.option(
        "--status",
        callback=_status_option,
        metavar="STATUS",
        help=f"Only this status: {', '.join(STATUSES)}.",
    )(function)


_identity_arguments: list[Callable[[Callable[..., Any]], Callable[..., Any]]] = [
    click.argument("item", callback=_label_option),
    click.argument("job", callback=_label_option),
    click.argument("program", callback=_label_option),
    click.argument("scope", callback=_label_option),
]


def _identity_args(function: Callable[..., Any]) -> Callable[..., Any]:
    for decorate in _identity_arguments:
        function = decorate(function)
    return function


@click.group(
    cls=_Group,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
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

    Exit codes: 0 fine, 1 problems found, 2 bad usage or input.
    """
    ctx.obj = _GroupOptions(location, input_key_file, trust_shared_root)
    ctx.call_on_close(_show_log_records(verbose))


def _show_log_records(verbosity: int) -> Callable[[], None]:
    """Route the journal's own log records for one command; return what undoes it.

    Every write the command makes is also a record on the ``itemjournal`` logger, and a
    record going to ``needs_review`` is a WARNING, which Python prints on stderr when
    nothing set logging up: the command would say what it did twice. So the command's
    own lines are the output, and the journal's records are shown only when asked for.
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
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(threshold)

    def undo() -> None:
        logger.removeFilter(shown)
        if handler is not None:
            logger.removeHandler(handler)
            logger.setLevel(level)

    return undo


# -------------------------------------------------------------------------------- list


@cli.command("list")
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


# -------------------------------------------------------------------------------- show


def _show_view(console: _Screen, view: RecordView) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    result = "-" if view.result is None else f"{len(view.result.encode('utf-8'))} bytes stored"
    for name, value in (
        ("identity", Text(_show_identity(view.identity))),
        ("key", Text(view.key)),
        ("status", _status_text(view.status)),
        ("attempt", Text(str(view.attempt))),
        ("receipt", Text(_clean(view.receipt) if view.receipt is not None else "-")),
        ("result", Text(result)),
        ("created", Text(_clean(view.created_at or "-"))),
        ("updated", Text(_clean(view.updated_at or "-"))),
        ("owner", Text(_owner_text(view))),
        ("review reason", Text(_clean(view.review_reason or "-"))),
    ):
        grid.add_row(name, value)
    console.print(grid)
    console.print(Text("history", style="bold"))
    history = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name in ("AT (UTC)", "EVENT", "STATUS", "ATTEMPT"):
        history.add_column(name, no_wrap=True)
    history.add_column("NOTE", overflow="fold")
    for event in view.history:
        history.add_row(
            Text(_when(event.at)),
            Text(_clean(event.event)),
            _status_text(event.status),
            Text(str(event.attempt)),
            Text(_clean(event.note or "-")),
        )
    console.print(history)


@cli.command("show")
@_identity_args
@click.option("--json", "as_json", is_flag=True, help="The full view as one JSON object.")
@_journal_options
@click.pass_context
def show_command(
    ctx: click.Context,
    *,
    scope: str,
    program: str,
    job: str,
    item: str,
    as_json: bool,
    location: str | None,
    input_key_file: str | None,
    trust_shared_root: bool,
) -> int:
    """Show one record, its history included."""
    settings = _settings(ctx, location, input_key_file, trust_shared_root)
    identity = _coerce(scope, program, job, item)

    async def body(journal: Journal) -> RecordView:
        return await journal.inspect(identity)

    view = _run(settings, body)
    if view.status == "absent":
        raise CommandError(
            "NOT_FOUND", f"no record of {_show_identity(identity)}", exit_code=EXIT_PROBLEMS
        )
    if as_json:
        _write([_dumps(_full_json(view), indent=2)])
    else:
        _show_view(_out_console(), view)
    return EXIT_OK


# ------------------------------------------------------------------------------ counts


@cli.command("counts")
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


# ------------------------------------------------------------------------------ review


@cli.command("review")
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
            journal.records("needs_review", scope=scope, program=program, job=job)
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


@cli.command("resolve")
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


# ------------------------------------------------------------------------------- sweep


@cli.command("sweep")
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
    """Mark started records whose owner process on this host is gone needs_review.

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


# --------------------------------------------------------------------------- reconcile

_CHECK_SPEC = re.compile(
    r"(?P<module>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)"
    r":(?P<attribute>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)"
)
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


@cli.command("reconcile")
@click.option(
    "--check",
    "check_spec",
    required=True,
    metavar="MODULE:FUNCTION",
    help="The check: a function of a record's view returning Happened, DidNotHappen or "
    "Unknown (an async def, or a plain function run in a worker thread).",
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

    The check gets each record's view (view.key is the idempotency key the provider was
    given) and answers Happened(receipt) (resolved succeeded), DidNotHappen(evidence)
    (resolved released: claimable again) or Unknown(reason) (left for a person). Each
    resolution is an audited resolve whose note names the check. MODULE is imported from
    the current directory or PYTHONPATH. Exit 1 when a check failed.
    """
    if dry_run == yes:
        raise click.UsageError(
            "give exactly one of --dry-run (show what it would do) and --yes (resolve)", ctx
        )
    settings = _settings(ctx, location, input_key_file, trust_shared_root)
    check = _load_check(check_spec)
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


# ------------------------------------------------------------------------------ verify


@cli.command("verify")
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


@cli.command("prune")
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


# ------------------------------------------------------------------------------ export


@cli.command("export")
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


# ------------------------------------------------------------------------------- serve


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@cli.command("serve")
@click.argument("where", required=False, default=None, metavar="[LOCATION]")
@click.option("--host", default="127.0.0.1", show_default=True, help="The address to bind.")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8080,
    show_default=True,
    help="The port (0: any free one).",
)
@click.option(
    "--token",
    envvar="ITEMJOURNAL_VIEWER_TOKEN",
    default=None,
    help="Required off loopback: checked on every request [env: ITEMJOURNAL_VIEWER_TOKEN].",
)
@_journal_options
@click.pass_context
def serve_command(
    ctx: click.Context,
    *,
    where: str | None,
    host: str,
    port: int,
    token: str | None,
    location: str | None,
    input_key_file: str | None,
    trust_shared_root: bool,
) -> int:
    """Serve a read-only web viewer of the journal (127.0.0.1 by default).

    The location may also be given here, as LOCATION, instead of with -L.
    """
    if where is not None and location is not None and where != location:
        raise click.UsageError("give the location once: as LOCATION or with -L", ctx)
    settings = _settings(ctx, where or location, input_key_file, trust_shared_root)
    if token is not None and not token.strip():
        raise CommandError("INVALID_ARGUMENT", "the viewer token must not be blank")
    if not _loopback(host) and token is None:
        raise CommandError(
            "TOKEN_REQUIRED",
            f"serving on {host} (not loopback) needs --token or ITEMJOURNAL_VIEWER_TOKEN",
        )
    try:
        from ..viewer.app import serve
    except ModuleNotFoundError as error:
        if error.name == "itemjournal._operator.viewer.app":
            raise CommandError(
                "VIEWER_UNAVAILABLE",
                "this version of itemjournal has no web viewer",
                exit_code=EXIT_PROBLEMS,
            ) from None
        raise CommandError(
            "VIEWER_UNAVAILABLE",
            f"the web viewer needs {error.name}: pip install 'itemjournal[viewer]'",
            exit_code=EXIT_PROBLEMS,
        ) from None
    serve(
        settings.location,
        host=host,
        port=port,
        token=token,
        input_key=settings.input_key,
        trust_shared_root=settings.trust_shared_root,
    )
    return EXIT_OK


def main() -> None:
    """The console script: ``itemjournal``, or ``python -m itemjournal``."""
    cli.main(prog_name="itemjournal")
