"""The viewer under abuse: a real ``serve`` process with a token, held open by slow and
incomplete requests (a slowloris) under a small limit of open files, keeps answering the
requests that carry the token, cuts incomplete requests at their deadline, keeps its
connections bounded and logs each cause once rather than once per attempt."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import resource
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from itemjournal import Journal
from itemjournal._operator.viewer.reports import Reports

TOKEN = "abuse-test-token-0123456789"
AUTHORIZED = {"authorization": f"Bearer {TOKEN}"}
# What the manual promises (docs/operations.md): a request head must be complete 5 s after
# the connection is accepted (or after its first byte on a kept-alive connection);
# connections are at most 2,048, and never more than the limit of open files less 128.
HEAD_TIMEOUT = 5.0
FILES_RESERVE = 128
MAX_CONNECTIONS = 2048
SLOW_CONNECTIONS = 1100
LOG_LIMIT = 64 * 1024

# The server: the limit of open files set before the viewer starts, and descriptors the
# process holds open beforehand (which the viewer cannot know of, so it meets EMFILE).
SERVER = (
    "import os, resource, sys\n"
    "soft, hard, held = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))\n"
    "kept = [os.open(os.devnull, os.O_RDONLY) for _ in range(held)]\n"
    "from itemjournal._operator.viewer.app import serve\n"
    "serve(sys.argv[1], host='127.0.0.1', port=int(sys.argv[2]), token=sys.argv[3])\n"
)


@dataclasses.dataclass
class Partial:
    """One client connection that never finishes its request."""

    sock: socket.socket
    opened: float
    closed: float | None = None
    answer: bytes = b""

    @property
    def held(self) -> float:
        assert self.closed is not None
        return self.closed - self.opened


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def location(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small file journal (the viewer only reads it)."""
    where = str(tmp_path_factory.mktemp("abuse") / "journal")

    async def main() -> None:
        journal = await Journal.open(where)
        await journal.aclose()

    anyio.run(main)
    return where


@pytest.fixture(scope="module", autouse=True)
def enough_files() -> Iterator[None]:
    """This process opens more than a thousand sockets: raise its own soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = SLOW_CONNECTIONS + 400
    if soft >= wanted:
        yield
        return
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"the hard limit of open files ({hard}) is below {wanted}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@contextlib.contextmanager
def server(
    location: str, tmp_path: Path, *, soft: int, hard: int, held: int = 0
) -> Iterator[tuple[int, list[str]]]:
    """A real viewer process with a token; yields its port and, once it has stopped, its
    log (stdout and stderr, written to a file so that no pipe ever blocks it)."""
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key != "ITEMJOURNAL_VIEWER_TOKEN"}
    log_path = tmp_path / "server.log"
    log: list[str] = []
    with log_path.open("wb") as output:
        process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SERVER,
                location,
                str(port),
                TOKEN,
                *map(str, (soft, hard, held)),
            ],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, log_path.read_text(errors="replace")[:4000]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/counts", headers=AUTHORIZED).is_success:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the viewer did not start"
            time.sleep(0.05)
        yield port, log
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log.append(log_path.read_bytes().decode(errors="replace"))


def open_partial(port: int, count: int) -> list[Partial]:
    """``count`` connections, each with the first part of a request head."""
    opened = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(b"GET /api/counts HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        sock.setblocking(False)
        opened.append(Partial(sock, time.monotonic()))
    return opened


class Watch:
    """Sees when the server closes each connection."""

    def __init__(self, partials: list[Partial]) -> None:
        self.selector = selectors.DefaultSelector()
        self.open = {partial.sock.fileno(): partial for partial in partials}
        for partial in partials:
            self.selector.register(partial.sock, selectors.EVENT_READ, partial)

    def poll(self, timeout: float = 0.0) -> None:
        for key, _ in self.selector.select(timeout):
            partial: Partial = key.data
            try:
                data = partial.sock.recv(4096)
            except BlockingIOError:
                continue
            except OSError:  # reset
                data = b""
            if data:
                partial.answer += data
                continue
            self.closed(partial)

    def closed(self, partial: Partial) -> None:
        partial.closed = time.monotonic()
        self.selector.unregister(partial.sock)
        del self.open[partial.sock.fileno()]
        partial.sock.close()

    def trickle(self) -> None:
        """One more byte of the head on every connection still open."""
        for partial in list(self.open.values()):
            try:
                partial.sock.send(b"x")
            except BlockingIOError:
                pass
            except OSError:
                self.closed(partial)

    def close(self) -> None:
        """Close what the server left open (not counted as closed by the server)."""
        for partial in self.open.values():
            partial.sock.close()
        self.selector.close()


def tokened_get(client: httpx.Client, port: int) -> tuple[float, int | str]:
    """A GET with the token on a new connection (the client keeps none alive, so each one
    must be accepted by the server past the slow ones): its time and status."""
    started = time.monotonic()
    try:
        response = client.get(f"http://127.0.0.1:{port}/api/counts", headers=AUTHORIZED)
    except httpx.TransportError as error:
        return time.monotonic() - started, type(error).__name__
    return time.monotonic() - started, response.status_code


def tracebacks(log: str) -> int:
    return log.count("Traceback (most recent call last)")


# (server's soft limit, its hard limit, descriptors it holds before serving)
LIMITS = {
    # 1,024 files and no more: more slow connections than the viewer may hold
    "at-1024-files": (1024, 1024, 0),
    # a soft limit of 1,024 under a higher hard limit: the viewer raises its soft limit
    "soft-limit-raised": (1024, 4096, 0),
    # descriptors the viewer does not know of: accept meets EMFILE before the bound
    "out-of-files": (1024, 1024, 500),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LIMITS))
def test_a_slowloris_leaves_the_tokened_viewer_answering(
    case: str, location: str, tmp_path: Path
) -> None:
    soft, hard, held = LIMITS[case]
    if hard > resource.getrlimit(resource.RLIMIT_NOFILE)[1] != resource.RLIM_INFINITY:
        pytest.skip(f"this machine's hard limit of open files is below {hard}")
    bound = min(MAX_CONNECTIONS, hard - FILES_RESERVE)
    latencies: list[tuple[float, int | str]] = []
    with (
        server(location, tmp_path, soft=soft, hard=hard, held=held) as (port, log),
        httpx.Client(timeout=3, limits=httpx.Limits(max_keepalive_connections=0)) as client,
    ):
        started = time.monotonic()
        partials = open_partial(port, SLOW_CONNECTIONS)
        opening = time.monotonic() - started
        # Queued behind the whole burst: the server accepts (and sorts) every slow
        # connection before this one, so on a loaded machine it may take longer.
        behind_the_burst = tokened_get(client, port)
        watch = Watch(partials)
        try:
            deadline = partials[-1].opened + HEAD_TIMEOUT + 3
            next_trickle = time.monotonic()
            while watch.open and time.monotonic() < deadline:
                if len(latencies) < 6:
                    latencies.append(tokened_get(client, port))
                if time.monotonic() >= next_trickle:
                    watch.trickle()
                    next_trickle += 0.5
                watch.poll(0.1 if len(latencies) >= 6 else 0.0)
            left_open = len(watch.open)
        finally:
            watch.close()
        latencies.append(tokened_get(client, port))
    text = log[0]
    cut = [partial for partial in partials if partial.answer.startswith(b"HTTP/1.1 408 ")]
    held_for = sorted(partial.held for partial in partials if partial.closed is not None)
    held_for = held_for or [float("nan")]
    # Held until their deadline: all held by the server at once, since every one was
    # accepted before the first deadline came.
    at_deadline = sum(held >= HEAD_TIMEOUT - 0.5 for held in held_for)
    early = len(held_for) - at_deadline
    lowered = [int(found) for found in re.findall(r"holding at most (\d+) connections", text)]
    print(
        f"{case}: {SLOW_CONNECTIONS} slow connections opened in {opening:.2f} s; "
        f"bound {bound}{f', lowered to {lowered[-1]}' if lowered else ''}"
    )
    print(
        f"tokened GET right behind the burst: {behind_the_burst[0]:.3f} s "
        f"({behind_the_burst[1]}); then, while they are open, and after: "
        + ", ".join(f"{seconds:.3f} ({status})" for seconds, status in latencies)
        + " s"
    )
    print(
        f"closed by the server: {len(partials) - left_open}, after {held_for[0]:.2f} to "
        f"{held_for[-1]:.2f} s (median {held_for[len(held_for) // 2]:.2f}): {at_deadline} at "
        f"their deadline ({len(cut)} answered 408), {early} earlier to make room"
    )
    print(f"server log: {len(text.encode())} bytes, {tracebacks(text)} tracebacks")
    for line in text.splitlines():
        if line.startswith("WARNING") or "more in the last" in line:
            print(f"  {line}")
    assert behind_the_burst[1] == 200
    assert behind_the_burst[0] < 3.0
    assert len(latencies) >= 7
    assert all(status == 200 for _, status in latencies), latencies
    assert max(seconds for seconds, _ in latencies) < 1.0, latencies
    # each on a connection of its own (uvicorn's access log names the client's port), and
    # the one that saw the viewer start
    ports = re.findall(r"127\.0\.0\.1:(\d+) - \"GET /api/counts HTTP/1\.1\" 200", text)
    assert len(set(ports)) >= len(latencies) + 2
    assert left_open == 0
    assert held_for[-1] <= HEAD_TIMEOUT + 1.5
    assert len(text.encode()) < LOG_LIMIT, text[:2000]
    assert tracebacks(text) == 0, text[:4000]
    assert at_deadline <= bound
    if case == "soft-limit-raised":
        # every connection was held until its deadline, then answered 408 (but for the
        # few whose 408 a reset may lose: a trickled byte crossing the close)
        assert at_deadline == SLOW_CONNECTIONS
        assert len(cut) >= SLOW_CONNECTIONS - 10
    if case == "at-1024-files":
        # the connections that waited longest made room for the new ones; each cause
        # (new connections closed at once, the longest waiting closed) is logged once,
        # then counted in a summary line (at most one a minute, and one at shutdown)
        assert at_deadline >= bound - 32
        limits = [line for line in text.splitlines() if re.search(r"at its limit of \d+ ", line)]
        first = [line for line in limits if "more in the last" not in line]
        summaries = [line for line in limits if "more in the last" in line]
        assert 1 <= len(first) <= 2, text
        assert len(set(first)) == len(first), text  # never the same cause twice
        assert len(summaries) <= 2 * len(first), text
    if case == "out-of-files":
        # EMFILE on accept: logged once (not a traceback per attempt), and the viewer
        # holds no more connections than it found it could
        assert 1 <= len(re.findall(r"Too many open files", text)) <= 3, text
        assert lowered
        assert at_deadline <= lowered[-1]


@dataclasses.dataclass
class Visitor:
    """One connection of ``test_every_kind_of_incomplete_request_is_cut``."""

    kind: str
    sock: socket.socket
    reference: float  # when the deadline the server should keep began
    first: bytes  # a complete request sent first, if any
    then: bytes  # what follows the first response (the start of what stays incomplete)
    trickling: bool  # a byte every 0.25 s (once ``then`` is sent)
    answered: float | None = None
    closed: float | None = None
    answer: bytes = b""


def whole_response(data: bytes) -> bool:
    head, found, body = data.partition(b"\r\n\r\n")
    if not found:
        return False
    length = re.search(rb"(?im)^content-length: *(\d+)", head)
    return length is not None and len(body) >= int(length.group(1))


@pytest.mark.slow
def test_every_kind_of_incomplete_request_is_cut(location: str, tmp_path: Path) -> None:
    request = (
        b"GET /api/counts HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
        + TOKEN.encode()
        + b"\r\n"
    )
    with server(location, tmp_path, soft=1024, hard=1024) as (port, log):
        visitors: list[Visitor] = []

        def visit(kind: str, first: bytes, then: bytes, *, trickling: bool) -> None:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(first or then)
            sock.setblocking(False)
            visitors.append(Visitor(kind, sock, time.monotonic(), first, then, trickling))

        # connected, nothing sent: closed silently at the deadline
        visit("silent", b"", b"", trickling=False)
        # a head sent a byte at a time: 408 at the deadline, however the bytes keep coming
        visit("slow head", b"", b"GET /api/counts HTTP/1.1\r\nX-Slow: ", trickling=True)
        # a complete request, then the next head slowly on the kept-alive connection
        visit("slow second head", request + b"\r\n", b"GET / HTTP/1.1\r\nX-Slow: ", trickling=True)
        # a GET that declares a body and sends it slowly: answered, then cut
        visit("slow body", request + b"Content-Length: 100000\r\n\r\n", b"", trickling=True)
        # a complete request, then nothing: uvicorn's keep-alive timeout
        visit("kept alive", request + b"\r\n", b"", trickling=False)

        selector = selectors.DefaultSelector()
        for visitor in visitors:
            selector.register(visitor.sock, selectors.EVENT_READ, visitor)
        deadline = time.monotonic() + 3 * HEAD_TIMEOUT
        next_trickle = time.monotonic() + 0.25
        while any(v.closed is None for v in visitors) and time.monotonic() < deadline:
            for key, _ in selector.select(0.05):
                visitor = key.data
                try:
                    data = visitor.sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    visitor.closed = time.monotonic()
                    selector.unregister(visitor.sock)
                    continue
                visitor.answer += data
                if visitor.first and visitor.answered is None and whole_response(visitor.answer):
                    visitor.answered = time.monotonic()
                    visitor.reference = visitor.answered
                    if visitor.then:
                        visitor.sock.send(visitor.then)
            if time.monotonic() >= next_trickle:
                next_trickle += 0.25
                for visitor in visitors:
                    waiting = visitor.first and visitor.then and visitor.answered is None
                    if visitor.trickling and visitor.closed is None and not waiting:
                        with contextlib.suppress(OSError):
                            visitor.sock.send(b"x")
        for visitor in visitors:
            visitor.sock.close()
        selector.close()
    codes = {v.kind: re.findall(rb"HTTP/1.1 (\d{3})", v.answer) for v in visitors}
    for visitor in visitors:
        waited = None if visitor.closed is None else visitor.closed - visitor.reference
        print(
            f"{visitor.kind}: closed "
            + ("never" if waited is None else f"{waited:.2f} s after its deadline began")
            + f"; answers: {codes[visitor.kind]}"
        )
    assert codes == {
        "silent": [],
        "slow head": [b"408"],
        "slow second head": [b"200", b"408"],
        "slow body": [b"200"],
        "kept alive": [b"200"],
    }
    for visitor in visitors:
        assert visitor.closed is not None, visitor.kind
        assert HEAD_TIMEOUT - 0.5 <= visitor.closed - visitor.reference <= HEAD_TIMEOUT + 1.5, (
            visitor.kind
        )
    assert tracebacks(log[0]) == 0


# --------------------------------------------------------------------------- reports


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_cause_is_logged_once_then_counted(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    logger = logging.getLogger("itemjournal.tests.reports")
    reports = Reports(logger, interval=60.0, clock=clock)
    later: list[tuple[float, Callable[[], None]]] = []
    reports.later = lambda delay, function: later.append((delay, function))
    with caplog.at_level(logging.INFO, logger=logger.name):
        firsts = [reports.report(logging.WARNING, "accept: out of files") for _ in range(1000)]
        reports.report(logging.INFO, "cut at the deadline")
        assert firsts == [True] + [False] * 999
        assert [r.getMessage() for r in caplog.records] == [
            "accept: out of files (repeats are counted and logged at most every 60 s)",
            "cut at the deadline (repeats are counted and logged at most every 60 s)",
        ]
        # The count is logged when the interval ends, even if nothing more happens.
        assert [delay for delay, _ in later] == [60.0]
        clock.now += 60
        later.pop()[1]()
        clock.now += 5
        reports.report(logging.WARNING, "accept: out of files")
        reports.flush()
        reports.flush()  # nothing more to say
    lines = [(r.levelno, r.getMessage()) for r in caplog.records[2:]]
    assert lines == [
        (logging.WARNING, "accept: out of files: 999 more in the last 60 s"),
        (logging.WARNING, "accept: out of files: 1 more in the last 5 s"),
    ]


def test_repeated_warnings_of_another_logger_are_collapsed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reports = Reports(logging.getLogger("itemjournal.tests.reports"), clock=Clock())
    noisy = logging.getLogger("itemjournal.tests.noisy")
    collapse = reports.filter()
    noisy.addFilter(collapse)
    try:
        with caplog.at_level(logging.INFO):
            for number in range(500):
                noisy.info("request %d answered", number)  # below WARNING: every one
                noisy.warning("Invalid HTTP request received.")
                try:
                    raise OSError(24, "Too many open files")
                except OSError:
                    noisy.exception("socket.accept() out of system resource")
            reports.flush()
    finally:
        noisy.removeFilter(collapse)
    lines = [r.getMessage() for r in caplog.records if "answered" not in r.getMessage()]
    assert lines == [
        "Invalid HTTP request received.",
        "socket.accept() out of system resource",
        "itemjournal.tests.noisy: Invalid HTTP request received.: 499 more in the last 0 s",
        "itemjournal.tests.noisy: socket.accept() out of system resource (OSError): 499 more "
        "in the last 0 s",
    ]
    assert sum(r.exc_info is not None for r in caplog.records) == 1
    assert sum("answered" in r.getMessage() for r in caplog.records) == 500
