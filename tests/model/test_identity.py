"""Identities, labels and fingerprints (SPEC §1)."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from itemjournal import Identity, InvalidArgument, definition_digest, input_digest
from itemjournal._model.identity import (
    InputDigester,
    coerce_identity,
    identity_digest,
    require_hash,
)

labels = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}", fullmatch=True)


def test_identity_accepts_namedtuple_tuple_and_list() -> None:
    expected = Identity("s", "p", "j", "i")
    assert coerce_identity(expected) == expected
    assert coerce_identity(("s", "p", "j", "i")) == expected
    assert coerce_identity(["s", "p", "j", "i"]) == expected
    assert type(coerce_identity(["s", "p", "j", "i"])) is Identity


@pytest.mark.parametrize(
    "value",
    ["s/p/j/i", ("s", "p", "j"), ("s", "p", "j", "i", "x"), {"s", "p", "j", "i"}, None, b"abcd"],
)
def test_wrong_shape_is_invalid_identity(value: object) -> None:
    with pytest.raises(InvalidArgument) as caught:
        coerce_identity(value)
    assert caught.value.code == "INVALID_IDENTITY"
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    "label",
    ["", "-lead", ".hidden", "_x", "a/b", "..", "a b", "é", "a" * 81, 7, None, "x\n"],
)
def test_bad_label_is_invalid_label(label: object) -> None:
    with pytest.raises(InvalidArgument) as caught:
        coerce_identity(("s", "p", "j", label))
    assert caught.value.code == "INVALID_LABEL"


def test_longest_label_is_accepted() -> None:
    assert coerce_identity(("a" * 80, "p", "j", "A.b_c-9"))[0] == "a" * 80


@given(st.tuples(labels, labels, labels, labels))
def test_identity_digest_is_sha256_of_compact_json(parts: tuple[str, str, str, str]) -> None:
    identity = coerce_identity(parts)
    text = '["' + '","'.join(parts) + '"]'
    assert identity_digest(identity) == hashlib.sha256(text.encode()).hexdigest()


def test_input_digest_formula_and_key_order() -> None:
    inputs = {"b": "2", "a": "één"}
    expected = hashlib.sha256(
        json.dumps(inputs, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()
    ).hexdigest()
    assert input_digest(inputs) == expected
    assert input_digest({"a": "één", "b": "2"}) == expected
    assert input_digest({"a": "één ", "b": "2"}) != expected  # whitespace matters
    assert input_digest({}) == hashlib.sha256(b"{}").hexdigest()


@pytest.mark.parametrize(
    "inputs",
    [
        {f"k{n}": "v" for n in range(21)},
        {"k": "x" * 20_001},
        {"k": 1.5},
        {"k": 12.0},
        {"k": 2**63},
        {"k": -(2**63)},
        {"k": b"bytes"},
        {"k": ["a", "list"]},
        {"bad key": "v"},
        {1: "v"},
        [("k", "v")],
        "k=v",
        {"k": "\ud800"},
    ],
)
def test_bad_inputs(inputs: object) -> None:
    with pytest.raises(InvalidArgument) as caught:
        input_digest(inputs)  # type: ignore[arg-type]
    assert caught.value.code == "INVALID_INPUTS"


def test_a_float_input_names_the_way_out() -> None:
    with pytest.raises(InvalidArgument, match="minor units"):
        input_digest({"amount": 12.5})


def test_ints_bools_and_none_are_inputs_in_canonical_json() -> None:
    inputs = {"cents": 1250, "express": True, "gift": False, "note": None, "big": 2**63 - 1}
    canonical = json.dumps(
        inputs, sort_keys=True, ensure_ascii=False, separators=(",", ":")
    ).encode()
    assert input_digest(inputs) == hashlib.sha256(canonical).hexdigest()
    # A number and its text are different inputs; True is not 1.
    assert input_digest({"n": 1}) != input_digest({"n": "1"})
    assert input_digest({"n": True}) != input_digest({"n": 1})
    assert input_digest({"n": None}) != input_digest({})


def test_input_limits_are_inclusive() -> None:
    largest = {f"k{n}": "x" * 20_000 for n in range(20)}
    canonical = json.dumps(largest, sort_keys=True, separators=(",", ":")).encode()
    assert input_digest(largest) == hashlib.sha256(canonical).hexdigest()


def test_keyed_digest_is_hmac_and_names_its_key() -> None:
    key = b"0123456789abcdef-secret"
    keyed = InputDigester(key)
    canonical = b'{"card":"4242"}'
    assert keyed({"card": "4242"}) == hmac.new(key, canonical, hashlib.sha256).hexdigest()
    assert keyed({"card": "4242"}) != input_digest({"card": "4242"})
    assert keyed.kind.startswith("hmac-sha256:")
    assert InputDigester(key).kind == keyed.kind
    assert InputDigester(b"another key, 16+ bytes").kind != keyed.kind
    assert InputDigester().kind == "sha256"
    assert "secret" not in repr(keyed)


@pytest.mark.parametrize("key", [b"short", "a str key of 16+ chars", 42])
def test_bad_input_key(key: object) -> None:
    with pytest.raises(InvalidArgument) as caught:
        InputDigester(key)  # type: ignore[arg-type]
    assert caught.value.code == "INVALID_ARGUMENT"


def charge(order: str) -> str:
    return f"charged {order}"


def test_definition_digest_of_callable_and_version() -> None:
    digest = definition_digest(charge)
    assert len(digest) == 64
    assert require_hash(digest) == digest
    assert definition_digest(charge) == digest
    assert definition_digest("billing-v3") == definition_digest("billing-v3")
    assert definition_digest("billing-v3") != definition_digest("billing-v4")
    assert definition_digest("billing-v3") != digest


def test_definition_digest_changes_with_source() -> None:
    def first(x: int) -> int:
        return x + 1

    def second(x: int) -> int:
        return x + 2

    assert definition_digest(first) != definition_digest(second)


@pytest.mark.parametrize("value", [len, 3, "", "   "])
def test_definition_digest_refuses_what_it_cannot_fingerprint(value: object) -> None:
    with pytest.raises(InvalidArgument) as caught:
        definition_digest(value)  # type: ignore[arg-type]
    assert caught.value.code == "INVALID_HASH"


@pytest.mark.parametrize("value", ["A" * 64, "a" * 63, "g" * 64, None, "a" * 65])
def test_require_hash(value: object) -> None:
    with pytest.raises(InvalidArgument) as caught:
        require_hash(value)
    assert caught.value.code == "INVALID_HASH"


# Written by the releases before definitions were one language: records made under these
# digests must keep matching, so they are pinned here as they were computed then.
PINNED_VERSION_DIGESTS = {
    "charge-v1": "95fe80f56aac73e18fd08fb86456a75c65b23827de679ab214bf08ef3373dea1",
    "billing-v3": hashlib.sha256(b"version\0billing-v3").hexdigest(),
    "itemjournal.asgi.IdempotencyMiddleware/1": hashlib.sha256(
        b"version\0itemjournal.asgi.IdempotencyMiddleware/1"
    ).hexdigest(),
}


@pytest.mark.parametrize(("version", "digest"), sorted(PINNED_VERSION_DIGESTS.items()))
def test_a_version_keeps_the_digest_it_always_had(version: str, digest: str) -> None:
    assert definition_digest(version) == digest


def test_a_digest_stands_for_itself() -> None:
    digest = definition_digest("charge-v1")
    assert definition_digest(digest) == digest
    assert definition_digest(definition_digest(charge)) == definition_digest(charge)
    assert definition_digest("0" * 64) == "0" * 64


@pytest.mark.parametrize(
    "value", ["A" * 64, "AB" * 32, definition_digest("charge-v1").upper(), "Ab" * 32]
)
def test_a_digest_that_is_not_lowercase_is_refused(value: str) -> None:
    with pytest.raises(InvalidArgument, match="lowercase") as caught:
        definition_digest(value)
    assert caught.value.code == "INVALID_HASH"


@pytest.mark.parametrize("value", ["a" * 63, "a" * 65, " " + "a" * 64, "g" * 64])
def test_a_string_that_is_not_exactly_a_digest_is_a_version(value: str) -> None:
    assert definition_digest(value) == hashlib.sha256(f"version\0{value}".encode()).hexdigest()


@pytest.mark.parametrize("value", [None, 3, b"billing-v3", object(), ("billing-v3",)])
def test_a_definition_is_a_string_or_a_callable(value: object) -> None:
    with pytest.raises(InvalidArgument, match="callable") as caught:
        definition_digest(value)  # type: ignore[arg-type]
    assert caught.value.code == "INVALID_HASH"
