"""Hostile record files (SPEC §2): whatever lies at a record's path, reading is strict.

- Mutations of valid records (bytes flipped, inserted, deleted, truncated; JSON values
  retyped, keys added or removed, nesting changed, identities swapped, unicode tricks):
  ``decode_record`` either returns a valid ``Record`` that survives a canonical
  re-encoding unchanged, or raises ``RecordInvalid``; never anything else.
- Random bytes and random JSON: always ``RecordInvalid``.
- The same hostile bytes through the real file store: every operation refuses with
  ``RECORD_INVALID`` (or works, when the mutation left a valid record), and the file is
  byte-for-byte what was put there: never overwritten, never treated as absent.
- Things that are not regular files, or are too large, at a record's path, beyond what
  ``test_filestore_faults.py`` and ``test_records.py`` already cover: a socket, a symlink
  loop, a symlink to a directory or to a FIFO, a character device, a sparse file of
  gigabytes, the exact size limit; and a scan or sweep over all of them.

Each property test counts its cases and prints the count (visible with ``-s``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import socket
import stat
import string
import tempfile
import threading
import time
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import pytest
from _builders import dead_owner, started_record
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from itemjournal import (
    Claim,
    ConflictError,
    FileStore,
    Identity,
    InvalidArgument,
    Journal,
    JournalError,
    RecordInvalid,
    Reuse,
    definition_digest,
)
from itemjournal._model.codec import decode_record, encode_record
from itemjournal._model.identity import identity_digest
from itemjournal._model.records import (
    HISTORY_LIMIT,
    MAX_RECORD_BYTES,
    STATUSES,
    Event,
    Owner,
    Record,
)

pytestmark = pytest.mark.anyio

IDENTITY = Identity("shop", "billing", "charge", "order-1")
INPUTS = {"amount": "10.00"}
DEFINITION = definition_digest("billing-v1")
NOW = "2026-11-30T00:00:00.000000+00:00"
DEAD_PID = 2**22 + 1  # beyond any Linux pid_max: no such process

# Cases per property test; together at least 10,000 (decode only, no disk).
ROUND_TRIPS = 500
BYTE_MUTATIONS = 4_000
JSON_MUTATIONS = 3_000
RANDOM_BYTES = 2_500
RANDOM_JSON = 500
# Through the real file store, per anyio backend (disk is slower).
STORE_CASES = 200

FAST = settings(
    deadline=None,
    database=None,  # explore afresh each run; write nothing into the repository
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_HEX64 = re.compile(r"[0-9a-f]{64}", re.ASCII)
_HEX32 = re.compile(r"[0-9a-f]{32}", re.ASCII)
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}", re.ASCII)


# ---------------------------------------------------------------------- counting


def run_counted(name: str, test: Callable[[], None], minimum: int) -> int:
    """Run a Hypothesis test that bumps ``CASES[name]`` once per case; print the count."""
    CASES[name] = 0
    VERDICTS.clear()
    started = time.perf_counter()
    test()
    elapsed = time.perf_counter() - started
    verdicts = ", ".join(f"{count} {verdict}" for verdict, count in sorted(VERDICTS.items()))
    print(f"\n[hostile] {name}: {CASES[name]} cases ({verdicts}) in {elapsed:.1f} s")
    assert CASES[name] >= minimum
    return CASES[name]


CASES: dict[str, int] = {}
VERDICTS: Counter[str] = Counter()  # how the cases of the current test came out


# ---------------------------------------------------------------------- valid records

labels = st.builds(
    str.__add__,
    st.sampled_from(string.ascii_letters + string.digits),
    st.text(alphabet=string.ascii_letters + string.digits + "._-", max_size=12),
)
identities = st.builds(Identity, labels, labels, labels, labels)
hex64 = st.binary(min_size=32, max_size=32).map(bytes.hex)
hex32 = st.binary(min_size=16, max_size=16).map(bytes.hex)
times = st.datetimes(min_value=datetime(1970, 1, 1), max_value=datetime(2200, 1, 1)).map(
    lambda moment: moment.replace(tzinfo=UTC).isoformat(timespec="microseconds")
)
notes = st.text(min_size=1, max_size=40).filter(str.strip)
receipts = st.text(min_size=1, max_size=40).filter(str.strip) | st.just("r" * 200)
owners = st.builds(
    Owner, host=st.text(max_size=20), pid=st.integers(1, 2**22), started_at=st.text(max_size=30)
)
events = st.builds(
    Event,
    at=times,
    event=st.sampled_from(("begin", "complete", "mark_review", "resolve", "sweep")),
    status=st.sampled_from(STATUSES),
    attempt=st.integers(1, 1000),
    note=st.none() | notes,
)


@st.composite
def records(draw: st.DrawFn, identity: Identity | None = None) -> Record:
    """Any record ``decode_record`` must accept."""
    status = draw(st.sampled_from(STATUSES))
    owner = draw(owners) if status == "started" else draw(st.none() | owners)
    return Record(
        identity=draw(identities) if identity is None else identity,
        input_kind=draw(st.just("sha256") | hex64.map(lambda h: f"hmac-sha256:{h[:16]}")),
        input_hash=draw(hex64),
        definition_hash=draw(hex64),
        claim_id=draw(hex32),
        status=status,
        receipt=draw(receipts) if status == "succeeded" else None,
        attempt=draw(st.integers(1, 10**6)),
        created_at=draw(times),
        updated_at=draw(times),
        owner=owner,
        review_reason=draw(st.none() | notes),
        history=tuple(draw(st.lists(events, max_size=3))),  # the pool has full histories
    )


@pytest.fixture(scope="module")
def journal_records() -> list[tuple[Identity, bytes]]:
    """Record files written by a real journal, one in each status (and a second attempt)."""

    async def build(root: str) -> list[tuple[Identity, bytes]]:
        journal = await Journal.open(root)
        made: list[Identity] = []

        def item(name: str) -> Identity:
            made.append(Identity("shop", "billing", "charge", name))
            return made[-1]

        await journal.begin(item("started"), INPUTS, DEFINITION)
        claim = await journal.begin(item("succeeded"), INPUTS, DEFINITION)
        assert isinstance(claim, Claim)
        await journal.complete(claim, "ch_✓ 1")
        for name in ("needs-review", "released", "second-attempt"):
            await journal.begin(item(name), INPUTS, DEFINITION)
            await journal.mark_review(made[-1], "gateway timeout")
        await journal.resolve(made[-2], retry=True, note="no charge found")
        await journal.resolve(made[-1], retry=True, note="no charge found")
        await journal.begin(made[-1], {"amount": "11.00"}, definition_digest("billing-v2"))
        store = journal.store
        return [(ident, store.path_for(ident).read_bytes()) for ident in made]  # type: ignore[attr-defined]

    with tempfile.TemporaryDirectory() as root:
        return anyio.run(build, root)


LABEL_CHARS = string.ascii_letters + string.digits + "._-"
TEXT_CHARS = string.printable + "é✓№ßİı\u00a0\u200b\u202e\u2028\ufeff\x00\x7f\U0001f600"


def random_record(rng: random.Random) -> Record:
    """A valid record of some variety (a seeded pool is far cheaper than a strategy)."""

    def label() -> str:
        size = rng.choice((1, 2, 5, 12, 80))
        first = rng.choice(string.ascii_letters + string.digits)
        return first + "".join(rng.choice(LABEL_CHARS) for _ in range(size - 1))

    def text(limit: int) -> str:
        size = rng.choice((1, 3, 20, limit))
        value = "".join(rng.choice(TEXT_CHARS) for _ in range(size))
        return value if value.strip() else "x" + value[1:]

    def moment() -> str:
        seconds = rng.uniform(0, 7e9)  # 1970 to 2191
        return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="microseconds")

    def hexdigits(count: int) -> str:
        return "".join(rng.choice("0123456789abcdef") for _ in range(count))

    status = rng.choice(STATUSES)
    owner = Owner(text(30), rng.randint(1, 2**22), rng.choice(("", moment(), text(30))))
    history = tuple(
        Event(
            moment(),
            rng.choice(("begin", "complete", "mark_review", "resolve", "sweep")),
            rng.choice(STATUSES),
            rng.randint(1, 99),
            rng.choice((None, text(500))),
        )
        for _ in range(rng.choice((0, 1, 2, 4, HISTORY_LIMIT)))
    )
    return Record(
        identity=Identity(label(), label(), label(), label()),
        input_kind=rng.choice(("sha256", f"hmac-sha256:{hexdigits(16)}")),
        input_hash=hexdigits(64),
        definition_hash=hexdigits(64),
        claim_id=hexdigits(32),
        status=status,
        receipt=text(200) if status == "succeeded" else None,
        attempt=rng.choice((1, 2, 3, 2**31, 10**12)),
        created_at=moment(),
        updated_at=moment(),
        owner=owner if status == "started" or rng.random() < 0.5 else None,
        review_reason=rng.choice((None, text(500))),
        history=history,
    )


POOL_SIZE = 256


@pytest.fixture(scope="module")
def valid_files(journal_records: list[tuple[Identity, bytes]]) -> list[tuple[Identity, bytes]]:
    """The record files mutations start from: the real journal's, then a seeded variety."""
    rng = random.Random(20261130)
    pool = list(journal_records)
    while len(pool) < POOL_SIZE:
        record = random_record(rng)
        pool.append((record.identity, encode_record(record)))
    for identity, data in pool:
        assert decode_record(data, identity).identity == identity
    return pool


def from_pool(pool: list[tuple[Identity, bytes]]) -> st.SearchStrategy[tuple[Identity, bytes]]:
    """One of the valid files (drawn by index: a failure report stays short)."""
    return st.integers(0, len(pool) - 1).map(lambda index: pool[index])


# ---------------------------------------------------------------------- the property


def decoded_or_refused(data: bytes, identity: Identity, by_digest: bool) -> Record | None:
    """``decode_record``'s answer, checked: a valid record, or RecordInvalid (None).

    Any other exception propagates and fails the test.
    """
    expected: Identity | str = identity_digest(identity) if by_digest else identity
    try:
        record = decode_record(data, expected, location="/hostile/record.json")
    except RecordInvalid as error:
        assert error.code == "RECORD_INVALID"
        assert error.location == "/hostile/record.json"
        assert "/hostile/record.json" in str(error)
        VERDICTS["refused"] += 1
        return None
    assert encodable(record), "a record that cannot be written back was accepted"
    assert_valid(record, identity)
    again = relaid(encode_record(record))
    assert decode_record(again, identity) == record
    assert decode_record(again, identity_digest(identity)) == record
    VERDICTS["valid"] += 1
    return record


def relaid(data: bytes) -> bytes:
    """The same document in another layout (indented, ASCII escapes, keys reversed).

    ``decode_record`` remembers the exact bytes it has read or ``encode_record`` has
    written; other bytes make it parse and check the document afresh.
    """
    document = json.loads(data)
    reordered = dict(reversed(list(document.items())))
    return json.dumps(reordered, indent=1, ensure_ascii=True).encode("ascii")


def encodable(record: Record) -> bool:
    """Whether every text of ``record`` is valid Unicode (no lone surrogate)."""
    texts = [record.receipt, record.review_reason, record.input_kind]
    if record.owner is not None:
        texts += [record.owner.host, record.owner.started_at]
    texts += [event.note for event in record.history]
    try:
        for text in texts:
            if text is not None:
                text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def assert_valid(record: Record, identity: Identity) -> None:
    """The contract's rules for a record, checked independently of the decoder."""
    assert type(record) is Record
    assert type(record.identity) is Identity
    assert record.identity == identity
    assert all(_LABEL.fullmatch(label) for label in record.identity)
    assert record.status in STATUSES
    if record.status == "succeeded":
        assert isinstance(record.receipt, str)
        assert record.receipt.strip()
        assert len(record.receipt) <= 200
    else:
        assert record.receipt is None
    if record.status == "started":
        assert record.owner is not None
    assert _HEX64.fullmatch(record.input_hash)
    assert _HEX64.fullmatch(record.definition_hash)
    assert _HEX32.fullmatch(record.claim_id)
    assert type(record.attempt) is int
    assert record.attempt >= 1
    assert len(record.history) <= HISTORY_LIMIT
    for event in record.history:
        assert type(event) is Event
        assert event.status in STATUSES
        assert type(event.attempt) is int
        assert event.attempt >= 1


# ---------------------------------------------------------------------- mutations

INTERESTING_BYTES = b'"\\{}[],:0 \n\x00\x7f\x80\xbf\xc0\xc3\xed\xef\xf0\xff'


@st.composite
def byte_mutations(draw: st.DrawFn, data: bytes) -> bytes:
    """One to three byte-level edits of ``data``."""
    buffer = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(
            st.sampled_from(
                ("flip", "set", "insert", "delete", "truncate", "duplicate", "swap", "prefix")
            )
        )
        at = draw(st.integers(0, max(len(buffer) - 1, 0)))
        if kind == "flip" and buffer:
            buffer[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and buffer:
            buffer[at] = draw(st.sampled_from(INTERESTING_BYTES) | st.integers(0, 255))
        elif kind == "insert":
            insert = draw(st.binary(min_size=1, max_size=8) | st.sampled_from(SNIPPETS))
            buffer[at:at] = insert
        elif kind == "delete":
            del buffer[at : at + draw(st.integers(1, 32))]
        elif kind == "truncate":
            del buffer[at:]
        elif kind == "duplicate":
            buffer[at:at] = buffer[at : at + draw(st.integers(1, 64))]
        elif kind == "swap" and len(buffer) > 1:
            other = draw(st.integers(0, len(buffer) - 1))
            buffer[at], buffer[other] = buffer[other], buffer[at]
        elif kind == "prefix":
            buffer[0:0] = draw(st.sampled_from((b"\xef\xbb\xbf", b" ", b"\x00", b"[", b"{")))
    return bytes(buffer)


SNIPPETS = (
    b'"version": 1, ',
    b'"status": "succeeded", ',
    b'"receipt": null, ',
    b", null",
    b"NaN",
    b"Infinity",
    b"-0",
    b"1e999",
    b"\\u0000",
    b"\\ud800",
    b"\\u",
    b"\xf0\x9f\x98",  # a four-byte sequence cut short
    b"\xed\xa0\x80",  # a surrogate encoded as UTF-8 (invalid)
    b"/*",
    b"\t\r\n",
)

TRICKY_STRINGS = (
    "",
    " ",
    "started",
    "Started",
    "started ",
    "succeeded",
    "needs_review",
    "released",
    "absent",
    "sha256",
    "hmac-sha256:0123456789abcdef",
    "a" * 64,
    "A" * 64,
    "a" * 32,
    "\uff41" * 64,  # fullwidth a
    "\u0660" * 64,  # Arabic-Indic zero
    "0" * 63 + "\u0660",
    "2026-11-30T00:00:00.000000+00:00",
    "2026-11-30T00:00:00.000000Z",
    "2026-11-30 00:00:00.000000+00:00",
    "\u200b",
    "\ufeff",
    "\u202e",
    "e\u0301",
    "\x00",
    "x\n",
    "shop\u200b",
    "\uff53hop",  # fullwidth s
    "\u0130",  # capital I with dot
    "\u0131",  # dotless i
    "\U0001f600",
    "\u2028",
    "null",
    "true",
    "1",
    "r" * 201,
    "n" * 501,
)
TRICKY_NUMBERS = (
    0,
    -1,
    1,
    2,
    True,
    False,
    1.0,
    -0.0,
    0.5,
    2**31,
    2**63,
    2**64 + 1,
    10**100,
    1e308,
    float("inf"),
    float("nan"),
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(TRICKY_STRINGS)
    | st.sampled_from(TRICKY_NUMBERS)
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.text(max_size=6) | st.sampled_from(("status", "pid")), children, max_size=3
        )
    ),
    max_leaves=6,
)

RECORD_KEYS = (
    "version",
    "identity",
    "input_kind",
    "input_hash",
    "definition_hash",
    "claim_id",
    "status",
    "receipt",
    "attempt",
    "created_at",
    "updated_at",
    "owner",
    "review_reason",
    "history",
)
NEW_KEYS = ("extra", "Status", "status ", "statu\u0455", "", "__proto__", *RECORD_KEYS)


def paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every position in a JSON document, the root first."""
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from paths(value, (*prefix, index))


def get(document: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        document = document[step]
    return document


def put(document: Any, path: tuple[Any, ...], value: Any) -> Any:
    """``document`` with the value at ``path`` replaced (the root too)."""
    if not path:
        return value
    get(document, path[:-1])[path[-1]] = value
    return document


def unicode_trick(draw: st.DrawFn, text: str) -> str:
    kind = draw(
        st.sampled_from(
            (
                "zero-width",
                "fullwidth",
                "decompose",
                "case",
                "arabic-digit",
                "newline",
                "bom",
                "rtl",
                "combining",
                "nul",
            )
        )
    )
    at = draw(st.integers(0, len(text)))
    if kind == "zero-width":
        return text[:at] + "\u200b" + text[at:]
    if kind == "fullwidth":
        return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in text)
    if kind == "decompose":
        return unicodedata.normalize("NFD", text.replace("e", "é"))
    if kind == "case":
        return text.swapcase()
    if kind == "arabic-digit":
        return "".join(chr(0x0660 + int(c)) if c.isdigit() and c.isascii() else c for c in text)
    if kind == "newline":
        return text + "\n"
    if kind == "bom":
        return "\ufeff" + text
    if kind == "rtl":
        return "\u202e" + text
    if kind == "combining":
        return text[:at] + "\u0301" + text[at:]
    return text[:at] + "\x00" + text[at:]


@st.composite
def other_identity_shapes(draw: st.DrawFn, identity: list[str]) -> Any:
    kind = draw(
        st.sampled_from(
            (
                "another",
                "permuted",
                "swapcase",
                "trick",
                "three",
                "five",
                "string",
                "object",
                "nested",
                "ints",
            )
        )
    )
    if kind == "another":
        return list(draw(identities))
    if kind == "permuted":
        return draw(st.permutations(identity))
    if kind == "swapcase":
        return [label.swapcase() for label in identity]
    if kind == "trick":
        index = draw(st.integers(0, 3))
        changed = list(identity)
        changed[index] = unicode_trick(draw, changed[index])
        return changed
    if kind == "three":
        return identity[:3]
    if kind == "five":
        return [*identity, "extra"]
    if kind == "string":
        return "/".join(identity)
    if kind == "object":
        return dict(zip(("scope", "program", "job", "item"), identity, strict=True))
    if kind == "nested":
        return [identity]
    return [1, 2, 3, 4]


@st.composite
def json_mutations(draw: st.DrawFn, data: bytes) -> bytes:
    """One to three structural edits of the record's JSON, then a random serialisation."""
    original = json.loads(data)
    document = json.loads(data)
    duplicate: str | None = None
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(list(paths(document))))
        value = get(document, where)
        kind = draw(
            st.sampled_from(
                (
                    "retype",
                    "retype",
                    "delete",
                    "add",
                    "nest-list",
                    "nest-object",
                    "unnest",
                    "identity",
                    "unicode",
                    "number",
                    "duplicate-key",
                )
            )
        )
        if kind == "retype":
            document = put(document, where, draw(json_values))
        elif kind == "delete" and where:
            del get(document, where[:-1])[where[-1]]
        elif kind == "add" and isinstance(value, dict):
            value[draw(st.sampled_from(NEW_KEYS) | st.text(max_size=8))] = draw(json_values)
        elif kind == "add" and isinstance(value, list):
            value.insert(draw(st.integers(0, len(value))), draw(json_values))
        elif kind == "nest-list":
            document = put(document, where, [value])
        elif kind == "nest-object":
            document = put(document, where, {"value": value})
        elif kind == "unnest" and isinstance(value, (list, dict)) and value:
            inner = value[0] if isinstance(value, list) else next(iter(value.values()))
            document = put(document, where, inner)
        elif kind == "identity" and isinstance(document, dict):
            document["identity"] = draw(other_identity_shapes(list(original["identity"])))
        elif kind == "unicode" and isinstance(value, str):
            document = put(document, where, unicode_trick(draw, value))
        elif kind == "number":
            document = put(document, where, draw(st.sampled_from(TRICKY_NUMBERS)))
        elif kind == "duplicate-key" and isinstance(document, dict) and document:
            duplicate = draw(st.sampled_from(sorted(document)))
    text = json.dumps(
        document,
        ensure_ascii=draw(st.booleans()),
        indent=draw(st.sampled_from((None, 0, 1, 2, "\t"))),
        sort_keys=draw(st.booleans()),
    )
    if isinstance(document, dict) and duplicate in document and text.startswith("{"):
        text = "{" + json.dumps(duplicate) + ": " + json.dumps(document[duplicate]) + "," + text[1:]
    text = draw(st.sampled_from(("", " ", "\n", "\ufeff"))) + text
    text += draw(st.sampled_from(("", "\n", " \n\t", "\n{}", "\x00", ",")))
    return text.encode(
        draw(st.sampled_from(("utf-8", "utf-8", "utf-8", "utf-16", "latin-1"))), "replace"
    )


# ---------------------------------------------------------------- (a) mutations of valid records


def test_valid_records_round_trip() -> None:
    @settings(FAST, max_examples=ROUND_TRIPS)
    @given(record=records(), by_digest=st.booleans())
    def check(record: Record, by_digest: bool) -> None:
        CASES["round trips"] += 1
        data = relaid(encode_record(record))  # bytes it has not seen: a full parse
        assert decoded_or_refused(data, record.identity, by_digest) == record

    run_counted("round trips", check, ROUND_TRIPS)


def test_byte_mutations_are_valid_or_record_invalid(
    valid_files: list[tuple[Identity, bytes]],
) -> None:
    @settings(FAST, max_examples=BYTE_MUTATIONS)
    @given(
        case=from_pool(valid_files).flatmap(
            lambda base: st.tuples(st.just(base[0]), byte_mutations(base[1]))
        ),
        by_digest=st.booleans(),
    )
    def check(case: tuple[Identity, bytes], by_digest: bool) -> None:
        CASES["byte mutations"] += 1
        decoded_or_refused(case[1], case[0], by_digest)

    run_counted("byte mutations", check, BYTE_MUTATIONS)


def test_json_mutations_are_valid_or_record_invalid(
    valid_files: list[tuple[Identity, bytes]],
) -> None:
    @settings(FAST, max_examples=JSON_MUTATIONS)
    @given(
        case=from_pool(valid_files).flatmap(
            lambda base: st.tuples(st.just(base[0]), json_mutations(base[1]))
        ),
        by_digest=st.booleans(),
    )
    def check(case: tuple[Identity, bytes], by_digest: bool) -> None:
        CASES["JSON mutations"] += 1
        decoded_or_refused(case[1], case[0], by_digest)

    run_counted("JSON mutations", check, JSON_MUTATIONS)


# ---------------------------------------------------------------------- (b) random input


def test_random_bytes_are_record_invalid() -> None:
    @settings(FAST, max_examples=RANDOM_BYTES)
    @given(
        data=st.binary(max_size=2048)
        | st.binary(max_size=256).map(lambda b: b"{" + b)
        | st.binary(max_size=256).map(lambda b: b'{"version": 1, ' + b + b"}"),
        identity=identities,
        by_digest=st.booleans(),
    )
    def check(data: bytes, identity: Identity, by_digest: bool) -> None:
        CASES["random bytes"] += 1
        assert decoded_or_refused(data, identity, by_digest) is None

    run_counted("random bytes", check, RANDOM_BYTES)


def test_random_json_is_record_invalid() -> None:
    @settings(FAST, max_examples=RANDOM_JSON)
    @given(
        document=json_values
        | st.dictionaries(st.sampled_from(RECORD_KEYS), json_values, min_size=10),
        identity=identities,
        by_digest=st.booleans(),
    )
    def check(document: Any, identity: Identity, by_digest: bool) -> None:
        CASES["random JSON"] += 1
        data = json.dumps(document).encode()
        assert decoded_or_refused(data, identity, by_digest) is None

    run_counted("random JSON", check, RANDOM_JSON)


# ---------------------------------------------------------------------- (c) through the file store


def temp_files(root: Path) -> list[str]:
    return [
        name
        for _, _, names in os.walk(root)
        for name in names
        if name.startswith(".") and name.endswith(".tmp")
    ]


def test_hostile_bytes_through_the_file_store(
    anyio_backend: str, tmp_path: Path, valid_files: list[tuple[Identity, bytes]]
) -> None:
    """Each case puts hostile bytes at a record's path and runs every operation over it."""
    root = tmp_path / "journal"
    hostile = from_pool(valid_files).flatmap(
        lambda base: st.tuples(
            st.just(base[0]),
            json_mutations(base[1]) | byte_mutations(base[1]) | st.just(base[1]),
        )
    )
    with start_blocking_portal(anyio_backend) as portal:
        journal = portal.call(Journal.open, str(root))

        @settings(FAST, max_examples=STORE_CASES)
        @given(case=hostile)
        def check(case: tuple[Identity, bytes]) -> None:
            CASES[f"store/{anyio_backend}"] += 1
            identity, data = case
            path: Path = journal.store.path_for(identity)  # type: ignore[attr-defined]
            path.parent.mkdir(mode=0o700, exist_ok=True)
            path.write_bytes(data)
            record = decoded_or_refused(data, identity, by_digest=False)
            if record is None:
                outcomes = portal.call(every_operation, journal, identity)
                for name, outcome in outcomes.items():
                    assert isinstance(outcome, RecordInvalid), (name, outcome)
                    assert outcome.location == str(path), (name, outcome)
                assert path.read_bytes() == data
            else:
                view, begun = portal.call(inspect_then_begin, journal, identity)
                assert (view.status, view.receipt, view.attempt) == (
                    record.status,
                    record.receipt,
                    record.attempt,
                )
                assert isinstance(begun, (Claim, Reuse, ConflictError)), begun
                VERDICTS[f"begin gave {type(begun).__name__}"] += 1
                dead_owner_marked = (
                    record.status == "started"
                    and isinstance(begun, ConflictError)
                    and begun.code == "REVIEW_REQUIRED"
                )
                if dead_owner_marked:  # a mutated owner names a gone process: begin marks it
                    assert isinstance(begun, ConflictError) and begun.view is not None
                    assert begun.view.status == "needs_review"
                    VERDICTS["begin marked a dead owner"] += 1
                elif not isinstance(begun, Claim):
                    assert path.read_bytes() == data  # a refusal or a reuse writes nothing
            assert stat.S_ISREG(path.lstat().st_mode)
            assert temp_files(root) == []

        run_counted(f"store/{anyio_backend}", check, STORE_CASES)


async def every_operation(journal: Journal, identity: Identity) -> dict[str, object]:
    """What each operation gives over the record: its result or its JournalError."""
    claim = Claim(identity, "a" * 64, DEFINITION, "b" * 32, 1, identity_digest(identity))
    calls: dict[str, Callable[[], Any]] = {
        "inspect": lambda: journal.inspect(identity),
        "begin": lambda: journal.begin(identity, INPUTS, DEFINITION),
        "complete": lambda: journal.complete(claim, "ch_1"),
        "mark_review": lambda: journal.mark_review(identity, "timeout"),
        "resolve retry": lambda: journal.resolve(identity, retry=True, note="checked"),
        "resolve receipt": lambda: journal.resolve(identity, receipt="ch_1", note="checked"),
    }
    outcomes: dict[str, object] = {}
    for name, call in calls.items():
        try:
            outcomes[name] = await call()
        except JournalError as error:
            outcomes[name] = error
    return outcomes


async def inspect_then_begin(journal: Journal, identity: Identity) -> tuple[Any, object]:
    view = await journal.inspect(identity)
    try:
        begun: object = await journal.begin(identity, INPUTS, DEFINITION)
    except ConflictError as error:
        begun = error
    return view, begun


# ---------------------------------------------------------------- (d) not a regular file, too large

# test_filestore_faults.py covers a symlink to a valid record, a dangling symlink, a
# directory and a FIFO for inspect and begin; test_records.py a dense oversize file.
# Here: the kinds it does not cover, every other operation, scans and the size limit.


@contextlib.contextmanager
def fifo_release(paths: list[Path], seconds: float = 2.0) -> Iterator[threading.Event]:
    """If the block outlives ``seconds``, flag it and keep opening each FIFO's write end,
    which frees a reader stuck in open(); a hang becomes a failure."""
    fired = threading.Event()
    done = threading.Event()

    def watch() -> None:
        if done.wait(seconds):
            return
        fired.set()
        while not done.wait(0.01):
            for path in paths:
                with contextlib.suppress(OSError):
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield fired
    finally:
        done.set()
        watcher.join()


def make_socket(record: Path, scratch: Path, identity: Identity) -> None:
    # AF_UNIX paths are limited to about 108 bytes: bind somewhere short, then move it.
    short = Path(tempfile.mkdtemp(prefix="ij"))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            server.bind(str(short / "s"))
            server.listen()
            os.rename(short / "s", record)
    finally:
        short.rmdir()


def make_symlink_loop(record: Path, scratch: Path, identity: Identity) -> None:
    record.symlink_to(record.name)  # points at itself


def make_symlink_to_directory(record: Path, scratch: Path, identity: Identity) -> None:
    target = scratch / "a-directory"
    target.mkdir()
    record.symlink_to(target)


def make_symlink_to_fifo(record: Path, scratch: Path, identity: Identity) -> None:
    target = scratch / "a-fifo"
    os.mkfifo(target, 0o600)
    record.symlink_to(target)


def make_character_device(record: Path, scratch: Path, identity: Identity) -> None:
    try:  # /dev/zero: read blindly, it would never end
        os.mknod(record, stat.S_IFCHR | 0o600, os.makedev(1, 5))
    except PermissionError:
        pytest.skip("mknod of a character device is not permitted here")


def make_sparse_giant(record: Path, scratch: Path, identity: Identity) -> None:
    with record.open("wb") as stream:  # 8 GiB that take no space: read blindly, they would
        stream.truncate(8 * 1024**3)


def make_just_over_the_limit(record: Path, scratch: Path, identity: Identity) -> None:
    valid = encode_record(started_record(identity))
    record.write_bytes(valid + b" " * (MAX_RECORD_BYTES + 1 - len(valid)))


NOT_REGULAR = [
    make_socket,
    make_symlink_loop,
    make_symlink_to_directory,
    make_symlink_to_fifo,
    make_character_device,
    make_sparse_giant,
    make_just_over_the_limit,
]


def snapshot(path: Path) -> tuple[object, ...]:
    """What must not change about the thing at a record's path."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        return ("link", os.readlink(path), info.st_ino)
    return (stat.S_IFMT(info.st_mode), info.st_ino, info.st_size, info.st_mtime_ns)


Maker = Callable[[Path, Path, Identity], None]


def prepare(root: Path, tmp_path: Path, make: Maker) -> Path:
    """Put the trap ``make`` builds at the record path of ``IDENTITY``."""
    path = FileStore(str(root)).path_for(IDENTITY)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    make(path, scratch, IDENTITY)
    return path


@pytest.mark.parametrize("make", NOT_REGULAR, ids=lambda make: make.__name__[5:])
async def test_not_a_plain_record_file_is_invalid_for_every_operation_and_untouched(
    anyio_backend: str, root: Path, tmp_path: Path, make: Maker
) -> None:
    path = prepare(root, tmp_path, make)
    journal = await Journal.open(str(root))
    before = snapshot(path)

    with fifo_release([tmp_path / "scratch" / "a-fifo"]) as hung:
        outcomes = await every_operation(journal, IDENTITY)
    assert not hung.is_set(), "a reader blocked on a FIFO"

    for name, outcome in outcomes.items():
        assert isinstance(outcome, RecordInvalid), (name, outcome)
        assert outcome.code == "RECORD_INVALID"
        assert outcome.location == str(path)
    assert snapshot(path) == before
    assert temp_files(root) == []


def make_fifo(record: Path, scratch: Path, identity: Identity) -> None:
    os.mkfifo(record, 0o600)


def make_directory(record: Path, scratch: Path, identity: Identity) -> None:
    record.mkdir(mode=0o700)


def make_dangling_symlink(record: Path, scratch: Path, identity: Identity) -> None:
    record.symlink_to(scratch / "missing.json")


@pytest.mark.parametrize(
    "make",
    [make_fifo, make_directory, make_dangling_symlink],
    ids=["fifo", "directory", "dangling"],
)
async def test_kinds_covered_elsewhere_refuse_the_writing_operations_too(
    anyio_backend: str, root: Path, tmp_path: Path, make: Maker
) -> None:
    """test_filestore_faults.py checks inspect and begin over these; the rest here."""
    path = prepare(root, tmp_path, make)
    journal = await Journal.open(str(root))
    before = snapshot(path)

    with fifo_release([path]) as hung:
        outcomes = await every_operation(journal, IDENTITY)
    assert not hung.is_set(), "a reader blocked on the FIFO"

    for name in ("complete", "mark_review", "resolve retry", "resolve receipt"):
        assert isinstance(outcomes[name], RecordInvalid), (name, outcomes[name])
    assert snapshot(path) == before
    assert not (tmp_path / "scratch" / "missing.json").exists()  # nothing written through it
    assert temp_files(root) == []


async def test_a_record_of_exactly_the_size_limit_is_read(anyio_backend: str, root: Path) -> None:
    journal = await Journal.open(str(root))
    path: Path = journal.store.path_for(IDENTITY)  # type: ignore[attr-defined]
    path.parent.mkdir(mode=0o700)
    valid = encode_record(started_record(IDENTITY))
    path.write_bytes(valid + b" " * (MAX_RECORD_BYTES - len(valid)))
    assert path.stat().st_size == MAX_RECORD_BYTES

    view = await journal.inspect(IDENTITY)
    assert (view.status, view.attempt) == ("started", 1)
    view = await journal.mark_review(IDENTITY, "found at the limit")
    assert view.status == "needs_review"
    assert path.stat().st_size < MAX_RECORD_BYTES  # rewritten canonically


async def test_scan_and_sweep_report_every_hostile_entry_and_touch_none(
    anyio_backend: str, root: Path, tmp_path: Path
) -> None:
    """A directory full of traps: the scan lists each as RECORD_INVALID, without hanging;
    sweep skips them, still marks the one started record whose owner is gone, and
    changes nothing else."""
    journal = await Journal.open(str(root))
    store = journal.store
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    orphan = Identity("trap", "scan", "job", "orphan")
    gone = dead_owner(DEAD_PID)  # of this boot and namespaces, surely not running
    orphaned = dataclasses.replace(started_record(orphan), owner=gone)
    orphan_path: Path = store.path_for(orphan)  # type: ignore[attr-defined]
    orphan_path.parent.mkdir(mode=0o700, exist_ok=True)
    orphan_path.write_bytes(encode_record(orphaned))
    makers = [
        make_socket,
        make_symlink_loop,
        make_symlink_to_directory,
        make_symlink_to_fifo,
        make_sparse_giant,
        make_just_over_the_limit,
        make_fifo,
        make_directory,
        make_dangling_symlink,
    ]
    traps: list[Path] = []
    for index, make in enumerate(makers):
        identity = Identity("trap", "scan", "job", f"item-{index}")
        path: Path = store.path_for(identity)  # type: ignore[attr-defined]
        path.parent.mkdir(mode=0o700, exist_ok=True)
        own = scratch / str(index)
        own.mkdir()
        make(path, own, identity)
        traps.append(path)
    before = [snapshot(path) for path in traps]
    fifos = [path for path in traps if stat.S_ISFIFO(path.lstat().st_mode)]
    fifos += list(scratch.glob("*/a-fifo"))

    with fifo_release(fifos) as hung:
        seen = [item async for item in store.scan()]
        report = await journal.sweep()
    assert not hung.is_set(), "a reader blocked on a FIFO"
    swept = report.marked

    invalid = [item for item in seen if isinstance(item, RecordInvalid)]
    assert [item for item in seen if not isinstance(item, RecordInvalid)] == [orphaned]
    assert sorted(item.location or "" for item in invalid) == sorted(str(p) for p in traps)
    assert [(view.identity, view.status) for view in swept] == [(orphan, "needs_review")]
    assert sorted(getattr(problem, "location", None) or "" for problem in report.problems) == (
        sorted(str(p) for p in traps)
    )
    assert [snapshot(path) for path in traps] == before
    assert temp_files(root) == []


# ---------------------------------------------------------------------- bugs found here


@pytest.mark.parametrize(
    "field", ["owner host", "owner started_at", "receipt", "review reason", "history note"]
)
def test_a_lone_surrogate_in_a_text_field_is_record_invalid(field: str) -> None:
    record = started_record(IDENTITY)
    if field == "receipt":
        record = record.advance("complete", "succeeded", NOW, receipt="ch_1")
    document = json.loads(encode_record(record))
    target = {
        "owner host": (document["owner"], "host"),
        "owner started_at": (document["owner"], "started_at"),
        "receipt": (document, "receipt"),
        "review reason": (document, "review_reason"),
        "history note": (document["history"][0], "note"),
    }[field]
    target[0][target[1]] = "text \ud800 more"
    data = json.dumps(document).encode()  # ensure_ascii: the surrogate is the escape \ud800

    try:
        decoded = decode_record(data, IDENTITY)
    except RecordInvalid:
        return
    encode_record(decoded)  # raises UnicodeEncodeError today
    pytest.fail("a record that cannot be written back was accepted")


@pytest.mark.parametrize("operation", ["complete", "mark_review", "resolve"])
async def test_a_receipt_or_note_that_cannot_be_encoded_is_an_argument_error(
    anyio_backend: str, root: Path, operation: str
) -> None:
    journal = await Journal.open(str(root))
    claim = await journal.begin(IDENTITY, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    if operation == "resolve":
        await journal.mark_review(IDENTITY, "timeout")
    before = journal.store.path_for(IDENTITY).read_bytes()  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgument) as caught:
        if operation == "complete":
            await journal.complete(claim, "ch_\ud800")
        elif operation == "mark_review":
            await journal.mark_review(IDENTITY, "timeout \udc80")
        else:
            await journal.resolve(IDENTITY, retry=True, note="checked \ud800")
    assert caught.value.code in ("INVALID_RECEIPT", "INVALID_ARGUMENT")
    assert journal.store.path_for(IDENTITY).read_bytes() == before  # type: ignore[attr-defined]


async def test_an_absurd_attempt_number_is_refused_not_a_crash(
    anyio_backend: str, root: Path
) -> None:
    journal = await Journal.open(str(root))
    path: Path = journal.store.path_for(IDENTITY)  # type: ignore[attr-defined]
    path.parent.mkdir(mode=0o700)
    released = started_record(IDENTITY).advance("resolve", "released", NOW, "checked")
    document = json.loads(encode_record(released))
    document["attempt"] = 10**4300 - 1  # the most digits int() still reads by default
    data = json.dumps(document).encode()
    path.write_bytes(data)

    with pytest.raises(JournalError):
        await journal.begin(IDENTITY, INPUTS, DEFINITION)
    assert path.read_bytes() == data


@pytest.mark.parametrize(
    "moment",
    [
        "\u0662\u0660\u0662\u0666-11-30T00:00:00.000000+00:00",  # Arabic-Indic digits
        "2026-13-45T25:61:61.000000+00:00",  # no such time
    ],
    ids=["non-ascii-digits", "impossible-date"],
)
def test_a_timestamp_that_is_not_a_time_is_record_invalid(moment: str) -> None:
    document = json.loads(encode_record(started_record(IDENTITY)))
    document["created_at"] = moment
    with pytest.raises(RecordInvalid):
        decode_record(json.dumps(document, ensure_ascii=False).encode(), IDENTITY)
