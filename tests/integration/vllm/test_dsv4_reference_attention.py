"""The test-only DeepSeek-V4 attention references against vLLM 0.32's real CPU kernels.

``dsv4_reference.cache_format`` models the ``fp8_ds_mla`` KV-cache bytes and
``dsv4_reference.attention`` stands for ``fused_qnorm_rope_kv_insert_cpu`` and
``flash_mla_with_kvcache_cpu``, which exist only in vLLM's AVX512-BF16 library.  Where
that library loads, every reference is compared with the real op on the tiny model's
shapes (16 heads x 512, rope 64, 64-token blocks).  The remaining tests run on any CPU:
token-row invariance and hand-checkable cases.
"""

from __future__ import annotations

import math

import pytest
import torch
from dsv4_reference import attention, cache_format

pytestmark = pytest.mark.integration

HEADS = 16
HEAD_DIM = 512
BLOCK = 64
WINDOW = 128
EPS = 1e-6
SCALE = HEAD_DIM**-0.5


def _real_ops_loaded() -> bool:
    try:
        from vllm.platforms import current_platform

        current_platform.import_kernels()
    except Exception:
        return False
    return all(
        hasattr(torch.ops._C, name)
        for name in ("fused_qnorm_rope_kv_insert_cpu", "flash_mla_with_kvcache_cpu")
    )


REAL = _real_ops_loaded()
needs_real = pytest.mark.skipif(
    not REAL,
    reason="vLLM's DeepSeek-V4 CPU kernels (vllm/_C.abi3.so) need AVX512-BF16",
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _cos_sin_cache(max_pos: int = 4096, theta: float = 10000.0) -> torch.Tensor:
    """``[max_pos, 64]`` float32 rows ``[cos(32) | sin(32)]``, as vLLM's rotary embedding."""
    inv_freq = 1.0 / theta ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float().contiguous()


def _latents(n: int, gen: torch.Generator) -> torch.Tensor:
    """Latent rows of varied magnitude, some with zero tiles and near-zero values."""
    x = torch.randn(n, HEAD_DIM, generator=gen) * torch.rand(n, 1, generator=gen).mul(4)
    x[::5, :64] = 0.0
    x[1::7, 64:128] *= 1e-3
    x[2::9, 100] = 1e-30
    return x


def _q(n: int, gen: torch.Generator, heads: int = HEADS) -> torch.Tensor:
    return (torch.randn(n, heads, HEAD_DIM, generator=gen) * 3).bfloat16()


def _filled_cache(num_blocks: int, block_size: int, gen: torch.Generator, **kw) -> torch.Tensor:
    """A cache whose every slot holds a validly encoded random latent."""
    cache = torch.zeros(num_blocks, block_size * cache_format.TOKEN_BYTES, dtype=torch.uint8)
    slots = torch.arange(num_blocks * block_size)
    records = cache_format.encode_fp8_ds_mla(_latents(slots.numel(), gen), **kw)
    cache_format.write_tokens(cache, slots, records, block_size)
    return cache


def _window_slots(positions: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The model's window slots: the last 128 positions (``-1`` before 0) via a block table."""
    local = positions[:, None] - WINDOW + 1 + torch.arange(WINDOW)
    blocks = block_table[local.clamp(min=0) // BLOCK]
    return torch.where(local >= 0, blocks * BLOCK + local % BLOCK, -1)


def _compressed_slots(positions: torch.Tensor, width: int, block_size: int, ratio: int):
    """The model's short-context compressed slots: indices ``0..(pos+1)//ratio-1`` in
    order, ``-1`` after, in a compressed cache whose block ``b`` is the table's ``b + 1``."""
    local = torch.arange(width)[None, :].expand(positions.numel(), width)
    used = local < torch.div(positions + 1, ratio, rounding_mode="floor")[:, None]
    return torch.where(used, (local // block_size + 1) * block_size + local % block_size, -1)


def _attention_case(num_tokens: int, start: int, seed: int, compressed: bool):
    """Arguments of one ``flash_mla_with_kvcache_cpu`` call shaped like the tiny model's."""
    gen = _gen(seed)
    positions = torch.arange(start, start + num_tokens)
    nblocks = (start + num_tokens + BLOCK - 1) // BLOCK + 1
    block_table = torch.randperm(nblocks, generator=gen)
    window_cache = _filled_cache(nblocks, BLOCK, gen)
    if compressed:
        cblock = BLOCK // 4
        width = 512
        comp_cache = _filled_cache(width // cblock + 1, cblock, gen, flush_subnormals=False)
        comp_slots = _compressed_slots(positions, width, cblock, 4)
    else:
        cblock, comp_cache = 1, window_cache
        comp_slots = torch.full((num_tokens, 0), -1, dtype=torch.int64)
    sink = torch.randn(HEADS, generator=gen)
    return (
        _q(num_tokens, gen),
        window_cache,
        _window_slots(positions, block_table),
        BLOCK,
        comp_cache,
        comp_slots,
        cblock,
        sink,
        SCALE,
    )


def _run_flash(fn, args) -> torch.Tensor:
    out = torch.full((args[0].shape[0], HEADS, HEAD_DIM), float("nan"), dtype=torch.bfloat16)
    fn(out, *args)
    return out


def _assert_bf16_close(got: torch.Tensor, want: torch.Tensor, min_exact: float) -> None:
    """Within bf16 rounding: every element within 2 ** -6 of its row's largest, most equal."""
    got, want = got.float(), want.float()
    row_scale = want.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    assert torch.all((got - want).abs() <= 2**-6 * row_scale), (got - want).abs().max()
    exact = (got == want).float().mean().item()
    assert exact >= min_exact, exact


# ---------------------------------------------------------------- fp8_ds_mla cache format


def test_encode_known_bytes_and_decode_round_trip() -> None:
    """Hand-checked bytes of one token and the decode -> encode precision on many."""
    x = torch.zeros(1, HEAD_DIM)
    x[0, :64] = 1.0
    x[0, 5] = 448.0  # tile 0: amax 448 -> scale 2**0
    x[0, 64:128] = -0.5  # tile 1: amax 0.5 -> scale 2**ceil(log2(0.5/448)) = 2**-9
    # tile 2 (128..191) stays zero: scale floor 1e-4 -> 2**-13
    x[0, 448] = 1.0  # rope dims are stored as bf16
    x[0, 449] = -2.0
    raw = cache_format.encode_fp8_ds_mla(x)
    assert raw.shape == (1, 584) and raw.dtype == torch.uint8
    assert raw[0, 0].item() == 0x38  # 1.0 = 2**(7-7) * (1 + 0/8)
    assert raw[0, 5].item() == 0x7E  # 448 = 2**8 * 1.75
    assert raw[0, 64].item() == 0xF8  # -0.5 / 2**-9 = -256 = -(2**8)
    assert raw[0, 128].item() == 0x00
    assert raw[0, 448:452].tolist() == [0x80, 0x3F, 0x00, 0xC0]  # bf16 1.0, -2.0
    assert raw[0, 576:584].tolist() == [127, 127 - 9, 127 - 13, 114, 114, 114, 114, 0]
    dec = cache_format.decode_fp8_ds_mla(raw)
    assert dec[0, 0].item() == 1.0 and dec[0, 5].item() == 448.0
    assert dec[0, 64].item() == -0.5
    assert dec[0, 128].item() == 2.0**-7 * 2.0**-13  # the kernel reads a zero code as 2**-7
    assert dec[0, 448].item() == 1.0 and dec[0, 449].item() == -2.0

    x = _latents(300, _gen(1))
    for flush in (True, False):
        dec = cache_format.decode_fp8_ds_mla(
            cache_format.encode_fp8_ds_mla(x, flush_subnormals=flush)
        )
        ref = x.bfloat16().float()
        tiles = ref[:, :448].reshape(300, 7, 64)
        scale = torch.pow(2.0, cache_format.tile_scale_exponents(ref[:, :448]).double()).float()
        err = (dec[:, :448].reshape(300, 7, 64) - tiles).abs()
        assert torch.all(err <= 2**-4 * tiles.abs() + 2**-6 * scale[..., None])
        assert torch.equal(dec[:, 448:], ref[:, 448:])


def test_write_and_read_tokens_use_the_split_block_layout() -> None:
    """Data bytes at ``pos * 576``, scale bytes at ``block_size * 576 + pos * 8`` of the
    slot's row; other bytes (and rows wider than the block) are left alone."""
    bs = 4
    backing = torch.randint(0, 256, (3, bs * 584 + 40), dtype=torch.uint8, generator=_gen(2))
    cache = backing[:, : bs * 584]  # a strided view, as a page-aligned pool gives
    before = backing.clone()
    records = torch.randint(0, 256, (3, 584), dtype=torch.uint8, generator=_gen(3))
    slots = torch.tensor([6, -1, 1])
    cache_format.write_tokens(cache, slots, records, bs)
    expected = before.clone()
    for slot, rec in ((6, records[0]), (1, records[2])):
        row, pos = divmod(slot, bs)
        expected[row, pos * 576 : pos * 576 + 576] = rec[:576]
        expected[row, bs * 576 + pos * 8 : bs * 576 + pos * 8 + 8] = rec[576:]
    assert torch.equal(backing, expected)
    assert torch.equal(cache_format.read_tokens(cache, torch.tensor([1, 6]), bs), records[[2, 0]])


@needs_real
def test_cache_bytes_match_the_real_insert_kernel() -> None:
    """The real insert kernel's bytes are the reference encoding at the reference layout,
    and the reference reader recovers them; subnormal-range values are flushed."""
    gen = _gen(4)
    n, nblocks = 150, 4
    kv = _latents(n, gen).bfloat16()
    positions = torch.zeros(n, dtype=torch.int64)  # position 0: RoPE is the identity
    slots = torch.randperm(nblocks * BLOCK, generator=gen)[:n]
    cache = torch.zeros(nblocks, BLOCK * 584, dtype=torch.uint8)
    q = _q(n, gen, heads=1)
    torch.ops._C.fused_qnorm_rope_kv_insert_cpu(
        q, kv, positions, cache, slots, _cos_sin_cache(), 1, EPS, BLOCK
    )
    ours = torch.zeros_like(cache)
    cache_format.write_tokens(ours, slots, cache_format.encode_fp8_ds_mla(kv), BLOCK)
    assert torch.equal(cache, ours)
    raw = cache_format.read_tokens(cache, slots, BLOCK)
    assert torch.equal(raw, cache_format.encode_fp8_ds_mla(kv))
    assert (raw[:, :448] == 0x80).any() and (raw[:, :448] == 0x00).any()


@needs_real
def test_decode_matches_what_the_real_attention_kernel_reads() -> None:
    """With one usable key and no sink the real attention returns that key's latent, so its
    output is the kernel's decoding of every e4m3 code (zero and subnormals included) and
    of scale bytes (0 reads as 0; tiny scales flush to zero below 2 ** -126)."""
    gen = _gen(5)
    record = torch.zeros(1, 584, dtype=torch.uint8)
    record[0, :448] = (torch.arange(448) % 256).to(torch.uint8)
    record[0, :448][record[0, :448] % 128 == 127] = 0  # skip e4m3's NaN codes
    record[0, 448:576] = torch.randn(64, generator=gen).bfloat16().view(torch.uint8)
    record[0, 576:584] = torch.tensor([127, 120, 130, 0, 140, 114, 6, 0])
    cache = torch.zeros(2, BLOCK * 584, dtype=torch.uint8)
    cache_format.write_tokens(cache, torch.tensor([70]), record, BLOCK)
    window = torch.full((1, WINDOW), -1)
    window[0, 9] = 70
    args = (
        _q(1, gen),
        cache,
        window,
        BLOCK,
        cache,
        torch.full((1, 0), -1),
        1,
        torch.full((HEADS,), float("-inf")),
        SCALE,
    )
    real = _run_flash(torch.ops._C.flash_mla_with_kvcache_cpu, args)
    decoded = cache_format.decode_fp8_ds_mla(record)[0]
    assert torch.equal(real[0].float(), decoded.expand(HEADS, HEAD_DIM))
    assert torch.equal(_run_flash(attention.flash_mla_with_kvcache_cpu, args), real)


# ---------------------------------------------------------- fused_qnorm_rope_kv_insert_cpu


def _insert_case(num_tokens: int, seed: int, padded: int = HEADS, num_insert: int | None = None):
    gen = _gen(seed)
    nblocks = (num_tokens + BLOCK - 1) // BLOCK + 2
    num_insert = num_tokens if num_insert is None else num_insert
    slots = torch.randperm(nblocks * BLOCK, generator=gen)[:num_insert]
    slots[3::6] = -1
    cache = torch.randint(0, 256, (nblocks, BLOCK * 584), dtype=torch.uint8, generator=gen)
    return (
        _q(num_tokens, gen),
        _latents(num_tokens, gen).bfloat16(),
        torch.randint(0, 4096, (num_tokens,), generator=gen),
        cache,
        slots,
        _cos_sin_cache(),
        padded,
        EPS,
        BLOCK,
    )


def _run_insert(fn, args):
    cache = args[3].clone()
    out = fn(*args[:3], cache, *args[4:])
    return out, cache


@needs_real
@pytest.mark.parametrize(
    ("num_tokens", "padded", "num_insert"),
    [(1, HEADS, None), (7, HEADS + 4, None), (67, HEADS, None), (20, HEADS, 13)],
)
def test_fused_qnorm_rope_kv_insert_matches_real(num_tokens, padded, num_insert) -> None:
    args = _insert_case(num_tokens, 10 + num_tokens, padded, num_insert)
    real_q, real_cache = _run_insert(torch.ops._C.fused_qnorm_rope_kv_insert_cpu, args)
    ref_q, ref_cache = _run_insert(attention.fused_qnorm_rope_kv_insert_cpu, args)
    assert ref_q.shape == real_q.shape == (num_tokens, padded, HEAD_DIM)
    assert ref_q.dtype == real_q.dtype == torch.bfloat16
    assert torch.equal(real_q[:, HEADS:], torch.zeros_like(real_q[:, HEADS:]))
    _assert_bf16_close(ref_q, real_q, min_exact=0.99)
    # Cache: e4m3 codes and scales identical; rope bf16 within one rounding.
    rows = (args[4] >= 0).nonzero().flatten()
    slots = args[4][rows]
    real_raw = cache_format.read_tokens(real_cache, slots, BLOCK)
    ref_raw = cache_format.read_tokens(ref_cache, slots, BLOCK)
    assert torch.equal(ref_raw[:, :448], real_raw[:, :448])
    assert torch.equal(ref_raw[:, 576:], real_raw[:, 576:])
    real_rope = cache_format.decode_fp8_ds_mla(real_raw)[:, 448:]
    ref_rope = cache_format.decode_fp8_ds_mla(ref_raw)[:, 448:]
    _assert_bf16_close(ref_rope, real_rope, min_exact=0.98)
    untouched = torch.ones_like(real_cache, dtype=torch.bool)
    untouched[real_cache != args[3]] = False
    untouched[ref_cache != args[3]] = False
    assert torch.equal(real_cache[untouched], ref_cache[untouched])
    assert (real_cache != args[3]).sum() <= slots.numel() * 584


def test_fused_qnorm_rope_kv_insert_is_row_invariant() -> None:
    """Each token's query output and cache record are the same alone as in the batch."""
    args = _insert_case(40, 20)
    q, kv, positions, _, slots = args[:5]
    full_q, full_cache = _run_insert(attention.fused_qnorm_rope_kv_insert_cpu, args)
    for t in (0, 13, 38):
        cache = args[3].clone()
        one = (q[t : t + 1], kv[t : t + 1], positions[t : t + 1], cache, slots[t : t + 1])
        out = attention.fused_qnorm_rope_kv_insert_cpu(*one, *args[5:])
        assert torch.equal(out[0], full_q[t])
        alone = cache_format.read_tokens(cache, slots[t : t + 1], BLOCK)
        assert torch.equal(alone, cache_format.read_tokens(full_cache, slots[t : t + 1], BLOCK))
    cache = args[3].clone()
    tail = (q[20:], kv[20:], positions[20:], cache, slots[20:])
    assert torch.equal(attention.fused_qnorm_rope_kv_insert_cpu(*tail, *args[5:]), full_q[20:])
    head = (q[:20], kv[:20], positions[:20], cache, slots[:20])
    attention.fused_qnorm_rope_kv_insert_cpu(*head, *args[5:])
    assert torch.equal(cache, full_cache)


def test_fused_qnorm_rope_kv_insert_known_rotation() -> None:
    """With cos = 0, sin = 1 every rope pair (e, o) becomes (-o, e): the query head is
    RMS-normalised and so rotated; the stored rope dims are the kv's, so rotated."""
    gen = _gen(21)
    q = _q(2, gen, heads=2)
    kv = _latents(2, gen).bfloat16()
    cos_sin = torch.cat([torch.zeros(8, 32), torch.ones(8, 32)], dim=1)
    cache = torch.zeros(1, BLOCK * 584, dtype=torch.uint8)
    out = attention.fused_qnorm_rope_kv_insert_cpu(
        q, kv, torch.tensor([3, 5]), cache, torch.tensor([2, -1]), cos_sin, 3, EPS, BLOCK
    )
    x = q.double()
    normed = x / torch.sqrt(x.square().mean(-1, keepdim=True) + EPS)
    pairs = normed[..., 448:].reshape(2, 2, 32, 2)
    rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).reshape(2, 2, 64)
    assert torch.equal(out[:, :2, :448], normed[..., :448].bfloat16())
    assert torch.equal(out[:, :2, 448:], rotated.bfloat16())
    assert torch.equal(out[:, 2], torch.zeros(2, HEAD_DIM, dtype=torch.bfloat16))
    stored = cache_format.decode_fp8_ds_mla(
        cache_format.read_tokens(cache, torch.tensor([2]), BLOCK)
    )
    kv_pairs = kv[0, 448:].float().reshape(32, 2)
    assert torch.equal(
        stored[0, 448:], torch.stack([-kv_pairs[:, 1], kv_pairs[:, 0]], -1).flatten()
    )
    assert torch.equal(
        cache_format.read_tokens(cache, torch.tensor([3]), BLOCK),
        torch.zeros(1, 584, dtype=torch.uint8),
    )


# -------------------------------------------------------------- flash_mla_with_kvcache_cpu


@needs_real
@pytest.mark.parametrize(
    ("num_tokens", "start", "compressed"),
    [(1, 0, False), (1, 300, True), (7, 120, False), (70, 0, True), (64, 200, True)],
)
def test_flash_mla_matches_real(num_tokens, start, compressed) -> None:
    args = _attention_case(num_tokens, start, 30 + num_tokens + start, compressed)
    real = _run_flash(torch.ops._C.flash_mla_with_kvcache_cpu, args)
    ref = _run_flash(attention.flash_mla_with_kvcache_cpu, args)
    _assert_bf16_close(ref, real, min_exact=0.99)


@needs_real
def test_flash_mla_edge_cases_match_real() -> None:
    """Slots out of range or -1, rows with no usable key (zeros), duplicates, extreme sinks,
    several 128-key blocks of compressed slots, a cache written by the real insert kernel."""
    gen = _gen(40)
    n = 12
    window_cache = torch.zeros(3, BLOCK * 584, dtype=torch.uint8)
    torch.ops._C.fused_qnorm_rope_kv_insert_cpu(
        _q(3 * BLOCK, gen, heads=1),
        _latents(3 * BLOCK, gen).bfloat16(),
        torch.arange(3 * BLOCK),
        window_cache,
        torch.arange(3 * BLOCK),
        _cos_sin_cache(),
        1,
        EPS,
        BLOCK,
    )
    window = torch.randint(0, 3 * BLOCK, (n, WINDOW), generator=gen)
    window[0] = -1  # no usable key at all
    window[1, 1:] = -1  # a single key
    window[2, ::2] = 3 * BLOCK + 5  # past the cache's last slot: ignored
    window[3, :64] = window[3, 64:]  # duplicates count twice
    cache_c = _filled_cache(40, 16, gen, flush_subnormals=False)
    comp = torch.randint(0, 40 * 16, (n, 300), generator=gen)
    comp[0] = -1
    comp[4, :256] = -1  # only the third block of 128 is used
    comp[5, 128:] = -1
    sink = torch.randn(HEADS, generator=gen) * 4
    sink[0], sink[1], sink[2] = float("-inf"), 30.0, -30.0
    args = (_q(n, gen), window_cache, window, BLOCK, cache_c, comp, 16, sink, SCALE)
    real = _run_flash(torch.ops._C.flash_mla_with_kvcache_cpu, args)
    ref = _run_flash(attention.flash_mla_with_kvcache_cpu, args)
    assert torch.equal(real[0], torch.zeros_like(real[0]))
    _assert_bf16_close(ref, real, min_exact=0.99)


def test_flash_mla_is_row_invariant() -> None:
    """A token's output is bit-identical whether computed alone, in a slice, or in the
    whole call (the serving test compares exactly this)."""
    args = _attention_case(70, 100, 50, compressed=True)
    full = _run_flash(attention.flash_mla_with_kvcache_cpu, args)
    q, wcache, wslots, wbs, ccache, cslots, cbs, sink, scale = args
    for lo, hi in ((69, 70), (0, 1), (33, 34), (5, 45)):
        part = (q[lo:hi], wcache, wslots[lo:hi], wbs, ccache, cslots[lo:hi], cbs, sink, scale)
        assert torch.equal(_run_flash(attention.flash_mla_with_kvcache_cpu, part), full[lo:hi])


def test_flash_mla_known_cases() -> None:
    """Hand-checkable: one key returns its latent scaled by the sink's share; two keys
    with equal scores average; no key gives zeros; the sink acts as a zero-valued key."""
    gen = _gen(60)
    latents = torch.zeros(4, HEAD_DIM)
    latents[0] = torch.randn(HEAD_DIM, generator=gen)
    latents[1, 448:] = 1.0
    latents[2, 448:] = -1.0
    latents[2, :448] = 0.5
    latents[3, :448] = 0.5  # keys 2 and 3 score the same against a nope-free query
    cache = torch.zeros(1, BLOCK * 584, dtype=torch.uint8)
    cache_format.write_tokens(
        cache, torch.arange(4), cache_format.encode_fp8_ds_mla(latents), BLOCK
    )
    stored = cache_format.decode_fp8_ds_mla(cache_format.read_tokens(cache, torch.arange(4), BLOCK))
    q = torch.zeros(3, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    q[:, :, :448] = 1.0
    window = torch.full((3, WINDOW), -1)
    window[0, 50] = 0
    window[1, 0], window[1, 127] = 2, 3
    sink = torch.full((HEADS,), float("-inf"))
    sink[1] = 0.0
    args = (q, cache, window, BLOCK, cache, torch.full((3, 0), -1), 1, sink, 0.01)
    out = _run_flash(attention.flash_mla_with_kvcache_cpu, args).float()
    assert torch.equal(out[0, 0], stored[0].bfloat16().float())
    score = 0.01 * stored[0].bfloat16().double() @ q[0, 1].double()
    share = 1.0 / (1.0 + math.exp(-score.item()))  # sink logit 0 against the key's score
    assert torch.allclose(out[0, 1], stored[0] * share, rtol=2**-7, atol=0)
    assert torch.allclose(out[1, 0], (stored[2] + stored[3]) / 2, rtol=2**-8, atol=0)
    assert torch.equal(out[2], torch.zeros(HEADS, HEAD_DIM))
