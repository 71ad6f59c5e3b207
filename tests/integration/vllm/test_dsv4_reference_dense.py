"""The test-only dense DeepSeek-V4 CPU op stand-ins (``dsv4_reference.dense``).

Where vLLM's AVX512-BF16 library is loaded, each stand-in is compared with the real
``torch.ops._C`` op on the tiny model's shapes. On any CPU: every stand-in gives a
token the same bits whether it is computed alone or among others (the serving tests
compare a token computed alone with the same token inside a prompt), and small cases
whose answer is known by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
from dsv4_reference import dense

pytestmark = pytest.mark.integration

OPS = (
    "hc_pre_fused_cpu",
    "hc_post_fused_cpu",
    "hc_head_fused_cpu",
    "biased_topk_cpu",
    "bmm_cpu",
    "convert_weight_packed",
    "inverse_gptj_rope_o_proj_cpu",
)


def _real_ops_loaded() -> bool:
    """True when every op above comes from vLLM's C++ library (not a Python stand-in)."""
    try:
        from vllm.platforms import current_platform

        current_platform.import_kernels()
    except Exception:
        return False
    for name in OPS:
        if not hasattr(torch.ops._C, name):
            return False
        dump = torch._C._dispatch_dump(f"_C::{name}")
        cpu = [line for line in dump.splitlines() if line.startswith("CPU:")]
        if not cpu or ".cpp" not in cpu[0]:
            return False
    return True


REAL = _real_ops_loaded()
needs_real = pytest.mark.skipif(
    not REAL, reason="vLLM's DeepSeek-V4 CPU kernels (vllm/_C.abi3.so) need AVX512-BF16"
)

# The tiny model: hidden 256, hc_mult 4, 16 heads x 512 (rope 64), o-LoRA 128 in 4
# groups (K = 4 heads x 512), 256 routed experts top-6, sinkhorn 20, eps 1e-6.
HIDDEN, HC, HEADS, HEAD_DIM, ROPE = 256, 4, 16, 512, 64
GROUPS, O_LORA = 4, 128
EXPERTS, TOPK = 256, 6
TOKEN_COUNTS = (1, 7, 130)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


def _assert_bf16_close(ref: torch.Tensor, real: torch.Tensor, max_diff_frac: float) -> None:
    """Within bf16 rounding, and all but a few elements bit-identical."""
    assert ref.dtype == real.dtype and ref.shape == real.shape
    torch.testing.assert_close(ref.float(), real.float(), rtol=1e-2, atol=1e-2)
    frac = (ref != real).float().mean().item()
    assert frac <= max_diff_frac, f"{frac:.2%} of elements differ"


def _assert_rows_invariant(call, num_tokens: int, check) -> None:
    """``call(rows)`` computes the given token rows; each subset must match the full call."""
    full = call(torch.arange(num_tokens))
    for rows in (
        torch.tensor([0]),
        torch.tensor([num_tokens - 1]),
        torch.arange(num_tokens // 3, num_tokens // 3 + 5),
        torch.arange(num_tokens - 1, -1, -2),
    ):
        check(full, rows, call(rows))


def _equal_rows(full, rows, part) -> None:
    fulls = full if isinstance(full, tuple) else (full,)
    parts = part if isinstance(part, tuple) else (part,)
    for f, p in zip(fulls, parts):
        assert torch.equal(f[rows], p), "a token's result depends on the other tokens"


# ----------------------------------------------------------------------------- inputs


def _hc_pre_inputs(num_tokens: int, seed: int = 0):
    g = _gen(seed)
    mix = (2 + HC) * HC
    x = _randn(g, num_tokens, HC, HIDDEN).bfloat16()
    hc_fn = _randn(g, mix, HC * HIDDEN, scale=0.05)
    hc_scale = torch.tensor([0.6, 0.8, 1.1])
    hc_base = _randn(g, mix, scale=0.5)
    return x, hc_fn, hc_scale, hc_base


def _hc_post_inputs(num_tokens: int, seed: int = 1):
    g = _gen(seed)
    x = _randn(g, num_tokens, HIDDEN).bfloat16()
    residual = _randn(g, num_tokens, HC, HIDDEN).bfloat16()
    post = torch.rand(num_tokens, HC, generator=g) * 2
    comb = torch.rand(num_tokens, HC, HC, generator=g)
    return x, residual, post, comb


def _hc_head_inputs(num_tokens: int, seed: int = 2):
    g = _gen(seed)
    x = _randn(g, num_tokens, HC, HIDDEN).bfloat16()
    hc_fn = _randn(g, HC, HC * HIDDEN, scale=0.05)
    return x, hc_fn, torch.tensor([0.7]), _randn(g, HC, scale=0.5)


def _topk_inputs(num_tokens: int, seed: int = 3, experts: int = EXPERTS):
    g = _gen(seed)
    logits = _randn(g, num_tokens, experts, scale=2.0)
    return logits, _randn(g, experts, scale=0.1)


def _bmm_inputs(num_tokens: int, seed: int = 4):
    g = _gen(seed)
    k = HEAD_DIM * HEADS // GROUPS
    weight = _randn(g, GROUPS, O_LORA, k, scale=0.02).bfloat16()
    mat1 = _randn(g, GROUPS, num_tokens, k).bfloat16()
    return mat1, weight


def _rope_inputs(num_tokens: int, seed: int = 5):
    g = _gen(seed)
    o = _randn(g, num_tokens, HEADS, HEAD_DIM).bfloat16()
    positions = torch.randint(0, 4096, (num_tokens,), generator=g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE))
    angles = torch.arange(4096, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).float()
    return o, positions, cos_sin


def _bmm(module, mat1: torch.Tensor, weight: torch.Tensor, packed: bool = True) -> torch.Tensor:
    out = torch.empty(mat1.shape[0], mat1.shape[1], weight.shape[1], dtype=mat1.dtype)
    mat2 = module.convert_weight_packed(weight) if packed else weight
    module.bmm_cpu(out, mat1, mat2, packed, None)
    return out


def _real():
    return torch.ops._C


# ------------------------------------------------------------------- against the real ops


@needs_real
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_hc_pre_matches_real(num_tokens: int) -> None:
    args = (*_hc_pre_inputs(num_tokens), HC, 20, 1e-6, 1e-6)
    y_real, post_real, comb_real = _real().hc_pre_fused_cpu(*args)
    y_ref, post_ref, comb_ref = dense.hc_pre_fused_cpu(*args)
    _assert_bf16_close(y_ref, y_real, max_diff_frac=0.01)
    for ref, real in ((post_ref, post_real), (comb_ref, comb_real)):
        assert ref.dtype == real.dtype == torch.float32 and ref.shape == real.shape
        torch.testing.assert_close(ref, real, rtol=1e-5, atol=1e-6)


@needs_real
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_hc_post_matches_real_bit_for_bit(num_tokens: int) -> None:
    args = _hc_post_inputs(num_tokens)
    real = _real().hc_post_fused_cpu(*args)
    ref = dense.hc_post_fused_cpu(*args)
    assert ref.dtype == real.dtype and ref.shape == real.shape == (num_tokens, HC, HIDDEN)
    assert torch.equal(ref, real)


def test_hc_post_fma_rounding_is_visible_on_many_tokens() -> None:
    """The bit-exact claim above is a real test: a float32 replay without the fused
    multiply-add differs from the stand-in somewhere on 520 tokens."""
    x, residual, post, comb = _hc_post_inputs(520)
    acc = post[:, :, None] * x.float()[:, None, :]
    for i in range(HC):
        acc = acc + comb[:, i, :, None] * residual.float()[:, i, None, :]
    assert not torch.equal(acc.bfloat16(), dense.hc_post_fused_cpu(x, residual, post, comb))


@needs_real
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_hc_head_matches_real(num_tokens: int) -> None:
    args = (*_hc_head_inputs(num_tokens), 1e-6, 1e-6)
    _assert_bf16_close(
        dense.hc_head_fused_cpu(*args), _real().hc_head_fused_cpu(*args), max_diff_frac=0.01
    )


@needs_real
@pytest.mark.parametrize("scoring_func", ["sqrtsoftplus", "sigmoid"])
@pytest.mark.parametrize("topk", [6, 8, 9])
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_biased_topk_matches_real(scoring_func: str, topk: int, num_tokens: int) -> None:
    logits, bias = _topk_inputs(num_tokens)
    args = (logits, logits, bias, topk, True, scoring_func, 0, 1.5, True)
    w_real, ids_real = _real().biased_topk_cpu(*args)
    w_ref, ids_ref = dense.biased_topk_cpu(*args)
    assert ids_ref.dtype == ids_real.dtype == torch.int32
    assert torch.equal(ids_ref, ids_real)
    assert w_ref.dtype == w_real.dtype == torch.float32
    torch.testing.assert_close(w_ref, w_real, rtol=1e-6, atol=1e-7)


@needs_real
@pytest.mark.parametrize(
    ("renormalize", "scaling", "on_output", "logit_dtype", "bias_dtype"),
    [
        (False, 1.5, True, torch.float32, torch.float32),
        (True, None, True, torch.float32, torch.float32),
        (True, 2.5, False, torch.float32, torch.float32),
        (True, 1.5, True, torch.bfloat16, torch.bfloat16),
        (True, 1.5, True, torch.float16, torch.float32),
    ],
)
def test_biased_topk_options_match_real(
    renormalize: bool, scaling, on_output: bool, logit_dtype, bias_dtype
) -> None:
    logits, bias = _topk_inputs(64, seed=7, experts=128)
    logits, bias = logits.to(logit_dtype), bias.to(bias_dtype)
    args = (logits, logits, bias, 8, renormalize, "sqrtsoftplus", 0, scaling, on_output)
    w_real, ids_real = _real().biased_topk_cpu(*args)
    w_ref, ids_ref = dense.biased_topk_cpu(*args)
    assert torch.equal(ids_ref, ids_real)
    torch.testing.assert_close(w_ref, w_real, rtol=1e-6, atol=1e-7)


@needs_real
def test_biased_topk_extreme_logits_match_real() -> None:
    """The softplus branches (x > 20, x < -15) and the float32 ``1 + exp(x)`` near -15."""
    logits = torch.full((1, EXPERTS), -40.0)
    logits[0, :8] = torch.tensor([30.0, -20.0, 19.9, 20.1, -15.1, -14.9, -12.0, -30.0])
    args = (logits, logits, torch.zeros(EXPERTS), 8, False, "sqrtsoftplus", 0, 1.5, True)
    w_real, ids_real = _real().biased_topk_cpu(*args)
    w_ref, ids_ref = dense.biased_topk_cpu(*args)
    assert torch.equal(ids_ref, ids_real)
    torch.testing.assert_close(w_ref, w_real, rtol=1e-6, atol=0.0)


@needs_real
def test_biased_topk_rejects_what_real_rejects() -> None:
    logits, bias = _topk_inputs(2)
    args = (logits, logits, bias, 6, True, "softmax", 0, 1.5, True)
    with pytest.raises(RuntimeError, match="Unsupported scoring_func"):
        _real().biased_topk_cpu(*args)
    with pytest.raises(ValueError, match="Unsupported scoring_func"):
        dense.biased_topk_cpu(*args)


@needs_real
@pytest.mark.parametrize("num_tokens", (*TOKEN_COUNTS, 520))
def test_bmm_matches_real(num_tokens: int) -> None:
    mat1, weight = _bmm_inputs(num_tokens)
    real = _bmm(_real(), mat1, weight)
    _assert_bf16_close(_bmm(dense, mat1, weight), real, max_diff_frac=0.005)
    # is_vnni=False: the real op packs the plain weight itself, to the same result.
    assert torch.equal(_bmm(_real(), mat1, weight, packed=False), real)
    assert torch.equal(_bmm(dense, mat1, weight, packed=False), _bmm(dense, mat1, weight))


@needs_real
def test_bmm_strided_views_and_fp8_scale_match_real() -> None:
    """As vLLM's callers pass them: ``mat1`` a transposed view, ``out`` a column slice."""
    mat1, weight = _bmm_inputs(9)
    mat1_view = mat1.transpose(0, 1).contiguous().transpose(0, 1)
    outs = {}
    for name, module in (("real", _real()), ("ref", dense)):
        big = torch.full((GROUPS, 9, O_LORA + 32), 7.0, dtype=torch.bfloat16)
        module.bmm_cpu(
            big[:, :, 16 : 16 + O_LORA], mat1_view, module.convert_weight_packed(weight), True, None
        )
        outs[name] = big
    _assert_bf16_close(outs["ref"], outs["real"], max_diff_frac=0.005)
    assert (outs["ref"][:, :, :16] == 7.0).all() and (outs["ref"][:, :, -16:] == 7.0).all()

    fp8 = (weight.float() * 20).to(torch.float8_e4m3fn)
    scale = torch.tensor(0.05)
    for packed in (True, False):
        got = {}
        for name, module in (("real", _real()), ("ref", dense)):
            out = torch.empty(GROUPS, 9, O_LORA, dtype=torch.bfloat16)
            mat2 = module.convert_weight_packed(fp8) if packed else fp8
            module.bmm_cpu(out, mat1, mat2, packed, scale)
            got[name] = out
        _assert_bf16_close(got["ref"], got["real"], max_diff_frac=0.005)


@needs_real
def test_convert_weight_packed_shapes_match_real() -> None:
    _, weight = _bmm_inputs(1)
    real = _real().convert_weight_packed(weight)
    ref = dense.convert_weight_packed(weight)
    assert ref.shape == real.shape and ref.dtype == real.dtype
    assert ref.data_ptr() != weight.data_ptr() and real.data_ptr() != weight.data_ptr()


@needs_real
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_inverse_gptj_rope_matches_real_bit_for_bit(num_tokens: int) -> None:
    args = (*_rope_inputs(num_tokens), ROPE)
    real = _real().inverse_gptj_rope_o_proj_cpu(*args)
    ref = dense.inverse_gptj_rope_o_proj_cpu(*args)
    assert ref.dtype == real.dtype == torch.float32
    assert ref.shape == real.shape == (num_tokens, HEADS, HEAD_DIM)
    assert torch.equal(ref, real)


# ----------------------------------------------------------------- any CPU: row invariance

ROW_TOKENS = 70


def test_hc_pre_rows_invariant() -> None:
    x, hc_fn, hc_scale, hc_base = _hc_pre_inputs(ROW_TOKENS)
    _assert_rows_invariant(
        lambda rows: dense.hc_pre_fused_cpu(
            x[rows].contiguous(), hc_fn, hc_scale, hc_base, HC, 20, 1e-6, 1e-6
        ),
        ROW_TOKENS,
        _equal_rows,
    )


def test_hc_post_rows_invariant() -> None:
    x, residual, post, comb = _hc_post_inputs(ROW_TOKENS)
    _assert_rows_invariant(
        lambda rows: dense.hc_post_fused_cpu(x[rows], residual[rows], post[rows], comb[rows]),
        ROW_TOKENS,
        _equal_rows,
    )


def test_hc_head_rows_invariant() -> None:
    x, hc_fn, hc_scale, hc_base = _hc_head_inputs(ROW_TOKENS)
    _assert_rows_invariant(
        lambda rows: dense.hc_head_fused_cpu(x[rows], hc_fn, hc_scale, hc_base, 1e-6, 1e-6),
        ROW_TOKENS,
        _equal_rows,
    )


def test_biased_topk_rows_invariant() -> None:
    logits, bias = _topk_inputs(ROW_TOKENS)
    _assert_rows_invariant(
        lambda rows: dense.biased_topk_cpu(
            logits[rows], logits[rows], bias, TOPK, True, "sqrtsoftplus", 0, 1.5, True
        ),
        ROW_TOKENS,
        _equal_rows,
    )


def test_bmm_rows_invariant() -> None:
    mat1, weight = _bmm_inputs(ROW_TOKENS)
    packed = dense.convert_weight_packed(weight)

    def call(rows):
        out = torch.empty(GROUPS, len(rows), O_LORA, dtype=torch.bfloat16)
        dense.bmm_cpu(out, mat1[:, rows], packed, True, None)
        return out

    full = call(torch.arange(ROW_TOKENS))
    for rows in (torch.tensor([0]), torch.tensor([ROW_TOKENS - 1]), torch.arange(10, 17)):
        assert torch.equal(full[:, rows], call(rows))


def test_inverse_gptj_rope_rows_invariant() -> None:
    o, positions, cos_sin = _rope_inputs(ROW_TOKENS)
    _assert_rows_invariant(
        lambda rows: dense.inverse_gptj_rope_o_proj_cpu(o[rows], positions[rows], cos_sin, ROPE),
        ROW_TOKENS,
        _equal_rows,
    )


def test_float64_building_blocks_ignore_position() -> None:
    """The elementwise float64 steps give a value the same bits wherever it sits in a
    tensor. ``torch.sigmoid`` does not (its vector body and scalar tail round apart),
    which is why the stand-ins build sigmoid from exp; a torch update that changed
    exp or log the same way would show here first."""
    values = _randn(_gen(11), 4099, scale=6.0).double()
    for fn in (dense._sigmoid, torch.exp, lambda v: torch.log(v.abs() + 1e-3)):
        whole = fn(values)
        for length in (1, 3, 17):
            for start in range(0, 600, length):
                part = fn(values[start : start + length].clone())
                assert torch.equal(part, whole[start : start + length])
    rows = _randn(_gen(12), 40, 1000).double()
    whole = dense._pairwise_sum(rows)
    assert all(
        torch.equal(dense._pairwise_sum(rows[i : i + 1]), whole[i : i + 1]) for i in range(40)
    )
    torch.testing.assert_close(whole, rows.sum(-1), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------- any CPU: known answers


def test_hc_pre_with_zero_mixing_weights_by_hand() -> None:
    """``hc_fn = 0``: every gate comes from ``hc_base`` alone."""
    x, hc_fn, hc_scale, hc_base = _hc_pre_inputs(3)
    y, post, comb = dense.hc_pre_fused_cpu(x, hc_fn * 0, hc_scale, hc_base, HC, 20, 1e-6, 1e-6)
    base = hc_base.double()
    pre = 1 / (1 + torch.exp(-base[:HC])) + 1e-6
    expect_post = (2 / (1 + torch.exp(-base[HC : 2 * HC]))).float()
    torch.testing.assert_close(post, expect_post.expand(3, HC))
    expect_y = (pre[None, :, None] * x.double()).sum(1).to(torch.bfloat16)
    assert torch.equal(y, expect_y)
    # Sinkhorn output is (nearly) doubly stochastic: last step normalises columns.
    torch.testing.assert_close(comb.sum(-2), torch.ones(3, HC), rtol=0, atol=1e-5)
    torch.testing.assert_close(comb.sum(-1), torch.ones(3, HC), rtol=0, atol=1e-3)


def test_hc_pre_and_post_agree_with_vllms_torch_version() -> None:
    """vLLM's own eager torch mHC (kernels/mhc/torch.py), an independent formulation."""
    torch_mhc = pytest.importorskip("vllm.model_executor.kernels.mhc.torch")
    x, hc_fn, hc_scale, hc_base = _hc_pre_inputs(5)
    y, post, comb = dense.hc_pre_fused_cpu(x, hc_fn, hc_scale, hc_base, HC, 20, 1e-6, 1e-6)
    post_t, comb_t, y_t = torch_mhc.mhc_pre_torch(
        x, hc_fn, hc_scale, hc_base, 1e-6, 1e-6, 1e-6, 2.0, 20
    )
    torch.testing.assert_close(post, post_t.reshape(5, HC), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, comb_t, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y.float(), y_t.float(), rtol=1e-2, atol=1e-2)

    xp, residual, post_in, comb_in = _hc_post_inputs(5)
    out = dense.hc_post_fused_cpu(xp, residual, post_in, comb_in)
    out_t = torch_mhc.mhc_post_torch(xp, residual, post_in[..., None], comb_in)
    torch.testing.assert_close(out.float(), out_t.float(), rtol=1e-2, atol=1e-2)


def test_hc_post_identity_cases() -> None:
    x, residual, _, _ = _hc_post_inputs(4)
    eye = torch.eye(HC).expand(4, HC, HC).contiguous()
    assert torch.equal(dense.hc_post_fused_cpu(x, residual, torch.zeros(4, HC), eye), residual)
    out = dense.hc_post_fused_cpu(x, residual, torch.ones(4, HC), torch.zeros(4, HC, HC))
    assert torch.equal(out, x[:, None, :].expand(4, HC, HIDDEN))
    # comb[t, i, h] feeds stream i into output h (the transpose of a plain matmul).
    swap = torch.zeros(4, HC, HC)
    swap[:, 1, 0] = 1.0
    out = dense.hc_post_fused_cpu(x, residual, torch.zeros(4, HC), swap)
    assert torch.equal(out[:, 0], residual[:, 1])


def test_hc_head_with_zero_mixing_weights_by_hand() -> None:
    x, hc_fn, hc_scale, hc_base = _hc_head_inputs(3)
    y = dense.hc_head_fused_cpu(x, hc_fn * 0, hc_scale, hc_base, 1e-6, 1e-6)
    gate = 1 / (1 + torch.exp(-hc_base.double())) + 1e-6
    assert torch.equal(y, (gate[None, :, None] * x.double()).sum(1).to(torch.bfloat16))


def test_biased_topk_by_hand() -> None:
    logits = torch.zeros(1, 64)
    logits[0, [3, 10, 20, 30, 40, 50, 60]] = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.5, 0.25])
    bias = torch.zeros(64)
    bias[60] = 10.0  # bias steers the choice, but the weight stays unbiased
    weights, ids = dense.biased_topk_cpu(logits, logits, bias, 6, False, "sigmoid", 0, 1.5, True)
    assert ids.tolist() == [[60, 3, 10, 20, 30, 40]]
    expect = [1 / (1 + math.exp(-v)) for v in (0.25, 5.0, 4.0, 3.0, 2.0, 1.0)]
    torch.testing.assert_close(weights, torch.tensor([expect]), rtol=1e-6, atol=0.0)
    weights, _ = dense.biased_topk_cpu(logits, logits, bias, 6, True, "sigmoid", 0, 1.5, True)
    torch.testing.assert_close(weights.sum(), torch.tensor(1.5), rtol=1e-6, atol=0.0)
    weights, _ = dense.biased_topk_cpu(logits, logits, bias, 6, True, "sigmoid", 0, None, True)
    assert torch.equal(weights, torch.zeros(1, 6))  # the real op reads None as 0.0
    zero = torch.zeros(1, 1)
    score, _ = dense.biased_topk_cpu(
        zero, zero, torch.zeros(1), 1, False, "sqrtsoftplus", 0, None, False
    )
    torch.testing.assert_close(score, torch.tensor([[math.sqrt(math.log(2.0))]]))


def test_biased_topk_ties_go_to_the_lower_id() -> None:
    zeros = torch.zeros(2, EXPERTS)
    _, ids = dense.biased_topk_cpu(
        zeros, zeros, torch.zeros(EXPERTS), 8, True, "sigmoid", 0, 1.5, True
    )
    assert ids.tolist() == [list(range(8))] * 2
    with pytest.raises(NotImplementedError):
        dense.biased_topk_cpu(zeros, zeros, torch.zeros(EXPERTS), 8, True, "sigmoid", 1, 1.5, True)


def test_bmm_small_integers_exact() -> None:
    g = _gen(9)
    mat1 = torch.randint(-4, 5, (2, 3, 64), generator=g).bfloat16()
    weight = torch.randint(-4, 5, (2, 32, 64), generator=g).bfloat16()
    packed = dense.convert_weight_packed(weight)
    assert torch.equal(packed, weight) and packed.data_ptr() != weight.data_ptr()
    out = torch.empty(2, 3, 32, dtype=torch.bfloat16)
    assert dense.bmm_cpu(out, mat1, packed, True, None) is None
    expect = torch.einsum("bmk,bnk->bmn", mat1.long(), weight.long())
    assert torch.equal(out, expect.bfloat16())
    fp8 = weight.to(torch.float8_e4m3fn)
    dense.bmm_cpu(out, mat1, fp8, False, torch.tensor(0.5))
    assert torch.equal(out, (expect.double() * 0.5).bfloat16())


def test_inverse_gptj_rope_undoes_the_rotation() -> None:
    """Rotate by +pos (GPT-J, interleaved pairs) in float64, then the stand-in rotates back."""
    o, positions, cos_sin = _rope_inputs(6)
    half = ROPE // 2
    cos = cos_sin[positions][:, None, :half].double()
    sin = cos_sin[positions][:, None, half:].double()
    pairs = o[..., HEAD_DIM - ROPE :].double().reshape(6, HEADS, half, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), -1)
    q = torch.cat([o[..., : HEAD_DIM - ROPE].double(), rotated.reshape(6, HEADS, ROPE)], -1)
    back = dense.inverse_gptj_rope_o_proj_cpu(q.bfloat16(), positions, cos_sin, ROPE)
    assert back.dtype == torch.float32
    assert torch.equal(back[..., : HEAD_DIM - ROPE], o[..., : HEAD_DIM - ROPE].float())
    torch.testing.assert_close(back, o.float(), rtol=0, atol=0.05)
    # A quarter turn by hand: cos = 0, sin = 1 sends (e, o) to (o, -e).
    quarter = torch.zeros(1, ROPE)
    quarter[0, half:] = 1.0
    one = dense.inverse_gptj_rope_o_proj_cpu(
        o[:1], torch.zeros(1, dtype=torch.int64), quarter, ROPE
    )
    src = o[:1, ..., HEAD_DIM - ROPE :].float()
    assert torch.equal(one[..., HEAD_DIM - ROPE :: 2], src[..., 1::2])
    assert torch.equal(one[..., HEAD_DIM - ROPE + 1 :: 2], -src[..., 0::2])
