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
  whole response can never race its own record. A response with status below 500 is
  final unless its status is in ``release``: it completes the record, the receipt is
  ``"http <status> sha256:<body digest>"`` and the result is the response (status, the
  headers in ``REPLAYED_HEADERS`` and the body), replayed to every later duplicate with
  ``Idempotent-Replayed: true``. ``Set-Cookie`` and other per-response headers are
  never stored nor replayed.
* A response whose status is in ``release`` is not kept: it releases the key (the claim
  is withdrawn, history event ``withdrawn``, the reason naming the status), and a retry
  with the same key runs the application again. The default, ``RELEASED_STATUSES``,
  follows the IETF draft and the practice of payment APIs, which keep a response only
  once the request began to act: 401 and 403 (not authenticated, not allowed), 408
  and 425 (timed out, too early), 429 (rate limited), 409 (a conflict with the
  resource's state) and the validation failures 400 and 422 (422 is what FastAPI and
  other frameworks answer for a body that does not parse, before any handler runs).
  They are answers to a request that had no effect yet; kept, a 429 or a 401 would
  stick to the key for good. Every other status below 500 is final: a 402 (a declined
  card) is replayed, as is a 404. An application that answers 400, 409 or 422 *after*
  its effect must pass its own ``release`` (``release=()`` keeps every status below
  500). ``release`` holds statuses from 100 to 499: a 5xx always needs review.
* A handler that raises ``itemjournal.Withdraw(reason)`` declares that nothing was sent:
  the key is released the same way (the reason is the one it gave), and the exception
  goes on to the server. The client gets the framework's 500 (Starlette's, say), or, from
  a bare application that sent nothing, a 500 problem ``request-withdrawn`` saying a
  retry runs the request again. Let the exception reach the middleware: an exception
  handler that turns it into a 5xx response makes that response need review. Raise it
  only where nothing was sent.
* The application finds the journal's claim with ``claim_of(request.scope)``: it passes
  the claim's ``key`` on to the services it calls, as their own idempotency key.
* A response whose serialised form exceeds the journal's 64 KiB result limit is
  completed but not replayable: a duplicate gets 409 saying so (and so does a record
  an operator resolved without a response, or with a result that is not a stored
  response).

The stored response, version 1, is the record's ``result``: a JSON object
``{"v": 1, "status": <int>, "headers": [[<name>, <value>], ...], "text": <body>}``, where
the header names are lowercase and among ``REPLAYED_HEADERS``, and the body is ``text``
when it is UTF-8 or ``"base64"`` (its bytes in base64) when it is not. A response too
large to keep is ``{"v": 1, "status": ..., "length": ..., "replayable": false}``. A
duplicate is answered with that status, those headers in that order, ``content-length``,
``Idempotent-Replayed: true`` and the body's very bytes. A later format will carry another
``"v"``; a middleware answers a version it does not know with 409, never misreading it.
``replayable_response(status, body, headers=..., content_type=...)`` builds this
document, so that a reconciliation that finds a request's effect happened can settle it
with the response its client should get::

    async def check(view):
        charge = await provider.find_charge(idempotency_key=view.key)
        if charge is None:
            return Unknown("no charge under this key")
        body = json.dumps({"order": charge.order, "charge": charge.id})
        return Happened(charge.id, result=replayable_response(
            201, body, content_type="application/json"))

    await journal.reconcile(check, scope=...)

The client's next retry with that key gets exactly that response, replayed.
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

The code lives in ``itemjournal._homes.asgi`` (the middleware, reading the request and
streaming the response) and ``itemjournal._homes.http`` (the policy it shares with
``itemjournal.wsgi``: the key and fingerprint, the stored response, the problem answers);
this module is its public face.
"""

from ._homes.asgi import protocol as _protocol
from ._homes.asgi.middleware import IdempotencyMiddleware, claim_of
from ._homes.http import policy as _policy
from ._homes.http.keys import DEFINITION, MAX_KEY_CHARS, MalformedKey, key_identity, parse_key
from ._homes.http.responses import RELEASED_STATUSES, REPLAYED_HEADERS, replayable_response

__all__ = [
    "DEFINITION",
    "MAX_KEY_CHARS",
    "RELEASED_STATUSES",
    "REPLAYED_HEADERS",
    "IdempotencyMiddleware",
    "MalformedKey",
    "claim_of",
    "key_identity",
    "parse_key",
    "replayable_response",
]

# Not in ``__all__`` but public all the same: the middleware's signature names them, so
# code that annotates its own application or scope function may use them.
DEFAULT_MAX_BODY = _policy.DEFAULT_MAX_BODY
Scope = _protocol.Scope
Message = _protocol.Message
Receive = _protocol.Receive
Send = _protocol.Send
ASGIApp = _protocol.ASGIApp
ScopeFunction = _protocol.ScopeFunction
