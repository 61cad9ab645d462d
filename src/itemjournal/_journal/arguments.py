"""Checks of what callers pass, shared by the journal, its reconciliation and the homes.

Every check refuses with ``InvalidArgument`` before anything is read or written, and
returns the value as it will be used. ``once`` and ``run_each`` check their ``wait`` and
their definitions when they are made, not at their first call, with the very checks
``begin`` applies, so the same value is refused in the same words wherever it is given.
A definition given as a callable is checked for what it is at once; its source is read
later, in a worker thread (``definition_hashes``), since reading it reads a file.
"""

from __future__ import annotations

import inspect
import math
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

import anyio.to_thread

from .._model.errors import InvalidArgument
from .._model.identity import definition_digest
from .._model.records import STATUSES, note_problem, receipt_problem, result_problem
from .._model.view import Claim

__all__ = [
    "check_after",
    "check_claim",
    "check_compatible",
    "check_definition",
    "check_definitions",
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
    "definition_hashes",
    "is_async",
    "plain_hashes",
]

_KEY = re.compile(r"[0-9a-f]{64}")

# A call's definitions as checked: its own first, then those it is compatible with, each
# a digest or a callable whose source is still to be read.
Definitions = tuple["str | Callable[..., Any]", ...]


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


def check_definition(value: object, what: str = "definition") -> str | Callable[..., Any]:
    """A definition in one of its forms: the digest of a string form (a digest stands for
    itself, a version for its hash), or the callable itself, whose source is read later."""
    if isinstance(value, str):
        return definition_digest(value)
    if callable(value):
        return value
    raise InvalidArgument(
        f"{what} is a digest, a version string or a callable, not {type(value).__name__}",
        code="INVALID_HASH",
    )


def check_compatible(value: object) -> tuple[str | Callable[..., Any], ...]:
    """``compatible``: a collection of earlier definitions, each checked as a definition."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        shown = "a single string" if isinstance(value, str) else type(value).__name__
        raise InvalidArgument(
            f"compatible is a collection of earlier definitions, such as "
            f'compatible=("billing-v3",), not {shown}',
            code="INVALID_ARGUMENT",
        )
    forms = []
    for each in value:
        try:
            forms.append(check_definition(each, "a compatible definition"))
        except InvalidArgument as error:
            raise _in_compatible(error) from None
    return tuple(forms)


def _in_compatible(error: InvalidArgument) -> InvalidArgument:
    """The same refusal, saying it was one of the compatible definitions."""
    if "compatible" in error.message:
        return error
    return InvalidArgument(f"in compatible: {error.message}", code=error.code)


def check_definitions(definition: object, compatible: object) -> Definitions:
    """A call's ``definition`` and ``compatible``, checked: the definition first."""
    return (check_definition(definition), *check_compatible(compatible))


_NONE: frozenset[str] = frozenset()


def plain_hashes(forms: Definitions) -> tuple[str, frozenset[str]] | None:
    """``definition_hashes`` of the usual call, one digest and no others, with no
    coroutine; None for any other call."""
    if len(forms) == 1 and type(forms[0]) is str:
        return forms[0], _NONE
    return None


async def definition_hashes(forms: Definitions) -> tuple[str, frozenset[str]]:
    """The digest of the definition and the set of its compatible ones, from the checked
    ``forms``: the sources of callables among them are read in one worker-thread trip,
    never on the event loop; a source that cannot be read is ``INVALID_HASH``."""
    if any(not isinstance(form, str) for form in forms):
        digests = await anyio.to_thread.run_sync(_digests, forms)
    else:
        digests = tuple(str(form) for form in forms)
    return digests[0], frozenset(digests[1:])


def definition_hashes_blocking(forms: Definitions) -> tuple[str, frozenset[str]]:
    """``definition_hashes`` for blocking code: the sources are read in the caller's thread."""
    digests = _digests(forms)
    return digests[0], frozenset(digests[1:])


def _digests(forms: Definitions) -> tuple[str, ...]:
    digests = []
    for index, form in enumerate(forms):
        try:
            digests.append(form if isinstance(form, str) else definition_digest(form))
        except InvalidArgument as error:
            raise (error if index == 0 else _in_compatible(error)) from error.__cause__
    return tuple(digests)


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
