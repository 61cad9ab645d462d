"""An ASGI middleware for the ``Idempotency-Key`` HTTP header, backed by a journal.

``IdempotencyMiddleware`` implements the IETF httpapi draft
(draft-ietf-httpapi-idempotency-key-header-07) for any ASGI application (Starlette,
FastAPI, or a bare ASGI callable). It needs nothing beyond anyio::

    app = IdempotencyMiddleware(app, location="sqlite:///var/lib/shop/journal.db",
                                scope=lambda scope: scope["state"]["user_id"])

For each request whose method is in ``methods`` (POST and PATCH by default):

* The ``Idempotency-Key`` header is an RFC 8941 string (``"..."`` with ``\\"`` and
  ``\\\\`` escapes) or a bare token (a bare UUID is fine), 1 to 255 characters of
  printable ASCII. Missing (when ``required``), repeated or malformed: 400.
* The request body is read whole, up to ``max_body`` bytes (413 beyond that), and
  handed to the application unchanged.
* The record's identity is ``(<scope label>, "http", "idempotency-key", <digest>)``,
  where the digest is the SHA-256 of the scope value and the key together: the raw key
  is never stored, and one scope's key never meets another's. ``scope`` is a fixed
  label, or a callable (sync or async) taking the ASGI scope and returning a string,
  for example the authenticated user's id; the journal's scope label is that string
  when it is a valid label, otherwise a digest of it. Without ``scope``, every client
  shares the label ``default``: use it only when keys cannot be guessed across users.
* The fingerprint (the record's inputs) is the method, the path with its query string,
  and the SHA-256 of the body. The same key with another fingerprint: 422.
* A request with the same key still in flight: 409 with ``Retry-After: 1``; with
  ``wait=seconds`` the duplicate waits that long for the first to settle.
* The first response passes through as the application streams it; its last body
  message is held until the journal has recorded the outcome, so a client that has the
  whole response can never race its own record. A response with status below 500
  completes the record: the receipt is ``"http <status> sha256:<body digest>"`` and the
  result is the response (status, the headers in ``REPLAYED_HEADERS`` and the body),
  replayed to every later duplicate with ``Idempotent-Replayed: true``. ``Set-Cookie``
  and other per-response headers are never stored nor replayed.
* The application finds the journal's claim with ``claim_of(request.scope)``: it passes
  the claim's ``key`` on to the services it calls, as their own idempotency key.
* A response whose serialised form exceeds the journal's 64 KiB result limit is
  completed but not replayable: a duplicate gets 409 saying so (and so does a record
  an operator resolved without a response).
* A 5xx response, an exception, or an application that ends without a complete
  response leaves the outcome uncertain: the record is marked ``needs_review``. An
  exception before the response started is answered 500 and then re-raised for the
  server to log, as Starlette's own error middleware does. A duplicate of a record
  that needs review: 409 naming the review's reason, until an operator resolves it.
* A journal that cannot be read or written: 503, and the application does not run.

Every error this middleware answers is ``application/problem+json`` (RFC 9457). Other
methods, websockets and requests that carry no key (when not ``required``) pass through
untouched.

Given ``location``, the middleware opens the journal at lifespan startup (or on the
first request when the server runs without lifespan) and closes it at lifespan
shutdown (or on ``await middleware.aclose()``). Given ``journal``, the caller owns it.
"""

from __future__ import annotations

import base64
import hashlib
import inspect
import json
import logging
import math
import re
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

import anyio

from ._journal.claim import Attempt
from ._journal.journal import Journal
from ._model.conflicts import ConflictError
from ._model.errors import InvalidArgument, JournalError
from ._model.identity import definition_digest
from ._model.records import MAX_RESULT_BYTES
from ._model.view import Claim

__all__ = [
    "DEFINITION",
    "MAX_KEY_CHARS",
    "REPLAYED_HEADERS",
    "IdempotencyMiddleware",
    "MalformedKey",
    "claim_of",
    "parse_key",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
ScopeFunction = Callable[[Scope], str | Awaitable[str]]

logger = logging.getLogger("itemjournal.asgi")

MAX_KEY_CHARS = 255
DEFAULT_MAX_BODY = 1024 * 1024
# What the records of this middleware name as the code performing the effect.
DEFINITION = definition_digest("itemjournal.asgi.IdempotencyMiddleware/1")
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
_PROGRAM = "http"
_JOB = "idempotency-key"
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}")
# A bare key: RFC 8941 token characters, also leading digits (bare UUIDs are common).
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z:/]+")
_PROBLEM = "urn:itemjournal:problem:"
_CLAIM_SCOPE_KEY = "itemjournal.claim"
# Server extensions that would let a response bypass the body messages we record.
_BYPASSING_EXTENSIONS = ("http.response.pathsend", "http.response.zerocopy")


class MalformedKey(ValueError):
    """The ``Idempotency-Key`` header is not an RFC 8941 string or token of ≤ 255 chars."""


def parse_key(value: bytes | str) -> str:
    """The key an ``Idempotency-Key`` field value carries, or ``MalformedKey``.

    The value is an RFC 8941 sf-string (``"..."``, printable ASCII, ``\\"`` and ``\\\\``
    escaped) or, leniently, a bare token (sf-token characters, a leading digit allowed,
    so a bare UUID is accepted); surrounding spaces are ignored; parameters
    are refused. The key has 1 to ``MAX_KEY_CHARS`` characters.
    """
    if isinstance(value, bytes):
        try:
            text = value.decode("ascii")
        except UnicodeDecodeError:
            raise MalformedKey("the key must be ASCII") from None
    else:
        text = value
    text = text.strip(" ")
    if text.startswith('"'):
        chars: list[str] = []
        at = 1
        while True:
            if at >= len(text):
                raise MalformedKey("the quoted key is not closed")
            char = text[at]
            if char == "\\":
                if at + 1 >= len(text) or text[at + 1] not in '"\\':
                    raise MalformedKey('only \\" and \\\\ may be escaped in the key')
                chars.append(text[at + 1])
                at += 2
            elif char == '"':
                if at + 1 != len(text):
                    raise MalformedKey("nothing may follow the quoted key")
                break
            elif " " <= char <= "~":
                chars.append(char)
                at += 1
            else:
                raise MalformedKey("the key holds a character that is not printable ASCII")
        key = "".join(chars)
    elif _TOKEN.fullmatch(text):
        key = text
    else:
        raise MalformedKey('the key must be a quoted string ("...") or a token')
    if not key:
        raise MalformedKey("the key is empty")
    if len(key) > MAX_KEY_CHARS:
        raise MalformedKey(f"the key has at most {MAX_KEY_CHARS} characters, got {len(key)}")
    return key


def claim_of(scope: Scope) -> Claim | None:
    """The journal's claim on the request being handled (None without a key).

    Hand ``claim_of(request.scope).key`` to a downstream service as *its* idempotency
    key, so that even an operator-approved retry cannot repeat the effect there.
    """
    claim = scope.get(_CLAIM_SCOPE_KEY)
    return claim if isinstance(claim, Claim) else None


def _scope_label(value: str) -> str:
    if _LABEL.fullmatch(value):
        return value
    return "s-" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def _item_label(scope_value: str, key: str) -> str:
    joined = json.dumps([scope_value, key], ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(joined.encode("ascii")).hexdigest()


def _header(scope: Scope, name: bytes) -> list[bytes]:
    return [value for key, value in scope.get("headers", ()) if key.lower() == name]


class _Answer(Exception):
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
        await _send_problem(
            send,
            self.status,
            self.slug,
            self.title,
            self.detail,
            headers=self.headers,
            members=self.members,
        )


async def _send_problem(
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


class _Recorder:
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


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the application the body already read, then the client's."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class IdempotencyMiddleware:
    """Answer duplicate requests from the journal instead of running them again.

    See the module's documentation for the whole contract.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        location: str | None = None,
        journal: Journal | None = None,
        scope: str | ScopeFunction | None = None,
        methods: Iterable[str] = ("POST", "PATCH"),
        required: bool | Callable[[Scope], bool] = True,
        wait: float | None = None,
        max_body: int = DEFAULT_MAX_BODY,
    ) -> None:
        if (location is None) == (journal is None):
            raise InvalidArgument(
                "give the middleware exactly one of location= or journal=",
                code="INVALID_ARGUMENT",
            )
        if isinstance(scope, str) and not _LABEL.fullmatch(scope):
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
        self.app = app
        self._location = location
        self._journal = journal
        self._scope = scope
        self._methods = frozenset(method.upper() for method in methods)
        self._required = required
        self._wait = wait
        self._max_body = max_body
        self._opening: anyio.Lock | None = None

    @property
    def journal(self) -> Journal | None:
        """The journal in use (None while one given by ``location`` is not open)."""
        return self._journal

    async def open(self) -> Journal:
        """The journal, opening the one at ``location`` once, whoever asks first."""
        if self._journal is not None:
            return self._journal
        if self._opening is None:
            self._opening = anyio.Lock()
        async with self._opening:
            if self._journal is None:
                assert self._location is not None
                self._journal = await Journal.open(self._location)
            return self._journal

    async def aclose(self) -> None:
        """Close a journal this middleware opened (a given ``journal`` stays open)."""
        if self._location is None or self._journal is None:
            return
        journal, self._journal = self._journal, None
        await journal.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
        elif scope["type"] == "http" and str(scope.get("method", "")).upper() in self._methods:
            await self._http(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    # ------------------------------------------------------------------ lifespan

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._location is None:
            await self.app(scope, receive, send)
            return

        async def lifespan_send(message: Message) -> None:
            kind = message["type"]
            if kind == "lifespan.startup.complete":
                try:
                    await self.open()
                except Exception as error:
                    logger.exception("itemjournal could not open %s", self._location)
                    await send(
                        {
                            "type": "lifespan.startup.failed",
                            "message": f"itemjournal could not open {self._location}: {error}",
                        }
                    )
                    return
            elif kind in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                with anyio.CancelScope(shield=True):
                    await self.aclose()
            await send(message)

        try:
            await self.app(scope, receive, lifespan_send)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.aclose()
            raise

    # ------------------------------------------------------------------ requests

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            prepared = await self._prepare(scope, receive)
        except _Answer as answer:
            await answer.send(send)
            return
        if prepared is None:  # no key, and none required
            await self.app(scope, receive, send)
            return
        if isinstance(prepared, _Gone):
            return
        identity, inputs, body = prepared
        try:
            journal = await self.open()
        except JournalError as error:
            logger.exception("itemjournal could not open %s", self._location)
            await _unavailable(error).send(send)
            return
        app_scope = dict(scope)
        extensions = scope.get("extensions")
        if isinstance(extensions, dict):
            app_scope["extensions"] = {
                name: value
                for name, value in extensions.items()
                if name not in _BYPASSING_EXTENSIONS
            }
        recorder: _Recorder | None = None
        entered = False
        try:
            async with journal.claim(identity, inputs, DEFINITION, wait=self._wait) as attempt:
                entered = True
                if attempt.reused:
                    await _replay(send, attempt.result, attempt.receipt)
                    return
                recorder = _Recorder(send, attempt)
                app_scope[_CLAIM_SCOPE_KEY] = attempt.claim
                await self.app(app_scope, _replaying(body, receive), recorder.send)
                if not recorder.started:
                    await attempt.mark_review("the application sent no response")
                elif not recorder.finished:
                    await attempt.mark_review("the application left its response unfinished")
                elif recorder.held is not None:
                    await attempt.mark_review(
                        f"the application answered {recorder.status}; "
                        "whether its effect happened is unknown"
                    )
        except JournalError as error:
            if entered:
                await _after_failure(send, recorder)
                raise
            await _refusal(error).send(send)
            return
        except Exception:
            await _after_failure(send, recorder)
            raise
        if recorder is not None:
            if not recorder.started:
                await _internal_error(send)
            elif recorder.held is not None:
                await send(recorder.held)

    async def _prepare(
        self, scope: Scope, receive: Receive
    ) -> tuple[tuple[str, str, str, str], dict[str, str | int], bytes] | _Gone | None:
        """Identity, inputs and body of a request with a key; None when it has none."""
        values = _header(scope, b"idempotency-key")
        if not values:
            required = self._required(scope) if callable(self._required) else self._required
            if not required:
                return None
            raise _Answer(
                400,
                "idempotency-key-missing",
                "Idempotency-Key missing",
                f"{scope.get('method')} requests to this resource need an Idempotency-Key "
                'header, such as Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"',
            )
        if len(values) > 1:
            raise _Answer(
                400,
                "idempotency-key-malformed",
                "Idempotency-Key malformed",
                "the request carries more than one Idempotency-Key",
            )
        try:
            key = parse_key(values[0])
        except MalformedKey as error:
            raise _Answer(
                400, "idempotency-key-malformed", "Idempotency-Key malformed", str(error)
            ) from None
        scope_value = await self._scope_value(scope)
        body = await self._read_body(scope, receive)
        if body is None:
            return _Gone()
        identity = (_scope_label(scope_value), _PROGRAM, _JOB, _item_label(scope_value, key))
        target = str(scope.get("root_path", "")) + str(scope.get("path", ""))
        query = bytes(scope.get("query_string", b"")).decode("latin-1")
        inputs: dict[str, str | int] = {
            "method": str(scope["method"]).upper(),
            "target": hashlib.sha256(f"{target}?{query}".encode("utf-8", "replace")).hexdigest(),
            "body": hashlib.sha256(body).hexdigest(),
            "length": len(body),
        }
        return identity, inputs, body

    async def _scope_value(self, scope: Scope) -> str:
        if self._scope is None:
            return "default"
        if isinstance(self._scope, str):
            return self._scope
        value = self._scope(scope)
        if inspect.isawaitable(value):
            value = await value
        if not isinstance(value, str) or not value:
            raise TypeError(f"the scope function must return a non-empty str, not {value!r}")
        return value

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole request body (None if the client left), refused beyond the limit."""
        too_large = _Answer(
            413,
            "request-too-large",
            "Request body too large",
            f"requests with an Idempotency-Key carry at most {self._max_body} bytes",
        )
        for declared in _header(scope, b"content-length"):
            if declared.strip().isdigit() and int(declared) > self._max_body:
                raise too_large
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            if message["type"] != "http.request":
                continue
            chunk = bytes(message.get("body", b""))
            size += len(chunk)
            if size > self._max_body:
                raise too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _Gone:
    """The client disconnected before its request body arrived: nothing to answer."""


def _unavailable(error: JournalError) -> _Answer:
    return _Answer(
        503,
        "journal-unavailable",
        "Idempotency journal unavailable",
        "the request was not run: its idempotency record could not be read or written",
        headers=[(b"retry-after", b"5")],
        members={"code": error.code},
    )


def _refusal(error: JournalError) -> _Answer:
    """The answer to a claim the journal refused (the application did not run)."""
    if error.code in ("INPUT_CHANGED", "DEFINITION_CHANGED"):
        return _Answer(
            422,
            "idempotency-key-reused",
            "Idempotency-Key reused",
            "this Idempotency-Key was used for a different request (method, path or body)",
            members={"code": error.code},
        )
    if error.code == "IN_PROGRESS":
        return _Answer(
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
        return _Answer(
            409,
            "review-required",
            "Request needs review",
            "the outcome of the request with this Idempotency-Key is uncertain and "
            f"needs review ({reason or 'no reason given'}); it will not run again until "
            "an operator resolves it",
            members={"code": error.code, "review_reason": reason},
        )
    logger.error("itemjournal refused an idempotent request: %s", error)
    return _unavailable(error)


async def _replay(send: Send, result: str | None, receipt: str | None) -> None:
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
        await _send_problem(
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


async def _internal_error(send: Send) -> None:
    await _send_problem(
        send,
        500,
        "internal-error",
        "Internal Server Error",
        "the request failed and its outcome is uncertain; the request with this "
        "Idempotency-Key needs review and will not run again until an operator resolves it",
    )


async def _after_failure(send: Send, recorder: _Recorder | None) -> None:
    """The application raised: answer what the client has not been answered yet.

    The application's exception is what goes on to the server: a client that left
    meanwhile must not replace it with an error of its own.
    """
    try:
        if recorder is None or not recorder.started:
            await _internal_error(send)
        elif recorder.held is not None:
            await send(recorder.held)
    except Exception:
        logger.debug("could not answer a failed idempotent request", exc_info=True)
