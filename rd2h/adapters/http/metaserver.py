"""Metaserver client (httpx): Decode's scheduler posts its contact information to the
proxy without blocking the scheduler step (spec 3.1 item 4).

Posts are queued and sent by a few background threads. A transport error
(connection refused, timeout, connection dropped) is retried ``retries`` times at
once, then every ``retry_delay_s`` until the request is cancelled or the client
shuts down: the proxy may come up after the engine, and a lost post would leave
the request waiting for KV until its deadline. An HTTP error status is counted
as delivered and logged (older proxies answer errors for posts they do not
need). Every wait in here is bounded: one attempt by ``timeout_s``, an idle
worker wakes at least every ``idle_wake_s``, ``shutdown`` joins within its
deadline.

Once a post is delivered, the request is *watched* (``rd2h.adapters.http.metaserver_watch``):
one long-poll per metaserver and engine asks the proxy which posted requests will get
no KV (their Prefill dispatch failed), and ``take_failed`` hands them to the scheduler.
"""

from __future__ import annotations

import heapq
import itertools
import json
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from rd2h.adapters.http.metaserver_watch import Watcher
from rd2h.ports.metaserver import MetaserverStats
from rd2h.ports.runtime import Logger

_LOG_EVERY_SLOW_RETRIES = 30  # a dead metaserver is logged about every 30 retries, not each one


@dataclass(eq=False)
class _Post:
    request_id: str
    url: str
    body: bytes
    attempts: int = 0
    in_flight: bool = False
    cancelled: bool = False
    engine: str | None = None  # the posting engine (``remote_engine_id``): watched by it


@dataclass(frozen=True)
class _Answered:
    status: int
    text: str


@dataclass(frozen=True)
class _TransportFailure:
    error: str


@dataclass(frozen=True)
class _Unrecoverable:
    error: str


def _check_url(url: str) -> None:
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise ValueError(f"metaserver URL {url!r} is not a valid URL: {exc}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"metaserver URL {url!r} must be http:// or https:// with a host")


class MetaserverClient:
    """Non-blocking metaserver poster (implements ``rd2h.ports.metaserver.MetaserverPoster``).

    ``transport`` is for tests (``httpx.MockTransport``); production uses httpx's
    default connection pool.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 5.0,
        retries: int = 3,
        retry_delay_s: float = 1.0,
        workers: int = 2,
        idle_wake_s: float = 1.0,
        log: Logger | None = None,
        transport: httpx.BaseTransport | None = None,
        watch: bool = True,
        watch_wait_s: float = 10.0,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, not {timeout_s!r}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, not {retries!r}")
        if not retry_delay_s > 0:
            raise ValueError(f"retry_delay_s must be > 0, not {retry_delay_s!r}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, not {workers!r}")
        if not idle_wake_s > 0:
            raise ValueError(f"idle_wake_s must be > 0, not {idle_wake_s!r}")
        if log is None:
            from rd2h.adapters.logging import make_logger

            log = make_logger("metaserver", 0)
        self._log = log
        self._retries = retries
        self._retry_delay_s = retry_delay_s
        self._idle_wake_s = idle_wake_s
        self._client = httpx.Client(
            timeout=httpx.Timeout(timeout_s),
            transport=transport,
            headers={"Content-Type": "application/json"},
        )
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Post]] = []
        self._seq = itertools.count()
        self._by_request: dict[str, list[_Post]] = {}
        self._closed = False
        self._counts = {"delivered": 0, "http_errors": 0, "transport_errors": 0,
                        "failed": 0, "cancelled": 0}
        self._alive = workers
        self.watcher = Watcher(self._cond, log, retry_delay_s=retry_delay_s,
                               wait_s=watch_wait_s, timeout_s=timeout_s,
                               transport=transport) if watch else None
        self._threads = [
            threading.Thread(target=self._run, name=f"rd2h-metaserver-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    # -- caller side ---------------------------------------------------------------------

    def post(self, request_id: str, url: str, payload: Mapping[str, Any]) -> None:
        _check_url(url)
        try:
            body = json.dumps(dict(payload), allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"metaserver payload for request {request_id!r} is not JSON-serialisable: {exc}"
            ) from exc
        engine = payload.get("remote_engine_id")
        job = _Post(request_id, url, body, engine=engine if isinstance(engine, str) else None)
        with self._cond:
            if self._closed:
                raise RuntimeError("metaserver client is shut down; cannot post")
            self._by_request.setdefault(request_id, []).append(job)
            heapq.heappush(self._heap, (time.monotonic(), next(self._seq), job))
            self._cond.notify()

    def cancel(self, request_id: str) -> int:
        with self._cond:
            jobs = self._by_request.pop(request_id, [])
            dropped = self._drop(jobs)
            if self.watcher is not None:
                self.watcher.forget(request_id)
            if jobs:  # workers skip cancelled jobs; with none, nobody needs waking (this
                self._cond.notify_all()  # runs for every finished request)
        if dropped:
            self._log.debug("metaserver posts cancelled", request=request_id, posts=dropped)
        return dropped

    def pending(self) -> int:
        with self._cond:
            return sum(len(jobs) for jobs in self._by_request.values())

    def take_failed(self) -> dict[str, str]:
        if self.watcher is None:
            return {}
        with self._cond:
            return self.watcher.take_failed()

    def stats(self) -> MetaserverStats:
        with self._cond:
            return MetaserverStats(
                pending=sum(len(jobs) for jobs in self._by_request.values()), **self._counts
            )

    def drain(self, timeout: float) -> bool:
        """Wait until nothing is pending; False if ``timeout`` ran out first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._by_request:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def shutdown(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            if not self._closed:
                self._closed = True
                if self.watcher is not None:
                    self.watcher.close()
                for jobs in self._by_request.values():
                    self._drop(jobs)
                self._by_request.clear()
                self._heap.clear()
            self._cond.notify_all()
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        busy = [t.name for t in self._threads if t.is_alive()]
        if busy:
            self._log.warning("metaserver threads still busy at shutdown deadline",
                              threads=busy, timeout_s=timeout)
        return not busy

    def _drop(self, jobs: list[_Post]) -> int:
        """Mark jobs cancelled (lock held). In-flight ones are counted when they return."""
        dropped = 0
        for job in jobs:
            job.cancelled = True
            if not job.in_flight:
                self._counts["cancelled"] += 1
                dropped += 1
        return dropped

    # -- worker side ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while (job := self._next_job()) is not None:
                self._settle(job, self._attempt(job))
        finally:
            with self._cond:
                self._alive -= 1
                last = self._alive == 0
            if last:
                self._client.close()

    def _next_job(self) -> _Post | None:
        with self._cond:
            while not self._closed:
                while self._heap and self._heap[0][2].cancelled:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait(self._idle_wake_s)
                    continue
                delay = self._heap[0][0] - time.monotonic()
                if delay > 0:
                    self._cond.wait(min(delay, self._idle_wake_s))
                    continue
                job = heapq.heappop(self._heap)[2]
                job.in_flight = True
                return job
            return None

    def _attempt(self, job: _Post) -> _Answered | _TransportFailure | _Unrecoverable:
        try:
            response = self._client.post(job.url, content=job.body)
        except httpx.TransportError as exc:
            return _TransportFailure(f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # one bad post must not kill the worker
            return _Unrecoverable(f"{type(exc).__name__}: {exc}")
        return _Answered(response.status_code, response.text[:200] if response.is_error else "")

    def _settle(self, job: _Post, outcome: _Answered | _TransportFailure | _Unrecoverable) -> None:
        with self._cond:
            job.in_flight = False
            job.attempts += 1
            if isinstance(outcome, _TransportFailure):
                self._counts["transport_errors"] += 1
                retrying = not (job.cancelled or self._closed)
                if retrying:
                    fast = job.attempts <= self._retries
                    due = time.monotonic() + (0.0 if fast else self._retry_delay_s)
                    heapq.heappush(self._heap, (due, next(self._seq), job))
                else:
                    self._counts["cancelled"] += 1
                    self._forget(job)
            elif isinstance(outcome, _Unrecoverable):
                self._counts["failed"] += 1
                self._forget(job)
            else:
                self._counts["delivered"] += 1
                self._counts["http_errors"] += int(outcome.status >= 400)
                self._forget(job)
                if (outcome.status < 300 and job.engine and not job.cancelled
                        and self.watcher is not None):
                    self.watcher.watch(job.request_id, job.url, job.engine)
            self._cond.notify_all()
        self._report(job, outcome, retrying=isinstance(outcome, _TransportFailure) and retrying)

    def _report(self, job: _Post, outcome: _Answered | _TransportFailure | _Unrecoverable,
                retrying: bool) -> None:
        """Log one settled attempt; a dead metaserver is not logged on every retry."""
        where = {"request": job.request_id, "url": job.url}
        if isinstance(outcome, _Answered):
            if outcome.status >= 400:
                self._log.warning("metaserver answered an HTTP error; counted as delivered",
                                  status=outcome.status, body=outcome.text, **where)
            else:
                self._log.debug("metaserver post delivered", status=outcome.status, **where)
        elif isinstance(outcome, _Unrecoverable):
            self._log.error("metaserver post failed and will not be retried",
                            error=outcome.error, **where)
        elif retrying:
            slow = job.attempts - self._retries
            if slow == 1 or (slow > 1 and slow % _LOG_EVERY_SLOW_RETRIES == 0):
                self._log.warning(
                    f"metaserver unreachable; retrying every {self._retry_delay_s:g} s until "
                    "the request finishes", attempts=job.attempts, error=outcome.error, **where)
            else:
                self._log.debug("metaserver attempt failed; retrying", attempts=job.attempts,
                                error=outcome.error, **where)

    def _forget(self, job: _Post) -> None:
        """Remove a settled job from the per-request index (lock held)."""
        jobs = self._by_request.get(job.request_id)
        if jobs is None:
            return
        jobs[:] = [j for j in jobs if j is not job]
        if not jobs:
            del self._by_request[job.request_id]
