"""What the middleware reads of an ASGI request for the journal: its header fields and
its fingerprint, from the scope. What they become (the key, the identity, the inputs) is
the shared policy's, in ``_homes.http.keys``; its names are also reachable from here.
"""

from __future__ import annotations

from ..http.keys import (
    DEFAULT_SCOPE,
    DEFINITION,
    JOB,
    LABEL,
    MAX_KEY_CHARS,
    PROGRAM,
    MalformedKey,
    key_identity,
    parse_key,
    request_identity,
)
from ..http.keys import request_inputs as _inputs
from .protocol import Scope

__all__ = [
    "DEFAULT_SCOPE",
    "DEFINITION",
    "JOB",
    "LABEL",
    "MAX_KEY_CHARS",
    "PROGRAM",
    "MalformedKey",
    "header",
    "key_identity",
    "parse_key",
    "request_identity",
    "request_inputs",
]


def header(scope: Scope, name: bytes) -> list[bytes]:
    """Every value of the request header ``name`` (lower case), in order."""
    return [value for key, value in scope.get("headers", ()) if key.lower() == name]


def request_inputs(scope: Scope, body: bytes) -> dict[str, str | int]:
    """The request's fingerprint (``_homes.http.keys.request_inputs``), from its scope."""
    target = str(scope.get("root_path", "")) + str(scope.get("path", ""))
    query = bytes(scope.get("query_string", b"")).decode("latin-1")
    return _inputs(str(scope["method"]), target, query, body)
