"""``itemjournal.mcp.effect_once``, in process: the identity of a call, its replay, and
the tool errors a model reads, on every store."""

from __future__ import annotations

import json
from typing import Any

import anyio.lowlevel
import pytest
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import CallToolResult, ImageContent, TextContent

import itemjournal
from itemjournal import Happened, Identity, InvalidArgument, Journal, RecordView
from itemjournal.mcp import FORMAT, current_claim, effect_once, stored_result

pytestmark = pytest.mark.anyio


class Tool:
    """An effect-once ``send`` tool that counts how often its effect really ran."""

    def __init__(self, journal: Journal, **options: Any) -> None:
        self.runs: list[tuple[str, int, str]] = []
        self.fail: BaseException | None = None
        self.answer: object = None

        @effect_once(journal, scope="agent", definition="send-v1", **options)
        async def send(to: str, cents: int, idempotency_key: str | None = None) -> object:
            self.runs.append((to, cents, current_claim().key))
            if self.fail is not None:
                raise self.fail
            return self.answer if self.answer is not None else {"sent": f"{to}:{cents}"}

        self.send = send


def text(result: CallToolResult) -> str:
    assert all(isinstance(block, TextContent) for block in result.content)
    return "".join(block.text for block in result.content if isinstance(block, TextContent))


def meta(result: CallToolResult) -> dict[str, Any]:
    assert result.meta is not None
    value = result.meta["itemjournal"]
    assert isinstance(value, dict)
    return value


def wire(result: CallToolResult) -> bytes:
    """The content as a client receives it, byte for byte."""
    dumped = result.model_dump(mode="json", by_alias=True, exclude_none=True)
    return json.dumps([dumped["content"], dumped.get("structuredContent")]).encode()


# ---------------------------------------------------------------- replay


async def test_the_same_call_five_times_runs_once_and_replays_four(journal: Journal) -> None:
    tool = Tool(journal)
    results = [await tool.send("ann", 500, idempotency_key="inv-1") for _ in range(5)]
    assert len(tool.runs) == 1
    assert [meta(r)["replay"] for r in results] == [False, True, True, True, True]
    assert {wire(r) for r in results} == {wire(results[0])}
    assert text(results[0]) == '{"sent": "ann:500"}'
    assert results[0].structured_content == {"sent": "ann:500"}
    assert not any(r.is_error for r in results)
    key = tool.runs[0][2]
    assert {meta(r)["key"] for r in results} == {key}
    view = await journal.inspect(("agent", "mcp", "send", "k.inv-1"))
    assert view.status == "succeeded"
    assert view.key == key


async def test_without_a_key_the_arguments_are_the_identity(journal: Journal) -> None:
    tool = Tool(journal)
    first = await tool.send("ann", 500)
    again = await tool.send(cents=500, to="ann")  # the same arguments, another order
    other = await tool.send("ann", 501)
    assert len(tool.runs) == 2
    assert (meta(first)["replay"], meta(again)["replay"], meta(other)["replay"]) == (
        False,
        True,
        False,
    )
    items = [view.identity.item async for view in journal.records(scope="agent")]
    assert len(items) == 2
    assert all(item.startswith("a.") and len(item) == 66 for item in items)


async def test_a_key_that_is_not_a_label_is_hashed(journal: Journal) -> None:
    tool = Tool(journal)
    await tool.send("ann", 500, idempotency_key="order 7 / ann")
    await tool.send("ann", 500, idempotency_key="order 7 / ann")
    assert len(tool.runs) == 1
    [view] = [view async for view in journal.records(scope="agent")]
    assert view.identity.item == itemjournal.label("k.order 7 / ann")
    assert view.identity.item.startswith("k.order-7-ann_")


async def test_the_key_argument_and_the_identity_are_configurable(journal: Journal) -> None:
    runs: list[str] = []

    @effect_once(journal, scope="agent", key_argument="request_id", definition="v1")
    async def book(room: str, request_id: str) -> str:
        runs.append(room)
        return f"booked {room}"

    assert text(await book("r1", request_id="q1")) == "booked r1"
    assert meta(await book("r1", request_id="q1"))["replay"] is True
    assert (await journal.inspect(("agent", "mcp", "book", "k.q1"))).status == "succeeded"

    @effect_once(
        journal,
        scope="agent",
        definition="v1",
        identity=lambda name, args: ("agent", "rooms", name, args["room"]),
    )
    async def hold(room: str, minutes: int) -> str:
        runs.append(room)
        return "held"

    await hold("r2", 5)
    changed = await hold("r2", 10)
    assert changed.is_error
    assert runs == ["r1", "r2"]
    assert (await journal.inspect(("agent", "rooms", "hold", "r2"))).status == "succeeded"


async def test_arguments_beyond_the_input_rules_are_fingerprinted(journal: Journal) -> None:
    runs: list[list[str]] = []

    @effect_once(journal, scope="agent", definition="v1")
    async def notify(people: list[str], ratio: float, idempotency_key: str) -> str:
        runs.append(people)
        return "ok"

    assert not (await notify(["a", "b"], 0.5, idempotency_key="n1")).is_error
    assert meta(await notify(["a", "b"], 0.5, idempotency_key="n1"))["replay"] is True
    changed = await notify(["a", "c"], 0.5, idempotency_key="n1")
    assert changed.is_error
    assert "different arguments" in text(changed)
    assert runs == [["a", "b"]]


# ---------------------------------------------------------------- refusals


async def test_the_same_key_with_other_arguments_is_a_tool_error(journal: Journal) -> None:
    tool = Tool(journal)
    await tool.send("ann", 500, idempotency_key="inv-1")
    refused = await tool.send("ann", 900, idempotency_key="inv-1")
    assert refused.is_error
    assert len(tool.runs) == 1
    assert text(refused) == (
        "Refused: this idempotency key was already used for a call with different "
        "arguments, so the tool did not run and nothing was done. If you meant that "
        "earlier action, repeat it with exactly its original arguments to get its result. "
        "If this is a new, separate action, call again with a new idempotency key."
    )
    assert meta(refused)["key"] == tool.runs[0][2]


async def test_a_tool_that_raises_leaves_an_uncertain_outcome(journal: Journal) -> None:
    tool = Tool(journal)
    tool.fail = TimeoutError("the provider did not answer")
    first = await tool.send("ann", 500, idempotency_key="inv-2")
    tool.fail = None
    again = await tool.send("ann", 500, idempotency_key="inv-2")
    assert len(tool.runs) == 1
    ident = Identity("agent", "mcp", "send", "k.inv-2")
    view = await journal.inspect(ident)
    assert view.status == "needs_review"
    for result in (first, again):
        assert result.is_error
        words = text(result)
        assert words.startswith("Outcome unknown: this action began but did not finish cleanly")
        assert "may or may not have taken effect" in words
        assert "Do not retry it, not with this idempotency key and not with a new one" in words
        assert "A person will check what happened and settle it" in words
        assert view.key in words
        assert "record agent mcp send k.inv-2" in words  # what `itemjournal show` takes
        assert meta(result) == {"key": view.key, "outcome": "unknown"}
    assert "(the tool failed after it began)" in text(first)


async def test_a_call_in_progress_elsewhere_waits_then_says_when_to_retry(
    journal: Journal,
) -> None:
    tool = Tool(journal, wait=0.05, retry_after=3)
    ident = Identity("agent", "mcp", "send", "k.inv-3")
    # Another server holds the claim (its owner is alive: this very process).
    digest = itemjournal.definition_digest("send-v1")
    held = await journal.begin(ident, {"to": "ann", "cents": 500}, digest)
    busy = await tool.send("ann", 500, idempotency_key="inv-3")
    assert busy.is_error
    assert tool.runs == []
    assert text(busy) == (
        "Not finished yet: this action is still running in another call after waiting "
        "0.05 seconds, so it was not started again. Call again with the same arguments "
        "and the same idempotency key in about 3 seconds to get its result. Do not use a "
        "new idempotency key: that would do the action a second time."
    )
    assert meta(busy)["retry_after_seconds"] == 3
    assert isinstance(held, itemjournal.Claim)
    await journal.complete(held, "sent", result=stored_result({"sent": "ann:500"}))
    done = await tool.send("ann", 500, idempotency_key="inv-3")
    assert meta(done)["replay"] is True
    assert text(done) == '{"sent": "ann:500"}'
    assert tool.runs == []


async def test_a_changed_definition_is_refused_without_running(journal: Journal) -> None:
    tool = Tool(journal)
    await tool.send("ann", 500, idempotency_key="inv-4")
    runs: list[str] = []

    @effect_once(journal, scope="agent", definition="send-v2")
    async def send(to: str, cents: int, idempotency_key: str | None = None) -> str:
        runs.append(to)
        return "sent"

    refused = await send("ann", 500, idempotency_key="inv-4")
    assert refused.is_error
    assert runs == []
    assert "the tool has changed since this action was first done" in text(refused)
    assert "Do not retry under a new key" in text(refused)


async def test_an_answer_that_cannot_be_kept_needs_review(journal: Journal) -> None:
    tool = Tool(journal)
    tool.answer = CallToolResult(content=[ImageContent(data="AAAA", mime_type="image/png")])
    result = await tool.send("ann", 500, idempotency_key="inv-5")
    assert len(tool.runs) == 1
    assert result.is_error
    assert "(its answer could not be kept)" in text(result)
    view = await journal.inspect(("agent", "mcp", "send", "k.inv-5"))
    assert view.status == "needs_review"
    assert "cannot be replayed" in (view.review_reason or "")


@pytest.mark.skipif(
    not hasattr(itemjournal, "Withdraw"), reason="itemjournal.Withdraw is not in this tree"
)
async def test_a_withdrawn_call_leaves_its_key_free(journal: Journal) -> None:
    tool = Tool(journal)
    tool.fail = itemjournal.Withdraw("cents must be positive")  # type: ignore[attr-defined,unused-ignore]
    refused = await tool.send("ann", 500, idempotency_key="inv-6")
    assert refused.is_error
    assert text(refused).startswith("Not done: the tool refused before doing anything")
    assert "cents must be positive" in text(refused)
    view = await journal.inspect(("agent", "mcp", "send", "k.inv-6"))
    assert view.status == "released"
    tool.fail = None
    fixed = await tool.send("ann", 500, idempotency_key="inv-6")
    assert not fixed.is_error
    assert len(tool.runs) == 2  # the withdrawn run sent nothing; the corrected one ran


# ---------------------------------------------------------------- settling and the server


async def test_a_reconciled_call_replays_the_answer_the_check_gave(journal: Journal) -> None:
    tool = Tool(journal)
    tool.fail = RuntimeError("lost")
    await tool.send("ann", 500, idempotency_key="inv-7")
    tool.fail = None

    async def check(view: RecordView) -> Happened:
        return Happened("sent-1", result=stored_result({"sent": "ann:500"}))

    report = await journal.reconcile(check, scope="agent")
    assert report.counts()["happened"] == 1
    replayed = await tool.send("ann", 500, idempotency_key="inv-7")
    assert meta(replayed)["replay"] is True
    assert meta(replayed)["receipt"] == "sent-1"
    assert text(replayed) == '{"sent": "ann:500"}'
    assert len(tool.runs) == 1


async def test_a_plain_result_and_a_receipt_alone_are_replayed_as_text(journal: Journal) -> None:
    tool = Tool(journal)
    for item, result in (("k.p1", "sent to ann"), ("k.p2", None)):
        ident = Identity("agent", "mcp", "send", item)
        claim = await journal.begin(
            ident, {"to": "ann", "cents": 1}, itemjournal.definition_digest("send-v1")
        )
        assert isinstance(claim, itemjournal.Claim)
        await journal.complete(claim, "r-1", result=result)
    assert text(await tool.send("ann", 1, idempotency_key="p1")) == "sent to ann"
    alone = await tool.send("ann", 1, idempotency_key="p2")
    assert not alone.is_error
    assert "already done (its receipt: r-1)" in text(alone)
    assert tool.runs == []


def test_stored_result_forms() -> None:
    assert json.loads(stored_result("hi")) == {"format": FORMAT, "text": ["hi"]}
    assert json.loads(stored_result([1, 2])) == {"format": FORMAT, "text": ["[1, 2]"]}
    block = CallToolResult(
        content=[TextContent(type="text", text="a")], structured_content={"b": 1}
    )
    assert json.loads(stored_result(block)) == {
        "format": FORMAT,
        "text": ["a"],
        "structured": {"b": 1},
    }
    with pytest.raises(InvalidArgument):
        stored_result(CallToolResult(content=[], is_error=True))
    with pytest.raises(InvalidArgument):
        stored_result(float("nan"))
    with pytest.raises(InvalidArgument):
        stored_result(object())
    with pytest.raises(InvalidArgument):
        stored_result("x" * 70_000)


def test_current_claim_outside_a_tool() -> None:
    with pytest.raises(InvalidArgument) as caught:
        current_claim()
    assert caught.value.code == "INVALID_CLAIM"


def test_bad_options_are_refused_when_made() -> None:
    with pytest.raises(InvalidArgument):
        effect_once(object(), scope="agent")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        effect_once(lambda: None, scope="not a label")  # type: ignore[arg-type,return-value]
    with pytest.raises(InvalidArgument):
        effect_once(lambda: None, scope="agent", retry_after=0)  # type: ignore[arg-type,return-value]


async def test_registered_on_an_mcp_server_with_a_context(journal: Journal) -> None:
    server = MCPServer("test")
    seen: list[str] = []

    @server.tool()
    @effect_once(journal, scope="agent", definition="v1")
    async def file_ticket(title: str, ctx: Context) -> dict[str, str]:
        seen.append(title)
        return {"ticket": "T-1"}

    [listed] = await server.list_tools()
    assert set(listed.input_schema["properties"]) == {"title"}
    first = await server.call_tool("file_ticket", {"title": "printer"})
    second = await server.call_tool("file_ticket", {"title": "printer"})
    assert isinstance(first, CallToolResult)
    assert isinstance(second, CallToolResult)
    assert seen == ["printer"]
    assert meta(second)["replay"] is True
    assert wire(first) == wire(second)


def test_the_core_does_not_import_the_sdk() -> None:
    import subprocess
    import sys

    script = "import sys, itemjournal; print(' '.join(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    imported = {name.split(".")[0] for name in done.stdout.split()}
    assert imported.isdisjoint({"mcp", "mcp_types", "pydantic", "pydantic_core"})


async def test_call_serves_a_low_level_handler(journal: Journal) -> None:
    runs: list[dict[str, Any]] = []
    once = effect_once(journal, scope="agent", definition="send-v1")

    async def handler(name: str, arguments: dict[str, Any]) -> CallToolResult:
        async def run() -> str:
            runs.append(arguments)
            return f"sent under {current_claim().key}"

        return await once.call(name, arguments, run)

    first = await handler("send", {"to": "ann", "idempotency_key": "low-1"})
    again = await handler("send", {"to": "ann", "idempotency_key": "low-1"})
    assert runs == [{"to": "ann", "idempotency_key": "low-1"}]
    assert text(first) == text(again) == f"sent under {meta(first)['key']}"
    assert meta(again)["replay"] is True
    view = await journal.inspect(("agent", "mcp", "send", "k.low-1"))
    assert view.status == "succeeded"

    bare = effect_once(journal, scope="agent")
    with pytest.raises(InvalidArgument) as caught:
        await bare.call("send", {}, anyio.lowlevel.checkpoint)
    assert "needs definition=" in str(caught.value)
    assert len([view async for view in journal.records(scope="agent")]) == 1
