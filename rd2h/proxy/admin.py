"""``rd2h proxy``'s health, status and admin endpoints.

* ``GET /health``: 200 while at least one Prefill and one Decode instance can take
  requests (pair-aware), else 503; for load balancers and orchestrators.
* ``GET /status``: every instance with its state (``admitted``, ``ejected``,
  ``draining``, ``drained``), in-flight count, last error and engine load.
* ``GET /healthcheck``: the instance lists, requests in flight and plain counters.
* The admin API, on only when the proxy has a token (``--admin-token`` or
  ``$RD2H_PROXY_ADMIN_TOKEN``), each call with ``Authorization: Bearer <token>``:
  ``GET /admin/instances``; ``POST /admin/instances`` ``{"role", "url"}`` adds one
  (or takes back a drained or removed one); ``POST /admin/instances/remove`` takes
  one out at once (requests in flight finish); ``POST /admin/instances/drain``
  stops new requests to one and answers its state; ``GET
  /admin/instances/drain?role=R&url=U`` answers ``{"drained": bool, "in_flight": n}``.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rd2h.proxy.error_bodies import error_body
from rd2h.proxy.options import normalize_base_url
from rd2h.proxy.router import UnknownInstance


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


def add_routes(app: FastAPI, proxy: Any) -> None:
    """Register the endpoints above on ``app`` for ``proxy`` (a ``RendezvousProxy``)."""
    router = proxy.router
    token = proxy.config.admin_token

    @app.get("/healthcheck")
    async def healthcheck() -> dict[str, Any]:
        return proxy.health()

    @app.get("/health")
    async def health() -> JSONResponse:
        router.start()
        ready = router.ready()
        pools = {role: sum(1 for i in pool if i.pickable) for role, pool in router.pools.items()}
        return JSONResponse({"ready": ready, "admitted": pools}, status_code=200 if ready
                            else 503)

    @app.get("/status")
    async def status() -> dict[str, Any]:
        return {"ready": router.ready(), "instances": router.status(),
                "pending": len(proxy.table), "counters": dataclasses.asdict(proxy.counters)}

    def refused(request: Request) -> JSONResponse | None:
        if token is None:
            return _error(404, "the admin API is off: start the proxy with --admin-token or "
                               "RD2H_PROXY_ADMIN_TOKEN")
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(),
                                                                 token.encode()):
            return _error(401, "admin API: missing or wrong bearer token")
        return None

    async def target(request: Request) -> tuple[str, str]:
        if request.method == "GET":
            body: Any = dict(request.query_params)
        else:
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"body is not valid JSON: {exc}") from None
        if not isinstance(body, dict) or not isinstance(body.get("role"), str) \
                or not isinstance(body.get("url"), str):
            raise ValueError('expected {"role": "prefill" | "decode", "url": "http://HOST:PORT"}')
        return body["role"], normalize_base_url(body["url"], f"{body['role']} URL")

    async def admin(request: Request, op: str) -> JSONResponse:
        denied = refused(request)
        if denied is not None:
            return denied
        if op == "list":
            return JSONResponse({"instances": router.status()})
        try:
            role, url = await target(request)
            if op == "add":
                if role not in router.pools:
                    raise UnknownInstance(f"role must be prefill or decode, not {role!r}")
                inst = router.add(role, url)
            elif op == "remove":
                inst = router.remove(role, url)
            elif op == "drain":
                inst = router.drain(role, url)
            else:  # drain state
                inst = router.pools[role].get(url) if role in router.pools else None
                if inst is None:
                    raise UnknownInstance(f"no {role} instance {url!r}")
                return JSONResponse({"role": role, "url": url, "state": inst.state,
                                     "drained": inst.in_flight == 0 and inst.draining,
                                     "in_flight": inst.in_flight})
        except ValueError as exc:
            return _error(400, f"admin API: {exc}")
        except (UnknownInstance, KeyError) as exc:
            return _error(404, f"admin API: {exc.args[0] if exc.args else exc}")
        return JSONResponse({"role": role, "url": url, "state": inst.state,
                             "in_flight": inst.in_flight})

    @app.get("/admin/instances")
    async def list_instances(request: Request) -> JSONResponse:
        return await admin(request, "list")

    @app.post("/admin/instances")
    async def add_instance(request: Request) -> JSONResponse:
        return await admin(request, "add")

    @app.post("/admin/instances/remove")
    async def remove_instance(request: Request) -> JSONResponse:
        return await admin(request, "remove")

    @app.post("/admin/instances/drain")
    async def drain_instance(request: Request) -> JSONResponse:
        return await admin(request, "drain")

    @app.get("/admin/instances/drain")
    async def drain_state(request: Request) -> JSONResponse:
        return await admin(request, "drained")
