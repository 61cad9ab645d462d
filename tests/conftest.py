"""Shared fixtures: every async test runs on asyncio and on trio; on asyncio a
blocking-call detector fails any test in which itemjournal touches the disk from
the event loop thread."""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from blockbuster import BlockBuster, BlockBusterFunction, blockbuster_ctx

import itemjournal
from itemjournal import Journal
from itemjournal.testing import MemoryStore

# `make test-dist` runs this suite against the wheel installed in a fresh environment and
# sets this variable: the session then refuses to start unless ``itemjournal`` was
# imported from that environment's site-packages, never from the source tree's ``src/``.
INSTALLED_VARIABLE = "ITEMJOURNAL_TEST_INSTALLED"
SOURCE_TREE = Path(__file__).resolve().parent.parent / "src"


def installed_problem(
    module_file: str | None, *, source: Path = SOURCE_TREE, site: Path | None = None
) -> str | None:
    """Why ``module_file`` (``itemjournal.__file__``) is not a copy installed in ``site``
    (this interpreter's site-packages by default), or None when it is."""
    import sysconfig

    if module_file is None:
        return "itemjournal was imported from no file"
    where = Path(module_file).resolve()
    if where.is_relative_to(source.resolve()):
        return f"itemjournal was imported from the source tree ({where}), not the installed wheel"
    site = (site or Path(sysconfig.get_paths()["purelib"])).resolve()
    if not where.is_relative_to(site):
        return f"itemjournal was imported from {where}, outside site-packages ({site})"
    return None


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.environ.get(INSTALLED_VARIABLE) == "1":
        problem = installed_problem(itemjournal.__file__)
        if problem is not None:
            pytest.exit(f"{INSTALLED_VARIABLE}=1: {problem}", returncode=3)


# Owners log the boots of their machine (``itemjournal._stores.owners.boot_log_path``); the suite,
# and every process it starts, keeps a log of its own instead of the machine's.
os.environ.setdefault("ITEMJOURNAL_STATE_DIR", tempfile.mkdtemp(prefix="itemjournal-test-state-"))

# Calls blockbuster does not watch by itself but that a store makes on every save.
_EXTRA_BLOCKING = ("open", "fsync", "fdatasync", "fstat", "lstat", "makedirs")


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(autouse=True)
def blockbuster() -> Iterator[BlockBuster]:
    """Active in every test; it only fires inside a running asyncio loop."""
    with blockbuster_ctx("itemjournal") as detector:
        for name in _EXTRA_BLOCKING:
            function = BlockBusterFunction(
                os,
                name,
                scanned_modules="itemjournal",
                # coverage's tracer looks up each new source file on the loop thread
                can_block_functions=[("coverage/control.py", {"_should_trace"})],
            )
            detector.functions[f"os.{name}"] = function
            function.activate()
        yield detector


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """An absolute directory for one file journal (not yet created)."""
    return tmp_path / "journal"


STORE_KINDS = ("file", "sqlite", "postgres", "memory")

# Where the PostgreSQL tests find their server: a postgresql:// URL. Unset, they skip
# with this reason; with ITEMJOURNAL_REQUIRE_POSTGRES=1 (as in CI) they fail instead.
POSTGRES_VARIABLE = "ITEMJOURNAL_TEST_POSTGRES"
_postgres_problem: list[str] = []  # why the server cannot be used (found once per run)


def postgres_url() -> str:
    """The test server's URL, or skip (fail, when it is required) saying why there is none."""
    url = os.environ.get(POSTGRES_VARIABLE, "")
    if not _postgres_problem:
        if not url:
            _postgres_problem.append(f"{POSTGRES_VARIABLE} is not set (a postgresql:// URL)")
        else:
            import psycopg

            try:
                psycopg.connect(url, connect_timeout=5).close()
                _postgres_problem.append("")
            except psycopg.Error as error:
                _postgres_problem.append(f"cannot connect to {POSTGRES_VARIABLE}: {error}")
    problem = _postgres_problem[0]
    if problem:
        if os.environ.get("ITEMJOURNAL_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"the PostgreSQL tests are required: {problem}")
        pytest.skip(problem)
    return url


@contextlib.contextmanager
def postgres_schema() -> Iterator[str]:
    """A location in a schema of its own on the test server, dropped afterwards."""
    import psycopg

    url = postgres_url()
    schema = f"ijtest_{os.getpid()}_{secrets.token_hex(6)}"
    try:
        yield f"{url}{'&' if '?' in url else '?'}schema={schema}"
    finally:
        with psycopg.connect(url, autocommit=True) as connection:
            connection.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


# A test that takes one of these makes its journals over a ``MemoryStore`` itself when
# ``store_kind`` is "memory" (``memory_ok`` says so for a test that needs nothing else).
_MEMORY_FIXTURES = {"make_journal", "open_sync", "memory_ok"}


@pytest.fixture
def memory_ok() -> None:
    """Taken by a test that handles ``store_kind == "memory"`` itself (see ``store_kind``)."""


@pytest.fixture(params=STORE_KINDS)
def store_kind(request: pytest.FixtureRequest) -> str:
    """Which store the conformance tests run on (every test using ``journal``).

    The in-memory store has no location: it runs the tests that take their journals from
    ``journal`` or ``make_journal``; a test that only uses the kind to build a location
    of its own is skipped for it. The PostgreSQL store runs where a server is given.
    """
    kind = str(request.param)
    if kind == "memory" and not _MEMORY_FIXTURES & set(request.fixturenames):
        pytest.skip("an in-memory store has no location")
    if kind == "postgres":
        postgres_url()
    return kind


@pytest.fixture
def location(store_kind: str, root: Path) -> Iterator[str]:
    """The ``Journal.open`` location of the test's journal, for the store under test.

    The in-memory store has none: a test that needs one (to open it again, from another
    process, or to look at its files) is skipped for it. A PostgreSQL location is a
    schema of its own, dropped after the test.
    """
    if store_kind == "memory":
        pytest.skip("an in-memory store has no location")
    if store_kind == "postgres":
        with postgres_schema() as url:
            yield url
        return
    if store_kind == "sqlite":
        yield f"sqlite://{root}/journal.db"
        return
    yield str(root)


@pytest.fixture
def file_only(store_kind: str) -> None:
    """Skip (for the other stores) a test about the file store's on-disk layout."""
    if store_kind != "file":
        pytest.skip("about the file store's files")


@pytest.fixture
def on_disk(store_kind: str) -> None:
    """Skip (for the in-memory and PostgreSQL stores) a test that looks at the files a store
    writes."""
    if store_kind in ("memory", "postgres"):
        pytest.skip(f"the {store_kind} store writes no files here")


@pytest.fixture
def separate_stores(store_kind: str) -> None:
    """Skip (for the in-memory store) a test that needs each journal from ``make_journal``
    to hold a store of its own: the in-memory store's journals share one."""
    if store_kind == "memory":
        pytest.skip("the journals of an in-memory store share one store")


JournalFactory = Callable[..., Awaitable[Journal]]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A module with ``FACES = ("async", "sync")`` runs its journal tests on both faces
    (``tests/_faces.py``)."""
    faces = getattr(metafunc.module, "FACES", None)
    if faces and "make_journal" in metafunc.fixturenames:
        metafunc.parametrize("face", faces, indirect=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The blocking face runs on one anyio backend: none of its calls runs on the event
    loop, which only waits for the threads that make them; and not the tests marked
    ``async_only``."""
    kept, dropped = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        blocking = params.get("face") == "sync"
        both = blocking and params.get("anyio_backend") not in (None, "asyncio")
        # Cancellation, a task's deadline, the journal's event loop: the async face alone.
        alone = blocking and item.get_closest_marker("async_only") is not None
        (dropped if both or alone else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture
def face(request: pytest.FixtureRequest) -> str:
    """Which face of the journal ``make_journal`` opens: ``async`` unless the module asks
    for both (``pytest_generate_tests``)."""
    return str(getattr(request, "param", "async"))


@pytest.fixture
async def make_journal(
    store_kind: str, face: str, request: pytest.FixtureRequest
) -> AsyncIterator[JournalFactory]:
    """Open journals over the test's location; all are closed at the end.

    For the in-memory store, every journal is made over one ``MemoryStore``, so that they
    share records as journals opened on one location do; ``lock_timeout`` and
    ``trust_shared_root`` mean nothing to it. On the blocking face (``face == "sync"``)
    each is an ``itemjournal.sync.Journal`` seen through ``tests._faces.AsyncView``.
    """
    opened: list[Journal] = []
    shared = MemoryStore() if store_kind == "memory" else None
    location = None if shared is not None else str(request.getfixturevalue("location"))

    async def factory(**options: object) -> Journal:
        if face == "sync":
            return await _sync_journal(shared, location, options)
        if shared is not None:
            journal = Journal(shared, input_key=_memory_options(options))
        else:
            assert location is not None
            journal = await Journal.open(location, **options)  # type: ignore[arg-type]
        opened.append(journal)
        return journal

    async def _sync_journal(
        shared: MemoryStore | None, location: str | None, options: dict[str, object]
    ) -> Journal:
        import functools

        import anyio.to_thread
        from _faces import AsyncView

        from itemjournal import sync

        if shared is not None:
            made = sync.Journal(shared, input_key=_memory_options(options))
        else:
            assert location is not None
            made = await anyio.to_thread.run_sync(
                functools.partial(sync.Journal.open, location, **options)  # type: ignore[arg-type]
            )
        journal: Journal = AsyncView(made)  # type: ignore[assignment]
        opened.append(journal)
        return journal

    yield factory
    for journal in opened:
        await journal.aclose()


def _memory_options(options: dict[str, object]) -> bytes | None:
    """The one option a journal over a ``MemoryStore`` takes: its ``input_key``."""
    unknown = set(options) - {"input_key", "lock_timeout", "trust_shared_root"}
    assert not unknown, f"no such option: {sorted(unknown)}"
    input_key = options.get("input_key")
    assert input_key is None or isinstance(input_key, bytes)
    return input_key


@pytest.fixture
async def journal(make_journal: JournalFactory) -> Journal:
    return await make_journal()


# Figures: tests that measure something (crash states, injected faults, races, commits)
# print one line each; those lines are gathered here and shown at the end of every run.
_FIGURES: list[tuple[str, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.passed and report.capstdout.strip():
        _FIGURES.append((report.nodeid, report.capstdout.strip()))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _FIGURES:
        return
    terminalreporter.section("figures measured by the tests")
    for nodeid, text in _FIGURES:
        terminalreporter.write_line(nodeid)
        for line in text.splitlines():
            if line.strip():
                terminalreporter.write_line(f"    {line.strip()}")


@pytest.fixture(autouse=True)
def _close_forgotten_postgres_stores(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Close any PostgreSQL store a test opened and left open, so that its connections
    (and the server's connection slots) do not outlive the test."""
    try:
        from itemjournal._stores.postgres.store import PostgresStore
    except ImportError:  # pragma: no cover - the postgres extra is part of the test extra
        yield
        return
    opened: list[PostgresStore] = []
    real_open = PostgresStore._open_sync

    def recording_open(store: PostgresStore) -> None:
        opened.append(store)
        real_open(store)

    monkeypatch.setattr(PostgresStore, "_open_sync", recording_open)
    yield
    for store in opened:
        store._close_sync()
