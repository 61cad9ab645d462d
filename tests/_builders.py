"""Records built by hand for tests that need one without a journal."""

from __future__ import annotations

from itemjournal import Identity, Owner, definition_digest
from itemjournal._records import Record

NOW = "2026-11-30T00:00:00.000000+00:00"
DEFINITION = definition_digest("billing-v1")
# An exact process name as an owner on another machine would write it.
ELSEWHERE_PROCESS = "0f3c9a52-6b1e-4d8e-9a4b-2c7d5e1f8a90:4026531836:123456"


def started_record(identity: Identity, owner: Owner | None = None) -> Record:
    """A valid ``started`` record of ``identity`` (owned by default by a process elsewhere)."""
    record = Record(
        identity=identity,
        input_kind="sha256",
        input_hash="a" * 64,
        definition_hash=DEFINITION,
        claim_id="b" * 32,
        status="started",
        receipt=None,
        attempt=1,
        created_at=NOW,
        updated_at=NOW,
        owner=owner or Owner("elsewhere", 42, NOW, ELSEWHERE_PROCESS),
        review_reason=None,
    )
    return record.advance("begin", "started", NOW)
