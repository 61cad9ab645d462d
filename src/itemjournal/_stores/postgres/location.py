"""What a ``postgresql://`` location asks of the store.

The URL goes to libpq as written, except for the store's own three parameters
(``schema``, ``pool_size``, ``owner_url``), which are taken out and checked here, so that
a location the store cannot use is refused before anything connects. The secrets of the
URL never leave this module except inside the connection strings: what is shown is
``redact``'s copy.

Every connection string also bounds how long a vanished server goes unnoticed
(``PEER_BOUND``: TCP keepalives and ``tcp_user_timeout``, the owner session's own bound),
unless the URL sets these itself: a connection made from it, whichever part of the store
or the command line makes it, never waits hours on a dead peer.
"""

from __future__ import annotations

import dataclasses
import re
import urllib.parse
from typing import Final

from ..._model.errors import InvalidArgument
from ..registry import redact

__all__ = ["PEER_BOUND", "PEER_BOUND_SECONDS", "Location", "parse_location"]

_SCHEMES: Final = ("postgresql://", "postgres://")
_OUR_PARAMETERS: Final = ("schema", "pool_size", "owner_url")
_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,62}")
# libpq's client-side bound on a vanished peer: the first probe after 5 s of silence, then
# every 2 s, given up after 3 (or after 11 s of unacknowledged data): about 11 s.
PEER_BOUND: Final = {
    "keepalives": "1",
    "keepalives_idle": "5",
    "keepalives_interval": "2",
    "keepalives_count": "3",
    "tcp_user_timeout": "11000",
}
PEER_BOUND_SECONDS: Final = 11


@dataclasses.dataclass(frozen=True, slots=True)
class Location:
    """A checked location: where the data connections and the owner-lock session go, the
    schema, the pool's size, and the URL as it may be shown."""

    conninfo: str
    # The owner lock's session: the data connections' server unless owner_url names a
    # direct one (the data connections may then go through a transaction pooler).
    owner_conninfo: str
    owner_url_given: bool
    schema: str
    pool_size: int
    shown: str  # the URL with its secrets redacted


def parse_location(url: str) -> Location:
    """``url`` checked and split; ``INVALID_ARGUMENT`` (or, for what is no PostgreSQL URL
    at all, ``ABSOLUTE_ROOT_REQUIRED``) saying what is wrong with it."""
    if not isinstance(url, str) or not url.startswith(_SCHEMES):
        raise InvalidArgument(
            "a PostgreSQL location is a postgresql://user@host/database URL",
            code="ABSOLUTE_ROOT_REQUIRED",
        )
    conninfo, ours = _split_query(url)
    owner_conninfo = conninfo
    owner_url = ours.get("owner_url")
    if owner_url is not None:
        if not owner_url.startswith(_SCHEMES):
            raise InvalidArgument(
                "owner_url is a percent-encoded postgresql://user@host/database URL, "
                f"not {redact(owner_url)!r}",
                code="INVALID_ARGUMENT",
            )
        owner_conninfo, nested = _split_query(owner_url)
        if nested:
            raise InvalidArgument(
                f"owner_url names the server of the owner-lock session only; "
                f"{', '.join(sorted(nested))} belong to the journal's own URL",
                code="INVALID_ARGUMENT",
            )
    schema = ours.get("schema", "itemjournal")
    if _IDENTIFIER.fullmatch(schema) is None:
        raise InvalidArgument(
            f"schema is a lowercase SQL identifier (letters, digits, _), not {schema!r}",
            code="INVALID_ARGUMENT",
        )
    size_text = ours.get("pool_size", "8")
    if not size_text.isdigit() or not 1 <= int(size_text) <= 100:
        raise InvalidArgument(
            f"pool_size is a whole number from 1 to 100, not {size_text!r}",
            code="INVALID_ARGUMENT",
        )
    return Location(
        conninfo=_bounded(conninfo),
        owner_conninfo=_bounded(owner_conninfo),
        owner_url_given=owner_url is not None,
        schema=schema,
        pool_size=int(size_text),
        shown=redact(url),
    )


def _split_query(url: str) -> tuple[str, dict[str, str]]:
    """``url`` without the store's own parameters, every other byte of it as given (libpq
    decodes the rest itself), and the store's parameters, percent-decoded."""
    parts = urllib.parse.urlsplit(url)
    kept: list[str] = []
    ours: dict[str, str] = {}
    for piece in parts.query.split("&") if parts.query else ():
        if not piece:
            continue
        raw_name, _, raw_value = piece.partition("=")
        name = urllib.parse.unquote(raw_name)
        if name in _OUR_PARAMETERS:
            ours[name] = urllib.parse.unquote(raw_value)
        else:
            kept.append(piece)
    return urllib.parse.urlunsplit(parts._replace(query="&".join(kept))), ours


def _bounded(conninfo: str) -> str:
    """``conninfo`` with ``PEER_BOUND``'s parameters added where it names none of its own."""
    parts = urllib.parse.urlsplit(conninfo)
    given = {piece.partition("=")[0] for piece in parts.query.split("&") if piece}
    added = [f"{name}={value}" for name, value in PEER_BOUND.items() if name not in given]
    query = "&".join(filter(None, [parts.query, *added]))
    return urllib.parse.urlunsplit(parts._replace(query=query))
