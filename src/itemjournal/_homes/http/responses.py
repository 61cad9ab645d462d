"""A response as the journal keeps it: recorded while the application produces it, judged
(kept, released or in need of review), stored as a small JSON document in the record's
result, and turned back into a response for later duplicates.

The stored form is versioned (``"v"``) so that a record written by an older middleware is
either replayed or refused, never misread. Only the headers in ``REPLAYED_HEADERS`` are
kept: ``Set-Cookie`` and other per-response headers must never reach another client.
``replayable_response`` builds the same document, for a reconciliation that settles a
request with the response its client should get. Which statuses are kept and which
release the key (``RELEASED_STATUSES`` by default) is the middleware's ``release=``.
Both middlewares record, judge and replay through this module: only how a response
reaches them and how it leaves is theirs.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..._model.errors import InvalidArgument
from ..._model.records import MAX_RESULT_BYTES, result_problem
from .problems import Reply, problem

__all__ = [
    "RELEASED_STATUSES",
    "REPLAYED_HEADERS",
    "Recording",
    "Verdict",
    "check_release",
    "replayable_response",
    "stored_reply",
]

# Response headers stored with the response and replayed; nothing else is kept.
REPLAYED_HEADERS = frozenset(
    {
        "cache-control",
        "content-encoding",
        "content-language",
        "content-location",
        "content-type",
        "etag",
        "expires",
        "last-modified",
        "link",
        "location",
        "vary",
    }
)
_RESULT_VERSION = 1

# Responses that release the key instead of being kept, by default: the client may retry
# them with the same key. A request refused before it had any effect: not authenticated
# (401), not allowed (403), timed out or too early (408, 425), rate limited (429), in
# conflict with the resource's state (409), or failing validation (400, and 422 as
# frameworks answer a body that does not parse). Every other status below 500 is final
# and replayed (a 402 "card declined" among them); a 5xx needs review.
RELEASED_STATUSES = frozenset({400, 401, 403, 408, 409, 422, 425, 429})


def check_release(statuses: Iterable[int]) -> frozenset[int]:
    """The middleware's ``release=``: statuses from 100 to 499 (a 5xx needs review)."""
    if isinstance(statuses, (str, bytes)) or not isinstance(statuses, Iterable):
        raise InvalidArgument(
            f"release is a collection of HTTP statuses, not {type(statuses).__name__}",
            code="INVALID_ARGUMENT",
        )
    chosen = frozenset(statuses)
    for status in chosen:
        if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 499:
            raise InvalidArgument(
                f"release holds statuses from 100 to 499, not {status!r}: a 5xx response "
                "leaves the outcome uncertain and always needs review",
                code="INVALID_ARGUMENT",
            )
    return chosen


def _serialise(status: int, headers: list[tuple[str, str]], body: bytes) -> str:
    """The stored form of a response: JSON, its body as text when it is UTF-8."""
    document: dict[str, object] = {"v": _RESULT_VERSION, "status": status, "headers": headers}
    try:
        document["text"] = body.decode("utf-8")
    except UnicodeDecodeError:
        document["base64"] = base64.b64encode(body).decode("ascii")
    return json.dumps(document, ensure_ascii=False, separators=(",", ":"))


def _too_large(status: int, length: int) -> str:
    document = {"v": _RESULT_VERSION, "status": status, "length": length, "replayable": False}
    return json.dumps(document, separators=(",", ":"))


@dataclass(frozen=True)
class Verdict:
    """What the journal does with a whole response: ``complete`` it (``note`` is the
    receipt, ``result`` the stored response), ``withdraw`` the claim or mark it for
    ``review`` (``note`` is the reason)."""

    action: Literal["complete", "withdraw", "review"]
    note: str
    result: str | None = None


def answered_reason(status: int) -> str:
    """The review reason of a response that leaves the outcome uncertain (a 5xx)."""
    return f"the application answered {status}; whether its effect happened is unknown"


class Recording:
    """What the journal keeps of a response while the application produces it: the
    status, the replayed headers, a digest of the body and the body while it is small
    enough to store."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self._digest = hashlib.sha256()
        self._chunks: list[bytes] = []
        self._length = 0

    def start(self, status: int, headers: Iterable[tuple[str, str]]) -> None:
        """The response's status and headers (names in any case, latin-1 text)."""
        self.status = status
        self.headers = [
            (name.lower(), value) for name, value in headers if name.lower() in REPLAYED_HEADERS
        ]

    def add(self, chunk: bytes) -> None:
        self._digest.update(chunk)
        self._length += len(chunk)
        if self._length <= MAX_RESULT_BYTES:
            self._chunks.append(chunk)
        else:
            self._chunks.clear()

    def verdict(self, release: frozenset[int]) -> Verdict:
        """What the journal does with the whole response under the ``release`` policy."""
        if self.status >= 500:
            return Verdict("review", answered_reason(self.status))
        if self.status in release:  # refused before any effect: retry allowed
            return Verdict(
                "withdraw",
                f"the application answered {self.status}, a status that releases the key "
                "for a retry",
            )
        return Verdict("complete", self.receipt(), self.result())

    def receipt(self) -> str:
        return f"http {self.status} sha256:{self._digest.hexdigest()}"

    def result(self) -> str:
        if self._length <= MAX_RESULT_BYTES:
            stored = _serialise(self.status, self.headers, b"".join(self._chunks))
            if len(stored.encode("utf-8")) <= MAX_RESULT_BYTES:
                return stored
        return _too_large(self.status, self._length)


def stored_reply(result: str | None, receipt: str | None) -> Reply:
    """The stored response, to send again; or the 409 saying why it cannot be."""
    stored: dict[str, Any] | None = None
    if result is not None:
        try:
            loaded = json.loads(result)
        except ValueError:
            loaded = None
        if isinstance(loaded, dict) and loaded.get("v") == _RESULT_VERSION:
            stored = loaded
    if stored is None or stored.get("replayable") is False:
        if stored is None:
            detail = (
                "the request with this Idempotency-Key was completed, but its response was not kept"
            )
        else:
            detail = (
                f"the request with this Idempotency-Key was completed (status "
                f"{stored.get('status')}), but its response of {stored.get('length')} bytes "
                f"was too large to keep for replay (at most {MAX_RESULT_BYTES} bytes)"
            )
        return problem(
            409,
            "response-not-replayable",
            "Response not replayable",
            detail,
            members={"receipt": receipt},
        )
    if "text" in stored:
        body = str(stored["text"]).encode("utf-8")
    else:
        body = base64.b64decode(str(stored.get("base64", "")))
    headers = [(str(name), str(value)) for name, value in stored.get("headers", ())]
    headers.append(("content-length", str(len(body))))
    headers.append(("idempotent-replayed", "true"))
    return Reply(int(stored["status"]), headers, body)


def replayable_response(
    status: int,
    body: bytes | str = b"",
    *,
    headers: Mapping[str, str] | Iterable[tuple[str, str]] = (),
    content_type: str | None = None,
) -> str:
    """The stored form of a response, as the middleware keeps it, for ``result=``.

    A reconciliation that finds a request's effect happened settles it with the response
    its client should get: ``Happened(receipt, result=replayable_response(201, body,
    content_type="application/json"))``. The client's next retry with that key is then
    answered with exactly this status, these headers and these bytes (and
    ``Idempotent-Replayed: true``), as if the first request had answered it.

    ``body`` is bytes, or a str sent as UTF-8. ``headers`` are names in
    ``REPLAYED_HEADERS`` (any case) with their values, kept in order after
    ``content-type`` when ``content_type`` is given. The document is the stored format,
    version 1 (see ``itemjournal.asgi``); ``InvalidArgument`` for a status outside
    100-599, a header that is never replayed, or a response over the 64 KiB result limit.
    The ASGI and the WSGI middleware store and replay this one format.
    """
    if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
        raise InvalidArgument(
            f"status is an HTTP status from 100 to 599, not {status!r}", code="INVALID_ARGUMENT"
        )
    if isinstance(body, str):
        body = body.encode("utf-8")
    if not isinstance(body, bytes):
        raise InvalidArgument(
            f"body is bytes or a str, not {type(body).__name__}", code="INVALID_ARGUMENT"
        )
    pairs = [] if content_type is None else [("content-type", content_type)]
    pairs.extend(headers.items() if isinstance(headers, Mapping) else headers)
    kept: list[tuple[str, str]] = []
    for pair in pairs:
        name, value = pair
        if not isinstance(name, str) or not isinstance(value, str):
            raise InvalidArgument(
                f"a header is a (name, value) pair of str, not {pair!r}", code="INVALID_ARGUMENT"
            )
        if name.lower() not in REPLAYED_HEADERS:
            raise InvalidArgument(
                f"the header {name!r} is never replayed; replayed are: "
                + ", ".join(sorted(REPLAYED_HEADERS)),
                code="INVALID_ARGUMENT",
            )
        try:
            value.encode("latin-1")
        except UnicodeEncodeError:
            raise InvalidArgument(
                f"the value of the header {name!r} is not latin-1", code="INVALID_ARGUMENT"
            ) from None
        kept.append((name.lower(), value))
    stored = _serialise(status, kept, body)
    problem_text = result_problem(stored)
    if problem_text is not None:
        raise InvalidArgument(
            f"the response cannot be stored: {problem_text}", code="INVALID_ARGUMENT"
        )
    return stored
