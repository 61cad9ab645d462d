"""The location registry: a scheme names a store, imported only when it is used."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from itemjournal import FileStore, InvalidArgument, SQLiteStore
from itemjournal._stores.registry import open_store, redact


def test_a_path_is_the_file_store() -> None:
    store = open_store("/var/lib/app/journal", lock_timeout=3.0, trust_shared_root=True)
    assert isinstance(store, FileStore)
    assert store.location == "/var/lib/app/journal"
    assert store.lock_timeout == 3.0
    assert store.trust_shared_root is True


def test_sqlite_names_the_sqlite_store() -> None:
    store = open_store(
        "sqlite:///var/lib/app/journal.db", lock_timeout=2.0, trust_shared_root=False
    )
    assert isinstance(store, SQLiteStore)
    assert store.location == "sqlite:///var/lib/app/journal.db"
    assert store.busy_timeout == 2.0


@pytest.mark.parametrize("scheme", ["postgresql", "postgres", "POSTGRESQL"])
def test_postgresql_names_the_postgresql_store(scheme: str) -> None:
    from itemjournal._stores.postgres.store import PostgresStore

    store = open_store(
        f"{scheme}://app@db.internal/jobs", lock_timeout=1.0, trust_shared_root=False
    )
    assert isinstance(store, PostgresStore)
    assert store.location == f"{scheme.lower()}://app@db.internal/jobs"


@pytest.mark.parametrize(
    "location", ["https://example.invalid/journal", "s3://bucket/journal", "relative/path"]
)
def test_an_unknown_scheme_or_a_relative_path_is_refused(location: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        open_store(location, lock_timeout=1.0, trust_shared_root=False)
    assert raised.value.code == "ABSOLUTE_ROOT_REQUIRED"


def test_importing_the_package_imports_no_database_driver() -> None:
    script = textwrap.dedent(
        """
        import sys
        import itemjournal
        from itemjournal._stores.registry import open_store
        open_store("/tmp/x", lock_timeout=1.0, trust_shared_root=False)
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("psycopg", "psycopg_pool")))
        print("itemjournal._stores.postgres.store" in sys.modules)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.split("\n")[:2] == ["[]", "False"]


def test_a_missing_driver_names_the_extra() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["psycopg"] = None  # as if the postgres extra were not installed
        from itemjournal._stores.registry import open_store
        try:
            open_store("postgresql://db/jobs", lock_timeout=1.0, trust_shared_root=False)
        except ValueError as error:
            print(error.code, error)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.startswith("INVALID_ARGUMENT ")
    assert "pip install 'itemjournal[postgres]'" in done.stdout


@pytest.mark.parametrize(
    ("location", "shown"),
    [
        ("postgresql://app:s3cret@db/jobs", "postgresql://app:***@db/jobs"),
        (
            "postgresql://app:s3cret@db:5433/jobs?schema=x",
            "postgresql://app:***@db:5433/jobs?schema=x",
        ),
        (
            "postgresql://app@db/jobs?password=s3cret&schema=x",
            "postgresql://app@db/jobs?password=***&schema=x",
        ),
        ("postgresql://app@db/jobs", "postgresql://app@db/jobs"),
        ("sqlite:///var/lib/app/journal.db", "sqlite:///var/lib/app/journal.db"),
        ("/var/lib/app/journal", "/var/lib/app/journal"),
    ],
)
def test_redact_hides_passwords_and_nothing_else(location: str, shown: str) -> None:
    assert redact(location) == shown


def test_a_password_never_shows_in_the_store_or_its_errors() -> None:
    from itemjournal._stores.postgres.store import PostgresStore

    with pytest.raises(InvalidArgument) as raised:
        PostgresStore("postgresql://app:s3cret@db.internal/jobs?schema=Bad-Name")
    assert "s3cret" not in str(raised.value)
    good = PostgresStore("postgresql://app:s3cret@db.internal/jobs")
    assert "s3cret" not in repr(good)
    assert "s3cret" not in good.location
