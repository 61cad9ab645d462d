"""Checks of what callers pass, shared by the journal, its reconciliation and the homes.

Every check refuses with ``InvalidArgument`` before anything is read or written, and
returns the value as it will be used. ``once`` and ``run_each`` check their ``wait`` when
they are made, not at their first call, with the very check ``begin`` applies, so the
same value is refused in the same words wherever it is given.
"""

from __future__ import annotations

import inspect
import math
import os
import re

from .._model.errors import InvalidArgument
from .._model.records import STATUSES, note_problem, receipt_problem, result_problem
from .._model.view import Claim

__all__ = [
    "check_after",
    "check_claim",
    "check_dry_run",
    "check_location",
    "check_lock_timeout",
    "check_note",
    "check_open",
    "check_receipt",
    "check_resolution",
    "check_result",
    "check_status",
    "check_wait",
    "is_async",
]

_KEY = re.compile(r"[0-9a-f]{64}")


def check_note(value: object, what: str) -> str:
    problem = note_problem(value, what)
    if problem:
        raise InvalidArgument(problem, code="INVALID_ARGUMENT")
    assert isinstance(value, str)
    return value


def check_status(value: object) -> None:
    if value is not None and value not in STATUSES:
        raise InvalidArgument(
            f"status is one of {', '.join(STATUSES)}, not {value!r}", code="INVALID_ARGUMENT"
        )


def check_wait(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(
            f"wait is a number of seconds or None, not {type(value).__name__}",
            code="INVALID_ARGUMENT",
        )
    if not (math.isfinite(value) and value >= 0):
        raise InvalidArgument(
            f"wait must be a finite number of seconds, at least 0, got {value}",
            code="INVALID_ARGUMENT",
        )
    return float(value)


def check_result(value: object) -> str | None:
    problem = result_problem(value)
    if problem:
        raise InvalidArgument(problem, code="INVALID_ARGUMENT")
    assert value is None or isinstance(value, str)
    return value


def check_receipt(value: object) -> str:
    problem = receipt_problem(value)
    if problem:
        raise InvalidArgument(problem, code="INVALID_RECEIPT")
    assert isinstance(value, str)
    return value


def check_after(value: object) -> None:
    """``after`` of a listing: None or a record key."""
    if value is not None and (not isinstance(value, str) or _KEY.fullmatch(value) is None):
        raise InvalidArgument(
            "after is a record key: 64 lowercase hex characters", code="INVALID_ARGUMENT"
        )


def check_dry_run(value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidArgument("dry_run must be True or False", code="INVALID_ARGUMENT")


def check_lock_timeout(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(
            f"lock_timeout is a number of seconds, not {type(value).__name__}",
            code="INVALID_ARGUMENT",
        )
    if not (math.isfinite(value) and value > 0):
        raise InvalidArgument(
            f"lock_timeout must be a positive, finite number of seconds, got {value}",
            code="INVALID_ARGUMENT",
        )
    return float(value)


def check_claim(claim: object) -> None:
    if not isinstance(claim, Claim):
        raise InvalidArgument(
            f"complete() takes the Claim that begin() returned, not {type(claim).__name__}",
            code="INVALID_CLAIM",
        )


def check_resolution(
    receipt: object, retry: object, note: object, result: object
) -> tuple[str | None, str, str | None]:
    """``resolve``'s arguments, checked: ``(receipt, note, result)``."""
    if not isinstance(retry, bool):
        raise InvalidArgument("retry must be True or False", code="INVALID_ARGUMENT")
    if (receipt is None) == (not retry):
        raise InvalidArgument(
            "resolve() takes either receipt=... (it happened) or retry=True "
            "(it verifiably did not), exactly one of them",
            code="INVALID_ARGUMENT",
        )
    checked = None if receipt is None else check_receipt(receipt)
    kept = check_result(result)
    if retry and kept is not None:
        raise InvalidArgument(
            "a result is stored only with a receipt, not with retry=True",
            code="INVALID_ARGUMENT",
        )
    return checked, check_note(note, "a resolution note"), kept


def check_open(
    location: object, lock_timeout: object, trust_shared_root: object
) -> tuple[str, float]:
    """``Journal.open``'s arguments, checked in this order: ``(location text, timeout)``."""
    timeout = check_lock_timeout(lock_timeout)
    if not isinstance(trust_shared_root, bool):
        raise InvalidArgument("trust_shared_root must be True or False", code="INVALID_ARGUMENT")
    return check_location(location), timeout


def check_location(location: object) -> str:
    """The text of a location ``Journal.open`` was given: a str or a text path."""
    if not isinstance(location, (str, os.PathLike)):
        raise InvalidArgument(
            f"location must be an absolute directory path, not {type(location).__name__}",
            code="ABSOLUTE_ROOT_REQUIRED",
        )
    text = os.fspath(location)
    if not isinstance(text, str):
        raise InvalidArgument(
            f"location must be a text path; {type(location).__name__} gave "
            f"{type(text).__name__} (decode it with os.fsdecode first)",
            code="ABSOLUTE_ROOT_REQUIRED",
        )
    if "\0" in text:
        raise InvalidArgument("the location holds a NUL character", code="ABSOLUTE_ROOT_REQUIRED")
    return text


def is_async(func: object) -> bool:
    """Whether calling ``func`` gives a coroutine: an ``async def``, or an object whose
    ``__call__`` is one."""
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(
        getattr(func, "__call__", None)  # noqa: B004 - an object whose __call__ is async
    )
