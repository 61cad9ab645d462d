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

from ._errors import InvalidArgument, StorageFailed

if TYPE_CHECKING:  # the check below must import nothing that a refused platform lacks
    from ._store import Store

__all__ = ["check_platform", "open_store", "redact"]

# scheme -> (module, class, extra that brings what it imports, or None)
_STORES: Final[dict[str, tuple[str, str, str | None]]] = {
    "sqlite": ("itemjournal._sqlitestore", "SQLiteStore", None),
    "postgresql": ("itemjournal._pgstore", "PostgresStore", "postgres"),
    "postgres": ("itemjournal._pgstore", "PostgresStore", "postgres"),
}
_FILES: Final[tuple[str, str, str | None]] = ("itemjournal._filestore", "FileStore", None)
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


def redact(location: str) -> str:
    """``location`` with any password replaced by ``***``: in the URL's user part and in
    a ``password=`` query parameter. Anything that is not such a URL comes back as it is."""
    if "://" not in location:
        return location
    try:
        parts = urllib.parse.urlsplit(location)
    except ValueError:
        return location
    netloc = parts.netloc
    if ":" not in netloc.rpartition("@")[0] and "password=" not in parts.query:
        return location  # nothing to hide: given back exactly as it came
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        if ":" in user:
            user = user.split(":", 1)[0] + ":***"
        netloc = f"{user}@{host}"
    query = parts.query
    if query:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        if any(name == "password" for name, _ in pairs):
            query = "&".join(
                f"{name}=***" if name == "password" else urllib.parse.urlencode({name: value})
                for name, value in pairs
            )
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))
