"""The shapes of the ASGI protocol the middleware speaks: a scope, its messages, the
``receive`` and ``send`` callables and an application; and how a whole reply is sent.

Kept apart so that every room of the middleware names them the same way without importing
the middleware itself.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ..http.problems import Reply

__all__ = [
    "ASGIApp",
    "Message",
    "Receive",
    "Scope",
    "ScopeFunction",
    "Send",
    "logger",
    "send_reply",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
ScopeFunction = Callable[[Scope], str | Awaitable[str]]

# Named after the public module, so that logging configured for ``itemjournal.asgi`` keeps
# catching what every room of the middleware logs.
logger = logging.getLogger("itemjournal.asgi")


async def send_reply(send: Send, reply: Reply) -> None:
    """Send ``reply`` whole: its start, then its body in one message."""
    headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in reply.headers]
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body, "more_body": False})
