"""Every console transcript of README.md and docs/*.md runs as printed.

A transcript is a ``console`` block whose commands start with ``$ ``; the lines after a
command, up to the next one, are what it prints. The suite runs the commands of a block in
order, in one ``bash``, in a scratch directory that is also ``$HOME``, after the scene the
comment before the block names (``<!-- scene: demo-review -->``), and with the files
that earlier ``<!-- file: NAME -->`` blocks of the same page hold. What a command prints
is compared with the printed lines: a line ``…`` stands for any number of lines, ``…``
within a line for any text; runs of spaces, the rules under table headings and the
time of day are not compared. A command whose printed output starts with ``error:`` or
holds a traceback must fail; every other command must succeed.

A ``console`` block without prompts lists commands that are more than a test can run
(``make test``, a worker that runs until stopped): the comment before it names the file
that runs them (``<!-- run by: .ci/run -->``), and that file must hold each command; or
they are benchmarks (``<!-- measured: … -->``), which are never timed by the suite: the
page shows the output of a run made by hand.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent
FENCE = re.compile(r"^```(?P<kind>\w*)[ ]*$")
COMMENT = re.compile(r"^<!-- (?P<what>scene|file|run by|measured): (?P<value>.+?) -->$")
MARK = "@@itemjournal-docs-command@@"
RULE = re.compile(r"^[─━-]+$")
TIME = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(\.\d+)?Z?")


@dataclass
class Command:
    line: str
    printed: list[str] = field(default_factory=list)

    @property
    def must_fail(self) -> bool:
        return bool(self.printed) and (
            self.printed[0].startswith("error:") or any("Traceback" in p for p in self.printed)
        )


@dataclass
class Transcript:
    source: str  # README.md:55, the line of its opening fence
    scene: str
    commands: list[Command]
    files: dict[str, str]


@dataclass
class Listing:
    source: str
    run_by: str | None
    measured: bool
    commands: list[str]


def blocks(path: Path) -> Iterator[tuple[str, str, dict[str, str], list[str]]]:
    """Each fenced block of ``path``: where, its kind, the comments before it, its lines."""
    lines = path.read_text(encoding="utf-8").splitlines()
    number = 0
    comments: dict[str, str] = {}
    while number < len(lines):
        line = lines[number]
        number += 1
        comment = COMMENT.match(line)
        if comment is not None:
            comments[comment["what"]] = comment["value"]
            continue
        opening = FENCE.match(line)
        if opening is None or not opening["kind"]:
            if line.strip():
                comments = {}
            continue
        start = number
        while lines[number] != "```":
            number += 1
        yield f"{path.relative_to(ROOT)}:{start}", opening["kind"], comments, lines[start:number]
        number += 1
        comments = {}


def collect() -> tuple[list[Transcript], list[Listing]]:
    transcripts: list[Transcript] = []
    listings: list[Listing] = []
    for path in PAGES:
        files: dict[str, str] = {}
        for source, kind, comments, lines in blocks(path):
            if "file" in comments:
                files[comments["file"]] = "\n".join(lines) + "\n"
            if kind != "console":
                continue
            if any(line.startswith("$ ") for line in lines):
                commands: list[Command] = []
                for line in lines:
                    if line.startswith("$ "):
                        commands.append(Command(line[2:]))
                    elif commands:
                        commands[-1].printed.append(line)
                scene = comments.get("scene", "")
                transcripts.append(Transcript(source, scene, commands, dict(files)))
            else:
                listed = [line.split("  #")[0].strip() for line in lines]
                listings.append(
                    Listing(
                        source,
                        comments.get("run by"),
                        "measured" in comments,
                        [command for command in listed if command],
                    )
                )
    return transcripts, listings


TRANSCRIPTS, LISTINGS = collect()


# ------------------------------------------------------------------------------ scenes


@dataclass
class Place:
    home: Path
    env: dict[str, str]

    def run(self, *argv: str, expect: int = 0) -> None:
        done = subprocess.run(
            argv,
            cwd=self.home,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == expect, (argv, done.returncode, done.stdout, done.stderr)


def empty(place: Place) -> None:
    """A new directory: nothing is there."""


def demo_review(place: Place) -> None:
    """The demo's first two runs on ``~/shop-journal``: a worker killed mid-charge, then a
    rerun; order-3 and order-5 need review."""
    worker = ["python", "examples/worker_loop.py", "--root", str(place.home / "shop-journal")]
    place.run(*worker, "--fresh", expect=-signal.SIGKILL)
    place.run(*worker)


def in_review(folder: str, *items: str) -> Callable[[Place], None]:
    """A file journal at ``~/<folder>``: order-1 succeeded, the orders ``items`` need
    review (their claim blocks raised), those written ``+order-8`` are left started."""

    def make(place: Place) -> None:
        place.run("python", "-c", PLANT, str(place.home / folder), *items)

    make.__doc__ = f"~/{folder}: order-1 succeeded; {', '.join(items)} in review"
    return make


PLANT = """
import sys
from itemjournal import sync

INPUTS = {"amount_cents": 4500}
with sync.Journal.open(sys.argv[1]) as journal:
    claim = journal.begin(("shop", "billing", "charge", "order-1"), INPUTS, "charge-v1")
    journal.complete(claim, "ch_order-1")
    for item in sys.argv[2:]:
        if item.startswith("+"):
            journal.begin(("shop", "billing", "charge", item[1:]), INPUTS, "charge-v1")
            continue
        try:
            with journal.claim(("shop", "billing", "charge", item), INPUTS, "charge-v1"):
                raise TimeoutError("the provider did not answer")
        except TimeoutError:
            pass
"""

SCENES: dict[str, Callable[[Place], None]] = {
    "empty": empty,
    "demo-review": demo_review,
    "shop-review": in_review("shop-journal", "order-3", "order-4", "order-17", "order-18"),
    "notebook-review": in_review(".local/state/shop-journal", "order-7", "+order-8"),
}


@pytest.fixture(scope="session")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the wheel built from this tree: ``pip install itemjournal`` finds
    it there (``PIP_FIND_LINKS``) and takes the rest from the package index."""
    folder = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "-w",
            str(folder),
            str(ROOT),
        ],
        check=True,
        timeout=600,
    )
    return folder


def place_for(tmp_path: Path, wheels: Path) -> Place:
    home = tmp_path / "home"
    home.mkdir()
    (home / "examples").symlink_to(ROOT / "examples")
    # ``pip`` before a virtual environment is activated would install into the suite's
    # own: refused, so a page that forgets to make one fails instead.
    guard = tmp_path / "guard"
    guard.mkdir()
    for name in ("pip", "pip3"):
        (guard / name).write_text(
            '#!/bin/sh\n[ -n "$VIRTUAL_ENV" ] && exec "$VIRTUAL_ENV/bin/pip" "$@"\n'
            'echo "pip outside a virtual environment" >&2\nexit 99\n'
        )
        (guard / name).chmod(0o755)
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("ITEMJOURNAL_", "PYTHON", "VIRTUAL_ENV", "COV_", "PYTEST"))
    }
    env.update(
        HOME=str(home),
        PATH=os.pathsep.join([str(guard), str(BIN), env.get("PATH", "/usr/bin:/bin")]),
        PIP_FIND_LINKS=str(wheels),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        COLUMNS="200",
        LC_ALL="C.UTF-8",
    )
    return Place(home, env)


# ---------------------------------------------------------------------------- comparing


def normal(line: str) -> str:
    return " ".join(TIME.sub("<time>", line).split())


def line_pattern(printed: str) -> re.Pattern[str]:
    parts = [re.escape(part) for part in normal(printed).split("…")]
    return re.compile(".*".join(parts) + r"\Z")


def matches(printed: list[str], seen: list[str]) -> bool:
    wanted = [normal(line) for line in printed if not RULE.match(line.strip())]
    got = [normal(line) for line in seen if not RULE.match(line.strip()) and line.strip()]

    def at(w: int, g: int) -> bool:
        if w == len(wanted):
            return g == len(got)
        if wanted[w] == "…":
            return any(at(w + 1, later) for later in range(g, len(got) + 1))
        return (
            g < len(got) and line_pattern(wanted[w]).match(got[g]) is not None and at(w + 1, g + 1)
        )

    return at(0, 0)


# ------------------------------------------------------------------------------- tests


def test_the_docs_have_transcripts() -> None:
    assert any(t.source.startswith("README.md") for t in TRANSCRIPTS)
    assert len(TRANSCRIPTS) >= 5


@pytest.mark.parametrize("transcript", TRANSCRIPTS, ids=[t.source for t in TRANSCRIPTS])
def test_a_transcript_runs_as_printed(transcript: Transcript, tmp_path: Path, wheels: Path) -> None:
    assert transcript.scene in SCENES, (
        f"{transcript.source}: name its scene before the block (<!-- scene: NAME -->), "
        f"one of {sorted(SCENES)}"
    )
    place = place_for(tmp_path, wheels)
    SCENES[transcript.scene](place)
    for name, text in transcript.files.items():
        (place.home / name).write_text(text, encoding="utf-8")
    script = [f"cd {place.home}"]
    for command in transcript.commands:
        script += [f"echo {MARK}", command.line, f"echo {MARK} $?"]
    # A session of its own: whatever a transcript starts in the background (a worker) is
    # ended with it, whatever the outcome.
    shell = subprocess.Popen(
        ["bash", "-c", "\n".join(script)],
        cwd=place.home,
        env=place.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        printed, _ = shell.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()
    pieces = printed.split(f"{MARK}\n")[1:]
    assert len(pieces) == len(transcript.commands), printed[-3000:]
    for command, piece in zip(transcript.commands, pieces, strict=True):
        output, _, status = piece.rpartition(f"{MARK} ")
        code = int(status.strip())
        where = f"{transcript.source}: $ {command.line}\n--- it printed (exit {code}):\n{output}"
        assert (code != 0) == command.must_fail, where
        if command.printed:
            assert matches(command.printed, output.splitlines()), (
                where + "--- the page prints:\n" + "\n".join(command.printed)
            )


@pytest.mark.parametrize("listing", LISTINGS, ids=[li.source for li in LISTINGS])
def test_a_command_listing_names_what_runs_it(listing: Listing) -> None:
    if listing.measured:
        assert all(command.startswith("make bench") for command in listing.commands)
        return
    assert listing.run_by is not None, (
        f"{listing.source}: a console block without prompts names the file that runs its "
        "commands (<!-- run by: .ci/run -->), or shows them as a transcript"
    )
    runner = ROOT / listing.run_by
    assert runner.is_file(), listing.run_by
    text = runner.read_text(encoding="utf-8")
    for command in listing.commands:
        assert command in text, f"{listing.run_by} does not run {command!r}"


def test_the_matching_of_printed_output() -> None:
    printed = ["STATUS  KEY", "───", "…", "succeeded  … ch_1", "1 record"]
    assert matches(
        printed, ["STATUS    KEY", "─────", "a", "b", "succeeded  ab12  ch_1", "1 record"]
    )
    assert matches(printed, ["STATUS KEY", "succeeded x ch_1", "1 record"])
    assert not matches(printed, ["STATUS KEY", "succeeded x ch_2", "1 record"])
    assert not matches(printed, ["STATUS KEY", "succeeded x ch_1", "2 records"])
    assert matches(["at 2026-11-30 18:47:01Z"], ["at 2026-12-03 21:00:00Z"])
