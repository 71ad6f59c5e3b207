"""``benchmarks/nixl_proxy.py``, the proxy that ``serving_vs_peers.py`` puts in front of
vLLM's own connectors, over real HTTP: stand-in Prefill and Decode servers (uvicorn)
record what each leg receives and answer as vLLM does (Prefill: JSON with
``kv_transfer_params``; Decode: server-sent events)."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import nixl_proxy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

KV = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [[3, 4]],
      "remote_host": "127.0.0.1", "remote_port": 5600, "remote_request_id": "r1"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _serve(app: FastAPI):
    port = _port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(10)


def _engines(seen: dict, prefill_status: int = 200, kv: dict | None = KV):
    prefill, decode = FastAPI(), FastAPI()

    @prefill.post("/v1/completions")
    async def p(request: Request):
        seen["prefill"] = (await request.json(), request.headers.get("x-request-id"))
        if prefill_status != 200:
            return JSONResponse({"error": "boom"}, status_code=prefill_status)
        body = {"choices": [{"text": "w5"}]}
        if kv is not None:
            body["kv_transfer_params"] = kv
        return body

    @decode.post("/v1/completions")
    async def d(request: Request):
        seen["decode"] = (await request.json(), request.headers.get("x-request-id"))

        async def events():
            for word in ("w5", " w6", " w7"):
                yield f"data: {json.dumps({'choices': [{'text': word}]})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return prefill, decode


@contextlib.contextmanager
def _cluster(seen: dict, **kw):
    prefill, decode = _engines(seen, **kw)
    with _serve(prefill) as p, _serve(decode) as d, \
            _serve(nixl_proxy.build_app(p, d, timeout_s=10)) as proxy:
        yield proxy


def test_prefill_first_then_decode_with_the_returned_kv_params() -> None:
    seen: dict = {}
    client = {"model": "m", "prompt": "w3 w4", "max_tokens": 3, "stream": True,
              "stream_options": {"include_usage": True}, "ignore_eos": True}
    with _cluster(seen) as proxy, httpx.stream("POST", proxy + "/v1/completions",
                                               json=client, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = b"".join(r.iter_raw()).decode()
        pending = httpx.get(proxy + "/healthcheck").json()["pending"]
    assert text.count("data: ") == 4 and text.endswith("data: [DONE]\n\n")
    pbody, prid = seen["prefill"]
    dbody, drid = seen["decode"]
    assert pbody["max_tokens"] == 1 and pbody["stream"] is False
    assert "stream_options" not in pbody
    assert pbody["kv_transfer_params"] == nixl_proxy.PREFILL_KV_PARAMS
    assert pbody["prompt"] == "w3 w4" and pbody["ignore_eos"] is True
    assert dbody == {**client, "kv_transfer_params": KV}
    assert prid == drid and len(prid) == 32
    assert pending == 0


@pytest.mark.parametrize(("kw", "says"), [({"prefill_status": 500}, "prefill answered 500"),
                                          ({"kv": None}, "no kv_transfer_params")])
def test_a_prefill_leg_that_fails_is_a_502_and_decode_is_not_asked(kw, says) -> None:
    seen: dict = {}
    with _cluster(seen, **kw) as proxy:
        r = httpx.post(proxy + "/v1/completions", json={"model": "m", "prompt": "w3"},
                       timeout=10)
        pending = httpx.get(proxy + "/healthcheck").json()["pending"]
    assert r.status_code == 502 and says in r.json()["error"]["message"]
    assert "decode" not in seen and pending == 0


def test_the_prefill_body_keeps_the_client_request_unchanged() -> None:
    body = {"prompt": "x", "max_tokens": 9, "min_tokens": 4, "stream": True,
            "kv_transfer_params": {"old": 1}}
    out = nixl_proxy.prefill_body(body)
    assert out["max_tokens"] == 1 and out["min_tokens"] == 1 and out["stream"] is False
    assert body == {"prompt": "x", "max_tokens": 9, "min_tokens": 4, "stream": True,
                    "kv_transfer_params": {"old": 1}}
    with pytest.raises(ValueError, match="kv_transfer_params"):
        nixl_proxy.decode_body(body, {"choices": []})
