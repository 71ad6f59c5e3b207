"""``rd2h proxy``'s engine instances: picking, /health probes, passive failure reports,
ejection and readmission, live membership and drain (rules: ``rd2h.proxy.routing``,
prefix affinity: ``rd2h.proxy.affinity``).

Probes run on the proxy's event loop, every ``probe_interval_s``, one ``GET /health``
per instance with ``probe_timeout_s``; with ``engine_metrics_s`` set, each engine's
``/metrics`` is read as often for ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from typing import Any

import httpx

from rd2h.ports.runtime import Logger
from rd2h.proxy.affinity import PrefixAffinity, prompt_text
from rd2h.proxy.metrics import ProxyMetrics
from rd2h.proxy.options import ProxyConfig
from rd2h.proxy.routing import Failure, HealthRules, Instance, InstancePool, Policy

ROLES = ("prefill", "decode")
_WAITING = "vllm:num_requests_waiting"
_KV_USAGE = "vllm:kv_cache_usage_perc"


class UnknownInstance(KeyError):
    """An admin call naming an instance the proxy does not have."""


class EngineRouter:
    def __init__(self, config: ProxyConfig, metrics: ProxyMetrics, log: Logger, *,
                 transport: httpx.AsyncBaseTransport | None = None,
                 seed: int | None = None) -> None:
        self._config = config
        self._metrics = metrics
        self._log = log
        rules = HealthRules(config.eject_after, config.eject_base_s, config.eject_max_s,
                            config.eject_after_probe_timeouts)
        rng = random.Random(seed)
        self.pools = {
            "prefill": InstancePool.of("prefill", config.prefill, rules=rules, rng=rng,
                                       policy=Policy(config.prefill_policy)),
            "decode": InstancePool.of("decode", config.decode, rules=rules, rng=rng,
                                      policy=Policy(config.decode_policy)),
        }
        for pool in self.pools.values():
            for inst in pool:
                self._gauges(inst)
        self.affinity = (PrefixAffinity(chunk_chars=config.affinity_chunk_chars)
                         if config.affinity_chunk_chars else None)
        # A fresh connection per probe: a pooled one the engine closed while idle would
        # fail a probe of a healthy engine.
        self._client = httpx.AsyncClient(
            transport=transport, timeout=httpx.Timeout(config.probe_timeout_s),
            limits=httpx.Limits(max_keepalive_connections=0))
        self._task: asyncio.Task[None] | None = None
        self._rescues: dict[str, asyncio.Future[Any]] = {}
        self.probes = 0

    # -- lifecycle
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._probe_loop())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        await self._client.aclose()

    # -- picking
    def pick_decode(self, body: dict[str, Any], exclude: tuple[str, ...] = ()) -> Instance | None:
        pool = self.pools["decode"]
        text = prompt_text(body) if self.affinity is not None else None
        if text is not None and self.affinity is not None:
            found = self.affinity.lookup(text)
            if found is not None:
                inst = pool.find(found[0])
                if inst is not None and inst.url not in exclude and pool.not_overloaded(
                        inst, self._config.affinity_slack):
                    self._metrics.affinity.labels("hit").inc()
                    self.affinity.record(text, inst.url)
                    return inst
                self._metrics.affinity.labels("overloaded").inc()
            else:
                self._metrics.affinity.labels("miss").inc()
        inst = pool.pick(exclude)
        if inst is not None and text is not None and self.affinity is not None:
            self.affinity.record(text, inst.url)
        return inst

    def pick_prefill(self, exclude: tuple[str, ...] = ()) -> Instance | None:
        return self.pools["prefill"].pick(exclude)

    def prefill_named(self, host_port: str) -> Instance | None:
        """The Prefill instance a ``x-prefiller-host-port`` header names, if it is one
        of this proxy's (the allowlist) and pickable."""
        value = host_port.strip()
        if "://" in value:
            value = value.split("://", 1)[1]
        value = value.rstrip("/")
        for inst in self.pools["prefill"]:
            if inst.url.split("://", 1)[1] == value:
                return inst
        return None

    # -- requests
    def begin(self, inst: Instance) -> None:
        self.pools[inst.role].started(inst)
        self._metrics.instance_in_flight.labels(inst.role, inst.url).set(inst.in_flight)

    def end(self, inst: Instance) -> None:
        self.pools[inst.role].ended(inst)
        self._metrics.instance_in_flight.labels(inst.role, inst.url).set(inst.in_flight)
        if inst.draining and inst.in_flight == 0:
            self._log.info("instance drained", role=inst.role, instance=inst.url)

    def succeeded(self, inst: Instance) -> None:
        self.pools[inst.role].succeeded(inst)

    def failed(self, inst: Instance, cause: Failure, error: str) -> None:
        ejection = self.pools[inst.role].failed(inst, cause, error, time.monotonic())
        if ejection is not None:
            self._metrics.ejections.labels(inst.role, cause.value).inc()
            self._gauges(inst)
            self._log.warning("instance ejected", role=inst.role, instance=inst.url,
                              cause=cause.value, error=error[:300],
                              backoff_s=round(ejection.backoff_s, 3))
        elif cause is Failure.PROBE_TIMEOUT and inst.healthy:
            self._log.warning("health probe answered late; instance kept", role=inst.role,
                              instance=inst.url, error=error[:300],
                              in_row=inst.probe_timeouts_in_row,
                              ejected_at=self._config.eject_after_probe_timeouts)

    # -- health
    def ready(self) -> bool:
        """Pair-aware: at least one Prefill and one Decode can take requests."""
        return all(pool.ready() for pool in self.pools.values())

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {role: [i.status(now) for i in pool] for role, pool in self.pools.items()}

    async def rescue(self, role: str) -> bool:
        """No ``role`` instance is pickable: probe the ejected ones now, back-off or not,
        instead of waiting for the next round (an engine that just came up, a fleet that
        just recovered); True when one was readmitted. One rescue per role at a time:
        requests arriving meanwhile wait for its probes instead of sending their own."""
        pool = self.pools[role]
        if pool.ready():
            return True
        task = self._rescues.get(role)
        if task is None or task.done():
            due = [i for i in pool if not i.healthy and not i.removed and not i.draining]
            if not due:
                return False
            task = asyncio.ensure_future(
                asyncio.gather(*(self._probe(i, False) for i in due)))
            self._rescues[role] = task
        await asyncio.shield(task)
        return pool.ready()

    async def _probe_loop(self) -> None:
        interval = self._config.probe_interval_s
        next_scrape = 0.0
        while True:
            instances = [i for pool in self.pools.values() for i in pool if not i.removed]
            scrape = bool(self._config.engine_metrics_s) and time.monotonic() >= next_scrape
            if scrape:
                next_scrape = time.monotonic() + self._config.engine_metrics_s
            await asyncio.gather(*(self._probe(i, scrape) for i in instances))
            self.probes += 1
            await asyncio.sleep(interval)

    async def _probe(self, inst: Instance, scrape: bool) -> None:
        try:
            r = await self._client.get(inst.url + "/health")
            ok, error = r.status_code == 200, f"/health answered HTTP {r.status_code}"
        except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout) as exc:
            # Connected, but no answer in time: a busy API server, or a hung one.
            error = f"/health: {type(exc).__name__} after {self._config.probe_timeout_s} s"
            self.failed(inst, Failure.PROBE_TIMEOUT, error)
            return
        except httpx.HTTPError as exc:
            ok, error = False, f"/health: {type(exc).__name__}: {exc}"[:300]
        except Exception as exc:  # a probe must never end the loop
            ok, error = False, f"/health: {type(exc).__name__}: {exc}"[:300]
        if not ok:
            self.failed(inst, Failure.PROBE, error)
            return
        if self.pools[inst.role].probed(inst, time.monotonic()):
            self._metrics.readmissions.labels(inst.role).inc()
            self._gauges(inst)
            self._log.info("instance readmitted", role=inst.role, instance=inst.url)
        if scrape:
            await self._scrape(inst)

    async def _scrape(self, inst: Instance) -> None:
        try:
            r = await self._client.get(inst.url + "/metrics")
            waiting = kv = None
            for line in r.text.splitlines() if r.status_code == 200 else ():
                if line.startswith(_WAITING):
                    waiting = (waiting or 0.0) + float(line.rsplit(" ", 1)[1])
                elif line.startswith(_KV_USAGE):
                    kv = max(kv or 0.0, float(line.rsplit(" ", 1)[1]))
            inst.engine_waiting, inst.engine_kv_usage = waiting, kv
        except (httpx.HTTPError, ValueError, IndexError):
            inst.engine_waiting = inst.engine_kv_usage = None

    # -- membership (the admin API)
    def add(self, role: str, url: str) -> Instance:
        inst = self._pool(role).add(url)
        self._gauges(inst)
        self._log.info("instance added", role=role, instance=url)
        return inst

    def remove(self, role: str, url: str) -> Instance:
        inst = self._instance(role, url)
        self.pools[role].remove(url)
        if self.affinity is not None:
            self.affinity.forget(url)
        self._metrics.instance_healthy.labels(role, url).set(0)
        self._log.info("instance removed", role=role, instance=url, in_flight=inst.in_flight)
        return inst

    def drain(self, role: str, url: str) -> Instance:
        inst = self._instance(role, url)
        self.pools[role].drain(url)
        self._log.info("instance draining", role=role, instance=url, in_flight=inst.in_flight)
        return inst

    def _pool(self, role: str) -> InstancePool:
        if role not in self.pools:
            raise UnknownInstance(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        return self.pools[role]

    def _instance(self, role: str, url: str) -> Instance:
        try:
            return self._pool(role).get(url)
        except KeyError as exc:
            raise UnknownInstance(str(exc.args[0])) from None

    def _gauges(self, inst: Instance) -> None:
        self._metrics.instance_healthy.labels(inst.role, inst.url).set(1 if inst.healthy else 0)
        self._metrics.instance_in_flight.labels(inst.role, inst.url).set(inst.in_flight)
