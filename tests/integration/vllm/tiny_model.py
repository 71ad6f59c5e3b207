"""Tiny random-weight checkpoints, made locally: Llama (standard attention, chunked
prefill on vLLM's CPU backend) and DeepSeek-V2 (MLA: the production cache shape, one
576-wide latent per token).

Both are served for real in the end-to-end tests. MLA needs ``servers.MLA_ARGS`` on
vLLM 0.32's CPU backend (the CPU rotary-embedding custom op is wrong for MLA's strided
views; see the README), and there chunked prefill and prefix caching are off.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

VOCAB = 1024
NUM_LAYERS = 4
MARKER = "rd2h-tiny-dsv2-v1"


def make_tiny_deepseek(path: str | os.PathLike[str], seed: int = 1234) -> Path:
    """Write the checkpoint to ``path`` once (idempotent); return the path."""
    out = Path(path)
    stamp = out / "rd2h-marker.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("marker") == MARKER:
        return out
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV2Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=NUM_LAYERS,
        max_position_embeddings=2048,
        initializer_range=0.2,
        torch_dtype="bfloat16",
        bos_token_id=0,
        eos_token_id=1,
    )
    model = DeepseekV2ForCausalLM(cfg).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps({"marker": MARKER}))
    return out


LLAMA_MARKER = "rd2h-tiny-llama-v1"


def make_tiny_llama(path: str | os.PathLike[str], seed: int = 1234) -> Path:
    """4 layers, GQA (4 query heads, 2 KV heads, head dim 64), vocab 1024."""
    out = Path(path)
    stamp = out / "rd2h-marker.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("marker") == LLAMA_MARKER:
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, max_position_embeddings=2048, initializer_range=0.2,
        torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps({"marker": LLAMA_MARKER}))
    return out


if __name__ == "__main__":
    print(make_tiny_deepseek(sys.argv[1] if len(sys.argv) > 1 else "/tmp/rd2h-tiny-dsv2"))
