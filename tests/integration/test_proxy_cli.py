"""``rd2h proxy`` as a real process between fake engines served by uvicorn on loopback.

The fake Decode engine does what a vLLM Decode engine with the rd2h connector does
at the HTTP level: it derives its request ids from ``X-Request-Id`` as vLLM 0.32
does, posts its contact information to the metaserver URL in
``kv_transfer_params`` with rd2h's ``MetaserverClient``, waits until the fake
Prefill engine received the dispatch for that request (standing in for the KV
arriving), then answers. The fake Prefill engine records what it was sent.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import uvicorn
from fakes.net import free_port
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from rd2h.adapters.http.metaserver import MetaserverClient
from rd2h.adapters.logging import make_logger

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
D_PORT = 31500  # the Decode control port the fake advertises (nothing binds it)


class ThreadServer:
    """uvicorn serving ``app`` on a pre-bound loopback socket in a daemon thread."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 10.0
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            threading.Event().wait(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10.0)
        self.sock.close()


class FakePrefill:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.received: list[tuple[str, dict, dict]] = []
        self.events: dict[str, threading.Event] = {}
        self.app = FastAPI()

        async def handle(request: Request) -> JSONResponse:
            body = await request.json()
            rid = request.headers["x-request-id"]
            with self.lock:
                self.received.append((request.url.path, dict(request.headers), body))
            self.event(rid).set()
            return JSONResponse({"id": rid, "choices": [{"text": "p"}]})

        self.app.post("/v1/completions")(handle)
        self.app.post("/v1/chat/completions")(handle)
        self.app.get("/health")(lambda: {})

    def event(self, rid: str) -> threading.Event:
        with self.lock:
            return self.events.setdefault(rid, threading.Event())


def contact(request_id: str) -> dict[str, Any]:
    return {"request_id": request_id, "do_remote_prefill": False, "do_remote_decode": True,
            "remote_engine_id": "decode-0", "remote_host": "127.0.0.1", "remote_port": D_PORT,
            "remote_tp_size": 1, "remote_pcp_size": 1, "remote_dcp_size": 1,
            "remote_cached_tokens": 0}


class FakeDecode:
    def __init__(self, prefill: FakePrefill) -> None:
        self.received: list[tuple[str, dict, dict]] = []
        self.poster = MetaserverClient(timeout_s=5.0, retry_delay_s=0.2,
                                       log=make_logger("fake-decode", 0))
        self.app = FastAPI()

        async def handle(request: Request) -> Any:
            body = await request.json()
            self.received.append((request.url.path, dict(request.headers), body))
            rid = request.headers["x-request-id"]
            params = body["kv_transfer_params"]
            assert params["do_remote_prefill"] is True
            if request.url.path.endswith("/chat/completions"):
                ids = [f"chatcmpl-{rid}"]
            else:
                prompt = body["prompt"]
                n = len(prompt) if isinstance(prompt, list) else 1
                ids = [f"cmpl-{rid}-{i}" for i in range(n)]
            for request_id in ids:
                self.poster.post(request_id, params["metaserver"], contact(request_id))
            got_kv = await anyio.to_thread.run_sync(prefill.event(rid).wait, 10.0)
            if not got_kv:
                return JSONResponse({"error": {"message": "KV never came"}}, status_code=500)
            if body.get("stream"):
                return StreamingResponse(iter(sse(ids[0])), media_type="text/event-stream")
            return JSONResponse({"id": ids[0], "choices": [
                {"index": i, "text": f"decoded {i}"} for i in range(len(ids))]})

        self.app.post("/v1/completions")(handle)
        self.app.post("/v1/chat/completions")(handle)
        self.app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": "decode-model"}]})
        self.app.get("/health")(lambda: {})


def sse(request_id: str) -> list[str]:
    return [*(f"data: {json.dumps({'id': request_id, 'delta': t})}\n\n" for t in ("a", "b")),
            "data: [DONE]\n\n"]




@pytest.fixture
def engines():
    prefill = FakePrefill()
    decode = FakeDecode(prefill)
    servers = [ThreadServer(prefill.app), ThreadServer(decode.app)]
    for s in servers:
        s.start()
    yield prefill, decode, servers[0].url, servers[1].url
    assert decode.poster.shutdown(5.0)
    for s in servers:
        s.stop()


def test_rd2h_proxy_process_routes_through_decode_and_prefill(engines, tmp_path: Path) -> None:
    prefill, decode, p_url, d_url = engines
    port = free_port()
    proxy_url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "proxy.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rd2h", "proxy", "--host", "127.0.0.1", "--port", str(port),
         "--prefill", p_url, "--decode", d_url, "--decode-timeout", "30",
         "--prefill-timeout", "30", "--log-level", "INFO"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        with httpx.Client(base_url=proxy_url, timeout=30.0) as client:
            deadline = time.monotonic() + 30.0
            while True:
                assert proc.poll() is None, (tmp_path / "proxy.log").read_text()
                try:
                    health = client.get("/healthcheck").json()
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, "proxy did not come up"
                    threading.Event().wait(0.1)
            assert health["prefill"] == [p_url] and health["decode"] == [d_url]
            assert health["metaserver"] == f"{proxy_url}/v1/metaserver"

            # One prompt, plain JSON answer.
            r = client.post("/v1/completions",
                            json={"model": "m", "prompt": "hello", "max_tokens": 8})
            assert r.status_code == 200, r.text
            rid = r.headers["x-request-id"]
            assert r.json() == {"id": f"cmpl-{rid}-0",
                                "choices": [{"index": 0, "text": "decoded 0"}]}
            _, d_headers, d_body = decode.received[-1]
            assert d_headers["x-request-id"] == rid
            trace = d_headers["traceparent"]
            assert d_body["kv_transfer_params"] == {
                "do_remote_prefill": True, "metaserver": f"{proxy_url}/v1/metaserver",
                "traceparent": trace}
            [(p_path, p_headers, p_body)] = [x for x in prefill.received
                                             if x[1]["x-request-id"] == rid]
            assert p_path == "/v1/completions" and p_headers["traceparent"] == trace
            assert p_body == {"model": "m", "prompt": "hello", "max_tokens": 1,
                              "stream": False, "kv_transfer_params": {
                                  **contact(f"cmpl-{rid}-0"), "traceparent": trace}}

            # Chat, streamed back unchanged.
            with client.stream("POST", "/v1/chat/completions", json={
                    "model": "m", "stream": True,
                    "messages": [{"role": "user", "content": "hi"}]}) as r:
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                text = "".join(r.iter_text())
                rid = r.headers["x-request-id"]
            assert text == "".join(sse(f"chatcmpl-{rid}"))
            [(_, _, p_body)] = [x for x in prefill.received if x[1]["x-request-id"] == rid]
            assert p_body["max_completion_tokens"] == 1 and p_body["stream"] is False

            # A prompt list: Prefill gets the list once, with every child's params.
            r = client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b", "c"]})
            assert r.status_code == 200 and len(r.json()["choices"]) == 3
            rid = r.headers["x-request-id"]
            [(_, p_headers, p_body)] = [x for x in prefill.received
                                        if x[1]["x-request-id"] == rid]
            ids = [f"cmpl-{rid}-{i}" for i in range(3)]
            assert p_body["prompt"] == ["a", "b", "c"]
            assert p_body["kv_transfer_params"] == {
                "do_remote_decode": True,
                "batch_kv_transfer_params": {i: contact(i) for i in ids},
                "traceparent": p_headers["traceparent"]}

            # Unknown metaserver ids are refused; nothing is left pending.
            r = client.post("/v1/metaserver", json=contact(f"cmpl-{'0' * 32}-0"))
            assert r.status_code == 404
            health = client.get("/healthcheck").json()
            assert health["pending"] == 0
            assert health["counters"]["prefill_ok"] == 3
            assert decode.poster.stats().delivered == 5

            # The engines' model list, and the proxy's own Prometheus series.
            r = client.get("/v1/models")
            assert r.status_code == 200 and r.json()["data"] == [{"id": "decode-model"}]
            r = client.get("/metrics")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            for line in ('rd2h_proxy_requests_total{endpoint="/v1/completions",outcome="ok"} 2.0',
                         'rd2h_proxy_requests_total{endpoint="/v1/chat/completions",'
                         'outcome="ok"} 1.0',
                         'rd2h_proxy_requests_total{endpoint="/v1/models",outcome="ok"} 1.0',
                         'rd2h_proxy_metaserver_posts_total{status="unknown"} 1.0',
                         'rd2h_proxy_prefill_dispatches_total{outcome="ok"} 3.0',
                         "rd2h_proxy_prefill_leg_seconds_count{outcome=\"ok\"} 3.0",
                         "rd2h_proxy_pending_rendezvous 0.0"):
                assert line in r.text.splitlines(), (line, r.text)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(15.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5.0)
            raise
        finally:
            log.close()
    output = (tmp_path / "proxy.log").read_text()
    assert rc in (0, -signal.SIGTERM), output  # uvicorn re-raises SIGTERM after its shutdown
    assert "Application shutdown complete" in output, output
    assert "client disconnected" not in output, output
    assert "Traceback" not in output, output


def test_rd2h_proxy_rejects_bad_flags_up_front() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rd2h", "proxy", "--prefill", "127.0.0.1:8100",
         "--decode", "http://127.0.0.1:8200"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "prefill URL '127.0.0.1:8100' must look like http://HOST:PORT" in proc.stderr
