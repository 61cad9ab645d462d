"""What stands in front of every request: only GET and HEAD, the host check (without a
token: a page of another site cannot reach the viewer through DNS rebinding), the token
check (with one: Bearer for scripts, the password of HTTP Basic for browsers), and the
security headers on every response."""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import re
from typing import Final

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..._model.errors import InvalidArgument
from .templates import Templates

ALLOWED_METHODS: Final = ("GET", "HEAD")

SECURITY_HEADERS: Final = (
    (
        "content-security-policy",
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'",
    ),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
    ("x-frame-options", "DENY"),
    ("cross-origin-opener-policy", "same-origin"),
    ("cross-origin-resource-policy", "same-origin"),
    ("cache-control", "no-store"),
)


_TOKEN: Final = re.compile(r"[\x21-\x7e]+")  # visible ASCII: fits any header unchanged
_LOOPBACK_NAMES: Final = frozenset({"localhost"})


def _host_name(header: str) -> str:
    """The host of a ``Host`` header, without its port (and without an IPv6 literal's
    brackets)."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Guard:
    """In front of every request: only GET and HEAD, the host check (without a token),
    the token check (with one), and the security headers on every response."""

    def __init__(self, app: ASGIApp, *, token: str | None, templates: Templates) -> None:
        self.app = app
        self.templates = templates
        self.token = None if token is None else token.encode("ascii")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_guarded(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS:
                    headers[name] = value
            await send(message)

        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, send_guarded)
            return
        await self.app(scope, receive, send_guarded)

    def _refusal(self, scope: Scope) -> Response | None:
        method = scope["method"]
        if method not in ALLOWED_METHODS:
            return self.templates.error(
                scope,
                405,
                "METHOD_NOT_ALLOWED",
                f"the viewer is read-only: {method} is refused; only GET and HEAD are answered",
                headers={"allow": ", ".join(ALLOWED_METHODS)},
            )
        if self.token is None:
            host = _host_name(Headers(scope=scope).get("host", ""))
            if not _is_loopback(host):
                return self.templates.error(
                    scope,
                    400,
                    "HOST_REFUSED",
                    f"without a token the viewer answers only requests addressed to "
                    f"127.0.0.1, localhost or [::1], not to {host!r}",
                )
            return None
        return self._auth_refusal(scope)

    def _auth_refusal(self, scope: Scope) -> Response | None:
        assert self.token is not None
        challenge = {"www-authenticate": 'Basic realm="itemjournal", charset="UTF-8"'}
        raw = _raw_header(scope, b"authorization")
        if raw is None:
            return self.templates.error(
                scope,
                401,
                "TOKEN_REQUIRED",
                "this viewer needs its token: send 'Authorization: Bearer <token>', or "
                "give it as the password when the browser asks",
                headers=challenge,
            )
        scheme, _, credentials = raw.partition(b" ")
        scheme = scheme.lower()
        given: bytes | None = None
        if scheme == b"bearer":
            given = credentials.strip()
        elif scheme == b"basic":
            try:
                decoded = base64.b64decode(credentials.strip(), validate=True)
            except (binascii.Error, ValueError):
                decoded = b""
            given = decoded.partition(b":")[2] if b":" in decoded else None
        if given is not None and hmac.compare_digest(given, self.token):
            return None
        if scheme == b"bearer":
            return self.templates.error(scope, 403, "TOKEN_WRONG", "the token is not this viewer's")
        # Basic (a browser) or an unknown scheme: ask again, so a mistyped password can
        # be corrected in the browser's dialog.
        return self.templates.error(
            scope,
            401,
            "TOKEN_WRONG",
            "the token is not this viewer's (give it as the password, any user name)",
            headers=challenge,
        )


def _raw_header(scope: Scope, name: bytes) -> bytes | None:
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def _check_token(token: object) -> str | None:
    if token is None:
        return None
    if not isinstance(token, str) or _TOKEN.fullmatch(token) is None:
        raise InvalidArgument(
            "the viewer token is printable ASCII without spaces, and not empty",
            code="INVALID_ARGUMENT",
        )
    return token
