"""Where a journal lives: a location's scheme names its store.

``Journal.open`` hands the location here. An absolute directory is the file store; a
``scheme:`` prefix picks the store from one table, and the store's module is imported
only then, so that a database driver is needed only by those who use its store (the
PostgreSQL store needs the ``postgres`` extra). The journal itself imports no store.

Every location is opened here, so this is also where an unsupported platform is refused.
"""

from __future__ import annotations

import importlib
import re
import sys
import urllib.parse
from typing import TYPE_CHECKING, Final

from .._model.errors import InvalidArgument, StorageFailed

if TYPE_CHECKING:  # the check below must import nothing that a refused platform lacks
    from .seam import Store

__all__ = ["check_platform", "open_store", "redact"]

# scheme -> (module, class, extra that brings what it imports, or None)
_STORES: Final[dict[str, tuple[str, str, str | None]]] = {
    "sqlite": ("itemjournal._stores.sqlite.store", "SQLiteStore", None),
    "postgresql": ("itemjournal._stores.postgres.store", "PostgresStore", "postgres"),
    "postgres": ("itemjournal._stores.postgres.store", "PostgresStore", "postgres"),
}
_FILES: Final[tuple[str, str, str | None]] = ("itemjournal._stores.files.store", "FileStore", None)
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_WINDOWS: Final = frozenset({"win32", "cygwin", "msys"})  # Windows, and its POSIX layers
_FORMS = "an absolute directory, sqlite:///absolute/path.db or postgresql://host/database"


def check_platform(platform: str = sys.platform) -> None:
    """Refuse a platform (a ``sys.platform`` value) the journal cannot keep its promise on.

    Windows is refused with ``StorageFailed``: the stores lock records with POSIX locks,
    make a new entry durable by syncing its directory, and tell a dead owner from a live
    one through ``/proc``; Windows has none of these, and a journal that half worked there
    could run work twice. Linux is supported; other POSIX systems (macOS) are let through.
    """
    if platform in _WINDOWS:
        raise StorageFailed(
            f"itemjournal does not run on Windows (sys.platform {platform!r}): its stores "
            "need POSIX file locks, fsync of directories and /proc to tell whether a "
            "claim's owner process still lives; use Linux"
        )


def open_store(location: str, *, lock_timeout: float, trust_shared_root: bool) -> Store:
    """The (not yet opened) store for ``location``; argument errors are raised here, and
    ``StorageFailed`` on a platform the journal does not support."""
    check_platform()
    match = _SCHEME.match(location)
    if match is None or location.startswith("/"):
        entry = _FILES
    else:
        found = _STORES.get(match[1].lower())
        if found is None:
            raise InvalidArgument(
                f"a journal location is {_FORMS}; {match[1]!r} names no store "
                f"(got {redact(location)!r})",
                code="ABSOLUTE_ROOT_REQUIRED",
            )
        entry = found
    module_name, class_name, extra = entry
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise InvalidArgument(
            f"the {class_name} needs the '{extra}' extra: pip install 'itemjournal[{extra}]' "
            f"({error})",
            code="INVALID_ARGUMENT",
        ) from error
    store: Store = getattr(module, class_name).from_location(
        location, lock_timeout=lock_timeout, trust_shared_root=trust_shared_root
    )
    return store


# Connection parameters whose value is a secret: those libpq itself shows as ``*`` (a
# password field) and the SCRAM keys that stand in for a password. Kept here, not asked of
# libpq, so that showing a location never imports a database driver.
SECRET_PARAMETERS: Final = frozenset(
    {"password", "sslpassword", "oauth_client_secret", "scram_client_key", "scram_server_key"}
)
# Parameters whose value is itself a location (the PostgreSQL store's ``owner_url``):
# redacted as one.
_NESTED: Final = frozenset({"owner_url"})


def redact(location: str) -> str:
    """``location`` with every secret replaced by ``***``: a password in the URL's user
    part, every query parameter that carries a secret (``password``, ``sslpassword`` and
    the others libpq keeps secret), and the secrets of a location given as a parameter
    (``owner_url``). Everything else is given back exactly as it came, byte for byte;
    anything that is not such a URL comes back as it is."""
    if "://" not in location:
        return location
    try:
        parts = urllib.parse.urlsplit(location)
    except ValueError:
        return location
    netloc = parts.netloc
    user, at, host = netloc.rpartition("@")
    if at and ":" in user:
        netloc = f"{user.split(':', 1)[0]}:***@{host}"
    pieces = []
    for given in parts.query.split("&") if parts.query else ():
        raw_name, equals, raw_value = given.partition("=")
        name = urllib.parse.unquote(raw_name)
        shown = given
        if name in SECRET_PARAMETERS and equals:
            shown = f"{raw_name}=***"
        elif name in _NESTED and equals:
            inner = urllib.parse.unquote(raw_value)
            hidden = redact(inner)
            if hidden != inner:
                shown = f"{raw_name}={urllib.parse.quote(hidden, safe=':/@')}"
        pieces.append(shown)
    query = "&".join(pieces)
    if netloc == parts.netloc and query == parts.query:
        return location  # nothing to hide: given back exactly as it came
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))
