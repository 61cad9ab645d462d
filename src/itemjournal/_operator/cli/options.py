"""What every command is given: the options and arguments commands share (the location,
the filters, an identity) with the checks of their values, the settings a command opens
its journal with, and ``_run``, which opens it for one command.

A value the journal would refuse is refused here, while click parses it, with the
journal's code (``INVALID_LABEL``, ``INVALID_STATUS``, ``INVALID_DURATION``)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import click

from ..._journal.journal import Journal
from ..._model.errors import InvalidArgument, JournalError
from ..._model.identity import Identity, check_label
from ..._model.records import STATUSES
from .errors import _BadValue
from .location import _check_location, _read_key_file, _shown_location

T = TypeVar("T")

_DURATION = re.compile(r"(?:\d+[smhdw])+")
_DURATION_PART = re.compile(r"(\d+)([smhdw])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


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
