"""The store conformance suite's journal and concurrency tests, run again on a PostgreSQL
journal reached through PgBouncer in session pooling mode (started by the tests on a free
loopback port, in front of a cluster of their own): session pooling is supported, so the
journal must keep every promise there that it keeps on a direct connection.

The tests are those of ``test_journal`` and ``test_concurrency``, imported here: the
fixtures below give them this module's location instead of the conftest's.
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Iterator
from pathlib import Path

import _pg
import pytest

# Their folder is on the path when pytest collected it first (a whole run), not when
# only this folder is run: put it there either way.
_JOURNAL_TESTS = str(Path(__file__).resolve().parents[2] / "journal")
if _JOURNAL_TESTS not in sys.path:
    sys.path.insert(0, _JOURNAL_TESTS)

from test_concurrency import *  # noqa: E402, F403
from test_journal import *  # noqa: E402, F403


@pytest.fixture(scope="module")
def _session_pooler() -> Iterator[str]:
    with (
        _pg.cluster(max_connections=150) as server,
        _pg.pgbouncer(server.url, "session", pool_size=120) as url,
    ):
        yield url


@pytest.fixture
def store_kind() -> str:
    return "postgres"


@pytest.fixture
def location(_session_pooler: str) -> str:
    """A schema of its own, through the session pooler (the cluster goes with the module)."""
    return f"{_session_pooler}?schema=ijc_{secrets.token_hex(5)}"


@pytest.mark.anyio
async def test_these_journals_are_behind_session_pooling(journal: Journal) -> None:  # noqa: F405
    assert journal.store.pooling == "session"  # type: ignore[attr-defined]
