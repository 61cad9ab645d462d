"""``show``: one record, its history included, found by what the operator has in hand:
its four labels, its key (the digest ``list`` and ``--json`` print) or a unique prefix of
it, or a client's ``Idempotency-Key`` (the record the ASGI middleware keeps for it)."""

from __future__ import annotations

import contextlib
import re

import click
from rich import box
from rich.table import Table
from rich.text import Text

from ..._homes.asgi.keys import DEFAULT_SCOPE, JOB, PROGRAM, MalformedKey, key_identity, parse_key
from ..._journal.journal import Journal
from ..._model.errors import InvalidArgument
from ..._model.identity import Identity, check_label
from ..._model.view import RecordView
from .errors import EXIT_OK, CommandError, _BadValue
from .options import _journal_options, _label_option, _run, _settings
from .progress import _metered
from .render import (
    _clean,
    _dumps,
    _full_json,
    _out_console,
    _owner_text,
    _Screen,
    _show_identity,
    _status_text,
    _when,
    _write,
)

MIN_PREFIX = 4  # hex digits: fewer would match most of any journal
_HEX = re.compile(rf"[0-9a-f]{{{MIN_PREFIX},64}}")
_SHOWN_MATCHES = 5


def _show_view(console: _Screen, view: RecordView) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    result = "-" if view.result is None else f"{len(view.result.encode('utf-8'))} bytes stored"
    for name, value in (
        ("identity", Text(_show_identity(view.identity))),
        ("key", Text(view.key)),
        ("status", _status_text(view.status)),
        ("attempt", Text(str(view.attempt))),
        ("receipt", Text(_clean(view.receipt) if view.receipt is not None else "-")),
        ("result", Text(result)),
        ("created", Text(_clean(view.created_at or "-"))),
        ("updated", Text(_clean(view.updated_at or "-"))),
        ("owner", Text(_owner_text(view))),
        ("review reason", Text(_clean(view.review_reason or "-"))),
    ):
        grid.add_row(name, value)
    console.print(grid)
    console.print(Text("history", style="bold"))
    history = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name in ("AT (UTC)", "EVENT", "STATUS", "ATTEMPT"):
        history.add_column(name, no_wrap=True)
    history.add_column("NOTE", overflow="fold")
    for event in view.history:
        history.add_row(
            Text(_when(event.at)),
            Text(_clean(event.event)),
            _status_text(event.status),
            Text(str(event.attempt)),
            Text(_clean(event.note or "-")),
        )
    console.print(history)


def _key_prefix(text: str) -> str:
    prefix = text.lower()
    if _HEX.fullmatch(prefix) is None:
        raise CommandError(
            "INVALID_KEY",
            f"a record's key is {MIN_PREFIX} to 64 hex digits (the start of the key list and "
            f"--json print), not {_clean(text)!r}; a record is also named by SCOPE PROGRAM "
            "JOB ITEM",
        )
    return prefix


async def _find_by_key(journal: Journal, prefix: str) -> RecordView:
    """The one record whose key begins with ``prefix``: every record is read (a key is a
    digest: nothing but the records can say which identity it is the key of)."""
    matches: list[RecordView] = []
    unreadable = 0
    async with (
        _metered(journal, "searching", None, filtered=False) as tick,
        contextlib.aclosing(journal.records(problems=True)) as items,
    ):
        async for item in items:
            tick()
            if not isinstance(item, RecordView):
                unreadable += 1
            elif item.key.startswith(prefix):
                matches.append(item)
    if len(matches) == 1:
        return matches[0]
    if matches:
        named = ", ".join(
            f"{_show_identity(view.identity)} ({view.key[:16]})"
            for view in matches[:_SHOWN_MATCHES]
        )
        more = "" if len(matches) <= _SHOWN_MATCHES else ", …"
        raise CommandError(
            "AMBIGUOUS_KEY",
            f"the key prefix {prefix} begins the keys of {len(matches)} records: {named}{more}; "
            "give more of the key",
        )
    also = f" ({unreadable} record(s) could not be read)" if unreadable else ""
    raise CommandError("NOT_FOUND", f"no record has a key beginning with {prefix}{also}")


def _labels(values: tuple[str, ...]) -> Identity:
    try:
        return Identity(
            *(
                check_label(value, name)
                for value, name in zip(values, Identity._fields, strict=True)
            )
        )
    except InvalidArgument as error:
        raise _BadValue(error.code, error.message) from None


def _of_idempotency_key(value: str, scope: str, program: str, job: str) -> Identity:
    try:
        return key_identity(parse_key(value), scope=scope, program=program, job=job)
    except MalformedKey as error:
        raise CommandError(
            "INVALID_KEY",
            f"--idempotency-key is the header's value as the client sent it, a quoted string "
            f'("...") or a token: {error}',
        ) from None


@click.command("show")
@click.argument("names", nargs=-1, metavar="[SCOPE PROGRAM JOB ITEM | KEY]")
@click.option(
    "--idempotency-key",
    "idempotency_key",
    metavar="VALUE",
    default=None,
    help="The record the ASGI middleware keeps for this Idempotency-Key (the header's value "
    "as the client sent it: a token, or a quoted string).",
)
@click.option(
    "--scope",
    "key_scope",
    metavar="VALUE",
    default=None,
    help="With --idempotency-key: the middleware's scope value (its fixed scope, or what its "
    f"scope function returned) [default: {DEFAULT_SCOPE}].",
)
@click.option(
    "--program",
    "key_program",
    callback=_label_option,
    metavar="LABEL",
    default=None,
    help=f"With --idempotency-key: the records' program label [default: {PROGRAM}].",
)
@click.option(
    "--job",
    "key_job",
    callback=_label_option,
    metavar="LABEL",
    default=None,
    help=f"With --idempotency-key: the records' job label [default: {JOB}].",
)
@click.option("--json", "as_json", is_flag=True, help="The full view as one JSON object.")
@_journal_options
@click.pass_context
def show_command(
    ctx: click.Context,
    *,
    names: tuple[str, ...],
    idempotency_key: str | None,
    key_scope: str | None,
    key_program: str | None,
    key_job: str | None,
    as_json: bool,
    location: str | None,
    input_key_file: str | None,
    trust_shared_root: bool,
) -> int:
    """Show one record, its history included.

    \b
    itemjournal show shop billing charge order-3     its four labels
    itemjournal show 5d2c1e0f9a                      its key, or a unique prefix of it
    itemjournal show --idempotency-key 8e03978e-40d5-43e8-bc93-6894a57f9324 --scope user-42

    A key or a prefix is looked for in every record (at least 4 hex digits; a prefix
    that begins more than one key is refused, AMBIGUOUS_KEY). A record that is not there
    is NOT_FOUND (exit 2).
    """
    key_options = (key_scope, key_program, key_job)
    if idempotency_key is not None:
        if names:
            raise click.UsageError("give --idempotency-key alone, without labels or a key", ctx)
    elif any(option is not None for option in key_options):
        raise click.UsageError("--scope, --program and --job go with --idempotency-key", ctx)
    elif len(names) not in (1, 4):
        raise click.UsageError(
            "name one record: SCOPE PROGRAM JOB ITEM, its KEY (or a prefix of it), or "
            f"--idempotency-key VALUE; got {len(names)} argument(s)",
            ctx,
        )
    prefix = _key_prefix(names[0]) if len(names) == 1 else None
    if idempotency_key is not None:
        identity: Identity | None = _of_idempotency_key(
            idempotency_key, key_scope or DEFAULT_SCOPE, key_program or PROGRAM, key_job or JOB
        )
        named = f"the Idempotency-Key {idempotency_key}"
    elif prefix is None:
        identity = _labels(names)
        named = _show_identity(identity)
    else:
        identity = None
        named = ""
    settings = _settings(ctx, location, input_key_file, trust_shared_root)

    async def body(journal: Journal) -> RecordView:
        if identity is None:
            assert prefix is not None
            return await _find_by_key(journal, prefix)
        return await journal.inspect(identity)

    view = _run(settings, body)
    if view.status == "absent":
        assert identity is not None
        raise CommandError(
            "NOT_FOUND",
            f"no record of {named} ({_show_identity(identity)})"
            if idempotency_key is not None
            else f"no record of {named}",
        )
    if as_json:
        _write([_dumps(_full_json(view), indent=2)])
    else:
        _show_view(_out_console(), view)
    return EXIT_OK
