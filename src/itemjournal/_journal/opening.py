"""What ``Journal.open`` does before and after the store opens: the location is checked
and mapped to its store (the store's module imported in a worker thread, since imports
read files), and the location's recorded way of fingerprinting inputs is compared with
the journal's own."""

from __future__ import annotations

import functools
import os

from .._model.conflicts import ConflictError
from .._stores.registry import open_store
from .._stores.seam import Store
from .._stores.threads import run_in_thread
from .arguments import check_open
from .faces import ASYNC, blocking
from .maintenance import INPUT_KIND


async def locate_store(
    location: str | os.PathLike[str], lock_timeout: float, trust_shared_root: bool
) -> Store:
    """The store for ``location``, made but not opened yet."""
    text, timeout = check_open(location, lock_timeout, trust_shared_root)
    store = await run_in_thread(
        functools.partial(
            open_store, text, lock_timeout=timeout, trust_shared_root=trust_shared_root
        )
    )
    if ASYNC:
        return store
    return blocking(store)


async def require_input_kind(store: Store, kind: str) -> None:
    """Record ``kind`` in a new location, or refuse a location made with another kind."""
    recorded = await store.setting(INPUT_KIND, kind)
    if recorded != kind:
        raise ConflictError(
            f"{store.location} fingerprints inputs with {recorded!r}, but it was "
            f"opened with {kind!r}; open it with the input_key it was created with",
            code="INPUT_KEY_MISMATCH",
        )
