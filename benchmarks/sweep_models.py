"""Tiny random-weight checkpoints for ``model_sweep.py``: vLLM's registry of text
generation architectures, each paired with the ``transformers`` config class that
describes it, and a small config with the family's distinctive features kept (sliding
windows, sinks, MoE, MLA, Mamba / gated delta net / short convolutions, shared KV).

The shrinking is generic (every size-like field a config has is set small, per-layer
lists are cut to ``LAYERS`` keeping each kind of layer), with a few per-family fields in
``OVERRIDES`` where a family's own consistency rules need them (say, Mamba heads x head
dim = the inner width). The families ``rd2h.demo`` already builds use those builders.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from rd2h.demo.tiny_families import BUILDERS, make_tiny_family
from rd2h.demo.tiny_model import VOCAB, make_tiny_deepseek, make_word_tokenizer

LAYERS = 4
WINDOW = 32
BUILDER_VERSION = 3  # in every checkpoint's stamp: a change here rebuilds them

# Architectures rd2h.demo builds itself (the model-family and MLA tests use the same).
FAMILY_OF = {
    "Qwen3ForCausalLM": "qwen3", "MistralForCausalLM": "mistral",
    "Gemma3ForCausalLM": "gemma3", "GptOssForCausalLM": "gpt_oss",
    "GraniteMoeHybridForCausalLM": "granite_hybrid", "NemotronHForCausalLM": "nemotron_h",
    "Qwen3NextForCausalLM": "qwen3_next", "FalconH1ForCausalLM": "falcon_h1",
}
assert set(FAMILY_OF.values()) <= set(BUILDERS)

# Sizes set on every config that has the field (attribute maps included: GPT-2's n_embd
# is hidden_size). Heads: 4 query heads of 64, 2 KV heads.
SIZES: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "max_position_embeddings": 2048,
    # MoE
    "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_k": 2, "top_k": 2, "moe_topk": 2, "n_group": 1,
    "topk_group": 1, "n_shared_experts": 1, "num_shared_experts": 1,
    "first_k_dense_replace": 1, "ffn_hidden_size": 512, "expert_dim": 128,
    # MLA: vLLM's CPU MLA takes a 512 latent + 64 rope (576) only; the rest small
    "kv_lora_rank": 512, "q_lora_rank": 128, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64, "v_head_dim": 64, "qk_head_dim": 128,
    # windows and chunking
    "sliding_window": WINDOW, "attention_chunk_size": 64,
    "initializer_range": 0.2,
    # Gemma-3n / Gemma-4 per-layer inputs (a 262,144-row table per layer otherwise)
    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 64,
}
# Fields given to the config class itself (derived views that cannot be set after).
CONSTRUCT: dict[str, dict[str, Any]] = {
    "Gemma4ForCausalLM": {
        "num_hidden_layers": LAYERS,
        "layer_types": ["sliding_attention", "full_attention"] * (LAYERS // 2),
        "per_layer_config": {str(i): {"head_dim": 128} for i in range(1, LAYERS, 2)}},
}
SPECIAL_IDS = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}

# Per family: fields its consistency rules need (applied last).
OVERRIDES: dict[str, dict[str, Any]] = {
    "Mamba2ForCausalLM": {"num_heads": 8, "head_dim": 32, "expand": 1, "n_groups": 1,
                          "state_size": 64, "conv_kernel": 4, "chunk_size": 64},
    "MambaForCausalLM": {"state_size": 16, "expand": 2, "conv_kernel": 4},
    "FalconMambaForCausalLM": {"state_size": 16, "expand": 2, "conv_kernel": 4},
    "JambaForCausalLM": {"mamba_d_state": 16, "mamba_expand": 2, "mamba_d_conv": 4,
                         "attn_layer_period": 2, "attn_layer_offset": 1,
                         "expert_layer_period": 2, "expert_layer_offset": 1},
    "Zamba2ForCausalLM": {"mamba_d_state": 64, "mamba_headdim": 32, "mamba_ngroups": 1,
                          "n_mamba_heads": 16, "mamba_expand": 2, "num_mem_blocks": 1,
                          "adapter_rank": 16, "chunk_size": 64,
                          # its shared attention block reads the hidden state twice wide
                          "attention_hidden_size": 2 * 256, "attention_head_dim": 128},
    "DbrxForCausalLM": {"attn_config.rope_theta": 10000.0, "attn_config.kv_n_heads": 2,
                        "ffn_config.moe_num_experts": 4, "ffn_config.moe_top_k": 2,
                        "ffn_config.ffn_hidden_size": 256},
    "Gemma3nForCausalLM": {"layer_types": ["sliding_attention", "full_attention"] * 2,
                           "num_kv_shared_layers": 2, "intermediate_size": [512] * LAYERS},
    "Lfm2MoeForCausalLM": {"layer_types": ["conv", "full_attention"] * 2,
                           "num_dense_layers": 1},
    "Qwen4ExpForCausalLM": {"indexer_n_heads": 4, "indexer_kv_heads": 1,
                            "indexer_head_dim": 64, "indexer_budget": 128,
                            "indexer_compress_ratio": 4, "hc_lowrank": 64,
                            "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                            "linear_num_key_heads": 2, "linear_num_value_heads": 2},
    "Qwen3_5ForCausalLM": {"linear_key_head_dim": 128, "linear_value_head_dim": 128,
                           "linear_num_key_heads": 2, "linear_num_value_heads": 2,
                           "linear_conv_kernel_dim": 4},
    "Qwen3_5MoeForCausalLM": {"linear_key_head_dim": 128, "linear_value_head_dim": 128,
                              "linear_num_key_heads": 2, "linear_num_value_heads": 2,
                              "linear_conv_kernel_dim": 4},
    "KimiLinearForCausalLM": {"linear_attn_config": {
        "kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 2, "head_dim": 128,
        "short_conv_kernel_size": 4}},
}

# Fields vLLM's model reads that transformers' config class lacks (written into the
# checkpoint's config.json).
CONFIG_EXTRAS: dict[str, dict[str, Any]] = {
    "AfmoeForCausalLM": {"score_func": "sigmoid", "route_norm": True, "n_group": 1,
                         "topk_group": 1},
    # vLLM's LFM2 reads its block and convolution widths from older field names.
    "Lfm2ForCausalLM": {"block_dim": SIZES["hidden_size"], "conv_dim": SIZES["hidden_size"]},
    # Flags of the original LongCat checkpoints vLLM reads (the tiny model scales nothing).
    "LongcatFlashForCausalLM": {"mla_scale_q_lora": False, "mla_scale_kv_lora": False},
    "MiniMaxM2ForCausalLM": {"rotary_dim": SIZES["head_dim"], "scoring_func": "sigmoid"},
    # vLLM gives the router its score-correction bias only for this method (V3's own).
    "DeepseekV3ForCausalLM": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"},
}
# vLLM's Falcon MLP is 4 x hidden wide whatever ffn_hidden_size says.
OVERRIDES["FalconForCausalLM"] = {"ffn_hidden_size": 4 * SIZES["hidden_size"]}
# transformers' A.X-K1 has the post-MLP norm in its MoE layers only; vLLM's in every
# layer: all layers MoE.
OVERRIDES["AXK1ForCausalLM"] = {"first_k_dense_replace": 0}

# Engine arguments a family needs: vLLM turns chunked prefill off for a model with
# non-causal attention layers, so a prompt must fit one step's budget.
ENGINE_ARGS: dict[str, list[str]] = {
    "HrmTextForCausalLM": ["--max-num-batched-tokens", "512"],
}

# Architectures vLLM's CPU kernels serve in bfloat16 only (tiny_families.BF16 and
# DeepSeek-V4).
BF16 = {"Qwen3NextForCausalLM", "DeepseekV4ForCausalLM", "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM", "KimiLinearForCausalLM"}


TESTS_VLLM = Path(__file__).resolve().parents[1] / "tests" / "integration" / "vllm"


def _harness_module(name: str) -> Any:
    import importlib

    if str(TESTS_VLLM) not in sys.path:
        sys.path.insert(0, str(TESTS_VLLM))
    return importlib.import_module(name)


# Families vLLM 0.32's CPU backend does not serve by itself, served with the test-only
# stand-ins rd2h's own tests use (their checkpoint builder, a ``sitecustomize`` on the
# engines' PYTHONPATH, their engine arguments): arch -> (module, builder, extra engine
# arguments, extra environment).
HARNESS: dict[str, tuple[str, str, list[str], dict[str, str]]] = {
    "DeepseekV32ForCausalLM": (
        "tiny_deepseek_v32", "make_tiny_deepseek_v32",
        ["--attention-backend", "CPU_MLA", "--dtype", "float32", "--block-size", "16",
         "--max-num-batched-tokens", "2048"], {}),
    "DeepseekV4ForCausalLM": (
        "tiny_deepseek_v4", "make_tiny_deepseek_v4",
        ["--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-batched-tokens",
         "1024"], {"TRITON_INTERPRET": "1"}),
    # Mamba-1's selective scan (mamba1_reference.py); the checkpoint is the generic one.
    **{arch: ("mamba1_reference", "", ["--dtype", "float32"], {})
       for arch in ("JambaForCausalLM", "MambaForCausalLM", "FalconMambaForCausalLM")},
}


def harness(arch: str, out: Path) -> tuple[Path, list[str], dict[str, str], str] | None:
    """For a family served with test-only stand-ins: its checkpoint (built once), the
    engine arguments and environment, and what it is; else None."""
    if arch not in HARNESS:
        return None
    module_name, builder, args, env = HARNESS[arch]
    module = _harness_module(module_name)
    ckpt = (getattr(module, builder)(out / "model") if builder
            else make_checkpoint(arch, registry_types()[arch], out / "model")[0])
    patches = module.serve_patch_dir(out / "patches")
    note = (f"with the test-only stand-ins of tests/integration/vllm/{module_name}.py "
            "(vLLM 0.32's CPU backend does not serve this family by itself)")
    return ckpt, list(args), {**env, "PYTHONPATH": str(patches)}, note


def registry_types() -> dict[str, str]:
    return dict(registry()[0])


def registry() -> tuple[list[tuple[str, str]], list[str]]:
    """(architecture, transformers model type) for each text-generation architecture in
    the installed vLLM's registry whose causal-LM class transformers provides; and the
    architectures without one (not swept)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS

    types: dict[str, list[str]] = {}
    for model_type, arch in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        for a in arch if isinstance(arch, (list, tuple)) else [arch]:
            types.setdefault(a, []).append(model_type)
    swept, left = [], []
    for arch in sorted(_TEXT_GENERATION_MODELS):
        if arch in types:
            # A text-only type when there are several ("gemma3_text" over "gemma3").
            pick = sorted(types[arch], key=lambda t: (not t.endswith("_text"), t))[0]
            swept.append((arch, pick))
        else:
            left.append(arch)
    return swept, left


def _cut(values: list[Any], n: int) -> list[Any]:
    """``values`` (one per layer) cut to ``n``, every distinct kind kept: the first
    ``n`` when they have every kind (a leading dense layer stays leading), else the
    first layer of each kind, the pattern repeated."""
    kinds = list(dict.fromkeys(json.dumps(v, sort_keys=True) for v in values))
    if len({json.dumps(v, sort_keys=True) for v in values[:n]}) == len(kinds):
        return values[:n]
    firsts = [values[[json.dumps(v, sort_keys=True) for v in values].index(k)] for k in kinds]
    out = (firsts * n)[:n] if len(firsts) <= n else firsts[:n]
    return out


def tiny_config(arch: str, model_type: str) -> Any:
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, **CONSTRUCT.get(arch, {}))
    text = getattr(cfg, "text_config", None)
    target = text if text is not None and hasattr(text, "hidden_size") else cfg
    if hasattr(target, "allow_global_per_layer_attribute_access"):
        target.allow_global_per_layer_attribute_access = True  # Gemma-4's per-layer sizes
    layers_before = getattr(target, "num_hidden_layers", None)
    for key, value in {**SIZES, **SPECIAL_IDS}.items():
        if hasattr(target, key) and (key not in ("sliding_window", "attention_chunk_size")
                                     or getattr(target, key) is not None):
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                setattr(target, key, value)
    # Per-layer lists and patterns cut to LAYERS, each kind of layer kept.
    if isinstance(layers_before, int) and layers_before > LAYERS:
        for key, value in list(vars(target).items()):
            if isinstance(value, list) and len(value) == layers_before:
                setattr(target, key, _cut(value, LAYERS))
            elif isinstance(value, str) and len(value) == layers_before and key.endswith(
                    "pattern"):
                setattr(target, key, "".join(_cut(list(value), LAYERS)))
    for key, value in OVERRIDES.get(arch, {}).items():
        owner, _, name = key.rpartition(".")
        setattr(getattr(target, owner) if owner else target, name, value)
    return cfg


def _derived(cfg: dict[str, Any]) -> dict[str, Any]:
    """Fields vLLM's models read that a transformers config leaves implicit, from what
    the config says (only those it lacks)."""
    out: dict[str, Any] = {}
    if "head_dim" not in cfg and cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        out["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    kinds = cfg.get("mlp_layer_types")
    if isinstance(kinds, list) and "first_k_dense_replace" not in cfg:
        dense = 0
        while dense < len(kinds) and kinds[dense] == "dense":
            dense += 1
        out["first_k_dense_replace"] = dense
    return out


def make_checkpoint(arch: str, model_type: str, out: Path, seed: int = 1234) -> tuple[Path, str]:
    """Write ``arch``'s tiny checkpoint with the word-level tokenizer to ``out`` (once);
    return it and the dtype to serve it in."""
    dtype = "bfloat16" if arch in BF16 else "float32"
    if arch in FAMILY_OF:
        return make_tiny_family(FAMILY_OF[arch], out, seed=seed), dtype
    if arch == "DeepseekV2ForCausalLM":
        make_word_tokenizer(out)
        return make_tiny_deepseek(out, seed=seed), dtype
    stamp = out / "rd2h-sweep.json"
    recipe = json.dumps([BUILDER_VERSION, arch, SIZES, OVERRIDES.get(arch), CONFIG_EXTRAS.get(arch),
                         CONSTRUCT.get(arch), seed],
                        sort_keys=True, default=str)
    if stamp.exists() and json.loads(stamp.read_text()).get("recipe") == recipe:
        return out, dtype
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = tiny_config(arch, model_type)
    cls = getattr(transformers, arch)
    model = cls(cfg).to(torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    path = out / "config.json"
    saved = json.loads(path.read_text())
    derived = {k: v for k, v in _derived(saved).items()  # never over a computed property
               if not isinstance(getattr(type(model.config), k, None), property)}
    path.write_text(json.dumps({**saved, **derived, **CONFIG_EXTRAS.get(arch, {})},
                               indent=2))
    make_word_tokenizer(out)
    stamp.write_text(json.dumps({"arch": arch, "model_type": model_type, "recipe": recipe}))
    return out, dtype


if __name__ == "__main__":
    import sys

    arch = sys.argv[1]
    types = dict(registry()[0])
    print(make_checkpoint(arch, types[arch], Path(sys.argv[2]))[0], file=sys.stdout)
    os._exit(0)
