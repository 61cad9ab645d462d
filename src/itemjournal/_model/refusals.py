"""What a refusal tells a person: which record, what it says, and what to do next.

A refusal (``ConflictError``, ``UnresolvedClaim``) is raised into code that a person
reads, in a notebook, a log or a terminal. Its message names the identity's four labels
and the record's key, says what the record says (its status, since when, the review
reason, its owner and whether that is this very process; never its receipt, which the
journal's log keeps to DEBUG, nor its inputs), and ends with the next step,
as a call or an ``itemjournal`` command that works as printed. Pure: the facts that need
I/O (whether the owner lives, whether it is this process) are judged by the caller in
the store's worker trip and passed in, and so is where the journal is (``Where``), with
every secret of its location already hidden.

Commands take the labels (``itemjournal show SCOPE PROGRAM JOB ITEM``), which finds the
record directly, where its key would make the command read every record; labels are
plain ASCII that a shell takes as they are. What only a person can decide (a receipt, a
note) is written ``<like-this>``, for that person to fill in: a command that settles a
record is never complete as printed, so no decision is made by pasting it unread.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from .identity import Identity
from .records import Owner
from .view import RecordView

__all__ = ["Where", "explain", "unresolved"]

# The parameters of the commands a person fills in before running them.
_RECEIPT = "<receipt>"
_NOTE = "<note>"
_WHY = "<why>"


@dataclass(frozen=True, slots=True)
class Where:
    """Where a journal is, as its refusals name it.

    ``location`` is the location as it may be shown (a database URL's secrets replaced by
    ``***``), or None when no command can reach the journal (a store in memory, a store
    of the application's own): then the next steps are calls. ``keyed``: the journal
    fingerprints inputs with a key, which a command must be given too.
    ``trust_shared_root``: it was opened so, and a command must say so too. ``awaited``:
    the journal's calls are awaited (``itemjournal.Journal``), not blocking
    (``itemjournal.sync.Journal``).
    """

    location: str | None
    keyed: bool = False
    trust_shared_root: bool = False
    awaited: bool = True

    @property
    def journal(self) -> str:
        """How a call on the journal begins: ``await journal.`` or ``journal.``."""
        return "await journal." if self.awaited else "journal."

    @property
    def hidden_secret(self) -> bool:
        """Whether the shown location stands for one with a secret (a password)."""
        location = self.location
        return location is not None and "://" in location and "***" in location

    def command(self, *words: str) -> str:
        """``itemjournal`` with ``words`` and this journal's options, as a shell takes it.

        A location with a hidden secret is not written out: the command reads it from
        ``ITEMJOURNAL_LOCATION``, which the message asks to be set."""
        parts = ["itemjournal", *words]
        if self.location is not None and not self.hidden_secret:
            parts += ["--location", shlex.quote(self.location)]
        if self.keyed:
            parts += ["--input-key-file", "<key-file>"]
        if self.trust_shared_root:
            parts.append("--trust-shared-root")
        return " ".join(parts)


def explain(
    what: str,
    code: str,
    view: RecordView,
    *,
    own: bool | None,
    where: Where,
) -> str:
    """The whole message of a refusal ``code`` whose first words are ``what`` (what the
    state machine said), for the record ``view`` shows.

    ``own``: whether the record's owner is this very process (None: not known here).
    """
    ident = view.identity
    state = _state(view, own)
    step = _next_step(code, view, own, where)
    return f"{what}. {_named(ident, view.key)} {state}. {step}{_setting(where)}."


def unresolved(what: str, view: RecordView, *, where: Where) -> str:
    """The message of ``UNRESOLVED_CLAIM``: the block ended without ``complete`` or
    ``mark_review``, and its record was marked ``needs_review`` (``view``)."""
    state = _state(view, None)
    step = _settle(view.identity, where)
    return f"{what}. {_named(view.identity, view.key)} {state}. {step}{_setting(where)}."


# ---------------------------------------------------------------------------- the record


def _named(ident: Identity, key: str) -> str:
    return f"Record {'/'.join(ident)} (key {key})"


def _state(view: RecordView, own: bool | None) -> str:
    """What the record says, as the end of a sentence that began with its name."""
    since = f" since {view.updated_at}" if view.updated_at else ""
    attempt = f"attempt {view.attempt}"
    if view.status == "absent":
        return "does not exist"
    if view.status == "started":
        return f"is started ({attempt}){since}, {_owner(view.owner, view.owner_alive, own)}"
    if view.status == "needs_review":
        reason = view.review_reason or "no reason given"
        return f"needs review ({attempt}){since}: {reason}"
    if view.status == "succeeded":
        return f"succeeded ({attempt}){since}"  # its receipt is not for the logs
    return f"is {view.status} ({attempt}){since}"


def _owner(owner: Owner | None, alive: bool | None, own: bool | None) -> str:
    if owner is None:
        return "its owner unknown"
    who = f"owned by pid {owner.pid} on {owner.host}"
    if own:
        return f"{who}: this very process"
    if alive is True:
        return f"{who}, which is alive"
    if alive is False:
        return f"{who}, which is gone"
    return f"{who}, which cannot be judged from here (another host, namespace or boot)"


# ---------------------------------------------------------------------------- next steps


def _code(text: str) -> str:
    """A call or a command, set apart as a person copies it: between backticks."""
    return f"`{text}`"


def _call(ident: Identity) -> str:
    return "(" + ", ".join(f'"{part}"' for part in ident) + ")"


def _show(ident: Identity, where: Where) -> str:
    if where.location is None:
        return _code(f"{where.journal}inspect({_call(ident)})")
    return _code(where.command("show", *ident))


def _settle(ident: Identity, where: Where) -> str:
    """How a person settles a record in review."""
    look = (
        f"Look at it ({_show(ident, where)}) and ask the service that was given that key "
        "whether the effect happened; then "
    )
    if where.location is None:
        happened = f'{where.journal}resolve({_call(ident)}, receipt="{_RECEIPT}", note="{_NOTE}")'
        did_not = f'{where.journal}resolve({_call(ident)}, retry=True, note="{_NOTE}")'
    else:
        happened = where.command("resolve", *ident, "--receipt", _RECEIPT, "--note", _NOTE)
        did_not = where.command("resolve", *ident, "--retry", "--note", _NOTE)
    return (
        f"{look}{_code(happened)} if it did, or {_code(did_not)} if it did not (the identity "
        "may then be claimed again)"
    )


def _to_review(ident: Identity, where: Where) -> str:
    """How a person sends a started record whose owner will not settle it to review."""
    if where.location is None:
        return _code(f'{where.journal}mark_review({_call(ident)}, reason="{_WHY}")')
    return _code(where.command("review", *ident, "--reason", _WHY))


def _list_job(ident: Identity, where: Where) -> str:
    scope, program, job, _ = ident
    if where.location is None:
        return _code(f'journal.records(scope="{scope}", program="{program}", job="{job}")')
    return _code(where.command("list", "--scope", scope, "--program", program, "--job", job))


def _started_step(view: RecordView, own: bool | None, where: Where) -> str:
    ident = view.identity
    show = _show(ident, where)
    if own:
        review = f'{where.journal}mark_review({_call(ident)}, reason="abandoned by its caller")'
        return (
            "This process holds the claim and is alive, so the claim will not end on its "
            "own: unless code of this process is still working on it, it was abandoned (a "
            "notebook cell or a call that failed between begin and complete). Send it to "
            f"review with {_code(review)}, then settle it as any record in review; {show} "
            "shows it"
        )
    if view.owner_alive is False:
        sweeping = f"{where.journal}sweep()" if where.location is None else where.command("sweep")
        sweep = _code(sweeping)
        return (
            f"Its owner is gone: {sweep} sends it to review (so does the next begin), where "
            f"a person settles it; {show} shows it"
        )
    wait = "Wait for it to end (`begin(..., wait=<seconds>)` waits), or call again later"
    if view.owner_alive is True:
        return f"{wait}; {show} shows it"
    return (
        f"{wait}; if you know its owner is gone for good, {_to_review(ident, where)} sends "
        f"it to review; {show} shows it"
    )


def _next_step(code: str, view: RecordView, own: bool | None, where: Where) -> str:
    ident, status = view.identity, view.status
    show = _show(ident, where)
    if code == "INPUT_CHANGED":
        return (
            "These inputs make other work than the record's: give that work an identity of "
            "its own (another item; `itemjournal.label(text)` makes a label of any text), "
            f"or find out why the inputs differ; {show} shows the record"
        )
    if code == "DEFINITION_CHANGED":
        if status == "succeeded":
            return (
                "If this code does other work than the code that made the record, give that "
                f"work an identity of its own; {show} shows the record"
            )
        return f"The record must be settled first. {_state_step(view, own, where)}"
    if code == "INPUT_KEY_MISMATCH":
        return (
            "Open the journal with the input key it was made with: "
            "`Journal.open(location, input_key=<the key>)`"
        )
    if code == "CLAIM_MISMATCH":
        if status == "absent":
            return (
                "This claim's record is gone (pruned?): do not declare this claim's outcome; "
                f"{_list_job(ident, where)} lists the job's records"
            )
        return (
            "This claim is not the record's claim now (the record moved on without it): do "
            f"not declare this claim's outcome; {show} shows what holds it"
        )
    if status == "absent":
        return (
            "Check the four labels: nothing was ever started under them; "
            f"{_list_job(ident, where)} lists the job's records"
        )
    return _state_step(view, own, where)


def _state_step(view: RecordView, own: bool | None, where: Where) -> str:
    """The next step for a record in its status, whatever was asked of it."""
    ident, status = view.identity, view.status
    if status == "needs_review":
        return _settle(ident, where)
    if status == "started":
        return _started_step(view, own, where)
    if status == "succeeded":
        return f"It is settled: there is nothing to do; {_show(ident, where)} shows it"
    # released: withdrawn, or resolved for a retry
    return (
        "It is settled as not done: the next begin claims it again; "
        f"{_show(ident, where)} shows its history"
    )


def _setting(where: Where) -> str:
    if where.hidden_secret:
        return (
            " (set ITEMJOURNAL_LOCATION to the journal's URL first: it holds a secret, "
            f"shown here as ***: {where.location})"
        )
    if where.keyed:
        return " (<key-file>: a file holding the journal's input key)"
    return ""
