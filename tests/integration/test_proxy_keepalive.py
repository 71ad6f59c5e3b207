"""``rd2h proxy`` over real sockets: engines that close reused connections, 64 clients.

The fake engines are FastAPI apps under uvicorn on loopback, all on one background
event loop; they do what vLLM engines with the rd2h connector do at the HTTP level:
Decode derives its request ids from ``X-Request-Id`` as vLLM 0.32 does, posts its
contact information to the proxy's metaserver URL, waits until Prefill received
the dispatch (standing in for the KV), then answers (JSON or SSE).

A ``Gremlin`` is a TCP relay in front of an engine that closes a client connection,
without passing anything on, as soon as a second request starts on it: the race
where an engine's keep-alive timer closes a connection just as the proxy reuses it,
made certain. It closes with a FIN (the proxy reads "Server disconnected without
sending a response") or a RST (a reset on read). The proxy runs in-process under
uvicorn with a recording logger, so "no error-level line" is checked exactly.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
import uvloop
from fakes.http_engines import FakeEngines, sse
from fakes.logs import RecordingLogger
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from rd2h.proxy.service import ProxyConfig, create_app

pytestmark = pytest.mark.integration

HOST = "127.0.0.1"


def bound_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, 0))
    return sock


class Gremlin:
    """TCP relay to ``port`` that kills a connection when a second request starts on it."""

    def __init__(self, port: int, mode: str) -> None:
        self.target = port
        self.mode = mode
        self.kills = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        # uvicorn's backlog: 64 clients' resends open 64 connections at once.
        self._server = await asyncio.start_server(self._relay, HOST, 0, backlog=2048)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()

    def _kill(self, writer: asyncio.StreamWriter) -> None:
        self.kills += 1
        if self.mode == "rst":
            writer.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        else:
            writer.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(HOST, self.target)
        answered = False

        async def downstream() -> None:
            nonlocal answered
            while data := await up_reader.read(65536):
                answered = True
                writer.write(data)
                await writer.drain()
            writer.close()

        task = asyncio.ensure_future(downstream())
        try:
            while data := await reader.read(65536):
                if answered:  # HTTP/1.1 without pipelining: a new request
                    self._kill(writer)
                    return
                up_writer.write(data)
                await up_writer.drain()
            writer.close()
        except ConnectionError:
            pass
        finally:
            task.cancel()
            up_writer.close()


class Cluster:
    """Fake engines (optionally behind gremlins) and the proxy, on loopback."""

    def __init__(self, gremlins: dict[str, str], engine_keep_alive_s: float = 5.0,
                 proxy_engine_keepalive_s: float = 2.0) -> None:
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engines = FakeEngines()
        self.servers: list[tuple[uvicorn.Server, asyncio.Future]] = []
        self.gremlins: dict[str, Gremlin] = {}
        urls = {}
        for leg, app in (("prefill", self.engines.prefill), ("decode", self.engines.decode)):
            port = self._serve_on_loop(app, engine_keep_alive_s)
            if leg in gremlins:
                gremlin = Gremlin(port, gremlins[leg])
                self.call(gremlin.start())
                self.gremlins[leg], port = gremlin, gremlin.port
            urls[leg] = f"http://{HOST}:{port}"
        self.log = RecordingLogger()
        proxy_sock = bound_socket()
        self.url = f"http://{HOST}:{proxy_sock.getsockname()[1]}"
        # Probes get 10 s (default 1 s): these engines share one event loop with up to
        # 64 streams, and on a loaded 2-core machine their /health answer has taken over
        # a second, which ejects the one Decode at once (by design, and not what these
        # tests are about: CI saw 503 "all ejected" once).
        config = ProxyConfig(prefill=(urls["prefill"],), decode=(urls["decode"],),
                             public_url=self.url, connect_timeout_s=5, decode_timeout_s=30,
                             prefill_timeout_s=30, engine_keepalive_s=proxy_engine_keepalive_s,
                             probe_timeout_s=10)
        self.app = create_app(config, log=self.log)
        # The proxy's own keep-alive as ``rd2h proxy`` sets it (``serve``).
        self.proxy_server = uvicorn.Server(uvicorn.Config(
            self.app, log_config=None, log_level="warning",
            timeout_keep_alive=config.client_keepalive_s))
        self.proxy_thread = threading.Thread(target=self.proxy_server.run,
                                             kwargs={"sockets": [proxy_sock]}, daemon=True)
        self.proxy_thread.start()
        self._wait(lambda: self.proxy_server.started, "proxy did not start")

    def call(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @staticmethod
    def _wait(ready: Any, what: str, deadline_s: float = 10.0) -> None:
        deadline = time.monotonic() + deadline_s
        while not ready():
            assert time.monotonic() < deadline, what
            time.sleep(0.01)

    def _serve_on_loop(self, app: FastAPI, keep_alive_s: float) -> int:
        sock = bound_socket()
        server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning",
                                               lifespan="off", timeout_keep_alive=keep_alive_s))
        task = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), self.loop)
        self.servers.append((server, task))
        self._wait(lambda: server.started, "engine did not start")
        return sock.getsockname()[1]

    def wait_idle(self) -> dict[str, Any]:
        """The proxy's health once no request is pending and no dispatch runs."""
        deadline = time.monotonic() + 10.0
        while True:
            health = httpx.get(self.url + "/healthcheck", timeout=5.0).json()
            if health["pending"] == 0 and health["prefill_in_flight"] == 0:
                return health
            assert time.monotonic() < deadline, health
            time.sleep(0.01)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = httpx.get(self.url + "/metrics", timeout=5.0).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stop(self) -> None:
        self.proxy_server.should_exit = True
        self.proxy_thread.join(15.0)
        for server, _ in self.servers:
            server.should_exit = True
        for _, task in self.servers:
            task.result(15.0)
        for gremlin in self.gremlins.values():
            self.call(gremlin.stop())
        if self.engines.poster is not None:
            self.call(self.engines.poster.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10.0)
        assert not self.proxy_thread.is_alive()


@pytest.fixture
def cluster_factory() -> Iterator[Any]:
    clusters: list[Cluster] = []

    def make(**kw: Any) -> Cluster:
        clusters.append(Cluster(**kw))
        return clusters[-1]

    yield make
    for cluster in clusters:
        cluster.stop()


def check_answer(r: httpx.Response, kind: str) -> None:
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    if kind == "chat":
        assert r.text == "".join(sse(f"chatcmpl-{rid}"))
    elif kind == "list":
        assert [c["text"] for c in r.json()["choices"]] == ["decoded 0", "decoded 1"]
    else:
        assert r.json()["id"] == f"cmpl-{rid}-0"


def request_for(i: int) -> tuple[str, str, dict[str, Any]]:
    kind = ("chat", "one", "list")[i % 3]
    if kind == "chat":
        return kind, "/v1/chat/completions", {
            "model": "m", "stream": True, "messages": [{"role": "user", "content": f"q{i}"}]}
    prompt: Any = [f"a{i}", f"b{i}"] if kind == "list" else f"p{i}"
    return kind, "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 4}


def no_errors(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    assert cluster.log.at("error") == []
    assert cluster.log.at("warning") == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.mark.parametrize("mode", ["fin", "rst"])
@pytest.mark.parametrize("leg", ["decode", "prefill"])
def test_engine_closing_a_reused_connection_costs_the_client_nothing(
        cluster_factory: Any, leg: str, mode: str, caplog: pytest.LogCaptureFixture) -> None:
    cluster = cluster_factory(gremlins={leg: mode})
    with httpx.Client(base_url=cluster.url, timeout=30.0) as client:
        for i in range(6):
            kind, path, body = request_for(i)
            check_answer(client.post(path, json=body), kind)
            cluster.wait_idle()  # the proxy's connection is back in its pool
    gremlin = cluster.gremlins[leg]
    # Every second request on a connection is killed; its resend opens a fresh one
    # that is closed after use, so requests alternate: new, reused (killed), new...
    assert gremlin.kills == 3
    m = cluster.metrics()
    assert m[("rd2h_proxy_upstream_retries_total",
              (("leg", leg), ("reason", "stale_connection")))] == 3
    failures = {r: m.get(("rd2h_proxy_upstream_failures_total", (("leg", leg), ("reason", r))),
                         0) for r in ("connection_closed", "connection_reset")}
    if mode == "rst":
        assert failures == {"connection_closed": 0, "connection_reset": 3}, failures
    else:
        # A FIN reads as a close, unless the proxy's write reached the closed socket
        # first and the kernel answered it with a reset (seen once on a loaded machine).
        assert sum(failures.values()) == 3 and failures["connection_closed"] >= 1, failures
    ok = sum(v for (name, labels), v in m.items()
             if name == "rd2h_proxy_requests_total" and ("outcome", "ok") in labels)
    assert ok == 6
    if leg == "prefill":
        assert m[("rd2h_proxy_prefill_dispatches_total", (("outcome", "ok"),))] == 6
    else:
        assert len(cluster.engines.decode_rids) == 6  # killed requests never reached it
    resends = [kw for event, kw in cluster.log.at("info") if "reused connection" in event]
    assert len(resends) == 3 and all(kw["error"] for kw in resends)
    no_errors(cluster, caplog)


def test_64_concurrent_clients_through_engines_that_kill_reused_connections(
        cluster_factory: Any, caplog: pytest.LogCaptureFixture) -> None:
    cluster = cluster_factory(gremlins={"decode": "rst", "prefill": "fin"})
    waves, width = 3, 64

    async def drive() -> float:
        # One client (one connection) per user, as separate benchmark users would be:
        # one httpx pool of 64 connections would cost this process more CPU than the
        # proxy under test.
        clients = [httpx.AsyncClient(base_url=cluster.url, timeout=60.0)
                   for _ in range(width)]

        async def one(i: int) -> None:
            kind, path, body = request_for(i)
            check_answer(await clients[i % width].post(path, json=body), kind)

        started = time.monotonic()
        try:
            for wave in range(waves):
                await asyncio.gather(*(one(wave * width + i) for i in range(width)))
        finally:
            for client in clients:
                await client.aclose()
        return time.monotonic() - started

    elapsed = asyncio.run(asyncio.wait_for(drive(), 120.0))
    health = cluster.wait_idle()
    assert health["counters"]["prefill_ok"] == waves * width
    assert health["counters"]["prefill_failed"] == 0
    m = cluster.metrics()
    total = sum(v for (name, labels), v in m.items()
                if name == "rd2h_proxy_requests_total")
    ok = sum(v for (name, labels), v in m.items()
             if name == "rd2h_proxy_requests_total" and ("outcome", "ok") in labels)
    assert total == ok == waves * width
    assert all(v == 0 for (name, _), v in m.items() if name == "rd2h_proxy_requests_in_flight")
    assert m[("rd2h_proxy_pending_rendezvous", ())] == 0
    # Waves after the first reuse pooled connections, which the gremlins kill.
    for leg in ("decode", "prefill"):
        retried = m[("rd2h_proxy_upstream_retries_total",
                     (("leg", leg), ("reason", "stale_connection")))]
        assert retried == cluster.gremlins[leg].kills > 0, leg
    assert m[("rd2h_proxy_request_duration_seconds_count",
              (("endpoint", "/v1/completions"),))] == 2 * width
    assert len(set(cluster.engines.decode_rids)) == waves * width
    no_errors(cluster, caplog)
    print(f"{waves * width} requests at concurrency {width} in {elapsed:.2f} s, "
          f"resent: decode {cluster.gremlins['decode'].kills}, "
          f"prefill {cluster.gremlins['prefill'].kills}")


def test_engines_with_a_short_keep_alive_and_a_proxy_that_outlives_it(
        cluster_factory: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Real uvicorn engines close idle connections after 50 ms while the proxy keeps them
    for 5 s: the proxy reuses connections as the engines close them, many times over;
    httpcore's readability check catches most, a resend the rest."""
    cluster = cluster_factory(gremlins={}, engine_keep_alive_s=0.05,
                              proxy_engine_keepalive_s=5.0)

    async def drive() -> None:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=30.0) as client:

            async def stream(k: int) -> None:
                for i in range(15):
                    kind, path, body = request_for(k * 100 + i)
                    check_answer(await client.post(path, json=body), kind)
                    await asyncio.sleep(0.04 + 0.005 * ((k + i) % 5))

            await asyncio.gather(*(stream(k) for k in range(4)))

    asyncio.run(asyncio.wait_for(drive(), 60.0))
    cluster.wait_idle()
    m = cluster.metrics()
    ok = sum(v for (name, labels), v in m.items()
             if name == "rd2h_proxy_requests_total" and ("outcome", "ok") in labels)
    assert ok == 60
    no_errors(cluster, caplog)
    print("resent on stale connections:", {
        labels: v for (name, labels), v in m.items()
        if name == "rd2h_proxy_upstream_retries_total"})


def test_models_and_metrics_over_http(cluster_factory: Any) -> None:
    cluster = cluster_factory(gremlins={"decode": "fin"})
    with httpx.Client(base_url=cluster.url, timeout=10.0) as client:
        for _ in range(3):  # the second one meets a killed connection and is asked again
            r = client.get("/v1/models")
            assert r.status_code == 200 and r.json()["data"] == [{"id": "tiny"}]
        r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 200
        cluster.wait_idle()
        r = client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    openmetrics = httpx.get(cluster.url + "/metrics", headers={
        "Accept": "application/openmetrics-text; version=1.0.0"})
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.endswith("# EOF\n")
    m = cluster.metrics()
    assert m[("rd2h_proxy_requests_total",
              (("endpoint", "/v1/models"), ("outcome", "ok")))] == 3
    assert m[("rd2h_proxy_upstream_retries_total",
              (("leg", "models"), ("reason", "stale_connection")))] == 1
    # Over real sockets the dispatch hop ends when the request was written (httpcore).
    assert m[("rd2h_proxy_prefill_dispatch_seconds_count", ())] == 1
    assert 0 <= m[("rd2h_proxy_prefill_dispatch_seconds_sum", ())] < 5
    assert m[("rd2h_proxy_decode_admission_seconds_count", ())] == 1
