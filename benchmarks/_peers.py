"""The peers: other ways to keep a journal of claims, each driven as begin + complete cycles.

``lean``
    The lean plain SQLite design on aiosqlite: one shared connection in autocommit mode
    (WAL, ``synchronous=FULL``), the claim one ``INSERT`` (a conflict is then read and
    decided), the completion one compare-and-set ``UPDATE … WHERE digest = ? AND
    claim_id = ? AND status = 'started'``. No explicit transaction, no lock: one
    statement, one commit, one aiosqlite trip per operation.
``aiosqlite``
    ``bench_sqlite.AiosqlitePeer``: read-decide-write in ``BEGIN IMMEDIATE`` … ``COMMIT``,
    one lock held across each transaction on the shared connection.
``serial``
    The design this product grew from: one file per record in one directory, every
    ``begin`` and ``complete`` a synchronous read-decide-save (temp file, fsync,
    ``os.replace``) under one process-wide lock; driven through worker threads.
``serial-on-loop``
    The same, called directly on the event loop (each save blocks the loop: the lag row).
``aiofiles``
    A naive async journal on aiofiles: the same file layout and saves, one worker-thread
    trip per file call (exists, open, read, write, flush, fsync, close, replace).
``idempotency``
    The PyPI ``idempotency`` package's ``@idempotent`` guard with its ``FileStore``,
    driven through worker threads. It has no separate begin and complete: one guarded
    call writes ``in_progress``, runs the function, writes ``completed``; that call is
    the cycle. It never fsyncs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiofiles
import aiofiles.os
import aiofiles.ospath
import anyio.lowlevel
import anyio.to_thread
from _common import Env, Sample, measure, run_directory
from bench_sqlite import AiosqlitePeer, PeerClaim, PeerRefused, PeerReuse, _sha256_json

from itemjournal import definition_digest

DEFINITION = definition_digest("bench-peer-v1")

# ---------------------------------------------------------------------- lean SQLite


class LeanPeer(AiosqlitePeer):
    """Autocommit ``INSERT`` to claim, compare-and-set ``UPDATE`` to complete."""

    async def begin(
        self, identity: tuple[str, ...], inputs: Mapping[str, str], definition: str
    ) -> PeerClaim | PeerReuse:
        digest = _sha256_json(list(identity))
        input_hash = _sha256_json(dict(inputs))
        claim_id = uuid.uuid4().hex
        document = self._document(identity, input_hash, definition, claim_id, _now())
        try:
            await self.db.execute(
                "INSERT INTO claims (digest, status, claim_id, document) "
                "VALUES (?, 'started', ?, ?)",
                (digest, claim_id, json.dumps(document, sort_keys=True).encode()),
            )
        except sqlite3.IntegrityError:
            rows = list(
                await self.db.execute_fetchall(
                    "SELECT status, document FROM claims WHERE digest = ?", (digest,)
                )
            )
            if not rows:
                raise PeerRefused(f"{identity}: changed meanwhile") from None
            old: dict[str, Any] = json.loads(rows[0][1])
            same = old["input_hash"] == input_hash and old["definition_hash"] == definition
            if rows[0][0] == "succeeded" and same:
                return PeerReuse(str(old["receipt"]))
            raise PeerRefused(f"{identity}: {rows[0][0]}, cannot claim") from None
        self.commits += 1
        return LeanClaim(digest, claim_id, 1, document)

    async def complete(self, claim: PeerClaim, receipt: str) -> dict[str, Any]:
        if not isinstance(claim, LeanClaim):
            raise TypeError("a claim of this peer")
        now = _now()
        event = self._event(now, "complete", "succeeded", claim.attempt)
        document = {
            **claim.document,
            "status": "succeeded",
            "receipt": receipt,
            "updated_at": now,
            "history": [*claim.document["history"], event][-32:],
        }
        cursor = await self.db.execute(
            "UPDATE claims SET status = 'succeeded', document = ? "
            "WHERE digest = ? AND claim_id = ? AND status = 'started'",
            (json.dumps(document, sort_keys=True).encode(), claim.digest, claim.claim_id),
        )
        if cursor.rowcount != 1:
            raise PeerRefused("not started by this claim")
        self.commits += 1
        return document


@dataclass(frozen=True)
class LeanClaim(PeerClaim):
    document: dict[str, Any]


def _now() -> str:
    from datetime import UTC, datetime

    return datetime.now(UTC).isoformat(timespec="microseconds")


async def _run_sqlite_peer(
    env: Env, cycles: int, concurrency: int, kind: type[AiosqlitePeer], name: str
) -> Sample:
    async with run_directory(env.base, f"{name}-") as root:
        peer = await kind.open(os.path.join(root, "peer.db"))
        try:

            async def cycle(index: int) -> None:
                identity = ("bench", name, "cycle", f"i{index}")
                claim = await peer.begin(identity, {"n": str(index)}, DEFINITION)
                if not isinstance(claim, PeerClaim):
                    raise TypeError(f"expected a fresh claim for {identity}, got {claim!r}")
                await peer.complete(claim, f"receipt-{index}")

            sample = await measure(cycle, cycles, concurrency, commits=lambda: peer.commits)
            rows = list(
                await peer.db.execute_fetchall(
                    "SELECT count(*) FROM claims WHERE status = 'succeeded'"
                )
            )
            if int(rows[0][0]) != cycles:
                raise RuntimeError(f"{name}: expected {cycles} succeeded rows, found {rows[0][0]}")
        finally:
            await peer.aclose()
    return sample


async def run_lean(env: Env, cycles: int, concurrency: int) -> Sample:
    return await _run_sqlite_peer(env, cycles, concurrency, LeanPeer, "lean")


async def run_aiosqlite(env: Env, cycles: int, concurrency: int) -> Sample:
    return await _run_sqlite_peer(env, cycles, concurrency, AiosqlitePeer, "aiosqlite")


# ---------------------------------------------------------------------- the serialised design

_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}")


class Refused(Exception):
    """A peer journal refused a begin or a complete."""


@dataclass(frozen=True)
class FileClaim:
    identity: tuple[str, ...]
    input_hash: str
    definition_hash: str
    claim_id: str


def _record_name(identity: tuple[str, ...]) -> str:
    if len(identity) != 4 or not all(_LABEL.fullmatch(label) for label in identity):
        raise ValueError(f"invalid identity {identity!r}")
    text = json.dumps(list(identity), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest() + ".json"


def _document(claim: FileClaim, status: str, receipt: str | None) -> str:
    return json.dumps(
        {
            "version": 1,
            "identity": list(claim.identity),
            "input_hash": claim.input_hash,
            "definition_hash": claim.definition_hash,
            "claim_id": claim.claim_id,
            "status": status,
            "receipt": receipt,
        },
        sort_keys=True,
    )


def _decide_begin(raw: str | None, claim: FileClaim) -> str | None:
    """The stored receipt to reuse, None to claim; raises ``Refused``."""
    if raw is None:
        return None
    old = json.loads(raw)
    if old["status"] == "succeeded" and (old["input_hash"], old["definition_hash"]) == (
        claim.input_hash,
        claim.definition_hash,
    ):
        return str(old["receipt"])
    raise Refused(f"{claim.identity}: {old['status']}")


def _check_complete(raw: str | None, claim: FileClaim) -> None:
    old = None if raw is None else json.loads(raw)
    if old is None or old["claim_id"] != claim.claim_id or old["status"] != "started":
        raise Refused(f"{claim.identity}: not started by this claim")


class SerialJournal:
    """One lock held across each synchronous read-decide-save (temp, fsync, replace)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.lock = threading.RLock()

    def _read(self, path: str) -> str | None:
        try:
            with open(path, encoding="utf-8") as stream:
                return stream.read()
        except FileNotFoundError:
            return None

    def _save(self, path: str, text: str) -> None:
        temp = os.path.join(self.root, f"{uuid.uuid4().hex}.tmp")
        try:
            with open(temp, "x", encoding="utf-8") as stream:
                stream.write(text)
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(temp, path)
        finally:
            if os.path.exists(temp):
                os.unlink(temp)

    def begin(self, identity: tuple[str, ...], inputs: dict[str, str]) -> FileClaim | str:
        claim = FileClaim(identity, _sha256_json(inputs), DEFINITION, uuid.uuid4().hex)
        path = os.path.join(self.root, _record_name(identity))
        with self.lock:
            reuse = _decide_begin(self._read(path), claim)
            if reuse is not None:
                return reuse
            self._save(path, _document(claim, "started", None))
        return claim

    def complete(self, claim: FileClaim, receipt: str) -> None:
        path = os.path.join(self.root, _record_name(claim.identity))
        with self.lock:
            _check_complete(self._read(path), claim)
            self._save(path, _document(claim, "succeeded", receipt))


async def run_serial(env: Env, cycles: int, concurrency: int) -> Sample:
    async with run_directory(env.base, "serial-") as root:
        journal = SerialJournal(root)

        async def cycle(index: int) -> None:
            identity = ("bench", "serial", "cycle", f"i{index}")
            claim = await anyio.to_thread.run_sync(journal.begin, identity, {"n": str(index)})
            if not isinstance(claim, FileClaim):
                raise TypeError(f"expected a fresh claim for {identity}")
            await anyio.to_thread.run_sync(journal.complete, claim, f"receipt-{index}")

        return await measure(cycle, cycles, concurrency)


async def run_serial_on_loop(env: Env, cycles: int, concurrency: int) -> Sample:
    async with run_directory(env.base, "serial-loop-") as root:
        journal = SerialJournal(root)

        async def cycle(index: int) -> None:
            identity = ("bench", "serial", "cycle", f"i{index}")
            claim = journal.begin(identity, {"n": str(index)})  # blocks the event loop
            if not isinstance(claim, FileClaim):
                raise TypeError(f"expected a fresh claim for {identity}")
            await anyio.lowlevel.checkpoint()
            journal.complete(claim, f"receipt-{index}")
            await anyio.lowlevel.checkpoint()

        return await measure(cycle, cycles, concurrency)


# ---------------------------------------------------------------------- naive aiofiles

_fsync = aiofiles.ospath.wrap(os.fsync)


class AiofilesJournal:
    """The same saves, one aiofiles call (one worker-thread trip) per file call; no lock."""

    def __init__(self, root: str) -> None:
        self.root = root

    async def _read(self, path: str) -> str | None:
        if not await aiofiles.ospath.exists(path):
            return None
        async with aiofiles.open(path, encoding="utf-8") as stream:
            return str(await stream.read())

    async def _save(self, path: str, text: str) -> None:
        temp = os.path.join(self.root, f"{uuid.uuid4().hex}.tmp")
        async with aiofiles.open(temp, "x", encoding="utf-8") as stream:
            await stream.write(text)
            await stream.flush()
            await _fsync(stream.fileno())
        await aiofiles.os.replace(temp, path)

    async def begin(self, identity: tuple[str, ...], inputs: dict[str, str]) -> FileClaim | str:
        claim = FileClaim(identity, _sha256_json(inputs), DEFINITION, uuid.uuid4().hex)
        path = os.path.join(self.root, _record_name(identity))
        reuse = _decide_begin(await self._read(path), claim)
        if reuse is not None:
            return reuse
        await self._save(path, _document(claim, "started", None))
        return claim

    async def complete(self, claim: FileClaim, receipt: str) -> None:
        path = os.path.join(self.root, _record_name(claim.identity))
        _check_complete(await self._read(path), claim)
        await self._save(path, _document(claim, "succeeded", receipt))


async def run_aiofiles(env: Env, cycles: int, concurrency: int) -> Sample:
    async with run_directory(env.base, "aiofiles-") as root:
        journal = AiofilesJournal(root)

        async def cycle(index: int) -> None:
            identity = ("bench", "aiofiles", "cycle", f"i{index}")
            claim = await journal.begin(identity, {"n": str(index)})
            if not isinstance(claim, FileClaim):
                raise TypeError(f"expected a fresh claim for {identity}")
            await journal.complete(claim, f"receipt-{index}")

        return await measure(cycle, cycles, concurrency)


# ---------------------------------------------------------------------- the idempotency package


async def run_idempotency(env: Env, cycles: int, concurrency: int) -> Sample:
    from idempotency import idempotent
    from idempotency.stores.file import FileStore

    async with run_directory(env.base, "idempotency-") as root:
        store = FileStore(root)

        def effect(index: int) -> str:
            return f"receipt-{index}"

        guarded = idempotent(store=store, key=lambda index: f"bench-i{index}")(effect)

        async def cycle(index: int) -> None:
            receipt = await anyio.to_thread.run_sync(guarded, index)
            if receipt != f"receipt-{index}":
                raise RuntimeError(f"unexpected answer {receipt!r}")

        return await measure(cycle, cycles, concurrency)
