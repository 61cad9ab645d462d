"""``itemjournal.mcp.effect_once`` given arguments the journal cannot record: a key that
is not Unicode text, a NaN among the arguments. Each answers with a tool error saying
nothing ran, and nothing ran; nothing escapes as a bare exception."""

from __future__ import annotations

import json
from typing import Any

import pytest
from mcp.types import CallToolResult, TextContent

from itemjournal import Journal
from itemjournal.mcp import effect_once

pytestmark = pytest.mark.anyio


class Tool:
    """An effect-once ``send`` tool (of any arguments) that counts its effect's runs."""

    def __init__(self, journal: Journal) -> None:
        self.runs: list[dict[str, Any]] = []

        @effect_once(journal, scope="agent", definition="send-v1")
        async def send(to: str, detail: Any = None, idempotency_key: Any = None) -> str:
            self.runs.append({"to": to, "detail": detail})
            return "sent"

        self.send = send
        self.effect = effect_once(journal, scope="agent", definition="send-v1")


def text(result: CallToolResult) -> str:
    return "".join(block.text for block in result.content if isinstance(block, TextContent))


async def records(journal: Journal) -> list[str]:
    return [view.identity.item async for view in journal.records()]


def refused_unrun(result: CallToolResult) -> None:
    assert result.is_error
    said = text(result)
    assert said.startswith("Refused: ")
    assert "did not run" in said
    assert "nothing was done" in said
    assert result.meta is not None
    assert result.meta["itemjournal"]["outcome"] == "not_done"
    json.dumps(result.model_dump(mode="json", by_alias=True))  # it reaches the client


async def test_a_lone_surrogate_key_is_a_tool_error_and_nothing_runs(journal: Journal) -> None:
    tool = Tool(journal)
    key = json.loads('"\\ud800"')  # valid JSON, not Unicode text
    result = await tool.send("ann", idempotency_key=key)
    refused_unrun(result)
    assert "idempotency_key" in text(result)
    assert tool.runs == []
    assert await records(journal) == []
    # A surrogate inside a longer key too, and in the low-level server's ``call``.
    refused_unrun(await tool.send("ann", idempotency_key="order-\udfff-7"))
    ran: list[int] = []

    async def run() -> str:
        ran.append(1)
        return "sent"

    refused_unrun(await tool.effect.call("send", {"to": "ann", "idempotency_key": key}, run))
    assert ran == []
    assert tool.runs == []
    assert await records(journal) == []


async def test_a_lone_surrogate_in_an_argument_is_a_tool_error(journal: Journal) -> None:
    tool = Tool(journal)
    refused_unrun(await tool.send("ann\ud800", idempotency_key="k-1"))
    refused_unrun(await tool.send("ann", detail={"note": "\udc80"}))  # no key: fingerprinted
    assert tool.runs == []
    assert await records(journal) == []


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
async def test_a_nan_in_the_arguments_is_a_tool_error(journal: Journal, value: float) -> None:
    tool = Tool(journal)
    refused_unrun(await tool.send("ann", detail=value, idempotency_key="k-2"))
    refused_unrun(await tool.send("ann", detail={"amounts": [1.5, value]}))  # no key
    assert tool.runs == []
    assert await records(journal) == []
    # The same call with a number JSON can carry runs, once.
    first = await tool.send("ann", detail=1.5, idempotency_key="k-2")
    again = await tool.send("ann", detail=1.5, idempotency_key="k-2")
    assert not first.is_error
    assert not again.is_error
    assert len(tool.runs) == 1
