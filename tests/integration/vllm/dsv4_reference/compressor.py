"""TEST-ONLY PyTorch stand-ins for vLLM 0.32's DeepSeek-V4 compressor kernels.

They replace, where vLLM's AVX512-BF16 library is absent, the three ops that
``vllm/models/deepseek_v4/cpu/cpu_compressor.py`` calls:

* ``save_partial_states_cpu``: stores each token's raw KV and (score + APE) into the
  compressor's float32 state cache;
* ``compress_norm_rope_store_cpu``: for every token that closes a compression window,
  softmax-pools the window's states, RMS-normalizes, applies RoPE and stores the result
  into a compressed KV cache in the ``fp8_ds_mla`` format (see ``cache_format``);
* ``compress_norm_rope_store_indexer_cpu``: the same for the indexer's 128-wide keys,
  stored in the indexer cache format described below.

State cache (float32 ``[num_blocks, block_tokens, 2 * W]``, ``W = kv.shape[1]``): a row is
``[kv (W) | score + ape[position % ratio] (W)]``. With overlapping windows (ratio 4) a
token's ``kv`` holds two ``head_dim`` halves: the first half serves the window after
the one the token belongs to (its "previous window" role), the second half its own
window. Rows are addressed as ``(slot // block_tokens, slot % block_tokens)`` of the
tensor, so a block stride larger than ``block_tokens * 2W`` (pooled pages) is honoured.

Pooling (per token whose ``(position + 1) % ratio == 0`` and whose ``kv_slot_mapping``
entry is ``>= 0``; other tokens write nothing): ``gather_slots[t]`` lists the state slots
of the window ``position - window + 1 .. position`` (``-1`` = absent, skipped); entry
``w`` reads the half at column offset ``head_dim`` if ``w >= ratio`` else ``0``. The
softmax runs per channel over the window. RMSNorm multiplies by ``1/sqrt(mean(x^2) +
eps)`` then by the weight. RoPE (GPT-J, interleaved pairs) rotates the last 64 channels
at position ``(position // ratio) * ratio`` with ``cos_sin_cache[p] = [cos(32) | sin(32)]``.

Indexer cache (uint8 ``[num_blocks, >= block_size * 132]``, 132 bytes a token): within a
block all tokens' 128 fp8 e4m3 bytes come first (token ``i`` at ``i * 128``), then one
raw little-endian float32 scale per token (at ``block_size * 128 + i * 4``). The key is
rounded to bf16 (after RoPE), ``scale = 2 ** ceil(log2(max(amax, 1e-4) / 448))`` and the
fp8 values are ``clamp(key / scale, -448, 448)`` rounded to nearest even (real
subnormals kept); a key reads back as ``fp8 * scale``.

Arithmetic: float64 where the kernel reduces (window softmax, sum of squares), rounded to
float32 where the kernel keeps float32 and to bf16 where it stores bf16, so a token's
bytes depend only on its own state rows, never on the other tokens of the call. Against
the real kernels (float32 throughout, vectorized ``exp``) about one stored byte in 10^5
differs, by one fp8 or bf16 rounding step.
"""

from __future__ import annotations

import torch

from .cache_format import encode_fp8_ds_mla, write_tokens

ROPE_DIM = 64
FP8_MAX = 448.0
INDEXER_HEAD_DIM = 128
INDEXER_TOKEN_BYTES = INDEXER_HEAD_DIM + 4  # 128 fp8 values + one float32 scale


# ----------------------------------------------------------------------------------------
# Indexer cache format
# ----------------------------------------------------------------------------------------


def _ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(v))`` for positive float tensors (integer-valued float32)."""
    mantissa, exponent = torch.frexp(v.to(torch.float64))  # v = mantissa * 2**exponent
    return (exponent - (mantissa == 0.5).to(exponent.dtype)).to(torch.float32)


def encode_indexer_fp8(k: torch.Tensor) -> torch.Tensor:
    """``[T, 128]`` keys -> ``[T, 132]`` uint8: 128 fp8 e4m3 bytes then the float32 scale.

    The key is first rounded to bf16 (as the kernel does); the scale is the power of two
    ``2 ** ceil(log2(max(amax, 1e-4) / 448))``, stored raw (not as an exponent byte)."""
    x = k.to(torch.bfloat16).to(torch.float32)
    amax = x.abs().amax(dim=-1).clamp(min=1e-4)
    scale = torch.exp2(_ceil_log2(amax / FP8_MAX))  # float32 division, as the kernel
    q = (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scale_bytes = scale.to(torch.float32).contiguous().view(torch.uint8).view(-1, 4)
    return torch.cat([q.view(torch.uint8), scale_bytes], dim=-1)


def decode_indexer_fp8(raw: torch.Tensor) -> torch.Tensor:
    """``[T, 132]`` uint8 -> ``[T, 128]`` float32 keys (``fp8 * scale``)."""
    raw = raw.contiguous()
    values = raw[:, :INDEXER_HEAD_DIM].view(torch.float8_e4m3fn).to(torch.float32)
    scale = raw[:, INDEXER_HEAD_DIM:].contiguous().view(torch.float32)  # [T, 1]
    return values * scale


def _indexer_columns(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, ...]:
    """Block index and the byte columns of each slot's data and scale in its block."""
    block = torch.div(slots, block_size, rounding_mode="floor")
    pos = slots % block_size
    data = pos[:, None] * INDEXER_HEAD_DIM + torch.arange(INDEXER_HEAD_DIM)
    scale = block_size * INDEXER_HEAD_DIM + pos[:, None] * 4 + torch.arange(4)
    return block[:, None], torch.cat([data, scale], dim=-1)


def write_indexer_tokens(
    cache_2d: torch.Tensor, slots: torch.Tensor, token_bytes: torch.Tensor, block_size: int
) -> None:
    """Write ``[T, 132]`` token bytes into the indexer cache in place; slots < 0 skipped."""
    keep = slots >= 0
    block, cols = _indexer_columns(slots[keep].to(torch.int64), block_size)
    cache_2d[block, cols] = token_bytes[keep].to(torch.uint8)


def read_indexer_tokens(
    cache_2d: torch.Tensor, slots: torch.Tensor, block_size: int
) -> torch.Tensor:
    """The ``[T, 132]`` bytes (fp8 data, then float32 scale) of the given slots."""
    block, cols = _indexer_columns(slots.to(torch.int64), block_size)
    return cache_2d[block, cols]


# ----------------------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------------------


def save_partial_states_cpu(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    state_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``state_cache[slot] = [kv[t] | score[t] + ape[positions[t] % ratio]]`` in float32,
    ``ratio = ape.shape[0]``, for every token whose slot is ``>= 0``."""
    width = kv.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_tokens = state_cache.shape[1]
    block = torch.div(slots, block_tokens, rounding_mode="floor")
    pos = slots % block_tokens
    scored = score[keep] + ape[positions[keep] % ape.shape[0]]
    state_cache[block, pos, :width] = kv[keep]
    state_cache[block, pos, width:] = scored


def _f32(x: torch.Tensor) -> torch.Tensor:
    """Round to float32 and continue in float64 (a float32 rounding point of the kernel)."""
    return x.to(torch.float32).to(torch.float64)


def _pool_norm_rope(
    state_cache: torch.Tensor,
    gather_slots: torch.Tensor,
    positions: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
    rms_norm_weight: torch.Tensor,
    rms_norm_eps: float,
    cos_sin_cache: torch.Tensor,
    compress_ratio: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The storing tokens' index and their float32 ``[N, head_dim]`` keys after pooling,
    RMSNorm and RoPE (the float32 values the kernel then rounds to bf16)."""
    rows = torch.nonzero(
        ((positions + 1) % compress_ratio == 0) & (kv_slot_mapping >= 0)
    ).flatten()
    slots = gather_slots[rows].to(torch.int64)  # [N, window]
    window = slots.shape[1]
    width = state_cache.shape[2] // 2
    valid = slots >= 0
    safe = slots.clamp(min=0)
    block_tokens = state_cache.shape[1]
    states = state_cache[torch.div(safe, block_tokens, rounding_mode="floor"), safe % block_tokens]
    # Entry w reads the second head_dim half of its state row when w >= ratio.
    half = (torch.arange(window) >= compress_ratio).to(torch.int64) * head_dim
    cols = half[:, None] + torch.arange(head_dim)  # [window, head_dim]
    cols = cols.expand(len(rows), window, head_dim)
    kv = torch.gather(states, 2, cols).to(torch.float64)
    score = torch.gather(states, 2, cols + width).to(torch.float64)
    score = torch.where(valid[..., None], score, float("-inf"))
    kv = torch.where(valid[..., None], kv, 0.0)

    # Per-channel softmax over the window, accumulated in window order.
    peak = score.amax(dim=1)
    denom = torch.zeros_like(peak)
    acc = torch.zeros_like(peak)
    for w in range(window):
        e = torch.exp(score[:, w] - peak)
        denom = denom + e
        acc = acc + e * kv[:, w]
    pooled = _f32(acc / denom)

    # RMSNorm: the kernel keeps 1/rms in float32 and rounds after each product.
    inv_rms = _f32(1.0 / torch.sqrt((pooled * pooled).sum(dim=-1) / head_dim + rms_norm_eps))
    normed = _f32(_f32(pooled * inv_rms[:, None]) * rms_norm_weight.to(torch.float64))

    # GPT-J RoPE on the last 64 channels at the window's first position; each output is
    # fma(x, cos, round(x_other * +-sin)) in float32.
    start = torch.div(positions[rows], compress_ratio, rounding_mode="floor") * compress_ratio
    cos_sin = cos_sin_cache[start].to(torch.float64)
    cos, sin = cos_sin[:, : ROPE_DIM // 2], cos_sin[:, ROPE_DIM // 2 :]
    even, odd = normed[:, -ROPE_DIM::2], normed[:, -ROPE_DIM + 1 :: 2]
    rot_even = even * cos + _f32(-odd * sin)
    rot_odd = odd * cos + _f32(even * sin)
    rope = torch.stack([rot_even, rot_odd], dim=-1).flatten(-2)
    out = torch.cat([normed[:, :-ROPE_DIM], rope], dim=-1).to(torch.float32)
    return rows, out


def compress_norm_rope_store_cpu(
    state_cache: torch.Tensor,
    gather_slots: torch.Tensor,
    positions: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
    rms_norm_weight: torch.Tensor,
    rms_norm_eps: float,
    cos_sin_cache: torch.Tensor,
    kv_cache_2d: torch.Tensor,
    kv_cache_block_size: int,
    compress_ratio: int,
) -> None:
    """Pool -> RMSNorm -> RoPE -> ``fp8_ds_mla`` store of the 512-wide compressed key for
    every token closing a window (ratio 4: window 8 over two state halves; ratio 128:
    window 128). The key goes to bf16 and is encoded by ``cache_format``: 448 NoPE values
    as fp8 with one UE8M0 scale per 64 (e4m3 subnormals kept, unlike the SWA insert,
    which flushes them), the 64 RoPE values as bf16."""
    rows, key = _pool_norm_rope(
        state_cache, gather_slots, positions, kv_slot_mapping, rms_norm_weight,
        rms_norm_eps, cos_sin_cache, compress_ratio, head_dim=512,
    )
    if len(rows) == 0:
        return
    token_bytes = encode_fp8_ds_mla(key.to(torch.bfloat16), flush_subnormals=False)
    write_tokens(kv_cache_2d, kv_slot_mapping[rows], token_bytes, kv_cache_block_size)


def compress_norm_rope_store_indexer_cpu(
    state_cache: torch.Tensor,
    gather_slots: torch.Tensor,
    positions: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
    rms_norm_weight: torch.Tensor,
    rms_norm_eps: float,
    cos_sin_cache: torch.Tensor,
    kv_cache_2d: torch.Tensor,
    kv_cache_block_size: int,
    compress_ratio: int,
) -> None:
    """Pool -> RMSNorm -> RoPE -> indexer-cache store of the 128-wide compressed key for
    every token closing a window (ratio 4, window 8). The whole post-RoPE key is rounded
    to bf16 and quantized as one block (``encode_indexer_fp8``)."""
    rows, key = _pool_norm_rope(
        state_cache, gather_slots, positions, kv_slot_mapping, rms_norm_weight,
        rms_norm_eps, cos_sin_cache, compress_ratio, head_dim=INDEXER_HEAD_DIM,
    )
    if len(rows) == 0:
        return
    write_indexer_tokens(
        kv_cache_2d, kv_slot_mapping[rows], encode_indexer_fp8(key), kv_cache_block_size
    )
