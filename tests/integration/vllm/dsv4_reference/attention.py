"""Test-only PyTorch references for vLLM 0.32's DeepSeek-V4 CPU attention kernels.

NOT production code.  vLLM's DeepSeek-V4 CPU path calls two attention kernels that exist
only in its AVX512-BF16 library (``vllm/_C.abi3.so``), not in the AVX2 one
(``_C_AVX2``):

* ``torch.ops._C.fused_qnorm_rope_kv_insert_cpu`` -> ``fused_qnorm_rope_kv_insert_cpu``
* ``torch.ops._C.flash_mla_with_kvcache_cpu`` -> ``flash_mla_with_kvcache_cpu``

The functions here take the same arguments in the same order and have the same effects,
so a test-only patch can register them where the real kernels are missing.  The KV cache
bytes follow ``cache_format`` (vLLM's ``fp8_ds_mla`` layout), byte-compatible with the
real kernels.

Arithmetic is done in float64 and rounded where the real kernels round (bfloat16 outputs,
bfloat16 attention probabilities, float32 scores), so results stay within bf16 rounding
of the real kernels.  Every token's outputs depend only on that token's inputs and the
cache bytes it reads, never on the other tokens of the call.
"""

from __future__ import annotations

import torch

from . import cache_format as cf

ROPE_DIM = cf.ROPE_DIM
# The real attention kernel walks each slot list in blocks of this many keys, keeping
# an online softmax; the probabilities of a block are rounded to bfloat16 relative to
# the running maximum at that block, so the reference walks the same blocks.
KEY_BLOCK = 128
# Tokens per step of the reference attention (bounds memory; no effect on results).
_TOKEN_CHUNK = 32


def _gptj_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved (even, odd) pairs of ``x[..., 64]`` by angles with ``cos``/``sin``.

    ``cos``/``sin`` are ``[..., 32]`` and broadcast over ``x``'s middle dims.
    """
    pairs = x.reshape(*x.shape[:-1], ROPE_DIM // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.reshape(x.shape)


def _cos_sin(cos_sin_cache: torch.Tensor, positions: torch.Tensor):
    """Per-token ``cos``, ``sin`` (float64, ``[T, 32]``): cache rows are ``[cos | sin]``."""
    rows = cos_sin_cache[positions].double()
    return rows[:, : ROPE_DIM // 2], rows[:, ROPE_DIM // 2 : ROPE_DIM]


def fused_qnorm_rope_kv_insert_cpu(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    swa_kv_cache_2d: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_head_padded: int,
    eps: float,
    cache_block_size: int,
) -> torch.Tensor:
    """Reference for ``_C::fused_qnorm_rope_kv_insert_cpu``.

    Query ``[T, H, 512]``: per-head RMSNorm without weight (``x / sqrt(mean(x^2) + eps)``),
    then GPT-J (interleaved-pair) RoPE on dims 448..511 with ``cos_sin_cache[pos]`` =
    ``[cos(32) | sin(32)]``; returned as a new ``[T, q_head_padded, 512]`` tensor of q's
    dtype whose heads ``H..`` are zero.  KV ``[T', 512]``: the same RoPE (no norm), rounded
    to bfloat16, encoded into ``fp8_ds_mla`` and stored at ``slot_mapping`` (length
    ``T' <= T``, rows of ``kv`` beyond it ignored, negative slots skipped).
    """
    num_tokens, num_heads, head_dim = q.shape
    nope = head_dim - ROPE_DIM
    cos, sin = _cos_sin(cos_sin_cache, positions)

    x = q.double()
    inv_rms = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)
    x = x * inv_rms
    x[..., nope:] = _gptj_rope(x[..., nope:], cos[:, None, :], sin[:, None, :])
    q_out = torch.zeros((num_tokens, q_head_padded, head_dim), dtype=q.dtype)
    q_out[:, :num_heads] = x.float().to(q.dtype)

    num_insert = slot_mapping.shape[0]
    latent = kv[:num_insert].double()
    latent[:, nope:] = _gptj_rope(latent[:, nope:], cos[:num_insert], sin[:num_insert])
    records = cf.encode_fp8_ds_mla(latent.float())
    cf.write_tokens(swa_kv_cache_2d, slot_mapping, records, cache_block_size)
    return q_out


def _key_table(
    cache_2d: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode each distinct usable slot of ``slots`` ``[c, n]`` once.

    Returns ``table`` ``[U, 512]`` (float64; an all-zero row stands for unusable slots)
    and ``index`` ``[c, n]`` into it.
    """
    marked = torch.where(valid, slots, torch.full_like(slots, -1))
    unique, index = torch.unique(marked, return_inverse=True)
    records = cf.read_tokens(cache_2d, unique.clamp(min=0), block_size)
    table = cf.decode_fp8_ds_mla(records).double()
    table[unique < 0] = 0.0
    return table, index


def _attend_chunk(
    q: torch.Tensor,
    sources: list[tuple[torch.Tensor, torch.Tensor, int]],
    attn_sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention for a few tokens ``q`` ``[c, H, 512]``; returns bfloat16 ``[c, H, 512]``."""
    c, num_heads, head_dim = q.shape
    qd = q.double()
    scale32 = torch.tensor(scale, dtype=torch.float32)
    neg_inf = float("-inf")
    m = torch.full((c, num_heads), neg_inf, dtype=torch.float64)
    denom = torch.zeros((c, num_heads), dtype=torch.float64)
    acc = torch.zeros((c, num_heads, head_dim), dtype=torch.float64)

    for cache_2d, slots, block_size in sources:
        total = cache_2d.shape[0] * block_size
        for n0 in range(0, slots.shape[1], KEY_BLOCK):
            block = slots[:, n0 : n0 + KEY_BLOCK]
            valid = (block >= 0) & (block < total)
            used = valid.any(dim=0)  # drop columns no token of the chunk uses
            if not bool(used.any()):
                continue
            block, valid = block[:, used], valid[:, used]
            table, index = _key_table(cache_2d, block, valid, block_size)
            index = index[:, None, :].expand(c, num_heads, index.shape[1])
            # Scores: float32 dot products (of bfloat16-exact values) times the scale.
            dots = torch.matmul(qd, table.T).gather(-1, index)  # [c, H, n]
            scores = (dots.float() * scale32).double()
            scores = scores.masked_fill(~valid[:, None, :], neg_inf)
            m_new = torch.maximum(m, scores.amax(dim=-1))
            live = torch.isfinite(m_new)
            safe_m = torch.where(live, m_new, torch.zeros_like(m_new))
            probs = torch.exp(scores - safe_m[..., None])  # 0 for masked keys
            rescale = torch.where(live, torch.exp(m - safe_m), torch.ones_like(m))
            denom = denom * rescale + probs.sum(dim=-1)
            # The kernel multiplies bfloat16 probabilities with the bfloat16 values.
            probs_bf16 = probs.to(torch.bfloat16).double()
            weights = torch.zeros((c, num_heads, table.shape[0]), dtype=torch.float64)
            weights.scatter_add_(-1, index, probs_bf16)
            acc = acc * rescale[..., None] + torch.matmul(weights, table)
            m = torch.where(live, m_new, m)

    lonely = ~torch.isfinite(m) | (denom == 0)
    safe_denom = torch.where(lonely, torch.ones_like(denom), denom)
    lse = m + torch.log(safe_denom)
    sink = attn_sink.double()[None, :]
    correction = 1.0 / (1.0 + torch.exp(sink - lse))
    factor = torch.where(lonely, torch.zeros_like(denom), correction / safe_denom)
    return (acc * factor[..., None]).float().to(torch.bfloat16)


def flash_mla_with_kvcache_cpu(
    out: torch.Tensor,
    q: torch.Tensor,
    window_cache_2d: torch.Tensor,
    window_slots: torch.Tensor,
    window_block_size: int,
    compressed_cache_2d: torch.Tensor,
    compressed_slots: torch.Tensor,
    compressed_block_size: int,
    attn_sink: torch.Tensor,
    scale: float,
) -> None:
    """Reference for ``_C::flash_mla_with_kvcache_cpu``; writes bfloat16 ``out`` in place.

    MQA over one shared 512-wide latent: for token ``t`` and head ``h`` the keys are the
    ``fp8_ds_mla`` latents at ``window_slots[t]`` (window cache) and
    ``compressed_slots[t]`` (compressed cache; ignored when it has 0 columns); a slot is
    used iff ``0 <= slot < num_blocks * block_size``.  Values are the same latents (all
    512 dims).  ``out = softmax(scale * q.k) @ v * 1 / (1 + exp(attn_sink[h] - lse))``,
    i.e. the sink is an extra zero-valued key with logit ``attn_sink[h]``.  A
    (token, head) with no usable key gets zeros.
    """
    sources = [(window_cache_2d, window_slots, window_block_size)]
    if compressed_slots.shape[1] > 0:
        sources.append((compressed_cache_2d, compressed_slots, compressed_block_size))
    for t0 in range(0, q.shape[0], _TOKEN_CHUNK):
        t1 = t0 + _TOKEN_CHUNK
        chunk_sources = [(cache, slots[t0:t1], bs) for cache, slots, bs in sources]
        out[t0:t1] = _attend_chunk(q[t0:t1], chunk_sources, attn_sink, scale)
