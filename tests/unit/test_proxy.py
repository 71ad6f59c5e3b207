"""``rd2h proxy`` app against fake Prefill/Decode engines, all in memory (ASGI, no sockets).

The fake Decode engine behaves like vLLM with the rd2h connector from the proxy's
point of view: it builds its request ids from ``X-Request-Id`` as vLLM 0.32 does
(``cmpl-<rid>-<i>`` per prompt, ``chatcmpl-<rid>``), posts each one's contact
information to the metaserver URL it was given, waits until the fake Prefill
engine received the dispatch (its "KV"), then answers (SSE or JSON).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from fakes.logs import RecordingLogger
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rd2h.adapters.logging import make_logger
from rd2h.cli.main import main
from rd2h.cli.proxy import default_public_url
from rd2h.proxy.service import ProxyConfig, create_app
from rd2h.proxy.upstream import (
    CONNECT,
    POOL_SHARD_SIZE,
    STALE,
    AttemptTrace,
    Upstream,
    resend_reason,
)

PROXY = "http://proxy:8000"
HEX32 = re.compile(r"^[0-9a-f]{32}$")


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20.0))


Fault = Callable[[httpx.Request], Awaitable[None]]


class Router(httpx.AsyncBaseTransport):
    """Sends each request to the ASGI app registered for its host:port; others are refused.

    ``faults[(host:port, path)]``: callables run, one per request, before the request
    would reach the app; they raise what a broken connection would.
    """

    def __init__(self) -> None:
        self.apps: dict[str, httpx.ASGITransport] = {}
        self.faults: dict[tuple[str, str], list[Fault]] = {}

    def add(self, base_url: str, app: Any) -> None:
        url = httpx.URL(base_url)
        self.apps[f"{url.host}:{url.port}"] = httpx.ASGITransport(app=app)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        key = f"{request.url.host}:{request.url.port}"
        faults = self.faults.get((key, request.url.path))
        if faults:
            await faults.pop(0)(request)
        target = self.apps.get(key)
        if target is None:
            raise httpx.ConnectError("connection refused", request=request)
        return await target.handle_async_request(request)


def contact(request_id: str, port: int) -> dict[str, Any]:
    return {"request_id": request_id, "do_remote_prefill": False, "do_remote_decode": True,
            "remote_engine_id": f"d-{port}", "remote_host": "127.0.0.1", "remote_port": port,
            "remote_tp_size": 1, "remote_pcp_size": 1, "remote_dcp_size": 1,
            "remote_cached_tokens": 0}


def models_route(app: FastAPI, owner: str) -> Callable[[Any], None]:
    """Adds ``GET /v1/models`` to a fake engine; the returned setter changes its answer:
    a status code, or ``"hang"``."""
    state: dict[str, Any] = {"answer": 200}

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({}, status_code=200)

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        answer = state["answer"]
        if answer == "hang":
            await asyncio.sleep(30)
        if answer != 200:
            return JSONResponse({"error": {"message": f"{owner} says {answer}"}},
                                status_code=answer)
        return {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": owner}],
                "auth": request.headers.get("authorization")}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        if state["answer"] != 200:
            return JSONResponse({"error": "down"}, status_code=state["answer"])
        words = (await request.json())["prompt"].split()
        return {"tokens": [len(w) for w in words], "count": len(words), "owner": owner}

    return lambda answer: state.__setitem__("answer", answer)


class FakePrefill:
    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.hang = False  # answer nothing (until cancelled)
        self.cancelled = 0
        self.received: list[tuple[str, dict, dict]] = []  # (path, headers, body)
        self.seen: dict[str, asyncio.Event] = {}
        self.app = FastAPI()

        async def handle(request: Request) -> JSONResponse:
            body = await request.json()
            if self.hang:
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    self.cancelled += 1
                    raise
            self.received.append((request.url.path, dict(request.headers), body))
            if self.status < 400:  # a failed Prefill sends no KV
                self.seen_event(request.headers["x-request-id"]).set()
            return JSONResponse({"id": "p", "choices": [{"text": "x"}]}, status_code=self.status)

        self.app.post("/v1/completions")(handle)
        self.app.post("/v1/chat/completions")(handle)
        self.set_models = models_route(self.app, "prefill")

    def seen_event(self, rid: str) -> asyncio.Event:
        return self.seen.setdefault(rid, asyncio.Event())


class FakeDecode:
    """``prefills``: the fake Prefill engines whose receipt of the dispatch stands for KV."""

    def __init__(self, router: Router, prefills: list[FakePrefill], port: int,
                 post_order: Callable[[list[str]], list[str]] = lambda ids: ids,
                 wait_for_kv: bool = True, fails_when: Callable[[], bool] | None = None
                 ) -> None:
        """``fails_when``: once it holds (polled after the posts), answer as vLLM does a
        request whose KV load failed under the ``fail`` policy (500, no reason)."""
        self.received: list[tuple[str, dict, dict]] = []
        self.posts: list[tuple[str, httpx.Response]] = []
        self.started = asyncio.Event()
        self.cancelled = False
        self.app = FastAPI()
        client = httpx.AsyncClient(transport=router)

        async def handle(request: Request) -> Any:
            body = await request.json()
            self.received.append((request.url.path, dict(request.headers), body))
            self.started.set()
            if body.get("prompt") == "reject me":
                return JSONResponse({"error": {"message": "bad prompt"}}, status_code=400)
            rid = request.headers["x-request-id"]
            params = body["kv_transfer_params"]
            if request.url.path == "/v1/chat/completions":
                ids = [f"chatcmpl-{rid}"]
            else:
                prompt = body["prompt"]
                n = len(prompt) if isinstance(prompt, list) and not isinstance(
                    prompt[0], int) else 1
                ids = [f"cmpl-{rid}-{i}" for i in range(n)]
            # A prompt starting "local" stands for one this Decode's prefix cache holds
            # all but a few tokens of: with local_prefill_tokens it computes it itself.
            local = bool(params.get("local_prefill_tokens")) and str(
                body.get("prompt", "")).startswith("local")
            try:
                for request_id in post_order(ids):
                    post = contact(request_id, port)
                    if local:
                        post.update(prefill="local", do_remote_decode=False)
                    r = await client.post(params["metaserver"], json=post)
                    self.posts.append((request_id, r))
                if fails_when is not None:
                    for _ in range(500):
                        if fails_when():
                            return JSONResponse({"error": {
                                "message": "Internal server error", "code": 500}},
                                status_code=500)
                        await asyncio.sleep(0.01)
                if wait_for_kv and not local:
                    await asyncio.wait_for(
                        asyncio.wait([asyncio.ensure_future(p.seen_event(rid).wait())
                                      for p in prefills], return_when=asyncio.FIRST_COMPLETED),
                        5.0)
            except asyncio.CancelledError:
                self.cancelled = True
                raise
            if body.get("stream"):
                return StreamingResponse(self.events(ids), media_type="text/event-stream")
            return JSONResponse({"id": ids[0], "from": port, "choices": [
                {"index": i, "text": f"answer {i}"} for i in range(len(ids))]})

        self.app.post("/v1/completions")(handle)
        self.app.post("/v1/chat/completions")(handle)
        self.set_models = models_route(self.app, f"decode-{port}")

    @staticmethod
    def sse(ids: list[str]) -> list[str]:
        chunks = [f"data: {json.dumps({'id': ids[0], 'choices': [{'text': t}]})}\n\n"
                  for t in ("Hel", "lo", "!")]
        return [*chunks, "data: [DONE]\n\n"]

    async def events(self, ids: list[str]) -> Any:
        for chunk in self.sse(ids):
            yield chunk.encode()


class Setup:
    def __init__(self, n_prefill: int = 1, n_decode: int = 1, prefill_status: int = 200,
                 unreachable_prefill: bool = False, log: Any = None, models_timeout_s: float = 5,
                 config_kw: dict[str, Any] | None = None, **decode_kw: Any) -> None:
        self.router = Router()
        p_urls = [f"http://p{i}:8100" for i in range(n_prefill)]
        d_urls = [f"http://d{i}:8200" for i in range(n_decode)]
        self.prefills = [FakePrefill(prefill_status) for _ in p_urls]
        for i, (url, fake) in enumerate(zip(p_urls, self.prefills)):
            if not (unreachable_prefill and i == 0):
                self.router.add(url, fake.app)
        self.decodes = [FakeDecode(self.router, self.prefills, 30000 + i, **decode_kw)
                        for i in range(n_decode)]
        for url, fake in zip(d_urls, self.decodes):
            self.router.add(url, fake.app)
        config = ProxyConfig(prefill=tuple(p_urls), decode=tuple(d_urls), public_url=PROXY,
                             connect_timeout_s=2, decode_timeout_s=10, prefill_timeout_s=10,
                             models_timeout_s=models_timeout_s, **(config_kw or {}))
        self.log = log if log is not None else make_logger("test-proxy", 0)
        self.app = create_app(config, transport=self.router, log=self.log)
        self.proxy = self.app.state.proxy
        self.router.add(PROXY, self.app)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app),
                                        base_url=PROXY)

    async def settle(self) -> None:
        """Let background Prefill dispatches finish (bounded)."""
        tasks = list(self.proxy._tasks)
        if tasks:
            await asyncio.wait_for(asyncio.gather(*tasks), 5.0)

    async def health(self) -> dict[str, Any]:
        return (await self.client.get("/healthcheck")).json()


def test_completion_goes_to_decode_then_prefill_with_d_contact() -> None:
    async def scenario() -> None:
        s = Setup()
        r = await s.client.post("/v1/completions", json={"model": "m", "prompt": "hello",
                                                         "max_tokens": 20, "temperature": 0},
                                headers={"Authorization": "Bearer k"})
        await s.settle()
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == "answer 0"
        [(d_path, d_headers, d_body)] = s.decodes[0].received
        rid = d_headers["x-request-id"]
        assert HEX32.match(rid) and r.headers["x-request-id"] == rid
        assert d_path == "/v1/completions" and d_headers["authorization"] == "Bearer k"
        trace = d_headers["traceparent"]  # a new one, not sampled: the client sent none
        assert re.match(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-00$", trace)
        assert d_body == {"model": "m", "prompt": "hello", "max_tokens": 20, "temperature": 0,
                          "kv_transfer_params": {"do_remote_prefill": True,
                                                 "metaserver": f"{PROXY}/v1/metaserver",
                                                 "traceparent": trace}}
        [(request_id, post_reply)] = s.decodes[0].posts
        assert post_reply.status_code == 200 and post_reply.json()["status"] == "dispatched"
        [(p_path, p_headers, p_body)] = s.prefills[0].received
        assert p_path == "/v1/completions" and p_headers["x-request-id"] == rid
        assert p_headers["authorization"] == "Bearer k" and p_headers["traceparent"] == trace
        assert p_body == {"model": "m", "prompt": "hello", "max_tokens": 1, "temperature": 0,
                          "stream": False, "kv_transfer_params": {
                              **contact(request_id, 30000), "traceparent": trace}}
        health = await s.health()
        assert health["pending"] == 0 and health["counters"]["prefill_ok"] == 1

    run(scenario())


def test_streaming_answer_passes_through_unchanged() -> None:
    async def scenario() -> None:
        s = Setup()
        body = {"model": "m", "prompt": "hi", "stream": True,
                "stream_options": {"include_usage": True}}
        async with s.client.stream("POST", "/v1/completions", json=body) as r:
            text = (await r.aread()).decode()
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
        rid = s.decodes[0].received[0][1]["x-request-id"]
        assert text == "".join(FakeDecode.sse([f"cmpl-{rid}-0"]))
        await s.settle()
        p_body = s.prefills[0].received[0][2]
        assert p_body["stream"] is False and "stream_options" not in p_body
        assert s.decodes[0].received[0][2]["stream_options"] == {"include_usage": True}
        assert (await s.health())["pending"] == 0

    run(scenario())


def test_chat_prefill_is_limited_to_one_token() -> None:
    async def scenario() -> None:
        s = Setup()
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 30}
        r = await s.client.post("/v1/chat/completions", json=body)
        await s.settle()
        assert r.status_code == 200
        rid = s.decodes[0].received[0][1]["x-request-id"]
        [(p_path, _, p_body)] = s.prefills[0].received
        assert p_path == "/v1/chat/completions"
        assert p_body["max_tokens"] == 1 and p_body["max_completion_tokens"] == 1
        assert p_body["kv_transfer_params"]["request_id"] == f"chatcmpl-{rid}"

    run(scenario())


def test_prompt_list_is_dispatched_once_with_batch_params() -> None:
    async def scenario() -> None:
        # Children post out of order and one posts twice (a retried post).
        s = Setup(post_order=lambda ids: [ids[2], ids[0], ids[0], ids[1]])
        prompts = ["one", "two", "three"]
        r = await s.client.post("/v1/completions", json={"model": "m", "prompt": prompts})
        await s.settle()
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
        rid = s.decodes[0].received[0][1]["x-request-id"]
        ids = [f"cmpl-{rid}-{i}" for i in range(3)]
        statuses = [reply.json()["status"] for _, reply in s.decodes[0].posts]
        assert statuses == ["waiting", "waiting", "duplicate", "dispatched"]
        [(_, p_headers, p_body)] = s.prefills[0].received
        assert p_headers["x-request-id"] == rid
        assert p_body["prompt"] == prompts and p_body["max_tokens"] == 1
        assert p_body["kv_transfer_params"] == {
            "do_remote_decode": True,
            "batch_kv_transfer_params": {i: contact(i, 30000) for i in ids},
            "traceparent": p_headers["traceparent"],
        }
        assert (await s.health())["pending"] == 0

    run(scenario())


def test_token_id_prompt_list() -> None:
    async def scenario() -> None:
        s = Setup()
        r = await s.client.post("/v1/completions",
                                json={"model": "m", "prompt": [[1, 2, 3], [4, 5]]})
        await s.settle()
        assert r.status_code == 200
        params = s.prefills[0].received[0][2]["kv_transfer_params"]
        assert len(params["batch_kv_transfer_params"]) == 2

    run(scenario())


def test_requests_round_robin_over_decode_and_prefill() -> None:
    async def scenario() -> None:
        s = Setup(n_prefill=2, n_decode=2)
        for i in range(4):
            r = await s.client.post("/v1/completions", json={"model": "m", "prompt": f"p{i}"})
            assert r.status_code == 200
        await s.settle()
        assert [len(d.received) for d in s.decodes] == [2, 2]
        assert [len(p.received) for p in s.prefills] == [2, 2]
        # Each Prefill dispatch carries the contact info of the Decode that posted it.
        for p in s.prefills:
            for _, headers, body in p.received:
                rid = headers["x-request-id"]
                [d_port] = [30000 + i for i, d in enumerate(s.decodes)
                            if any(h["x-request-id"] == rid for _, h, _ in d.received)]
                assert body["kv_transfer_params"]["remote_port"] == d_port

    run(scenario())


def test_unreachable_prefill_fails_over_to_the_next_once() -> None:
    async def scenario() -> None:
        s = Setup(n_prefill=2, unreachable_prefill=True)
        r = await s.client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        await s.settle()
        assert r.status_code == 200
        assert len(s.prefills[1].received) == 1
        counters = (await s.health())["counters"]
        assert (counters["prefill_ok"], counters["prefill_failed"]) == (1, 0)

    run(scenario())


def test_prefill_rejecting_the_dispatch_is_not_retried() -> None:
    async def scenario() -> None:
        s = Setup(n_prefill=2, prefill_status=400, wait_for_kv=False)
        r = await s.client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        await s.settle()
        assert r.status_code == 200  # Decode's answer; its KV deadline is Decode's business
        assert [len(p.received) for p in s.prefills] == [1, 0]
        assert (await s.health())["counters"]["prefill_failed"] == 1

    run(scenario())


def test_metaserver_rejects_unknown_and_malformed_posts() -> None:
    async def scenario() -> None:
        s = Setup()
        unknown = f"cmpl-{'ab' * 16}-0"
        r = await s.client.post("/v1/metaserver", json=contact(unknown, 1))
        assert r.status_code == 404
        assert unknown in r.json()["error"]["message"]
        r = await s.client.post("/v1/metaserver", json={"remote_host": "h"})
        assert r.status_code == 400 and "request_id" in r.json()["error"]["message"]
        r = await s.client.post("/v1/metaserver", content=b"{nope")
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        assert (await s.health())["counters"]["metaserver_rejected"] == 3

    run(scenario())


@pytest.mark.parametrize(("payload", "needle"), [
    (b"not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"prompt": []}', "empty"),
    (b'{"prompt": "x", "n": 3}', "'n'"),
])
def test_bad_client_requests_get_400_and_reach_no_engine(payload: bytes, needle: str) -> None:
    async def scenario() -> None:
        s = Setup()
        r = await s.client.post("/v1/completions", content=payload)
        assert r.status_code == 400 and needle in r.json()["error"]["message"]
        assert s.decodes[0].received == [] and (await s.health())["pending"] == 0

    run(scenario())


def test_decode_error_is_relayed_and_cleaned_up() -> None:
    async def scenario() -> None:
        s = Setup()
        r = await s.client.post("/v1/completions", json={"model": "m", "prompt": "reject me"})
        assert r.status_code == 400 and r.json() == {"error": {"message": "bad prompt"}}
        health = await s.health()
        assert health["pending"] == 0 and health["counters"]["incomplete_rendezvous"] == 1
        assert s.prefills[0].received == []

    run(scenario())


def test_unreachable_decode_gives_502_and_no_leak() -> None:
    async def scenario() -> None:
        s = Setup()
        s.router.apps.pop("d0:8200")
        r = await s.client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 502 and "http://d0:8200" in r.json()["error"]["message"]
        assert (await s.health())["pending"] == 0

    run(scenario())


def test_client_disconnect_cancels_decode_and_cleans_up() -> None:
    async def scenario() -> None:
        # Decode never gets its KV (Prefill hangs): it waits until the client leaves.
        s = Setup()
        s.prefills[0].hang = True
        body = json.dumps({"model": "m", "prompt": "x"}).encode()
        inbox = [{"type": "http.request", "body": body, "more_body": False}]
        gone = asyncio.Event()
        sent: list[dict] = []

        async def receive() -> dict:
            if inbox:
                return inbox.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions",
                 "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json")],
                 "client": ("client", 1), "server": ("proxy", 8000)}
        call = asyncio.ensure_future(s.app(scope, receive, send))
        await asyncio.wait_for(s.decodes[0].started.wait(), 5.0)
        assert len(s.proxy.table) == 1
        gone.set()
        await asyncio.wait_for(call, 5.0)
        assert s.decodes[0].cancelled
        assert len(s.proxy.table) == 0 and sent == []
        await s.settle()  # both legs go: the Prefill dispatch is cancelled too
        assert s.prefills[0].cancelled == 1

    run(scenario())


def test_healthcheck_lists_instances() -> None:
    async def scenario() -> None:
        s = Setup(n_prefill=2, n_decode=1)
        health = await s.health()
        assert health["prefill"] == ["http://p0:8100", "http://p1:8100"]
        assert health["decode"] == ["http://d0:8200"]
        assert health["metaserver"] == f"{PROXY}/v1/metaserver"
        assert health["pending"] == 0 and health["status"] == "ok"

    run(scenario())


@pytest.mark.parametrize(("kw", "needle"), [
    ({"prefill": ()}, "at least one prefill"),
    ({"decode": ("http://d:1/v1",)}, "no path"),
    ({"decode": ("d:1",)}, "http://HOST:PORT"),
    ({"decode": ("http://d:1", "http://d:1/")}, "more than once"),
    ({"public_url": "http://proxy:0"}, "port 0"),
    ({"prefill_timeout_s": 0}, "prefill_timeout_s"),
])
def test_config_is_validated_up_front(kw: dict, needle: str) -> None:
    base: dict[str, Any] = {"prefill": ("http://p:1",), "decode": ("http://d:2",),
                            "public_url": PROXY}
    with pytest.raises(ValueError, match=re.escape(needle)):
        ProxyConfig(**{**base, **kw})


# ---------------------------------------------------------------- the command line


@pytest.mark.parametrize(("host", "url"), [
    ("127.0.0.1", "http://127.0.0.1:8000"), ("0.0.0.0", "http://127.0.0.1:8000"),
    ("::1", "http://[::1]:8000"), ("proxy.example", "http://proxy.example:8000"),
])
def test_default_public_url(host: str, url: str) -> None:
    assert default_public_url(host, 8000) == url


@pytest.mark.parametrize(("argv", "needle"), [
    (["--prefill", "http://p:1", "--decode", "http://d:2/v1"], "no path"),
    (["--prefill", "http://p:1", "--decode", "http://d:2", "--public-url", "x"],
     "public URL 'x'"),
])
def test_cli_rejects_bad_config_before_serving(argv: list[str], needle: str, capsys) -> None:
    assert main(["proxy", *argv]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--decode", "http://d:2"],  # --prefill is required
    ["--prefill", "http://p:1", "--decode", "http://d:2", "--port", "70000"],
    ["--prefill", "http://p:1", "--decode", "http://d:2", "--prefill-timeout", "0"],
])
def test_cli_flag_errors_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["proxy", *argv])
    assert exc.value.code == 2


# ---------------------------------------------------------------- sending again


def reused_then(exc_type: type[httpx.TransportError], message: str = "",
                *, new_connection: bool = False, before: Fault | None = None) -> Fault:
    """A fault that fails like a pooled connection would: httpcore's trace events for
    a request written to a reused (or, with ``new_connection``, a new) connection, then
    ``exc_type``. ``before`` runs first (what the engine did before the failure)."""

    async def fault(request: httpx.Request) -> None:
        if before is not None:
            await before(request)
        trace = request.extensions["trace"]
        if new_connection:
            await trace("connection.connect_tcp.started", {})
            await trace("connection.connect_tcp.complete", {})
        await trace("http11.send_request_headers.started", {})
        await trace("http11.send_request_body.complete", {})
        await trace("http11.receive_response_headers.started", {})
        raise exc_type(message, request=request)

    return fault


SERVER_CLOSED = "Server disconnected without sending a response."


@pytest.mark.parametrize(("exc", "events", "expected"), [
    (httpx.RemoteProtocolError(SERVER_CLOSED), ["headers"], STALE),
    (httpx.ReadError("[Errno 104] Connection reset by peer"), ["headers"], STALE),
    (httpx.WriteError("[Errno 32] Broken pipe"), ["headers"], STALE),
    (httpx.ConnectError("refused"), [], CONNECT),
    (httpx.ConnectTimeout("slow"), ["connect"], CONNECT),
    # On a new connection the engine may have read the request: not sent again.
    (httpx.ReadError("reset"), ["connect", "headers"], None),
    (httpx.RemoteProtocolError(SERVER_CLOSED), ["connect", "headers"], None),
    # A garbled answer, a timeout or anything after the response started: never.
    (httpx.RemoteProtocolError("illegal status line"), ["headers"], None),
    (httpx.ReadTimeout("timed out"), ["headers"], None),
    (httpx.ReadError("reset"), ["headers", "response"], None),
    # Nothing traced (an in-memory transport): unknown, so not sent again.
    (httpx.ReadError("reset"), [], None),
])
def test_resend_rule(exc: Exception, events: list[str], expected: str | None) -> None:
    trace = AttemptTrace()
    names = {"connect": "connection.connect_tcp.started",
             "headers": "http11.send_request_headers.started",
             "response": "http11.receive_response_headers.complete"}
    for event in events:
        run(trace(names[event], {}))
    assert resend_reason(exc, trace) == expected


@pytest.mark.parametrize("exc_type", [httpx.RemoteProtocolError, httpx.ReadError])
def test_decode_closing_a_reused_connection_is_resent_under_a_new_rid(exc_type) -> None:
    async def scenario() -> None:
        log = RecordingLogger()
        s = Setup(log=log)
        s.router.faults[("d0:8200", "/v1/completions")] = [reused_then(exc_type, SERVER_CLOSED)]
        r = await s.client.post("/v1/completions", json={"model": "m", "prompt": "x",
                                                         "stream": True})
        await s.settle()
        assert r.status_code == 200
        [(_, d_headers, _)] = s.decodes[0].received
        assert r.headers["x-request-id"] == d_headers["x-request-id"]
        assert len(s.prefills[0].received) == 1
        health = await s.health()
        assert health["pending"] == 0 and health["counters"]["decode_resent"] == 1
        assert health["counters"]["incomplete_rendezvous"] == 0
        assert log.at("error") == [] and log.at("warning") == []
        [(_, info)] = [x for x in log.at("info") if "reused connection" in x[0]]
        assert info["new_rid"] == d_headers["x-request-id"] != info["rid"]
        metrics = await scrape(s)
        assert metrics[("rd2h_proxy_upstream_retries_total",
                        (("leg", "decode"), ("reason", "stale_connection")))] == 1
        assert metrics[("rd2h_proxy_requests_total",
                        (("endpoint", "/v1/completions"), ("outcome", "ok")))] == 1

    run(scenario())


def test_decode_request_is_not_resent_once_decode_posted_for_it() -> None:
    async def scenario() -> None:
        s = Setup(wait_for_kv=False)
        poster = httpx.AsyncClient(transport=s.router)

        async def admitted(request: httpx.Request) -> None:
            rid = request.headers["x-request-id"]
            await poster.post(f"{PROXY}/v1/metaserver", json=contact(f"cmpl-{rid}-0", 1))

        s.router.faults[("d0:8200", "/v1/completions")] = [
            reused_then(httpx.ReadError, "reset", before=admitted)]
        r = await s.client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        await s.settle()
        assert r.status_code == 502 and "ReadError" in r.json()["error"]["message"]
        assert s.decodes[0].received == []
        health = await s.health()
        assert health["pending"] == 0 and health["counters"]["decode_resent"] == 0

    run(scenario())


@pytest.mark.parametrize("fault", [
    reused_then(httpx.ReadError, "reset", new_connection=True),
    reused_then(httpx.ReadTimeout, "timed out"),
    reused_then(httpx.RemoteProtocolError, "illegal status line"),
])
def test_decode_failures_the_engine_may_have_seen_give_502(fault: Fault) -> None:
    async def scenario() -> None:
        s = Setup()
        s.router.faults[("d0:8200", "/v1/completions")] = [fault]
        r = await s.client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 502
        assert s.decodes[0].received == [] and (await s.health())["pending"] == 0
        metrics = await scrape(s)
        assert metrics[("rd2h_proxy_requests_total",
                        (("endpoint", "/v1/completions"), ("outcome", "unavailable")))] == 1

    run(scenario())


@pytest.mark.parametrize("fault", [
    reused_then(httpx.ReadError, "reset", new_connection=True),
    reused_then(httpx.ReadTimeout, "timed out"),
    reused_then(httpx.RemoteProtocolError, SERVER_CLOSED, new_connection=True),
])
def test_a_decode_failing_before_any_hand_off_sends_the_request_to_another_once(
        fault: Fault) -> None:
    """A Decode killed (or stalled) with the request on its way, before it posted to the
    metaserver: nothing was handed off, so the request goes to another Decode under a
    new id, once, and the client gets its answer."""
    async def scenario() -> None:
        log = RecordingLogger()
        s = Setup(n_decode=2, log=log)
        s.router.faults[("d0:8200", "/v1/completions")] = [fault]
        r = await s.client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        await s.settle()
        assert r.status_code == 200 and r.json()["from"] == 30001
        assert [len(d.received) for d in s.decodes] == [0, 1]
        health = await s.health()
        assert health["pending"] == 0 and health["counters"]["decode_resent"] == 1
        [(text, info)] = [x for x in log.at("warning") if "another one" in x[0]]
        assert "before any hand-off" in text and info["new_rid"] != info["rid"]
        metrics = await scrape(s)
        assert metrics[("rd2h_proxy_upstream_retries_total",
                        (("leg", "decode"), ("reason", "failover")))] == 1

    run(scenario())


def test_a_second_decode_failure_is_not_sent_a_third_time() -> None:
    async def scenario() -> None:
        s = Setup(n_decode=3)
        for d in ("d0:8200", "d1:8200", "d2:8200"):
            s.router.faults[(d, "/v1/completions")] = [
                reused_then(httpx.ReadError, "reset", new_connection=True)]
        r = await s.client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        await s.settle()
        assert r.status_code == 502
        assert sum(len(d.received) for d in s.decodes) == 0
        health = await s.health()
        assert health["pending"] == 0 and health["counters"]["decode_resent"] == 1
        assert sum(1 for key in s.router.faults.values() if not key) == 2  # two tried

    run(scenario())


def test_a_decode_failing_after_it_posted_is_not_sent_to_another() -> None:
    async def scenario() -> None:
        s = Setup(n_decode=2, wait_for_kv=False)
        poster = httpx.AsyncClient(transport=s.router)

        async def admitted(request: httpx.Request) -> None:
            rid = request.headers["x-request-id"]
            await poster.post(f"{PROXY}/v1/metaserver", json=contact(f"cmpl-{rid}-0", 1))

        s.router.faults[("d0:8200", "/v1/completions")] = [
            reused_then(httpx.ReadError, "reset", new_connection=True, before=admitted)]
        r = await s.client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        await s.settle()
        assert r.status_code == 502
        assert [len(d.received) for d in s.decodes] == [0, 0]
        assert (await s.health())["counters"]["decode_resent"] == 0

    run(scenario())


def test_refused_decode_moves_to_the_next_instance() -> None:
    async def scenario() -> None:
        s = Setup(n_decode=2)
        s.router.apps.pop("d0:8200")
        r = await s.client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        await s.settle()
        assert r.status_code == 200 and r.json()["from"] == 30001
        assert (await s.health())["pending"] == 0

    run(scenario())


def test_prefill_closing_a_reused_connection_gets_it_again_on_the_same_instance() -> None:
    async def scenario() -> None:
        log = RecordingLogger()
        s = Setup(n_prefill=2, log=log)
        s.router.faults[("p0:8100", "/v1/completions")] = [
            reused_then(httpx.RemoteProtocolError, SERVER_CLOSED)]
        r = await s.client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        await s.settle()
        assert r.status_code == 200
        assert [len(p.received) for p in s.prefills] == [1, 0]
        counters = (await s.health())["counters"]
        assert (counters["prefill_ok"], counters["prefill_resent"]) == (1, 1)
        assert log.at("error") == [] and log.at("warning") == []

    run(scenario())


# ---------------------------------------------------------------- /v1/models


def test_models_come_from_a_decode_engine_with_the_client_auth() -> None:
    async def scenario() -> None:
        s = Setup()
        r = await s.client.get("/v1/models", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200
        assert r.json()["data"][0]["owned_by"] == "decode-30000"
        assert r.json()["auth"] == "Bearer k"

    run(scenario())


def test_models_fall_back_to_the_other_engines() -> None:
    async def scenario() -> None:
        s = Setup(n_decode=2)
        s.router.apps.pop("d0:8200")
        s.decodes[1].set_models(500)
        r = await s.client.get("/v1/models")
        assert r.status_code == 200 and r.json()["data"][0]["owned_by"] == "prefill"
        metrics = await scrape(s)
        assert metrics[("rd2h_proxy_upstream_failures_total",
                        (("leg", "models"), ("reason", "status_5xx")))] == 1
        assert metrics[("rd2h_proxy_upstream_failures_total",
                        (("leg", "models"), ("reason", "connect")))] == 1

    run(scenario())


def test_tokenize_is_answered_by_an_engine_with_the_body_as_sent() -> None:
    async def scenario() -> None:
        s = Setup(n_decode=2)
        s.decodes[0].set_models(500)
        r = await s.client.post("/tokenize", json={"model": "m", "prompt": "ab cde f"})
        assert r.status_code == 200
        assert r.json() == {"tokens": [2, 3, 1], "count": 3, "owner": "decode-30001"}
        metrics = await scrape(s)
        assert metrics[("rd2h_proxy_upstream_failures_total",
                        (("leg", "tokenize"), ("reason", "status_5xx")))] == 1
        assert metrics[("rd2h_proxy_requests_total",
                        (("endpoint", "/tokenize"), ("outcome", "ok")))] == 1

    run(scenario())


def test_models_relay_an_engine_client_error() -> None:
    async def scenario() -> None:
        s = Setup()
        s.decodes[0].set_models(401)
        r = await s.client.get("/v1/models")
        assert r.status_code == 401 and "decode-30000 says 401" in r.text

    run(scenario())


def test_models_502_when_engines_answer_errors_503_when_none_answers() -> None:
    async def scenario() -> None:
        s = Setup()
        s.decodes[0].set_models(500)
        s.prefills[0].set_models(503)
        r = await s.client.get("/v1/models")
        assert r.status_code == 502
        message = r.json()["error"]["message"]
        assert "http://d0:8200/v1/models: HTTP 500" in message
        assert "http://p0:8100/v1/models: HTTP 503" in message
        s.router.apps.clear()
        s.router.add(PROXY, s.app)
        r = await s.client.get("/v1/models")
        assert r.status_code == 503 and "ConnectError" in r.json()["error"]["message"]

    run(scenario())


def test_models_answer_503_at_the_deadline_when_engines_hang() -> None:
    async def scenario() -> None:
        s = Setup(models_timeout_s=0.3)
        s.decodes[0].set_models("hang")
        started = time.monotonic()
        r = await s.client.get("/v1/models")
        assert r.status_code == 503 and "within 0.3 s" in r.json()["error"]["message"]
        assert time.monotonic() - started < 3.0

    run(scenario())


# ---------------------------------------------------------------- /metrics


async def scrape(s: Setup) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = await s.client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(r.text) for sample in family.samples}


def test_metrics_move_with_requests() -> None:
    async def scenario() -> None:
        s = Setup()
        before = await scrape(s)
        assert before[("rd2h_proxy_pending_rendezvous", ())] == 0
        assert not any(name == "rd2h_proxy_requests_total" for name, _ in before)
        r = await s.client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 200
        await s.settle()
        await s.client.post("/v1/completions", content=b"nope")
        m = await scrape(s)
        path = (("endpoint", "/v1/completions"),)
        assert m[("rd2h_proxy_requests_total", (*path, ("outcome", "ok")))] == 1
        assert m[("rd2h_proxy_requests_total", (*path, ("outcome", "invalid")))] == 1
        assert m[("rd2h_proxy_requests_in_flight", path)] == 0
        assert m[("rd2h_proxy_metaserver_posts_total", (("status", "dispatched"),))] == 1
        assert m[("rd2h_proxy_prefill_dispatches_total", (("outcome", "ok"),))] == 1
        for hist, labels in [("decode_response_start", path), ("decode_admission", ()),
                             ("prefill_dispatch", ()), ("prefill_leg", (("outcome", "ok"),)),
                             ("request_duration", path)]:
            assert m[(f"rd2h_proxy_{hist}_seconds_count", labels)] == 1, hist
            assert m[(f"rd2h_proxy_{hist}_seconds_sum", labels)] >= 0, hist
        assert m[("rd2h_proxy_pending_rendezvous", ())] == 0
        assert m[("rd2h_proxy_prefill_in_flight", ())] == 0

    run(scenario())


def test_two_proxies_in_one_process_keep_their_own_series() -> None:
    async def scenario() -> None:
        first, second = Setup(), Setup()
        r = await first.client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 200
        await first.settle()
        key = ("rd2h_proxy_requests_total", (("endpoint", "/v1/completions"), ("outcome", "ok")))
        assert (await scrape(first))[key] == 1
        assert key not in await scrape(second)
        assert "rd2h_proxy_requests" not in generate_latest(REGISTRY).decode()

    run(scenario())


def test_cli_help_explains_the_endpoints_and_keepalive(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["proxy", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for needle in ("GET /v1/models", "GET /metrics", "rd2h_proxy_*", "--engine-keepalive",
                   "--client-keepalive", "--models-timeout", "fresh connection",
                   "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "decode_response_start"):
        assert needle in text, needle


def test_cli_keepalive_flags_reach_the_config(monkeypatch) -> None:
    import rd2h.bootstrap.gateways as gateways

    seen: dict[str, Any] = {}
    monkeypatch.setattr(gateways, "serve_proxy",
                        lambda config, host, port, level, timeline_dir: seen.update(
                            config=config, timeline_dir=timeline_dir))
    assert main(["proxy", "--prefill", "http://p:1", "--decode", "http://d:2",
                 "--engine-keepalive", "1.5", "--client-keepalive", "90",
                 "--models-timeout", "3", "--timeline-dir", "/tmp/stamps"]) == 0
    config = seen["config"]
    assert seen["timeline_dir"] == "/tmp/stamps"
    assert (config.engine_keepalive_s, config.client_keepalive_s,
            config.models_timeout_s) == (1.5, 90.0, 3.0)
    assert ProxyConfig(prefill=("http://p:1",), decode=("http://d:2",),
                       public_url=PROXY).engine_keepalive_s < 5  # below uvicorn's 5 s


@pytest.mark.parametrize("streams", [1, 20])
def test_upstream_spreads_requests_in_flight_over_small_pools(streams: int) -> None:
    async def scenario() -> None:
        upstream = Upstream(connect_timeout_s=1, read_timeout_s=1, keepalive_expiry_s=1,
                            transport=httpx.MockTransport(lambda r: httpx.Response(200)))
        held = [await upstream.send("GET", "http://e:1/x", stream=True)
                for _ in range(streams)]
        assert upstream.pools() == -(-streams // POOL_SHARD_SIZE)
        for response in held:
            await upstream.close(response)
        # Closed responses free their pools' room: as many again need no new pool.
        held = [await upstream.send("GET", "http://e:1/x", stream=True)
                for _ in range(streams)]
        await upstream.send("GET", "http://e:1/x")
        assert upstream.pools() == -(-(streams + 1) // POOL_SHARD_SIZE)
        for response in held:
            await upstream.close(response)
        await upstream.aclose()

    run(scenario())


# ---------------------------------------------------------------- parallel dispatch


def test_parallel_dispatch_sends_prefill_at_once_with_the_instance_contact() -> None:
    async def scenario() -> None:
        s = Setup(config_kw={"dispatch": "parallel"})
        body = {"model": "m", "prompt": "hello", "max_tokens": 5}
        # The instance's first request goes Decode-first: its contact is not known yet.
        assert (await s.client.post("/v1/completions", json=body)).status_code == 200
        await s.settle()
        assert s.decodes[0].posts[0][1].json()["status"] == "dispatched"
        r = await s.client.post("/v1/completions", json=body)
        await s.settle()
        assert r.status_code == 200
        rid = s.decodes[0].received[1][1]["x-request-id"]
        d_params = s.decodes[0].received[1][2]["kv_transfer_params"]
        assert d_params["awaits_admission"] is True
        (_, p_headers, p_body) = s.prefills[0].received[1]
        # Decode is told the contact Prefill got (it posts only if its own differs).
        assert d_params["sent_contact"] == {
            k: v for k, v in p_body["kv_transfer_params"].items() if k.startswith("remote_")}
        assert p_headers["x-request-id"] == rid
        expected = {k: v for k, v in contact(f"cmpl-{rid}-0", 30000).items()
                    if k != "remote_cached_tokens"}  # unknown before Decode posts
        assert p_body["kv_transfer_params"] == {**expected, "awaits_admission": True,
                                                "traceparent": d_params["traceparent"]}
        assert s.decodes[0].posts[1][1].json()["status"] == "confirmed"
        counters = (await s.health())["counters"]
        assert counters["prefill_parallel"] == 1 and counters["prefill_dispatched"] == 2
        assert counters["parallel_mismatch"] == 0 and counters["prefill_ok"] == 2
        # Chat gets vLLM's chat id; a prompt list is never dispatched early.
        await s.client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}]})
        await s.client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"]})
        await s.settle()
        chat_rid = s.decodes[0].received[2][1]["x-request-id"]
        assert s.prefills[0].received[2][2]["kv_transfer_params"]["request_id"] == \
            f"chatcmpl-{chat_rid}"
        assert "awaits_admission" not in s.prefills[0].received[3][2]["kv_transfer_params"][
            "batch_kv_transfer_params"][f"cmpl-{s.decodes[0].received[3][1]['x-request-id']}-0"]
        assert (await s.health())["counters"]["prefill_parallel"] == 2

    run(scenario())


def test_parallel_dispatch_with_a_stale_contact_is_sent_again_with_the_posted_one() -> None:
    async def scenario() -> None:
        s = Setup(config_kw={"dispatch": "parallel"})
        body = {"model": "m", "prompt": "hello", "max_tokens": 5}
        await s.client.post("/v1/completions", json=body)
        await s.settle()
        # The instance restarted elsewhere: what the proxy knows is stale.
        s.proxy.contacts["http://d0:8200"]["remote_port"] = 1
        r = await s.client.post("/v1/completions", json=body)
        await s.settle()
        assert r.status_code == 200
        assert s.decodes[0].posts[1][1].json()["status"] == "mismatch"
        ports = [b["kv_transfer_params"]["remote_port"] for _, _, b in s.prefills[0].received]
        assert ports[0] == 30000 and sorted(ports[1:]) == [1, 30000]
        counters = (await s.health())["counters"]
        assert counters["parallel_mismatch"] == 1
        # The contact is learned again: the next one goes early, right.
        await s.client.post("/v1/completions", json=body)
        await s.settle()
        assert s.decodes[0].posts[2][1].json()["status"] == "confirmed"

    run(scenario())


def test_parallel_dispatch_is_validated_and_off_by_default() -> None:
    assert ProxyConfig(prefill=("http://p:1",), decode=("http://d:2",),
                       public_url=PROXY).dispatch == "decode-first"
    with pytest.raises(ValueError, match="dispatch must be one of"):
        ProxyConfig(prefill=("http://p:1",), decode=("http://d:2",), public_url=PROXY,
                    dispatch="both")


def test_upstream_sockets_are_aiohttp_by_default_and_validated() -> None:
    assert ProxyConfig(prefill=("http://p:1",), decode=("http://d:2",),
                       public_url=PROXY).upstream_sockets == "aiohttp"
    with pytest.raises(ValueError, match="upstream_sockets must be one of aiohttp, asyncio, anyio"):
        ProxyConfig(prefill=("http://p:1",), decode=("http://d:2",), public_url=PROXY,
                    upstream_sockets="trio")


def test_upstream_keeps_no_cookie_an_engine_sets() -> None:
    seen: list[str | None] = []

    def engine(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("cookie"))
        return httpx.Response(200, headers={"set-cookie": "session=client-a; Path=/"})

    async def scenario() -> None:
        upstream = Upstream(connect_timeout_s=1, read_timeout_s=1, keepalive_expiry_s=1,
                            transport=httpx.MockTransport(engine))
        for fresh in (False, False, True, True):
            await upstream.send("POST", "http://e:1/v1/completions", json={}, fresh=fresh)
        await upstream.aclose()

    asyncio.run(scenario())
    # httpx's default jar would send client A's session with every later request.
    assert seen == [None] * 4
