"""A disaggregated-serving proxy for vLLM's own KV connectors (NixlConnector and others
that follow vLLM's "Prefill first, then Decode with the returned kv_transfer_params"
protocol), for ``serving_vs_peers.py``.

For each completion request: the Prefill engine gets the request with
``kv_transfer_params = {"do_remote_decode": true, ...}``, ``max_tokens`` 1 and no
streaming; its answer's ``kv_transfer_params`` (where Decode finds the KV) go with the
original request to the Decode engine, whose answer (streamed or not) is relayed to the
client as it comes. Both legs carry the same ``X-Request-Id``. ``/healthcheck`` answers
``{"pending": N}`` (requests in flight), as ``rd2h proxy`` does, so the benchmark checks
both the same way.

The same HTTP stack as ``rd2h proxy`` (FastAPI on uvicorn, one pooled ``httpx`` client),
so the two proxies cost the same per request.

Run:  .venv/bin/python benchmarks/nixl_proxy.py --port P --prefill URL --decode URL
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

# What the Prefill leg asks of a KV producer (vLLM's documented proxy protocol).
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                     "remote_engine_id": None, "remote_block_ids": None,
                     "remote_host": None, "remote_port": None}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request as the Prefill leg: one token, no streaming, remote decode."""
    out = copy.deepcopy(body)
    out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if out.get("min_tokens"):
        out["min_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    return out


def decode_body(body: dict[str, Any], prefill_answer: dict[str, Any]) -> dict[str, Any]:
    """The client's request as the Decode leg, with the Prefill answer's KV parameters."""
    params = prefill_answer.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise ValueError("the Prefill answer has no kv_transfer_params: is Prefill's "
                         "kv_role kv_producer with a connector that returns them?")
    out = dict(body)
    out["kv_transfer_params"] = params
    return out


def build_app(prefill: str, decode: str, timeout_s: float = 600.0) -> FastAPI:
    state: dict[str, Any] = {"pending": 0, "client": None}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
            state["client"] = client
            yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/healthcheck")
    async def healthcheck() -> dict[str, Any]:
        return {"status": "ok", "pending": state["pending"]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    async def serve(request: Request, path: str):
        body = await request.json()
        rid = uuid.uuid4().hex
        headers = {"X-Request-Id": rid, "Content-Type": "application/json"}
        client: httpx.AsyncClient = state["client"]
        state["pending"] += 1
        done = False
        try:
            r = await client.post(prefill + path, json=prefill_body(body), headers=headers)
            if r.status_code != 200:
                return JSONResponse(_error(f"prefill answered {r.status_code}: "
                                           f"{r.text[:300]}"), status_code=502)
            try:
                dbody = decode_body(body, r.json())
            except ValueError as exc:
                return JSONResponse(_error(str(exc)), status_code=502)
            req = client.build_request("POST", decode + path, json=dbody, headers=headers)
            resp = await client.send(req, stream=True)

            async def relay() -> AsyncIterator[bytes]:
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                finally:
                    await resp.aclose()
                    state["pending"] -= 1

            done = True  # the relay owns the pending count from here
            return StreamingResponse(relay(), status_code=resp.status_code,
                                     media_type=resp.headers.get("content-type"))
        except httpx.HTTPError as exc:
            return JSONResponse(_error(f"{type(exc).__name__}: {exc}"), status_code=502)
        finally:
            if not done:
                state["pending"] -= 1

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await serve(request, "/v1/chat/completions")

    return app


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "proxy_error"}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", required=True, help="the Prefill engine's base URL")
    p.add_argument("--decode", required=True, help="the Decode engine's base URL")
    p.add_argument("--timeout", type=float, default=600.0, help="per upstream call (s)")
    args = p.parse_args(argv)
    import uvicorn

    uvicorn.run(build_app(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.timeout),
                host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["PREFILL_KV_PARAMS", "build_app", "decode_body", "prefill_body"]
