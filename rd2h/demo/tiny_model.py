"""Tiny random-weight checkpoints, made locally: Llama (standard attention, chunked
prefill on vLLM's CPU backend) and DeepSeek-V2 (MLA: the production cache shape, one
576-wide latent per token), and a word-level tokenizer over their vocabulary.

Both models are served for real in the end-to-end tests and the serving benchmark. MLA
needs ``MLA_ARGS`` (tests/integration/vllm/servers.py) on vLLM 0.32's CPU backend (the
CPU rotary-embedding custom op is wrong for MLA's strided views; see docs/guide/vllm.md), and
there chunked prefill and prefix caching are off.

torch, transformers and tokenizers are imported inside the builders only.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

VOCAB = 1024
NUM_LAYERS = 4
MARKER = "rd2h-tiny-dsv2-v1"


def _built(out: Path, marker: str) -> bool:
    """A checkpoint with ``marker`` is already at ``out``."""
    stamp = out / "rd2h-marker.json"
    return stamp.exists() and json.loads(stamp.read_text()).get("marker") == marker


def _save(model: object, out: Path, marker: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)  # type: ignore[attr-defined]
    (out / "rd2h-marker.json").write_text(json.dumps({"marker": marker}))
    return out


def make_tiny_deepseek(path: str | os.PathLike[str], seed: int = 1234) -> Path:
    """Write the checkpoint to ``path`` once (idempotent); return the path."""
    out = Path(path)
    if _built(out, MARKER):
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
    return _save(DeepseekV2ForCausalLM(cfg).to(torch.bfloat16), out, MARKER)


LLAMA_MARKER = "rd2h-tiny-llama-v1"


def make_tiny_llama(path: str | os.PathLike[str], seed: int = 1234) -> Path:
    """4 layers, GQA (4 query heads, 2 KV heads, head dim 64), vocab 1024."""
    out = Path(path)
    if _built(out, LLAMA_MARKER):
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
    return _save(LlamaForCausalLM(cfg).to(torch.bfloat16), out, LLAMA_MARKER)


KV_HEAVY_MARKER = "rd2h-kv-heavy-llama-v1"
# The KV-heavy Llama's shape: KV per token (float32) = layers x 2 x kv_heads x head_dim x 4
# bytes = 16 KiB, so a 4,096-token prompt holds 64 MiB of KV, a transfer of tens of
# milliseconds, while its prefill stays within seconds on one CPU thread.
KV_HEAVY = {"layers": 8, "kv_heads": 4, "head_dim": 64, "max_positions": 8192}


def kv_bytes_per_token(dtype_bytes: int = 4, **shape: int) -> int:
    """KV bytes per token of the KV-heavy Llama (or of ``shape``'s overrides)."""
    s = {**KV_HEAVY, **shape}
    return s["layers"] * 2 * s["kv_heads"] * s["head_dim"] * dtype_bytes


def make_kv_heavy_llama(path: str | os.PathLike[str], seed: int = 1234) -> Path:
    """A Llama whose KV per token is large for its compute (``KV_HEAVY``: 8 layers, as
    many KV heads as query heads, head dim 64, 8,192 positions), for serving benchmarks
    at long prompts; saved in float32 (vLLM serves it with ``--dtype float32``)."""
    out = Path(path)
    if _built(out, KV_HEAVY_MARKER):
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    heads = KV_HEAVY["kv_heads"]
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=heads * KV_HEAVY["head_dim"], intermediate_size=512,
        num_hidden_layers=KV_HEAVY["layers"], num_attention_heads=heads,
        num_key_value_heads=heads, head_dim=KV_HEAVY["head_dim"],
        max_position_embeddings=KV_HEAVY["max_positions"], initializer_range=0.2,
        torch_dtype="float32", bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    )
    return _save(LlamaForCausalLM(cfg).to(torch.float32), out, KV_HEAVY_MARKER)


TOKENIZER_MARKER = "rd2h-word-tokenizer-v1"
BOS, EOS, UNK = "<s>", "</s>", "<unk>"  # ids 0, 1, 2 (the checkpoints' bos 0 / eos 1)


def word(token_id: int) -> str:
    """The word of a non-special id: ``w<id>``."""
    return f"w{token_id}"


def make_word_tokenizer(path: str | os.PathLike[str], vocab: int = VOCAB,
                        max_length: int = 2048) -> Path:
    """Save a word-level tokenizer beside the checkpoint at ``path`` (idempotent).

    One word per id: ``<s>`` (0, bos), ``</s>`` (1, eos), ``<unk>`` (2), then ``w3`` ..
    ``w<vocab-1>``; words are split on whitespace and decoded joined by single spaces,
    no special tokens are added on encode. So decoding any ids and encoding the text
    again gives the same ids back (as long as no special id is among them), which vLLM's
    random benchmark prompts rely on (they are random ids decoded to text, re-encoded by
    the server). ``max_length``: the longest text it is meant for (the model's
    positions)."""
    out = Path(path)
    stamp = out / "rd2h-tokenizer-marker.json"
    want = {"marker": TOKENIZER_MARKER, "vocab": vocab}
    if max_length != 2048:
        want["max_length"] = max_length
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return out
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {BOS: 0, EOS: 1, UNK: 2, **{word(i): i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([BOS, EOS, UNK])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    specials = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", **specials,
        "model_max_length": max_length, "clean_up_tokenization_spaces": False,
        "add_bos_token": False, "add_eos_token": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=1))
    stamp.write_text(json.dumps(want))
    return out


if __name__ == "__main__":
    print(make_tiny_deepseek(sys.argv[1] if len(sys.argv) > 1 else "/tmp/rd2h-tiny-dsv2"))
