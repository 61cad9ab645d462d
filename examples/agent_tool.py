"""An MCP server (stdio) with one effect-once tool: ``send_invoice``.

An agent may call ``send_invoice`` again and again (a retry after a lost answer, a
conversation resumed after a crash, a second server process): the invoice is sent once,
and every repeat gets the first answer back, marked as a replay. Run it under an MCP
client, with the environment it reads:

    ITEMJOURNAL_LOCATION=/var/lib/agent/journal LEDGER=/var/lib/agent/ledger.txt \\
        python examples/agent_tool.py

* ``ITEMJOURNAL_LOCATION``: the journal (a directory, ``sqlite:///…`` or
  ``postgresql://…``), shared by every process of the server;
* ``LEDGER``: the stand-in for the invoicing service, a text file with one line per
  invoice sent: ``<customer> <amount_cents> <claim key>``, appended and fsynced; an
  invoice is sent when, and only when, its line is there;
* ``EFFECT_SECONDS`` (default 0): how long sending takes: the effect waits this long,
  then appends its line, then the tool answers; a server killed during the wait has
  sent nothing (no line), and its call is uncertain all the same (it needs review).

``what_happened`` is the check that settles an uncertain call from the ledger:

    PYTHONPATH=examples itemjournal reconcile --check agent_tool:what_happened --yes
"""

from __future__ import annotations

import os

import anyio
from mcp.server.mcpserver import MCPServer

import itemjournal
from itemjournal import DidNotHappen, Happened, Journal, RecordView, Unknown
from itemjournal.mcp import current_claim, effect_once, stored_result

server = MCPServer("invoices")
_opened: list[Journal] = []
_opening = anyio.Lock()


async def journal() -> Journal:
    """The journal, opened at the first call and kept for the life of the process."""
    async with _opening:
        if not _opened:
            _opened.append(await Journal.open(os.environ["ITEMJOURNAL_LOCATION"]))
    return _opened[0]


def invoice_id(key: str) -> str:
    """The invoicing service's id for the invoice sent under ``key``."""
    return "inv_" + key[:16]


def _append(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as ledger:
        ledger.write(line + "\n")
        ledger.flush()
        os.fsync(ledger.fileno())


@server.tool()
@effect_once(journal, scope="invoices", definition="send-invoice-v1")
async def send_invoice(
    customer: str, amount_cents: int, idempotency_key: str | None = None
) -> dict[str, str]:
    """Send an invoice of ``amount_cents`` to ``customer``. Give an idempotency_key to
    make two identical invoices on purpose; repeats of one call send nothing more."""
    if amount_cents <= 0:
        raise itemjournal.Withdraw(f"amount_cents must be positive, not {amount_cents}")
    key = current_claim().key
    # Sending takes EFFECT_SECONDS; the invoice is out once its line is in the ledger.
    await anyio.sleep(float(os.environ.get("EFFECT_SECONDS", "0")))
    await anyio.to_thread.run_sync(
        _append, os.environ["LEDGER"], f"{customer} {amount_cents} {key}"
    )
    return {"invoice": invoice_id(key)}


def _ledger_keys(path: str) -> set[str]:
    try:
        with open(path, encoding="utf-8") as ledger:
            return {line.split()[-1] for line in ledger if line.strip()}
    except FileNotFoundError:
        return set()


async def what_happened(view: RecordView) -> Happened | DidNotHappen | Unknown:
    """Settle an uncertain ``send_invoice`` from the ledger, with the answer it gives."""
    if view.identity[:3] != ("invoices", "mcp", "send_invoice"):
        return Unknown("not a send_invoice call")
    keys = await anyio.to_thread.run_sync(_ledger_keys, os.environ["LEDGER"])
    if view.key in keys:
        invoice = invoice_id(view.key)
        return Happened(
            invoice,
            result=stored_result({"invoice": invoice}),
            note=f"invoice {invoice} is in the ledger",
        )
    return DidNotHappen(f"no invoice under the key {view.key} in the ledger")


if __name__ == "__main__":
    server.run()
