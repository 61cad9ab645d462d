"""The viewer in a real browser: Debian's Chromium, driven by Playwright, over a real
uvicorn on 127.0.0.1 serving a journal of a few hundred records.

Skipped when ``/usr/bin/chromium`` is missing, except under CI (``CI=true``), where a
missing browser fails the test. The screenshot goes to a temporary directory, or to the
path in ``ITEMJOURNAL_SCREENSHOT`` (``docs/viewer.png`` for the manual).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx
import pytest

import itemjournal
from itemjournal import Journal

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
RECORDS = 320
PAGE = 50
REPOSITORY = Path(__file__).resolve().parents[2]
DEFINITION = itemjournal.definition_digest("charge-v3")
SERVER_START = 30.0  # seconds
STEP_TIMEOUT = 15_000  # milliseconds, for each browser action

pytestmark = pytest.mark.slow


def browser_or_skip() -> Path:
    if CHROMIUM.exists():
        return CHROMIUM
    message = f"{CHROMIUM} is missing (apt-get install chromium)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message}; under CI the browser test must run")
    pytest.skip(message)


def identity_of(number: int) -> tuple[str, str, str, str]:
    program, job = (("billing", "charge"), ("billing", "refund"), ("mail", "send-receipt"))[
        number % 3
    ]
    return ("shop", program, job, f"order-{10_000 + number * 7}")


def status_of(number: int) -> str:
    return ("succeeded", "needs_review", "succeeded", "released", "started")[number % 5]


REASONS = (
    "provider timed out after 30 s: outcome unknown",
    "owner process gone",
    "TimeoutError: card network did not answer",
    "HTTP 502 from the provider; the charge may have gone through",
)


def build(location: str) -> dict[str, int]:
    """A journal of ``RECORDS`` records of mixed statuses; returns how many of each."""

    async def main() -> None:
        journal = await Journal.open(location)
        limiter = anyio.CapacityLimiter(32)

        async def one(number: int) -> None:
            async with limiter:
                identity = identity_of(number)
                claim = await journal.begin(identity, {"amount": 100 + number}, DEFINITION)
                assert isinstance(claim, itemjournal.Claim)
                status = status_of(number)
                if status == "succeeded":
                    await journal.complete(claim, f"ch_{number:06d}{claim.key[:10]}")
                elif status in ("needs_review", "released"):
                    await journal.mark_review(identity, REASONS[number % len(REASONS)])
                    if status == "released":
                        await journal.resolve(identity, retry=True, note="provider says no charge")

        try:
            async with anyio.create_task_group() as group:
                for number in range(RECORDS):
                    group.start_soon(one, number)
        finally:
            await journal.aclose()

    anyio.run(main)
    counts: dict[str, int] = {}
    for number in range(RECORDS):
        counts[status_of(number)] = counts.get(status_of(number), 0) + 1
    return counts


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_server(location: str, port: int) -> subprocess.Popen[bytes]:
    code = (
        "import sys\n"
        "from itemjournal._operator.viewer.app import serve\n"
        "serve(sys.argv[1], host='127.0.0.1', port=int(sys.argv[2]))\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "ITEMJOURNAL_VIEWER_TOKEN"}
    return subprocess.Popen(
        [sys.executable, "-c", code, location, str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )


def wait_until_served(url: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + SERVER_START
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the viewer exited with {server.returncode}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"nothing answered at {url} within {SERVER_START} s")


def stop(server: subprocess.Popen[bytes]) -> str:
    """Stop the server (SIGINT, then SIGKILL after 10 s); its log."""
    if server.poll() is None:
        server.send_signal(signal.SIGINT)
    try:
        _, log = server.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        _, log = server.communicate(timeout=10)
    return log.decode(errors="replace")


def screenshot_path(tmp_path: Path) -> Path:
    wanted = os.environ.get("ITEMJOURNAL_SCREENSHOT")
    if not wanted:
        return tmp_path / "viewer.png"
    path = Path(wanted)
    return path if path.is_absolute() else REPOSITORY / path


def test_filter_page_and_open_a_record_in_chromium(tmp_path: Path) -> None:
    executable = browser_or_skip()
    from playwright.sync_api import sync_playwright

    timings: dict[str, float] = {}
    mark = time.monotonic()
    location = f"sqlite://{tmp_path}/journal.db"
    counts = build(location)
    assert counts["needs_review"] > PAGE  # so the filtered listing has a second page
    timings["journal"] = time.monotonic() - mark

    mark = time.monotonic()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(location, port)
    log = ""
    try:
        wait_until_served(base + "/api/counts", server)
        timings["server"] = time.monotonic() - mark

        mark = time.monotonic()
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=str(executable),
                headless=True,
                args=CHROMIUM_ARGS,
                timeout=30_000,
            )
            try:
                timings["launch"] = time.monotonic() - mark
                mark = time.monotonic()
                # No JavaScript: the viewer needs none, and its policy forbids it.
                context = browser.new_context(
                    java_script_enabled=False, viewport={"width": 1280, "height": 860}
                )
                page = context.new_page()
                page.set_default_timeout(STEP_TIMEOUT)
                problems: list[str] = []
                page.on("console", lambda message: problems.append(message.text))
                page.on("pageerror", lambda error: problems.append(str(error)))
                loaded: list[str] = []
                page.on("response", lambda reply: loaded.append(f"{reply.status} {reply.url}"))

                page.goto(base + "/")
                assert page.title() == "Records · itemjournal"
                rows = page.locator("table.records tbody tr.record")
                assert rows.count() == PAGE
                for status, number in counts.items():
                    shown = page.locator(f'[data-count="{status}"] .n').inner_text()
                    assert int(shown) == number, status
                assert f"200 {base}/static/viewer.css" in loaded

                # Filter by status: only matching rows.
                page.select_option("#status", "needs_review")
                page.click("#apply")
                page.wait_for_url("**/?status=needs_review*")
                assert rows.count() == PAGE
                first_keys = [rows.nth(i).get_attribute("data-key") for i in range(PAGE)]
                for i in range(PAGE):
                    assert rows.nth(i).get_attribute("data-status") == "needs_review"
                assert page.locator("#status option:checked").inner_text() == "needs_review"

                # The next page: the rest of them, none seen before.
                page.click("a.next")
                page.wait_for_url("**after=*")
                assert rows.count() == counts["needs_review"] - PAGE
                for i in range(rows.count()):
                    assert rows.nth(i).get_attribute("data-status") == "needs_review"
                    assert rows.nth(i).get_attribute("data-key") not in first_keys
                assert page.locator("a.next").count() == 0

                # A record's detail.
                item = rows.nth(0).locator("a.item")
                name = item.inner_text()
                item.click()
                page.wait_for_url(f"**/records/shop/*/*/{name}")
                assert page.locator("#status").inner_text() == "needs_review"
                assert page.locator("h1.identity .item").inner_text() == name
                reason = page.locator("pre.reason").inner_text()
                assert reason in REASONS
                assert page.locator("table.history tbody tr").count() == 2
                timings["browse"] = time.monotonic() - mark

                # The screenshot for the manual: the first page of records in review.
                mark = time.monotonic()
                page.goto(base + "/?status=needs_review")
                target = screenshot_path(tmp_path)
                target.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(target))
                assert target.stat().st_size > 10_000
                timings["screenshot"] = time.monotonic() - mark
                assert problems == []
                assert all(entry.startswith(("200 ", "404 ")) for entry in loaded), loaded
                context.close()
            finally:
                browser.close()
    finally:
        log = stop(server)
    assert "Traceback" not in log, log
    print("browser test timings: " + ", ".join(f"{k} {v:.2f} s" for k, v in timings.items()))
