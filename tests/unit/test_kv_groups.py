"""Which KV cache groups rd2h moves, over vLLM's own KV cache config objects (issues
#28, #39): full attention, MLA and sliding windows are moved, each group by its own
block table, and recurrent state (Mamba, gated delta net) by the N-1 scheme; cross-
attention, encoder caches, spec types rd2h does not know and a model of state alone
refuse the engine at start, naming the group, its spec type and its layers; groups of
different block sizes are moved, each by its own. Models vLLM's CPU backend cannot run
(Jamba, an EAGLE drafter) are covered here through the configs their engines would
build."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")
import torch
from test_vllm_connector import vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from rd2h.domain.planning.kv_groups import NO_BLOCK, UnsupportedKvGroup, leading_gap
from rd2h.domain.wire.compat import compare
from rd2h.entry import translate
from rd2h.entry.connector import SfaRemoteD2HConnector

BS = 16


def full(bs: int = BS) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=64, dtype=torch.float32)


def sliding(window: int = 32) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=64,
                             dtype=torch.float32, sliding_window=window)


def mamba() -> MambaSpec:
    return MambaSpec(block_size=BS, shapes=((3, 256), (8, 32, 64)),
                     dtypes=(torch.float32, torch.float32))


def layers(*idx: int, kind: str = "self_attn.attn") -> list[str]:
    return [f"model.layers.{i}.{kind}" for i in idx]


def config(*groups: KVCacheGroupSpec) -> KVCacheConfig:
    names = [n for g in groups for n in g.layer_names]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[
        KVCacheTensor(size=1 << 16, layers=[n], layer_stride=1 << 16, block_stride=1 << 13)
        for n in names], kv_cache_groups=list(groups))


def start(cfg: KVCacheConfig, role: str = "kv_consumer", vllm: Any = None
          ) -> SfaRemoteD2HConnector:
    return SfaRemoteD2HConnector(vllm or vllm_config(role), KVConnectorRole.SCHEDULER, cfg)


@pytest.mark.parametrize("role", ["kv_consumer", "kv_producer"])
def test_full_and_sliding_groups_are_both_moved(role) -> None:
    conn = start(config(KVCacheGroupSpec(layers(1, 3), full()),
                        KVCacheGroupSpec(layers(0, 2), sliding())), role)
    assert conn.get_loaded_kv_cache_group_ids(None) == (0, 1)
    groups = conn._facts.layer_groups()
    assert groups == {**dict.fromkeys(layers(1, 3), 0), **dict.fromkeys(layers(0, 2), 1)}
    assert "window 32" in conn._facts.groups_text
    assert conn._facts.compat.values["kv_groups"] == "full/16x2,slidingw32/16x2"
    conn.shutdown()


@pytest.mark.parametrize(
    ("spec", "why"),
    [(CrossAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32),
      "cross-attention"),
     (SinkFullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64,
                            dtype=torch.float32, sink_len=4), "does not know"),
     (RSWASpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32,
              rswa_window=32),
      "does not know")],
)
@pytest.mark.parametrize("role", ["kv_consumer", "kv_producer"])
def test_a_group_rd2h_cannot_move_refuses_the_engine_naming_it(spec, why, role) -> None:
    """An encoder-decoder, an attention variant vLLM added later: refused when the
    connector starts, on both sides."""
    cfg = config(KVCacheGroupSpec(layers(1, 3), full()),
                 KVCacheGroupSpec(layers(0, 2, kind="mixer"), spec))
    with pytest.raises(UnsupportedKvGroup) as info:
        start(cfg, role)
    text = str(info.value)
    assert f"group 1 ({type(spec).__name__}, 2 layers: model.layers.0.mixer" in text, text
    assert why in text and "serve this model without disaggregation" in text, text


@pytest.mark.parametrize("role", ["kv_consumer", "kv_producer"])
def test_a_hybrid_moves_its_state_groups_by_their_own_block_size(role) -> None:
    """Jamba / Granite-4-H / Nemotron-H / Falcon-H1 / Qwen3-Next: the state groups are
    moved (state kind, N-1), whatever their block size (vLLM: the model length without
    prefix caching); the attention groups set the engine's block size."""
    state = MambaSpec(block_size=512, shapes=((3, 256), (8, 32, 64)),
                      dtypes=(torch.float32, torch.float32))
    conn = start(config(KVCacheGroupSpec(layers(0, 2, kind="mixer"), state),
                        KVCacheGroupSpec(layers(1, 3), full())), role)
    assert conn.get_loaded_kv_cache_group_ids(None) == (0, 1)
    assert conn._facts.state_groups == (0,) and conn._facts.block_size == BS
    assert conn._facts.compat.values["kv_groups"] == "state/512x2,full/16x2"
    conn.shutdown()


def test_a_model_of_state_alone_is_refused() -> None:
    with pytest.raises(UnsupportedKvGroup, match="every group is recurrent state") as info:
        start(config(KVCacheGroupSpec(layers(0, 1, kind="mixer"), mamba())))
    assert "model.layers.0.mixer" in str(info.value)


def test_mixed_block_sizes_are_moved_each_group_by_its_own() -> None:
    """Groups of different block sizes (DeepSeek-V4's window, compressed and compressor
    caches) are moved, each counted in its own tokens per block; both sides state every
    group's block size, so a peer laid out otherwise is refused at the handshake."""
    cfg = config(KVCacheGroupSpec(layers(0), full(16)), KVCacheGroupSpec(layers(1), full(32)))
    conn = start(cfg)
    assert conn._facts.group_block_sizes == (16, 32)
    assert conn._facts.compat.values["kv_groups"] == "full/16x1,full/32x1"
    conn.shutdown()


def test_uniform_type_specs_and_mla_are_moved() -> None:
    uniform = UniformTypeKVCacheSpecs(block_size=BS, kv_cache_specs={
        "model.layers.0.self_attn.attn": full(), "model.layers.1.self_attn.attn": full()})
    conn = start(config(KVCacheGroupSpec(layers(0, 1), uniform)))
    assert conn.get_loaded_kv_cache_group_ids(None) == (0,)
    conn.shutdown()
    mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.float32)
    conn = start(config(KVCacheGroupSpec(layers(0, 1), mla)))
    assert conn._facts.compat.values["kv_groups"] == "full/16x2"
    conn.shutdown()
    mixed = UniformTypeKVCacheSpecs(block_size=BS, kv_cache_specs={
        "model.layers.0.self_attn.attn": full(), "model.layers.1.self_attn.attn": mamba()})
    with pytest.raises(UnsupportedKvGroup, match=r"UniformTypeKVCacheSpecs\(FullAttention"):
        start(config(KVCacheGroupSpec(layers(0, 1), mixed)))


def test_a_draft_models_layers_are_moved_like_the_targets() -> None:
    """EAGLE / MTP: the drafter's attention layers own KV (here in a group of their own,
    as vLLM builds it with ``is_eagle_group``); they are moved into their own group's
    blocks, and named in the layer map like every target layer. vLLM's CPU backend
    cannot run a drafter here, so this is shown on vLLM's config objects."""
    conn = start(config(KVCacheGroupSpec(layers(0, 1, 2, 3), full()),
                        KVCacheGroupSpec(layers(4), full(), is_eagle_group=True)))
    assert conn.get_loaded_kv_cache_group_ids(None) == (0, 1)
    assert conn._facts.layer_groups()["model.layers.4.self_attn.attn"] == 1
    conn.shutdown()


def test_a_group_vllm_does_not_transfer_is_neither_moved_nor_claimed() -> None:
    conn = start(config(KVCacheGroupSpec(layers(0, 1), full()),
                        KVCacheGroupSpec(layers(2), mamba(), enable_kv_transfer=False)))
    assert conn.get_loaded_kv_cache_group_ids(None) == (0,)
    assert "model.layers.2.self_attn.attn" not in conn._facts.layer_groups()
    conn.shutdown()


class _Spec:
    def __init__(self, method: str, model: str, n: int) -> None:
        self.method, self.model, self.num_speculative_tokens = method, model, n
        self.draft_model_config = None


def test_different_drafters_refuse_each_other_at_the_handshake() -> None:
    """The speculative config joins the compatibility map: a Prefill with an EAGLE
    drafter and a Decode without one (or with another) are refused at MF_META."""
    cfg = config(KVCacheGroupSpec(layers(0, 1), full()))
    p_vllm, d_vllm = vllm_config("kv_producer"), vllm_config("kv_consumer")
    object.__setattr__(p_vllm, "speculative_config", _Spec("eagle", "drafter-a", 3))
    p, d = start(cfg, "kv_producer", p_vllm), start(cfg, "kv_consumer", d_vllm)
    refusal = compare(p._facts.compat, d._facts.compat)
    assert refusal is not None
    assert [(m.key, m.prefill, m.decode) for m in refusal.mismatches] == [
        ("spec_decode", "eagle:drafter-a:3", "none")]
    object.__setattr__(d_vllm, "speculative_config", _Spec("eagle", "drafter-a", 3))
    d2 = start(cfg, "kv_consumer", d_vllm)
    assert compare(p._facts.compat, d2._facts.compat) is None
    for c in (p, d, d2):
        c.shutdown()


def test_vllms_null_block_becomes_no_block_on_both_sides() -> None:
    class Blocks:
        def get_block_ids(self):
            return ([0, 0, 5, 6], [7, 8, 9, 10])

    assert translate.block_ids(Blocks()) == ((NO_BLOCK, NO_BLOCK, 5, 6), (7, 8, 9, 10))
    assert leading_gap((NO_BLOCK, NO_BLOCK, 5)) == 2 and leading_gap((5, NO_BLOCK)) == 0


@pytest.mark.parametrize("dtype", ["int8_per_token_head", "nvfp4", "turboquant_4bit_nc"])
def test_a_kv_dtype_with_scales_outside_the_blocks_is_refused(dtype) -> None:
    vllm = vllm_config("kv_consumer")
    object.__setattr__(vllm.cache_config, "cache_dtype", dtype)
    with pytest.raises(UnsupportedKvGroup, match=f"a KV cache of dtype '{dtype}'"):
        start(config(KVCacheGroupSpec(layers(0), full())), vllm=vllm)


def test_fp8_is_moved_and_stated_exactly() -> None:
    """fp8 blocks are moved as bytes (one byte per element; its per-layer scales are
    checkpoint weights, the same on both sides) and the dtype is in the map, so an fp8
    Prefill and a bfloat16 Decode refuse each other."""
    p_vllm, d_vllm = vllm_config("kv_producer"), vllm_config("kv_consumer")
    object.__setattr__(p_vllm.cache_config, "cache_dtype", "fp8")
    cfg = config(KVCacheGroupSpec(layers(0), full()))
    p, d = start(cfg, "kv_producer", p_vllm), start(cfg, vllm=d_vllm)
    assert p._facts.compat.values["kv_dtype"] == "fp8_e4m3"
    refusal = compare(p._facts.compat, d._facts.compat)
    assert refusal is not None and refusal.mismatches[0].key == "kv_dtype"
    p.shutdown()
    d.shutdown()
