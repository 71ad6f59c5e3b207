"""What ``rd2h proxy`` costs per request, and what each router feature adds (issue #43).

The real ``rd2h proxy`` (the CLI, its own process) routes streamed completions at a
fixed concurrency to fake engines (``tests/fakes/http_engines.py``: 2 Prefill and 2
Decode instances that do at the HTTP level what engines with the rd2h connector do:
Decode posts to the metaserver, waits for Prefill's dispatch, then streams). The
proxy's CPU (user + system, from /proc) over the measured requests, divided by their
number, is the figure; each configuration turns one feature on over a base with every
optional feature off:

- base: round-robin picking on both legs, no prefix affinity, health probes every
  hour (none during the run);
- least_outstanding / power_of_two: the picking policy on both legs (the default is
  least_outstanding);
- affinity: prefix affinity on Decode (64-character chunks, the default);
- probes 0.1 s: /health probes of every engine every 0.1 s (the default is 2 s); its
  cost is per probe, not per request, so the figure is also given per probe;
- engine metrics: the proxy polls each engine's /metrics every 0.5 s;
- defaults: ``rd2h proxy`` as shipped.

Configurations run in turn, ``--rounds`` times in a rotated order; the figures are
medians. The engines and the clients share this process; only the proxy is measured.

    .venv/bin/python benchmarks/proxy_overhead.py [--requests 400] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fakes.http_engines import HOST, FakeEngines  # noqa: E402

BASE = ["--decode-policy", "round_robin", "--prefill-policy", "round_robin",
        "--affinity-chunk", "0", "--probe-interval", "3600"]
CONFIGS: dict[str, list[str]] = {
    "base": BASE,
    "least_outstanding": [*BASE, "--decode-policy", "least_outstanding",
                          "--prefill-policy", "least_outstanding"],
    "power_of_two": [*BASE, "--decode-policy", "power_of_two",
                     "--prefill-policy", "power_of_two"],
    "affinity": [*BASE, "--affinity-chunk", "64"],
    "probes 0.1 s": [*BASE, "--probe-interval", "0.1"],
    "engine metrics": [*BASE, "--engine-metrics", "0.5"],
    # The same as base (aiohttp's client) on httpx's: over asyncio's streams and over
    # httpcore's default (anyio) sockets; what each client costs per request.
    "httpx asyncio": [*BASE, "--upstream-sockets", "asyncio"],
    "anyio sockets": [*BASE, "--upstream-sockets", "anyio"],
    "defaults": [],
}
PROMPT = ("You are a helpful assistant. Summarise the following passage in one line: "
          * 4)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class Engines:
    """The fake engines on a uvloop thread of this process."""

    def __init__(self, instances: int, tokens: int = 2, token_gap_s: float = 0.0) -> None:
        import uvicorn
        import uvloop

        self.loop = uvloop.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.fake = FakeEngines(tokens, token_gap_s)
        self.servers: list[Any] = []
        self.urls: dict[str, list[str]] = {"prefill": [], "decode": []}
        for leg, app in (("prefill", self.fake.prefill), ("decode", self.fake.decode)):
            for _ in range(instances):
                sock = socket.socket()
                sock.bind((HOST, 0))
                server = uvicorn.Server(uvicorn.Config(
                    app, log_config=None, log_level="warning", lifespan="off",
                    timeout_keep_alive=30))
                asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), self.loop)
                deadline = time.monotonic() + 10
                while not server.started:
                    if time.monotonic() > deadline:
                        raise SystemExit("a fake engine did not start")
                    time.sleep(0.01)
                self.servers.append(server)
                self.urls[leg].append(f"http://{HOST}:{sock.getsockname()[1]}")

    def stop(self) -> None:
        for server in self.servers:
            server.should_exit = True
        time.sleep(0.3)
        self.loop.call_soon_threadsafe(self.loop.stop)


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def probes_seen(fake: FakeEngines) -> int:
    return fake.health_probes


async def load(url: str, requests: int, concurrency: int, tag: str, events: int
               ) -> list[float]:
    """``requests`` streamed completions at ``concurrency``, each checked to carry
    ``events`` SSE events (``[DONE]`` included); their latencies (s)."""
    latencies: list[float] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                body = {"model": "tiny", "prompt": f"{tag} {i}: {PROMPT}", "max_tokens": 2,
                        "stream": True}
                t0 = time.perf_counter()
                async with client.stream("POST", url + "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        raise SystemExit(f"request {i} answered {r.status_code}")
                    body = b"".join([part async for part in r.aiter_bytes()])
                if body.count(b"data: ") != events or not body.endswith(b"data: [DONE]\n\n"):
                    raise SystemExit(f"request {i}: {body.count(b'data: ')} events relayed, "
                                     f"{events} sent")
                latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


def run_config(name: str, flags: list[str], engines: Engines, args: argparse.Namespace,
               tag: str) -> dict[str, float]:
    port = free_port()
    cmd = [sys.executable, "-m", "rd2h", "proxy", "--host", HOST, "--port", str(port),
           "--prefill", *engines.urls["prefill"], "--decode", *engines.urls["decode"],
           "--log-level", "WARNING", *flags]
    proxy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, cwd=ROOT)
    url = f"http://{HOST}:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/healthcheck", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proxy.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the proxy ({name}) did not start: "
                                 f"{proxy.stderr.read() if proxy.stderr else ''}")
            time.sleep(0.05)
        events = args.tokens + 1
        asyncio.run(load(url, max(8, args.requests // 10), args.concurrency, f"{tag}-warm",
                         events))
        c0, p0, t0 = proc_cpu_s(proxy.pid), probes_seen(engines.fake), time.perf_counter()
        latencies = asyncio.run(load(url, args.requests, args.concurrency, tag, events))
        wall = time.perf_counter() - t0
        cpu, probes = proc_cpu_s(proxy.pid) - c0, probes_seen(engines.fake) - p0
    finally:
        proxy.terminate()
        try:
            proxy.wait(10)
        except subprocess.TimeoutExpired:
            proxy.kill()
            proxy.wait()
    return {"cpu_us_per_request": cpu / args.requests * 1e6,
            "req_per_s": args.requests / wall,
            "latency_p50_ms": statistics.median(latencies) * 1e3,
            "probes": probes, "cpu_s": cpu}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400, help="measured requests per run")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="runs per configuration")
    ap.add_argument("--config", action="append", choices=list(CONFIGS),
                    help="configurations to run (repeatable; default: all)")
    ap.add_argument("--tokens", type=int, default=2,
                    help="events in each streamed answer, before [DONE]")
    ap.add_argument("--token-gap-ms", type=float, default=0.0,
                    help="the fake Decode sends each event on its own after this pause, as "
                         "an engine's decode steps do (0: the whole answer at once)")
    ap.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    args = ap.parse_args(argv)
    names = args.config or list(CONFIGS)
    if args.tokens < 1 or args.token_gap_ms < 0:
        ap.error("--tokens must be positive and --token-gap-ms at least 0")
    engines = Engines(instances=2, tokens=args.tokens, token_gap_s=args.token_gap_ms / 1e3)
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    try:
        for rnd in range(args.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for name in order:
                print(f"round {rnd + 1}/{args.rounds}: {name} ...", flush=True)
                runs[name].append(run_config(name, CONFIGS[name], engines, args,
                                             f"r{rnd}-{name}"))
    finally:
        engines.stop()
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
    if args.json:
        print(json.dumps({"runs": runs, "medians": med}))
        return 0
    base = med.get("base")
    print(f"\n{args.requests} streamed completions at concurrency {args.concurrency}, "
          f"2 Prefill + 2 Decode fake engines, median of {args.rounds}:")
    print(f"{'configuration':20} {'proxy CPU us/req':>17} {'vs base':>9} {'req/s':>8} "
          f"{'p50 ms':>8}")
    for name, m in med.items():
        delta = "" if base is None or name == "base" else \
            f"{m['cpu_us_per_request'] - base['cpu_us_per_request']:+8.0f}"
        print(f"{name:20} {m['cpu_us_per_request']:17.0f} {delta:>9} {m['req_per_s']:8.1f} "
              f"{m['latency_p50_ms']:8.1f}")
    if base is not None and "probes 0.1 s" in med and med["probes 0.1 s"]["probes"]:
        m = med["probes 0.1 s"]
        per_probe = (m["cpu_s"] - base["cpu_s"]) / m["probes"] * 1e6
        print(f"health probes: {m['probes']:.0f} during the run, about {per_probe:.0f} us of "
              f"proxy CPU each")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
