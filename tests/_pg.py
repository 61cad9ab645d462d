"""Test helpers that reach into a PostgreSQL journal behind its back."""

from __future__ import annotations

import urllib.parse

import psycopg


def is_postgres(location: str) -> bool:
    return location.startswith(("postgresql://", "postgres://"))


def split(location: str) -> tuple[str, str]:
    """(libpq URL, schema) of a PostgreSQL journal location: the journal's own parameters
    taken out, every other byte left as it was given (libpq decodes them itself)."""
    parts = urllib.parse.urlsplit(location)
    kept, schema = [], "itemjournal"
    for piece in parts.query.split("&") if parts.query else ():
        name, _, value = piece.partition("=")
        if name == "schema":
            schema = urllib.parse.unquote(value)
        elif name not in ("pool_size", "owner_url") and piece:
            kept.append(piece)
    return urllib.parse.urlunsplit(parts._replace(query="&".join(kept))), schema


def connect(location: str, *, autocommit: bool = True) -> tuple[psycopg.Connection, str]:
    url, schema = split(location)
    return psycopg.connect(url, autocommit=autocommit), schema


def put_document(location: str, digest: str, document: bytes) -> None:
    """Overwrite a record's stored bytes (its status column stays)."""
    connection, schema = connect(location)
    with connection:
        connection.execute(
            f"UPDATE {schema}.records SET document = %s WHERE digest = %s", (document, digest)
        )


def hold_row(location: str, digest: str) -> psycopg.Connection:
    """A transaction that holds the row of ``digest`` (inserting a placeholder if there is
    none): every writer of that record waits until the returned connection is closed."""
    connection, schema = connect(location, autocommit=False)
    found = connection.execute(
        f"SELECT 1 FROM {schema}.records WHERE digest = %s FOR UPDATE", (digest,)
    ).fetchone()
    if found is None:
        connection.execute(
            f"INSERT INTO {schema}.records (digest, status, claim_id, document) "
            "VALUES (%s, 'released', '', '')",
            (digest,),
        )
    return connection


# ---------------------------------------------------------------------- servers of our own
#
# PgBouncer in front of a server, and whole PostgreSQL clusters, started by the tests
# themselves. Both refuse to run as root, so under root they run as the ``postgres`` user.

import contextlib  # noqa: E402
import os  # noqa: E402
import pwd  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

PGBOUNCER = "/usr/sbin/pgbouncer"


def _server_programs() -> Path:
    """The newest installed PostgreSQL's server programs (Debian keeps each version's in
    /usr/lib/postgresql/<version>/bin); the 15 of this project's machines if none is."""
    found = [
        where.parent
        for where in Path("/usr/lib/postgresql").glob("*/bin/initdb")
        if where.parent.parent.name.isdigit()
    ]
    return max(
        found, key=lambda bin: int(bin.parent.name), default=Path("/usr/lib/postgresql/15/bin")
    )


PG_BIN = _server_programs()


def missing(what: str, path: str | Path) -> None:
    """Skip saying ``what`` is not installed at ``path``; under CI (``CI=true``) fail."""
    message = f"{what} is not installed ({path})"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message}; under CI these tests must run")
    pytest.skip(message)


def _runner() -> tuple[list[str], int | None, int | None]:
    """The command prefix that runs a server program, and the uid/gid its files need."""
    if os.geteuid() != 0:
        return [], None, None
    entry = pwd.getpwnam("postgres")
    return ["runuser", "-u", "postgres", "--"], entry.pw_uid, entry.pw_gid


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_for_port(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text(errors='replace')[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}: {log.read_text(errors='replace')[-2000:]}")


def _private_dir(prefix: str, uid: int | None, gid: int | None) -> Path:
    where = Path(tempfile.mkdtemp(prefix=prefix))
    if uid is not None and gid is not None:
        os.chown(where, uid, gid)
    return where


@contextlib.contextmanager
def pgbouncer(
    server: str, mode: str, *, pool_size: int = 20, users: tuple[str, ...] = ()
) -> Iterator[str]:
    """A PgBouncer in ``mode`` (``session``, ``transaction``, ``statement``) on a free
    loopback port, in front of the server of the URL ``server``; yields its base URL
    (``postgresql://user@127.0.0.1:port/database``, no query). ``users``: more roles
    it lets through (trust authentication still needs each named)."""
    if not os.path.exists(PGBOUNCER):
        missing("PgBouncer", PGBOUNCER)
    parts = urllib.parse.urlsplit(server)
    user = parts.username or "postgres"
    database = parts.path.lstrip("/") or user
    prefix, uid, gid = _runner()
    where = _private_dir("ij-pgbouncer-", uid, gid)
    port = free_port()
    (where / "users.txt").write_text("".join(f'"{name}" ""\n' for name in (user, *users)))
    (where / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={parts.hostname or '127.0.0.1'} port={parts.port or 5432}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {where / 'users.txt'}\n"
        f"pool_mode = {mode}\ndefault_pool_size = {pool_size}\nmax_client_conn = 500\n"
        f"logfile = {where / 'pgbouncer.log'}\n"
        "ignore_startup_parameters = extra_float_digits\n"
    )
    if uid is not None and gid is not None:
        for name in ("users.txt", "pgbouncer.ini"):
            os.chown(where / name, uid, gid)
    process = subprocess.Popen(
        [*prefix, PGBOUNCER, str(where / "pgbouncer.ini")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_port(port, process, where / "pgbouncer.log")
        yield f"postgresql://{user}@127.0.0.1:{port}/{database}"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(where, ignore_errors=True)


class Cluster:
    """A PostgreSQL cluster of the test's own: ``initdb`` into a temporary directory, a
    free port, trust authentication, a database ``test``."""

    def __init__(self, *, max_connections: int = 60) -> None:
        for program in ("initdb", "pg_ctl", "postgres"):
            if not (PG_BIN / program).exists():
                missing("PostgreSQL's server programs", PG_BIN / program)
        self._prefix, uid, gid = _runner()
        self.where = _private_dir("ij-cluster-", uid, gid)
        self.data = self.where / "data"
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/test"
        self._run(
            "initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "--no-sync",
            "-E", "UTF8", "--locale=C.UTF-8",
        )  # fmt: skip
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(
                f"port = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.where}'\nfsync = on\n"
                f"max_connections = {max_connections}\nshared_buffers = 16MB\n"
            )
        self.start()
        with psycopg.connect(self.admin_url("postgres"), autocommit=True) as connection:
            connection.execute("CREATE DATABASE test")

    def admin_url(self, database: str = "test") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, program: str, *args: str) -> None:
        subprocess.run(
            [*self._prefix, str(PG_BIN / program), *args],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=self.where,
        )

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.where / "log"), "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    @contextlib.contextmanager
    def standby(self) -> Iterator[Cluster]:
        """A streaming standby of this cluster (``pg_basebackup -R``), on a port of its own."""
        made = Cluster.__new__(Cluster)
        made._prefix = self._prefix
        made.where = _private_dir("ij-standby-", *_runner()[1:])
        made.data = made.where / "data"
        made.port = free_port()
        made.url = f"postgresql://postgres@127.0.0.1:{made.port}/test"
        self._run(
            "pg_basebackup", "-D", str(made.data), "-R", "-X", "stream", "-c", "fast",
            "-U", "postgres", "-h", "127.0.0.1", "-p", str(self.port),
        )  # fmt: skip
        with (made.data / "postgresql.conf").open("a") as conf:
            conf.write(f"port = {made.port}\nunix_socket_directories = '{made.where}'\n")
        try:
            made.start()
            yield made
        finally:
            made.close()

    def execute(self, statement: str, database: str = "test") -> None:
        with psycopg.connect(self.admin_url(database), autocommit=True) as connection:
            connection.execute(statement)

    def close(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.stop("immediate")
        shutil.rmtree(self.where, ignore_errors=True)


@contextlib.contextmanager
def cluster(*, max_connections: int = 60) -> Iterator[Cluster]:
    made = Cluster(max_connections=max_connections)
    try:
        yield made
    finally:
        made.close()


# ---------------------------------------------------------------------- synchronous standbys
#
# A primary with a streaming synchronous standby of the test's own, and a TCP proxy that
# cuts a client's connections while the server works on.

import threading  # noqa: E402


def wait_for(condition: str, url: str, timeout: float = 30) -> None:
    """Until the SQL ``condition`` holds on the server of ``url`` (asked again and again)."""
    deadline = time.monotonic() + timeout
    while True:
        with (
            contextlib.suppress(psycopg.Error),
            psycopg.connect(url, autocommit=True, connect_timeout=2) as connection,
        ):
            row = connection.execute(f"SELECT {condition}").fetchone()
            if row is not None and row[0]:
                return
        assert time.monotonic() < deadline, f"never: {condition}"
        time.sleep(0.1)


@contextlib.contextmanager
def synchronous_pair(names: str = "*") -> Iterator[tuple[Cluster, Cluster]]:
    """A primary and its streaming standby, which the primary's commits wait for
    (``synchronous_standby_names`` = ``names``), once the standby is streaming in sync."""
    with cluster() as primary, primary.standby() as standby:
        primary.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{names}'")
        primary.execute("SELECT pg_reload_conf()")
        wait_for(
            "EXISTS (SELECT 1 FROM pg_stat_replication WHERE sync_state = 'sync')",
            primary.admin_url(),
        )
        yield primary, standby


def promote(standby: Cluster, *, start: bool = True) -> None:
    """Make ``standby`` a primary (started first, unless ``start`` is False: it runs)."""
    if start:
        standby.start()
    standby._run("pg_ctl", "-D", str(standby.data), "-w", "promote")
    wait_for("NOT pg_is_in_recovery()", standby.admin_url())


def wait_for_sync_rep(primary: Cluster, timeout: float = 30) -> None:
    """Until a session of ``primary`` waits for a synchronous standby in its commit."""
    wait_for(
        "EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event = 'SyncRep')",
        primary.admin_url(),
        timeout,
    )


class Proxy:
    """A TCP proxy on a free loopback port to ``port``; ``drop`` cuts every connection it
    carries now (new ones are still accepted)."""

    def __init__(self, port: int) -> None:
        self._target = port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._carried: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self._target))
            with self._lock:
                self._carried += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def drop(self) -> None:
        with self._lock:
            carried, self._carried = self._carried, []
        for end in carried:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()

    def close(self) -> None:
        self._listener.close()
        self.drop()


@contextlib.contextmanager
def proxy(port: int) -> Iterator[Proxy]:
    made = Proxy(port)
    try:
        yield made
    finally:
        made.close()
