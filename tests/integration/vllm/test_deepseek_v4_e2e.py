"""DeepSeek-V4 on real vLLM engines (issue #40): what this machine proves, and what stands
in the way of the rest.

A tiny random-weight DeepSeek-V4 (``tiny_deepseek_v4``: 4 layers, compress ratios 0, 4,
128, 0) is served by a Prefill and a Decode engine with rd2h's connector (cma). On
vLLM 0.32's CPU backend its kernels exist only in the AVX512-BF16 build of vLLM's
library; on a CPU without AVX512-BF16 (this one: AVX2) the engine gets through start-up
only with a test-only patch that skips one weight packing (``RD2H_DSV4_START_ONLY``),
and its first forward then fails in vLLM's own missing kernels (``hc_pre_fused_cpu``):
no token can be compared here. What the engines do prove here:

- both engines start with rd2h, which takes the model's real KV cache config (the
  scheduler's and the worker's) and moves all seven groups, each in its own block size
  (``kv_groups``), the model's own ``fp8_ds_mla`` as its bytes, its TP stated;
- the caches the worker allocated and rd2h registered are the layout the connector unit
  test moves real bytes through (``tests/unit/test_deepseek_v4_connector.py``): the same
  layers, view shapes and 47,808-byte pages.

The block selection against vLLM's own KV cache manager and the bytes over the
connector pair are proven in that unit test.
"""

from __future__ import annotations

import re

import pytest
from fakes.net import free_port, quiet_ports
from servers import rd2h_kv, running, vllm_server
from tiny_deepseek_v4 import cpu_kernels_available, make_tiny_deepseek_v4, serve_patch_dir

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

GROUPS = ("slidingw128/64x1,slidingw128/64x1,slidingw128/64x1,slidingw128/64x1,"
          "full/256x3,slidingw8/4x2,slidingw128/8x1")
PAGE = 47808
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


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv4")
    model = make_tiny_deepseek_v4(root / "model")
    env = {"TRITON_INTERPRET": "1", "PYTHONPATH": str(serve_patch_dir(root / "patches")),
           "RD2H_DUMP_KV_CACHES": "1",
           **({} if cpu_kernels_available() else {"RD2H_DSV4_START_ONLY": "1"})}
    kv_port = quiet_ports(1)  # Decode's control socket binds after its model loads
    args = ["--dtype", "bfloat16", "--max-model-len", "1024",
            "--max-num-batched-tokens", "1024"]
    servers = [vllm_server(role, model, free_port(), root / f"{role}.log",
                           kv=rd2h_kv(kv, kv_port, {"transport": "cma", "log_level": "INFO"}),
                           args=args, env=env, block_size=None, tokenizer=True)
               for role, kv in (("prefill", "kv_producer"), ("decode", "kv_consumer"))]
    with running(*servers):
        yield {s.name: s for s in servers}


def _log(server) -> str:
    return server.log.read_text(errors="replace")


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_both_engines_start_with_rd2h_moving_all_seven_groups(engines, side) -> None:
    text = _log(engines[side])
    assert "rd2h moves KV cache groups" in text, text[-3000:]
    assert f"'kv_groups': '{GROUPS}'" in text, text[-3000:]
    assert "'kv_dtype': 'fp8_ds_mla'" in text and "'state_tp': 1" in text, text[-3000:]
    assert "cannot transfer" not in text
    # The worker took the engine's caches (its transport registered them, its role built).
    assert "control channel" in text, text[-3000:]


def test_the_registered_caches_are_the_layout_the_unit_test_moves(engines) -> None:
    """The worker's KV caches (the patch's dump when vLLM allocated them): the layers,
    view shapes and page the connector unit test lays its caches out as."""
    text = _log(engines["decode"])
    dump = text[text.index("RD2H_KV_CACHES"):]
    seen = {}
    for m in re.finditer(r"^(\S+) -> shape=\((\d+), [^)]*\) dtype=(\S+) stride=\((\d+),[^|]*"
                         r"\| bound view shape=\(\d+, ([\d, ]+)\) stride=\((\d+),", dump, re.M):
        name, _, dtype, _, shape, stride = m.groups()
        seen[name] = (tuple(int(x) for x in shape.split(",")), dtype,
                      int(stride) * ELEM[dtype])
    assert {n: (s, d) for n, (s, d, _) in seen.items()} == VIEWS, dump[:3000]
    assert {p for *_, p in seen.values()} == {PAGE}
