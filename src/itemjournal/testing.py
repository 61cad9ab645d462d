"""Helpers for testing code that uses itemjournal.

``MemoryStore`` keeps a journal's records in memory, so a unit test needs no directory
and no database, and no ``await open``::

    from itemjournal import Journal
    from itemjournal.testing import MemoryStore

    journal = Journal(MemoryStore())

The journal behaves as over a durable store (the same records, read as strictly), but
nothing survives the process: use it for tests, never for work that must be remembered.

A test or a benchmark that needs a location already holding many records plants them
instead of claiming each one through a journal::

    from itemjournal import Identity
    from itemjournal.testing import seed_records, stored_record

    identities = [Identity("bench", "seed", "record", f"s{n}") for n in range(10_000)]
    await seed_records(journal.store, identities, status="succeeded", concurrency=32)

    planted = stored_record(Identity("bench", "seed", "record", "s0"), "needs_review")
    planted.digest, planted.document  # the key and the bytes a store files it under

``seed_records`` writes one record per identity through the store's own ``apply`` (its
own encoding, layout and indexes, as durably as the store writes anything);
``stored_record`` gives the record's document as every store encodes it, for a test that
writes straight into a store's files or table. The records are what a journal would have
written for a claim that began (``started``), then completed (``succeeded``) or was marked
for review (``needs_review``), with the definition ``SEED_DEFINITION`` and no inputs.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import anyio
import anyio.abc

from ._model import machine
from ._model.codec import encode_record
from ._model.identity import Identity, definition_digest, identity_digest, input_digest
from ._model.records import Owner, Record, utc_now
from ._stores.memory import MemoryStore
from ._stores.owners import current_owner
from ._stores.seam import Step, Store

__all__ = [
    "SEED_DEFINITION",
    "MemoryStore",
    "SeedStatus",
    "StoredRecord",
    "seed_records",
    "stored_record",
]

SeedStatus = Literal["started", "succeeded", "needs_review"]
"""The statuses a planted record may have."""

SEED_DEFINITION = definition_digest("itemjournal.testing.seed/1")
"""The definition every planted record names: a claim with it would reuse or refuse them."""

# The input kind of a journal opened without an input_key: planted records read as its own.
_INPUT_KIND = "sha256"


@dataclass(frozen=True, slots=True)
class StoredRecord:
    """A record as a store files it: for a test that writes into the storage directly."""

    identity: Identity
    status: SeedStatus
    claim_id: str
    digest: str
    """The key every store files the record under: the SHA-256 of its identity."""
    document: bytes
    """The record's document, as every store encodes it (and reads it back strictly)."""


def stored_record(
    identity: Identity, status: SeedStatus = "succeeded", *, owner: Owner | None = None
) -> StoredRecord:
    """The record a journal would have written for ``identity`` with ``status``.

    ``owner`` is the process named as the claim's holder; by default this one, so a
    planted ``started`` record reads as in progress, never as abandoned.
    """
    _check_status(status)
    record = _record(identity, status, owner or current_owner())
    return StoredRecord(
        identity, status, record.claim_id, identity_digest(identity), encode_record(record)
    )


async def seed_records(
    store: Store,
    identities: Iterable[Identity],
    *,
    status: SeedStatus = "succeeded",
    concurrency: int = 1,
) -> int:
    """Write a ``status`` record for each identity through ``store.apply``; returns how many.

    Each identity must have no record yet (``ValueError`` otherwise: a seed never
    overwrites). ``concurrency`` writes are in flight at once, which lets a store that
    batches (SQLite) commit many in one transaction. The store must be open.
    """
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency is a number of writes, at least 1, not {concurrency!r}")
    _check_status(status)
    pending: Iterator[Identity] = iter(identities)
    owner = store.owner()
    written = 0
    failures: list[Exception] = []

    async def plant(identity: Identity) -> None:
        record = _record(identity, status, owner)

        def step(current: Record | None) -> Step[None]:
            if current is not None:
                raise ValueError(f"{identity} has a record already: a seed never overwrites")
            return Step(record, None)

        await store.apply(identity, step)

    async def worker(group: anyio.abc.TaskGroup) -> None:
        nonlocal written
        for identity in pending:  # the workers share one iterator: each identity once
            try:
                await plant(identity)
            except Exception as error:
                # The first failure is the caller's, as it is, not wrapped in a group.
                failures.append(error)
                group.cancel_scope.cancel()
                return
            written += 1

    async with anyio.create_task_group() as group:
        for _ in range(concurrency):
            group.start_soon(worker, group)
    if failures:
        raise failures[0]
    return written


def _check_status(status: str) -> None:
    if status not in ("started", "succeeded", "needs_review"):
        raise ValueError(f"a seeded record is started, succeeded or needs_review, not {status!r}")


def _record(identity: Identity, status: SeedStatus, owner: Owner) -> Record:
    """A record made by the state machine itself, as a journal's claim would make it."""
    identity = Identity(*identity)
    now = utc_now()
    started = machine.begin(
        None,
        identity=identity,
        input_kind=_INPUT_KIND,
        input_hash=input_digest({}),
        definition_hash=SEED_DEFINITION,
        claim_id=secrets.token_hex(16),
        owner=owner,
        now=now,
    )
    assert started is not None  # a first claim always begins
    if status == "succeeded":
        return machine.complete(
            started,
            claim_id=started.claim_id,
            input_hash=started.input_hash,
            definition_hash=SEED_DEFINITION,
            receipt="seeded",
            now=now,
        )
    if status == "needs_review":
        return machine.mark_review(started, reason="seeded for review", claim_id=None, now=now)
    _check_status(status)
    return started
