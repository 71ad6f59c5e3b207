"""DeepSeek-V3.2 on real vLLM engines (issue #58): disaggregated through rd2h, it serves
what one plain engine serves, latent and indexer cache both moved.

A tiny random-weight DeepSeek-V3.2 (``tiny_deepseek_v32``: 3 layers, MLA latent 576 wide
in float32, a lightning indexer in every layer, ``index_topk`` 2048) is served on vLLM
0.32's CPU backend with the test-only stand-ins its builder writes (vLLM's CPU platform
has no sparse attention and nothing that writes V3.2's indexer cache: the sparse layers
run on the dense CPU MLA backend, exact while a sequence has at most ``index_topk``
tokens, and the indexer cache is written in torch in vLLM's byte layout). The stand-ins
are plain PyTorch and run on any x86 CPU. A Prefill and a Decode engine with rd2h's
connector (cma, ``verify_kv``) behind ``rd2h proxy``, and a plain engine of the same
checkpoint: the reference.

Each layer holds two caches in one KV cache group: the latent (``model.layers.N.
self_attn.attn``) and the indexer cache (``...indexer.k_cache``, 132 bytes a token: 128
fp8 values and a scale). vLLM calls the connector's save hook from attention forwards
only, never for the indexer cache: rd2h announces those layers after the forward, and a
request's completion rides on the layer announced last (before, a request hung: the
indexer layers were never announced).

What it proves: greedy completions (12 tokens, 5 logprobs) through the proxy equal the
plain engine's, tokens and logprobs, for prompts of 5 to 520 tokens on either side of
the 16-token block boundaries, 6 prompts at once and a prompt sent twice; Decode took
the prompt from the connector (``cached_tokens``), pulled the latent and the indexer
cache of every layer (bytes pulled for a fresh prompt = blocks x (latent + indexer page)
x layers), and every digest matched; a Prefill serving other weights makes the answers
differ, so the comparison can fail. Without AMX, vLLM turns chunked prefill and prefix
caching off for MLA, so each prompt is prefilled whole.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from completions import answer, metric_sum, post
from fakes.net import free_port, quiet_ports
from servers import proxy_server, rd2h_kv, running, settled_bytes_pulled, vllm_server
from tiny_deepseek_v32 import (
    INDEX_HEAD_DIM,
    KV_LORA,
    LAYERS,
    ROPE_DIM,
    SERVE_ARGS,
    make_tiny_deepseek_v32,
    serve_patch_dir,
)

from rd2h.demo.tiny_model import VOCAB

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

NAME = "tiny-dsv32"
MAX_TOKENS = 12
LOGPROBS = 5
BLOCK = 16  # SERVE_ARGS' --block-size (vLLM's CPU MLA kernel's)
LATENT_PAGE = BLOCK * (KV_LORA + ROPE_DIM) * 4  # float32 latent
INDEXER_PAGE = BLOCK * (INDEX_HEAD_DIM + INDEX_HEAD_DIM // 128 * 4)  # fp8 + a scale
LENGTHS = (5, 15, 16, 17, 64, 100, 300, 520)
ENGINE_ARGS = [*SERVE_ARGS, "--max-model-len", "2048", "--max-num-batched-tokens", "2048",
               "--served-model-name", NAME]
OTHER_SEED = 4321  # the negative control's Prefill weights


def _prompt(n: int, seed: int) -> list[int]:
    return [2 + (seed * 131 + i * 17) % (VOCAB - 2) for i in range(n)]


PROMPTS = {n: _prompt(n, n) for n in LENGTHS}


def _ask(url: str, n: int) -> dict:
    """The completion of ``PROMPTS[n]`` from the server at ``url``."""
    return post(url, NAME, PROMPTS[n], MAX_TOKENS, LOGPROBS)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv32")
    env = {"PYTHONPATH": str(serve_patch_dir(root / "patches"))}
    return {"root": root, "model": make_tiny_deepseek_v32(root / "model"), "env": env}


@pytest.fixture(scope="module")
def cluster(checkpoint):
    root, model, env = checkpoint["root"], checkpoint["model"], checkpoint["env"]
    kv_port = quiet_ports(1)
    extra = {"transport": "cma", "log_level": "INFO", "verify_kv": True}
    prefill = vllm_server("dsv32 prefill", model, free_port(), root / "prefill.log",
                          kv=rd2h_kv("kv_producer", kv_port, extra), args=ENGINE_ARGS,
                          env=env, block_size=None, tokenizer=True)
    decode = vllm_server("dsv32 decode", model, free_port(), root / "decode.log",
                         kv=rd2h_kv("kv_consumer", kv_port, extra),
                         args=[*ENGINE_ARGS, "--enable-prompt-tokens-details"],
                         env=env, block_size=None, tokenizer=True, log_stats=True)
    plain = vllm_server("dsv32 plain", model, free_port(), root / "plain.log",
                        args=ENGINE_ARGS, env=env, block_size=None, tokenizer=True)
    proxy = proxy_server(free_port(), [prefill.url], [decode.url], root / "proxy.log")
    t0 = time.monotonic()
    with running(prefill, decode, plain, proxy):
        print(f"[dsv32] Prefill, Decode, plain engine and proxy ready in "
              f"{time.monotonic() - t0:.0f} s")
        yield {"prefill": prefill, "decode": decode, "plain": plain, "proxy": proxy,
               "kv_port": kv_port, "reference": {}}



def _reference(c: dict, n: int) -> dict:
    if n not in c["reference"]:
        c["reference"][n] = answer(_ask(c["plain"].url, n))
    return c["reference"][n]


def _same(got: dict, want: dict) -> str | None:
    """None when the answers are the same: tokens exactly, and each logprob (chosen and
    top-5) within 1e-5 (float32 on CPU: the step's batch moves them by about 1e-6; a
    wrong or missing cache moves them by orders more); else where they differ."""
    if got["tokens"] != want["tokens"]:
        i = next(k for k, (a, b) in enumerate(zip(got["tokens"], want["tokens"])) if a != b)
        return f"tokens {got['tokens']} != {want['tokens']} (first at step {i})"
    for i, (a, b, ta, tb) in enumerate(zip(got["logprobs"], want["logprobs"], got["top"],
                                           want["top"])):
        if abs(a - b) > 1e-5 or ta.keys() != tb.keys() or any(
                abs(ta[k] - tb[k]) > 1e-5 for k in ta):
            return f"step {i}: logprob {a} vs {b}, top-5 {ta} vs {tb}"
    return None


def _tails(c: dict) -> str:
    return "\n".join(f"--- {k}\n{c[k].tail(30)}" for k in ("prefill", "decode", "proxy"))


def test_both_engines_move_the_latent_and_the_indexer_cache(cluster) -> None:
    for side in ("prefill", "decode"):
        text = cluster[side].log.read_text(errors="replace")
        assert f"'kv_groups': 'full/{BLOCK}x{2 * LAYERS}'" in text, cluster[side].tail(40)
        assert "cannot transfer" not in text
    prefill = cluster["prefill"].log.read_text(errors="replace")
    if not cluster["reference"]:
        test_disaggregated_completion_equals_the_plain_engine(cluster, 17)
        prefill = cluster["prefill"].log.read_text(errors="replace")
    # vLLM gave the indexer caches (and only them) no hook: announced after the forward.
    unhooked = "\n".join(line for line in prefill.splitlines()
                         if "vLLM called no save hook for a cache layer" in line)
    for i in range(LAYERS):
        assert f"model.layers.{i}.self_attn.indexer.k_cache" in unhooked, prefill[-3000:]
        assert f"model.layers.{i}.self_attn.attn'" not in unhooked, unhooked


@pytest.mark.parametrize("n", LENGTHS)
def test_disaggregated_completion_equals_the_plain_engine(cluster, n) -> None:
    """The plain engine's answer; every prompt token but the last from the connector;
    the bytes pulled: every block of the prompt, latent and indexer, in every layer."""
    want = _reference(cluster, n)
    before = metric_sum(cluster["decode"], "vllm:rd2h_bytes_pulled_total")
    out = _ask(cluster["proxy"].url, n)
    got = answer(out)
    assert _same(got, want) is None, f"{n} tokens: {_same(got, want)}\n{_tails(cluster)}"
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == n, out["usage"]
    expected = math.ceil(n / BLOCK) * (LATENT_PAGE + INDEXER_PAGE) * LAYERS
    pulled = settled_bytes_pulled(cluster["decode"], before, expected) - before
    assert pulled == expected, (n, pulled, expected)


def test_prompts_at_once_equal_the_plain_engine(cluster) -> None:
    ns = (5, 17, 64, 100, 300, 520)
    wants = {n: _reference(cluster, n) for n in ns}
    with ThreadPoolExecutor(len(ns)) as pool:
        outs = dict(zip(ns, pool.map(lambda n: _ask(cluster["proxy"].url, n), ns)))
    wrong = {n: _same(answer(o), wants[n]) for n, o in outs.items()
             if _same(answer(o), wants[n])}
    assert not wrong, f"{wrong}\n{_tails(cluster)}"


def test_a_prompt_sent_twice_is_served_equal_both_times(cluster) -> None:
    n = 300
    want = _reference(cluster, n)
    for attempt in range(2):
        got = answer(_ask(cluster["proxy"].url, n))
        assert _same(got, want) is None, f"attempt {attempt}: {_same(got, want)}"


def test_every_digest_matched_and_nothing_failed(cluster) -> None:
    decode = cluster["decode"]
    if not cluster["reference"]:
        test_disaggregated_completion_equals_the_plain_engine(cluster, 17)
    verified = metric_sum(decode, "vllm:rd2h_kv_blocks_verified_total")
    mismatches = metric_sum(decode, "vllm:rd2h_kv_digest_mismatches_total")
    failed = metric_sum(decode, "vllm:rd2h_requests_failed_total")
    print(f"[dsv32] Decode checked {verified:.0f} blocks against Prefill's digests, "
          f"{mismatches:.0f} mismatched, {failed:.0f} requests failed")
    assert verified > 0 and mismatches == 0 and failed == 0, _tails(cluster)


def test_a_prefill_with_other_weights_makes_the_comparison_fail(cluster, checkpoint) -> None:
    """Negative control: a Prefill on other weights in front of the same Decode."""
    root, env = checkpoint["root"], checkpoint["env"]
    other = make_tiny_deepseek_v32(root / "other-model", seed=OTHER_SEED)
    extra = {"transport": "cma", "log_level": "INFO"}
    prefill = vllm_server("dsv32 prefill (other weights)", other, free_port(),
                          root / "other-prefill.log",
                          kv=rd2h_kv("kv_producer", cluster["kv_port"], extra),
                          args=ENGINE_ARGS, env=env, block_size=None, tokenizer=True)
    proxy = proxy_server(free_port(), [prefill.url], [cluster["decode"].url],
                         root / "other-proxy.log")
    ns = (5, 17, 64, 100, 300)
    with running(prefill, proxy):
        outs = {n: answer(_ask(proxy.url, n)) for n in ns}
    differ = [n for n in ns if outs[n]["tokens"] != _reference(cluster, n)["tokens"]]
    print(f"[dsv32] negative control: {len(differ)}/{len(ns)} answers differ")
    assert len(differ) > len(ns) // 2, differ


def test_a_prefill_at_tp_2_serves_a_decode_at_tp_1(cluster, checkpoint) -> None:
    """Prefill TP 2 -> Decode TP 1 (the design's p_tp = k x d_tp): vLLM replicates the
    latent and the indexer cache on both Prefill ranks; each announces every layer to
    the one Decode rank (contributor members 0 and 1 of 2), member 0's reads move main,
    and Decode completes a request once both members reported it. Same answers as the
    plain TP 1 engine."""
    root, env = checkpoint["root"], checkpoint["env"]
    extra = {"transport": "cma", "log_level": "INFO", "verify_kv": True,
             "deadlines": {"request_s": 120.0, "layer_ack_s": 60.0, "meta_ack_s": 30.0}}
    prefill = vllm_server("dsv32 prefill tp2", checkpoint["model"], free_port(),
                          root / "tp2-prefill.log",
                          kv=rd2h_kv("kv_producer", cluster["kv_port"], extra),
                          args=[*ENGINE_ARGS, "--tensor-parallel-size", "2",
                                "--distributed-executor-backend", "mp"],
                          env=env, block_size=None, tokenizer=True)
    proxy = proxy_server(free_port(), [prefill.url], [cluster["decode"].url],
                         root / "tp2-proxy.log")
    ns = (5, 17, 100, 300)
    with running(prefill, proxy):
        post(prefill.url, NAME, [5, 6, 7])  # the first forward at TP 2 compiles: paid here
        before = metric_sum(cluster["decode"], "vllm:rd2h_bytes_pulled_total")
        outs = {n: answer(_ask(proxy.url, n)) for n in ns}
        expected = sum(math.ceil(n / BLOCK) for n in ns) * (LATENT_PAGE + INDEXER_PAGE) \
            * LAYERS
        pulled = settled_bytes_pulled(cluster["decode"], before, expected) - before
        text = prefill.log.read_text(errors="replace")
    assert pulled == expected, (pulled, expected)  # from member 0, once per block
    wrong = {n: _same(outs[n], _reference(cluster, n)) for n in ns
             if _same(outs[n], _reference(cluster, n))}
    assert not wrong, f"{wrong}\n{prefill.tail(40)}"
    assert "rd2h moves KV cache groups" in text and "cannot transfer" not in text
