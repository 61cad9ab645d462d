"""A response as the journal keeps it: recorded while the application streams it, stored
as a small JSON document in the record's result, and replayed to later duplicates.

The stored form is versioned (``"v"``) so that a record written by an older middleware is
either replayed or refused, never misread. Only the headers in ``REPLAYED_HEADERS`` are
kept: ``Set-Cookie`` and other per-response headers must never reach another client.
``replayable_response`` builds the same document, for a reconciliation that settles a
request with the response its client should get. Which statuses are kept and which
release the key (``RELEASED_STATUSES`` by default) is the middleware's ``release=``.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from ..._journal.claim import Attempt
from ..._model.errors import InvalidArgument
from ..._model.records import MAX_RESULT_BYTES, result_problem
from .problems import send_problem
from .protocol import Message, Send

__all__ = [
    "RELEASED_STATUSES",
    "REPLAYED_HEADERS",
    "Recorder",
    "check_release",
    "replay",
    "replayable_response",
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


class Recorder:
    """Passes the application's response on while keeping what the journal needs."""

    def __init__(
        self, send: Send, attempt: Attempt, release: frozenset[int] = RELEASED_STATUSES
    ) -> None:
        self._send = send
        self.attempt = attempt
        self._release = release
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.started = False
        self.finished = False
        self.held: Message | None = None  # the last body message of a 5xx response
        self._digest = hashlib.sha256()
        self._chunks: list[bytes] = []
        self._length = 0

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = int(message["status"])
            self.headers = [
                (name.decode("latin-1").lower(), value.decode("latin-1"))
                for name, value in message.get("headers", ())
                if name.decode("latin-1").lower() in REPLAYED_HEADERS
            ]
            self.started = True
            await self._send(message)
        elif kind == "http.response.body" and not self.finished:
            chunk = bytes(message.get("body", b""))
            self._digest.update(chunk)
            self._length += len(chunk)
            if self._length <= MAX_RESULT_BYTES:
                self._chunks.append(chunk)
            else:
                self._chunks.clear()
            if message.get("more_body", False):
                await self._send(message)
                return
            self.finished = True
            if self.status >= 500:  # uncertain: marked for review once the app is done
                self.held = message
                return
            if self.status in self._release:  # refused before any effect: retry allowed
                await self.attempt.withdraw(
                    f"the application answered {self.status}, a status that releases "
                    "the key for a retry"
                )
            else:
                await self.attempt.complete(self.receipt(), self.result())
            await self._send(message)
        else:
            await self._send(message)

    def receipt(self) -> str:
        return f"http {self.status} sha256:{self._digest.hexdigest()}"

    def result(self) -> str:
        if self._length <= MAX_RESULT_BYTES:
            stored = _serialise(self.status, self.headers, b"".join(self._chunks))
            if len(stored.encode("utf-8")) <= MAX_RESULT_BYTES:
                return stored
        return _too_large(self.status, self._length)


async def replay(send: Send, result: str | None, receipt: str | None) -> None:
    """Send the stored response again, or say why it cannot be."""
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
        await send_problem(
            send,
            409,
            "response-not-replayable",
            "Response not replayable",
            detail,
            members={"receipt": receipt},
        )
        return
    if "text" in stored:
        body = str(stored["text"]).encode("utf-8")
    else:
        body = base64.b64decode(str(stored.get("base64", "")))
    headers = [
        (str(name).encode("latin-1"), str(value).encode("latin-1"))
        for name, value in stored.get("headers", ())
    ]
    headers.append((b"content-length", str(len(body)).encode("ascii")))
    headers.append((b"idempotent-replayed", b"true"))
    await send({"type": "http.response.start", "status": int(stored["status"]), "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


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
    problem = result_problem(stored)
    if problem is not None:
        raise InvalidArgument(f"the response cannot be stored: {problem}", code="INVALID_ARGUMENT")
    return stored
