"""``itemjournal.label(text)``: any text as a valid label, stable, readable where it can
be, and never the same label for two different texts."""

from __future__ import annotations

import base64
import hashlib
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

import itemjournal
from itemjournal import Identity, InvalidArgument, label

LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}")
DIGESTED = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9._-]{0,26}_)?[a-z2-7]{52}")


def digest(text: str) -> str:
    """The documented digest: SHA-256 of the UTF-8 bytes, lowercase base32, unpadded."""
    raw = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    return base64.b32encode(raw).decode().rstrip("=").lower()


# Fixed values: a label made today is the label of every later version (records depend
# on them). Changing one of these is a breaking change.
KNOWN = {
    "alice@example.com": "alice-example.com_76gzqgp4byjl6djerexelgd6esncrxhig2ufzlla4khkvkgg3f3a",
    "order 7 / ann": "order-7-ann_kxxtxkdk4ci4rtkccoaq45n3qbi4muc4fdkssb4vbpl4uec6sika",
    "": "4oymiquy7qobjgx36tejs35zeqt24qpemsnzgtfeswmrw6csxbkq",
    "José Müller": "Jos-M-ller_pvd5k7lqkuplpiswlvecmvc7mpdnnfjxkt76aartyrrvyszzwf3a",
}


def test_it_is_exported() -> None:
    assert "label" in itemjournal.__all__
    assert itemjournal.label is label
    assert label.__doc__ and "digest" in label.__doc__


@pytest.mark.parametrize(("text", "expected"), sorted(KNOWN.items()))
def test_stable_values(text: str, expected: str) -> None:
    assert label(text) == expected
    assert expected.endswith(digest(text))


@pytest.mark.parametrize("text", ["order-3", "a", "A.b_c-9", "x" * 80, "8e03978e-40d5-43e8"])
def test_a_label_is_its_own_label(text: str) -> None:
    assert label(text) == text


@pytest.mark.parametrize(
    "text",
    [
        "a" * 52,  # the shape of a digested label: 52 characters of a-z and 2-7
        "x_" + "a" * 52,
        label("alice@example.com"),  # a digested label itself
    ],
)
def test_a_label_of_the_digested_shape_is_digested(text: str) -> None:
    assert LABEL.fullmatch(text)
    made = label(text)
    assert made != text
    assert made.endswith(digest(text))


def test_the_readable_start() -> None:
    assert label("alice@example.com").startswith("alice-example.com_")
    assert label("  ..--x y").startswith("x-y_")  # what would begin it is dropped
    assert label("@@@") == digest("@@@")  # nothing readable: the digest alone
    long = label("customer " + "x" * 200)
    assert long.startswith("customer-" + "x" * 18 + "_")
    assert len(long) == 80


def test_lone_surrogates_and_control_characters_are_text_too() -> None:
    for text in ["\ud800", "a\udfffb", "tab\there", "nul\x00", "\u202eevil"]:
        made = label(text)
        assert LABEL.fullmatch(made)
        assert made.endswith(digest(text))


@pytest.mark.parametrize("value", [None, 7, b"bytes", ["a"]])
def test_only_text(value: object) -> None:
    with pytest.raises(InvalidArgument) as caught:
        label(value)  # type: ignore[arg-type]
    assert caught.value.code == "INVALID_ARGUMENT"


def test_it_makes_identities() -> None:
    assert Identity("shop", "mail", "send", label("alice@example.com")).item.startswith("alice")


@given(st.text(max_size=200))
def test_any_text_gives_a_valid_label(text: str) -> None:
    made = label(text)
    assert LABEL.fullmatch(made)
    assert made == text or DIGESTED.fullmatch(made)
    assert label(text) == made  # the same every time


@given(st.text(max_size=120), st.text(max_size=120))
def test_two_texts_never_share_a_label(first: str, second: str) -> None:
    if first != second:
        assert label(first) != label(second)
    # nor does a text share one with the label of another text
    if first != label(second):
        assert label(first) != label(label(second))


@given(st.from_regex(LABEL, fullmatch=True))
def test_every_label_is_itself_or_digested(text: str) -> None:
    made = label(text)
    if DIGESTED.fullmatch(text):
        assert made != text and made.endswith(digest(text))
    else:
        assert made == text
