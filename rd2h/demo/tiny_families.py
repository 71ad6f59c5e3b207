"""Tiny random-weight checkpoints of current model families, made locally with
``transformers`` from small configs, for the model-family matrix (docs/guide/vllm.md,
"Model families"): each stresses a different part of the KV cache a connector must move.

| name | architecture | what is special |
|---|---|---|
| qwen3 | Qwen3ForCausalLM | GQA 4q/2kv, q/k norm: one full-attention group |
| mistral | MistralForCausalLM | every layer sliding (window 32): one sliding group |
| gemma3 | Gemma3ForCausalLM | sliding (32) and full attention alternating: two groups |
| gpt_oss | GptOssForCausalLM | attention sinks, sliding/full alternating, MoE: two groups |
| granite_hybrid | GraniteMoeHybridForCausalLM | Mamba2 layers + attention: recurrent state |
| nemotron_h | NemotronHForCausalLM | Mamba2, MLP and attention layers ("M-M*"): recurrent state |
| qwen3_next | Qwen3NextForCausalLM | gated delta net (128-wide heads) + attention, MoE |
| falcon_h1 | FalconH1ForCausalLM | attention and a Mamba2 mixer in every layer (``model.N.mixer``)|

All use the word-level tokenizer's vocabulary (``tiny_model.VOCAB``), bos 0 / eos 1,
4 layers, 2,048 positions. torch and transformers are imported inside the builders.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rd2h.demo.tiny_model import VOCAB, _built, _save, make_word_tokenizer

WINDOW = 32  # sliding window, tokens (one 32-token block)
LAYERS = 4
_COMMON = {"vocab_size": VOCAB, "max_position_embeddings": 2048, "bos_token_id": 0,
           "eos_token_id": 1, "pad_token_id": 1, "tie_word_embeddings": False,
           "initializer_range": 0.2}


def _qwen3() -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(
        hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, **_COMMON))


def _mistral() -> Any:
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=WINDOW,
        **_COMMON))


def _alternating() -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(LAYERS)]


def _gemma3() -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(Gemma3TextConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        query_pre_attn_scalar=64, sliding_window=WINDOW, layer_types=_alternating(),
        **_COMMON))


def _gpt_oss() -> Any:
    from transformers import GptOssConfig, GptOssForCausalLM

    return GptOssForCausalLM(GptOssConfig(
        hidden_size=256, intermediate_size=256, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=WINDOW, layer_types=_alternating(),
        rope_scaling=None, **_COMMON))


def _granite_hybrid() -> Any:
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    return GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
        hidden_size=256, intermediate_size=512, shared_intermediate_size=512,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=0, num_experts_per_tok=0,
        layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=8,
        mamba_d_head=32, mamba_d_state=64, mamba_n_groups=1, mamba_d_conv=4,
        mamba_expand=1, mamba_chunk_size=64, position_embedding_type="rope", **_COMMON))


def _nemotron_h() -> Any:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    return NemotronHForCausalLM(NemotronHConfig(
        hidden_size=256, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64,
        layers_block_type=["mamba", "mlp", "mamba", "attention"], mamba_num_heads=8,
        mamba_head_dim=32, ssm_state_size=64, n_groups=1, conv_kernel=4, expand=1,
        chunk_size=64, **_COMMON))


def _falcon_h1() -> Any:
    from transformers import FalconH1Config, FalconH1ForCausalLM

    # Every layer holds an attention cache and a Mamba2 mixer side by side (vLLM names
    # the mixers ``model.<i>.mixer``, i past the decoder layers' indices).
    return FalconH1ForCausalLM(FalconH1Config(
        hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, mamba_d_ssm=256,
        mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=64,
        mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=64, mamba_rms_norm=False,
        **_COMMON))


def _qwen3_next() -> Any:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    # 128-wide linear-attention heads: vLLM 0.32's CPU chunk_gated_delta_rule fails on 32.
    return Qwen3NextForCausalLM(Qwen3NextConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        layer_types=["linear_attention", "full_attention"] * (LAYERS // 2),
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=2, linear_num_value_heads=2, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=128,
        shared_expert_intermediate_size=128, **_COMMON))


# Saved in bfloat16 (vLLM's CPU gated-delta-net kernels); the others in float32.
BF16 = frozenset({"qwen3_next"})

BUILDERS: dict[str, Callable[[], Any]] = {
    "qwen3": _qwen3, "mistral": _mistral, "gemma3": _gemma3, "gpt_oss": _gpt_oss,
    "granite_hybrid": _granite_hybrid, "nemotron_h": _nemotron_h, "qwen3_next": _qwen3_next,
    "falcon_h1": _falcon_h1,
}


def make_tiny_family(name: str, path: str | os.PathLike[str], seed: int = 1234) -> Path:
    """Write family ``name``'s checkpoint, with the word-level tokenizer, to ``path``
    once (idempotent); return it."""
    if name not in BUILDERS:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(BUILDERS)}")
    out = Path(path)
    marker = f"rd2h-tiny-{name}-v1"
    if _built(out, marker):
        return out
    import torch

    torch.manual_seed(seed)
    model = BUILDERS[name]().to(torch.bfloat16 if name in BF16 else torch.float32)
    make_word_tokenizer(out)
    return _save(model, out, marker)


if __name__ == "__main__":
    import sys

    print(make_tiny_family(sys.argv[1], sys.argv[2]))
