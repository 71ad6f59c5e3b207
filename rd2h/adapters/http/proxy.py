"""The ``rd2h proxy`` rendezvous proxy (FastAPI + httpx): Decode first, Prefill on D's post.

Flow for one client request (spec 3.1, 3.2):

1. Name it ``rid`` (uuid4 hex), record it as pending, send the client's body to a
   Decode instance (round robin) with ``X-Request-Id: rid`` and
   ``kv_transfer_params = {do_remote_prefill: true, metaserver: <public>/v1/metaserver}``,
   and relay Decode's answer (SSE or JSON) to the client as it arrives.
2. Decode's connector posts its contact information to ``/v1/metaserver`` once per
   prompt; the rules for matching posts to requests live in
   ``rd2h.domain.rendezvous``.
3. When every expected post is in, send the original body to a Prefill instance
   (round robin) as a background task: one output token, no streaming, the posted
   params (or ``batch_kv_transfer_params`` for a prompt list). A failed dispatch is
   logged and tried once on the next Prefill instance.
4. The pending entry goes away when Decode's answer ends, errors or the client
   disconnects; closing the Decode connection on a disconnect makes vLLM abort it.

Every upstream wait has a deadline (connect, Decode's next bytes, the whole Prefill
request).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from rd2h.adapters.http.proxy_config import (
    FORWARDED_HEADERS,
    METASERVER_PATH,
    ProxyConfig,
)
from rd2h.domain.rendezvous import (
    ClientRequestError,
    Endpoint,
    MetaserverPostError,
    PendingRequest,
    PostStatus,
    RendezvousTable,
    UnexpectedPost,
    UnknownRendezvous,
    count_prompts,
    decode_body,
    prefill_body,
)
from rd2h.ports.runtime import Logger


def _error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "rd2h_proxy", "code": status}}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(_error_body(status, message), status_code=status)


@dataclass
class _Counters:
    requests: int = 0
    decode_errors: int = 0
    metaserver_posts: int = 0
    metaserver_rejected: int = 0
    prefill_dispatched: int = 0
    prefill_ok: int = 0
    prefill_failed: int = 0
    incomplete_rendezvous: int = 0


class RendezvousProxy:
    """State and upstream I/O of one proxy process, driven from one event loop."""

    def __init__(
        self,
        config: ProxyConfig,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        log: Logger | None = None,
    ) -> None:
        if log is None:
            from rd2h.adapters.logging import make_logger

            log = make_logger("proxy", 0)
        self.config = config
        self.table = RendezvousTable()
        self.counters = _Counters()
        self._log = log
        self._client = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(config.decode_timeout_s, connect=config.connect_timeout_s),
            # One Decode connection per client request in flight: no pool cap that would
            # queue client requests behind each other (clients bound the concurrency).
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=100),
        )
        self._decode_rr = itertools.count()
        self._prefill_rr = itertools.count()
        self._headers: dict[str, dict[str, str]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # -- client requests ----------------------------------------------------------------

    async def handle_client(self, request: Request, endpoint: Endpoint) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(400, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return _error(400, f"request body must be a JSON object, not {type(body).__name__}")
        try:
            expected = count_prompts(body, endpoint)
        except ClientRequestError as exc:
            return _error(400, str(exc))
        if "kv_transfer_params" in body:
            self._log.warning("client kv_transfer_params replaced by the proxy's")
        rid = uuid.uuid4().hex
        self.table.open(rid, endpoint, body, expected, time.monotonic())
        self.counters.requests += 1
        headers = {"X-Request-Id": rid}
        for name in FORWARDED_HEADERS:
            if name in request.headers:
                headers[name] = request.headers[name]
        self._headers[rid] = headers
        decode = self.config.decode[next(self._decode_rr) % len(self.config.decode)]
        self._log.debug("request to decode", rid=rid, decode=decode, prompts=expected)
        return _Relay(self, rid, decode + endpoint.path,
                      decode_body(body, self.config.metaserver_url), headers)

    def finish(self, rid: str, outcome: str) -> None:
        """Forget a request once Decode's answer has ended (any way it ends)."""
        self._headers.pop(rid, None)
        entry = self.table.close(rid)
        if entry is not None and not entry.dispatched:
            self.counters.incomplete_rendezvous += 1
            self._log.warning(
                "decode answer ended before every rendezvous post arrived; prefill not sent",
                rid=rid, outcome=outcome, posts=len(entry.posts), expected=entry.expected,
            )

    # -- metaserver ----------------------------------------------------------------------

    async def handle_post(self, request: Request) -> JSONResponse:
        self.counters.metaserver_posts += 1
        try:
            post = json.loads(await request.body())
            outcome = self.table.post(post)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            self.counters.metaserver_rejected += 1
            return _error(400, f"metaserver post is not valid JSON: {exc}")
        except MetaserverPostError as exc:
            self.counters.metaserver_rejected += 1
            return _error(400, str(exc))
        except UnknownRendezvous as exc:
            self.counters.metaserver_rejected += 1
            self._log.warning("metaserver post for an unknown request", error=str(exc))
            return _error(404, str(exc))
        except UnexpectedPost as exc:
            self.counters.metaserver_rejected += 1
            self._log.warning("unexpected metaserver post", error=str(exc))
            return _error(409, str(exc))
        entry = outcome.request
        if outcome.status is PostStatus.DISPATCH:
            self._spawn(self._dispatch_prefill(entry))
        return JSONResponse({
            "status": outcome.status.value, "request_id": outcome.request_id,
            "received": len(entry.posts), "expected": entry.expected,
        })

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _dispatch_prefill(self, entry: PendingRequest) -> None:
        """Send the request to Prefill; on failure try the next instance once.

        A 4xx answer is not retried: the same body would be rejected again.
        """
        self.counters.prefill_dispatched += 1
        body = prefill_body(entry.body, entry.endpoint, entry.prefill_params())
        headers = dict(self._headers.get(entry.rid, {"X-Request-Id": entry.rid}))
        urls = self.config.prefill
        first = next(self._prefill_rr) % len(urls)
        for attempt, url in enumerate((urls[first], urls[(first + 1) % len(urls)])):
            retryable = True
            try:
                with anyio.fail_after(self.config.prefill_timeout_s):
                    r = await self._client.post(
                        url + entry.endpoint.path, json=body, headers=headers,
                        timeout=httpx.Timeout(self.config.prefill_timeout_s,
                                              connect=self.config.connect_timeout_s),
                    )
            except (httpx.TransportError, TimeoutError) as exc:
                error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                self._log.error("prefill dispatch failed", rid=entry.rid, prefill=url,
                                attempt=attempt + 1, error=error)
            else:
                if not r.is_error:
                    self.counters.prefill_ok += 1
                    self._log.info("prefill done", rid=entry.rid, prefill=url,
                                   status=r.status_code, prompts=entry.expected)
                    return
                retryable = r.status_code >= 500
                self._log.error("prefill answered an error", rid=entry.rid, prefill=url,
                                attempt=attempt + 1, status=r.status_code, body=r.text[:500])
            if not retryable:
                break
        self.counters.prefill_failed += 1
        self._log.error("prefill dispatch gave up; decode fails the request at its KV deadline",
                        rid=entry.rid)

    # -- health and lifecycle ------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        c = self.counters
        return {
            "status": "ok",
            "prefill": list(self.config.prefill),
            "decode": list(self.config.decode),
            "metaserver": self.config.metaserver_url,
            "pending": len(self.table),
            "prefill_in_flight": len(self._tasks),
            "counters": dataclasses.asdict(c),
        }

    async def aclose(self) -> None:
        """Cancel Prefill dispatches still running and close the upstream client."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            done, _ = await asyncio.wait(tasks, timeout=self.config.shutdown_timeout_s)
            if len(done) < len(tasks):
                self._log.warning("prefill dispatches still running at shutdown",
                                  tasks=len(tasks) - len(done))
        await self._client.aclose()

    async def send_decode(self, url: str, body: Mapping[str, Any],
                          headers: Mapping[str, str]) -> httpx.Response:
        request = self._client.build_request("POST", url, json=dict(body), headers=dict(headers))
        return await self._client.send(request, stream=True)


class _Relay(Response):
    """Relays Decode's answer to the client, then forgets the pending request.

    A plain ASGI callable rather than a StreamingResponse: the status code is only
    known once Decode answers, and cleanup must run even when the client leaves
    before that.
    """

    def __init__(self, proxy: RendezvousProxy, rid: str, url: str, body: dict[str, Any],
                 headers: dict[str, str]) -> None:
        super().__init__(status_code=200)
        self._proxy = proxy
        self._rid = rid
        self._url = url
        self._body = body
        self._upstream_headers = headers  # not _headers: Response uses that name
        self._outcome = "not started"
        self._answered = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_disconnect, receive, tg.cancel_scope)
                await self._relay(send)
                tg.cancel_scope.cancel()
        finally:
            self._proxy.finish(self._rid, self._outcome)

    async def _watch_disconnect(self, receive: Receive, scope: anyio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if self._answered:
                    return  # servers report a disconnect once the answer is complete
                self._outcome = "client disconnected"
                self._proxy._log.info("client disconnected; closing decode request",
                                      rid=self._rid)
                scope.cancel()
                return

    async def _relay(self, send: Send) -> None:
        log = self._proxy._log
        try:
            response = await self._proxy.send_decode(self._url, self._body,
                                                     self._upstream_headers)
        except httpx.TransportError as exc:
            self._proxy.counters.decode_errors += 1
            self._outcome = "decode unreachable"
            message = f"decode instance {self._url} failed: {type(exc).__name__}: {exc}"
            log.error("decode request failed", rid=self._rid, error=message)
            await self._send_whole(send, 502, _error_body(502, message))
            self._answered = True
            return
        try:
            content_type = response.headers.get("content-type", "application/json")
            await send({
                "type": "http.response.start",
                "status": response.status_code,
                "headers": [(b"content-type", content_type.encode("latin-1")),
                            (b"x-request-id", self._rid.encode())],
            })
            self._outcome = f"decode status {response.status_code}"
            try:
                async for chunk in response.aiter_bytes():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.TransportError as exc:
                self._proxy.counters.decode_errors += 1
                self._outcome = "decode stream broken"
                message = f"decode instance {self._url} stream broke: {type(exc).__name__}: {exc}"
                log.error("decode stream failed", rid=self._rid, error=message)
                if content_type.startswith("text/event-stream"):
                    event = json.dumps(_error_body(502, message))
                    await send({"type": "http.response.body",
                                "body": f"data: {event}\n\n".encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            self._answered = True
            if self._outcome.startswith("decode status"):
                self._outcome = f"answered (decode status {response.status_code})"
        finally:
            with anyio.CancelScope(shield=True):
                await response.aclose()

    @staticmethod
    async def _send_whole(send: Send, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def create_app(
    config: ProxyConfig,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    log: Logger | None = None,
) -> FastAPI:
    """The proxy's ASGI app; ``app.state.proxy`` is its ``RendezvousProxy``."""
    proxy = RendezvousProxy(config, transport=transport, log=log)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.aclose()

    app = FastAPI(title="rd2h proxy", lifespan=lifespan)
    app.state.proxy = proxy

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle_client(request, Endpoint.COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.handle_client(request, Endpoint.CHAT)

    @app.post(METASERVER_PATH)
    async def metaserver(request: Request) -> JSONResponse:
        return await proxy.handle_post(request)

    @app.get("/healthcheck")
    async def healthcheck() -> dict[str, Any]:
        return proxy.health()

    return app
