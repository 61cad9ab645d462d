"""What a request with an ``Idempotency-Key`` becomes in the journal, whichever protocol
brought it.

The key is parsed here (RFC 8941 string or bare token); the record's identity is derived
from the scope value and the key (never the raw key), and its fingerprint from the method,
the target and the body. Everything here is pure: each middleware reads the request in
its protocol's way and hands over what it read, so that a request made through the ASGI
middleware and the same request through the WSGI one are one record.
"""

from __future__ import annotations

import hashlib
import json
import re

from ..._model.identity import Identity, check_label, definition_digest

__all__ = [
    "DEFAULT_SCOPE",
    "DEFINITION",
    "LABEL",
    "MAX_KEY_CHARS",
    "MalformedKey",
    "key_identity",
    "parse_key",
    "request_identity",
    "request_inputs",
]

MAX_KEY_CHARS = 255
# What the records of both middlewares name as the code performing the effect: one
# definition, so that a record written through one protocol is replayed through the other
# (its text stays the ASGI middleware's, which wrote the first records).
DEFINITION = definition_digest("itemjournal.asgi.IdempotencyMiddleware/1")
# A scope value that is already a valid journal label is used as it is.
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}")
# The scope value of a middleware given no ``scope``, and the program and job labels of
# its records.
DEFAULT_SCOPE = "default"
PROGRAM = "http"
JOB = "idempotency-key"
# A bare key: RFC 8941 token characters, also leading digits (bare UUIDs are common).
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z:/]+")


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
        key = _unquote(text)
    elif _TOKEN.fullmatch(text):
        key = text
    else:
        raise MalformedKey('the key must be a quoted string ("...") or a token')
    if not key:
        raise MalformedKey("the key is empty")
    if len(key) > MAX_KEY_CHARS:
        raise MalformedKey(f"the key has at most {MAX_KEY_CHARS} characters, got {len(key)}")
    return key


def _unquote(text: str) -> str:
    """The characters of an sf-string (``text`` starts with its opening quote)."""
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
            return "".join(chars)
        elif " " <= char <= "~":
            chars.append(char)
            at += 1
        else:
            raise MalformedKey("the key holds a character that is not printable ASCII")


def key_identity(
    key: str, *, scope: str = DEFAULT_SCOPE, program: str = PROGRAM, job: str = JOB
) -> Identity:
    """The identity of the record the middleware keeps for ``key`` in ``scope``.

    ``key`` is the key as ``parse_key`` reads it from the header (the characters of a
    quoted string, without its quotes); ``scope`` is the middleware's scope value: its
    fixed label, or what its scope function returned for the request (``"default"``
    without one). The identity is ``(<scope label>, "http", "idempotency-key",
    <digest>)``: the scope label is the scope value when that is a valid label, otherwise
    ``s-`` and 40 hex digits of its SHA-256; the digest is the SHA-256 (hex) of the compact
    JSON array ``[scope value, key]`` (ASCII escapes), so the raw key is never stored and
    one scope's key never meets another's. A key that is empty or longer than
    ``MAX_KEY_CHARS`` is ``MalformedKey``; ``program`` and ``job`` must be labels.
    """
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY_CHARS:
        raise MalformedKey(f"the key is a str of 1 to {MAX_KEY_CHARS} characters, not {key!r}")
    if not isinstance(scope, str) or not scope:
        raise MalformedKey(f"the scope value is a non-empty str, not {scope!r}")
    return Identity(
        _scope_label(scope),
        check_label(program, "program"),
        check_label(job, "job"),
        _item_label(scope, key),
    )


def request_identity(scope_value: str, key: str) -> Identity:
    """The identity of a request's record: ``key_identity``, the public recipe."""
    return key_identity(key, scope=scope_value)


def request_inputs(method: str, target: str, query: str, body: bytes) -> dict[str, str | int]:
    """The request's fingerprint: its method, a digest of its target (path and query) and
    of its body, and the body's length.

    ``target`` is the decoded path (mount point included) as text, ``query`` the raw query
    string with each byte as one character (latin-1), as an ASGI server gives them.
    """
    return {
        "method": method.upper(),
        "target": hashlib.sha256(f"{target}?{query}".encode("utf-8", "replace")).hexdigest(),
        "body": hashlib.sha256(body).hexdigest(),
        "length": len(body),
    }


def _scope_label(value: str) -> str:
    if LABEL.fullmatch(value):
        return value
    return "s-" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def _item_label(scope_value: str, key: str) -> str:
    joined = json.dumps([scope_value, key], ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(joined.encode("ascii")).hexdigest()
