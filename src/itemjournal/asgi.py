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
  ``key_identity(key, scope=...)`` gives the identity of a key, exactly as the middleware
  derives it; ``itemjournal show --idempotency-key KEY [--scope VALUE]`` shows its record.
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

The code lives in ``itemjournal._homes.asgi`` (the middleware, the request's key and
fingerprint, the stored response, the problem answers); this module is its public face.
"""

from ._homes.asgi import middleware as _middleware
from ._homes.asgi import protocol as _protocol
from ._homes.asgi.keys import DEFINITION, MAX_KEY_CHARS, MalformedKey, key_identity, parse_key
from ._homes.asgi.middleware import IdempotencyMiddleware, claim_of
from ._homes.asgi.responses import REPLAYED_HEADERS

__all__ = [
    "DEFINITION",
    "MAX_KEY_CHARS",
    "REPLAYED_HEADERS",
    "IdempotencyMiddleware",
    "MalformedKey",
    "claim_of",
    "key_identity",
    "parse_key",
]

# Not in ``__all__`` but public all the same: the middleware's signature names them, so
# code that annotates its own application or scope function may use them.
DEFAULT_MAX_BODY = _middleware.DEFAULT_MAX_BODY
Scope = _protocol.Scope
Message = _protocol.Message
Receive = _protocol.Receive
Send = _protocol.Send
ASGIApp = _protocol.ASGIApp
ScopeFunction = _protocol.ScopeFunction
