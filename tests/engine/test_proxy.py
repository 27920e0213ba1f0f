"""The fidelity tool's proxy (`fidelity.proxy`) in front of a prefill and a
decode server, in each of its phases (`serve.Phase`): what it sends where,
and what it refuses. The servers are stubs that record what they were sent;
the proxy is the real aiohttp application, run in vLLM's environment (it
ships aiohttp). The proxy between real NIXL servers: tests/engine/test_node.py."""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from vllm_kvfill_patch.fidelity.proxy import Routes, application
from vllm_kvfill_patch.fidelity.serve import Phase

PARAMS = {"remote_engine_id": "prefill", "remote_block_ids": [[1, 2]]}


def stub_servers(sent: list[tuple[str, dict]]) -> web.Application:
    """A prefill server under /prefill and a decode server under /decode."""

    async def prefill(request: web.Request) -> web.Response:
        sent.append(("prefill", await request.json()))
        return web.json_response({"kv_transfer_params": PARAMS})

    async def decode(request: web.Request) -> web.Response:
        sent.append(("decode", await request.json()))
        return web.Response(body=b"data: [DONE]\n\n", content_type="text/event-stream")

    app = web.Application()
    app.add_routes(
        [
            web.post("/prefill/v1/completions", prefill),
            web.post("/decode/v1/completions", decode),
        ]
    )
    return app


async def phases(sent: list[tuple[str, dict]]) -> dict[str, object]:
    async with TestServer(stub_servers(sent)) as stubs:
        base = str(stubs.make_url("")).rstrip("/")
        routes = Routes(f"{base}/decode", f"{base}/prefill")
        async with TestClient(TestServer(application(routes))) as proxy:

            async def ask(phase: Phase, prompt: str) -> int:
                await proxy.post("/phase", json={"phase": phase.value})
                body = {"prompt": prompt, "max_tokens": 4, "stream": True}
                reply = await proxy.post("/v1/completions", json=body)
                await reply.read()
                return reply.status

            statuses = [
                await ask(Phase.AHEAD, "a"),
                await ask(Phase.REPLAY, "a"),
                await ask(Phase.REPLAY, "b"),
                await ask(Phase.DECODE, "b"),
            ]
            stats = await (await proxy.get("/stats")).json()
    return {"statuses": statuses, "stats": stats}


def test_a_replay_decodes_what_was_prefilled_ahead_and_refuses_the_rest():
    sent: list[tuple[str, dict]] = []
    found = asyncio.run(phases(sent))
    assert found["statuses"] == [200, 200, 502, 200]
    assert [(server, body["prompt"]) for server, body in sent] == [
        ("prefill", "a"),  # ahead
        ("decode", "a"),  # replayed
        ("prefill", "b"),  # in the decode phase, inline
        ("decode", "b"),
    ]
    ahead, replayed = sent[0][1], sent[1][1]
    assert ahead["max_tokens"] == 1 and ahead["kv_transfer_params"]["do_remote_decode"]
    assert replayed["kv_transfer_params"] == PARAMS and replayed["max_tokens"] == 4
    assert found["stats"] == {
        "ahead": 1,
        "replayed": 1,
        "inline": 1,
        "refused": 1,
        "passed": 0,
        "held": 0,
    }
