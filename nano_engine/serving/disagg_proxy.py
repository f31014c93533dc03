"""The front of disaggregated serving: each request goes to the prefill server first, with
max_tokens=1 (it computes the prompt, and its KV connector saves the prompt's KV), then, as it came,
to the decode server (whose connector loads that KV, kv_transfer.py), whose answer the client gets,
streamed or not. After vLLM's `examples/online_serving/disaggregated_serving/` proxies and
`benchmarks/disagg_benchmarks/disagg_prefill_proxy_server.py`.

    python -m nano_engine serve --port 8100 --kv-transfer-config '{"kv_role": "kv_producer", ...}'
    python -m nano_engine serve --port 8200 --kv-transfer-config '{"kv_role": "kv_consumer", ...}'
    python -m nano_engine disagg-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

A prefill server's error is the client's answer (the decode server is not asked); the API key the
client sends goes to both servers.
"""

from __future__ import annotations

import contextlib

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

ROUTES = ("/v1/completions", "/v1/chat/completions")


def build_proxy(prefill_url: str, decode_url: str, timeout_s: float = 600.0) -> FastAPI:
    client = httpx.AsyncClient(timeout=timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()

    app = FastAPI(title="nano_engine disaggregated-serving proxy", lifespan=lifespan)

    def headers(request: Request) -> dict:
        auth = request.headers.get("authorization")
        return {"authorization": auth} if auth else {}

    async def forward(request: Request, path: str):
        body = await request.json()
        prefill = {**body, "max_tokens": 1, "stream": False, "n": 1}
        prefill.pop("stream_options", None)
        if "max_completion_tokens" in prefill:
            prefill["max_completion_tokens"] = 1
        first = await client.post(prefill_url + path, json=prefill, headers=headers(request))
        if first.status_code != 200:
            return Response(first.content, first.status_code, media_type=first.headers.get("content-type"))
        if not body.get("stream"):
            out = await client.post(decode_url + path, json=body, headers=headers(request))
            return Response(out.content, out.status_code, media_type=out.headers.get("content-type"))
        req = client.build_request("POST", decode_url + path, json=body, headers=headers(request))
        out = await client.send(req, stream=True)
        if out.status_code != 200:
            content = await out.aread()
            await out.aclose()
            return Response(content, out.status_code, media_type=out.headers.get("content-type"))

        async def pieces():
            try:
                async for chunk in out.aiter_raw():
                    yield chunk
            finally:
                await out.aclose()
        return StreamingResponse(pieces(), media_type="text/event-stream")

    def route(path: str):
        async def handler(request: Request):
            return await forward(request, path)
        return handler

    for path in ROUTES:
        app.add_api_route(path, route(path), methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request):
        out = await client.get(decode_url + "/v1/models", headers=headers(request))
        return Response(out.content, out.status_code, media_type=out.headers.get("content-type"))

    @app.get("/health")
    async def health():
        codes = []
        for url in (prefill_url, decode_url):
            try:
                codes.append((await client.get(url + "/health")).status_code)
            except httpx.HTTPError:
                codes.append(503)
        ok = all(c == 200 for c in codes)
        return JSONResponse({"prefill": codes[0], "decode": codes[1]}, status_code=200 if ok else 503)

    return app
