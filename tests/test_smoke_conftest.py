import pytest
from blockbuster import BlockingError

import itemjournal
from itemjournal import Journal

pytestmark = pytest.mark.anyio


async def test_detector_catches_disk_work_on_the_loop(
    anyio_backend: str, journal: Journal, file_only: None
) -> None:
    store = journal.store
    assert isinstance(store, itemjournal.FileStore)
    if anyio_backend != "asyncio":
        pytest.skip("the detector watches asyncio loops")
    with pytest.raises(BlockingError):
        store._open_sync()
