"""``itemjournal.testing``'s planted records: what a journal reads back from every store."""

from __future__ import annotations

import json

import pytest

from itemjournal import ConflictError, Identity, Journal, Reuse, identity_digest
from itemjournal.testing import SEED_DEFINITION, seed_records, stored_record

pytestmark = pytest.mark.anyio


def _identities(count: int, job: str = "record") -> list[Identity]:
    return [Identity("test", "seed", job, f"s{n}") for n in range(count)]


async def test_seeded_records_read_as_a_journal_wrote_them(journal: Journal) -> None:
    done, review, started = _identities(5, "done"), _identities(3, "review"), _identities(2, "go")
    assert await seed_records(journal.store, done, concurrency=4) == 5
    assert await seed_records(journal.store, review, status="needs_review") == 3
    assert await seed_records(journal.store, started, status="started", concurrency=8) == 2
    counts = await journal.counts()
    assert (counts["succeeded"], counts["needs_review"], counts["started"]) == (5, 3, 2)
    reused = await journal.begin(done[0], {}, SEED_DEFINITION)
    assert isinstance(reused, Reuse)
    assert reused.receipt == "seeded"
    assert (await journal.inspect(review[0])).review_reason == "seeded for review"
    with pytest.raises(ConflictError) as refused:
        await journal.begin(started[0], {}, SEED_DEFINITION)
    assert refused.value.code == "IN_PROGRESS"  # this process holds it: not abandoned
    assert not (await journal.sweep()).marked


async def test_a_seed_never_overwrites(journal: Journal) -> None:
    (identity,) = _identities(1)
    await seed_records(journal.store, [identity])
    with pytest.raises(ValueError, match="has a record already"):
        await seed_records(journal.store, [identity], status="needs_review")
    assert (await journal.inspect(identity)).status == "succeeded"


async def test_seed_refuses_what_it_cannot_plant(journal: Journal) -> None:
    with pytest.raises(ValueError, match="concurrency"):
        await seed_records(journal.store, _identities(1), concurrency=0)
    with pytest.raises(ValueError, match="not 'released'"):
        await seed_records(journal.store, _identities(1), status="released")  # type: ignore[arg-type]


def test_stored_record_is_the_document_a_store_files() -> None:
    identity = Identity("test", "seed", "record", "s0")
    planted = stored_record(identity, "needs_review")
    assert planted.digest == identity_digest(identity)
    document = json.loads(planted.document)
    assert document["identity"] == list(identity)
    assert document["status"] == planted.status == "needs_review"
    assert document["claim_id"] == planted.claim_id
    assert document["definition_hash"] == SEED_DEFINITION
    assert json.loads(stored_record(identity, "started").document)["status"] == "started"


def test_identity_digest_is_public_and_the_key_a_claim_carries() -> None:
    import itemjournal

    assert "identity_digest" in itemjournal.__all__
    digest = identity_digest(Identity("s", "p", "j", "i"))
    assert len(digest) == 64 and int(digest, 16) >= 0
