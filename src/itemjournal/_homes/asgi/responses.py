"""The response on its way through the ASGI middleware: recorded as the application
streams it, its last body message held until the journal has settled the record; and a
stored response sent again.

What is kept of a response, how it is judged and stored, and how a stored one is read
back are the shared policy's (``_homes.http.responses``); only the messages are ASGI's.
"""

from __future__ import annotations

from ..._journal.claim import Attempt
from ..http.responses import RELEASED_STATUSES, Recording, stored_reply
from .protocol import Message, Send, send_reply

__all__ = ["Recorder", "replay"]


class Recorder:
    """Passes the application's response on while keeping what the journal needs."""

    def __init__(
        self, send: Send, attempt: Attempt, release: frozenset[int] = RELEASED_STATUSES
    ) -> None:
        self._send = send
        self.attempt = attempt
        self._release = release
        self.recording = Recording()
        self.started = False
        self.finished = False
        self.held: Message | None = None  # the last body message of a 5xx response

    @property
    def status(self) -> int:
        return self.recording.status

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.recording.start(
                int(message["status"]),
                [
                    (name.decode("latin-1"), value.decode("latin-1"))
                    for name, value in message.get("headers", ())
                ],
            )
            self.started = True
            await self._send(message)
        elif kind == "http.response.body" and not self.finished:
            self.recording.add(bytes(message.get("body", b"")))
            if message.get("more_body", False):
                await self._send(message)
                return
            self.finished = True
            verdict = self.recording.verdict(self._release)
            if verdict.action == "review":  # uncertain: marked once the app is done
                self.held = message
                return
            if verdict.action == "withdraw":
                await self.attempt.withdraw(verdict.note)
            else:
                await self.attempt.complete(verdict.note, verdict.result)
            await self._send(message)
        else:
            await self._send(message)


async def replay(send: Send, result: str | None, receipt: str | None) -> None:
    """Send the stored response again, or say why it cannot be."""
    await send_reply(send, stored_reply(result, receipt))
