"""The servers the comparison uses: a durable Redis of its own, PostgreSQL schemas, Redis keys."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class DurableRedis:
    """A ``redis-server`` started for the run: ``appendonly yes``, ``appendfsync always``."""

    process: subprocess.Popen[bytes]
    url: str
    directory: str

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_durable_redis(base: str) -> DurableRedis | str:
    """Start the server in a directory under ``base``; a reason when it cannot be."""
    executable = shutil.which("redis-server")
    if executable is None:
        return "no redis-server on PATH (Debian: apt-get install redis-server)"
    directory = tempfile.mkdtemp(prefix="redis-", dir=base)
    port = _free_port()
    command = [
        executable,
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--dir", directory,
        "--appendonly", "yes",
        "--appendfsync", "always",
        "--save", "",
        "--daemonize", "no",
        "--logfile", os.path.join(directory, "redis.log"),
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = DurableRedis(process, f"redis://127.0.0.1:{port}/0", directory)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if redis_settings(server.url) is not None:
            return server
        if process.poll() is not None:
            break
        time.sleep(0.1)
    server.stop()
    return f"redis-server did not answer on port {port}"


def redis_settings(url: str) -> dict[str, str] | None:
    """The server's version and persistence settings; None when it does not answer."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=2, decode_responses=True)
        info: dict[str, Any] = client.info("server")
        settings = {"version": str(info["redis_version"])}
        for name in ("appendonly", "appendfsync", "save"):
            settings.update({str(k): str(v) for k, v in client.config_get(name).items()})
        client.close()
    except (redis.RedisError, OSError):
        return None
    return settings


def redis_promise(settings: dict[str, str]) -> str:
    if settings.get("appendonly") == "yes":
        return f"AOF, appendfsync {settings.get('appendfsync')}"
    if settings.get("save"):
        return "memory; snapshots only (no fsync per write)"
    return "memory only (no AOF, no snapshots)"


def delete_keys(url: str, prefix: str) -> None:
    """Remove the keys a measurement wrote on a shared Redis."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        batch = list(client.scan_iter(match=f"{prefix}*", count=1000))
        while batch:
            client.delete(*batch[:1000])
            batch = batch[1000:]
    finally:
        client.close()


def new_schema() -> str:
    return f"ijpeers_{os.getpid()}_{secrets.token_hex(4)}"


def drop_schema(url: str, schema: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def drop_leftover_schemas(url: str) -> None:
    """Schemas this run made and did not drop (a child that failed before its cleanup)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as connection:
        rows = connection.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE %s",
            (f"ijpeers\\_{os.getpid()}\\_%",),
        ).fetchall()
        for (schema,) in rows:
            connection.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def postgres_settings(url: str) -> dict[str, str] | None:
    import psycopg

    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=5) as connection:
            settings = {}
            for name in ("server_version", "fsync", "synchronous_commit", "wal_sync_method"):
                row = connection.execute(f"SHOW {name}").fetchone()
                settings[name] = str(row[0]) if row else "?"
    except psycopg.Error:
        return None
    return settings
