"""The exit codes and the command's own refusals (the module docstring of ``app``
lists the codes): 0 when all is well, 1 for problems found or met, 2 for bad usage or
input."""

from __future__ import annotations

import click

from ..._model.errors import InvalidArgument, JournalError

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2


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


def _exit_code_of(error: JournalError) -> int:
    """Bad input is 2 (an argument the journal refused, a key that does not fit the
    location); anything the journal found or met while doing its work is 1."""
    if isinstance(error, InvalidArgument) or error.code == "INPUT_KEY_MISMATCH":
        return EXIT_USAGE
    return EXIT_PROBLEMS
