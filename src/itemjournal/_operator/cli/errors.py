"""The exit codes and the error codes of the whole command, in one table each, and the
command's own refusals.

The tables are the documentation: ``itemjournal --help`` prints them and the manual's
(docs/cli.md) says the same (a test holds the two together). Every error is one line on stderr,
``error: CODE: message``; a record that cannot be read, met along the way, is one line
``problem: CODE: message`` and the command goes on."""

from __future__ import annotations

import textwrap

import click

from ..._model.errors import InvalidArgument, JournalError

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

EXIT_CODES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "all is well"),
    (
        EXIT_PROBLEMS,
        "the command ran and found or met a problem: a record that cannot be read, a record "
        "not in the state a decision needs, verify findings, a failed check or bulk decision",
    ),
    (
        EXIT_USAGE,
        "bad usage or bad input: an unknown option, a bad label, key, status, duration or "
        "location, a record that is not there, a file that cannot be used",
    ),
    (EXIT_INTERRUPTED, "interrupted"),
)

# (code, exit code, what it means): the codes of the command and those of the journal
# the command can meet.
ERROR_CODES: tuple[tuple[str, int, str], ...] = (
    ("USAGE", EXIT_USAGE, "an unknown command or option, a missing or extra argument"),
    ("INVALID_LABEL", EXIT_USAGE, "a scope, program, job or item that is not a label"),
    ("INVALID_STATUS", EXIT_USAGE, "a status that is not one of the four"),
    ("INVALID_DURATION", EXIT_USAGE, "a duration that is not like 30d, 12h or 1d12h"),
    (
        "INVALID_KEY",
        EXIT_USAGE,
        "a key that is not 4 to 64 hex digits, or an Idempotency-Key value that is not a "
        "quoted string or a token",
    ),
    ("AMBIGUOUS_KEY", EXIT_USAGE, "a key prefix that more than one record's key begins with"),
    ("NOT_FOUND", EXIT_USAGE, "no record has that identity, key or Idempotency-Key"),
    ("INVALID_ARGUMENT", EXIT_USAGE, "a blank note or reason, a blank viewer token"),
    ("INVALID_RECEIPT", EXIT_USAGE, "a receipt that is blank or longer than 200 characters"),
    ("ABSOLUTE_ROOT_REQUIRED", EXIT_USAGE, "no location, or one that is not absolute"),
    ("NO_JOURNAL", EXIT_USAGE, "a location that holds no journal (none is ever created)"),
    ("INPUT_KEY_MISMATCH", EXIT_USAGE, "an input key that is not the journal's, or none"),
    ("INVALID_KEY_FILE", EXIT_USAGE, "an input key file that cannot be read, empty or too big"),
    ("INVALID_RECEIPT_FILE", EXIT_USAGE, "a receipt file with a bad line, or unreadable"),
    ("TOKEN_REQUIRED", EXIT_USAGE, "serve on an address other than loopback without --token"),
    ("INVALID_CHECK", EXIT_USAGE, "a reconcile --check that cannot be imported, found or called"),
    (
        "INVALID_CHECK_ARG",
        EXIT_USAGE,
        "a --check-arg that is not NAME=VALUE, a repeated NAME, or one the check does not take",
    ),
    ("RECORD_INVALID", EXIT_PROBLEMS, "a stored record that cannot be trusted (left as found)"),
    ("NOT_STARTED", EXIT_PROBLEMS, "review of a record that is not started"),
    ("NOT_IN_REVIEW", EXIT_PROBLEMS, "resolve of a record that is not needs_review"),
    ("FILTERED_OUT", EXIT_PROBLEMS, "a bulk receipt for a record outside the filters"),
    ("STORAGE_FAILED", EXIT_PROBLEMS, "the store could not be read or written"),
    ("VIEWER_UNAVAILABLE", EXIT_PROBLEMS, "serve without the viewer extra"),
    ("CLI_UNAVAILABLE", EXIT_PROBLEMS, "the command without the cli extra"),
    ("INTERRUPTED", EXIT_INTERRUPTED, "stopped (Ctrl-C) before the end"),
)
_EXIT_OF = {code: exit_code for code, exit_code, _ in ERROR_CODES}


def codes_epilog(width: int = 96) -> str:
    """The two tables as ``--help`` prints them (click keeps ``\\b`` paragraphs as they are)."""
    exits = [
        textwrap.fill(meaning, width, initial_indent=f"  {code:<4} ", subsequent_indent=" " * 7)
        for code, meaning in EXIT_CODES
    ]
    errors = [
        textwrap.fill(
            meaning, width, initial_indent=f"  {code} ({exit_code}) ", subsequent_indent=" " * 6
        )
        for code, exit_code, meaning in ERROR_CODES
    ]
    return "\n".join(
        [
            "\b",
            "Exit codes:",
            *exits,
            "",
            "\b",
            "Error codes (exit code), each shown as one line: error: CODE: message",
            *errors,
        ]
    )


class CommandError(Exception):
    """A refusal of the command itself; shown as ``error: CODE: message``."""

    def __init__(self, code: str, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.exit_code = _EXIT_OF.get(code, EXIT_USAGE) if exit_code is None else exit_code


class _BadValue(click.BadParameter):
    """A parameter click parsed but that the journal would refuse, with its code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.error_code = code


def _exit_code_of(error: JournalError) -> int:
    """Bad input is 2 (an argument the journal refused, a key that does not fit the
    location); anything the journal found or met while doing its work is 1."""
    if isinstance(error, InvalidArgument):
        return EXIT_USAGE
    return _EXIT_OF.get(error.code, EXIT_PROBLEMS)
