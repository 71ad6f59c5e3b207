"""Fail fast when Prefill cannot serve a request (issue 21, part 1), over real sockets.

``rd2h proxy`` runs under uvicorn on loopback. A stand-in Decode engine (FastAPI under
uvicorn) does what Decode's connector does at the HTTP level: it posts its contact
information with the real ``MetaserverClient`` and waits for its KV; here it waits for
``take_failed()`` to name the request, which is what the Decode scheduler polls each
step. The Prefill instances refuse connections, answer 500, or die mid-request. The
proxy's ``POST /v1/metaserver/watch`` must tell Decode within a second of the proxy
giving up, not at Decode's KV deadline.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from fakes.logs import RecordingLogger
from fakes.net import free_port
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rd2h.adapters.http.metaserver import MetaserverClient
from rd2h.proxy.service import ProxyConfig, create_app

pytestmark = pytest.mark.integration

HOST = "127.0.0.1"
KV_DEADLINE_S = 20.0  # the stand-in Decode's own deadline: the slow path being removed


class Served:
    """A FastAPI app under uvicorn on its own thread and event loop."""

    def __init__(self, app: Any, port: int) -> None:
        self.port = port
        self.server = uvicorn.Server(uvicorn.Config(app, host=HOST, port=port,
                                                    log_config=None, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def decode_app(client: MetaserverClient, engine: str, kv: set[str]) -> FastAPI:
    """One scheduler takes every failure in the real connector; here each request's
    thread takes them into one shared table and looks for its own."""
    app = FastAPI()
    app.get("/health")(lambda: {})
    seen: dict[str, str] = {}
    lock = threading.Lock()

    @app.post("/v1/completions")
    def complete(request: Request, body: dict) -> JSONResponse:  # sync: runs in a thread
        rid = request.headers["x-request-id"]
        ext = f"cmpl-{rid}-0"
        posted = time.monotonic()
        client.post(ext, body["kv_transfer_params"]["metaserver"], {
            "request_id": ext, "do_remote_prefill": False, "do_remote_decode": True,
            "remote_engine_id": engine, "remote_host": HOST, "remote_port": 31999,
            "remote_tp_size": 1, "remote_pcp_size": 1, "remote_dcp_size": 1,
            "remote_cached_tokens": 0})
        while time.monotonic() - posted < KV_DEADLINE_S:
            if rid in kv:  # Prefill got the dispatch: stands for the KV arriving
                return JSONResponse({"ok": True, "after_s": time.monotonic() - posted})
            with lock:
                seen.update(client.take_failed())
                reason = seen.pop(ext, None)
            if reason is not None:
                return JSONResponse({"failed_after_s": time.monotonic() - posted,
                                     "reason": reason}, status_code=503)
            time.sleep(0.002)  # vLLM's engine loop steps about every millisecond
        return JSONResponse({"failed_after_s": KV_DEADLINE_S, "reason": "deadline"},
                            status_code=504)

    return app


def prefill_app(status: int, kv: set[str] | None = None) -> FastAPI:
    app = FastAPI()
    app.get("/health")(lambda: {})

    @app.post("/v1/completions")
    async def complete(request: Request) -> JSONResponse:
        if status == 200 and kv is not None:
            kv.add(request.headers["x-request-id"])
            return JSONResponse({"choices": [{"text": "x"}]})
        return JSONResponse({"error": {"message": "engine dead"}}, status_code=status)

    return app


class DyingPrefill:
    """Accepts a connection, reads the request, then closes it unanswered (a SIGKILLed
    engine mid-request)."""

    def __init__(self) -> None:
        self.sock = socket.create_server((HOST, 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.recv(65536)
            time.sleep(0.2)  # some forward ran
            conn.close()

    def stop(self) -> None:
        self.sock.close()


@pytest.fixture
def deployment() -> Iterator[Any]:
    made: list[Any] = []

    def make(prefill_urls: list[str], kv: set[str] | None = None
             ) -> tuple[str, MetaserverClient, RecordingLogger]:
        client = MetaserverClient(timeout_s=2.0, retry_delay_s=0.2, watch_wait_s=2.0)
        made.append(client)
        d = Served(decode_app(client, "decode-a", kv if kv is not None else set()),
                   free_port())
        made.append(d)
        port = free_port()
        log = RecordingLogger()
        # Decode, told at once, answers a failed Prefill leg itself (what is tested here).
        config = ProxyConfig(prefill=prefill_urls, decode=[d.url],
                             public_url=f"http://{HOST}:{port}", connect_timeout_s=2.0,
                             on_prefill_failure="decode")
        made.append(Served(create_app(config, log=log), port))
        return f"http://{HOST}:{port}", client, log

    yield make
    for thing in reversed(made):
        if isinstance(thing, MetaserverClient):
            thing.shutdown(5)
        else:
            thing.stop()


def _ask(proxy: str, n: int = 3) -> list[dict]:
    async def one(c: httpx.AsyncClient, i: int) -> dict:
        started = time.monotonic()
        r = await c.post(f"{proxy}/v1/completions",
                         json={"model": "m", "prompt": f"hello {i}", "max_tokens": 4})
        return {"status": r.status_code, "seconds": time.monotonic() - started,
                **r.json()}

    async def main() -> list[dict]:
        async with httpx.AsyncClient(timeout=30) as c:
            return await asyncio.gather(*(one(c, i) for i in range(n)))

    return asyncio.run(main())


def _check_fast(answers: list[dict], needle: str) -> None:
    for a in answers:
        assert a["status"] == 503, a  # the stand-in's "failed fast" answer
        assert needle in a["reason"], a
        assert a["failed_after_s"] < 1.0, a  # was KV_DEADLINE_S (request_s) before


def test_refusing_prefills_fail_decode_at_once(deployment) -> None:
    proxy, client, log = deployment([f"http://{HOST}:{free_port()}",
                                     f"http://{HOST}:{free_port()}"])
    answers = _ask(proxy)
    _check_fast(answers, "prefill dispatch failed")
    assert any("gave up" in e for e, _ in log.at("error"))
    assert client.watcher is not None and client.watcher.watched == 0


def test_a_prefill_answering_500_fails_decode_at_once(deployment) -> None:
    p = Served(prefill_app(500), free_port())
    try:
        proxy, *_ = deployment([p.url])
        _check_fast(_ask(proxy), "HTTP 500")
    finally:
        p.stop()


def test_a_prefill_dying_mid_request_fails_decode_at_once(deployment) -> None:
    dying = DyingPrefill()
    try:
        proxy, *_ = deployment([f"http://{HOST}:{dying.port}"])
        answers = _ask(proxy, n=2)
        _check_fast(answers, "prefill dispatch failed")
    finally:
        dying.stop()


def test_requests_that_succeed_are_never_reported(deployment) -> None:
    kv: set[str] = set()
    p = Served(prefill_app(200, kv), free_port())
    try:
        proxy, client, _ = deployment([p.url], kv)
        answers = _ask(proxy, n=4)
        assert all(a["status"] == 200 and a["ok"] for a in answers), answers
        time.sleep(0.5)
        assert client.take_failed() == {}
        # A post for a request the proxy does not know is answered 404: not watched.
        ext = "cmpl-" + "ab" * 16 + "-0"
        client.post(ext, f"{proxy}/v1/metaserver", {"request_id": ext,
                                                     "remote_engine_id": "decode-a"})
        assert client.drain(5)
        assert client.take_failed() == {}
    finally:
        p.stop()


def test_a_proxy_without_the_watch_endpoint_is_not_asked_again(deployment) -> None:
    old = FastAPI()  # an older proxy: the metaserver, no watch

    @old.post("/v1/metaserver")
    async def post() -> JSONResponse:
        return JSONResponse({"status": "dispatched"})

    server = Served(old, free_port())
    client = MetaserverClient(timeout_s=2.0, retry_delay_s=0.2, watch_wait_s=2.0)
    try:
        for i in range(3):
            client.post(f"r{i}", f"{server.url}/v1/metaserver",
                        {"request_id": f"r{i}", "remote_engine_id": "decode-a"})
            assert client.drain(5)
        deadline = time.monotonic() + 5
        while client.watcher is not None and client.watcher.watched:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert client.watcher is not None and client.watcher.polls == 1
    finally:
        client.shutdown(5)
        server.stop()
