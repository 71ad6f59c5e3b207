"""``GET /v1/models``, ``POST /tokenize`` and ``POST /detokenize`` for ``rd2h proxy``:
answered by the engines behind it (every engine serves the same model and tokenizer).

Engines are asked one after the other (the Decode instances first, then the
Prefill ones) until one answers, all within one deadline. An engine's 2xx answer
(a JSON object) is returned as is; a 4xx is relayed as is too (an auth error would
be the same on every engine); a 5xx, a malformed answer or a transport failure
moves on to the next engine. When none answers: 502 if some engine answered
badly, 503 if none could be reached in time. These requests are idempotent, so
one that met a stale pooled connection is sent once more on a fresh one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import httpx
from fastapi.responses import JSONResponse
from starlette.responses import Response

from rd2h.ports.runtime import Logger
from rd2h.proxy.error_bodies import error_body
from rd2h.proxy.metrics import ProxyMetrics, status_reason
from rd2h.proxy.upstream import STALE, Upstream, UpstreamError

MODELS_PATH = "/v1/models"
# Engine endpoints the proxy relays as they are: path -> (method, metrics leg).
ENGINE_PATHS = {MODELS_PATH: ("GET", "models"), "/tokenize": ("POST", "tokenize"),
                "/detokenize": ("POST", "detokenize")}


async def _ask(upstream: Upstream, method: str, url: str, headers: Mapping[str, str],
               body: bytes | None, timeout: httpx.Timeout, log: Logger, metrics: ProxyMetrics,
               leg: str) -> httpx.Response:
    kw: dict[str, Any] = {"headers": dict(headers), "timeout": timeout}
    if body is not None:
        kw["content"] = body
        kw["headers"]["content-type"] = "application/json"
    try:
        return await upstream.send(method, url, **kw)
    except UpstreamError as exc:
        if exc.resend != STALE:
            raise
        metrics.failure(leg, exc.label)
        metrics.retry(leg, STALE)
        log.info("engine closed a reused connection; asking again on a fresh one",
                 url=url, error=str(exc))
        return await upstream.send(method, url, fresh=True, **kw)


async def fetch_models(
    upstream: Upstream,
    engines: Sequence[str],
    headers: Mapping[str, str],
    *,
    deadline_s: float,
    connect_timeout_s: float,
    log: Logger,
    metrics: ProxyMetrics,
    path: str = MODELS_PATH,
    body: bytes | None = None,
) -> tuple[Response, str]:
    """The engines' answer to ``path`` (one of ``ENGINE_PATHS``) and its outcome label."""
    method, leg = ENGINE_PATHS[path]
    problems: list[str] = []
    answered = False
    timeout = httpx.Timeout(deadline_s, connect=min(connect_timeout_s, deadline_s))
    started = time.monotonic()
    with anyio.move_on_after(deadline_s) as scope:
        for base in engines:
            url = base + path
            try:
                r = await _ask(upstream, method, url, headers, body, timeout, log, metrics,
                               leg)
            except UpstreamError as exc:
                metrics.failure(leg, exc.label)
                problems.append(f"{url}: {exc}")
                continue
            answered = True
            if r.is_client_error:
                metrics.failure(leg, status_reason(r.status_code))
                return Response(r.content, status_code=r.status_code,
                                media_type=r.headers.get("content-type")), "engine_error"
            if r.is_success:
                try:
                    payload: Any = r.json()
                except (json.JSONDecodeError, UnicodeDecodeError):
                    payload = None
                if isinstance(payload, dict):
                    return JSONResponse(payload), "ok"
                metrics.failure(leg, "bad_answer")
                problems.append(f"{url}: HTTP {r.status_code} with no JSON object")
            else:
                metrics.failure(leg, status_reason(r.status_code))
                problems.append(f"{url}: HTTP {r.status_code} {r.text[:200]}")
    if scope.cancelled_caught:
        metrics.failure(leg, "timeout")
        problems.append(f"no answer within {deadline_s:g} s "
                        f"(after {time.monotonic() - started:.1f} s)")
    status = 502 if answered else 503
    message = f"no engine answered {method} {path}: " + "; ".join(problems)
    log.warning("engine request failed", path=path, status=status, error=message)
    return JSONResponse(error_body(status, message), status_code=status), "unavailable"


async def engine_answer(proxy: Any, request: Any, headers: Mapping[str, str],
                        path: str) -> Response:
    """Answer ``path`` for ``proxy`` (a ``RendezvousProxy``) from its engines: an
    admitted Decode instance first (picked as requests are), then every other admitted
    instance; when every one is out, all of them (the answer is then honest)."""
    started = time.monotonic()
    body = await request.body() if request.method == "POST" else None
    metrics = proxy.metrics
    metrics.in_flight.labels(path).inc()
    router = proxy.router
    picked = router.pick_decode({})
    rest = [i.url for role in ("decode", "prefill") for i in router.pools[role]
            if i.pickable and i is not picked]
    engines = ([picked.url] if picked is not None else []) + rest
    if not engines:
        engines = [i.url for pool in router.pools.values() for i in pool]
    try:
        response, label = await fetch_models(
            proxy.upstream, engines, headers, deadline_s=proxy.config.models_timeout_s,
            connect_timeout_s=proxy.config.connect_timeout_s, log=proxy.log,
            metrics=metrics, path=path, body=body)
    finally:
        metrics.in_flight.labels(path).dec()
    metrics.requests.labels(path, label).inc()
    metrics.request_duration.labels(path).observe(time.monotonic() - started)
    return response
