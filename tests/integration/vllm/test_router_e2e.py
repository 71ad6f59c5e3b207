"""``rd2h proxy`` as the router an operator runs (issue 30), on real vLLM engines: two
Prefill and two Decode engines (tiny Llama, cma) behind proxies, the session's plain
engine as the token reference.

* prefix affinity: two-turn conversations; the second turn pulls a fraction of a full
  pull on the Decode that served the first (round robin: about half pull everything);
* conditional disaggregation: a second turn adding fewer tokens than the threshold is
  answered with no Prefill dispatch, equal;
* two proxies in front of the same engines with a round-robin client;
* drain a Decode under load (0 failed, drained);
* kill a Decode, then a Prefill, under load: ejected within the probe interval, every
  request after the ejection succeeds, the restarted engine is readmitted and equal;
* the only Decode, then the only Prefill, of a proxy at its defaults killed under load
  and restarted: every request from 1 s after its /health answers is answered, equal;
* a Prefill answering 500 and a Decode answering 400: the client gets that status and
  the error body;
* the traceparent a client sends appears in the logs and timelines of both engines;
* sidecar mode: the Prefill named by ``x-prefiller-host-port``, within the allowlist.

Figures are printed with ``-s``.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from fakes.net import free_port, quiet_ports
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client.parser import text_string_to_metric_families
from servers import (
    Server,
    proxy_server,
    rd2h_kv,
    running,
    secret_file,
    vllm_server,
    wait_admitted,
)

from rd2h.demo.tiny_model import VOCAB

pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]

MAX_TOKENS = 8
BLOCK = 32
TOKEN = "router-e2e-admin-token"
PROBE_S = 0.5
FAST = ["--probe-interval", str(PROBE_S), "--probe-timeout", "2", "--eject-backoff", "1",
        "--eject-backoff-max", "2"]
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _prompt(n: int, seed: int) -> list[int]:
    return [2 + (seed * 131 + i * 17 + seed * i) % (VOCAB - 2) for i in range(n)]


def _body(model: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, **extra}


def _tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def _pulled(server: Server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:rd2h_bytes_pulled_total")


def _settled_pulled(decodes: list[Server], before: float, deadline_s: float = 15.0) -> float:
    """Bytes pulled by ``decodes`` once the counter moved past ``before`` and held still
    for a second (stats reach /metrics with the engine's steps)."""
    t0, last, still = time.monotonic(), None, 0.0
    while time.monotonic() - t0 < deadline_s:
        now = sum(_pulled(d) for d in decodes)
        if now == last and now > before:
            still += 0.25
            if still >= 1.0:
                return now
        else:
            still = 0.0
        last = now
        time.sleep(0.25)
    return sum(_pulled(d) for d in decodes)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, llama_model, llama_reference) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("router")
    extra = {"transport": "cma", "log_level": "INFO",
             "deadlines": {"layer_ack_s": 10.0, "meta_ack_s": 5.0}}
    s: dict[str, Server] = {}
    for name in ("p0", "p1"):
        s[name] = vllm_server(f"prefill {name}", llama_model, free_port(), root / f"{name}.log",
                              kv=rd2h_kv("kv_producer", quiet_ports(2), extra), log_stats=True)
    for name in ("d0", "d1"):
        s[name] = vllm_server(f"decode {name}", llama_model, free_port(), root / f"{name}.log",
                              kv=rd2h_kv("kv_consumer", quiet_ports(2), extra), log_stats=True)
    prefills, decodes = [s["p0"].url, s["p1"].url], [s["d0"].url, s["d1"].url]
    # The admin token from a file (never on the command line; conftest checks the logs).
    admin = [*FAST, "--admin-token-file", str(secret_file(root / "admin-token", TOKEN))]
    s["proxy"] = proxy_server(free_port(), prefills, decodes, root / "proxy.log", args=admin)
    s["rr"] = proxy_server(free_port(), prefills, decodes, root / "proxy_rr.log",
                           args=[*admin, "--decode-policy", "round_robin", "--prefill-policy",
                                 "round_robin", "--affinity-chunk", "0"])
    s["local"] = proxy_server(free_port(), prefills, decodes, root / "proxy_local.log",
                              args=[*admin, "--local-prefill-tokens", "64"])
    # One Prefill and one Decode, every routing flag at its default.
    s["solo"] = proxy_server(free_port(), [s["p0"].url], [s["d0"].url],
                             root / "proxy_solo.log")
    with running(*s.values()):
        yield {"model": str(llama_model), "base": llama_reference, "root": root, **s}


_REF: dict[tuple[int, ...], list[int]] = {}


def _reference(f: dict[str, Any], prompt: list[int]) -> list[int]:
    key = tuple(prompt)
    if key not in _REF:
        _REF[key] = _tokens(httpx.post(f["base"].url + "/v1/completions",
                                       json=_body(f["model"], prompt), timeout=120))
    return _REF[key]


def _ask(f: dict[str, Any], via: str, prompt: list[int], **kw: Any) -> httpx.Response:
    return httpx.post(f[via].url + "/v1/completions", json=_body(f["model"], prompt),
                      timeout=120, **kw)


def _counters(f: dict[str, Any], via: str) -> dict[str, int]:
    return httpx.get(f[via].url + "/healthcheck", timeout=10).json()["counters"]


def _logs(f: dict[str, Any], *names: str) -> str:
    return "\n".join(f"--- {k}\n{f[k].tail(25)}" for k in names)


# ------------------------------------------------------------------ affinity


def _two_turns(f: dict[str, Any], via: str, seed: int, n: int = 8) -> list[float]:
    """``n`` conversations: every first turn, then every second turn in a shuffled
    order, one request at a time; each second turn's pulled bytes as a fraction of
    what a full pull of its prompt takes (bytes per block from the first turns)."""
    decodes = [f["d0"], f["d1"]]
    firsts = [_prompt(200, seed + i) for i in range(n)]
    before = _settled_pulled(decodes, -1.0)
    seconds = []
    for p in firsts:
        out = _tokens(_ask(f, via, p))
        assert out == _reference(f, p)
        seconds.append(p + out + _prompt(40, seed + 100 + len(seconds)))
    total = _settled_pulled(decodes, before)
    per_block = (total - before) / sum(-(-len(p) // BLOCK) for p in firsts)
    fractions = []
    for i in random.Random(seed).sample(range(n), n):
        prompt, before = seconds[i], total
        assert _tokens(_ask(f, via, prompt)) == _reference(f, prompt)
        total = _settled_pulled(decodes, before)
        fractions.append((total - before) / (per_block * -(-len(prompt) // BLOCK)))
    return fractions


def test_prefix_affinity_sends_the_second_turn_where_the_first_was(fleet) -> None:
    f = fleet
    affine = _two_turns(f, "proxy", 5000)
    rr = _two_turns(f, "rr", 6000)
    print(f"\nsecond turns, pulled / full pull: affinity {[round(x, 2) for x in affine]} "
          f"(mean {sum(affine) / len(affine):.2f}); round robin {[round(x, 2) for x in rr]} "
          f"(mean {sum(rr) / len(rr):.2f}, {sum(x > 0.9 for x in rr)}/{len(rr)} whole)")
    assert max(affine) <= 0.35, affine
    assert sum(x > 0.9 for x in rr) >= 2, rr  # round robin misses the cache often
    hits = httpx.get(f["proxy"].url + "/metrics", timeout=10).text
    assert 'rd2h_proxy_affinity_total{result="hit"}' in hits


def test_decode_holding_the_prompt_answers_without_prefill(fleet) -> None:
    f = fleet
    first = _prompt(200, 7000)
    out = _tokens(_ask(f, "local", first))
    assert out == _reference(f, first)
    before = _counters(f, "local")
    second = first + out + _prompt(10, 7001)  # 26 tokens past Decode's cached blocks
    sampled = "00-5bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    got = _tokens(_ask(f, "local", second, headers={"traceparent": sampled}))
    after = _counters(f, "local")
    print(f"\nlocal prefill: counters before {before['prefill_dispatched']} dispatched / "
          f"{before['prefill_skipped']} skipped, after {after['prefill_dispatched']} / "
          f"{after['prefill_skipped']}")
    assert got == _reference(f, second), _logs(f, "local", "d0", "d1")
    assert after["prefill_skipped"] == before["prefill_skipped"] + 1
    assert after["prefill_dispatched"] == before["prefill_dispatched"]
    logs = f["d0"].log.read_text(errors="replace") + f["d1"].log.read_text(errors="replace")
    assert "computing the prompt locally" in logs and sampled in logs


# ------------------------------------------------------------------ two proxies


async def _load(urls: list[str], model: str, prompts: list[list[int]], concurrency: int
                ) -> list[dict[str, Any]]:
    """Each prompt once, spread over ``urls`` round robin, ``concurrency`` at a time."""
    sem = asyncio.Semaphore(concurrency)

    async def one(c: httpx.AsyncClient, i: int, prompt: list[int]) -> dict[str, Any]:
        async with sem:
            t0 = time.monotonic()
            try:
                r = await c.post(urls[i % len(urls)] + "/v1/completions",
                                 json=_body(model, prompt))
            except httpx.HTTPError as exc:
                return {"prompt": prompt, "status": None, "error": repr(exc), "t0": t0}
            out = {"prompt": prompt, "status": r.status_code, "t0": t0,
                   "seconds": time.monotonic() - t0}
            if r.status_code == 200:
                out["tokens"] = list(r.json()["choices"][0]["token_ids"])
            else:
                out["error"] = r.text[:300]
            return out

    async with httpx.AsyncClient(timeout=180) as c:
        return await asyncio.gather(*(one(c, i, p) for i, p in enumerate(prompts)))


def test_two_proxies_in_front_of_the_same_engines(fleet) -> None:
    f = fleet
    prompts = [_prompt(120 + 5 * i, 8000 + i) for i in range(12)]
    for p in prompts:
        _reference(f, p)
    results = asyncio.run(_load([f["proxy"].url, f["rr"].url], f["model"], prompts, 4))
    for r in results:
        assert r["status"] == 200 and r["tokens"] == _reference(f, r["prompt"]), r
    for via in ("proxy", "rr"):
        assert httpx.get(f[via].url + "/healthcheck", timeout=10).json()["pending"] == 0


# ------------------------------------------------------------------ drain


def test_drain_a_decode_under_load(fleet) -> None:
    f = fleet
    prompts = [_prompt(150 + 3 * i, 9000 + i) for i in range(16)]
    for p in prompts:
        _reference(f, p)
    target = {"role": "decode", "url": f["d0"].url}

    async def main() -> tuple[list[dict[str, Any]], float]:
        load = asyncio.create_task(_load([f["proxy"].url], f["model"], prompts, 4))
        async with httpx.AsyncClient(timeout=10, headers=AUTH) as c:
            while True:  # drain once d0 has requests in flight
                status = (await c.get(f["proxy"].url + "/status")).json()
                [d0] = [i for i in status["instances"]["decode"] if i["url"] == f["d0"].url]
                if d0["in_flight"] >= 1:
                    break
                await asyncio.sleep(0.01)
            r = await c.post(f["proxy"].url + "/admin/instances/drain", json=target)
            assert r.status_code == 200 and r.json()["state"] == "draining", r.text
            t0 = time.monotonic()
            while not (await c.get(f["proxy"].url + "/admin/instances/drain",
                                   params=target)).json()["drained"]:
                assert time.monotonic() - t0 < 120, "never drained"
                await asyncio.sleep(0.05)
            took = time.monotonic() - t0
        return await load, took

    served_before = _served(f, "d0")
    results, took = asyncio.run(main())
    served_after = _served(f, "d0")
    print(f"\ndrain: d0 drained {took:.2f} s after the call; d0 served "
          f"{served_after - served_before} of 16")
    assert all(r["status"] == 200 and r["tokens"] == _reference(f, r["prompt"])
               for r in results), results
    later = _tokens(_ask(f, "proxy", _prompt(100, 9100)))
    assert later == _reference(f, _prompt(100, 9100))
    assert _served(f, "d0") == served_after  # nothing new reached the drained instance
    r = httpx.post(f["proxy"].url + "/admin/instances", json=target, headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.json()["state"] == "admitted"


def _served(f: dict[str, Any], name: str, via: Server | None = None) -> int:
    """Requests the engine ``name`` answered well, as the proxy ``via`` counts them."""
    proxy = f["proxy"] if via is None else via
    status = httpx.get(proxy.url + "/status", timeout=10).json()["instances"]
    return next(i["served"] for role in status.values() for i in role
                if i["url"] == f[name].url)


# ------------------------------------------------------------------ kills


def _kill_under_load(f: dict[str, Any], victim: str, n: int = 24
                     ) -> tuple[list[dict[str, Any]], float, float]:
    """``n`` requests through the proxy at concurrency 4; ``victim`` SIGKILLed once the
    proxy has it busy. Returns the results, the kill time and the time the proxy's
    /status first showed it ejected (monotonic)."""
    seed = {"d1": 10000, "p1": 11000}[victim]
    prompts = [_prompt(150 + 3 * i, seed + i) for i in range(n)]
    for p in prompts:
        _reference(f, p)

    async def main() -> tuple[list[dict[str, Any]], float, float]:
        load = asyncio.create_task(_load([f["proxy"].url], f["model"], prompts, 4))
        async with httpx.AsyncClient(timeout=10) as c:
            while True:
                status = (await c.get(f["proxy"].url + "/status")).json()["instances"]
                me = next(i for role in status.values() for i in role
                          if i["url"] == f[victim].url)
                if me["in_flight"] >= 1:
                    break
                await asyncio.sleep(0.01)
            f[victim].kill()
            killed = time.monotonic()
            while True:
                status = (await c.get(f["proxy"].url + "/status")).json()["instances"]
                me = next(i for role in status.values() for i in role
                          if i["url"] == f[victim].url)
                if me["state"] == "ejected":
                    ejected = time.monotonic()
                    break
                assert time.monotonic() - killed < 30, "never ejected"
                await asyncio.sleep(0.02)
        return await load, killed, ejected

    return asyncio.run(main())


@pytest.mark.parametrize("victim", ["d1", "p1"])
def test_a_killed_engine_is_ejected_and_readmitted_when_restarted(fleet, victim) -> None:
    f = fleet
    results, killed, ejected = _kill_under_load(f, victim)
    failed = [r for r in results if r["status"] != 200]
    after = [r for r in results if r["t0"] > ejected]
    print(f"\n{victim} killed: ejected {ejected - killed:.2f} s after the kill (probe "
          f"interval {PROBE_S} s); {len(failed)} of {len(results)} requests failed "
          f"({sorted({str(r['status']) for r in failed})}), {len(after)} sent after the "
          f"ejection")
    assert ejected - killed <= PROBE_S + 2.5  # one probe interval and one probe deadline
    for r in results:
        if r["status"] == 200:
            assert r["tokens"] == _reference(f, r["prompt"]), r
        else:
            assert r["status"] in (500, 502, 503, 504), r  # a clean error, never a hang
    for r in after:
        assert r["status"] == 200, (r, _logs(f, "proxy"))
    if victim == "d1":  # nothing sent after the kill is lost while d0 serves
        for r in results:
            if r["t0"] > killed:
                assert r["status"] == 200, (r, _logs(f, "proxy"))
    f[victim].start()
    f[victim].wait_ready("/health", time.monotonic() + 420)
    took = wait_admitted(f["proxy"], f[victim].url)
    served = _served(f, victim)
    for i in range(4):  # least outstanding: ties rotate, so the instance gets some
        prompt = _prompt(90, 12000 + i + (50 if victim == "p1" else 0))
        assert _tokens(_ask(f, "proxy", prompt)) == _reference(f, prompt)
    print(f"{victim} readmitted {took:.2f} s after it served /health again")
    assert _served(f, victim) > served
    for via in ("rr", "local"):
        wait_admitted(f[via], f[victim].url)


def _healthy_at(server: Server, deadline_s: float = 420.0) -> float:
    """The monotonic time the engine's own /health first answered 200 (polled at 20 Hz)."""
    end = time.monotonic() + deadline_s
    while True:
        assert server.proc is not None and server.proc.poll() is None, server.tail()
        try:
            if httpx.get(server.url + "/health", timeout=1.0).status_code == 200:
                return time.monotonic()
        except httpx.HTTPError:
            pass
        assert time.monotonic() < end, f"{server.name} not healthy in {deadline_s} s"
        time.sleep(0.05)


@pytest.mark.parametrize("victim", ["d0", "p0"])
def test_the_only_engine_of_a_role_serves_once_it_is_back(fleet, victim) -> None:
    """Issue #60: a proxy at its defaults with one Prefill and one Decode; the victim
    SIGKILLed under load and kept down long enough for its probes to fail several times,
    then restarted. Every request sent from 1 s after the engine's /health answers 200
    is answered, equal to the plain engine (the back-off holds only while another
    instance of the role can serve)."""
    f = fleet
    solo = f["solo"]
    seed = {"d0": 13000, "p0": 14000}[victim]
    prompts = [_prompt(120 + 5 * i, seed + i) for i in range(12)]
    for p in prompts:
        _reference(f, p)

    async def under_load() -> list[dict[str, Any]]:
        load = asyncio.create_task(_load([solo.url], f["model"], prompts[:8], 2))
        async with httpx.AsyncClient(timeout=10) as c:
            end = time.monotonic() + 120
            while sum(i["served"] for role in (await c.get(solo.url + "/status")).json()[
                    "instances"].values() for i in role) < 2 and time.monotonic() < end:
                await asyncio.sleep(0.02)
            f[victim].kill()
            while True:
                status = (await c.get(solo.url + "/status")).json()["instances"]
                if any(i["url"] == f[victim].url and i["state"] == "ejected"
                       for role in status.values() for i in role):
                    break
                assert time.monotonic() < end, "never ejected"
                await asyncio.sleep(0.05)
        return await load

    results = asyncio.run(under_load())
    for r in results:
        if r["status"] == 200:
            assert r["tokens"] == _reference(f, r["prompt"]), r
        else:
            assert r["status"] in (500, 502, 503, 504), r  # a clean error, never a hang
    time.sleep(8)  # down a while: its probes fail (every 2 s by default)
    f[victim].start()
    healthy = _healthy_at(f[victim])
    sent: list[dict[str, Any]] = []
    i = 0
    while sum(1 for r in sent if r["t0"] >= healthy + 1.0) < 8:
        prompt = prompts[i % len(prompts)]
        i += 1
        t0 = time.monotonic()
        r = httpx.post(solo.url + "/v1/completions", json=_body(f["model"], prompt),
                       timeout=120)
        sent.append({"t0": t0, "done": time.monotonic(), "status": r.status_code,
                     "prompt": prompt, "tokens": _tokens(r) if r.status_code == 200 else None,
                     "error": r.text[:300] if r.status_code != 200 else ""})
        assert time.monotonic() - healthy < 180, sent[-1]
    first = next((f"{r['done'] - healthy:.2f} s" for r in sent if r["status"] == 200),
                 "never")
    print(f"\n{victim} (the only one of its role) restarted: first request answered "
          f"{first} after its /health answered 200; {len(sent)} sent from then, "
          f"{sum(r['status'] == 200 for r in sent)} answered 200; the 8 sent around the "
          f"kill: {sum(r['status'] == 200 for r in results)} answered")
    for r in sent:
        if r["t0"] >= healthy + 1.0:
            assert r["status"] == 200, (r, _logs(f, "solo"))
            assert r["tokens"] == _reference(f, r["prompt"]), r
    for via in ("proxy", "rr", "local"):
        wait_admitted(f[via], f[victim].url)


# ------------------------------------------------------------------ honest statuses


class _Stub:
    """A Prefill stand-in (a real HTTP server) that answers 500 with an error body."""

    def __init__(self) -> None:
        app = FastAPI()
        app.get("/health")(lambda: {})

        @app.post("/v1/completions")
        async def complete() -> JSONResponse:
            return JSONResponse({"error": {"message": "prefill exploded", "code": 500}},
                                status_code=500)

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            assert time.monotonic() - t0 < 10
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def test_prefill_500_and_decode_400_reach_the_client(fleet) -> None:
    f = fleet
    stub = _Stub()
    try:
        proxy = proxy_server(free_port(), [f"http://127.0.0.1:{stub.port}"], [f["d0"].url],
                             f["root"] / "proxy_stub.log", args=FAST)
        with running(proxy):
            t0 = time.monotonic()
            r = httpx.post(proxy.url + "/v1/completions", json=_body(
                f["model"], _prompt(100, 13000), stream=True), timeout=60)
            took = time.monotonic() - t0
            print(f"\nPrefill 500: client got HTTP {r.status_code} after {took:.2f} s: "
                  f"{r.text[:120]}")
            assert r.status_code == 500 and r.json() == {
                "error": {"message": "prefill exploded", "code": 500}}
            assert took < 10
            # Decode's leg was closed: it runs nothing for it.
            deadline = time.monotonic() + 20
            while _running(f["d0"]) != 0:
                assert time.monotonic() < deadline, f["d0"].tail(20)
                time.sleep(0.2)
            # Decode's own 400 (more tokens than the model's length).
            r = httpx.post(proxy.url + "/v1/completions", json=_body(
                f["model"], _prompt(100, 13001), max_tokens=100000), timeout=60)
            print(f"Decode 400: client got HTTP {r.status_code}: {r.text[:120]}")
            assert r.status_code == 400
            assert "max_tokens" in r.text or "maximum context length" in r.text, r.text
    finally:
        stub.stop()


def _running(server: Server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "vllm:num_requests_running")


# ------------------------------------------------------------------ traces, sidecar


def test_traceparent_reaches_both_engines_logs_and_timelines(fleet) -> None:
    f = fleet
    trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    prompt = _prompt(120, 14000)
    r = _ask(f, "proxy", prompt, headers={"traceparent": trace})
    assert _tokens(r) == _reference(f, prompt)
    logs = {n: f[n].log.read_text(errors="replace") for n in ("p0", "p1", "d0", "d1")}
    assert any(trace in logs[n] and "sending KV to decode" in logs[n] for n in ("p0", "p1"))
    assert any(trace in logs[n] and "pulling KV from prefill" in logs[n] for n in ("d0", "d1"))
    stamps = [json.loads(line) for p in _timeline_files() for line in p.read_text().splitlines()
              if trace in line]
    hops = {s["hop"] for s in stamps}
    print(f"\ntraceparent stamped on hops {sorted(hops)}")
    assert {"proxy.received", "decode.matched", "prefill.tracked"} <= hops


def _timeline_files() -> list:
    import stall

    return sorted(stall.timeline_dir().glob("stamps-*.jsonl"))


def test_sidecar_mode_uses_the_named_prefill_and_refuses_others(fleet) -> None:
    f = fleet
    sidecar = proxy_server(free_port(), [f["p0"].url, f["p1"].url], [f["d1"].url],
                           f["root"] / "sidecar.log", args=[*FAST, "--prefiller-header"])
    with running(sidecar):
        named = f["p1"].url.removeprefix("http://")
        for i in range(3):
            prompt = _prompt(100, 15000 + i)
            r = httpx.post(sidecar.url + "/v1/completions", json=_body(f["model"], prompt),
                           headers={"x-prefiller-host-port": named}, timeout=120)
            assert _tokens(r) == _reference(f, prompt)
        assert _served(f, "p1", via=sidecar) == 3
        assert _served(f, "p0", via=sidecar) == 0
        r = httpx.post(sidecar.url + "/v1/completions", json=_body(f["model"], _prompt(50, 1)),
                       headers={"x-prefiller-host-port": "10.9.9.9:8000"}, timeout=30)
        assert r.status_code == 403, r.text

