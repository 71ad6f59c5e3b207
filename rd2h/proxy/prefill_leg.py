"""The Prefill leg of ``rd2h proxy``: one dispatch per request once Decode has posted.

Retries (the rule: only while no KV can have been handed off): a request is sent to
another Prefill instance only when the one tried refused the connection, and sent
once more to the same instance only when it closed a pooled connection before
reading the request. Any other failure (an HTTP error, a timeout, a connection lost
after the request went out) ends the dispatch: that Prefill may have read the
request and announced KV, and a second Prefill must not announce it again.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from rd2h.domain.wire.rendezvous import PendingRequest, prefill_body
from rd2h.ports.runtime import HopName, Logger, Timeline
from rd2h.proxy.error_bodies import error_body
from rd2h.proxy.metrics import HealthCounters, ProxyMetrics, status_reason
from rd2h.proxy.options import ProxyConfig
from rd2h.proxy.outcomes import DispatchFailures
from rd2h.proxy.router import EngineRouter
from rd2h.proxy.routing import Failure, Instance
from rd2h.proxy.upstream import (
    CONNECT,
    FAILOVER,
    STALE,
    AttemptTrace,
    Upstream,
    UpstreamError,
)


@dataclass(frozen=True)
class PrefillFailure:
    """How a Prefill dispatch failed for good, as the client is to be told."""

    status: int
    body: dict[str, Any]
    reason: str


def transport_cause(label: str) -> Failure:
    """The ejection cause of a transport failure (``proxy_upstream.failure_label``)."""
    if label in ("connect", "connect_timeout"):
        return Failure.CONNECT
    return Failure.TIMEOUT if label == "timeout" else Failure.BROKEN


def engine_error_body(r: httpx.Response, fallback: str) -> dict[str, Any]:
    """The engine's own JSON error object when it sent one, else ours."""
    try:
        body = r.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        return body
    return error_body(r.status_code, fallback)


class PrefillLeg:
    def __init__(self, config: ProxyConfig, upstream: Upstream, router: EngineRouter,
                 metrics: ProxyMetrics, counters: HealthCounters, log: Logger,
                 timeline: Timeline, failures: DispatchFailures | None = None) -> None:
        self._config = config
        self._failures = failures
        self._timeline = timeline
        self._upstream = upstream
        self._router = router
        self._metrics = metrics
        self._counters = counters
        self._log = log

    async def dispatch(self, entry: PendingRequest, headers: Mapping[str, str], posted: float,
                       pin: Instance | None = None,
                       extra_params: Mapping[str, Any] | None = None,
                       params: Mapping[str, Any] | None = None) -> PrefillFailure | None:
        """Send the request to Prefill (``pin``: that instance only); None once it
        answered 2xx. ``posted``: when the last metaserver post arrived (monotonic), or
        the request did (parallel dispatch: ``params``, sent instead of the posts')."""
        started = time.monotonic()
        self._timeline.stamp(entry.rid, HopName.PROXY_PREFILL_SENT)
        self._counters.prefill_dispatched += 1
        params = {**(entry.prefill_params() if params is None else params),
                  **(extra_params or {})}
        body = prefill_body(entry.body, entry.endpoint, params)
        failure = await self._send(entry, body, dict(headers), posted, pin)
        outcome = "ok" if failure is None else "failed"
        self._metrics.dispatches.labels(outcome).inc()
        self._metrics.prefill_leg.labels(outcome).observe(time.monotonic() - started)
        if failure is not None:
            self._counters.prefill_failed += 1
            entry.prefill_failure = failure.reason  # before Decode can fail the request
            told = 0 if self._failures is None else self._failures.record(
                entry.posts or entry.early, f"prefill dispatch failed: {failure.reason}")
            self._log.error("prefill dispatch gave up; decode is told to fail the request now",
                            rid=entry.rid, error=failure.reason, status=failure.status,
                            decode_requests=told)
        return failure

    async def _send(self, entry: PendingRequest, body: dict[str, Any], headers: dict[str, str],
                    posted: float, pin: Instance | None) -> PrefillFailure | None:
        deadline = self._config.prefill_timeout_s
        timeout = httpx.Timeout(deadline, connect=self._config.connect_timeout_s)
        tried: list[str] = []
        inst = pin if pin is not None else self._router.pick_prefill()
        if inst is None and await self._router.rescue("prefill"):
            inst = self._router.pick_prefill()
        fresh = resent = False
        while True:
            if inst is None:
                return PrefillFailure(503, error_body(503, "no Prefill instance is available"
                                      + (f" (tried {', '.join(tried)})" if tried else "")),
                                      "no Prefill instance is available")
            tried.append(inst.url)
            trace = AttemptTrace()
            current = inst  # ``inst`` may name the next instance by the time this ends
            self._router.begin(current)
            try:
                r = await self._upstream.send(
                    "POST", inst.url + entry.endpoint.path, json=body, headers=headers,
                    timeout=timeout, deadline_s=deadline, trace=trace, fresh=fresh)
            except UpstreamError as exc:
                self._metrics.failure("prefill", exc.label)
                if exc.resend == STALE and not resent:
                    resent = fresh = True
                    self._counters.prefill_resent += 1
                    self._metrics.retry("prefill", STALE)
                    self._log.info("prefill closed a reused connection before answering; "
                                   "sending again on a fresh connection", rid=entry.rid,
                                   prefill=inst.url, error=str(exc))
                    continue
                self._router.failed(inst, transport_cause(exc.label), str(exc))
                reason = f"{inst.url}: {exc}"
                if exc.resend == CONNECT and pin is None:
                    nxt = self._router.pick_prefill(exclude=tuple(tried))
                    self._log.warning("prefill instance unreachable", rid=entry.rid,
                                      prefill=inst.url, error=str(exc),
                                      next=None if nxt is None else nxt.url)
                    if nxt is not None:
                        self._metrics.retry("prefill", FAILOVER)
                        inst, fresh, resent = nxt, False, False
                        continue
                    return PrefillFailure(502, error_body(502, f"prefill failed: {reason}"),
                                          reason)
                self._log.error("prefill dispatch failed", rid=entry.rid, prefill=inst.url,
                                error=str(exc))
                status = 504 if exc.label == "timeout" else 502
                return PrefillFailure(status, error_body(status, f"prefill failed: {reason}"),
                                      reason)
            finally:
                self._router.end(current)
            if not r.is_error:
                self._router.succeeded(inst)
                self._counters.prefill_ok += 1
                self._timeline.stamp(entry.rid, HopName.PROXY_PREFILL_ANSWERED)
                # The write time where the transport reports it, else the answer's.
                self._metrics.prefill_dispatch.observe((trace.sent_at or time.monotonic())
                                                       - posted)
                self._log.debug("prefill done", rid=entry.rid, prefill=inst.url,
                               status=r.status_code, prompts=entry.expected)
                return None
            self._metrics.failure("prefill", status_reason(r.status_code))
            if r.status_code >= 500:
                self._router.failed(inst, Failure.ERROR, f"HTTP {r.status_code}")
            reason = f"{inst.url} answered HTTP {r.status_code}: {r.text[:200]}"
            self._log.error("prefill answered an error", rid=entry.rid, prefill=inst.url,
                            status=r.status_code, body=r.text[:500])
            return PrefillFailure(r.status_code, engine_error_body(r, reason), reason)
