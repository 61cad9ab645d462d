"""The location's settings document, ``root/itemjournal.json``: its codec and its update.

The document names the application and a version, so a directory that holds some other
program's ``itemjournal.json`` is refused rather than overwritten. It is changed only
under a lock on the root's ``.lock`` and written like a record (``saves``), so of two
first openers one value wins and both are told which.
"""

from __future__ import annotations

import errno
import json
import os
from typing import Any, Final

from ..._model.errors import InvalidArgument, RecordInvalid, StorageFailed
from .layout import SETTINGS_NAME, fail, open_root, quietly, read_document
from .locks import BUSY, Busy, close_call_lock_file, open_call_lock_file, try_lock_whole
from .saves import DurableSaves, LostRace

MAX_SETTINGS_BYTES: Final = 64 * 1024


def _settings_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise ValueError(f"duplicate key {key!r}")
        document[key] = value
    return document


def decode_settings(data: bytes, path: str) -> dict[str, str]:
    """The settings of a settings document, read strictly; ``RECORD_INVALID`` otherwise."""
    try:
        document = json.loads(data.decode("utf-8"), object_pairs_hook=_settings_pairs)
    except (UnicodeDecodeError, ValueError) as error:
        raise RecordInvalid(
            f"the settings document {path} is not valid JSON ({error}); it is left as it is",
            location=path,
        ) from None
    settings = document.get("settings") if isinstance(document, dict) else None
    if (
        not isinstance(document, dict)
        or set(document) != {"application", "version", "settings"}
        or document["application"] != "itemjournal"
        or type(document["version"]) is not int
        or document["version"] != 1
        or not isinstance(settings, dict)
        or not all(isinstance(value, str) for value in settings.values())
    ):
        raise RecordInvalid(
            f"{path} is not an itemjournal settings document (expected "
            f'{{"application": "itemjournal", "version": 1, "settings": {{...}}}}); '
            f"it is left as it is",
            location=path,
        )
    return dict(settings)


def encode_settings(settings: dict[str, str]) -> bytes:
    document = {"application": "itemjournal", "version": 1, "settings": settings}
    return (json.dumps(document, ensure_ascii=False, sort_keys=True, indent=1) + "\n").encode()


def check_settings(location: str) -> None:
    """Refuse a location whose settings document is not one of ours (left untouched)."""
    path = os.path.join(location, SETTINGS_NAME)
    root_fd = open_root(location)
    try:
        data = read_document(root_fd, SETTINGS_NAME, path, MAX_SETTINGS_BYTES, "settings document")
    finally:
        os.close(root_fd)
    if data is not None:
        decode_settings(data, path)


def check_setting_text(name: str, value: str) -> None:
    """Refuse (``INVALID_ARGUMENT``) a setting whose name is not a non-empty string or
    whose value is not a string."""
    for what, text in (("name", name), ("value", value)):
        if not isinstance(text, str) or (what == "name" and not text):
            raise InvalidArgument(
                f"a setting's {what} is a non-empty string, not {text!r}",
                code="INVALID_ARGUMENT",
            )


def record_setting(saves: DurableSaves, location: str, name: str, value: str) -> str | Busy:
    """The recorded value of ``name``, recording ``value`` first if none is; ``BUSY``
    when another holds the settings lock. One worker trip."""
    fs = saves.fs
    path = os.path.join(location, SETTINGS_NAME)
    try:
        root_fd = fs.open_dir(location)
    except OSError as error:
        raise fail(f"cannot open {location}", error) from error
    lock_fd: int | None = None
    try:
        lock_fd = open_call_lock_file(root_fd, location)
        if not try_lock_whole(lock_fd, location):
            return BUSY
        for _ in range(8):
            data = read_document(
                root_fd, SETTINGS_NAME, path, MAX_SETTINGS_BYTES, "settings document"
            )
            settings = {} if data is None else decode_settings(data, path)
            if name in settings:
                # A writer may have died between its link and its directory sync:
                # make what this answer rests on durable before giving it.
                try:
                    fs.fsync_dir(root_fd)
                except OSError as error:
                    raise fail(f"cannot sync {location}", error) from error
                return settings[name]
            encoded = encode_settings({**settings, name: value})
            save = saves.create if data is None else saves.replace
            try:
                save(root_fd, location, SETTINGS_NAME, encoded, "settings document")
            except LostRace:
                continue
            return value
        raise StorageFailed(f"{path} kept changing under the lock", errno=errno.EAGAIN)
    finally:
        # The root first: every call of the save, up to its last on the directory, is
        # made under the settings lock, which closing its file then releases.
        quietly(fs.close_dir, root_fd)
        if lock_fd is not None:
            close_call_lock_file(lock_fd)
