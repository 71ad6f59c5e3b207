"""Relays Decode's answer to the client (an ASGI response) for ``rd2h proxy``.

Honest answers: the response to the client starts only with Decode's first answer
byte (or its end), so that a Prefill leg that fails for good before then is answered
with Prefill's own status and error body, and Decode's request is closed (vLLM aborts
it). A Decode stream that breaks before any byte reached the client is a 502; after
that, an event-stream gets an error event and no ``[DONE]``, and any other answer is
cut off (the connection closes with the body incomplete), never ended as if complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from rd2h.domain.wire.rendezvous import Endpoint, PendingRequest
from rd2h.ports.runtime import HopName, Logger, Timeline
from rd2h.proxy.error_bodies import error_body
from rd2h.proxy.metrics import HealthCounters, ProxyMetrics, status_reason
from rd2h.proxy.routing import Instance
from rd2h.proxy.upstream import Upstream, UpstreamError, describe


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
    instance: Instance | None = None  # the Decode instance (None in bare tests)
    traceparent: str | None = None
    prefill_pin: Instance | None = None  # sidecar mode: the Prefill the header named
    prefill_task: asyncio.Task[None] | None = None
    # Set (to a PrefillFailure) when the Prefill leg failed for good.
    prefill_failed: asyncio.Future[Any] | None = None
    status: int = 0  # Decode's answer status (0: none)
    tried: list[str] = field(default_factory=list)
    failed_over: bool = False  # sent to another Decode after a failure (at most once)

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
        opening = asyncio.ensure_future(self._open())
        waits: set[asyncio.Future[Any]] = {opening}
        if call.prefill_failed is not None:
            waits.add(call.prefill_failed)
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the client left: Decode's request goes too
            opening.cancel()
            with anyio.CancelScope(shield=True), contextlib.suppress(BaseException):
                await opening
            raise
        if not opening.done():  # Prefill failed for good before Decode said anything
            opening.cancel()
            with contextlib.suppress(BaseException):
                await opening
            failure = call.prefill_failed.result()  # type: ignore[union-attr]
            call.outcome, call.label = f"prefill failed: {failure.reason}", "prefill_failed"
            call.status = failure.status
            await send_whole(send, failure.status, failure.body, call.rid)
            self._answered = True
            return
        try:
            response, chunks, first = opening.result()
        except UpstreamError as exc:
            proxy.counters.decode_errors += 1
            call.outcome, call.label = "decode unreachable", "unavailable"
            message = f"decode instance {call.url} failed: {exc}"
            proxy.log.error("decode request failed", rid=call.rid, error=message)
            await send_whole(send, 502, error_body(502, message), call.rid)
            self._answered = True
            return
        except httpx.TransportError as exc:  # broke before its first byte
            self._broken(exc)
            await send_whole(send, 502, error_body(502, call.outcome), call.rid)
            self._answered = True
            return
        try:
            await self._stream(send, response, chunks, first)
        finally:
            with anyio.CancelScope(shield=True):
                await proxy.upstream.close(response)

    async def _open(self) -> tuple[httpx.Response, Any, bytes | None]:
        """Decode's response and its first body chunk (None: an empty body)."""
        response = await self._proxy.open_decode(self._call)
        try:
            chunks = response.aiter_bytes()
            first: bytes | None = None
            async for chunk in chunks:
                if chunk:
                    first = chunk
                    break
            return response, chunks, first
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._proxy.upstream.close(response)
            raise

    async def _failed_after_prefill(self, send: Send, status: int, chunks: Any,
                                    first: bytes | None) -> None:
        """Decode failed a request whose Prefill dispatch had failed for good (with
        ``--on-prefill-failure decode`` Decode decides, by its ``kv_load_failure_policy``):
        the client's error says why, and what Decode said, instead of Decode's bare
        error alone (vLLM's is "Internal server error")."""
        proxy, call = self._proxy, self._call
        said = _engine_message(await _read_some(chunks, first, QUOTED_ERROR_BYTES))
        reason = call.entry.prefill_failure
        message = (f"decode failed the request after its prefill failed ({reason}); "
                   f"decode said: {said}")
        call.outcome, call.label = f"prefill failed: {reason}", "prefill_failed"
        proxy.log.error("decode failed a request whose prefill failed", rid=call.rid,
                        status=status, prefill_error=reason, decode_said=said)
        await send_whole(send, status, error_body(status, message), call.rid)
        self._answered = True

    def _broken(self, exc: Exception) -> None:
        proxy, call = self._proxy, self._call
        proxy.counters.decode_errors += 1
        proxy.metrics.failure("decode", "stream_broken")
        call.label = "broken"
        call.outcome = f"decode instance {call.url} stream broke: {describe(exc)}"
        proxy.log.error("decode stream failed", rid=call.rid, error=call.outcome)

    async def _stream(self, send: Send, response: httpx.Response, chunks: Any,
                      first: bytes | None) -> None:
        proxy, call = self._proxy, self._call
        status = call.status = response.status_code
        if response.is_error:
            proxy.metrics.failure("decode", status_reason(status))
            # vLLM's answer to a request it failed (its kv_load_failure_policy ``fail``)
            # is a bare 500; any other status carries its own reason and passes as sent.
            if status == 500 and call.entry.prefill_failure is not None:
                await self._failed_after_prefill(send, status, chunks, first)
                return
        content_type = response.headers.get("content-type", "application/json")
        await send({
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type.encode("latin-1")),
                        (b"x-request-id", call.rid.encode())],
        })
        call.outcome = f"decode status {status}"
        if first is not None:
            proxy.metrics.decode_first_byte.labels(call.endpoint.path).observe(
                time.monotonic() - call.started)
            proxy.timeline.stamp(call.rid, HopName.PROXY_FIRST_BYTE)
            await send({"type": "http.response.body", "body": first, "more_body": True})
            try:
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": chunk,
                                "more_body": True})
            except httpx.TransportError as exc:
                self._broken(exc)
                if not content_type.startswith("text/event-stream"):
                    return  # cut off: the client sees an incomplete answer, not a whole one
                event = json.dumps(error_body(502, call.outcome))
                await send({"type": "http.response.body",
                            "body": f"data: {event}\n\n".encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self._answered = True
        if call.label != "broken":
            call.outcome = f"answered (decode status {status})"
            call.label = "engine_error" if response.is_error else "ok"


# How much of Decode's own error body the proxy quotes when it explains one.
QUOTED_ERROR_BYTES = 2048


async def _read_some(chunks: Any, first: bytes | None, limit: int) -> bytes:
    body = first or b""
    with contextlib.suppress(httpx.TransportError):
        async for chunk in chunks:
            if len(body) >= limit:
                break
            body += chunk
    return body[:limit]


def _engine_message(body: bytes) -> str:
    """The ``error.message`` (or ``message``) of an engine's JSON error body, else its
    text."""
    text = body.decode("utf-8", "replace")
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        data = json.loads(text)
        err = data.get("error", data)
        message = err.get("message") if isinstance(err, dict) else err
        if message:
            return str(message)
    return text.strip() or "no message"


async def send_whole(send: Send, status: int, payload: dict[str, Any],
                     rid: str | None = None) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json")]
    if rid is not None:
        headers.append((b"x-request-id", rid.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
