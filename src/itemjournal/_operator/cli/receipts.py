"""The receipt file of a bulk ``resolve --receipt-from``: its two line forms, its
limits, and why a file is refused whole when one line is bad."""

from __future__ import annotations

import json
import sys

from ..._model.errors import InvalidArgument
from ..._model.identity import Identity, check_label
from ..._model.records import receipt_problem
from .errors import CommandError
from .render import _show_identity

_MAX_RECEIPT_FILE_BYTES = 64 * 1024 * 1024


def _read_receipts(path: str) -> dict[Identity, str]:
    """Receipts for a bulk decision, one record a line.

    A line is either ``SCOPE PROGRAM JOB ITEM RECEIPT`` (whitespace between the labels;
    the receipt is the rest of the line, its outer whitespace dropped) or a JSON object
    ``{"identity": [scope, program, job, item], "receipt": "..."}``. Blank lines and lines
    starting with ``#`` are skipped. ``-`` reads standard input. Any bad line refuses the
    whole file, and an identity may appear once.
    """

    def bad(number: int, why: str) -> CommandError:
        return CommandError("INVALID_RECEIPT_FILE", f"{path} line {number}: {why}")

    try:
        if path == "-":
            data = sys.stdin.buffer.read(_MAX_RECEIPT_FILE_BYTES + 1)
        else:
            with open(path, "rb") as file:
                data = file.read(_MAX_RECEIPT_FILE_BYTES + 1)
    except OSError as error:
        raise CommandError(
            "INVALID_RECEIPT_FILE", f"cannot read the receipt file {path}: {error.strerror}"
        ) from None
    if len(data) > _MAX_RECEIPT_FILE_BYTES:
        raise CommandError("INVALID_RECEIPT_FILE", f"the receipt file {path} is too large")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CommandError(
            "INVALID_RECEIPT_FILE", f"the receipt file {path} is not UTF-8 ({error.reason})"
        ) from None
    receipts: dict[Identity, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("{"):
            try:
                entry = json.loads(line)
            except ValueError as error:
                raise bad(number, f"not a JSON object ({error})") from None
            if not isinstance(entry, dict) or set(entry) != {"identity", "receipt"}:
                raise bad(number, 'a JSON line has exactly the keys "identity" and "receipt"')
            labels, receipt = entry["identity"], entry["receipt"]
            if not isinstance(labels, list) or len(labels) != 4:
                raise bad(number, '"identity" is a list of four labels')
        else:
            fields = line.split(maxsplit=4)
            if len(fields) != 5:
                raise bad(number, "expected SCOPE PROGRAM JOB ITEM RECEIPT")
            labels, receipt = fields[:4], fields[4].strip()
        try:
            identity = Identity(
                *(
                    check_label(label, name)
                    for label, name in zip(labels, Identity._fields, strict=True)
                )
            )
        except InvalidArgument as error:
            raise bad(number, f"{error.code}: {error.message}") from None
        problem = receipt_problem(receipt)
        if problem is not None:
            raise bad(number, f"INVALID_RECEIPT: {problem}")
        if identity in receipts:
            raise bad(number, f"{_show_identity(identity)} appears more than once")
        receipts[identity] = receipt
    if not receipts:
        raise CommandError("INVALID_RECEIPT_FILE", f"the receipt file {path} names no record")
    return receipts
