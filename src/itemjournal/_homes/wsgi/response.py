"""The application's response on its way to the WSGI server.

``Response`` is the iterable the middleware gives the server in place of the
application's. It runs the application, records its status, headers and body, and holds
back its last chunk until the journal has settled the record, so that a client that has
the whole response can never race its own record. It is the claim block of the request:
the claim opened before the application ran is closed when the response is whole (the
record completed, released or marked for review), when the application fails, or when
the server closes a response the application had not finished (the client left): then
the outcome is unknown and the record needs review.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from ..._model.errors import JournalError
from ..._sync.claim import ClaimContext, ClaimedAttempt
from ..http.policy import NO_RESPONSE, released
from ..http.problems import Reply, internal_error, withdrawn_error
from ..http.responses import Recording
from .protocol import Environ, ExcInfo, StartResponse, WSGIApp, logger, status_line

__all__ = ["CLOSED_EARLY", "Response"]

# The review reason of a response the server closed before the application finished it.
CLOSED_EARLY = "the server closed the response before the application finished it"


class Response:
    """Runs the application for a claimed request and hands its response to the server."""

    def __init__(
        self,
        context: ClaimContext,
        attempt: ClaimedAttempt,
        start_response: StartResponse,
        release: frozenset[int],
    ) -> None:
        self._context = context
        self._attempt = attempt
        self._start_response = start_response
        self._release = release
        self.recording = Recording()
        self._started = False  # the application called start_response
        self._sent = False  # body bytes went to the server: the response can't be replaced
        self._iterable: Iterable[bytes] | None = None
        self._iterator: Iterator[bytes] | None = None
        self._ready: deque[bytes] = deque()
        self._exhausted = False  # the application has no more chunks
        self._open = True  # the claim block is open

    def run(self, app: WSGIApp, environ: Environ) -> Response:
        """Call the application and take its first chunks, so that a failure before any
        byte went out is still answered with a response of the middleware's own."""
        try:
            self._iterable = app(environ, self._app_start_response)
            self._iterator = iter(self._iterable)
            self._fill()
        except BaseException as error:  # every exit settles the claim, then goes on
            self._fail(error)
        return self

    def __iter__(self) -> Response:
        return self

    def __next__(self) -> bytes:
        try:
            self._fill()
        except BaseException as error:
            self._fail(error)
        if not self._ready:
            raise StopIteration
        chunk = self._ready.popleft()
        self._sent = self._sent or bool(chunk)
        return chunk

    def close(self) -> None:
        """The server is done with the response: the application's iterable is closed,
        and a record still open needs review (the response was not whole)."""
        try:
            close: Callable[[], object] | None = getattr(self._iterable, "close", None)
            if close is not None:
                close()
        finally:
            if self._open:
                self._review(CLOSED_EARLY)

    # ------------------------------------------------------------------ the application

    def _app_start_response(
        self, status: str, headers: list[tuple[str, str]], exc_info: ExcInfo | None = None
    ) -> Callable[[bytes], object]:
        if exc_info is not None and exc_info[1] is not None and self._sent:
            raise exc_info[1].with_traceback(exc_info[2])
        self.recording.start(int(status.split(None, 1)[0]), headers)
        self._started = True
        write = self._start_response(status, headers, exc_info)

        def recorded_write(data: bytes) -> object:
            # The legacy write() goes to the server at once: recorded, never held.
            self.recording.add(data)
            self._sent = self._sent or bool(data)
            return write(data)

        return recorded_write

    def _fill(self) -> None:
        """Keep one chunk held back from the server until the application has no more
        and the record is settled."""
        while len(self._ready) < 2 and not self._exhausted:
            assert self._iterator is not None
            try:
                chunk = next(self._iterator)
            except StopIteration:
                self._exhausted = True
                self._settle()
                return
            if not self._started:
                raise RuntimeError("the application gave a body before calling start_response")
            self.recording.add(chunk)
            self._ready.append(chunk)

    # ------------------------------------------------------------------ the record

    def _settle(self) -> None:
        """The application's response is whole: complete, release or review the record."""
        if not self._started:
            self._review(NO_RESPONSE)
            self._replace(internal_error(), None)
            return
        verdict = self.recording.verdict(self._release)
        if verdict.action == "complete":
            self._attempt.complete(verdict.note, verdict.result)
        elif verdict.action == "withdraw":
            self._attempt.withdraw(verdict.note)
        else:
            self._attempt.mark_review(verdict.note)
        self._open = False
        self._context.__exit__(None, None, None)

    def _review(self, reason: str) -> None:
        self._open = False
        try:
            self._attempt.mark_review(reason)
        except JournalError as error:
            logger.error("itemjournal could not mark a request for review: %s", error)
            self._context.__exit__(type(error), error, error.__traceback__)
            return
        self._context.__exit__(None, None, None)

    def _fail(self, error: BaseException) -> None:
        """The application (or the journal) failed: the claim block settles the record
        (review, or a release for ``Withdraw``); the client gets a problem response if no
        byte went out yet, and the exception goes on otherwise."""
        if self._open:
            self._open = False
            self._context.__exit__(type(error), error, error.__traceback__)
        self._exhausted = True
        self._ready.clear()
        try:
            close: Callable[[], object] | None = getattr(self._iterable, "close", None)
            if close is not None:
                close()
        except Exception:
            logger.debug("the failed application's response did not close", exc_info=True)
        self._iterable = None
        if self._sent or not isinstance(error, Exception):
            raise error
        logger.error("the application failed on an idempotent request", exc_info=error)
        reply = withdrawn_error() if released(self._attempt.view) else internal_error()
        self._replace(reply, sys.exc_info())  # called where ``error`` is being handled

    def _replace(self, reply: Reply, exc_info: ExcInfo | None) -> None:
        """Answer ``reply`` instead of what the application gave (nothing went out); the
        application's headers, if it started, are replaced as PEP 3333 allows."""
        self._start_response(status_line(reply.status), list(reply.headers), exc_info)
        self._ready = deque([reply.body])
        self._exhausted = True
