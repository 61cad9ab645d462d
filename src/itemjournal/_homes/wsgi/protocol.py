"""The shapes of the WSGI protocol (PEP 3333) the middleware speaks: an environ, the
``start_response`` callable, an application; how a whole reply is started, and how the
request's key fields, fingerprint and body are read from the environ.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from http import HTTPStatus
from types import TracebackType
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from ..http.keys import request_inputs as _inputs
from ..http.policy import declared_too_large
from ..http.problems import Answer, Reply, problem, too_large

__all__ = [
    "Environ",
    "ExcInfo",
    "ScopeFunction",
    "StartResponse",
    "WSGIApp",
    "key_fields",
    "logger",
    "read_body",
    "request_inputs",
    "send_reply",
    "status_line",
]

# The standard library's names for the shapes of PEP 3333, so that any typed WSGI
# application (Flask's, Django's) is one to a type checker.
Environ = WSGIEnvironment
WSGIApp = WSGIApplication
ExcInfo = tuple[type[BaseException], BaseException, TracebackType] | tuple[None, None, None]
ScopeFunction = Callable[[Environ], str]

# Named after the public module, so that logging configured for ``itemjournal.wsgi``
# catches what every room of the middleware logs.
logger = logging.getLogger("itemjournal.wsgi")

_CHUNK = 64 * 1024


def status_line(status: int) -> str:
    """``"201 Created"``: WSGI wants a reason phrase, which the stored response has not."""
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} Unknown"


def send_reply(
    start_response: StartResponse, reply: Reply, exc_info: ExcInfo | None = None
) -> list[bytes]:
    """Start ``reply`` (replacing a response not sent yet when ``exc_info`` is given) and
    give its body as the application's iterable."""
    start_response(status_line(reply.status), list(reply.headers), exc_info)
    return [reply.body]


def key_fields(environ: Environ) -> list[str]:
    """The ``Idempotency-Key`` field values (a server joins repeated fields with commas,
    which the key's syntax then refuses)."""
    value = environ.get("HTTP_IDEMPOTENCY_KEY")
    return [] if value is None else [str(value)]


def request_inputs(environ: Environ, body: bytes) -> dict[str, str | int]:
    """The request's fingerprint (``_homes.http.keys.request_inputs``), from its environ.

    The environ's path is the decoded bytes of the path as latin-1 text (PEP 3333): read
    as UTF-8 again, it is the text an ASGI server gives, so a request through either
    middleware has one fingerprint.
    """
    raw = (str(environ.get("SCRIPT_NAME", "")) + str(environ.get("PATH_INFO", ""))).encode(
        "latin-1", "replace"
    )
    target = raw.decode("utf-8", "replace")
    query = str(environ.get("QUERY_STRING", ""))
    return _inputs(str(environ.get("REQUEST_METHOD", "")), target, query, body)


def read_body(environ: Environ, max_body: int) -> bytes:
    """The whole request body, refused (413) beyond ``max_body``.

    With a ``Content-Length``, exactly that many bytes (a body that ends before is a
    400); without one, the stream to its end where the server marks it terminated
    (``wsgi.input_terminated``, a chunked request), otherwise nothing (PEP 3333). A read
    the server fails (the client left) goes on to the server: nothing was claimed yet.
    """
    length = str(environ.get("CONTENT_LENGTH") or "").strip()
    declared_too_large([length], max_body)
    stream = environ.get("wsgi.input")
    if stream is None:
        return b""
    chunks: list[bytes] = []
    size = 0
    if length.isdigit():
        wanted = int(length)
        while size < wanted:
            chunk = stream.read(min(_CHUNK, wanted - size))
            if not chunk:
                raise Answer(
                    problem(
                        400,
                        "request-incomplete",
                        "Request body incomplete",
                        f"the request body ended after {size} of its {wanted} bytes",
                    )
                )
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    if not environ.get("wsgi.input_terminated"):
        return b""
    while chunk := stream.read(_CHUNK):
        size += len(chunk)
        if size > max_body:
            raise Answer(too_large(max_body))
        chunks.append(chunk)
    return b"".join(chunks)
