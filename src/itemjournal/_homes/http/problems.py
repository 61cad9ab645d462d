"""The middlewares' own answers: ``application/problem+json`` documents (RFC 9457).

Every refusal a middleware makes instead of running the application (a missing, malformed
or reused key, a body too large, a request in progress or in review, a journal out of
reach) and the 500 it sends after a failure is made here, as a ``Reply`` each protocol
sends in its own way, so that each answer has one wording and one status.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..._model.conflicts import ConflictError
from ..._model.errors import JournalError

__all__ = [
    "Answer",
    "Reply",
    "internal_error",
    "problem",
    "refusal",
    "too_large",
    "unavailable",
    "withdrawn_error",
]

_PROBLEM = "urn:itemjournal:problem:"


@dataclass(frozen=True)
class Reply:
    """A whole response: its status, its headers (lower-case names, latin-1 text) in
    order, and its body."""

    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""


def problem(
    status: int,
    slug: str,
    title: str,
    detail: str,
    *,
    headers: Iterable[tuple[str, str]] = (),
    members: dict[str, object] | None = None,
) -> Reply:
    document: dict[str, object] = {
        "type": _PROBLEM + slug,
        "title": title,
        "status": status,
        "detail": detail,
    }
    document.update(members or {})
    body = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return Reply(
        status,
        [
            ("content-type", "application/problem+json"),
            ("content-length", str(len(body))),
            *headers,
        ],
        body,
    )


class Answer(Exception):
    """A problem response to send instead of running the application."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(f"answered {reply.status}")
        self.reply = reply


def unavailable(error: JournalError) -> Reply:
    return problem(
        503,
        "journal-unavailable",
        "Idempotency journal unavailable",
        "the request was not run: its idempotency record could not be read or written",
        headers=[("retry-after", "5")],
        members={"code": error.code},
    )


def too_large(max_body: int) -> Reply:
    return problem(
        413,
        "request-too-large",
        "Request body too large",
        f"requests with an Idempotency-Key carry at most {max_body} bytes",
    )


def refusal(error: JournalError) -> Reply:
    """The answer to a claim the journal refused (the application did not run); a 503 for
    a refusal that is not about the request (the caller logs it)."""
    if error.code in ("INPUT_CHANGED", "DEFINITION_CHANGED"):
        return problem(
            422,
            "idempotency-key-reused",
            "Idempotency-Key reused",
            "this Idempotency-Key was used for a different request (method, path or body)",
            members={"code": error.code},
        )
    if error.code == "IN_PROGRESS":
        return problem(
            409,
            "request-in-progress",
            "Request in progress",
            "a request with this Idempotency-Key is still being processed; retry later",
            headers=[("retry-after", "1")],
            members={"code": error.code},
        )
    if error.code == "REVIEW_REQUIRED":
        view = error.view if isinstance(error, ConflictError) else None
        reason = view.review_reason if view is not None else None
        return problem(
            409,
            "review-required",
            "Request needs review",
            "the outcome of the request with this Idempotency-Key is uncertain and "
            f"needs review ({reason or 'no reason given'}); it will not run again until "
            "an operator resolves it",
            members={"code": error.code, "review_reason": reason},
        )
    return unavailable(error)


def internal_error() -> Reply:
    return problem(
        500,
        "internal-error",
        "Internal Server Error",
        "the request failed and its outcome is uncertain; the request with this "
        "Idempotency-Key needs review and will not run again until an operator resolves it",
    )


def withdrawn_error() -> Reply:
    """The 500 after an application raised ``Withdraw``: it failed, but it declared that
    nothing was sent, so its key was released and a retry runs the request again."""
    return problem(
        500,
        "request-withdrawn",
        "Request failed before any effect",
        "the request failed before it had any effect; its Idempotency-Key was released, "
        "and a retry with the same key runs it again",
    )
