"""The ``rd2h proxy`` rendezvous proxy (FastAPI + httpx): Decode first, Prefill on D's post.

Flow for one client request (spec 3.1, 3.2):

1. Name it ``rid`` (uuid4 hex), record it as pending, send the client's body to a
   Decode instance (picked by ``proxy_router``: policy, health, prefix affinity) with
   ``X-Request-Id: rid``, a ``traceparent`` (``proxy_trace``) and
   ``kv_transfer_params = {do_remote_prefill: true, metaserver: <public>/v1/metaserver}``,
   and relay Decode's answer (SSE or JSON) to the client as it arrives
   (``proxy_relay``).
2. Decode's connector posts its contact information to ``/v1/metaserver`` once per
   prompt; the rules for matching posts to requests live in
   ``rd2h.domain.wire.rendezvous``.
3. When every expected post is in, send the original body to a Prefill instance
   as a background task: one output token, no streaming, the posted params (or
   ``batch_kv_transfer_params`` for a prompt list); retries: ``proxy_prefill``. A post
   saying Decode computes the prompt itself (``local``) means no Prefill dispatch.
   A Prefill leg that fails for good is answered to the client with Prefill's status
   and body, and Decode's request is closed (``proxy_relay``).
4. The pending entry goes away when Decode's answer ends, errors or the client
   disconnects; closing the Decode connection on a disconnect makes vLLM abort it,
   and a Prefill dispatch still running is cancelled too.

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
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from rd2h.domain.wire.rendezvous import (
    ClientRequestError,
    Endpoint,
    MetaserverPostError,
    PendingRequest,
    PostStatus,
    RendezvousTable,
    UnexpectedPost,
    UnknownRendezvous,
    contact_of,
    count_prompts,
    early_params,
    predicted_request_id,
)
from rd2h.ports.runtime import NO_TIMELINE, SILENT_LOGGER, HopName, Logger, Timeline
from rd2h.proxy.admin import add_routes
from rd2h.proxy.decode_leg import DecodeLeg
from rd2h.proxy.error_bodies import error_body
from rd2h.proxy.metrics import HealthCounters, ProxyMetrics
from rd2h.proxy.models import MODELS_PATH, engine_answer
from rd2h.proxy.options import (
    FORWARDED_HEADERS,
    METASERVER_PATH,
    ProxyConfig,
)
from rd2h.proxy.outcomes import DispatchFailures, WatchError
from rd2h.proxy.prefill_leg import PrefillFailure, PrefillLeg
from rd2h.proxy.relay import DecodeCall, DecodeRelay
from rd2h.proxy.router import EngineRouter
from rd2h.proxy.routing import Failure
from rd2h.proxy.trace import traceparent_for
from rd2h.proxy.upstream import (
    Upstream,
)

__all__ = ["ProxyConfig", "RendezvousProxy", "create_app"]


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


PREFILLER_HEADER = "x-prefiller-host-port"
# Ends of a Decode answer after which a Prefill dispatch still running is cancelled.
_CANCEL_PREFILL = frozenset({"disconnected", "broken", "engine_error", "unavailable"})


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
        # The composition root (``rd2h.bootstrap.gateways.serve_proxy``) hands both in;
        # built bare (tests), the proxy logs nothing and stamps nothing.
        log = log if log is not None else SILENT_LOGGER
        timeline = timeline if timeline is not None else NO_TIMELINE
        self.timeline = timeline
        self.config = config
        self.table = RendezvousTable()
        self.counters = HealthCounters()
        self.log = log
        self.upstream = Upstream(
            connect_timeout_s=config.connect_timeout_s, read_timeout_s=config.decode_timeout_s,
            keepalive_expiry_s=config.engine_keepalive_s, transport=transport,
            sockets=config.upstream_sockets,
        )
        self.calls: dict[str, DecodeCall] = {}
        # Parallel dispatch: each Decode instance's contact, as it posted it last.
        self.contacts: dict[str, dict[str, Any]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.metrics = ProxyMetrics(pending=lambda: len(self.table),
                                    prefill_in_flight=lambda: len(self._tasks))
        self.router = EngineRouter(config, self.metrics, log, transport=transport)
        self.failures = DispatchFailures()
        self.decode = DecodeLeg(self)
        self.prefill = PrefillLeg(config, self.upstream, self.router, self.metrics,
                                  self.counters, log, timeline, self.failures)

    # -- client requests ----------------------------------------------------------------

    def _refuse(self, endpoint: Endpoint, message: str, status: int = 400,
                label: str = "invalid") -> JSONResponse:
        self.metrics.requests.labels(endpoint.path, label).inc()
        return _error(status, message)

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
        self.router.start()
        pin = None
        named = request.headers.get(PREFILLER_HEADER) if self.config.prefiller_header else None
        if named:
            pin = self.router.prefill_named(named)
            if pin is None:
                return self._refuse(endpoint, f"{PREFILLER_HEADER} {named!r} is not one of "
                                    "this proxy's Prefill instances", 403)
        elif self.config.on_prefill_failure == "fail" and not self.router.pools[
                "prefill"].ready() and not await self.router.rescue("prefill"):
            return self._refuse(endpoint, "no Prefill instance is available (all ejected, "
                                "draining or removed)", 503, "unavailable")
        decode = self.router.pick_decode(body)
        if decode is None and await self.router.rescue("decode"):
            decode = self.router.pick_decode(body)
        if decode is None:
            return self._refuse(endpoint, "no Decode instance is available (all ejected, "
                                "draining or removed)", 503, "unavailable")
        rid = uuid.uuid4().hex
        trace = traceparent_for(request.headers.get("traceparent"))
        self.timeline.stamp(rid, HopName.PROXY_RECEIVED, trace)
        entry = self.table.open(rid, endpoint, body, expected, time.monotonic())
        self.counters.requests += 1
        headers = {"X-Request-Id": rid, "traceparent": trace, **_forwarded(request)}
        call = DecodeCall(rid, endpoint, body, headers, decode.url, entry, started,
                          instance=decode, traceparent=trace, prefill_pin=pin,
                          prefill_failed=asyncio.get_running_loop().create_future(),
                          tried=[decode.url])
        self.calls[rid] = call
        self.router.begin(decode)
        self.log.debug("request to decode", rid=rid, decode=decode.url, prompts=expected,
                       traceparent=trace)
        self.metrics.in_flight.labels(endpoint.path).inc()
        if (self.config.dispatch == "parallel" and expected == 1
                and not self.config.local_prefill_tokens
                and (contact := self.contacts.get(decode.url)) is not None):
            self._dispatch_early(call, contact)
        return DecodeRelay(self, call)

    def _dispatch_early(self, call: DecodeCall, contact: dict[str, Any]) -> None:
        """Parallel dispatch: send the request to Prefill now, with the contact its
        Decode instance posted last; Decode's own post confirms it (``handle_post``)."""
        entry = call.entry
        request_id = predicted_request_id(call.endpoint, call.rid)
        entry.early = {request_id: early_params(contact, request_id)}
        entry.dispatched = True
        self.counters.prefill_parallel += 1
        call.prefill_task = self._spawn(self._prefill(entry, call, time.monotonic(),
                                                      entry.early[request_id]))

    async def open_decode(self, call: DecodeCall) -> httpx.Response:
        return await self.decode.open(call)

    def finish(self, call: DecodeCall) -> None:
        """Forget a request once Decode's answer has ended (any way it ends)."""
        self.calls.pop(call.rid, None)
        task = call.prefill_task
        if task is not None and not task.done() and call.label in _CANCEL_PREFILL:
            task.cancel()  # its KV has nowhere to go; closing it makes Prefill abort it
            self.log.info("prefill dispatch cancelled", rid=call.rid, because=call.outcome)
        if call.prefill_failed is not None and not call.prefill_failed.done():
            call.prefill_failed.cancel()
        if call.instance is not None:
            self.router.end(call.instance)
            if call.label == "ok" or (call.label == "engine_error" and call.status < 500):
                self.router.succeeded(call.instance)
            elif call.label == "engine_error":
                self.router.failed(call.instance, Failure.ERROR, f"HTTP {call.status}")
            elif call.label == "broken":
                self.router.failed(call.instance, Failure.BROKEN, call.outcome)
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
        return await engine_answer(self, request, _forwarded(request), path)

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
        call = self.calls.get(entry.rid)
        if call is not None and call.instance is not None and (
                contact := contact_of(post)) is not None:
            self.contacts[call.instance.url] = contact  # the next request's early dispatch
        if entry.early:
            self._early_posted(entry, call, outcome.status, post, received)
        elif outcome.status is PostStatus.LOCAL:
            self.counters.prefill_skipped += 1
            self.metrics.prefill_skipped.labels("decode_holds_prompt").inc()
            self.log.info("decode computes the prompt itself; no prefill dispatch",
                          rid=entry.rid, cached_tokens=post.get("remote_cached_tokens"),
                          prompt_tokens=post.get("prompt_tokens"))
        elif outcome.status is PostStatus.DISPATCH:
            self.timeline.stamp(entry.rid, HopName.PROXY_POST)
            self.metrics.decode_admission.observe(received - entry.created)
            task = self._spawn(self._prefill(entry, call, received))
            if call is not None:
                call.prefill_task = task
        return JSONResponse({
            "status": outcome.status.value, "request_id": outcome.request_id,
            "received": len(entry.posts), "expected": entry.expected,
        })

    def _early_posted(self, entry: PendingRequest, call: DecodeCall | None,
                      status: PostStatus, post: Any, received: float) -> None:
        """Decode posted a request Prefill already has (parallel dispatch). The same
        contact: nothing to do. A local notice: Prefill's work is not needed (its
        announcements end skipped). Another contact (the instance restarted, or vLLM named
        the request otherwise): the early dispatch is cancelled and the request sent again
        with what Decode posted."""
        self.metrics.decode_admission.observe(received - entry.created)
        if status is PostStatus.DUPLICATE or status is PostStatus.CONFIRMED:
            return
        task = call.prefill_task if call is not None else None
        if task is not None and not task.done():
            task.cancel()
        entry.early = {}
        if status is PostStatus.LOCAL:
            self.counters.prefill_skipped += 1
            self.metrics.prefill_skipped.labels("decode_holds_prompt").inc()
            self.log.info("decode computes the prompt itself; the parallel prefill dispatch "
                          "is cancelled", rid=entry.rid)
            return
        self.counters.parallel_mismatch += 1
        self.log.warning("decode posted another contact than the one its parallel prefill "
                         "dispatch used; sending the request to prefill again",
                         rid=entry.rid, request_id=post.get("request_id"),
                         engine=post.get("remote_engine_id"))
        self.timeline.stamp(entry.rid, HopName.PROXY_POST)
        task = self._spawn(self._prefill(entry, call, received))
        if call is not None:
            call.prefill_task = task

    async def _prefill(self, entry: Any, call: DecodeCall | None, posted: float,
                       params: dict[str, Any] | None = None) -> None:
        """One Prefill dispatch; ``params``: the early (parallel) dispatch's own."""
        if call is None:
            headers, pin, extra = {"X-Request-Id": entry.rid}, None, {}
        else:
            headers, pin = call.headers, call.prefill_pin
            extra = {"traceparent": call.traceparent} if call.traceparent else {}
        failure: PrefillFailure | None = await self.prefill.dispatch(
            entry, headers, posted, pin, extra, params=params)
        if params is not None and (call is None or call.entry is not entry
                                   or entry.early.get(params.get("request_id")) is not params):
            return  # an early dispatch since replaced: its outcome is not the request's
        if failure is not None and call is not None and call.prefill_failed is not None \
                and not call.prefill_failed.done() and self.config.on_prefill_failure == "fail":
            call.prefill_failed.set_result(failure)

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- health and lifecycle ------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok" if self.router.ready() else "unavailable",
            "prefill": [i.url for i in self.router.pools["prefill"]],
            "decode": [i.url for i in self.router.pools["decode"]],
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
        await self.router.aclose()
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
        proxy.router.start()  # /health probes from the start
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

    add_routes(app, proxy)
    return app
