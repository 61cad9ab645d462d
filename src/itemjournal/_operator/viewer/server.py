"""Serving the viewer so that slow or abusive clients cannot take it down.

uvicorn (with h11) parses and answers the requests; this module stands at the two places
where a slowloris wins against it alone, its ``accept`` and its wait for a request:

* **A deadline for every request head.** A head must be complete ``HEAD_TIMEOUT`` seconds
  after its connection is accepted, or after its first byte on a kept-alive connection;
  the deadline does not move as more bytes trickle in. A client that declares a body and
  sends it slowly gets the same deadline once its answer is sent. A connection past its
  deadline is answered 408 (if part of a head had come) and closed. An idle kept-alive
  connection is closed by uvicorn's keep-alive timeout (``KEEP_ALIVE``); a head larger
  than ``HEAD_LIMIT`` is refused by h11 with a 400.
* **A bound on connections.** The viewer holds at most ``bound`` connections: at most
  ``MAX_CONNECTIONS``, and never more than the limit of open files less ``FILES_RESERVE``
  (descriptors kept for the journal, the event loop and the connections being closed).
  At the bound, a new connection makes room by closing the connection that has waited
  longest for a request: a new connection is more likely to carry a request soon than
  one that has sent nothing useful for seconds. Connections being answered are never
  closed for room; when every connection is being answered, a new one is closed at once.
* **Out of files.** ``accept`` failing with EMFILE (or ENFILE, ENOBUFS, ENOMEM) lowers the
  bound to what the process could hold, closes the connections that waited longest, and
  is reported once, then counted (``Reports``), never as a traceback per attempt.

Everything here runs in the event loop's thread, in uvicorn's protocol callbacks; it
never blocks and never waits.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import weakref
from collections.abc import Iterator
from typing import Any, ClassVar, Final

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from .reports import Reports

__all__ = [
    "FILES_RESERVE",
    "HEAD_LIMIT",
    "HEAD_TIMEOUT",
    "KEEP_ALIVE",
    "MAX_CONNECTIONS",
    "Listener",
    "Room",
    "bound_for",
    "more_open_files",
    "protocol_for",
]

HEAD_TIMEOUT: Final = 5.0
KEEP_ALIVE: Final = 5
HEAD_LIMIT: Final = 16 * 1024
MAX_CONNECTIONS: Final = 2048
FILES_RESERVE: Final = 128
# Connections being closed may exceed the bound by this many descriptors.
_CLOSING_SLACK: Final = 32
_OUT_OF_FILES: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_TIMEOUT_TEXT: Final = f"the request did not arrive within {HEAD_TIMEOUT:.0f} s\n".encode()
_REQUEST_TIMEOUT: Final = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"x-content-type-options: nosniff\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
    % (len(_TIMEOUT_TEXT), _TIMEOUT_TEXT)
)


@contextlib.contextmanager
def more_open_files() -> Iterator[int]:
    """The soft limit of open files raised to the hard limit while the viewer serves (and
    set back afterwards, unless something else changed it meanwhile); yields the limit
    the viewer may count on."""
    try:
        import resource
    except ImportError:  # not a Unix: nothing to raise, nothing known
        yield MAX_CONNECTIONS + FILES_RESERVE
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        yield MAX_CONNECTIONS + FILES_RESERVE
        return
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, MAX_CONNECTIONS + FILES_RESERVE)
    if wanted <= soft:
        yield soft
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ValueError, OSError):
        yield soft
        return
    try:
        yield wanted
    finally:
        if resource.getrlimit(resource.RLIMIT_NOFILE) == (wanted, hard):
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def bound_for(open_files: int) -> int:
    """The bound on connections for a process allowed ``open_files`` descriptors."""
    return max(1, min(MAX_CONNECTIONS, open_files - FILES_RESERVE))


class Room:
    """The viewer's connections, counted from ``accept`` to their closing.

    ``pending``: accepted, not yet handed to a protocol (by descriptor; an entry goes away
    with its socket should uvicorn never get it). ``waiting``: protocols waiting for a
    request, in the order they began to wait. ``busy``: protocols answering one.
    ``closing``: protocols closed for room or at their deadline, whose descriptors are not
    yet released.
    """

    def __init__(self, bound: int, reports: Reports) -> None:
        self.bound = bound
        self.reports = reports
        self.pending: weakref.WeakValueDictionary[int, socket.socket] = (
            weakref.WeakValueDictionary()
        )
        self.waiting: dict[_GuardedProtocol, None] = {}
        self.busy: set[_GuardedProtocol] = set()
        self.closing: set[_GuardedProtocol] = set()

    @property
    def held(self) -> int:
        """Connections held and not being closed."""
        return len(self.pending) + len(self.waiting) + len(self.busy)

    def full(self) -> bool:
        """Too many descriptors still open to accept one more now (the connections being
        closed release theirs on the loop's next turn)."""
        return self.held + len(self.closing) >= self.bound + _CLOSING_SLACK

    def admit(self, connection: socket.socket) -> bool:
        """Count a connection just accepted, making room if the bound is reached; False
        when no room can be made (every connection is being answered)."""
        self.pending[connection.fileno()] = connection
        if self.trim():
            return True
        del self.pending[connection.fileno()]
        self.reports.report(
            logging.WARNING,
            f"the viewer is at its limit of {self.bound} connections, all being answered: "
            f"closing new connections at once",
        )
        return False

    def trim(self) -> bool:
        """Close the connections that have waited longest until no more are held than the
        bound allows (more can be: accepted in a burst, or after the bound was lowered);
        False if that many are not waiting."""
        excess = self.held - self.bound
        if excess <= 0:
            return True
        if self.waiting:
            self.reports.report(
                logging.WARNING,
                f"the viewer is at its limit of {self.bound} connections: closing those "
                f"that have waited longest for a request",
            )
        for _ in range(excess):
            if not self.waiting:
                return False
            oldest = next(iter(self.waiting))
            self.close(oldest)
            oldest.transport.abort()
        return True

    def out_of_files(self, error: OSError) -> None:
        """``accept`` failed for want of descriptors: hold fewer connections from now on,
        and close the ones that waited longest."""
        held = self.held + len(self.closing)
        self.bound = max(1, min(self.bound, held - FILES_RESERVE))
        self.reports.report(
            logging.WARNING,
            f"cannot accept a connection: {error}; holding at most {self.bound} "
            f"connections from now on",
        )
        self.trim()

    def arrived(self, protocol: _GuardedProtocol, connection: Any) -> None:
        self.pending.pop(connection.fileno(), None)
        self.waiting[protocol] = None
        self.trim()

    def answering(self, protocol: _GuardedProtocol) -> None:
        self.waiting.pop(protocol, None)
        self.busy.add(protocol)

    def answered(self, protocol: _GuardedProtocol) -> None:
        if protocol in self.busy:
            self.busy.discard(protocol)
            self.waiting[protocol] = None  # waits again, behind the others

    def close(self, protocol: _GuardedProtocol) -> None:
        self.waiting.pop(protocol, None)
        self.busy.discard(protocol)
        self.closing.add(protocol)

    def left(self, protocol: _GuardedProtocol) -> None:
        self.waiting.pop(protocol, None)
        self.busy.discard(protocol)
        self.closing.discard(protocol)


class Listener(socket.socket):
    """The listening socket, whose ``accept`` (called by the event loop) counts each
    connection in the room and answers for running out of files."""

    room: Room | None = None
    # A descriptor held in reserve: given up to accept (and close) a connection when the
    # process is out of descriptors and no connection can be closed to make room.
    spare: int | None = None

    def keep_spare(self) -> None:
        if self.spare is None:
            try:
                self.spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self.spare = None

    def accept(self) -> tuple[socket.socket, Any]:
        room = self.room
        if room is None:
            return super().accept()
        room.trim()
        if room.full():
            # The loop calls again on its next turn, once the closed ones are released.
            raise BlockingIOError(errno.EAGAIN, "connections are being closed")
        try:
            connection, address = super().accept()
        except OSError as error:
            if error.errno not in _OUT_OF_FILES:
                raise
            room.out_of_files(error)
            if not room.closing:
                self._refuse_one()
            raise BlockingIOError(errno.EAGAIN, "out of descriptors") from error
        if not room.admit(connection):
            connection.close()
            raise BlockingIOError(errno.EAGAIN, "no room")
        return connection, address

    def _refuse_one(self) -> None:
        """Take one connection off the queue and close it, with the spare descriptor, so
        that a client is told rather than left waiting."""
        if self.spare is None:
            return
        os.close(self.spare)
        self.spare = None
        try:
            connection, _ = super().accept()
        except OSError:
            pass
        else:
            connection.close()
        self.keep_spare()

    def close(self) -> None:
        if self.spare is not None:
            os.close(self.spare)
            self.spare = None
        super().close()


class _GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head, counted in a room."""

    room: ClassVar[Room]

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: Any = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.deadline: Any = None  # the loop's timer handle

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        if self.room.reports.later is None:
            self.room.reports.later = self.loop.call_later
        self.room.arrived(self, transport.get_extra_info("socket"))
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._settle(data_came=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.room.answered(self)
        self._settle(data_came=False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.room.left(self)
        super().connection_lost(exc)

    def _answering(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _settle(self, *, data_came: bool) -> None:
        """After each turn of uvicorn's parsing: a request being answered needs no
        deadline; a connection waiting for (the rest of) a request keeps the deadline it
        has, or gets one if bytes of a request have come."""
        if self.transport.is_closing():
            return
        if self._answering():
            self._disarm()
            self.room.answering(self)
            return
        owed = bool(self.conn.trailing_data[0]) or self.conn.their_state is not h11.IDLE
        if self.deadline is None and (data_came or owed):
            self._arm()

    def _arm(self) -> None:
        self.deadline = self.loop.call_later(HEAD_TIMEOUT, self._past_deadline)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _past_deadline(self) -> None:
        self.deadline = None
        if self.transport.is_closing() or self._answering():
            return
        self.room.reports.report(
            logging.INFO,
            f"closing connections whose request did not arrive within {HEAD_TIMEOUT:.0f} s",
        )
        self.room.close(self)
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self.transport.write(_REQUEST_TIMEOUT)
        self.transport.close()


def protocol_for(room: Room) -> type[H11Protocol]:
    """The protocol class uvicorn makes for each connection, counting them in ``room``."""
    return type("ViewerProtocol", (_GuardedProtocol,), {"room": room})
