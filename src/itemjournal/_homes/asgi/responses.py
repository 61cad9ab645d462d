"""A response as the journal keeps it: recorded while the application streams it, stored
as a small JSON document in the record's result, and replayed to later duplicates.

The stored form is versioned (``"v"``) so that a record written by an older middleware is
either replayed or refused, never misread. Only the headers in ``REPLAYED_HEADERS`` are
kept: ``Set-Cookie`` and other per-response headers must never reach another client.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

from ..._journal.claim import Attempt
from ..._model.records import MAX_RESULT_BYTES
from .problems import send_problem
from .protocol import Message, Send

__all__ = ["REPLAYED_HEADERS", "Recorder", "replay"]

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

    def __init__(self, send: Send, attempt: Attempt) -> None:
        self._send = send
        self._attempt = attempt
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
            await self._attempt.complete(self.receipt(), self.result())
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
