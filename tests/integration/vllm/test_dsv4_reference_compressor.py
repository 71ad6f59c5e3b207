"""The test-only DeepSeek-V4 compressor reference kernels (``dsv4_reference.compressor``).

Where vLLM's AVX512-BF16 library loads, each reference is compared with the real op on
the tiny model's shapes (the ratio-4 and ratio-128 attention compressors, head 512, and
the ratio-4 indexer compressor, head 128). Everywhere, each is checked for row
invariance (a token's cache bytes do not depend on the other tokens of the call) and
against hand-checkable cases.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from dsv4_reference import cache_format, compressor

pytestmark = pytest.mark.integration

OPS = (
    "save_partial_states_cpu",
    "compress_norm_rope_store_cpu",
    "compress_norm_rope_store_indexer_cpu",
)


def _real_kernels_loaded() -> bool:
    try:
        from vllm.platforms import current_platform

        current_platform.import_kernels()
    except Exception:
        return False
    return all(hasattr(torch.ops._C, name) for name in OPS)


REAL = _real_kernels_loaded()
needs_real = pytest.mark.skipif(
    not REAL, reason="vLLM's DeepSeek-V4 CPU kernels (vllm/_C.abi3.so) need AVX512-BF16"
)

# kind: (compress_ratio, head_dim); the state width is 2 * coff * head_dim with
# coff = 2 for overlapping (ratio 4) windows; state blocks hold 4 (ratio 4) or 8 rows.
KINDS = {"c4": (4, 512), "c128": (128, 512), "indexer": (4, 128)}
CACHE_BLOCK = 64  # compressed tokens per KV-cache block


def _cos_sin_cache(max_pos: int = 4096, dim: int = 64) -> torch.Tensor:
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


@dataclass(repr=False)
class Case:
    """A request whose first ``history`` tokens were computed earlier and whose last
    ``num_tokens`` are in this call, laid out as vLLM's CPU compressor lays them out."""

    kind: str
    ratio: int
    head_dim: int
    kv: torch.Tensor  # [H + T, W] column view of a fused kv_score projection
    score: torch.Tensor  # [H + T, W]
    ape: torch.Tensor  # [ratio, W]
    all_positions: torch.Tensor  # [H + T]
    state_slots: torch.Tensor  # [H + T]
    state_pool: torch.Tensor  # [blocks, rows + 1, 2W]: the state cache's pooled pages
    gather_slots: torch.Tensor  # [T, window]
    positions: torch.Tensor  # [T]
    kv_slots: torch.Tensor  # [T]
    weight: torch.Tensor  # [head_dim]
    cos_sin: torch.Tensor  # [4096, 64]
    cache_pool: torch.Tensor  # [blocks, 64 * token_bytes + 64] zeros: pooled cache pages

    @property
    def state(self) -> torch.Tensor:
        """The state cache: a view whose block stride exceeds its rows' width."""
        return self.state_pool[:, :-1]

    @property
    def token_bytes(self) -> int:
        return 584 if self.head_dim == 512 else 132

    @property
    def store(self) -> str:
        if self.head_dim == 512:
            return "compress_norm_rope_store_cpu"
        return "compress_norm_rope_store_indexer_cpu"

    def fresh_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A zeroed pooled allocation and its ``[blocks, 64 * token_bytes]`` cache view."""
        pool = torch.zeros_like(self.cache_pool)
        return pool, pool[:, : CACHE_BLOCK * self.token_bytes]

    def stored(self) -> torch.Tensor:
        """Indices (into this call's tokens) of the tokens that write a compressed key."""
        closing = (self.positions + 1) % self.ratio == 0
        return torch.nonzero(closing & (self.kv_slots >= 0)).flatten()


def _case(kind: str, num_tokens: int, history: int = 0, seed: int = 0) -> Case:
    ratio, head_dim = KINDS[kind]
    gen = torch.Generator().manual_seed(seed)
    coff = 2 if ratio == 4 else 1
    width = coff * head_dim
    rows = 4 if ratio == 4 else 8
    total = history + num_tokens
    all_positions = torch.arange(total)
    n_blocks = total // rows + 2
    block_table = torch.randperm(n_blocks + 3, generator=gen)[:n_blocks]
    state_slots = block_table[all_positions // rows] * rows + all_positions % rows
    kv_score = torch.randn(total, 2 * width, generator=gen)
    kv, score = kv_score.split([width, width], dim=-1)
    ape = 0.5 * torch.randn(ratio, width, generator=gen)
    state_pool = torch.randn(n_blocks + 3, rows + 1, 2 * width, generator=gen)
    state = state_pool[:, :rows]
    # Written by the reference (bit-identical to the real op: see its test).
    compressor.save_partial_states_cpu(kv, score, ape, all_positions, state, state_slots)

    positions = all_positions[history:]
    window = coff * ratio
    local = positions[:, None] - window + 1 + torch.arange(window)
    safe = local.clamp(min=0)
    gather = torch.where(local >= 0, block_table[safe // rows] * rows + safe % rows, -1)
    n_cache_blocks = total // ratio // CACHE_BLOCK + 2
    cache_table = torch.randperm(n_cache_blocks + 2, generator=gen)[:n_cache_blocks]
    compressed = positions // ratio
    kv_slots = cache_table[compressed // CACHE_BLOCK] * CACHE_BLOCK + compressed % CACHE_BLOCK
    # Some tokens carry no KV slot; the rest (closing a window or not) carry their
    # compressed token's slot, so the window-closing rule is exercised too.
    kv_slots = torch.where(torch.rand(num_tokens, generator=gen) < 0.1, -1, kv_slots)
    token_bytes = 584 if head_dim == 512 else 132
    cache_pool = torch.zeros(n_cache_blocks + 2, CACHE_BLOCK * token_bytes + 64, dtype=torch.uint8)
    return Case(
        kind=kind, ratio=ratio, head_dim=head_dim, kv=kv, score=score, ape=ape,
        all_positions=all_positions, state_slots=state_slots, state_pool=state_pool,
        gather_slots=gather.contiguous(), positions=positions.contiguous(),
        kv_slots=kv_slots.contiguous(),
        weight=1.0 + 0.1 * torch.randn(head_dim, generator=gen), cos_sin=_cos_sin_cache(),
        cache_pool=cache_pool,
    )


def _run_store(fn, case: Case, cache: torch.Tensor, rows=slice(None)) -> None:
    fn(
        case.state, case.gather_slots[rows].contiguous(), case.positions[rows].contiguous(),
        case.kv_slots[rows].contiguous(), case.weight, 1e-6, case.cos_sin, cache,
        CACHE_BLOCK, case.ratio,
    )


def _read(case: Case, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    if case.head_dim == 512:
        return cache_format.read_tokens(cache, slots, CACHE_BLOCK)
    return compressor.read_indexer_tokens(cache, slots, CACHE_BLOCK)


def _write(case: Case, cache: torch.Tensor, slots: torch.Tensor, raw: torch.Tensor) -> None:
    if case.head_dim == 512:
        cache_format.write_tokens(cache, slots, raw, CACHE_BLOCK)
    else:
        compressor.write_indexer_tokens(cache, slots, raw, CACHE_BLOCK)


def _decode(case: Case, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain IEEE decoding of stored tokens (e4m3 subnormals as such): the values and
    each value's scale (bf16 RoPE values get scale 0: they are compared exactly-ish)."""
    if case.head_dim == 128:
        scale = raw[:, 128:].contiguous().view(torch.float32).expand(-1, 128)
        return compressor.decode_indexer_fp8(raw), scale
    codes = raw[:, :448].contiguous().view(torch.float8_e4m3fn).float().reshape(-1, 7, 64)
    scale = torch.exp2(raw[:, 576:583].float() - 127.0)[..., None].expand(-1, 7, 64)
    rope = raw[:, 448:576].contiguous().view(torch.bfloat16).float()
    values = torch.cat([(codes * scale).reshape(-1, 448), rope], dim=-1)
    scales = torch.cat([scale.reshape(-1, 448), torch.zeros_like(rope)], dim=-1)
    return values, scales


def _assert_within_fp8(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor):
    """Within one e4m3 rounding (relative 2**-4, absolute 2**-10 * scale for subnormals)
    plus a bf16 rounding (relative 2**-8), with a little slack."""
    bound = 0.07 * expected.abs() + 2.0**-9 * scale + 1e-30
    excess = (actual - expected).abs() - bound
    assert bool((excess <= 0).all()), f"worst excess {excess.max().item():.3g}"


# ----------------------------------------------------------------------------------------
# save_partial_states_cpu
# ----------------------------------------------------------------------------------------


@needs_real
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_tokens", [1, 7, 96])
def test_save_partial_states_matches_real(kind: str, num_tokens: int) -> None:
    case = _case(kind, num_tokens, history=5, seed=num_tokens)
    slots = case.state_slots.clone()
    slots[::3] = -1
    before = torch.randn_like(case.state_pool)
    real_pool, ref_pool = before.clone(), before.clone()
    args = (case.kv, case.score, case.ape, case.all_positions)
    torch.ops._C.save_partial_states_cpu(*args, real_pool[:, :-1], slots)
    assert compressor.save_partial_states_cpu(*args, ref_pool[:, :-1], slots) is None
    assert not torch.equal(real_pool, before)
    # Equal everywhere, the pooled rows past each block's last one included.
    assert torch.equal(real_pool, ref_pool)


@pytest.mark.parametrize("kind", KINDS)
def test_save_partial_states_rows_and_layout(kind: str) -> None:
    case = _case(kind, 40, seed=1)
    args = (case.kv, case.score, case.ape, case.all_positions)
    whole = torch.zeros_like(case.state)
    compressor.save_partial_states_cpu(*args, whole, case.state_slots)
    # Token by token (and with the others' slots -1) gives the same state.
    alone = torch.zeros_like(case.state)
    for t in range(len(case.all_positions)):
        slots = torch.full_like(case.state_slots, -1)
        slots[t] = case.state_slots[t]
        compressor.save_partial_states_cpu(*args, alone, slots)
    assert torch.equal(whole, alone)
    # A row is [kv | score + ape[position % ratio]].
    width = case.kv.shape[1]
    t = 13
    slot = int(case.state_slots[t])
    row = whole[slot // whole.shape[1], slot % whole.shape[1]]
    assert torch.equal(row[:width], case.kv[t])
    assert torch.equal(row[width:], case.score[t] + case.ape[13 % case.ratio])
    written = (whole != 0).any(-1).sum().item()
    assert written == len(case.all_positions)


# ----------------------------------------------------------------------------------------
# compress_norm_rope_store_cpu / compress_norm_rope_store_indexer_cpu
# ----------------------------------------------------------------------------------------

COMPARISONS = [
    ("c4", 1, 515),  # decode of a window-closing token
    ("c4", 7, 9),
    ("c4", 520, 0),
    ("c128", 1, 255),
    ("c128", 9, 376),
    ("c128", 520, 0),
    ("indexer", 1, 515),
    ("indexer", 7, 9),
    ("indexer", 520, 0),
]


@needs_real
@pytest.mark.parametrize(("kind", "num_tokens", "history"), COMPARISONS)
def test_compress_store_matches_real(kind: str, num_tokens: int, history: int) -> None:
    case = _case(kind, num_tokens, history, seed=num_tokens + history)
    (real_pool, real), (ref_pool, ref) = case.fresh_cache(), case.fresh_cache()
    _run_store(getattr(torch.ops._C, case.store), case, real)
    _run_store(getattr(compressor, case.store), case, ref)

    stored = case.stored()
    assert len(stored) > 0
    slots = case.kv_slots[stored]
    raw_real, raw_ref = _read(case, real, slots), _read(case, ref, slots)
    assert bool((raw_real != 0).any(-1).all())
    # Nothing but the stored tokens' bytes is written.
    blank = torch.zeros_like(raw_real)
    for pool in (real_pool, ref_pool):
        _write(case, pool[:, : CACHE_BLOCK * case.token_bytes], slots, blank)
        assert not bool(pool.any())
    # The bytes agree but for rare rounding flips; the values agree within fp8 rounding.
    mismatch = (raw_real != raw_ref).float().mean().item()
    assert mismatch <= 1e-3, f"{mismatch:.2%} of the stored bytes differ"
    real_values, real_scales = _decode(case, raw_real)
    ref_values, _ = _decode(case, raw_ref)
    _assert_within_fp8(ref_values, real_values, real_scales)


def _float64_compress(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """An independent float64 statement of the compressor: the stored tokens and their
    keys, from the raw kv/score/ape (not the state cache)."""
    stored = case.stored()
    window = case.gather_slots.shape[1]
    d = case.head_dim
    keys = []
    for t in stored.tolist():
        pos = int(case.positions[t])
        kvs, scores = [], []
        for w in range(window):
            p = pos - window + 1 + w
            if p < 0:
                continue
            half = slice(d, 2 * d) if w >= case.ratio else slice(0, d)
            kvs.append(case.kv[p, half].double())
            scores.append((case.score[p] + case.ape[p % case.ratio])[half].double())
        weights = torch.softmax(torch.stack(scores), dim=0)
        x = (weights * torch.stack(kvs)).sum(0)
        x = x / torch.sqrt((x * x).mean() + 1e-6) * case.weight.double()
        start = pos // case.ratio * case.ratio
        cos, sin = case.cos_sin[start, :32].double(), case.cos_sin[start, 32:].double()
        pair = torch.complex(x[-64::2], x[-63::2]) * torch.complex(cos, sin)
        x[-64::2], x[-63::2] = pair.real, pair.imag
        keys.append(x)
    return stored, torch.stack(keys).float()


@pytest.mark.parametrize("kind", KINDS)
def test_compress_store_hand_case(kind: str) -> None:
    """The stored keys decode to an independent float64 compressor's keys within fp8
    precision; only window-closing tokens with a KV slot write."""
    case = _case(kind, 300 if kind == "c128" else 24, seed=3)
    pool, cache = case.fresh_cache()
    _run_store(getattr(compressor, case.store), case, cache)
    stored, keys = _float64_compress(case)
    slots = case.kv_slots[stored]
    values, scales = _decode(case, _read(case, cache, slots))
    _assert_within_fp8(values, keys, scales)
    if case.head_dim == 512:  # the bf16 RoPE part is exact to bf16
        torch.testing.assert_close(values[:, 448:], keys[:, 448:], rtol=2**-8, atol=1e-6)
    _write(case, cache, slots, torch.zeros(len(slots), case.token_bytes, dtype=torch.uint8))
    assert not bool(pool.any())


@pytest.mark.parametrize("kind", KINDS)
def test_compress_store_row_invariant(kind: str) -> None:
    """The whole call's cache bytes equal those of calls over chunks of 1, 6, 57, ...
    tokens, and of each stored token computed alone."""
    case = _case(kind, 300 if kind == "c128" else 130, history=3, seed=4)
    fn = getattr(compressor, case.store)
    _, whole = case.fresh_cache()
    _run_store(fn, case, whole)
    _, chunked = case.fresh_cache()
    bounds = [0, 1, 7, 64, len(case.positions)]
    for lo, hi in itertools.pairwise(bounds):
        _run_store(fn, case, chunked, slice(lo, hi))
    assert torch.equal(whole, chunked)
    stored = case.stored()
    assert len(stored) > 1
    for t in stored.tolist()[-3:]:
        _, alone = case.fresh_cache()
        _run_store(fn, case, alone, slice(t, t + 1))
        slot = case.kv_slots[t : t + 1]
        assert torch.equal(_read(case, alone, slot), _read(case, whole, slot))


# ----------------------------------------------------------------------------------------
# The indexer cache format
# ----------------------------------------------------------------------------------------


def test_indexer_format_known_token() -> None:
    """amax 1 -> scale 2**ceil(log2(1/448)) = 2**-8; 1.0 -> 256 = e4m3 0x78, -0.5 -> 0xF0;
    the scale is a raw little-endian float32 after the block's 64 * 128 data bytes."""
    key = torch.zeros(1, 128)
    key[0, 0], key[0, 5] = 1.0, -0.5
    raw = compressor.encode_indexer_fp8(key)
    assert raw.shape == (1, 132) and raw.dtype == torch.uint8
    assert raw[0, 0] == 0x78 and raw[0, 5] == 0xF0
    assert int(raw[0, :128].count_nonzero()) == 2
    assert raw[0, 128:].tolist() == [0x00, 0x00, 0x80, 0x3B]  # 2**-8 as float32
    assert torch.equal(compressor.decode_indexer_fp8(raw), key)

    cache = torch.zeros(3, 64 * 132, dtype=torch.uint8)
    compressor.write_indexer_tokens(cache, torch.tensor([64 + 3, -1]), raw.repeat(2, 1), 64)
    assert cache[1, 3 * 128] == 0x78 and cache[1, 3 * 128 + 5] == 0xF0
    assert cache[1, 64 * 128 + 12 : 64 * 128 + 16].tolist() == [0x00, 0x00, 0x80, 0x3B]
    assert int(cache.count_nonzero()) == 4
    assert torch.equal(compressor.read_indexer_tokens(cache, torch.tensor([67]), 64), raw)


def test_indexer_format_round_trip() -> None:
    gen = torch.Generator().manual_seed(5)
    key = torch.randn(50, 128, generator=gen) * torch.logspace(-6, 3, 50)[:, None]
    key[7, :100] = 0.0  # tiny amax: the 1e-4 floor
    key[7, 100:] *= 1e-9
    raw = compressor.encode_indexer_fp8(key)
    scale = raw[:, 128:].contiguous().view(torch.float32).flatten()
    amax = key.to(torch.bfloat16).float().abs().amax(-1).clamp(min=1e-4)
    assert torch.equal(scale, torch.exp2(torch.ceil(torch.log2(amax.double() / 448))).float())
    values = compressor.decode_indexer_fp8(raw)
    _assert_within_fp8(values, key, scale[:, None].expand(-1, 128))
    # Row invariance of the encoding.
    assert torch.equal(compressor.encode_indexer_fp8(key[20:21]), raw[20:21])
