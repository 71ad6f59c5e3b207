"""Prefill and Decode on separate hosts, as operators run them (issue 42): real vLLM
engines in two network namespaces joined by a bridge (``tests/integration/hosts.py``),
KV pulled over Mooncake TCP between the hosts' addresses, behind ``rd2h proxy`` on a third address
(the test's own namespace), the session's plain engine as the token reference.

* 1 Prefill + 1 Decode: tokens equal, and the pulled bytes crossed the Decode host's
  link (its veth received at least as many bytes as rd2h counts as pulled);
* 2 Prefill (one host) + 1 Decode: concurrent requests, both Prefills used, tokens equal;
* the Decode host's link cut mid-stream (its veth set down: no FIN, no RST): every
  stream ends within the proxy's read deadline, a new request is answered at once,
  both Prefills give every block back within their gate budget, and once the link is
  back the proxy readmits Decode, Decode is idle, and tokens are equal again.

Figures are printed with ``-s``.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import hosts as net
import httpx
import pytest
from fakes.net import free_port
from prometheus_client.parser import text_string_to_metric_families
from servers import Server, bytes_pulled, proxy_server, rd2h_kv, running, vllm_server

from rd2h.demo.tiny_model import VOCAB
from rd2h.domain.prefill.prefill_state import PrefillTimeouts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

MAX_TOKENS = 8
KV_PORT = 20000
ENGINE_PORT = 8000
DECODE_TIMEOUT_S = 20.0
DEADLINES = {"layer_ack_s": 10.0, "meta_ack_s": 5.0, "device_event_s": 10.0,
             "request_s": 30.0}
GATE_BUDGET_S = PrefillTimeouts(
    meta_ack_s=DEADLINES["meta_ack_s"], layer_ack_s=DEADLINES["layer_ack_s"],
    device_event_s=DEADLINES["device_event_s"]).gate_budget_s
PROXY_ARGS = ["--probe-interval", "0.5", "--probe-timeout", "2", "--eject-backoff", "1",
              "--eject-backoff-max", "2", "--connect-timeout", "3",
              "--decode-timeout", str(DECODE_TIMEOUT_S), "--prefill-policy", "round_robin"]
IDLE = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def _prompt(n: int, seed: int) -> list[int]:
    return [2 + (seed * 131 + i * 17 + seed * i) % (VOCAB - 2) for i in range(n)]


def _body(model: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, **extra}


def _tokens(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, resp.text
    (choice,) = resp.json()["choices"]
    return list(choice["token_ids"])


def _metrics(url: str, *names: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, llama_model, llama_reference) -> Iterator[dict[str, Any]]:
    try:
        made = net.create("xh", ("prefill", "decode"))
    except net.HostsUnavailable as exc:  # CI runs as root with iproute2: never expected
        pytest.fail(f"two hosts cannot be made here: {exc}")
    root = tmp_path_factory.mktemp("across-hosts")
    p_host, d_host = made["prefill"], made["decode"]

    def kv(role: str, host: net.Host, kv_port: int) -> dict:
        return rd2h_kv(role, kv_port, {"transport": "mooncake", "mooncake_protocol": "tcp",
                                       "host": host.addr, "log_level": "INFO",
                                       "deadlines": DEADLINES})

    s: dict[str, Server] = {
        "p0": vllm_server("prefill 0 (prefill host)", llama_model, ENGINE_PORT,
                          root / "p0.log", kv=kv("kv_producer", p_host, KV_PORT),
                          log_stats=True, host=p_host.addr, prefix=p_host.exec_prefix()),
        "p1": vllm_server("prefill 1 (prefill host)", llama_model, ENGINE_PORT + 1,
                          root / "p1.log", kv=kv("kv_producer", p_host, KV_PORT + 10),
                          log_stats=True, host=p_host.addr, prefix=p_host.exec_prefix()),
        "d": vllm_server("decode (decode host)", llama_model, ENGINE_PORT, root / "d.log",
                         kv=kv("kv_consumer", d_host, KV_PORT), log_stats=True,
                         host=d_host.addr, prefix=d_host.exec_prefix()),
    }
    router = made.router_addr
    s["one"] = proxy_server(free_port(router), [s["p0"].url], [s["d"].url],
                            root / "proxy_one.log", args=PROXY_ARGS, host=router)
    s["two"] = proxy_server(free_port(router), [s["p0"].url, s["p1"].url], [s["d"].url],
                            root / "proxy_two.log", args=PROXY_ARGS, host=router)
    try:
        with running(*s.values()):
            yield {"model": str(llama_model), "base": llama_reference, "hosts": made, **s}
    finally:
        net.delete(made)


_REF: dict[tuple[int, ...], list[int]] = {}


def _reference(c: dict[str, Any], prompt: list[int]) -> list[int]:
    key = tuple(prompt)
    if key not in _REF:
        _REF[key] = _tokens(httpx.post(c["base"].url + "/v1/completions",
                                       json=_body(c["model"], prompt), timeout=120))
    return _REF[key]


def _ask(c: dict[str, Any], via: str, prompt: list[int]) -> httpx.Response:
    return httpx.post(c[via].url + "/v1/completions", json=_body(c["model"], prompt),
                      timeout=120)


def _logs(c: dict[str, Any], *names: str) -> str:
    return "\n".join(f"--- {k}\n{c[k].tail(25)}" for k in names)


def _settled(read, before: float, deadline_s: float = 15.0) -> float:
    """``read()`` once it moved past ``before`` and held still for a second."""
    t0, last, still = time.monotonic(), None, 0.0
    while time.monotonic() - t0 < deadline_s:
        now = read()
        still = still + 0.25 if now == last and now > before else 0.0
        if still >= 1.0:
            return now
        last = now
        time.sleep(0.25)
    return read()


def test_one_prefill_one_decode_across_hosts(cluster) -> None:
    c = cluster
    d_host: net.Host = c["hosts"]["decode"]
    # The engines state their transport and the address they advertise at start.
    for name, host in (("p0", c["hosts"]["prefill"]), ("d", d_host)):
        log = c[name].log.read_text(errors="replace")
        assert "mooncake" in log and host.addr in log, c[name].tail()
    prompts = [_prompt(n, 100 + n) for n in (40, 100, 200, 300)]
    pulled0, (rx0, _) = bytes_pulled(c["d"]), d_host.rx_tx_bytes()
    for p in prompts:
        assert _tokens(_ask(c, "one", p)) == _reference(c, p), _logs(c, "one", "p0", "d")
    pulled = _settled(lambda: bytes_pulled(c["d"]), pulled0) - pulled0
    rx = d_host.rx_tx_bytes()[0] - rx0
    print(f"\n1P+1D across hosts: {len(prompts)} requests equal; pulled {pulled:.0f} B over "
          f"Mooncake TCP, the Decode host's link received {rx} B")
    assert pulled > 0
    assert rx >= pulled, "the pulled KV did not cross the Decode host's link"


def test_two_prefills_one_decode_across_hosts(cluster) -> None:
    c = cluster
    success = "vllm:request_success_total"
    before = {n: _metrics(c[n].url, success)[success] for n in ("p0", "p1")}
    prompts = [_prompt(60 + 17 * i, 300 + i) for i in range(8)]
    results: dict[int, httpx.Response] = {}

    def one(i: int) -> None:
        results[i] = _ask(c, "two", prompts[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(results) == len(prompts)
    for i, p in enumerate(prompts):
        assert _tokens(results[i]) == _reference(c, p), _logs(c, "two", "p0", "p1", "d")
    served = {n: _metrics(c[n].url, success)[success] - before[n] for n in ("p0", "p1")}
    print(f"\n2P+1D across hosts: {len(prompts)} concurrent requests equal; Prefill "
          f"requests served: {served}")
    assert all(v >= 1 for v in served.values()), served


def _stream(c: dict[str, Any], prompt: list[int], out: dict[str, Any]) -> None:
    """One streamed completion through proxy "two"; records when its first chunk came,
    when it ended and how (``done``: [DONE] seen; ``cut``: the stream ended without it;
    ``status``: an error status; ``client-timeout``: the client's own deadline)."""
    body = _body(c["model"], prompt, stream=True, max_tokens=400, ignore_eos=True)
    try:
        with httpx.stream("POST", c["two"].url + "/v1/completions", json=body,
                          timeout=httpx.Timeout(60.0, connect=5.0)) as r:
            if r.status_code != 200:
                out["how"] = f"status {r.status_code}"
            else:
                for line in r.iter_lines():
                    out.setdefault("first", time.monotonic())
                    if line.strip() == "data: [DONE]":
                        out["how"] = "done"
                out.setdefault("how", "cut")
    except httpx.TimeoutException:
        out["how"] = "client-timeout"
    except httpx.HTTPError as exc:
        out["how"] = f"cut ({type(exc).__name__})"
    out["end"] = time.monotonic()


def _post(c: dict[str, Any], prompt: list[int], out: dict[str, Any]) -> None:
    """One plain completion through proxy "two", recorded like ``_stream``'s."""
    try:
        r = httpx.post(c["two"].url + "/v1/completions", json=_body(c["model"], prompt),
                       timeout=httpx.Timeout(60.0, connect=5.0))
        out["how"] = "done" if r.status_code == 200 else f"status {r.status_code}"
    except httpx.TimeoutException:
        out["how"] = "client-timeout"
    except httpx.HTTPError as exc:
        out["how"] = f"cut ({type(exc).__name__})"
    out["end"] = time.monotonic()


def _idle(c: dict[str, Any], names: tuple[str, ...], idle: dict[str, dict[str, float]],
          deadline_s: float) -> float:
    t0 = time.monotonic()
    while True:
        now = {n: _metrics(c[n].url, *IDLE) for n in names}
        if all(now[n] == idle[n] for n in names):
            return time.monotonic() - t0
        assert time.monotonic() - t0 < deadline_s, (now, idle)
        time.sleep(0.5)


def _reconnects(prefill: Server) -> int:
    """How often this Prefill's control connection to a Decode came back after a loss."""
    return prefill.log.read_text(errors="replace").count("decode endpoint reconnected")


def _admitted(proxy: Server, url: str) -> bool:
    status = httpx.get(proxy.url + "/status", timeout=5).json()["instances"]
    return any(i["url"] == url and i["state"] == "admitted" for r in status.values()
               for i in r)


def test_decode_host_link_cut_mid_stream(cluster) -> None:
    c = cluster
    d_host: net.Host = c["hosts"]["decode"]
    idle = {n: _metrics(c[n].url, *IDLE) for n in ("p0", "p1", "d")}
    reconnects = {n: _reconnects(c[n]) for n in ("p0", "p1")}
    streams: list[dict[str, Any]] = [{} for _ in range(6)]
    threads = [threading.Thread(target=_stream, args=(c, _prompt(64 + 8 * i, 500 + i), o))
               for i, o in enumerate(streams)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    while not all("first" in o or "end" in o for o in streams):
        assert time.monotonic() - t0 < 120, streams
        time.sleep(0.05)
    # Requests whose KV is being prefilled or pulled when the link goes, too.
    pulls: list[dict[str, Any]] = [{} for _ in range(4)]
    threads += [threading.Thread(target=_post, args=(c, _prompt(300, 550 + i), o))
                for i, o in enumerate(pulls)]
    for t in threads[len(streams):]:
        t.start()
    time.sleep(0.3)
    d_host.link(up=False)
    cut = time.monotonic()
    try:
        for t in threads:
            t.join(DECODE_TIMEOUT_S + 30)
        ended = [o.get("end", float("inf")) - cut for o in streams + pulls]
        hows = [o.get("how") for o in streams + pulls]
        # A request sent while the link is down is answered, not left waiting.
        t1 = time.monotonic()
        late = httpx.post(c["two"].url + "/v1/completions",
                          json=_body(c["model"], _prompt(50, 599)), timeout=60)
        late_s = time.monotonic() - t1
        p_idle_s = _idle(c, ("p0", "p1"), idle, GATE_BUDGET_S + 10)
    finally:
        d_host.link(up=True)
    print(f"\nDecode host's link cut mid-stream: 6 streams and 4 requests being pulled ended "
          f"{[round(x, 1) for x in ended]} s after the cut ({hows}); a request sent "
          f"meanwhile answered {late.status_code} in "
          f"{late_s:.1f} s; both Prefills idle {p_idle_s:.1f} s after that "
          f"(gate budget {GATE_BUDGET_S:g} s)")
    assert all(x <= DECODE_TIMEOUT_S + 10 for x in ended), (ended, hows)
    assert "client-timeout" not in hows, hows
    assert late.status_code != 200 and late_s < 15, (late.status_code, late.text)
    # The link is back: both Prefills reconnect their control connections within a few
    # seconds (a connect attempt is bounded, not left to the kernel's SYN back-off),
    # Decode is readmitted, finishes or drops what it held, and serves again.
    t2 = time.monotonic()
    while not (all(_reconnects(c[n]) > reconnects[n] for n in ("p0", "p1"))
               and _admitted(c["two"], c["d"].url)):
        assert time.monotonic() - t2 < 15, _logs(c, "two", "p0", "p1", "d")
        time.sleep(0.25)
    back_s = time.monotonic() - t2
    d_idle_s = _idle(c, ("d",), idle, DEADLINES["request_s"] + 60)
    pending = httpx.get(c["two"].url + "/healthcheck", timeout=10).json()["pending"]
    assert pending == 0
    for i in range(3):
        p = _prompt(120 + 30 * i, 700 + i)
        assert _tokens(_ask(c, "two", p)) == _reference(c, p), _logs(c, "two", "p0", "p1", "d")
    print(f"link back: Prefills reconnected and Decode readmitted in {back_s:.1f} s, "
          f"Decode idle after {d_idle_s:.1f} s, 3 requests equal")


def test_hosts_helper_cuts_a_link() -> None:
    """The cut the test above relies on is real: with the link down, a host cannot
    reach another, and reaches it again once it is back up."""
    import sys

    made = net.create("hc", ("a", "b"), subnet="10.231.10")
    server = None
    try:
        a, b = made["a"], made["b"]
        server = subprocess.Popen([*b.exec_prefix(), sys.executable, "-m", "http.server",
                                   "8080", "--bind", b.addr], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        probe = ("import socket, sys\n"
                 f"try: socket.create_connection(('{b.addr}', 8080), timeout=2)\n"
                 "except OSError: sys.exit(1)")

        def reach() -> bool:
            return subprocess.run([*a.exec_prefix(), sys.executable, "-c", probe],
                                  timeout=30).returncode == 0

        t0 = time.monotonic()
        while not reach():
            assert time.monotonic() - t0 < 30, "the server on host b never answered"
            time.sleep(0.2)
        b.link(up=False)
        assert not reach()
        b.link(up=True)
        assert reach()
    finally:
        if server is not None:
            server.kill()
            server.wait(10)
        net.delete(made)
