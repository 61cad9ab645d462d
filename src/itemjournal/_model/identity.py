"""Identities, labels and the fingerprints of inputs and definitions."""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import inspect
import json
import re
import textwrap
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeAlias

from .errors import InvalidArgument

__all__ = [
    "DefinitionLike",
    "Identity",
    "IdentityLike",
    "InputDigester",
    "InputValue",
    "coerce_identity",
    "definition_digest",
    "identity_digest",
    "input_digest",
    "label",
    "require_hash",
]

_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}")
# Four labels joined by NUL, which no label may hold: one match checks a whole identity.
_FOUR_LABELS = re.compile(r"\x00".join([_LABEL.pattern] * 4))
_HASH = re.compile(r"[0-9a-f]{64}")
_HASH_ANY_CASE = re.compile(r"[0-9a-fA-F]{64}")
MAX_INPUTS = 20
MAX_INPUT_CHARS = 20_000
MAX_INPUT_INT = 2**63 - 1

# What an input may be: text, a whole number, a flag, or nothing. No float: its text is
# not one exact value (0.1 + 0.2), so it would fingerprint unstably.
InputValue = str | int | bool | None


class Identity(NamedTuple):
    """The four labels that name one item of work."""

    scope: str
    program: str
    job: str
    item: str


IdentityLike: TypeAlias = "Identity | tuple[str, str, str, str] | list[str]"

# What names the code that performs an effect: a digest, a version string or a callable.
DefinitionLike: TypeAlias = "str | Callable[..., Any]"


def check_label(value: object, what: str = "label") -> str:
    if not isinstance(value, str) or _LABEL.fullmatch(value) is None:
        raise InvalidArgument(
            f"{what} {value!r} must match [A-Za-z0-9][A-Za-z0-9._-]{{0,79}}",
            code="INVALID_LABEL",
        )
    return value


# What ``label`` makes of a text that is not a label as it is: up to ``_READABLE``
# characters of it, ``_``, and its SHA-256 in lowercase base32 (52 characters, unpadded);
# or the 52 characters alone when nothing of it is readable. A label of this shape is
# never given back as it is: it is digested like any other text, so that no text's
# digested label is another text unchanged.
_READABLE = 27
_DIGESTED = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9._-]{0,26}_)?[a-z2-7]{52}")
_NOT_LABEL_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


def label(text: str) -> str:
    """``text`` as a label (``[A-Za-z0-9][A-Za-z0-9._-]{0,79}``): an e-mail address, an
    HTTP key, a file name, any ``str``.

    A text that is a label already is its own label (``label("order-3") == "order-3"``),
    unless it has the shape of a digested one (below). Any other text is digested: its
    first characters as far as a label can hold them (each run of other characters
    becomes ``-``, what would begin it with ``.``, ``_`` or ``-`` is dropped; at most 27),
    then ``_`` and the SHA-256 of the text's UTF-8 bytes (a lone surrogate encoded as
    ``surrogatepass`` does) in lowercase base32 without padding, 52 characters; the 52
    characters alone when no character of the text is readable::

        label("alice@example.com")
        # 'alice-example.com_' followed by 52 characters of a-z and 2-7

    The digest makes it stable across versions, processes and machines, and keeps two
    different texts from ever giving one label: the label of a text that is not one
    already always has the digested shape (it ends in 52 characters of ``a-z2-7``,
    alone or after ``_`` and at most 27 characters), and a label of that shape is
    digested too, never given back as it is. Case and every character count: ``"A"`` and
    ``"a"``, ``"x "`` and ``"x"`` are different texts. Only a ``str`` is a text
    (``INVALID_ARGUMENT`` otherwise).
    """
    if not isinstance(text, str):
        raise InvalidArgument(
            f"label() takes a str, not {type(text).__name__}", code="INVALID_ARGUMENT"
        )
    if _LABEL.fullmatch(text) is not None and _DIGESTED.fullmatch(text) is None:
        return text
    raw = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    digest = base64.b32encode(raw).decode("ascii").rstrip("=").lower()
    readable = _NOT_LABEL_CHARS.sub("-", text).lstrip("._-")[:_READABLE].rstrip("._-")
    return f"{readable}_{digest}" if readable else digest


def coerce_identity(value: object) -> Identity:
    """Accept an ``Identity``, a 4-tuple or a 4-list of labels; anything else is refused."""
    if type(value) is Identity:
        parts: tuple[object, ...] | list[object] = value
    elif isinstance(value, (tuple, list)) and not isinstance(value, (str, bytes)):
        parts = value
    else:
        raise InvalidArgument(
            f"an identity is (scope, program, job, item), not {type(value).__name__}",
            code="INVALID_IDENTITY",
        )
    if len(parts) != 4:
        raise InvalidArgument(
            f"an identity has exactly four labels, got {len(parts)}", code="INVALID_IDENTITY"
        )
    try:
        joined = "\x00".join(parts)  # type: ignore[arg-type]
    except TypeError:
        joined = ""  # a label that is not a str: said below
    if _FOUR_LABELS.fullmatch(joined) is not None:
        return parts if type(parts) is Identity else Identity(*parts)
    names = Identity._fields  # which label is wrong, and why
    return Identity(*(check_label(part, name) for part, name in zip(parts, names, strict=False)))


@functools.lru_cache(maxsize=4096)
def identity_digest(identity: Identity) -> str:
    """SHA-256 hex of the identity's compact JSON array: the only source of its location."""
    text = _COMPACT.encode(list(identity))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# Made once: ``json.dumps`` with options builds a new encoder on every call.
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _canonical_inputs(inputs: object) -> bytes:
    if not isinstance(inputs, Mapping):
        raise InvalidArgument(
            f"inputs must be a mapping of labels to strings, not {type(inputs).__name__}",
            code="INVALID_INPUTS",
        )
    if len(inputs) > MAX_INPUTS:
        raise InvalidArgument(
            f"at most {MAX_INPUTS} inputs are allowed, got {len(inputs)}", code="INVALID_INPUTS"
        )
    plain: dict[str, InputValue] = {}
    for key, value in inputs.items():
        if not isinstance(key, str) or _LABEL.fullmatch(key) is None:
            raise InvalidArgument(f"input key {key!r} must be a label", code="INVALID_INPUTS")
        if value is None or isinstance(value, bool):
            plain[key] = value
            continue
        if isinstance(value, int):
            if not -MAX_INPUT_INT <= value <= MAX_INPUT_INT:
                raise InvalidArgument(
                    f"input {key!r} is an int outside -(2**63-1)..2**63-1; pass it as a str",
                    code="INVALID_INPUTS",
                )
            plain[key] = int(value)  # an int subclass (an IntEnum) hashes as its number
            continue
        if isinstance(value, float):
            raise InvalidArgument(
                f"input {key!r} is a float, which has no single exact text; pass an int of "
                f"minor units (1250 for 12.50) or a str",
                code="INVALID_INPUTS",
            )
        if not isinstance(value, str):
            raise InvalidArgument(
                f"input {key!r} must be a str, int, bool or None, not {type(value).__name__}",
                code="INVALID_INPUTS",
            )
        if len(value) > MAX_INPUT_CHARS:
            raise InvalidArgument(
                f"input {key!r} has {len(value)} characters; at most {MAX_INPUT_CHARS}",
                code="INVALID_INPUTS",
            )
        plain[key] = value
    text = _CANONICAL.encode(plain)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as error:  # lone surrogates cannot be hashed reproducibly
        raise InvalidArgument("inputs must be encodable as UTF-8", code="INVALID_INPUTS") from error


def input_digest(inputs: Mapping[str, InputValue]) -> str:
    """SHA-256 hex of the inputs as sorted, compact, UTF-8 JSON."""
    return hashlib.sha256(_canonical_inputs(inputs)).hexdigest()


class InputDigester:
    """Fingerprints inputs, plainly (SHA-256) or keyed (HMAC-SHA256).

    ``kind`` is written into every record so that a journal opened with the other kind,
    or with another key, says so instead of reporting ``INPUT_CHANGED``.
    """

    __slots__ = ("_key", "kind")

    def __init__(self, key: bytes | None = None) -> None:
        if key is None:
            self._key: bytes | None = None
            self.kind = "sha256"
            return
        if not isinstance(key, (bytes, bytearray)) or len(key) < 16:
            raise InvalidArgument(
                "input_key must be bytes, at least 16 of them", code="INVALID_ARGUMENT"
            )
        self._key = bytes(key)
        key_id = hmac.new(self._key, b"itemjournal input key id", hashlib.sha256).hexdigest()
        self.kind = f"hmac-sha256:{key_id[:16]}"

    def __call__(self, inputs: Mapping[str, InputValue]) -> str:
        data = _canonical_inputs(inputs)
        if self._key is None:
            return hashlib.sha256(data).hexdigest()
        return hmac.new(self._key, data, hashlib.sha256).hexdigest()

    def __repr__(self) -> str:
        return f"InputDigester(kind={self.kind!r})"


def require_hash(value: object, what: str = "definition") -> str:
    if not isinstance(value, str) or _HASH.fullmatch(value) is None:
        raise InvalidArgument(
            f"{what} must be 64 lowercase hex characters (see definition_digest), got {value!r}",
            code="INVALID_HASH",
        )
    return value


def definition_digest(definition: DefinitionLike) -> str:
    """The digest a definition stands for, whichever form it is given in.

    A 64-character lowercase hex string is a digest already and stands for itself (so a
    version string of exactly that shape cannot be used: it is always taken as a digest).
    Any other string is a version such as ``"billing-v3"``: its digest changes only with a
    deliberate bump. A callable stands for its source text (dedented), so any edit of it,
    comments included, is a new definition; reading the source reads a file.
    """
    if isinstance(definition, str):
        known = _VERSIONS.get(definition)
        if known is not None:
            return known
        if _HASH.fullmatch(definition) is not None:
            return definition
        if _HASH_ANY_CASE.fullmatch(definition) is not None:
            raise InvalidArgument(
                "a definition that looks like a digest must be lowercase hex; pass it in "
                "lowercase, or pick a version string that is not 64 hex characters",
                code="INVALID_HASH",
            )
        if not definition.strip():
            raise InvalidArgument("a definition version must not be blank", code="INVALID_HASH")
        material = "version\0" + definition
    elif callable(definition):
        target = inspect.unwrap(definition)
        try:
            source = inspect.getsource(target)
        except (OSError, TypeError) as error:
            raise InvalidArgument(
                f"cannot read the source of {definition!r}; pass a version string instead",
                code="INVALID_HASH",
            ) from error
        material = "source\0" + textwrap.dedent(source)
    else:
        raise InvalidArgument(
            f"a definition is a digest, a version string or a callable, not "
            f"{type(definition).__name__}",
            code="INVALID_HASH",
        )
    digest = hashlib.sha256(material.encode("utf-8", "surrogatepass")).hexdigest()
    if isinstance(definition, str):
        if len(_VERSIONS) >= _VERSIONS_LIMIT:
            _VERSIONS.clear()
        _VERSIONS[definition] = digest
    return digest


# Version strings already digested: a service passes the same few on every call. Bounded;
# plain dict operations, safe across threads.
_VERSIONS: dict[str, str] = {}
_VERSIONS_LIMIT = 256
