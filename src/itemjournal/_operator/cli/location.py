"""Which journal a command works on: a location refused unless it already holds a
journal (the command never creates one), a key file read exactly, and a location shown
without the password a database URL may carry."""

from __future__ import annotations

import os

from ..._model.errors import InvalidArgument
from ..._stores.files.layout import SETTINGS_NAME
from ..._stores.registry import redact
from .errors import CommandError

_MAX_KEY_FILE_BYTES = 4096


def _missing_postgres_journal(location: str) -> str | None:
    """Why a PostgreSQL location holds no journal, when its server says so: the command
    never creates one (``Journal.open`` would make the schema). None when there is one,
    or when the server or the driver is not there (``Journal.open`` then says why)."""
    try:
        from ..._stores.postgres.store import missing_journal
    except ImportError:
        return None
    try:
        return missing_journal(location)
    except InvalidArgument:
        return None  # a bad parameter: Journal.open refuses it with its own code


def _check_location(value: str | None) -> str:
    """The location, refused unless it names an existing journal (never created here)."""
    if not value:
        raise CommandError(
            "ABSOLUTE_ROOT_REQUIRED",
            "no journal location: pass --location/-L or set ITEMJOURNAL_LOCATION",
        )
    if value.startswith(("postgresql:", "postgres:")):
        if not value.startswith(("postgresql://", "postgres://")):
            raise CommandError(
                "ABSOLUTE_ROOT_REQUIRED",
                "a PostgreSQL location is a URL, postgresql://user@host/database, "
                f"not {redact(value)!r}",
            )
        missing = _missing_postgres_journal(value)
        if missing is not None:
            raise CommandError("NO_JOURNAL", missing)
        return value  # given to Journal.open unchanged; only ever shown redacted
    if value.startswith("sqlite:"):
        path = value[len("sqlite://") :] if value.startswith("sqlite://") else ""
        if not os.path.isabs(path):
            raise CommandError(
                "ABSOLUTE_ROOT_REQUIRED",
                f"a SQLite location looks like sqlite:///absolute/path.db, not {value!r}",
            )
        if not os.path.isfile(path):
            raise CommandError("NO_JOURNAL", f"no SQLite journal at {path}: no such file")
        return value
    if not os.path.isabs(value):
        raise CommandError(
            "ABSOLUTE_ROOT_REQUIRED",
            f"the location is an absolute directory, sqlite:///absolute/path.db or "
            f"postgresql://user@host/database, not {value!r}",
        )
    if not os.path.isdir(value):
        raise CommandError("NO_JOURNAL", f"no journal at {value}: no such directory")
    if not os.path.isfile(os.path.join(value, SETTINGS_NAME)):
        raise CommandError(
            "NO_JOURNAL", f"{value} holds no itemjournal journal (no {SETTINGS_NAME})"
        )
    return value


def _shown_location(value: str) -> str:
    """The location as output may show it: a database URL without its password."""
    return redact(value) if value.startswith(("postgresql:", "postgres:")) else value


def _read_key_file(path: str) -> bytes:
    """The key file's exact bytes, as the application passes them to ``Journal.open``."""
    try:
        with open(path, "rb") as file:
            key = file.read(_MAX_KEY_FILE_BYTES + 1)
    except OSError as error:
        raise CommandError(
            "INVALID_KEY_FILE", f"cannot read the input key file {path}: {error.strerror}"
        ) from None
    if len(key) > _MAX_KEY_FILE_BYTES:
        raise CommandError(
            "INVALID_KEY_FILE",
            f"the input key file {path} holds more than {_MAX_KEY_FILE_BYTES} bytes",
        )
    if not key:
        raise CommandError("INVALID_KEY_FILE", f"the input key file {path} is empty")
    return key
