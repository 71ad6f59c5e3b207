"""The ``rd2h proxy`` rendezvous proxy (FastAPI + httpx): Decode first, Prefill on D's post.

Flow for one client request (spec 3.1, 3.2):

1. Name it ``rid`` (uuid4 hex), record it as pending, send the client's body to a
   Decode instance (round robin) with ``X-Request-Id: rid`` and
   ``kv_transfer_params = {do_remote_prefill: true, metaserver: <public>/v1/metaserver}``,
   and relay Decode's answer (SSE or JSON) to the client as it arrives
   (``proxy_relay``).
2. Decode's connector posts its contact information to ``/v1/metaserver`` once per
   prompt; the rules for matching posts to requests live in
   ``rd2h.domain.rendezvous``.
3. When every expected post is in, send the original body to a Prefill instance
   (round robin) as a background task: one output token, no streaming, the posted
   params (or ``batch_kv_transfer_params`` for a prompt list). A failed dispatch is
   logged and tried once on the next Prefill instance.
4. The pending entry goes away when Decode's answer ends, errors or the client
   disconnects; closing the Decode connection on a disconnect makes vLLM abort it.

Connections to the engines are pooled; a request that met a pooled connection the
engine had closed (its keep-alive) is sent once more on a fresh connection, on
both legs, before any byte reached the client (the rule: ``proxy_upstream``). A
Decode request is sent again only while no metaserver post arrived for it, under a
new request id. ``GET /v1/models`` is answered by the engines (``proxy_models``),
``GET /metrics`` from the proxy's own Prometheus registry (``proxy_metrics``).

Every upstream wait has a deadline (connect, Decode's next bytes, the whole Prefill
request, the whole models request).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from rd2h.adapters.http.proxy_config import (
    FORWARDED_HEADERS,
    METASERVER_PATH,
    ProxyConfig,
)
from rd2h.adapters.http.proxy_errors import error_body
from rd2h.adapters.http.proxy_metrics import HealthCounters, ProxyMetrics
from rd2h.adapters.http.proxy_models import MODELS_PATH, fetch_models
from rd2h.adapters.http.proxy_outcomes import DispatchFailures, WatchError
from rd2h.adapters.http.proxy_prefill import PrefillLeg
from rd2h.adapters.http.proxy_relay import DecodeCall, DecodeRelay
from rd2h.adapters.http.proxy_upstream import (
    CONNECT,
    FAILOVER,
    STALE,
    Upstream,
    UpstreamError,
)
from rd2h.domain.rendezvous import (
    ClientRequestError,
    Endpoint,
    MetaserverPostError,
    PostStatus,
    RendezvousTable,
    UnexpectedPost,
    UnknownRendezvous,
    count_prompts,
    decode_body,
)
from rd2h.ports.runtime import HopName, Logger, Timeline

__all__ = ["ProxyConfig", "RendezvousProxy", "create_app"]


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


class RendezvousProxy:
    """State and upstream I/O of one proxy process, driven from one event loop."""

    def __init__(
        self,
        config: ProxyConfig,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        log: Logger | None = None,
        timeline: Timeline | None = None,
    ) -> None:
        if log is None:
            from rd2h.adapters.logging import make_logger

            log = make_logger("proxy", 0)
        if timeline is None:  # $RD2H_TIMELINE_DIR, else none
            from rd2h.adapters.logging.timeline import timeline as from_env

            timeline = from_env()
        self.timeline = timeline
        self.config = config
        self.table = RendezvousTable()
        self.counters = HealthCounters()
        self.log = log
        self.upstream = Upstream(
            connect_timeout_s=config.connect_timeout_s, read_timeout_s=config.decode_timeout_s,
            keepalive_expiry_s=config.engine_keepalive_s, transport=transport,
        )
        self._decode_rr = itertools.count()
        self._models_rr = itertools.count()
        self._headers: dict[str, dict[str, str]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.metrics = ProxyMetrics(pending=lambda: len(self.table),
                                    prefill_in_flight=lambda: len(self._tasks))
        self.failures = DispatchFailures()
        self.prefill = PrefillLeg(config, self.upstream, self.metrics, self.counters, log,
                                  timeline, self.failures)

    # -- client requests ----------------------------------------------------------------

    def _refuse(self, endpoint: Endpoint, message: str) -> JSONResponse:
        self.metrics.requests.labels(endpoint.path, "invalid").inc()
        return _error(400, message)

    async def handle_client(self, request: Request, endpoint: Endpoint) -> Response:
        started = time.monotonic()
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return self._refuse(endpoint, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return self._refuse(
                endpoint, f"request body must be a JSON object, not {type(body).__name__}")
        try:
            expected = count_prompts(body, endpoint)
        except ClientRequestError as exc:
            return self._refuse(endpoint, str(exc))
        if "kv_transfer_params" in body:
            self.log.warning("client kv_transfer_params replaced by the proxy's")
        rid = uuid.uuid4().hex
        self.timeline.stamp(rid, HopName.PROXY_RECEIVED)
        entry = self.table.open(rid, endpoint, body, expected, time.monotonic())
        self.counters.requests += 1
        headers = {"X-Request-Id": rid, **_forwarded(request)}
        self._headers[rid] = headers
        decode = self.config.decode[next(self._decode_rr) % len(self.config.decode)]
        self.log.debug("request to decode", rid=rid, decode=decode, prompts=expected)
        self.metrics.in_flight.labels(endpoint.path).inc()
        return DecodeRelay(self, DecodeCall(rid, endpoint, body, headers, decode, entry, started))

    async def open_decode(self, call: DecodeCall) -> httpx.Response:
        """Send the request to Decode; its response once the headers arrived.

        Sent again at most once (``_resend_decode``); raises ``UpstreamError``.
        """
        fresh = False
        while True:
            try:
                response = await self.upstream.send(
                    "POST", call.url, json=decode_body(call.body, self.config.metaserver_url),
                    headers=call.headers, stream=True, fresh=fresh)
            except UpstreamError as exc:
                self.metrics.failure("decode", exc.label)
                if fresh or not self._resend_decode(call, exc):
                    raise
                fresh = True
                continue
            self.metrics.decode_response_start.labels(call.endpoint.path).observe(
                time.monotonic() - call.started)
            self.timeline.stamp(call.rid, HopName.PROXY_DECODE_HEADERS)
            return response

    def _resend_decode(self, call: DecodeCall, exc: UpstreamError) -> bool:
        """Prepare ``call`` to be sent again, if that is safe; see ``proxy_upstream``.

        Besides the connection rule, no metaserver post may have arrived (a post proves
        Decode admitted the request). The resend gets a new request id, so nothing of a
        first attempt an engine might have read after all can match the second one's
        rendezvous. A connection refused moves to the next Decode instance.
        """
        if exc.resend is None or call.entry.posts:
            return False
        if exc.resend == CONNECT:
            decodes = self.config.decode
            if len(decodes) < 2:
                return False
            call.decode = decodes[(decodes.index(call.decode) + 1) % len(decodes)]
        old = call.rid
        self.table.close(old)
        self._headers.pop(old, None)
        call.rid = uuid.uuid4().hex
        self.timeline.stamp(call.rid, HopName.PROXY_RECEIVED)
        call.entry = self.table.open(call.rid, call.endpoint, call.body, call.entry.expected,
                                     time.monotonic())
        call.headers["X-Request-Id"] = call.rid
        self._headers[call.rid] = call.headers
        self.counters.decode_resent += 1
        if exc.resend == STALE:
            self.metrics.retry("decode", STALE)
            self.log.info("decode closed a reused connection before answering; sending again "
                          "on a fresh connection", rid=old, new_rid=call.rid, decode=call.decode,
                          error=str(exc))
        else:
            self.metrics.retry("decode", FAILOVER)
            self.log.warning("decode instance unreachable; sending to the next one", rid=old,
                             new_rid=call.rid, decode=call.decode, error=str(exc))
        return True

    def finish(self, call: DecodeCall) -> None:
        """Forget a request once Decode's answer has ended (any way it ends)."""
        self._headers.pop(call.rid, None)
        self.timeline.stamp(call.rid, HopName.PROXY_DONE)
        entry = self.table.close(call.rid)
        path = call.endpoint.path
        self.metrics.in_flight.labels(path).dec()
        self.metrics.requests.labels(path, call.label).inc()
        self.metrics.request_duration.labels(path).observe(time.monotonic() - call.started)
        if entry is not None and not entry.dispatched:
            self.counters.incomplete_rendezvous += 1
            self.log.warning(
                "decode answer ended before every rendezvous post arrived; prefill not sent",
                rid=call.rid, outcome=call.outcome, posts=len(entry.posts),
                expected=entry.expected,
            )

    async def handle_models(self, request: Request, path: str = MODELS_PATH) -> Response:
        """``GET /v1/models``, ``POST /tokenize`` or ``/detokenize``, from the engines."""
        started = time.monotonic()
        body = await request.body() if request.method == "POST" else None
        self.metrics.in_flight.labels(path).inc()
        decodes = list(self.config.decode)
        first = next(self._models_rr) % len(decodes)
        engines = [*decodes[first:], *decodes[:first], *self.config.prefill]
        try:
            response, label = await fetch_models(
                self.upstream, engines, _forwarded(request),
                deadline_s=self.config.models_timeout_s,
                connect_timeout_s=self.config.connect_timeout_s, log=self.log,
                metrics=self.metrics, path=path, body=body)
        finally:
            self.metrics.in_flight.labels(path).dec()
        self.metrics.requests.labels(path, label).inc()
        self.metrics.request_duration.labels(path).observe(time.monotonic() - started)
        return response

    # -- metaserver ----------------------------------------------------------------------

    def _reject_post(self, status: int, label: str, message: str) -> JSONResponse:
        self.counters.metaserver_rejected += 1
        self.metrics.posts.labels(label).inc()
        return _error(status, message)

    async def handle_post(self, request: Request) -> JSONResponse:
        received = time.monotonic()
        self.counters.metaserver_posts += 1
        try:
            post = json.loads(await request.body())
            outcome = self.table.post(post)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return self._reject_post(400, "rejected", f"metaserver post is not valid JSON: {exc}")
        except MetaserverPostError as exc:
            return self._reject_post(400, "rejected", str(exc))
        except UnknownRendezvous as exc:
            self.log.warning("metaserver post for an unknown request", error=str(exc))
            return self._reject_post(404, "unknown", str(exc))
        except UnexpectedPost as exc:
            self.log.warning("unexpected metaserver post", error=str(exc))
            return self._reject_post(409, "unexpected", str(exc))
        entry = outcome.request
        self.metrics.posts.labels(outcome.status.value).inc()
        if outcome.status is PostStatus.DISPATCH:
            self.timeline.stamp(entry.rid, HopName.PROXY_POST)
            self.metrics.decode_admission.observe(received - entry.created)
            headers = self._headers.get(entry.rid, {"X-Request-Id": entry.rid})
            self._spawn(self.prefill.dispatch(entry, headers, received))
        return JSONResponse({
            "status": outcome.status.value, "request_id": outcome.request_id,
            "received": len(entry.posts), "expected": entry.expected,
        })

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- health and lifecycle ------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "prefill": list(self.config.prefill),
            "decode": list(self.config.decode),
            "metaserver": self.config.metaserver_url,
            "pending": len(self.table),
            "prefill_in_flight": len(self._tasks),
            "counters": dataclasses.asdict(self.counters),
        }

    async def aclose(self) -> None:
        """Cancel Prefill dispatches still running and close the upstream clients."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            done, _ = await asyncio.wait(tasks, timeout=self.config.shutdown_timeout_s)
            if len(done) < len(tasks):
                self.log.warning("prefill dispatches still running at shutdown",
                                 tasks=len(tasks) - len(done))
        await self.upstream.aclose()


def _forwarded(request: Request) -> dict[str, str]:
    return {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}


def create_app(
    config: ProxyConfig,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    log: Logger | None = None,
    timeline: Timeline | None = None,
) -> FastAPI:
    """The proxy's ASGI app; ``app.state.proxy`` is its ``RendezvousProxy``."""
    proxy = RendezvousProxy(config, transport=transport, log=log, timeline=timeline)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.aclose()

    app = FastAPI(title="rd2h proxy", lifespan=lifespan)
    app.state.proxy = proxy
    app.state.before_shutdown = proxy.failures.close  # watches answer at once

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle_client(request, Endpoint.COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.handle_client(request, Endpoint.CHAT)

    @app.post(METASERVER_PATH)
    async def metaserver(request: Request) -> JSONResponse:
        return await proxy.handle_post(request)

    @app.post(METASERVER_PATH + "/watch")
    async def watch(request: Request) -> JSONResponse:
        try:
            return JSONResponse(await proxy.failures.watch(json.loads(await request.body())))
        except (json.JSONDecodeError, UnicodeDecodeError, WatchError) as exc:
            return _error(400, f"bad watch request: {exc}")

    @app.get(MODELS_PATH)
    async def models(request: Request) -> Response:
        return await proxy.handle_models(request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await proxy.handle_models(request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await proxy.handle_models(request, "/detokenize")

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        body, content_type = proxy.metrics.render(request.headers.get("accept", ""))
        return Response(body, media_type=content_type)

    @app.get("/healthcheck")
    async def healthcheck() -> dict[str, Any]:
        return proxy.health()

    return app
