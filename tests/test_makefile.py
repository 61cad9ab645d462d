"""The Makefile as a developer runs it: `make test` on a machine with the project's
PostgreSQL server must test the PostgreSQL store too, without any variable set first."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

MAKEFILE = Path(__file__).resolve().parents[1] / "Makefile"
LOCAL_SERVER = "postgresql://postgres@127.0.0.1:5432/test"
# A target of the test's own that prints what every recipe of the Makefile would see.
SHOW = "show-test-server: ; @printf '%s\\n' \"$$ITEMJOURNAL_TEST_POSTGRES\""

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def seen_by_recipes(**variables: str) -> str:
    env = {name: value for name, value in os.environ.items() if name != "ITEMJOURNAL_TEST_POSTGRES"}
    env.update(variables)
    done = subprocess.run(
        ["make", "-s", "-f", str(MAKEFILE), "--eval", SHOW, "show-test-server"],
        env=env,
        cwd=MAKEFILE.parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


def test_the_suite_is_pointed_at_the_local_server_when_no_variable_says_otherwise() -> None:
    assert seen_by_recipes() == LOCAL_SERVER


def test_a_server_named_by_the_developer_is_kept() -> None:
    other = "postgresql://app@db.example/other"
    assert seen_by_recipes(ITEMJOURNAL_TEST_POSTGRES=other) == other


def test_an_empty_variable_still_means_no_server() -> None:
    """`ITEMJOURNAL_TEST_POSTGRES= make test` skips the PostgreSQL tests on purpose."""
    assert seen_by_recipes(ITEMJOURNAL_TEST_POSTGRES="") == ""


def recipes(target: str) -> list[str]:
    """The commands ``make TARGET`` would run from scratch (``make -n -B``: nothing run)."""
    done = subprocess.run(
        ["make", "--no-print-directory", "-n", "-B", "-f", str(MAKEFILE), target],
        cwd=MAKEFILE.parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.splitlines()


def test_the_demo_installs_only_the_package_and_the_extra_it_uses() -> None:
    """`make demo` runs in an environment of its own with the `cli` extra: not the test
    and lint toolchain `make test` needs."""
    demo = recipes("demo")
    installs = [line for line in demo if "pip install" in line and "-e" in line]
    assert installs == [".venv-demo/bin/python -m pip install --quiet -e '.[cli]'"]
    assert demo[-1].startswith(".venv-demo/bin/python examples/demo.py --root ")
    test = recipes("test")
    assert ".venv/bin/python -m pip install --quiet -e '.[test,lint]'" in test
    assert not any(".venv-demo" in line for line in test)
