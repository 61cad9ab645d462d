"""The record document: encoding, strict reading, hostile files (SPEC §2)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from _builders import started_record

from itemjournal import Identity, Journal, RecordInvalid, definition_digest
from itemjournal._model import codec as _records
from itemjournal._model.codec import clear_decode_cache, decode_record, encode_record
from itemjournal._model.records import HISTORY_LIMIT, MAX_RECORD_BYTES, Owner, Record, parse_process

pytestmark = pytest.mark.anyio

IDENTITY = Identity("shop", "billing", "charge", "order-1")
OTHER = Identity("shop", "billing", "charge", "order-2")
DEFINITION = definition_digest("billing-v1")
NOW = "2026-11-30T00:00:00.000000+00:00"
BOOT = "0f3c9a52-6b1e-4d8e-9a4b-2c7d5e1f8a90"


def started() -> Record:
    return started_record(IDENTITY, Owner("host", 42, "2026-11-29T23:00:00.000+00:00"))


def read_back(data: bytes, identity: Identity = IDENTITY) -> Record:
    """Decode as a new process would: strictly, not from the writer's decode cache."""
    clear_decode_cache()
    return decode_record(data, identity)


def document(record: Record | None = None) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(encode_record(record or started()))
    return loaded


def test_round_trip() -> None:
    record = started().advance("complete", "succeeded", NOW, receipt="ch_1")
    assert read_back(encode_record(record)) == record


def test_document_holds_the_contract_fields() -> None:
    fields = set(document())
    assert {
        "version",
        "identity",
        "input_hash",
        "definition_hash",
        "claim_id",
        "status",
        "receipt",
    } <= fields
    assert {"attempt", "created_at", "updated_at", "owner", "review_reason", "history"} <= fields
    assert document()["identity"] == list(IDENTITY)


@pytest.mark.parametrize(
    "process",
    [
        "",
        BOOT,  # the boot alone: the owner could not name its process
        f"{BOOT}:4026531836:0",  # written before time namespaces were recorded
        f"{BOOT}:1:{2**64 - 1}",
        f"{BOOT}:{2**64 - 1}:42",
        f"{BOOT}:4026531836:4026531834:42",
        f"{BOOT}:4026531836:0:42",  # a kernel without time namespaces
        f"{BOOT}:1:{2**64 - 1}:{2**64 - 1}",
    ],
)
def test_owner_process_round_trips(process: str) -> None:
    owner = Owner("host", 42, "2026-11-29T23:00:00.000+00:00", process)
    data = encode_record(started_record(IDENTITY, owner))
    assert json.loads(data)["owner"]["process"] == process
    decoded = read_back(data)
    assert decoded.owner == owner


def test_what_an_owner_process_names() -> None:
    assert parse_process(f"{BOOT}:4026531836:4026531834:42") == (BOOT, 4026531836, 4026531834, 42)
    assert parse_process(f"{BOOT}:4026531836:42") == (BOOT, 4026531836, None, 42)
    assert parse_process(BOOT) == (BOOT, None, None, None)
    assert parse_process("") is None


def test_owner_process_defaults_to_unknown() -> None:
    assert Owner("host", 42, "").process == ""
    assert document()["owner"] == {
        "host": "host",
        "pid": 42,
        "started_at": "2026-11-29T23:00:00.000+00:00",
        "process": "",
    }


def test_history_is_bounded() -> None:
    record = started()
    for n in range(HISTORY_LIMIT * 2):
        record = record.advance("begin", "started", NOW, note=f"n{n}")
    assert len(record.history) == HISTORY_LIMIT
    assert record.history[-1].note == f"n{HISTORY_LIMIT * 2 - 1}"
    assert read_back(encode_record(record)) == record


def mutate(change: dict[str, Any] | None = None, drop: str | None = None) -> bytes:
    doc = document()
    doc.update(change or {})
    if drop:
        del doc[drop]
    return json.dumps(doc).encode()


BAD_DOCUMENTS = {
    "not json": b"{not json",
    "truncated": encode_record(started())[:-20],
    "empty": b"",
    "array": b"[]",
    "not utf-8": b'{"version": "\xff"}',
    "NaN constant": mutate({"attempt": float("nan")}),
    "duplicate key": encode_record(started()).replace(b'"version"', b'"version": 1, "version"', 1),
    "duplicate owner key": encode_record(started()).replace(b'"pid"', b'"pid": 1, "pid"', 1),
    "duplicate key, same value": encode_record(started()).replace(
        b'"version": 1', b'"version": 1, "version": 1', 1
    ),
    "byte order mark": b"\xef\xbb\xbf" + encode_record(started()),
    "unknown field": mutate({"extra": 1}),
    "missing field": mutate(drop="claim_id"),
    "wrong version": mutate({"version": 2}),
    "bool version": mutate({"version": True}),
    "other identity": mutate({"identity": list(OTHER)}),
    "identity of three": mutate({"identity": ["a", "b", "c"]}),
    "bad label": mutate({"identity": ["shop", "billing", "charge", "../x"]}),
    "unknown status": mutate({"status": "done"}),
    "status not str": mutate({"status": ["started"]}),
    "receipt on started": mutate({"receipt": "ch_1"}),
    "succeeded without receipt": mutate({"status": "succeeded"}),
    "blank receipt": mutate({"status": "succeeded", "receipt": "  "}),
    "long receipt": mutate({"status": "succeeded", "receipt": "r" * 201}),
    "receipt not str": mutate({"status": "succeeded", "receipt": 5}),
    "short hash": mutate({"input_hash": "a" * 63}),
    "upper hash": mutate({"definition_hash": "A" * 64}),
    "claim id": mutate({"claim_id": "xyz"}),
    "input kind": mutate({"input_kind": "md5"}),
    "attempt zero": mutate({"attempt": 0}),
    "attempt str": mutate({"attempt": "1"}),
    "bad time": mutate({"created_at": "yesterday"}),
    "impossible date": mutate({"created_at": "2025-02-30T00:00:00.000000+00:00"}),
    "time not str": mutate({"updated_at": ["2025-01-01T00:00:00.000000+00:00"]}),
    "started without owner": mutate({"owner": None}),
    "owner fields": mutate({"owner": {"host": "h", "pid": 1, "started_at": ""}}),
    "owner pid": mutate({"owner": {"host": "h", "pid": -1, "started_at": "", "process": ""}}),
    **{
        f"owner process {name}": mutate(
            {"owner": {"host": "h", "pid": 1, "started_at": "", "process": value}}
        )
        for name, value in {
            "not str": 5,
            "null": None,
            "free text": "pid 1",
            "upper case": f"{BOOT.upper()}:4026531836:12",
            "no dashes": f"{BOOT.replace('-', '')}:4026531836:12",
            "two parts": f"{BOOT}:4026531836",
            "five parts": f"{BOOT}:4026531836:4026531834:12:1",
            "time namespace leading zero": f"{BOOT}:4026531836:04026531834:12",
            "time namespace over 64 bits": f"{BOOT}:4026531836:{2**64}:12",
            "boot and a colon": f"{BOOT}:",
            "zero namespace": f"{BOOT}:0:12",
            "leading zero": f"{BOOT}:4026531836:012",
            "negative ticks": f"{BOOT}:4026531836:-1",
            "ticks over 64 bits": f"{BOOT}:4026531836:{2**64}",
            "namespace over 64 bits": f"{BOOT}:{2**64}:12",
            "spaces": f" {BOOT}:4026531836:12",
            "newline": f"{BOOT}:4026531836:12\n",
            "non-ascii digit": f"{BOOT}:4026531836:1\u0662",
        }.items()
    },
    "history not list": mutate({"history": {}}),
    "history entry": mutate({"history": [{"at": NOW}]}),
    "history event": mutate(
        {"history": [{"at": NOW, "event": "x", "status": "started", "attempt": 1, "note": None}]}
    ),
    "history too long": mutate(
        {
            "history": [
                {"at": NOW, "event": "begin", "status": "started", "attempt": 1, "note": None}
            ]
            * (HISTORY_LIMIT + 1)
        }
    ),
    "blank reason": mutate({"review_reason": " "}),
    "deep nesting": b"[" * 100_000 + b"]" * 100_000,
    "oversize": b" " * (MAX_RECORD_BYTES + 1) + encode_record(started()),
}


@pytest.mark.parametrize("data", BAD_DOCUMENTS.values(), ids=BAD_DOCUMENTS.keys())
def test_strict_reading(data: bytes) -> None:
    with pytest.raises(RecordInvalid) as caught:
        decode_record(data, IDENTITY, location="/x")
    assert caught.value.code == "RECORD_INVALID"
    assert "/x" in str(caught.value)


async def corrupt_on_disk(journal: Journal, data: bytes) -> Path:
    """Begin the identity, then overwrite its record with ``data``."""
    await journal.begin(IDENTITY, {"a": "1"}, DEFINITION)
    path = journal.store.path_for(IDENTITY)  # type: ignore[attr-defined]
    assert isinstance(path, Path)
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    "name", ["not json", "unknown field", "missing field", "other identity", "oversize"]
)
async def test_corrupt_record_is_reported_and_left_byte_for_byte(
    journal: Journal, name: str, file_only: None
) -> None:
    data = BAD_DOCUMENTS[name]
    path = await corrupt_on_disk(journal, data)
    for call in (
        lambda: journal.inspect(IDENTITY),
        lambda: journal.begin(IDENTITY, {"a": "1"}, DEFINITION),
        lambda: journal.mark_review(IDENTITY),
        lambda: journal.resolve(IDENTITY, retry=True, note="checked"),
    ):
        with pytest.raises(RecordInvalid) as caught:
            await call()
        assert caught.value.code == "RECORD_INVALID"
        assert path.read_bytes() == data


async def test_record_copied_to_another_identity_is_invalid(
    journal: Journal, file_only: None
) -> None:
    await journal.begin(OTHER, {}, DEFINITION)
    store = journal.store
    source = store.path_for(OTHER)  # type: ignore[attr-defined]
    target = store.path_for(IDENTITY)  # type: ignore[attr-defined]
    target.parent.mkdir(mode=0o700, exist_ok=True)
    target.write_bytes(source.read_bytes())
    with pytest.raises(RecordInvalid):
        await journal.begin(IDENTITY, {}, DEFINITION)
    assert target.read_bytes() == source.read_bytes()


def test_what_was_checked_before_does_not_let_a_bad_value_through() -> None:
    """Checked labels, hashes and times are remembered (bounded); a value that does not
    match is refused however many good ones were seen, and the memory stays bounded."""
    record = started()
    for n in range(_records._MATCHED_LIMIT + 10):
        hashed = f"{n:064x}"
        assert read_back(encode_record(replace(record, input_hash=hashed))).input_hash == hashed
    assert all(len(seen) <= _records._MATCHED_LIMIT for seen in _records._MATCHED.values())
    good = document(record)
    for field, bad in (
        ("input_hash", good["input_hash"].upper()),
        ("claim_id", good["claim_id"] + "0"),
        ("identity", [*good["identity"][:3], good["identity"][3] + "/"]),
        ("created_at", good["created_at"].replace("T", " ")),
    ):
        spoiled = dict(good, **{field: bad})
        with pytest.raises(RecordInvalid):
            read_back(json.dumps(spoiled, sort_keys=True).encode(), IDENTITY)


def test_the_bytes_are_a_sorted_dump_of_the_document() -> None:
    """The writer builds each object with its keys in order instead of asking the encoder
    to sort them: the bytes are exactly those of a sorted dump, for every shape of record
    (with and without a result, an owner session, notes)."""
    base = started()
    shapes = [
        base,
        replace(base, owner=replace(base.owner, session="pg:0123456789abcdef")),
        base.advance("complete", "succeeded", NOW, receipt="ch_1", owner=None),
        base.advance("complete", "succeeded", NOW, receipt="ch_1", owner=None, result='{"a":1}'),
        base.advance("mark_review", "needs_review", NOW, "timeout é", review_reason="timeout é"),
    ]
    for record in shapes:
        data = encode_record(record)
        assert (
            data
            == (json.dumps(json.loads(data), sort_keys=True, ensure_ascii=False) + "\n").encode()
        )
        assert read_back(data) == record
