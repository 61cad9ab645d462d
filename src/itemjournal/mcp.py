"""Tools of an MCP server whose effect happens once: across retries, restarts and
conversations.

An agent retries a tool call when its result is late, ambiguous or lost, and a
conversation resumed after a crash replays its last step. ``effect_once`` puts a journal
record before the tool's effect, keeps its answer for replay, and answers "a person must
look" instead of running an uncertain action a second time. It is built on the official
Python SDK (``mcp`` 2.3 or later, the ``mcp`` extra; in it ``FastMCP`` is ``MCPServer``)
and works with its ``MCPServer``::

    from mcp.server.mcpserver import MCPServer
    from itemjournal.mcp import current_claim, effect_once

    server = MCPServer("billing")

    @server.tool()
    @effect_once(journal, scope="billing-agent", definition="send-invoice-v1")
    async def send_invoice(customer: str, amount_cents: int,
                           idempotency_key: str | None = None) -> dict[str, str]:
        invoice = await provider.invoice(customer, amount_cents, key=current_claim().key)
        return {"invoice": invoice.id}

The identity of a call is ``(scope, program, tool name, item)``: ``program`` is ``"mcp"``
unless given, the tool name is the function's (``name=`` when the server registers it
under another), and the item is ``itemjournal.label("k." + key)`` for a text value of
the ``key_argument`` (``idempotency_key`` by default): ``k.<key>`` itself when that is a
label, otherwise its readable start and its digest (a value that is not text:
``label("kj." + its JSON)``), or ``a.<fingerprint>`` when the tool declares no such
argument or the call leaves it out: the SHA-256 of the arguments' canonical JSON (sorted
keys, compact, UTF-8), so the same arguments are the same call. ``identity=`` is a
function ``(tool name, arguments) -> identity`` for any other choice (``itemjournal.label``
turns any text into a label).

The record's inputs are the arguments without the key argument (and without the
server's ``Context`` parameter), when they fit the journal's input rules (at most 20
keys, each a label, values ``str`` of at most 20,000 characters, ``int``, ``bool`` or
``None``); otherwise a single input ``arguments``, their fingerprint. The definition is
``definition=`` (a version string such as ``"send-invoice-v1"``, a digest or a callable),
by default the tool function's source.

What a call answers, as a ``CallToolResult``:

* a fresh claim: the tool runs, and its answer is stored and returned. The answer is
  text (a ``str``), JSON (a dict, a list, a number, a pydantic model: its JSON text, and
  a dict also as structured content) or a ``CallToolResult`` of text blocks. Its
  ``_meta["itemjournal"]`` says ``{"replay": false, "key": ...}``.
* the same call again (a retry, a resumed conversation, another server process): the
  stored answer, content byte for byte the same, with ``_meta["itemjournal"]`` saying
  ``{"replay": true, ...}``; the tool does not run.
* the same key with other arguments: a tool error (``isError``) saying so; nothing runs.
* in progress elsewhere: the call waits up to ``wait`` seconds (10 by default) for it to
  settle and answers as above; still running then, a tool error saying to call again
  with the same key in about ``retry_after`` seconds.
* uncertain (the server died during the effect, or the tool raised after it began): a
  tool error telling the model the outcome is unknown, not to retry under a new key, and
  that a person will settle it, with the record's key (``RecordView.key``, the
  ``current_claim().key`` the tool was given) and its identity for ``itemjournal show``.
* the tool raised ``itemjournal.Withdraw`` (nothing was sent): the claim is withdrawn,
  and a tool error says nothing was done and the call may be corrected and made again.
* arguments that cannot be recorded (text that is not Unicode, such as the lone
  surrogate a JSON ``"\\ud800"`` escape makes; NaN or an infinity; a value with no JSON
  form): a tool error naming the argument and saying nothing was done; nothing is
  claimed, nothing runs, and ``_meta["itemjournal"]`` carries no key (there is no record).

The receipt of a call is ``sha256:`` and the SHA-256 of its stored answer. An answer
that cannot be stored for replay (not text or JSON, over 64 KiB) leaves the
record ``needs_review``: the effect may have happened. ``stored_result(value)`` gives the
stored form of an answer, for a reconciliation check that settles a call with the
answer the tool would have given (``Happened(receipt, result=stored_result(...))``).

For a low-level ``Server``, call ``await effect_once(...).call(name, arguments, run,
definition_of=...)`` from its tool handler: ``run`` is an async function of no arguments
that performs the effect.
"""

from ._homes.mcp.answers import FORMAT, stored_result
from ._homes.mcp.tool import EffectOnce, current_claim, effect_once

__all__ = ["FORMAT", "EffectOnce", "current_claim", "effect_once", "stored_result"]
