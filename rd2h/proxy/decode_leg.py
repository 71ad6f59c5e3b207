"""The Decode leg of ``rd2h proxy``: send the client's request to a Decode instance,
once more on a fresh connection when a pooled one was stale, to the next instance
when one refuses the connection, and to another instance once whatever else failed
before any response (an engine killed while the request was on its way): all only
while no metaserver post arrived for it, so nothing was handed off to a Prefill."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx

from rd2h.domain.wire.rendezvous import contact_of, decode_body
from rd2h.ports.runtime import HopName
from rd2h.proxy.prefill_leg import transport_cause
from rd2h.proxy.relay import DecodeCall
from rd2h.proxy.upstream import CONNECT, FAILOVER, STALE, UpstreamError


class DecodeLeg:
    def __init__(self, proxy: Any) -> None:
        """``proxy``: the ``RendezvousProxy`` whose table, router and upstream it uses."""
        self._p = proxy

    async def open(self, call: DecodeCall) -> httpx.Response:
        """Send the request to Decode; its response once the headers arrived.

        Sent again (``_resend``) on a stale pooled connection (once), to the next
        instance when one refuses the connection, or to another instance once after any
        other failure; raises ``UpstreamError``.
        """
        fresh = stale_resent = False
        while True:
            try:
                response = await self._p.upstream.send(
                    "POST", call.url, json=decode_body(
                        call.body, self._p.config.metaserver_url, traceparent=call.traceparent,
                        local_prefill_tokens=self._p.config.local_prefill_tokens,
                        sent_contact=next(map(contact_of, call.entry.early.values()), None)),
                    headers=call.headers, stream=True, fresh=fresh)
            except UpstreamError as exc:
                self._p.metrics.failure("decode", exc.label)
                if exc.resend != STALE and call.instance is not None:
                    self._p.router.failed(call.instance, transport_cause(exc.label), str(exc))
                how = None if exc.resend == STALE and stale_resent else exc.resend
                if not self._resend(call, exc, how):
                    raise
                stale_resent = stale_resent or how == STALE
                fresh = how == STALE
                continue
            self._p.metrics.decode_response_start.labels(call.endpoint.path).observe(
                time.monotonic() - call.started)
            self._p.timeline.stamp(call.rid, HopName.PROXY_DECODE_HEADERS)
            return response

    def _resend(self, call: DecodeCall, exc: UpstreamError, how: str | None) -> bool:
        """Prepare ``call`` to be sent again, if that is safe; see ``proxy_upstream``.

        ``how``: the connection rule's reason (``exc.resend``), or None for any other
        failure before a response. No metaserver post may have arrived (a post proves
        Decode admitted the request and a Prefill may be computing for it). The resend
        gets a new request id, so nothing of a first attempt an engine might have read
        after all can match the second one's rendezvous: an engine that admits the old
        one later has its post refused and fails it. A connection refused moves to the
        next Decode instance; any other failure (the engine died or stalled with the
        request unanswered) moves to another instance, once per request, when there is
        one.
        """
        if call.entry.posts:
            return False
        if how is None:
            if call.failed_over:
                return False
            call.failed_over = True
        if how in (CONNECT, None):
            nxt = self._p.router.pick_decode(call.body, exclude=tuple(call.tried))
            if nxt is None:
                return False
            if call.instance is not None:
                self._p.router.end(call.instance)
            self._p.router.begin(nxt)
            call.instance, call.decode = nxt, nxt.url
            call.tried.append(nxt.url)
        if call.entry.early and call.prefill_task is not None:
            call.prefill_task.cancel()  # Prefill computes for the old id: not needed now
        old = call.rid
        self._p.table.close(old)
        self._p.calls.pop(old, None)
        call.rid = uuid.uuid4().hex
        self._p.timeline.stamp(call.rid, HopName.PROXY_RECEIVED, call.traceparent)
        call.entry = self._p.table.open(call.rid, call.endpoint, call.body, call.entry.expected,
                                     time.monotonic())
        call.headers["X-Request-Id"] = call.rid
        self._p.calls[call.rid] = call
        self._p.counters.decode_resent += 1
        if how == STALE:
            self._p.metrics.retry("decode", STALE)
            self._p.log.info("decode closed a reused connection before answering; sending again "
                          "on a fresh connection", rid=old, new_rid=call.rid, decode=call.decode,
                          error=str(exc))
        else:
            self._p.metrics.retry("decode", FAILOVER)
            self._p.log.warning(
                "decode instance unreachable; sending to the next one" if how == CONNECT
                else "decode instance failed before answering and before any hand-off; "
                     "sending to another one", rid=old, new_rid=call.rid,
                decode=call.decode, error=str(exc))
        return True

