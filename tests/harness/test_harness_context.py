"""A session longer than the model's context budget, over real servers: session and local
sandbox servers (child processes), the scripted model server, and a harness whose context
policy has a small budget."""

from __future__ import annotations

import asyncio
from typing import Any

from harness_helpers import HarnessFactory, Peers, SessionClient, payload, wake

from oma.harness.v1 import harness_pb2, harness_pb2_grpc
from oma.runtime.client import connect
from oma.runtime.server import ServerOptions
from oma.servers.harness.app import HarnessConfig, start_harness
from oma.servers.harness.context import LogSlices, SessionSlices, SlidingWindowPolicy
from oma.servers.harness.driver import DriverConfig
from oma.servers.harness.grpc_ports import GrpcSession
from oma.servers.harness.loop import LoopConfig
from oma.servers.harness.model_server.server import start_model_server

TOOL_TURNS = 40
OUTPUT_CHARS = 600
BUDGET = 2000

SCRIPT: dict[str, Any] = {
    "name": "long",
    "turns": [
        *(
            {
                "content": [
                    {
                        "type": "tool_use",
                        "name": "bash",
                        "input": {"command": f"printf 'step {i}: %0{OUTPUT_CHARS}d\\n' {i}"},
                    }
                ]
            }
            for i in range(TOOL_TURNS)
        ),
        {"text": "All steps are done."},
    ],
}


async def test_a_session_longer_than_the_context_budget_completes(
    local_peers: Peers, local_client: SessionClient, harness_factory: HarnessFactory
) -> None:
    policy = SlidingWindowPolicy(budget_tokens=BUDGET, step_events=16)
    async with await start_model_server(SCRIPT) as model:
        config = HarnessConfig(
            session_address=local_peers.session,
            sandbox_address=local_peers.sandbox,
            token=local_peers.tokens.token_for("harness"),
            model_base_url=model.base_url,
            driver=DriverConfig(loop=LoopConfig(context=policy)),
        )
        harness = await start_harness(config, ServerOptions(tokens=local_peers.tokens))
        harness_factory.started.append(harness)
        async with connect(harness.address, token=local_peers.tokens.token_for("client")) as ch:
            caps = await harness_pb2_grpc.HarnessServiceStub(ch).GetCapabilities(
                harness_pb2.GetCapabilitiesRequest()
            )
        assert caps.server_info.limits["harness.context_budget_tokens"] == BUDGET
        session_id = await local_client.create("long", tools=("bash",))
        waiting = asyncio.create_task(local_client.wait_idle(session_id, limit_seconds=300))
        await wake(local_peers, harness.address, session_id)
        events, _ = await waiting

        # It completed, every tool call ran once with its result, and nothing was rejected:
        # each trimmed request had whole tool_use/tool_result pairs and alternating roles.
        assert payload(events, "agent.message")[-1].content[0].text == "All steps are done."
        assert payload(events, "session.status_idle")[-1].stop_reason == 1  # end_turn
        results = payload(events, "agent.tool_result")
        assert len(results) == TOOL_TURNS and not any(r.is_error for r in results)
        assert "step 39: 000" in results[-1].content[0].text
        assert model.rejections() == []
        served = model.served()
        # No turn was replayed although later requests hold fewer assistant messages.
        assert [s["turn"] for s in served] == list(range(TOOL_TURNS + 1))

    # The requests were really trimmed: bounded, far below the whole conversation, and
    # each one still opened with the task.
    assert all(s["first_user_text"].startswith(f"go ({session_id})") for s in served)
    prompts = [s["prompt_tokens"] for s in served]
    whole = sum(len(r.content[0].text) for r in results) // 4
    assert whole > 3 * BUDGET
    assert max(prompts) < 1.5 * BUDGET
    trimmed = [i for i, s in enumerate(served) if s["messages"] < 2 * i + 1]
    assert len(trimmed) > TOOL_TURNS // 2
    assert all(served[i]["chosen_by"] == "record" for i in trimmed)

    # The prompt cache: the first request is exactly the stable prefix (tools, system, task);
    # every later one reads at least that from the cache, and between the window's coarse
    # moves a request reads the whole previous request.
    usages = [end.usage for end in payload(events, "span.model_request_end")]
    assert len(usages) == len(served)
    prefix = prompts[0]
    assert usages[0].cache_read_input_tokens == 0
    assert all(u.cache_read_input_tokens >= prefix for u in usages[1:])
    moves = [
        i for i in trimmed if i > trimmed[0] and usages[i].cache_read_input_tokens < prompts[i - 1]
    ]
    extended = [
        i for i in trimmed if i > trimmed[0] and usages[i].cache_read_input_tokens >= prompts[i - 1]
    ]
    assert moves, "the window moved as the log grew"
    assert len(extended) >= 2 * len(moves), (moves, extended)

    # The policy reads positional slices: over GetEvents it builds the same request as over
    # the events in memory.
    async with connect(local_peers.session, token=local_peers.tokens.token_for("harness")) as ch:
        port = GrpcSession(ch)
        log = await port.read_events(session_id, 0)
        kwargs: dict[str, Any] = {"system": "", "tools": [], "caching": True}
        remote = await policy.build(SessionSlices(port, session_id), **kwargs)
        local = await policy.build(LogSlices(log), **kwargs)
    assert remote == local
    assert remote.omitted is not None and remote.omitted[1] > TOOL_TURNS
