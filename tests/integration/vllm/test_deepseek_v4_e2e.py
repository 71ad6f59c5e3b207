"""DeepSeek-V4 on real vLLM engines (issue #40): disaggregated through rd2h, it serves
what one plain engine serves.

A tiny random-weight DeepSeek-V4 (``tiny_deepseek_v4``: 4 layers, compress ratios 0, 4,
128, 0; 256 experts, top-6) is served on vLLM 0.32's CPU backend by a Prefill and a
Decode engine with rd2h's connector (cma, ``verify_kv``) behind ``rd2h proxy``, and by a
plain engine of the same checkpoint (no connector): the reference. Twice, once per kind
of kernels (``MODES``): vLLM's own, which exist only in the AVX512-BF16 build of its
library (``cpu_kernels_available``), where this CPU runs them; and everywhere the test-only
PyTorch reference kernels (``dsv4_reference``, each checked against vLLM's in
``test_dsv4_reference_*``), with vLLM's AVX2 library: on an AVX512 CPU the engines are
made to behave as on an AVX2-only one (``RD2H_SIMULATE_AVX2``), so every test
machine serves the model and no test is skipped. The Triton metadata kernels run in
Triton's interpreter, through the test-only ``sitecustomize`` the checkpoint builder
writes.

What it proves:

- both engines start with rd2h, which takes the model's real KV cache config and moves
  all seven groups, each in its own block size (``kv_groups``: the four sliding-window
  caches 64 tokens a block, the compressed caches 256, the compressor states 4 and 8),
  the model's own ``fp8_ds_mla`` as its bytes, its TP stated; the caches the worker
  registered are the layout the connector unit test moves bytes through
  (``tests/unit/test_vllm_layouts_connector.py``: the same layers and view shapes,
  47,808-byte blocks, every layer of a group side by side in each block);
- greedy completions (12 tokens, 5 logprobs) through the proxy equal the plain engine's,
  tokens and logprobs exactly, for prompts of 5 to 520 tokens that end on either side of
  every group's block boundaries (64, 256, and the states' 4 and 8) (where both kinds of
  kernels run, each serves 7 of the 12 lengths and together all of them; elsewhere the
  reference kernels serve all 12: ``lengths``); the same for 8 prompts at once, and
  for a prompt sent twice;
- not vacuously: Decode took the prompt from the connector (``cached_tokens``), its
  rd2h counters show the bytes it pulled and the blocks it checked against Prefill's
  digests with no mismatch; and a Prefill serving other weights makes Decode's tokens
  differ from the plain engine's, so the comparison can fail.

Without AMX, vLLM turns chunked prefill and prefix caching off for this model ("MLA is
enabled on a non-GPU platform"), so each prompt is prefilled whole, and Decode holds no
prefix of its own: every request's KV comes from Prefill.
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from completions import answer, metric_sum, post
from fakes.net import free_port, quiet_ports
from servers import proxy_server, rd2h_kv, running, settled_bytes_pulled, vllm_server
from tiny_deepseek_v4 import cpu_kernels_available, make_tiny_deepseek_v4, serve_patch_dir

from rd2h.demo.tiny_model import VOCAB

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

KERNELS = cpu_kernels_available()
# The kernels the engines serve with: vLLM's own where this CPU runs them, and the
# test-only reference kernels on every CPU.
MODES = ("vllm", "reference") if KERNELS else ("reference",)
CLUSTER_PARAMS = MODES  # conftest keeps each mode's tests together

GROUPS = ("slidingw128/64x1,slidingw128/64x1,slidingw128/64x1,slidingw128/64x1,"
          "full/256x3,slidingw8/4x2,slidingw128/8x1")
BLOCK_BYTES = 47808  # every group's block: its layers' pages side by side
# Each cache layer's view as rd2h gets it: (shape after the block dimension, dtype).
VIEWS = {
    **{f"model.layers.{i}.attn.swa_cache": ((64, 584), "torch.uint8") for i in range(4)},
    "model.layers.1.attn.indexer.k_cache": ((64, 132), "torch.uint8"),
    "model.layers.1.attn": ((64, 584), "torch.uint8"),
    "model.layers.2.attn": ((2, 584), "torch.uint8"),
    "model.layers.1.attn.indexer.compressor.state_cache": ((4, 512), "torch.float32"),
    "model.layers.1.attn.compressor.state_cache": ((4, 2048), "torch.float32"),
    "model.layers.2.attn.compressor.state_cache": ((8, 1024), "torch.float32"),
}
ELEM = {"torch.uint8": 1, "torch.float32": 4}

NAME = "tiny-dsv4"  # every engine's --served-model-name (the checkpoints' paths differ)
MAX_TOKENS = 12
LOGPROBS = 5
# Prompt lengths: a few tokens; around the sliding-window caches' 64-token blocks; two
# of them; around the compressed caches' 256-token blocks; a partial and a third block
# of 256 (and the compressor states' 4 and 8 on both sides throughout). 191, 255 and 383
# (64k + 63 from 191 on): the window of the prompt's last token reaches back to the last
# token of a 64-token block (token N - 128), which vLLM does not keep when it sizes the
# window for a hit of all N tokens and then rewinds by one to recompute the last token;
# so rd2h moves N-1 tokens and Decode computes the last one (served wrong before).
LENGTHS = (5, 63, 64, 65, 128, 191, 255, 256, 257, 300, 383, 520)
# Where both kinds of kernels run, each serves about half of these (both the shortest
# and the longest), together every one; where only the reference kernels run, they
# serve every length.
HALVES = {"vllm": (5, 63, 64, 128, 255, 300, 520), "reference": (5, 65, 191, 256, 257, 383, 520)}
assert set(HALVES["vllm"]) | set(HALVES["reference"]) == set(LENGTHS)


def lengths(mode: str) -> tuple[int, ...]:
    return HALVES[mode] if len(MODES) > 1 else LENGTHS


# A CPU with AMX (this session's hosts; CI's earlier ones had none): vLLM keeps chunked
# prefill on for this model, and its bfloat16 matrix kernels take another path by the
# number of rows a step computes, so answers move in the last bits of their logprobs
# (seen: 2e-6 to 0.031 nats) with what a step computes beside a prompt's tokens. With
# vLLM's kernels a plain engine computing the P/D split is the exact reference for one
# prompt (its lengths all pass there). Two comparisons have no exact reference on such a
# CPU yet, and are expected to fail there, not skipped: eight prompts at once (Decode's
# steps mix requests: vLLM's batch variance, in both modes; one token flipped at a near
# tie) and the 256-token prompt with the reference kernels (the only length of a multiple
# of 16 rows: the whole prompt against N-1 rows then one; 0.031 nats, same tokens).
AMX = os.path.exists("/proc/cpuinfo") and "amx_bf16" in Path("/proc/cpuinfo").read_text()
AMX_NO_EXACT_REFERENCE = pytest.mark.xfail(
    AMX, strict=False, reason="a CPU with AMX: vLLM's bfloat16 kernels vary with the rows a "
    "step computes, and no plain engine computes the same rows (module constants)")
CASES = [pytest.param(m, n, id=f"{m}-{n}",
                      marks=[AMX_NO_EXACT_REFERENCE] if (m, n) == ("reference", 256) else [])
         for m in MODES for n in lengths(m)]
ENGINE_ARGS = ["--dtype", "bfloat16", "--max-model-len", "1024",
               "--max-num-batched-tokens", "1024", "--served-model-name", NAME]
# The plain reference's scheduler in vLLM-kernel mode: the P/D split (the first N-1
# tokens, then the last alone), one request at a time, no prefix cache.
PD_SPLIT = ["--scheduler-cls", "pd_split_scheduler.PdSplitScheduler", "--max-num-seqs", "1",
            "--no-enable-prefix-caching"]
OTHER_SEED = 4321  # the negative control's Prefill weights


def _prompt(n: int, seed: int) -> list[int]:
    return [2 + (seed * 131 + i * 17) % (VOCAB - 2) for i in range(n)]


PROMPTS = {n: _prompt(n, n) for n in LENGTHS}


def _ask(url: str, n: int) -> dict:
    """The completion of ``PROMPTS[n]`` from the server at ``url``."""
    return post(url, NAME, PROMPTS[n], MAX_TOKENS, LOGPROBS)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv4")
    env = {"TRITON_INTERPRET": "1", "PYTHONPATH": str(serve_patch_dir(root / "patches"))}
    return {"root": root, "model": make_tiny_deepseek_v4(root / "model"), "env": env}


def _env(checkpoint: dict, mode: str) -> dict:
    """The engines' environment for one kind of kernels."""
    env = dict(checkpoint["env"])
    if mode == "reference":
        env["RD2H_DSV4_REFERENCE_KERNELS"] = "1"
        if KERNELS:  # behave as an AVX2-only CPU: vLLM's AVX2 library and paths
            env.update(RD2H_SIMULATE_AVX2="1", ATEN_CPU_CAPABILITY="avx2")
    return env


@pytest.fixture(scope="module", params=MODES)
def cluster(checkpoint, request):
    mode = request.param
    model, env = checkpoint["model"], _env(checkpoint, mode)
    root = checkpoint["root"] / mode
    root.mkdir(exist_ok=True)
    kv_port = quiet_ports(1)  # Decode's control socket binds after its model loads
    extra = {"transport": "cma", "log_level": "INFO", "verify_kv": True}
    dump = {**env, "RD2H_DUMP_KV_CACHES": "1"}
    prefill = vllm_server("dsv4 prefill", model, free_port(), root / "prefill.log",
                          kv=rd2h_kv("kv_producer", kv_port, extra), args=ENGINE_ARGS,
                          env=dump, block_size=None, tokenizer=True)
    # prompt-token details: the response says how many prompt tokens Decode did not
    # compute itself; stats on: rd2h's Prometheus series.
    decode = vllm_server("dsv4 decode", model, free_port(), root / "decode.log",
                         kv=rd2h_kv("kv_consumer", kv_port, extra),
                         args=[*ENGINE_ARGS, "--enable-prompt-tokens-details"],
                         env=dump, block_size=None, tokenizer=True, log_stats=True)
    # With vLLM's kernels the plain engine computes each prompt in the P/D split (with
    # chunked prefill on, a CPU with AMX, its bfloat16 kernels are not split-invariant;
    # without, the scheduler changes nothing).
    here = os.path.dirname(os.path.abspath(__file__))
    split = mode == "vllm"
    plain = vllm_server("dsv4 plain", model, free_port(), root / "plain.log",
                        args=[*ENGINE_ARGS, *(PD_SPLIT if split else [])],
                        env={**env, "PYTHONPATH": os.pathsep.join(
                            p for p in (env.get("PYTHONPATH"), here if split else None) if p)},
                        block_size=None, tokenizer=True)
    proxy = proxy_server(free_port(), [prefill.url], [decode.url], root / "proxy.log")
    t0 = time.monotonic()
    with running(prefill, decode, plain, proxy):
        print(f"[dsv4] {mode} kernels: Prefill, Decode, plain engine and proxy ready in "
              f"{time.monotonic() - t0:.0f} s")
        yield {"prefill": prefill, "decode": decode, "plain": plain, "proxy": proxy,
               "kv_port": kv_port, "reference": {}, "mode": mode, "root": root,
               "env": env}



def _reference(c: dict, n: int) -> dict:
    """The plain engine's answer to ``PROMPTS[n]`` (asked once: it is deterministic)."""
    if n not in c["reference"]:
        c["reference"][n] = answer(_ask(c["plain"].url, n))
    return c["reference"][n]


def _diff(got: dict, want: dict) -> str:
    """The first step at which the answers differ, and in what."""
    for i, step in enumerate(zip(*(got[k] for k in ("tokens", "logprobs", "top")),
                                 *(want[k] for k in ("tokens", "logprobs", "top")))):
        g, w = step[:3], step[3:]
        if g != w:
            what = [k for k, a, b in zip(("token", "logprob", "top-5"), g, w) if a != b]
            return (f"first differing step {i} ({', '.join(what)}): token {g[0]} "
                    f"logprob {g[1]:.6f} != token {w[0]} logprob {w[1]:.6f}")
    return "equal" if got == want else f"lengths differ: {got} != {want}"


def _tails(c: dict) -> str:
    return "\n".join(f"--- {k}\n{c[k].tail(30)}" for k in ("prefill", "decode", "proxy"))


def _log(server) -> str:
    return server.log.read_text(errors="replace")


@pytest.mark.parametrize("side", ["prefill", "decode", "plain"])
def test_the_engines_serve_with_the_kernels_of_their_mode(cluster, side) -> None:
    """vLLM's own kernels, or every one of them replaced by the reference (vLLM's AVX2
    library has none of them): the log says which."""
    text = _log(cluster[side])
    registered = "rd2h test-only reference kernels registered for DeepSeek-V4: "
    if cluster["mode"] == "vllm":
        assert registered not in text
    else:
        line = text[text.index(registered):].splitlines()[0]
        assert "flash_mla_with_kvcache_cpu" in line and "hc_pre_fused_cpu" in line, line
        assert "compress_norm_rope_store_cpu" in line and "bmm_cpu" in line, line


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_both_engines_start_with_rd2h_moving_all_seven_groups(cluster, side) -> None:
    text = _log(cluster[side])
    assert "rd2h moves KV cache groups" in text, text[-3000:]
    assert f"'kv_groups': '{GROUPS}'" in text, text[-3000:]
    assert "'kv_dtype': 'fp8_ds_mla'" in text and "'state_tp': 1" in text, text[-3000:]
    assert "cannot transfer" not in text
    # The worker took the engine's caches (its transport registered them, its role built).
    assert "control channel" in text, text[-3000:]


def test_the_registered_caches_are_the_layout_the_unit_test_moves(cluster) -> None:
    """The worker's KV caches (the patch's dump when vLLM allocated them): the layers,
    view shapes and block stride the connector unit test lays its caches out as."""
    text = _log(cluster["decode"])
    dump = text[text.index("RD2H_KV_CACHES"):]
    seen = {}
    for m in re.finditer(r"^(\S+) -> shape=\((\d+), [^)]*\) dtype=(\S+) stride=\((\d+),[^|]*"
                         r"\| bound view shape=\(\d+, ([\d, ]+)\) stride=\((\d+),", dump, re.M):
        name, _, dtype, _, shape, stride = m.groups()
        seen[name] = (tuple(int(x) for x in shape.split(",")), dtype,
                      int(stride) * ELEM[dtype])
    assert {n: (s, d) for n, (s, d, _) in seen.items()} == VIEWS, dump[:3000]
    assert {p for *_, p in seen.values()} == {BLOCK_BYTES}


@pytest.mark.parametrize("cluster,n", CASES, indirect=["cluster"])
def test_disaggregated_completion_equals_the_plain_engine(cluster, n) -> None:
    """Tokens and logprobs (top 5 at each of 12 steps) exactly the plain engine's; the
    prompt but its last token came from the connector (the N-1 scheme: Decode computes
    the last token itself)."""
    want = _reference(cluster, n)
    before = metric_sum(cluster["decode"], "vllm:rd2h_bytes_pulled_total")
    out = _ask(cluster["proxy"].url, n)
    got = answer(out)
    assert got == want, f"prompt of {n} tokens: {_diff(got, want)}\n{_tails(cluster)}"
    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == n - 1, (out["usage"], _tails(cluster))
    after = settled_bytes_pulled(cluster["decode"], before, 1)
    assert after > before, f"Decode pulled no bytes for the {n}-token prompt"


@AMX_NO_EXACT_REFERENCE
def test_eight_prompts_at_once_equal_the_plain_engine(cluster) -> None:
    ns = (5, 63, 65, 128, 256, 257, 300, 520)
    wants = {n: _reference(cluster, n) for n in ns}
    with ThreadPoolExecutor(len(ns)) as pool:
        outs = dict(zip(ns, pool.map(lambda n: _ask(cluster["proxy"].url, n), ns)))
    wrong = {n: _diff(answer(o), wants[n]) for n, o in outs.items()
             if answer(o) != wants[n]}
    assert not wrong, f"{wrong}\n{_tails(cluster)}"


def test_a_prompt_sent_twice_is_served_equal_both_times(cluster) -> None:
    """A second request whose prompt Decode served before: still the plain engine's
    answer, and its KV was pulled again (prefix caching is off here, so Decode keeps
    none of the first request's blocks)."""
    n = 300
    want = _reference(cluster, n)
    for attempt in range(2):
        before = metric_sum(cluster["decode"], "vllm:rd2h_bytes_pulled_total")
        got = answer(_ask(cluster["proxy"].url, n))
        assert got == want, f"attempt {attempt}: {_diff(got, want)}\n{_tails(cluster)}"
        assert settled_bytes_pulled(cluster["decode"], before, 1) > before


def test_decode_pulled_the_kv_and_every_digest_matched(cluster) -> None:
    decode = cluster["decode"]
    if not cluster["reference"]:  # run alone: one request first
        test_disaggregated_completion_equals_the_plain_engine(cluster, 65)
    pulled = metric_sum(decode, "vllm:rd2h_bytes_pulled_total")
    verified = metric_sum(decode, "vllm:rd2h_kv_blocks_verified_total")
    mismatches = metric_sum(decode, "vllm:rd2h_kv_digest_mismatches_total")
    failed = metric_sum(decode, "vllm:rd2h_requests_failed_total")
    done = metric_sum(decode, "vllm:rd2h_requests_done_total")
    print(f"[dsv4] Decode pulled {pulled:.0f} bytes for {done:.0f} requests, checked "
          f"{verified:.0f} blocks against Prefill's digests, {mismatches:.0f} mismatched")
    assert pulled > 0 and done > 0 and verified > 0, _tails(cluster)
    assert mismatches == 0 and failed == 0, _tails(cluster)
    text = _log(decode)
    assert "KV digest mismatch" not in text
    assert "verify_kv: this prefill peer states KV digests" in text


@pytest.mark.parametrize("cluster", ["reference"], indirect=True)
def test_a_prefill_with_other_weights_makes_the_comparison_fail(cluster, checkpoint) -> None:
    """Negative control: a second Prefill engine on a checkpoint of the same shape but
    other weights, in front of the same Decode. Decode then continues from KV the plain
    engine never computed, and most answers differ: the equality above is not one that
    holds whatever Decode is given. With the reference kernels, which run on every CPU
    (the comparison is the same for both kinds of kernels)."""
    root, env = cluster["root"], cluster["env"]
    other = make_tiny_deepseek_v4(checkpoint["root"] / "other-model", seed=OTHER_SEED)
    extra = {"transport": "cma", "log_level": "INFO"}
    prefill = vllm_server("dsv4 prefill (other weights)", other, free_port(),
                          root / "other-prefill.log",
                          kv=rd2h_kv("kv_producer", cluster["kv_port"], extra),
                          args=ENGINE_ARGS, env=env, block_size=None, tokenizer=True)
    proxy = proxy_server(free_port(), [prefill.url], [cluster["decode"].url],
                         root / "other-proxy.log")
    ns = (5, 65, 257)
    with running(prefill, proxy):
        outs = {n: answer(_ask(proxy.url, n)) for n in ns}
    differ = [n for n in ns if outs[n]["tokens"] != _reference(cluster, n)["tokens"]]
    print(f"[dsv4] negative control: {len(differ)}/{len(ns)} answers differ "
          f"(prompt lengths {differ})")
    assert len(differ) > len(ns) // 2, {n: _diff(outs[n], _reference(cluster, n))
                                        for n in ns}
