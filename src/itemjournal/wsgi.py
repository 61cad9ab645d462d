"""A WSGI middleware for the ``Idempotency-Key`` HTTP header, backed by a journal.

``IdempotencyMiddleware`` is the twin of ``itemjournal.asgi.IdempotencyMiddleware`` for
any WSGI application (Flask, Django, or a bare WSGI callable), on the blocking journal
(``itemjournal.sync``). It needs nothing beyond the core::

    app.wsgi_app = IdempotencyMiddleware(app.wsgi_app,
                                         location="sqlite:///var/lib/shop/journal.db",
                                         scope=lambda environ: environ["REMOTE_USER"])

Both middlewares apply one policy, documented in ``itemjournal.asgi``: the same key
syntax, identity (``key_identity``) and fingerprint (method, path with query, body), the
same statuses (400 missing or malformed key, 413 body over ``max_body``, 422 key reused
for another request, 409 in progress with ``Retry-After: 1`` or ``wait=seconds``, 409
in review, 503 journal unreachable), the same ``release=`` policy (``RELEASED_STATUSES``
by default; a 5xx needs review), the same stored response (format version 1, built by
``replayable_response``) replayed with ``Idempotent-Replayed: true``, and the same
``application/problem+json`` answers. A record written through one middleware is replayed
through the other on the same location.

What WSGI changes:

* ``scope`` is a fixed label or a function of the WSGI environ returning a str (say,
  ``environ["REMOTE_USER"]`` or what an authentication middleware put there);
  ``required`` may be a function of the environ too.
* The body is read whole (``CONTENT_LENGTH`` bytes, or to its end for a chunked request
  the server marks ``wsgi.input_terminated``) and handed to the application as a fresh
  ``wsgi.input`` with its ``CONTENT_LENGTH``. A body shorter than its ``Content-Length``
  is a 400; a read the server fails (the client left) goes on to the server, with
  nothing claimed.
* The application finds its claim with ``claim_of(environ)``: ``request.environ`` in
  Flask, ``request.META`` in Django.
* The response passes through as the application's iterable yields it, with its last
  chunk held until the journal has recorded the outcome (the whole body of a response
  of one chunk, as Flask and Django give). What the legacy ``write()`` callable sends
  goes out at once and is recorded. A ``wsgi.file_wrapper`` response is iterated, not
  sent by the server's file transfer, so that its bytes are recorded.
* The server closing the response before the application finished it (the client left
  mid-stream) leaves the outcome unknown: the record needs review, the reason saying so.
* An application that raises before any byte went out: the record needs review (or,
  for ``itemjournal.Withdraw``, its key is released), the exception is logged on the
  ``itemjournal.wsgi`` logger with its traceback, and the client gets the middleware's
  500 problem (``internal-error``, or ``request-withdrawn``), replacing the headers the
  application may have started (PEP 3333 ``exc_info``). A WSGI server answers an
  exception with a 500 of its own, which would not tell the client whether a retry runs
  again. Once bytes went out, the exception goes on to the server, which ends the
  connection. ``KeyboardInterrupt``, ``SystemExit`` (gunicorn's worker timeout) and
  other ``BaseException`` always go on, after the record is marked. Flask and Django
  turn a view's exception into a 500 response of their own, which needs review like any
  5xx: for a view's ``Withdraw`` to release its key, let it reach the middleware
  (Flask's ``PROPAGATE_EXCEPTIONS = True``, Django's ``DEBUG_PROPAGATE_EXCEPTIONS``).

Given ``location``, the middleware opens its ``itemjournal.sync.Journal`` on the first
request that needs it in each process, whichever thread comes first, so it works under
gunicorn's sync and threaded workers, with or without ``--preload`` (a journal opened
before the fork, by ``middleware.open()`` at import, serves the children too);
``middleware.close()`` closes it. Given ``journal`` (an ``itemjournal.sync.Journal``),
the caller owns it. A worker killed mid-request leaves its claim ``started``; the next
duplicate finds its owner gone and the record in review (409), never runs it again.

The code lives in ``itemjournal._homes.wsgi`` (the middleware, reading the request and
carrying the response) and ``itemjournal._homes.http`` (the policy shared with
``itemjournal.asgi``); this module is its public face.
"""

from ._homes.http import policy as _policy
from ._homes.http.keys import DEFINITION, MAX_KEY_CHARS, MalformedKey, key_identity, parse_key
from ._homes.http.responses import RELEASED_STATUSES, REPLAYED_HEADERS, replayable_response
from ._homes.wsgi import protocol as _protocol
from ._homes.wsgi.middleware import IdempotencyMiddleware, claim_of

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
Environ = _protocol.Environ
StartResponse = _protocol.StartResponse
WSGIApp = _protocol.WSGIApp
ScopeFunction = _protocol.ScopeFunction
