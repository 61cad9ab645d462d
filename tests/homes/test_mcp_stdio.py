"""examples/agent_tool.py driven from outside: a real MCP client (the SDK's
``ClientSession`` over stdio) talks to the example server in a subprocess, and the
ledger the tool appends to counts the effects."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.types import CallToolResult, TextContent

import itemjournal
from itemjournal import Identity, Journal

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"
TOOL = "send_invoice"


class Agent:
    """Starts the example server as a client does, and reads its ledger."""

    def __init__(self, location: str, ledger: Path) -> None:
        self.location = location
        self.ledger = ledger

    def env(self, effect_seconds: float = 0) -> dict[str, str]:
        return {
            **os.environ,
            "ITEMJOURNAL_LOCATION": self.location,
            "LEDGER": str(self.ledger),
            "EFFECT_SECONDS": str(effect_seconds),
        }

    @asynccontextmanager
    async def conversation(self, effect_seconds: float = 0) -> AsyncIterator[ClientSession]:
        server = StdioServerParameters(
            command=sys.executable,
            args=[str(EXAMPLES / "agent_tool.py")],
            env=self.env(effect_seconds),
        )
        with open(os.devnull, "w") as errlog:
            async with (
                stdio_client(server, errlog=errlog) as (read, write),
                ClientSession(read, write) as session,
            ):
                await session.initialize()
                yield session

    def effects(self) -> list[str]:
        if not self.ledger.exists():
            return []
        return [line for line in self.ledger.read_text().splitlines() if line.strip()]


@pytest.fixture
async def agent(location: str, tmp_path: Path) -> Agent:
    # The journal exists before the first server opens it (as a deployment's would).
    journal = await Journal.open(location)
    await journal.aclose()
    return Agent(location, tmp_path / "ledger.txt")


def text(result: CallToolResult) -> str:
    return "".join(block.text for block in result.content if isinstance(block, TextContent))


def replayed(result: CallToolResult) -> bool:
    assert result.meta is not None
    return bool(result.meta["itemjournal"].get("replay"))


def content(result: CallToolResult) -> bytes:
    dumped = result.model_dump(mode="json", by_alias=True, exclude_none=True)
    return json.dumps([dumped["content"], dumped.get("structuredContent")]).encode()


INVOICE: dict[str, Any] = {"customer": "acme", "amount_cents": 1250, "idempotency_key": "i-1"}
IDENTITY = Identity("invoices", "mcp", TOOL, "k.i-1")


async def test_the_same_call_five_times_is_one_effect(agent: Agent) -> None:
    results = []
    for _ in range(3):  # a retry within one conversation
        async with agent.conversation() as session:
            results.append(await session.call_tool(TOOL, INVOICE))
            if len(results) == 3:
                results.append(await session.call_tool(TOOL, INVOICE))
                results.append(await session.call_tool(TOOL, INVOICE))
    assert len(results) == 5
    effects = agent.effects()
    assert len(effects) == 1
    async with await Journal.open(agent.location) as journal:
        key = (await journal.inspect(IDENTITY)).key
    assert effects == [f"acme 1250 {key}"]
    assert [replayed(r) for r in results] == [False, True, True, True, True]
    assert {content(r) for r in results} == {content(results[0])}
    assert json.loads(text(results[0])) == {"invoice": "inv_" + key[:16]}
    assert not any(r.is_error for r in results)


async def test_a_server_killed_during_the_effect_is_never_run_again(agent: Agent) -> None:
    """The effect waits EFFECT_SECONDS, then appends its line: a server killed during the
    wait sent nothing, and its call is still never run again until a person (here, the
    example's check, which finds no line) settles it."""
    async with await Journal.open(agent.location) as journal:
        with pytest.raises(Exception):  # noqa: B017 - the transport fails as it may
            async with agent.conversation(effect_seconds=60) as session:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(session.call_tool, TOOL, INVOICE)
                    with anyio.fail_after(30):
                        # Claimed: the effect has begun its wait; no line yet.
                        while (await journal.inspect(IDENTITY)).status != "started":  # noqa: ASYNC110
                            await anyio.sleep(0.05)
                    await anyio.sleep(0.5)  # well inside the wait
                    view = await journal.inspect(IDENTITY)
                    assert view.status == "started"
                    assert view.owner is not None
                    assert agent.effects() == []
                    os.kill(view.owner.pid, signal.SIGKILL)
                    with anyio.fail_after(30):
                        while (await journal.inspect(IDENTITY)).owner_alive:  # noqa: ASYNC110
                            await anyio.sleep(0.05)
                    tg.cancel_scope.cancel()
                raise RuntimeError("the server is gone")
        assert agent.effects() == []  # killed before its line: nothing was sent
        assert not agent.ledger.exists()

        async with agent.conversation() as session:  # restarted; the agent repeats the call
            repeated = await session.call_tool(TOOL, INVOICE)
            again = await session.call_tool(TOOL, INVOICE)
        assert agent.effects() == []  # no second effect: the retry did not run it
        view = await journal.inspect(IDENTITY)
        assert view.status == "needs_review"
        for result in (repeated, again):
            assert result.is_error
            words = text(result)
            assert words.startswith("Outcome unknown:")
            assert "not with this idempotency key and not with a new one" in words
            assert "A person will check what happened" in words
            assert view.key in words

        settle = await anyio.run_process(
            [
                sys.executable,
                "-m",
                "itemjournal",
                "reconcile",
                "--check",
                "agent_tool:what_happened",
                "--yes",
                "--json",
            ],
            env={**agent.env(), "PYTHONPATH": str(EXAMPLES)},
            check=False,
        )
        assert settle.returncode == 0, settle.stderr.decode()
        assert json.loads(settle.stdout)["counts"]["did_not_happen"] == 1
        assert (await journal.inspect(IDENTITY)).status == "released"

        async with agent.conversation() as session:  # released: now it runs, once
            sent = await session.call_tool(TOOL, INVOICE)
            replay = await session.call_tool(TOOL, INVOICE)
        assert not sent.is_error
        assert not replayed(sent)
        assert replayed(replay)
        assert json.loads(text(sent)) == {"invoice": "inv_" + view.key[:16]}
        assert agent.effects() == [f"acme 1250 {view.key}"]


async def test_the_ledger_line_comes_after_the_effect_seconds(agent: Agent) -> None:
    """The contract of the example: EFFECT_SECONDS of delay, then the line."""
    async with agent.conversation(effect_seconds=1.5) as session:
        began = anyio.current_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(session.call_tool, TOOL, INVOICE)
            with anyio.fail_after(30):
                while not agent.effects():  # noqa: ASYNC110 - another process writes it
                    await anyio.sleep(0.02)
            assert anyio.current_time() - began >= 1.5
    assert len(agent.effects()) == 1


@pytest.mark.skipif(
    not hasattr(itemjournal, "Withdraw"), reason="itemjournal.Withdraw is not in this tree"
)
async def test_a_refused_call_leaves_its_key_free(agent: Agent) -> None:
    wrong = {**INVOICE, "amount_cents": -5}
    async with agent.conversation() as session:
        refused = await session.call_tool(TOOL, wrong)
        assert refused.is_error
        assert text(refused).startswith("Not done: the tool refused before doing anything")
        assert agent.effects() == []
        fixed = await session.call_tool(TOOL, INVOICE)
        again = await session.call_tool(TOOL, INVOICE)
    assert not fixed.is_error
    assert replayed(again)
    assert len(agent.effects()) == 1


async def test_two_servers_on_one_journal_run_one_effect(agent: Agent) -> None:
    results: list[CallToolResult] = []

    async def call() -> None:
        async with agent.conversation(effect_seconds=2) as session:
            results.append(await session.call_tool(TOOL, INVOICE))

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        tg.start_soon(call)
    assert len(agent.effects()) == 1
    assert sorted(replayed(r) for r in results) == [False, True]
    assert content(results[0]) == content(results[1])


async def test_changed_arguments_under_one_key_are_refused(agent: Agent) -> None:
    async with agent.conversation() as session:
        first = await session.call_tool(TOOL, INVOICE)
        changed = await session.call_tool(TOOL, {**INVOICE, "amount_cents": 9999})
    assert not first.is_error
    assert changed.is_error
    assert "already used for a call with different arguments" in text(changed)
    assert len(agent.effects()) == 1
