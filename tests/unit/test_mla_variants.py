"""vLLM's MLA spec types are not one layout (issue #40): ``MLAAttentionSpec`` holds
DeepSeek-V2/V3's plain latent, DeepSeek-V3.2's indexer cache and DeepSeek-V4's
compressed latent caches alike, and ``SlidingWindowMLASpec`` DeepSeek-V4's window
caches and compressor states. rd2h takes the plain latent (one state per token, no
model-specific layout) for full attention, and DeepSeek-V4's caches each by vLLM's own
rule for them (compressed: full attention in 256-token blocks; windows and compressor
states: sliding windows); every other variant refuses the engine at start, naming the
layout, never a flag nobody passed. (The bytes: ``test_vllm_layouts_connector``.)

The spec objects come from vLLM's own cache layers (``DeepseekV32IndexerCache``,
``DeepseekV4SWACache``, ``DeepseekV4IndexerCache``, ``CompressorStateCache``) and, for
DeepSeek-V4's compressed latent, from ``MLAAttentionSpec`` with the arguments of
``DeepseekV4Attention.get_kv_cache_spec``; grouped as vLLM 0.32 groups a tiny DeepSeek-V4
(4 layers, compress ratios 0, 4, 128, 0): a window-cache group per layer, one group
mixing the C4 indexer cache with the C4 and C128 compressed latents (block 256), and the
C4 and C128 compressor states (blocks 4 and 8).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")
import torch
from test_kv_groups import config, start
from test_vllm_connector import vllm_config
from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
from vllm.models.deepseek_v4.attention import DeepseekV4IndexerCache
from vllm.models.deepseek_v4.compressor import CompressorStateCache
from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache
from vllm.v1.kv_cache_interface import (
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SparseCacheRole,
)

from rd2h.domain.planning.kv_groups import UnsupportedKvGroup

BLOCK = 256


def _cache_config(dtype: str = "auto") -> VllmConfig:
    return VllmConfig(cache_config=CacheConfig(block_size=BLOCK, cache_dtype=dtype))


def _dsv4_compressed(ratio: int) -> MLAAttentionSpec:
    """``DeepseekV4Attention.get_kv_cache_spec`` with vLLM's defaults (fp8_ds_mla)."""
    return MLAAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=512, dtype=torch.uint8,
        tokens_per_state=ratio, cache_dtype_str="fp8_ds_mla", alignment=576,
        model_version="deepseek_v4", state_content_bytes=584)


def dsv32_groups() -> list[KVCacheGroupSpec]:
    """DeepSeek-V3.2: the plain latent (576 wide) and the indexer cache, 4 layers."""
    cfg = _cache_config()
    latent = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576,
                              dtype=torch.bfloat16)
    with set_current_vllm_config(cfg):
        indexer = DeepseekV32IndexerCache(
            head_dim=128, dtype=torch.uint8, prefix="model.layers.0.self_attn.indexer.k_cache",
            cache_config=cfg.cache_config).get_kv_cache_spec(cfg)
    assert indexer.cache_role == SparseCacheRole.INDEXER
    names = [f"model.layers.{i}.self_attn" for i in range(4)]
    return [KVCacheGroupSpec([f"{n}.attn" for n in names], latent),
            KVCacheGroupSpec([f"{n}.indexer.k_cache" for n in names], indexer)]


def dsv4_specs(cfg: VllmConfig) -> dict[str, Any]:
    """The tiny DeepSeek-V4's cache layers' specs (call under ``set_current_vllm_config``),
    each from vLLM's own cache layer with the widths a real engine gives it: the indexer
    cache 132 bytes a token (``head_dim`` carries the fp8 scale), the compressor states
    of the C4 indexer, the C4 attention and the C128 attention 512, 2048 and 1024
    floats a state (read from a real engine's bound caches)."""
    cc = cfg.cache_config
    out: dict[str, Any] = {
        f"model.layers.{i}.attn.swa_cache": DeepseekV4SWACache(
            head_dim=512, window_size=128, dtype=torch.uint8,
            prefix=f"model.layers.{i}.attn.swa_cache", cache_config=cc,
        ).get_kv_cache_spec(cfg) for i in range(4)}
    out["model.layers.1.attn.indexer.k_cache"] = DeepseekV4IndexerCache(
        head_dim=132, dtype=torch.uint8, prefix="model.layers.1.attn.indexer.k_cache",
        cache_config=cc, compress_ratio=4).get_kv_cache_spec(cfg)
    out["model.layers.1.attn"] = _dsv4_compressed(4)
    out["model.layers.2.attn"] = _dsv4_compressed(128)
    for name, dim, r in (("model.layers.1.attn.indexer.compressor.state_cache", 512, 4),
                         ("model.layers.1.attn.compressor.state_cache", 2048, 4),
                         ("model.layers.2.attn.compressor.state_cache", 1024, 128)):
        out[name] = CompressorStateCache(state_dim=dim, dtype=torch.float32,
                                         compress_ratio=r, prefix=name).get_kv_cache_spec(cfg)
    return out


def dsv4_groups() -> list[KVCacheGroupSpec]:
    """The tiny DeepSeek-V4's seven groups as vLLM 0.32 groups them on a real engine
    (its log: group block sizes 64, 64, 64, 64, 256, 4, 8), grouped by vLLM itself
    (``get_kv_cache_groups`` in the block-outermost layout V4 needs): a window cache per
    layer; the C4 indexer cache with the C4 and C128 compressed latents
    (``model.layers.N.attn``); the C4 compressor states of the indexer and of the
    attention (window 8); the C128 compressor state (window 128)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

    cfg = _cache_config("fp8_ds_mla")
    cfg.cache_config.kv_cache_layout = "BLHNC"
    with set_current_vllm_config(cfg):
        return get_kv_cache_groups(cfg, dsv4_specs(cfg))


def _fp8_ds_mla_engine(role: str) -> Any:
    """The engine config DeepSeek-V4 gets: vLLM sets cache_dtype fp8_ds_mla itself."""
    vllm = vllm_config(role)
    object.__setattr__(vllm.cache_config, "cache_dtype", "fp8_ds_mla")
    return vllm


def test_deepseek_v32s_latent_and_indexer_are_moved() -> None:
    conn = start(config(*dsv32_groups()), "kv_consumer")
    assert conn.get_loaded_kv_cache_group_ids(None) == (0, 1)
    assert conn._facts.compat.values["kv_groups"] == f"full/{BLOCK}x4,full/{BLOCK}x4"
    conn.shutdown()


@pytest.mark.parametrize("role", ["kv_consumer", "kv_producer"])
def test_deepseek_v4s_seven_groups_are_moved_each_by_its_own_rule(role) -> None:
    """The window caches and compressor states are sliding windows (their tail blocks),
    the compressed group full attention counted in 256-token blocks, each group in its own
    block size; all of them announced after the forward (V4's kernels write them with no
    per-layer hook); the model's own fp8_ds_mla moved as its bytes; TP stated, so a peer
    of another TP size is refused at the handshake."""
    conn = start(config(*dsv4_groups()), role, vllm=_fp8_ds_mla_engine(role))
    facts = conn._facts
    assert conn.get_loaded_kv_cache_group_ids(None) == tuple(range(7))
    assert facts.group_block_sizes == (64, 64, 64, 64, BLOCK, 4, 8)
    assert facts.hookless_groups == tuple(range(7)) and facts.state_groups == ()
    assert facts.compat.values["kv_groups"] == (
        "slidingw128/64x1,slidingw128/64x1,slidingw128/64x1,slidingw128/64x1,"
        f"full/{BLOCK}x3,slidingw8/4x2,slidingw128/8x1")
    assert facts.compat.values["kv_dtype"] == "fp8_ds_mla"
    assert facts.compat.values["state_tp"] == 1
    conn.shutdown()


def test_deepseek_v4s_indexer_cache_alone_is_not_taken_for_full_attention() -> None:
    """V4's indexer cache and compressor states do not name the model: outside an engine
    whose caches do, a compressed cache is refused, naming what it is."""
    indexer = dict(dsv4_groups()[4].kv_cache_spec.kv_cache_specs)[
        "model.layers.1.attn.indexer.k_cache"]
    with pytest.raises(UnsupportedKvGroup, match=r"a compressed indexer cache \(one state "
                       r"per 4 tokens, uint8\)"):
        start(config(KVCacheGroupSpec(["model.layers.1.attn.indexer.k_cache"], indexer)))


@pytest.mark.parametrize(
    ("spec", "layout"),
    [(MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                       tokens_per_state=4), "one state per 4 tokens"),
     (MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                       model_version="deepseek_v9"), "model layout 'deepseek_v9'")],
)
def test_no_mla_variant_passes_for_full_attention_by_its_type_name(spec, layout) -> None:
    """Each departure from the plain latent on its own: a compressed cache of no known
    model, a model layout rd2h does not know; only ``tokens_per_state`` 1 without a
    ``model_version``, or a layout rd2h moves (DeepSeek-V4), is taken."""
    with pytest.raises(UnsupportedKvGroup, match=layout):
        start(config(KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)))


def test_a_dtype_the_model_did_not_choose_is_still_refused_without_naming_a_flag() -> None:
    """A plain layout with an unmovable cache dtype: the message says where a dtype
    comes from instead of assuming a command-line flag."""
    vllm = vllm_config("kv_consumer")
    object.__setattr__(vllm.cache_config, "cache_dtype", "nvfp4_ds_mla")
    latent = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576,
                              dtype=torch.uint8)
    with pytest.raises(UnsupportedKvGroup, match="or the model's own choice"):
        start(config(KVCacheGroupSpec(["model.layers.0.self_attn.attn"], latent)), vllm=vllm)
