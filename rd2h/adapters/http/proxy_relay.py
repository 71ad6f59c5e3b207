"""Relays Decode's answer to the client (an ASGI response) for ``rd2h proxy``."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from rd2h.adapters.http.proxy_errors import error_body
from rd2h.adapters.http.proxy_metrics import HealthCounters, ProxyMetrics, status_reason
from rd2h.adapters.http.proxy_upstream import Upstream, UpstreamError, describe
from rd2h.domain.rendezvous import Endpoint, PendingRequest
from rd2h.ports.runtime import HopName, Logger, Timeline


@dataclass
class DecodeCall:
    """One client request on its way through Decode. ``rid`` and ``entry`` change when
    the request is sent again (a resend gets a new request id)."""

    rid: str
    endpoint: Endpoint
    body: dict[str, Any]
    headers: dict[str, str]
    decode: str
    entry: PendingRequest
    started: float = field(default_factory=time.monotonic)
    outcome: str = "not started"  # for the log
    label: str = "disconnected"  # for the requests_total series

    @property
    def url(self) -> str:
        return self.decode + self.endpoint.path


class RelayHost(Protocol):
    """What a relay needs of the proxy (``RendezvousProxy`` is one)."""

    log: Logger
    timeline: Timeline
    counters: HealthCounters
    metrics: ProxyMetrics
    upstream: Upstream

    async def open_decode(self, call: DecodeCall) -> httpx.Response: ...

    def finish(self, call: DecodeCall) -> None: ...


class DecodeRelay(Response):
    """Relays Decode's answer to the client, then forgets the pending request.

    A plain ASGI callable rather than a StreamingResponse: the status code is only
    known once Decode answers, and cleanup must run even when the client leaves
    before that.
    """

    def __init__(self, proxy: RelayHost, call: DecodeCall) -> None:
        super().__init__(status_code=200)
        self._proxy = proxy
        self._call = call
        self._answered = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_disconnect, receive, tg.cancel_scope)
                await self._relay(send)
                tg.cancel_scope.cancel()
        finally:
            self._proxy.finish(self._call)

    async def _watch_disconnect(self, receive: Receive, scope: anyio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if self._answered:
                    return  # servers report a disconnect once the answer is complete
                self._call.outcome = "client disconnected"
                self._call.label = "disconnected"
                self._proxy.log.info("client disconnected; closing decode request",
                                     rid=self._call.rid)
                scope.cancel()
                return

    async def _relay(self, send: Send) -> None:
        proxy, call = self._proxy, self._call
        try:
            response = await proxy.open_decode(call)
        except UpstreamError as exc:
            proxy.counters.decode_errors += 1
            call.outcome, call.label = "decode unreachable", "unavailable"
            message = f"decode instance {call.url} failed: {exc}"
            proxy.log.error("decode request failed", rid=call.rid, error=message)
            await send_whole(send, 502, error_body(502, message))
            self._answered = True
            return
        try:
            await self._stream(send, response)
        finally:
            with anyio.CancelScope(shield=True):
                await proxy.upstream.close(response)

    async def _stream(self, send: Send, response: httpx.Response) -> None:
        proxy, call = self._proxy, self._call
        status = response.status_code
        if response.is_error:
            proxy.metrics.failure("decode", status_reason(status))
        content_type = response.headers.get("content-type", "application/json")
        await send({
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type.encode("latin-1")),
                        (b"x-request-id", call.rid.encode())],
        })
        call.outcome = f"decode status {status}"
        broken = False
        first = True
        try:
            async for chunk in response.aiter_bytes():
                if first and chunk:
                    first = False
                    proxy.timeline.stamp(call.rid, HopName.PROXY_FIRST_BYTE)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.TransportError as exc:
            broken = True
            proxy.counters.decode_errors += 1
            proxy.metrics.failure("decode", "stream_broken")
            call.outcome, call.label = "decode stream broken", "broken"
            message = f"decode instance {call.url} stream broke: {describe(exc)}"
            proxy.log.error("decode stream failed", rid=call.rid, error=message)
            if content_type.startswith("text/event-stream"):
                event = json.dumps(error_body(502, message))
                await send({"type": "http.response.body",
                            "body": f"data: {event}\n\n".encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self._answered = True
        if not broken:
            call.outcome = f"answered (decode status {status})"
            call.label = "engine_error" if response.is_error else "ok"


async def send_whole(send: Send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
