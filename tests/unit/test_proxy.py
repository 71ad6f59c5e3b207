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
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from rd2h.adapters.http.proxy import ProxyConfig, create_app
from rd2h.adapters.logging import make_logger
from rd2h.cli.main import main
from rd2h.cli.proxy import default_public_url

PROXY = "http://proxy:8000"
HEX32 = re.compile(r"^[0-9a-f]{32}$")


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20.0))


class Router(httpx.AsyncBaseTransport):
    """Sends each request to the ASGI app registered for its host:port; others are refused."""

    def __init__(self) -> None:
        self.apps: dict[str, httpx.ASGITransport] = {}

    def add(self, base_url: str, app: Any) -> None:
        url = httpx.URL(base_url)
        self.apps[f"{url.host}:{url.port}"] = httpx.ASGITransport(app=app)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        target = self.apps.get(f"{request.url.host}:{request.url.port}")
        if target is None:
            raise httpx.ConnectError("connection refused", request=request)
        return await target.handle_async_request(request)


def contact(request_id: str, port: int) -> dict[str, Any]:
    return {"request_id": request_id, "do_remote_prefill": False, "do_remote_decode": True,
            "remote_engine_id": f"d-{port}", "remote_host": "127.0.0.1", "remote_port": port,
            "remote_tp_size": 1, "remote_pcp_size": 1, "remote_dcp_size": 1,
            "remote_cached_tokens": 0}


class FakePrefill:
    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.received: list[tuple[str, dict, dict]] = []  # (path, headers, body)
        self.seen: dict[str, asyncio.Event] = {}
        self.app = FastAPI()

        async def handle(request: Request) -> JSONResponse:
            body = await request.json()
            self.received.append((request.url.path, dict(request.headers), body))
            self.seen_event(request.headers["x-request-id"]).set()
            return JSONResponse({"id": "p", "choices": [{"text": "x"}]}, status_code=self.status)

        self.app.post("/v1/completions")(handle)
        self.app.post("/v1/chat/completions")(handle)

    def seen_event(self, rid: str) -> asyncio.Event:
        return self.seen.setdefault(rid, asyncio.Event())


class FakeDecode:
    """``prefills``: the fake Prefill engines whose receipt of the dispatch stands for KV."""

    def __init__(self, router: Router, prefills: list[FakePrefill], port: int,
                 post_order: Callable[[list[str]], list[str]] = lambda ids: ids,
                 wait_for_kv: bool = True) -> None:
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
            try:
                for request_id in post_order(ids):
                    r = await client.post(params["metaserver"], json=contact(request_id, port))
                    self.posts.append((request_id, r))
                if wait_for_kv:
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
                 unreachable_prefill: bool = False, **decode_kw: Any) -> None:
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
                             connect_timeout_s=2, decode_timeout_s=10, prefill_timeout_s=10)
        self.app = create_app(config, transport=self.router, log=make_logger("test-proxy", 0))
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
        assert d_body == {"model": "m", "prompt": "hello", "max_tokens": 20, "temperature": 0,
                          "kv_transfer_params": {"do_remote_prefill": True,
                                                 "metaserver": f"{PROXY}/v1/metaserver"}}
        [(request_id, post_reply)] = s.decodes[0].posts
        assert post_reply.status_code == 200 and post_reply.json()["status"] == "dispatched"
        [(p_path, p_headers, p_body)] = s.prefills[0].received
        assert p_path == "/v1/completions" and p_headers["x-request-id"] == rid
        assert p_headers["authorization"] == "Bearer k"
        assert p_body == {"model": "m", "prompt": "hello", "max_tokens": 1, "temperature": 0,
                          "stream": False, "kv_transfer_params": contact(request_id, 30000)}
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
        # Decode never gets its KV (no Prefill reachable): it waits until the client leaves.
        s = Setup(unreachable_prefill=True)
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
