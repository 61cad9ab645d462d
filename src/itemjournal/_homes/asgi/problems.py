"""The middleware's own answers: ``application/problem+json`` documents (RFC 9457).

Every refusal the middleware makes instead of running the application (a malformed or
reused key, a request in progress or in review, a journal out of reach) and the 500 it
sends after a failure is made here, so that each has one wording and one status.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from ..._model.conflicts import ConflictError
from ..._model.errors import JournalError
from .protocol import Send, logger

__all__ = [
    "Answer",
    "internal_error",
    "refusal",
    "send_problem",
    "unavailable",
    "withdrawn_error",
]

_PROBLEM = "urn:itemjournal:problem:"


class Answer(Exception):
    """A problem response to send instead of running the application."""

    def __init__(
        self,
        status: int,
        slug: str,
        title: str,
        detail: str,
        *,
        headers: Iterable[tuple[bytes, bytes]] = (),
        members: dict[str, object] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.slug = slug
        self.title = title
        self.detail = detail
        self.headers = list(headers)
        self.members = members or {}

    async def send(self, send: Send) -> None:
        await send_problem(
            send,
            self.status,
            self.slug,
            self.title,
            self.detail,
            headers=self.headers,
            members=self.members,
        )


async def send_problem(
    send: Send,
    status: int,
    slug: str,
    title: str,
    detail: str,
    *,
    headers: Iterable[tuple[bytes, bytes]] = (),
    members: dict[str, object] | None = None,
) -> None:
    document: dict[str, object] = {
        "type": _PROBLEM + slug,
        "title": title,
        "status": status,
        "detail": detail,
    }
    document.update(members or {})
    body = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/problem+json"),
                (b"content-length", str(len(body)).encode("ascii")),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


def unavailable(error: JournalError) -> Answer:
    return Answer(
        503,
        "journal-unavailable",
        "Idempotency journal unavailable",
        "the request was not run: its idempotency record could not be read or written",
        headers=[(b"retry-after", b"5")],
        members={"code": error.code},
    )


def refusal(error: JournalError) -> Answer:
    """The answer to a claim the journal refused (the application did not run)."""
    if error.code in ("INPUT_CHANGED", "DEFINITION_CHANGED"):
        return Answer(
            422,
            "idempotency-key-reused",
            "Idempotency-Key reused",
            "this Idempotency-Key was used for a different request (method, path or body)",
            members={"code": error.code},
        )
    if error.code == "IN_PROGRESS":
        return Answer(
            409,
            "request-in-progress",
            "Request in progress",
            "a request with this Idempotency-Key is still being processed; retry later",
            headers=[(b"retry-after", b"1")],
            members={"code": error.code},
        )
    if error.code == "REVIEW_REQUIRED":
        view = error.view if isinstance(error, ConflictError) else None
        reason = view.review_reason if view is not None else None
        return Answer(
            409,
            "review-required",
            "Request needs review",
            "the outcome of the request with this Idempotency-Key is uncertain and "
            f"needs review ({reason or 'no reason given'}); it will not run again until "
            "an operator resolves it",
            members={"code": error.code, "review_reason": reason},
        )
    logger.error("itemjournal refused an idempotent request: %s", error)
    return unavailable(error)


async def internal_error(send: Send) -> None:
    await send_problem(
        send,
        500,
        "internal-error",
        "Internal Server Error",
        "the request failed and its outcome is uncertain; the request with this "
        "Idempotency-Key needs review and will not run again until an operator resolves it",
    )


async def withdrawn_error(send: Send) -> None:
    """The 500 after an application raised ``Withdraw``: it failed, but it declared that
    nothing was sent, so its key was released and a retry runs the request again."""
    await send_problem(
        send,
        500,
        "request-withdrawn",
        "Request failed before any effect",
        "the request failed before it had any effect; its Idempotency-Key was released, "
        "and a retry with the same key runs it again",
    )
