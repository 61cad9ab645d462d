"""Records built by hand for tests that need one without a journal."""

from __future__ import annotations

import contextlib

from itemjournal import Identity, Owner, definition_digest
from itemjournal._model.records import Record

NOW = "2026-11-30T00:00:00.000000+00:00"
DEFINITION = definition_digest("billing-v1")
# An exact process name as an owner on another machine would write it.
ELSEWHERE_PROCESS = "0f3c9a52-6b1e-4d8e-9a4b-2c7d5e1f8a90:4026531836:4026531834:123456"


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


def written_long_ago(location: str, seconds: float) -> None:
    """Move the store's own witness of when each record was written (``Store.ages``)
    ``seconds`` back, as if every write had landed that long ago by the kernel's clock:
    the modification times of a file journal's records, ``written_at`` of a SQLite one."""
    import os
    import sqlite3
    import time
    from pathlib import Path

    if location.startswith("sqlite://"):
        with contextlib.closing(sqlite3.connect(location.removeprefix("sqlite://"))) as db:
            db.execute("UPDATE itemjournal_records SET written_at = written_at - ?", (seconds,))
            db.commit()
        return
    then = time.time() - seconds
    for path in Path(location).glob("??/*.json"):
        os.utime(path, (then, then), follow_symlinks=False)


def dead_owner(pid: int = 2**22 + 1) -> Owner:
    """An owner of this boot and these namespaces whose process is gone: ``pid`` is above
    the kernel's pid limit, so no process has it."""
    from itemjournal._model.records import parse_process
    from itemjournal._stores.owners import current_owner

    me = current_owner()
    name = parse_process(me.process)
    assert name is not None and name.pid_namespace is not None, "this process names itself"
    process = f"{name.boot}:{name.pid_namespace}:{name.time_namespace}:1"
    return Owner(me.host, pid, NOW, process)


def gone_reason_of(journal: object) -> str:
    """The review reason a journal's store gives an owner it found gone: a process on the
    stores of one host, the database session that vouched for it on PostgreSQL."""
    store = getattr(journal, "store", None)
    return "owner session gone" if type(store).__name__ == "PostgresStore" else "owner process gone"
