"""TEST-ONLY PyTorch reference versions of the vLLM 0.32 DeepSeek-V4 CPU kernels that
exist only in vLLM's AVX512-BF16 library (``vllm/_C.abi3.so``).

On an AVX2-only CPU vLLM loads ``_C_AVX2``, which has none of DeepSeek-V4's kernels but
``cpu_fused_moe``, so the model cannot even finish loading there. ``register()`` defines
each missing kernel under ``torch.ops._C`` with the real op's schema and a PyTorch body
from this package, so the tests serve a tiny DeepSeek-V4 on any x86 CPU. The tiny
model's forward needs these (``dense``: the hyper-connection mixes, the router, the
grouped output LoRA; ``attention``: the query/KV insert and the sparse MLA over the
``fp8_ds_mla`` caches; ``compressor``: the compressor's states and its compressed and
indexer caches). The indexer's scoring kernels (``fp8_paged_mqa_logits_cpu``,
``fused_indexer_q_rope_quant_cpu``, ``topk_transform_512_cpu``) are not among them: they
run only once a compressed sequence exceeds ``index_topk`` (512 compressed tokens, i.e.
prompts over 2,048 tokens), which the tiny model's 1,024-token context never reaches; a
forward that needed one would fail on the missing op, not compute something else.

Each body is deterministic and row-invariant (a token's result depends only on its own
inputs and the cache bytes it reads), which is what the serving tests need: Decode
computes a prompt's last token alone and must match the plain engine computing it inside
the whole prompt. The ``test_dsv4_reference_*`` modules check every body against vLLM's
real kernel wherever that loads, and its invariance everywhere.

Nothing here is part of rd2h; it is put on an engine's ``PYTHONPATH`` by the test-only
``sitecustomize`` that ``tiny_deepseek_v4.serve_patch_dir`` writes.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import torch

# The real ops' schemas (vLLM 0.32's ``_C``), but for ``convert_weight_packed``, whose
# real schema aliases its input (``Tensor($0! -> ) weight``); the reference packs into a
# new tensor.
SCHEMAS = {
    "hc_pre_fused_cpu": "(Tensor x, Tensor hc_fn, Tensor hc_scale, Tensor hc_base, "
    "int hc_mult, int sinkhorn_iters, float rms_eps, float hc_eps) -> (Tensor, Tensor, Tensor)",
    "hc_post_fused_cpu": "(Tensor x, Tensor residual, Tensor post, Tensor comb) -> Tensor",
    "hc_head_fused_cpu": "(Tensor x, Tensor hc_fn, Tensor hc_scale, Tensor hc_base, "
    "float hc_eps, float norm_eps) -> Tensor",
    "biased_topk_cpu": "(Tensor hidden_states, Tensor gating_output, Tensor correction_bias, "
    "int topk, bool renormalize, str scoring_func, int num_fused_shared_experts, "
    "float? routed_scaling_factor, bool apply_routed_scaling_factor_on_output) "
    "-> (Tensor, Tensor)",
    "bmm_cpu": "(Tensor(a!) out, Tensor mat1, Tensor mat2, bool is_vnni, Tensor? scale) -> ()",
    "convert_weight_packed": "(Tensor weight) -> Tensor",
    "inverse_gptj_rope_o_proj_cpu": "(Tensor o, Tensor positions, Tensor cos_sin_cache, "
    "int rope_dim) -> Tensor",
    "fused_qnorm_rope_kv_insert_cpu": "(Tensor q, Tensor kv, Tensor positions, "
    "Tensor(a!) swa_kv_cache_2d, Tensor slot_mapping, Tensor cos_sin_cache, "
    "int q_head_padded, float eps, int cache_block_size) -> Tensor",
    "flash_mla_with_kvcache_cpu": "(Tensor(a!) out, Tensor q, Tensor window_cache_2d, "
    "Tensor window_slots, int window_block_size, Tensor compressed_cache_2d, "
    "Tensor compressed_slots, int compressed_block_size, Tensor attn_sink, float scale) -> ()",
    "save_partial_states_cpu": "(Tensor kv, Tensor score, Tensor ape, Tensor positions, "
    "Tensor(a!) state_cache, Tensor slot_mapping) -> ()",
    "compress_norm_rope_store_cpu": "(Tensor state_cache, Tensor gather_slots, "
    "Tensor positions, Tensor kv_slot_mapping, Tensor rms_norm_weight, float rms_norm_eps, "
    "Tensor cos_sin_cache, Tensor(a!) kv_cache_2d, int kv_cache_block_size, "
    "int compress_ratio) -> ()",
    "compress_norm_rope_store_indexer_cpu": "(Tensor state_cache, Tensor gather_slots, "
    "Tensor positions, Tensor kv_slot_mapping, Tensor rms_norm_weight, float rms_norm_eps, "
    "Tensor cos_sin_cache, Tensor(a!) kv_cache_2d, int kv_cache_block_size, "
    "int compress_ratio) -> ()",
}

_MODULES = ("dense", "attention", "compressor")
_LIBRARY: torch.library.Library | None = None  # kept alive: dropping it drops the ops


def reference(name: str) -> Callable:
    """The reference body for the op ``name``."""
    for module in _MODULES:
        fn = getattr(importlib.import_module(f"{__name__}.{module}"), name, None)
        if fn is not None:
            return fn
    raise KeyError(f"no reference kernel for {name}")


def _fake_for(name: str) -> Callable | None:
    """A shape-only implementation for ops vLLM registers none for (vLLM's
    ``_custom_ops`` registers fakes for the rest once they exist)."""
    if name == "convert_weight_packed":
        return lambda weight: torch.empty_like(weight)
    if SCHEMAS[name].endswith("-> ()"):
        return lambda *args: None
    return None


def missing() -> list[str]:
    """The DeepSeek-V4 kernels the loaded vLLM library lacks."""
    return [name for name in SCHEMAS if not hasattr(torch.ops._C, name)]


def register(verbose: bool = True) -> list[str]:
    """Define every missing kernel under ``torch.ops._C`` with its reference body (and a
    fake where vLLM has none); return their names. A no-op where vLLM's real kernels
    loaded. Call it after vLLM loaded its library (``CpuPlatform.import_kernels``)."""
    global _LIBRARY
    names = missing()
    if not names:
        return []
    if _LIBRARY is None:
        _LIBRARY = torch.library.Library("_C", "FRAGMENT")
    for name in names:
        _LIBRARY.define(name + SCHEMAS[name])
        _LIBRARY.impl(name, reference(name), "CPU")
        fake = _fake_for(name)
        if fake is not None:
            torch.library.register_fake(f"_C::{name}", fake, lib=_LIBRARY)
    if verbose:
        print(f"rd2h test-only reference kernels registered for DeepSeek-V4: "
              f"{', '.join(names)}", file=sys.stderr, flush=True)
    return names
