"""Disaggregated serving on real vLLM: a Prefill engine and a Decode engine with
``SfaRemoteD2HConnector`` over the ``cma`` transport, ``rd2h proxy`` in front,
and a single non-disaggregated engine as the reference.

Run alone with ``pytest tests/integration/vllm``. The engines are real ``vllm
serve`` processes on a tiny random-weight Llama (see rd2h/demo/tiny_model.py for why not
the MLA model); Prefill uses chunked prefill (--max-num-batched-tokens 64); greedy tokens
through the proxy must equal the reference engine's for the same prompts. Then
Prefill is killed: the proxy's dispatch fails and Decode, told at once, fails the
request at once (not at its KV deadline), and serves again once a Prefill is back.
The Decode engine keeps vLLM's stats on, so rd2h's series on its ``/metrics`` are
checked too.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import stall

# Sibling helpers: pytest puts this directory on sys.path (it is deliberately not a
# package: a package named "vllm" under tests/ would shadow the real vLLM).
from fakes.net import free_port, quiet_ports
from prometheus_client.parser import text_string_to_metric_families
from servers import proxy_server, rd2h_kv, running, vllm_server, wait_admitted

from rd2h.adapters.vllm.prom import VLLM_ENGINE_LABELS
from rd2h.demo.tiny_model import NUM_LAYERS, VOCAB

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

SEAMS = Path(__file__).parent / "seams"
REQUEST_DEADLINE_S = 25.0
MAX_TOKENS = 8


def _prompt(n: int, seed: int) -> list[int]:
    # Ids 2.. (0 and 1 are bos/eos), varied so requests differ.
    return [2 + (seed * 131 + i * 17) % (VOCAB - 2) for i in range(n)]


# Lengths in 32-token cache blocks: a partial last block (40), exact blocks (64),
# several blocks with a partial tail (150), and prompts longer than
# --max-num-batched-tokens 64, so Prefill computes them in chunks (150, 200).
PROMPTS = [_prompt(40, 1), _prompt(64, 2), _prompt(150, 3), _prompt(200, 4), _prompt(17, 5)]
PROMPT_LIST = [_prompt(33, 6), _prompt(90, 7), _prompt(48, 8)]


def _complete(url: str, model: str, prompt, timeout: float = 120.0) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}
    return stall.post(url + "/v1/completions", body, timeout)


def _tokens(resp: httpx.Response) -> list[list[int]]:
    assert resp.status_code == 200, resp.text
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    return [list(c["token_ids"]) for c in choices]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, llama_model, llama_reference):
    root = tmp_path_factory.mktemp("vllm-e2e")
    model = llama_model
    kv_port = quiet_ports(4)  # bound after the model loads: keep it out of the way
    extra = {"transport": "cma", "log_level": "INFO",
             "deadlines": {"request_s": REQUEST_DEADLINE_S, "layer_ack_s": 10.0,
                           "meta_ack_s": 5.0}}
    admit_delay = root / "admit-delay"  # absent: Decode admits at its own pace
    p_cfg = rd2h_kv("kv_producer", kv_port, extra)
    d_cfg = rd2h_kv("kv_consumer", kv_port, extra)
    servers = {
        "prefill": vllm_server("prefill engine", model, free_port(), root / "prefill.log",
                               kv=p_cfg),
        "decode": vllm_server("decode engine", model, free_port(), root / "decode.log",
                              kv=d_cfg, log_stats=True,  # rd2h's /metrics series
                              # A test seam: admissions slowed while this file exists.
                              env={"PYTHONPATH": str(SEAMS),
                                   "RD2H_TEST_ADMIT_DELAY_FLAG": str(admit_delay)}),
    }
    servers["proxy"] = proxy_server(
        free_port(), [servers["prefill"].url], [servers["decode"].url], root / "proxy.log"
    )
    # The same engines behind a second proxy that dispatches Prefill and Decode at once.
    servers["parallel"] = proxy_server(
        free_port(), [servers["prefill"].url], [servers["decode"].url],
        root / "parallel-proxy.log", args=["--dispatch", "parallel"])
    with running(*servers.values()):
        yield {"model": str(model), "base": llama_reference, "kv_port": kv_port,
               "admit_delay": admit_delay, **servers}


def _logs(cluster) -> str:
    return "\n".join(f"--- {k}\n{cluster[k].tail(40)}" for k in ("prefill", "decode", "proxy"))


def test_greedy_tokens_match_a_single_engine(cluster):
    model, proxy, base = cluster["model"], cluster["proxy"], cluster["base"]
    for prompt in PROMPTS:
        want = _tokens(_complete(base.url, model, prompt))
        got = _tokens(_complete(proxy.url, model, prompt))
        assert got == want, f"prompt of {len(prompt)} tokens\n{_logs(cluster)}"
        assert len(got[0]) == MAX_TOKENS


def test_prompt_list_goes_to_prefill_once_and_matches(cluster):
    model, proxy, base = cluster["model"], cluster["proxy"], cluster["base"]
    want = _tokens(_complete(base.url, model, PROMPT_LIST))
    got = _tokens(_complete(proxy.url, model, PROMPT_LIST))
    assert got == want, _logs(cluster)
    health = httpx.get(proxy.url + "/healthcheck", timeout=10).json()
    assert health["pending"] == 0, health


def test_parallel_dispatch_matches_a_single_engine_with_and_without_a_prefix_hit(cluster):
    """``--dispatch parallel``: after the instance's first request, Prefill gets each
    request with Decode at once and announces before Decode admitted it; Decode keeps
    those announcements until its admission. A prompt Decode's prefix cache holds part
    of (sent twice, and one extending an earlier one) is announced whole, and Decode
    must not write the blocks it holds: tokens equal the single engine's either way."""
    model, proxy, base = cluster["model"], cluster["parallel"], cluster["base"]
    before = _rd2h_metrics(cluster["decode"].url)
    extended = PROMPTS[2] + _prompt(70, 9)  # 150 tokens Decode has seen, then new ones
    prompts = [*PROMPTS, PROMPTS[3], extended]
    wants = [_tokens(_complete(base.url, model, p)) for p in prompts]
    # On an idle host Decode admits before Prefill's first layer is out; slowed down
    # (as under load), it admits after: both orders must give the same tokens.
    for slow, (prompt, want) in [(i % 2 == 1, pw) for i, pw in enumerate(zip(prompts, wants))]:
        if slow:
            cluster["admit_delay"].write_text("0.3")
        try:
            got = _tokens(_complete(proxy.url, model, prompt))
        finally:
            cluster["admit_delay"].unlink(missing_ok=True)
        assert got == want, f"prompt of {len(prompt)} tokens\n{_logs(cluster)}\n" + \
            cluster["parallel"].tail(40)
    counters = httpx.get(proxy.url + "/healthcheck", timeout=10).json()["counters"]
    assert counters["prefill_parallel"] == len(PROMPTS) + 1, counters  # all but the first
    assert counters["parallel_mismatch"] == 0 and counters["prefill_failed"] == 0, counters
    # Decode posted only the first one: afterwards Prefill had its contact already.
    assert counters["metaserver_posts"] == 1, counters
    # The stats reach the frontend with later steps' outputs: wait for this run's.
    deadline = time.monotonic() + 30
    while True:
        after = _rd2h_metrics(cluster["decode"].url)
        if after["layers_done_total"] - before["layers_done_total"] >= 7 * NUM_LAYERS or (
                time.monotonic() > deadline):
            break
        time.sleep(0.5)
    grew = {k: after[k] - before.get(k, 0.0) for k in after}
    for name in FAILURES:
        assert grew[name] == 0, (name, grew, _logs(cluster))
    # Announcements did arrive before Decode's admission (what the change is for), and
    # every one of them was admitted in time.
    assert grew["announcements_parked_total"] > 0, grew
    assert grew["announcements_parked_expired_total"] == 0, grew


def test_streaming_through_the_proxy(cluster):
    model, proxy, base = cluster["model"], cluster["proxy"], cluster["base"]
    prompt = PROMPTS[0]
    want = _tokens(_complete(base.url, model, prompt))[0]
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, "stream": True}
    got: list[int] = []
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                import json

                for choice in json.loads(line[6:]).get("choices", []):
                    got.extend(choice.get("token_ids") or [])
    assert got == want, _logs(cluster)


RD2H_SERIES = "vllm:rd2h_"
FAILURES = ("layers_failed_total", "reads_failed_total", "requests_failed_total")


def _rd2h_metrics(url: str) -> dict[str, float]:
    """rd2h's samples on an engine's /metrics: name (``+{le}`` for buckets) -> value."""
    resp = httpx.get(url + "/metrics", timeout=10)
    assert resp.status_code == 200, resp.text
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            if s.name.startswith(RD2H_SERIES) and not s.name.endswith("_created"):
                assert s.labels.get("engine") == "0", s
                # The labels the metrics reference states (scripts/gen_reference.py).
                assert set(s.labels) - {"le", "cause"} == set(VLLM_ENGINE_LABELS), s
                le = s.labels.get("le")
                out[s.name[len(RD2H_SERIES):] + (f"+{le}" if le else "")] = s.value
    return out


def test_decode_metrics_show_the_pull(cluster):
    model, proxy, base, decode = (cluster["model"], cluster["proxy"], cluster["base"],
                                  cluster["decode"])
    before = _rd2h_metrics(decode.url)
    assert "bytes_pulled_total" in before and "read_latency_seconds_count" in before, before
    prompt = _prompt(120, 9)  # not seen before: nothing of it is in Decode's prefix cache
    want = _tokens(_complete(base.url, model, prompt))
    assert _tokens(_complete(proxy.url, model, prompt)) == want, _logs(cluster)

    # The stats of the steps that pulled reach the frontend with those steps' outputs;
    # allow a few more steps' worth before judging.
    deadline = time.monotonic() + 30
    while True:
        after = _rd2h_metrics(decode.url)
        if after["layers_done_total"] - before["layers_done_total"] >= NUM_LAYERS or (
                time.monotonic() > deadline):
            break
        time.sleep(0.5)
    grew = {k: after[k] - before.get(k, 0.0) for k in after}
    assert after["bytes_pulled_total"] > 0 and grew["bytes_pulled_total"] > 0, grew
    assert grew["layers_done_total"] >= NUM_LAYERS, grew
    assert grew["read_latency_seconds_count"] >= 1, grew
    assert grew["read_latency_seconds_sum"] > 0, grew
    assert grew["read_latency_seconds_bucket++Inf"] == grew["read_latency_seconds_count"]
    for name in FAILURES:
        assert grew[name] == 0, (name, grew, _logs(cluster))


def test_a_mismatched_prefill_build_gets_the_client_an_error_not_wrong_tokens(
        cluster, tmp_path):
    """A Prefill with another block size (64 against Decode's 32) behind its own proxy:
    Decode refuses its MF_META naming ``block_size``; with vLLM's default policy
    ("fail") the client gets an error at once, never tokens from mismatched KV."""
    extra = {"transport": "cma", "log_level": "INFO"}
    odd = vllm_server("prefill, block size 64", cluster["model"], free_port(),
                      tmp_path / "prefill_odd.log",
                      kv=rd2h_kv("kv_producer", cluster["kv_port"], extra),
                      args=["--block-size", "64"])
    proxy = proxy_server(free_port(), [odd.url], [cluster["decode"].url],
                         tmp_path / "proxy_odd.log")
    with running(odd, proxy):
        t0 = time.monotonic()
        resp = _complete(proxy.url, cluster["model"], PROMPTS[3])
        took = time.monotonic() - t0
        failed = resp.status_code != 200 or any(
            c.get("finish_reason") not in ("length", "stop") for c in resp.json()["choices"])
        print(f"\nmismatched Prefill, policy fail: HTTP {resp.status_code} after {took:.2f} s: "
              f"{resp.text[:160]}")
        assert failed, f"tokens from a mismatched Prefill: {resp.text}"
        assert took < 10.0, f"the refusal took {took:.1f} s"
        assert "block_size" in odd.log.read_text(errors="replace"), odd.tail(40)


def test_dead_prefill_fails_the_waiting_request_then_serving_resumes(cluster):
    model, proxy, base, prefill = (cluster["model"], cluster["proxy"], cluster["base"],
                                   cluster["prefill"])
    prefill.kill()
    t0 = time.monotonic()
    resp = _complete(proxy.url, model, PROMPTS[1], timeout=REQUEST_DEADLINE_S + 90)
    elapsed = time.monotonic() - t0
    failed = resp.status_code != 200 or any(
        c.get("finish_reason") not in ("length", "stop") for c in resp.json()["choices"]
    )
    assert failed, f"request succeeded without a Prefill: {resp.text}"
    # At once, not at the KV deadline: the proxy's probes ejected the dead Prefill
    # (503 before Decode is asked), or its dispatch met the refused connection (502:
    # Decode's request is closed and Decode is told, the watch).
    assert elapsed < min(10.0, REQUEST_DEADLINE_S), f"failure took {elapsed:.1f} s"
    assert resp.status_code in (502, 503), resp.text
    assert "prefill" in resp.json()["error"]["message"].lower(), resp.text

    prefill.start()
    prefill.wait_ready("/health", time.monotonic() + 420)
    wait_admitted(proxy, prefill.url)
    want = _tokens(_complete(base.url, model, PROMPTS[2]))
    got = _tokens(_complete(proxy.url, model, PROMPTS[2]))
    assert got == want, _logs(cluster)
