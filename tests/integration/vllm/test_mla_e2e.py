"""The target model's cache shape on real vLLM: a tiny DeepSeek-V2 (MLA, one
576-wide latent per token) served disaggregated through rd2h.

A Prefill engine and a Decode engine with ``SfaRemoteD2HConnector`` (cma) behind
``rd2h proxy``, and a plain engine (session fixture ``mla_reference``), all with
``servers.MLA_ARGS`` (CPU_MLA, block size 16, float32, vLLM 0.32's CPU rotary op
off: see docs/guide/vllm.md "MLA on vLLM's CPU backend"). Greedy tokens through the proxy must
equal the plain engine's, and the plain engine's must equal an independent float64
forward of the same checkpoint in transformers, so the reference is itself known
right. Prompts: partial last blocks, exact blocks, several blocks, a prompt list.

Chunked Prefill does not run here: vLLM 0.32's CPU platform turns chunked prefill
(and prefix caching) off for MLA unless the AMX MLA kernels are in use
(``CpuPlatform.check_and_update_config``); the AMX backend takes bf16 only, where
rounding legitimately separates the decode path from the prefill path.
"""

from __future__ import annotations

import httpx
import pytest
import stall
from fakes.net import free_port, quiet_ports
from float64_reference import Float64Greedy
from servers import MLA_ARGS, proxy_server, rd2h_kv, running, vllm_server

from rd2h.demo.tiny_model import VOCAB

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

MAX_TOKENS = 8
BLOCK = 16  # CPU_MLA's block size


def _prompt(n: int, seed: int) -> list[int]:
    return [2 + (seed * 131 + i * 17) % (VOCAB - 2) for i in range(n)]


# (tokens, what it exercises): at block size 16
PROMPTS = [
    _prompt(17, 1),  # one full block and one token
    _prompt(16, 2),  # exactly one block: Decode recomputes the last token in block 0
    _prompt(32, 3),  # exact blocks
    _prompt(33, 4),  # partial
    _prompt(64, 5),  # exact, four blocks
    _prompt(90, 6),  # several blocks, partial tail
    _prompt(200, 7),  # 13 blocks, partial tail
]
PROMPT_LIST = [_prompt(40, 8), _prompt(48, 9), _prompt(150, 10)]


def _post(url: str, model: str, prompt, timeout: float = 180.0) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}
    resp = stall.post(url + "/v1/completions", body, timeout)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _tokens(out: dict) -> list[list[int]]:
    return [list(c["token_ids"]) for c in sorted(out["choices"], key=lambda c: c["index"])]


def _complete(url: str, model: str, prompt) -> list[list[int]]:
    return _tokens(_post(url, model, prompt))


@pytest.fixture(scope="module")
def float64(mla_model):
    return Float64Greedy(mla_model)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, mla_model, mla_reference):
    root = tmp_path_factory.mktemp("vllm-mla")
    kv_port = quiet_ports(4)
    extra = {"transport": "cma", "log_level": "INFO",
             "deadlines": {"request_s": 60.0, "layer_ack_s": 20.0, "meta_ack_s": 10.0}}
    servers = {
        "prefill": vllm_server("MLA prefill engine", mla_model, free_port(),
                               root / "prefill.log", args=MLA_ARGS,
                               kv=rd2h_kv("kv_producer", kv_port, extra)),
        # prompt-token details: the response says how many prompt tokens Decode did
        # not compute itself (the ones rd2h pulled)
        "decode": vllm_server("MLA decode engine", mla_model, free_port(),
                              root / "decode.log",
                              args=[*MLA_ARGS, "--enable-prompt-tokens-details"],
                              kv=rd2h_kv("kv_consumer", kv_port, extra)),
    }
    servers["proxy"] = proxy_server(
        free_port(), [servers["prefill"].url], [servers["decode"].url], root / "proxy.log"
    )
    servers["parallel"] = proxy_server(
        free_port(), [servers["prefill"].url], [servers["decode"].url],
        root / "parallel-proxy.log", args=["--dispatch", "parallel"])
    with running(*servers.values()):
        yield {"model": str(mla_model), "base": mla_reference, **servers}


def _logs(cluster) -> str:
    return "\n".join(f"--- {k}\n{cluster[k].tail(40)}" for k in ("prefill", "decode", "proxy"))


def test_the_plain_mla_engine_equals_a_float64_forward(cluster, float64):
    """The reference is right: vLLM's plain MLA engine with the rotary op off gives a
    float64 transformers forward's greedy tokens."""
    model, base = cluster["model"], cluster["base"]
    for prompt in [*PROMPTS, *PROMPT_LIST]:
        want, margin = float64.generate(prompt, MAX_TOKENS)
        got = _complete(base.url, model, prompt)[0]
        assert got == want, f"{len(prompt)} tokens (smallest top-2 logit gap {margin:.2e})"


def test_disaggregated_mla_tokens_equal_the_reference(cluster, float64):
    model, proxy, base = cluster["model"], cluster["proxy"], cluster["base"]
    for prompt in PROMPTS:
        want = _complete(base.url, model, prompt)
        out = _post(proxy.url, model, prompt)
        got = _tokens(out)
        assert got == want, f"prompt of {len(prompt)} tokens\n{_logs(cluster)}"
        assert got[0] == float64.generate(prompt, MAX_TOKENS)[0]
        # not vacuous: Decode's scheduler took the whole prompt from the connector
        # (prefix caching is off for MLA on CPU, so nothing else can supply it; vLLM
        # then recomputes only the last prompt token to sample from)
        pulled = out["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert pulled == len(prompt), (out["usage"], _logs(cluster))


def test_mla_prompt_list_matches_and_nothing_is_left_pending(cluster):
    model, proxy, base = cluster["model"], cluster["proxy"], cluster["base"]
    want = _complete(base.url, model, PROMPT_LIST)
    got = _complete(proxy.url, model, PROMPT_LIST)
    assert got == want, _logs(cluster)
    health = httpx.get(proxy.url + "/healthcheck", timeout=10).json()
    assert health["pending"] == 0, health


def test_parallel_dispatch_mla_tokens_equal_the_reference(cluster):
    """``--dispatch parallel`` on MLA (one latent cache per layer): tokens equal the
    plain engine's and the whole prompt came from the connector."""
    model, proxy, base = cluster["model"], cluster["parallel"], cluster["base"]
    for prompt in PROMPTS:
        out = _post(proxy.url, model, prompt)
        assert _tokens(out) == _complete(base.url, model, prompt), \
            f"prompt of {len(prompt)} tokens\n{_logs(cluster)}"
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt)
    counters = httpx.get(proxy.url + "/healthcheck", timeout=10).json()["counters"]
    assert counters["prefill_parallel"] == len(PROMPTS) - 1, counters
    assert counters["parallel_mismatch"] == 0 and counters["prefill_failed"] == 0, counters
