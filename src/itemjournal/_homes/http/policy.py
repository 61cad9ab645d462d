"""The decisions both middlewares make the same way about a request before and after its
application runs: which arguments a middleware takes, whether a request carries a usable
key, whether its body may be read, what its scope value is, and what the record says once
the application failed.

Each middleware reads the request and drives its application in its protocol's way, and
asks these functions what to do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from ..._model.errors import InvalidArgument
from ..._model.view import RecordView
from .keys import LABEL, MalformedKey, parse_key
from .problems import Answer, problem, too_large
from .responses import check_release

__all__ = [
    "DEFAULT_MAX_BODY",
    "NO_RESPONSE",
    "UNFINISHED",
    "check_options",
    "check_scope_value",
    "declared_too_large",
    "released",
    "request_key",
]

DEFAULT_MAX_BODY = 1024 * 1024
# Review reasons of an application that ended without a whole response.
NO_RESPONSE = "the application sent no response"
UNFINISHED = "the application left its response unfinished"


def check_options(
    *,
    given: int,
    scope: object,
    wait: float | None,
    max_body: int,
    release: Iterable[int],
) -> frozenset[int]:
    """Refuse what a middleware cannot mean (``given``: how many of ``location=`` and
    ``journal=`` came); the statuses its ``release`` holds."""
    if given != 1:
        raise InvalidArgument(
            "give the middleware exactly one of location= or journal=",
            code="INVALID_ARGUMENT",
        )
    if isinstance(scope, str) and not LABEL.fullmatch(scope):
        raise InvalidArgument(
            f"a fixed scope {scope!r} must match [A-Za-z0-9][A-Za-z0-9._-]{{0,79}}",
            code="INVALID_LABEL",
        )
    if wait is not None and (
        isinstance(wait, bool)
        or not isinstance(wait, (int, float))
        or not (math.isfinite(wait) and wait >= 0)
    ):
        raise InvalidArgument(
            f"wait is a number of seconds, at least 0, or None, not {wait!r}",
            code="INVALID_ARGUMENT",
        )
    if isinstance(max_body, bool) or not isinstance(max_body, int) or max_body < 0:
        raise InvalidArgument(
            f"max_body is a number of bytes, not {max_body!r}", code="INVALID_ARGUMENT"
        )
    # Statuses below 500 whose response releases the key instead of being kept.
    return check_release(release)


def request_key(
    values: Sequence[bytes | str], method: object, required: Callable[[], bool]
) -> str | None:
    """The key of a request whose ``Idempotency-Key`` fields are ``values``; None when it
    has none and none is ``required``; otherwise an ``Answer`` (400)."""
    if not values:
        if not required():
            return None
        raise Answer(
            problem(
                400,
                "idempotency-key-missing",
                "Idempotency-Key missing",
                f"{method} requests to this resource need an Idempotency-Key "
                'header, such as Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"',
            )
        )
    if len(values) > 1:
        raise Answer(
            problem(
                400,
                "idempotency-key-malformed",
                "Idempotency-Key malformed",
                "the request carries more than one Idempotency-Key",
            )
        )
    try:
        return parse_key(values[0])
    except MalformedKey as error:
        raise Answer(
            problem(400, "idempotency-key-malformed", "Idempotency-Key malformed", str(error))
        ) from None


def declared_too_large(declared: Iterable[bytes | str], max_body: int) -> None:
    """Refuse (413) a request whose ``Content-Length`` says it is over the limit, before
    reading any of it."""
    for value in declared:
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        if text.strip().isdigit() and int(text) > max_body:
            raise Answer(too_large(max_body))


def check_scope_value(value: object) -> str:
    """What a scope function returned, refused unless it is a non-empty str."""
    if not isinstance(value, str) or not value:
        raise TypeError(f"the scope function must return a non-empty str, not {value!r}")
    return value


def released(view: RecordView | None) -> bool:
    """Whether the request's record was just withdrawn: the key is free for a retry."""
    return (
        view is not None
        and view.status == "released"
        and bool(view.history)
        and view.history[-1].event == "withdrawn"
    )
