"""Test-only PyTorch model of vLLM 0.32's ``fp8_ds_mla`` KV-cache byte format on CPU.

This is NOT production code.  It stands for the cache encoding that vLLM's DeepSeek-V4
CPU kernels (``vllm/_C.abi3.so``, built for AVX512-BF16 only) write and read:
``fused_qnorm_rope_kv_insert_cpu`` and ``compress_norm_rope_store_cpu`` write it,
``flash_mla_with_kvcache_cpu`` reads it.  The reference kernels in this package use it so
that a cache written by a real kernel can be read by a reference one and vice versa.

One token is a 512-wide latent: 448 "nope" dims followed by 64 rope dims.  It occupies
584 bytes, but NOT contiguously: a paged block of ``block_size`` tokens is laid out as

* bytes ``[0, block_size * 576)``: per-token data, token ``i`` at ``i * 576``:

  - ``+0 .. +448``: the nope dims as float8_e4m3fn codes, one byte each;
  - ``+448 .. +576``: the rope dims as bfloat16, little-endian (64 x 2 bytes);

* bytes ``[block_size * 576, block_size * 584)``: per-token scales, token ``i`` at
  ``block_size * 576 + i * 8``: seven UE8M0 scale bytes (one per 64-wide nope tile,
  value ``2 ** (byte - 127)``) and one zero pad byte.

A block is one row of the 2-D ``uint8`` cache view; addressing uses offsets inside the
row, so a row may be wider than ``block_size * 584`` (page-aligned pools).  Slot ``s``
lives in row ``s // block_size`` at position ``s % block_size``.

Encoding (what the kernels do, confirmed against the real ops on an AVX512-BF16 CPU):
the latent is first rounded to bfloat16; per 64-wide nope tile,
``scale = 2 ** ceil(log2(max(amax / 448, 1e-4)))`` and each value ``x / scale`` (clamped to
+-448) is rounded to nearest-even e4m3.  ``fused_qnorm_rope_kv_insert_cpu`` flushes results
below the smallest normal e4m3 (``2 ** -6``) to a signed zero byte (``0x00``/``0x80``); the
compressor kernels keep exact e4m3 subnormals instead (``flush_subnormals=False``).

Decoding (what ``flash_mla_with_kvcache_cpu`` reads): the real kernel expands an e4m3
byte into bfloat16 by bit placement, treating every byte as a normal number: a byte with
exponent field ``E`` and mantissa ``M`` reads as ``+-2 ** (E - 7) * (1 + M / 8)``, so a
zero byte reads as ``+-2 ** -7`` and subnormals as ``2 ** -7 * (1 + M / 8)``, never as
zero.  Multiplied by the tile scale (a scale byte of 0 reads as 0) this is exactly
representable in bfloat16; ``decode_fp8_ds_mla`` returns these values, so the round trip
``decode(encode(x))`` is ``x`` within e4m3 precision (relative 2 ** -4 per element, plus
an absolute ``2 ** -6 * scale`` for elements that encode to zero or a subnormal).
"""

from __future__ import annotations

import torch

NOPE_DIM = 448
ROPE_DIM = 64
HEAD_DIM = NOPE_DIM + ROPE_DIM
TILE = 64
NUM_TILES = NOPE_DIM // TILE
DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576: e4m3 nope + bf16 rope, per token
SCALE_BYTES = NUM_TILES + 1  # 8: seven UE8M0 scales + one zero pad byte, per token
TOKEN_BYTES = DATA_BYTES + SCALE_BYTES  # 584

FP8_MAX = 448.0
SCALE_FLOOR = 1e-4
_SMALLEST_NORMAL = 2.0**-6
_SMALLEST_FLOAT32_NORMAL = 2.0**-126


def _to_e4m3_bytes(x: torch.Tensor, flush_subnormals: bool) -> torch.Tensor:
    """Round float32 values already clamped to +-448 to e4m3fn codes (as uint8)."""
    codes = x.to(torch.float8_e4m3fn).view(torch.uint8)
    if flush_subnormals:
        sign = torch.signbit(x).to(torch.uint8) << 7
        codes = torch.where(x.abs() < _SMALLEST_NORMAL, sign, codes)
    return codes


def tile_scale_exponents(nope: torch.Tensor) -> torch.Tensor:
    """Per-tile power-of-two exponents ``ceil(log2(max(amax / 448, 1e-4)))``.

    ``nope`` is ``[T, 448]`` holding bfloat16-exact values; returns ``[T, 7]`` int64.
    The division is done in float32 as the kernel does; for bfloat16 inputs ``amax / 448``
    is never within rounding distance of a power of two, so ``ceil(log2(.))`` is exact.
    """
    amax = nope.float().abs().reshape(nope.shape[0], NUM_TILES, TILE).amax(-1)
    ratio = torch.clamp(amax / FP8_MAX, min=SCALE_FLOOR)
    return torch.ceil(torch.log2(ratio.double())).to(torch.int64)


def encode_fp8_ds_mla(kv: torch.Tensor, *, flush_subnormals: bool = True) -> torch.Tensor:
    """Encode latents ``[T, 512]`` (float32 or bfloat16) into their ``[T, 584]`` bytes.

    The returned row is the token's logical record: 576 data bytes (448 e4m3 codes, then
    64 little-endian bfloat16 rope values) followed by 8 scale bytes (7 UE8M0 + a zero
    pad).  ``write_tokens`` scatters it into the split block layout.  Values are rounded
    to bfloat16 first, as the kernels do.  ``flush_subnormals=True`` is
    ``fused_qnorm_rope_kv_insert_cpu``'s rounding; the compressor kernels use ``False``.
    """
    if kv.dim() != 2 or kv.shape[1] != HEAD_DIM:
        raise ValueError(f"expected [T, {HEAD_DIM}] latents, got {tuple(kv.shape)}")
    t = kv.shape[0]
    x = kv.to(torch.bfloat16)
    nope = x[:, :NOPE_DIM].float()
    exps = tile_scale_exponents(nope)  # [T, 7]
    inv_scale = torch.pow(2.0, -exps.double()).float()  # exact powers of two
    scaled = nope.reshape(t, NUM_TILES, TILE) * inv_scale[..., None]
    scaled = scaled.clamp(-FP8_MAX, FP8_MAX).reshape(t, NOPE_DIM)
    out = torch.empty((t, TOKEN_BYTES), dtype=torch.uint8)
    out[:, :NOPE_DIM] = _to_e4m3_bytes(scaled, flush_subnormals)
    out[:, NOPE_DIM:DATA_BYTES] = x[:, NOPE_DIM:].contiguous().view(torch.uint8)
    out[:, DATA_BYTES : DATA_BYTES + NUM_TILES] = (exps + 127).to(torch.uint8)
    out[:, DATA_BYTES + NUM_TILES] = 0
    return out


def _e4m3_as_read_by_kernel(codes: torch.Tensor) -> torch.Tensor:
    """What the real kernel's bit-placement expansion makes of e4m3 codes (float32).

    Every code reads as a normal number ``+-2 ** (E - 7) * (1 + M / 8)``; ``E = 0`` codes
    (zero and subnormals) are not special-cased.
    """
    c = codes.to(torch.int32)
    exponent = ((c >> 3) & 0xF).float()
    mantissa = (c & 0x7).float()
    magnitude = torch.pow(2.0, exponent - 7.0) * (1.0 + mantissa / 8.0)
    return torch.where((c & 0x80) != 0, -magnitude, magnitude)


def decode_fp8_ds_mla(raw: torch.Tensor) -> torch.Tensor:
    """Decode ``[T, 584]`` token bytes into the ``[T, 512]`` float32 latent the kernel reads.

    Nope dims: the kernel's reading of the e4m3 code (see the module docstring: a zero
    code reads as ``+-2 ** -7``) times ``2 ** (scale_byte - 127)`` (scale byte 0 -> 0,
    0xFF -> NaN, results below ``2 ** -126`` -> 0; the kernels only write scale bytes
    114..136); rope dims: the stored bfloat16.  All results are bfloat16-exact.
    """
    if raw.dim() != 2 or raw.shape[1] != TOKEN_BYTES or raw.dtype != torch.uint8:
        raise ValueError(f"expected [T, {TOKEN_BYTES}] uint8 rows, got {tuple(raw.shape)}")
    t = raw.shape[0]
    values = _e4m3_as_read_by_kernel(raw[:, :NOPE_DIM]).reshape(t, NUM_TILES, TILE)
    sbytes = raw[:, DATA_BYTES : DATA_BYTES + NUM_TILES].to(torch.int32)
    scale = torch.pow(2.0, (sbytes - 127).float())
    scale = torch.where(sbytes == 0, torch.zeros_like(scale), scale)
    scale = torch.where(sbytes == 0xFF, torch.full_like(scale, float("nan")), scale)
    nope = (values * scale[..., None]).reshape(t, NOPE_DIM)
    # The kernel's float32 -> bfloat16 step flushes denormals (below 2 ** -126) to zero.
    nope = torch.where(nope.abs() < _SMALLEST_FLOAT32_NORMAL, torch.zeros_like(nope), nope)
    out = torch.empty((t, HEAD_DIM), dtype=torch.float32)
    out[:, :NOPE_DIM] = nope
    rope = raw[:, NOPE_DIM:DATA_BYTES].contiguous().view(torch.bfloat16)
    out[:, NOPE_DIM:] = rope.float()
    return out


def _byte_columns(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row index ``[T, 1]`` and in-row byte columns ``[T, 584]`` of each slot's record."""
    rows = torch.div(slots, block_size, rounding_mode="floor")
    pos = slots - rows * block_size
    data_cols = pos[:, None] * DATA_BYTES + torch.arange(DATA_BYTES)
    scale_cols = block_size * DATA_BYTES + pos[:, None] * SCALE_BYTES + torch.arange(SCALE_BYTES)
    return rows[:, None], torch.cat([data_cols, scale_cols], dim=1)


def write_tokens(
    cache_2d: torch.Tensor, slots: torch.Tensor, token_bytes: torch.Tensor, block_size: int
) -> None:
    """Store ``[T, 584]`` token records at ``slots`` (in place; negative slots skipped).

    ``cache_2d`` is the ``[num_blocks, >= block_size * 584]`` uint8 view of a paged cache;
    data bytes go to ``pos * 576`` and scale bytes to ``block_size * 576 + pos * 8`` of
    the slot's row.
    """
    slots = slots.reshape(-1).to(torch.int64)
    keep = slots >= 0
    if not bool(keep.any()):
        return
    rows, cols = _byte_columns(slots[keep], block_size)
    cache_2d[rows, cols] = token_bytes[keep].to(torch.uint8)


def read_tokens(cache_2d: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """Gather the ``[T, 584]`` token records stored at ``slots`` (all must be valid)."""
    slots = slots.reshape(-1).to(torch.int64)
    if slots.numel() == 0:
        return torch.empty((0, TOKEN_BYTES), dtype=torch.uint8)
    rows, cols = _byte_columns(slots, block_size)
    return cache_2d[rows, cols]
