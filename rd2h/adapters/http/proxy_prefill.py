"""The Prefill leg of ``rd2h proxy``: one dispatch per request once Decode has posted."""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from typing import Any

import httpx

from rd2h.adapters.http.proxy_config import ProxyConfig
from rd2h.adapters.http.proxy_metrics import HealthCounters, ProxyMetrics, status_reason
from rd2h.adapters.http.proxy_outcomes import DispatchFailures
from rd2h.adapters.http.proxy_upstream import FAILOVER, STALE, AttemptTrace, Upstream, UpstreamError
from rd2h.domain.rendezvous import PendingRequest, prefill_body
from rd2h.ports.runtime import HopName, Logger, Timeline


class PrefillLeg:
    """Sends a request to the Prefill instances (round robin)."""

    def __init__(self, config: ProxyConfig, upstream: Upstream, metrics: ProxyMetrics,
                 counters: HealthCounters, log: Logger, timeline: Timeline,
                 failures: DispatchFailures | None = None) -> None:
        self._config = config
        self._failures = failures
        self._timeline = timeline
        self._upstream = upstream
        self._metrics = metrics
        self._counters = counters
        self._log = log
        self._rr = itertools.count()

    async def dispatch(self, entry: PendingRequest, headers: Mapping[str, str],
                       posted: float) -> None:
        """Send the request to Prefill; on failure try the next instance once.

        A 4xx answer is not retried: the same body would be rejected again. A stale
        pooled connection is not a failure of the instance: the request goes once more
        to the same one on a fresh connection (``proxy_upstream``). ``posted``: when
        the last metaserver post arrived (monotonic).
        """
        started = time.monotonic()
        self._timeline.stamp(entry.rid, HopName.PROXY_PREFILL_SENT)
        self._counters.prefill_dispatched += 1
        body = prefill_body(entry.body, entry.endpoint, entry.prefill_params())
        urls = self._config.prefill
        first = next(self._rr) % len(urls)
        error = await self._send(entry, body, dict(headers),
                                 (urls[first], urls[(first + 1) % len(urls)]), posted)
        ok = error is None
        outcome = "ok" if ok else "failed"
        self._metrics.dispatches.labels(outcome).inc()
        self._metrics.prefill_leg.labels(outcome).observe(time.monotonic() - started)
        if error is not None:
            self._counters.prefill_failed += 1
            told = 0 if self._failures is None else self._failures.record(
                entry.posts, f"prefill dispatch failed: {error}")
            self._log.error("prefill dispatch gave up; decode is told to fail the request now "
                            "(watch)", rid=entry.rid, error=error, decode_requests=told)

    async def _send(self, entry: PendingRequest, body: dict[str, Any], headers: dict[str, str],
                    targets: tuple[str, str], posted: float) -> str | None:
        """None once a Prefill instance answered 2xx, else the last error."""
        deadline = self._config.prefill_timeout_s
        timeout = httpx.Timeout(deadline, connect=self._config.connect_timeout_s)
        attempt, fresh, resent = 0, False, False
        error = "no prefill instance was tried"
        while attempt < len(targets):
            url, last = targets[attempt], attempt + 1 == len(targets)
            report = self._log.error if last else self._log.warning
            trace = AttemptTrace()
            try:
                r = await self._upstream.send(
                    "POST", url + entry.endpoint.path, json=body, headers=headers,
                    timeout=timeout, deadline_s=deadline, trace=trace, fresh=fresh)
            except UpstreamError as exc:
                self._metrics.failure("prefill", exc.label)
                if exc.resend == STALE and not resent:
                    resent = fresh = True
                    self._counters.prefill_resent += 1
                    self._metrics.retry("prefill", STALE)
                    self._log.info("prefill closed a reused connection before answering; "
                                   "sending again on a fresh connection", rid=entry.rid,
                                   prefill=url, error=str(exc))
                    continue
                report("prefill dispatch failed", rid=entry.rid, prefill=url,
                       attempt=attempt + 1, error=str(exc))
                error = f"{url}: {exc}"
            else:
                if not r.is_error:
                    self._counters.prefill_ok += 1
                    self._timeline.stamp(entry.rid, HopName.PROXY_PREFILL_ANSWERED)
                    # The write time where the transport reports it, else the answer's.
                    sent = trace.sent_at or time.monotonic()
                    self._metrics.prefill_dispatch.observe(sent - posted)
                    self._log.info("prefill done", rid=entry.rid, prefill=url,
                                   status=r.status_code, prompts=entry.expected)
                    return None
                self._metrics.failure("prefill", status_reason(r.status_code))
                error = f"{url} answered HTTP {r.status_code}: {r.text[:200]}"
                report("prefill answered an error", rid=entry.rid, prefill=url,
                       attempt=attempt + 1, status=r.status_code, body=r.text[:500])
                if r.status_code < 500:
                    return error
            if not last:
                self._metrics.retry("prefill", FAILOVER)
            attempt, fresh = attempt + 1, False
        return error
