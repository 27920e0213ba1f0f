"""The tool's proxy between vLLM's client and the servers it measures.

Every leg goes through it, so its hop is in every mode's figures. With a
prefill server it routes as a prefill/decode deployment does: the prompt
to prefill with ``do_remote_decode`` and one token, then to decode with
the ``kv_transfer_params`` prefill returned, as `serve.Phase` says.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

from vllm_kvfill_patch.fidelity.serve import Phase

PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What asks a NIXL prefill server to keep the prompt's KV for a decode
node instead of decoding it."""
ONE_TOKEN_ANSWER = (
    b'data: {"choices":[{"index":0,"text":" ","finish_reason":"length"}]}\n\n'
    b"data: [DONE]\n\n"
)


@dataclass
class Routes:
    """Where requests go, and what the ahead phase prefilled."""

    decode: str
    prefill: str | None
    phase: Phase = Phase.DECODE
    ahead: dict[str, list[dict]] = field(default_factory=dict)
    """Transfer parameters by prompt, in the order they were prefilled: a
    prompt sent twice (vLLM's client's ready check, where a user asks for
    it, sends the first one again) is read twice."""
    counts: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("ahead", "replayed", "inline", "refused", "passed"), 0
        )
    )


NAME = "X-Request-Id"
ROUTES = web.AppKey("routes", Routes)
SESSION = web.AppKey("session", ClientSession)


async def prefill(session: ClientSession, routes: Routes, body: dict) -> dict:
    """The prompt prefilled on the prefill server; its transfer parameters."""
    assert routes.prefill is not None
    request = prefill_request(body)
    async with session.post(f"{routes.prefill}/v1/completions", json=request) as reply:
        reply.raise_for_status()
        answer = await reply.json()
    params = answer.get("kv_transfer_params")
    if not params:
        raise web.HTTPBadGateway(text="prefill returned no kv_transfer_params")
    return params


def prompt_key(body: dict) -> str:
    """What the ahead phase keeps a prompt's transfer parameters under: the
    decode phase's client sends the same prompt (same seed)."""
    return json.dumps(body.get("prompt"), sort_keys=True)


def prefill_request(body: dict) -> dict:
    """`body` as the prefill server takes it: one token, not streamed, its
    KV kept for a decode node."""
    request = {**body, "stream": False, "max_tokens": 1}
    request["kv_transfer_params"] = dict(PREFILL_PARAMS)
    request.pop("stream_options", None)
    request.pop("min_tokens", None)
    return request


async def completions(request: web.Request) -> web.StreamResponse:
    routes: Routes = request.app[ROUTES]
    session: ClientSession = request.app[SESSION]
    body = await request.json()
    if routes.prefill is not None:
        waiting = routes.ahead.setdefault(prompt_key(body), [])
        if routes.phase is Phase.AHEAD:
            waiting.append(await prefill(session, routes, body))
            routes.counts["ahead"] += 1
            return web.Response(body=ONE_TOKEN_ANSWER, content_type="text/event-stream")
        if routes.phase is Phase.REPLAY and not waiting:
            routes.counts["refused"] += 1
            raise web.HTTPBadGateway(text="not prefilled ahead, and prefill is paused")
        routes.counts["replayed" if waiting else "inline"] += 1
        body["kv_transfer_params"] = (
            waiting.pop(0) if waiting else await prefill(session, routes, body)
        )
    else:
        routes.counts["passed"] += 1
    return await relay(request, session, f"{routes.decode}/v1/completions", body)


async def relay(
    request: web.Request, session: ClientSession, url: str, body: dict
) -> web.StreamResponse:
    """`body` sent to `url` under the request's name (``X-Request-Id``, which
    vLLM keeps in its request id), its answer streamed back as it comes."""
    named = {NAME: request.headers[NAME]} if NAME in request.headers else None
    async with session.post(url, json=body, headers=named) as upstream:
        response = web.StreamResponse(status=upstream.status)
        response.content_type = upstream.content_type
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


async def health(request: web.Request) -> web.Response:
    """200 when every server behind the proxy answers its own /health."""
    routes: Routes = request.app[ROUTES]
    session: ClientSession = request.app[SESSION]
    for base in filter(None, (routes.decode, routes.prefill)):
        try:
            async with session.get(f"{base}/health") as reply:
                if reply.status != 200:
                    return web.Response(status=503, text=f"{base}: {reply.status}")
        except OSError as error:  # not up yet: the tool polls again
            return web.Response(status=503, text=f"{base}: {error}")
    return web.Response(text="ok")


async def phase(request: web.Request) -> web.Response:
    routes: Routes = request.app[ROUTES]
    routes.phase = Phase((await request.json())["phase"])
    return web.json_response({"phase": routes.phase.value, "held": held(routes)})


async def stats(request: web.Request) -> web.Response:
    routes: Routes = request.app[ROUTES]
    return web.json_response({**routes.counts, "held": held(routes)})


def held(routes: Routes) -> int:
    """Prompts prefilled ahead and not yet replayed."""
    return sum(map(len, routes.ahead.values()))


def application(routes: Routes) -> web.Application:
    app = web.Application(client_max_size=64 << 20)
    app[ROUTES] = routes

    async def open_session(app: web.Application) -> AsyncIterator[None]:
        # A connection per request: uvicorn closes a keep-alive connection
        # idle for 5 s, and one reused as it closes fails its request
        # ("Server disconnected"). On loopback a connection costs well
        # under a millisecond, in every mode's hop alike.
        app[SESSION] = ClientSession(
            timeout=ClientTimeout(total=None),
            connector=TCPConnector(force_close=True),
        )
        yield
        await app[SESSION].close()

    app.cleanup_ctx.append(open_session)
    app.add_routes(
        [
            web.post("/v1/completions", completions),
            web.get("/health", health),
            web.post("/phase", phase),
            web.get("/stats", stats),
        ]
    )
    return app


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_kvfill_patch.fidelity.proxy",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--port", type=int, required=True, help="where it listens")
    parser.add_argument("--decode", required=True, help="the decode server's URL")
    parser.add_argument(
        "--prefill", help="the prefill server's URL (none: every request to decode)"
    )
    args = parser.parse_args()
    web.run_app(
        application(Routes(args.decode, args.prefill)),
        host="127.0.0.1",
        port=args.port,
        print=None,
    )


if __name__ == "__main__":
    main()
