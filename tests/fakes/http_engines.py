"""Fake vLLM engines at the HTTP level, for the proxy's tests and benchmarks.

A ``FakeEngines`` holds one Prefill and one Decode FastAPI app (serve each on as many
ports as instances are wanted; they share the object's state). They do what vLLM
engines with the rd2h connector do over HTTP: Decode derives its request ids from
``X-Request-Id`` as vLLM 0.32 does, posts its contact information to the proxy's
metaserver URL, waits until a Prefill received the dispatch (standing in for the KV),
then answers (JSON or SSE). Both apps must run on one event loop.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

HOST = "127.0.0.1"


def contact(request_id: str) -> dict[str, Any]:
    return {"request_id": request_id, "do_remote_prefill": False, "do_remote_decode": True,
            "remote_engine_id": "decode-0", "remote_host": HOST, "remote_port": 31501,
            "remote_tp_size": 1, "remote_pcp_size": 1, "remote_dcp_size": 1,
            "remote_cached_tokens": 0}


def sse(request_id: str, tokens: int = 2) -> list[str]:
    return [*(f"data: {json.dumps({'id': request_id, 'delta': chr(97 + i % 26)})}\n\n"
              for i in range(tokens)),
            "data: [DONE]\n\n"]


class FakeEngines:
    """A fake Decode and a fake Prefill engine; they share this object's event loop."""

    def __init__(self, tokens: int = 2, token_gap_s: float = 0.0) -> None:
        """``tokens``: events a streamed answer carries before ``[DONE]``; with
        ``token_gap_s``, each is sent on its own after that pause (as an engine's decode
        steps produce them), else all at once."""
        self.tokens, self.token_gap_s = tokens, token_gap_s
        self.kv: dict[str, asyncio.Event] = {}
        self.prefill_rids: list[str] = []
        self.decode_rids: list[str] = []
        self.poster: httpx.AsyncClient | None = None
        self.health_probes = 0  # /health requests answered, both apps together
        self.prefill = FastAPI()
        self.decode = FastAPI()

        async def prefill(request: Request) -> JSONResponse:
            await request.json()
            rid = request.headers["x-request-id"]
            self.prefill_rids.append(rid)
            self.kv_event(rid).set()
            return JSONResponse({"id": rid, "choices": [{"text": "p"}]})

        async def decode(request: Request) -> Any:
            body = await request.json()
            rid = request.headers["x-request-id"]
            self.decode_rids.append(rid)
            if request.url.path.endswith("/chat/completions"):
                ids = [f"chatcmpl-{rid}"]
            else:
                prompt = body["prompt"]
                ids = [f"cmpl-{rid}-{i}"
                       for i in range(len(prompt) if isinstance(prompt, list) else 1)]
            if self.poster is None:
                self.poster = httpx.AsyncClient(timeout=10.0)
            for request_id in ids:
                r = await self.poster.post(body["kv_transfer_params"]["metaserver"],
                                           json=contact(request_id))
                r.raise_for_status()
            await asyncio.wait_for(self.kv_event(rid).wait(), 30.0)
            if body.get("stream"):
                events = sse(ids[0], self.tokens)
                if not self.token_gap_s:
                    return StreamingResponse(iter(events), media_type="text/event-stream")

                async def paced() -> Any:
                    for event in events:
                        await asyncio.sleep(self.token_gap_s)
                        yield event

                return StreamingResponse(paced(), media_type="text/event-stream")
            return JSONResponse({"id": ids[0], "choices": [
                {"index": i, "text": f"decoded {i}"} for i in range(len(ids))]})

        def health() -> dict[str, Any]:
            self.health_probes += 1
            return {}

        for app, handler in ((self.prefill, prefill), (self.decode, decode)):
            app.post("/v1/completions")(handler)
            app.post("/v1/chat/completions")(handler)
            app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": "tiny"}]})
            app.get("/health")(health)

    def kv_event(self, rid: str) -> asyncio.Event:
        return self.kv.setdefault(rid, asyncio.Event())
