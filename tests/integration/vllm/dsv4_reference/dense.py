"""Test-only PyTorch stand-ins for vLLM 0.32's dense DeepSeek-V4 CPU kernels.

vLLM ships these ops only in its AVX512-BF16 library (``vllm/_C.abi3.so``); on an
AVX2-only CPU it loads ``_C_AVX2``, which lacks them. The functions here take the
same arguments, in the same order, as the ``torch.ops._C`` ops they stand for, and
return (or write in place) what those ops do:

- ``hc_pre_fused_cpu``, ``hc_post_fused_cpu``, ``hc_head_fused_cpu`` (mHC gating,
  csrc/cpu/sgl-kernels/mhc.cpp),
- ``biased_topk_cpu`` (flat bias-corrected MoE routing, topk.cpp),
- ``convert_weight_packed`` and ``bmm_cpu`` (batched GEMM, bmm.cpp / gemm.cpp),
- ``inverse_gptj_rope_o_proj_cpu`` (attention-output de-rotation, store_cache.cpp).

They are for tests only: correct and deterministic, not fast. Every token's output
depends on that token's inputs alone, never on how many tokens share the call.
Reductions whose order BLAS would pick by batch size (the mHC mixes) are summed in
float64 in a fixed pairwise order. ``bmm_cpu`` keeps a float64 matmul: its bf16 x bf16
(or bf16 x fp8) products, summed in float64, are exact unless they span more than about
2^25 in magnitude, so the summation order BLAS picks does not reach the bf16 output.
Elementwise float32 steps are emulated exactly where the real kernel's rounding is
known (``hc_post_fused_cpu``, ``inverse_gptj_rope_o_proj_cpu`` match the real ops bit
for bit).
"""

from __future__ import annotations

import torch

__all__ = [
    "hc_pre_fused_cpu",
    "hc_post_fused_cpu",
    "hc_head_fused_cpu",
    "biased_topk_cpu",
    "convert_weight_packed",
    "bmm_cpu",
    "inverse_gptj_rope_o_proj_cpu",
]

# Tokens per chunk when the mHC mixes are formed as explicit products: bounds the
# temporary (chunk x mix_hc x hc*d float64) to a few MiB. Results do not depend on it.
_MIX_CHUNK_TOKENS = 32


def _pairwise_sum(p: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in a fixed pairwise order (zero-padded to a power of two).

    Only elementwise adds, so each row's result is the same however many rows there
    are and however torch splits the work between threads.
    """
    k = p.shape[-1]
    width = 1 << max(k - 1, 0).bit_length()
    if width != k:
        p = torch.nn.functional.pad(p, (0, width - k))
    while p.shape[-1] > 1:
        half = p.shape[-1] // 2
        p = p[..., :half] + p[..., half:]
    return p[..., 0]


def _sum_in_order(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum a short dim left to right (explicit adds: no reduction kernel involved)."""
    parts = t.unbind(dim)
    acc = parts[0]
    for part in parts[1:]:
        acc = acc + part
    return acc


def _mixes_and_rms(x_flat: torch.Tensor, fn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x_flat @ fn.T`` and the row sum of squares, float64, fixed order per token."""
    x64 = x_flat.to(torch.float64)
    fn64 = fn.to(torch.float64)
    mixes = []
    for start in range(0, x64.shape[0], _MIX_CHUNK_TOKENS):
        chunk = x64[start : start + _MIX_CHUNK_TOKENS]
        mixes.append(_pairwise_sum(chunk[:, None, :] * fn64[None, :, :]))
    sq = _pairwise_sum(x64 * x64)
    return torch.cat(mixes), sq


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` from exp and a division. ``torch.sigmoid`` is avoided: its
    vectorised body and scalar tail round differently, so a value's result would depend
    on where it sits in the tensor (and so on the token count)."""
    return 1.0 / (1.0 + torch.exp(-x))


def _weighted_streams(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``sum_h gate[t, h] * x[t, h, :]`` in float64, streams added in order h = 0, 1, ..."""
    x64 = x.to(torch.float64)
    return _sum_in_order(gate[:, :, None] * x64, dim=1)


def hc_pre_fused_cpu(
    x: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    hc_mult: int,
    sinkhorn_iters: int,
    rms_eps: float,
    hc_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC pre block: returns ``(layer_input, post, comb)``.

    ``x`` is ``(T, hc, d)`` bf16/fp16; ``hc_fn`` ``((2 + hc) * hc, hc * d)`` float32;
    ``hc_scale`` ``(3,)``; ``hc_base`` ``((2 + hc) * hc,)``. With
    ``mixes = (x_flat @ hc_fn.T) / sqrt(mean(x_flat**2) + rms_eps)``:

    - ``pre = sigmoid(mixes[:hc] * s0 + base[:hc]) + hc_eps`` (internal only),
    - ``post = 2 * sigmoid(mixes[hc:2hc] * s1 + base[hc:2hc])`` -> ``(T, hc)`` float32
      (the multiplier 2 is hard-coded in the kernel),
    - ``comb``: row softmax of ``mixes[2hc:] * s2 + base[2hc:]`` viewed ``(hc, hc)``,
      plus ``hc_eps``, then column-normalised (``/ (col_sum + hc_eps)``); each further
      of the ``sinkhorn_iters - 1`` rounds divides rows by ``row_sum + hc_eps`` and
      then columns by ``col_sum + hc_eps`` -> ``(T, hc, hc)`` float32, row-major,
    - ``layer_input = sum_h pre[h] * x[:, h]`` -> ``(T, d)`` in ``x``'s dtype.

    The real kernel sums in float32 (K-blocked); this one in float64, so ``post`` and
    ``comb`` agree to ~1e-6 and ``layer_input`` to a bf16 rounding step.
    """
    num_tokens, hc, d = x.shape
    if hc != hc_mult:
        raise ValueError(f"x has {hc} streams, hc_mult is {hc_mult}")
    mix_hc = (2 + hc) * hc
    if tuple(hc_fn.shape) != (mix_hc, hc * d) or hc_base.numel() != mix_hc:
        raise ValueError("hc_fn must be [(2+hc)*hc, hc*d] and hc_base [(2+hc)*hc]")
    scale = hc_scale.to(torch.float64).reshape(3)
    base = hc_base.to(torch.float64).reshape(mix_hc)

    mixes, sq = _mixes_and_rms(x.reshape(num_tokens, hc * d), hc_fn)
    mixes = mixes * (1.0 / torch.sqrt(sq / (hc * d) + rms_eps))[:, None]

    pre = _sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2.0 * _sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])

    logits = (mixes[:, 2 * hc :] * scale[2] + base[2 * hc :]).reshape(num_tokens, hc, hc)
    comb = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    comb = comb / _sum_in_order(comb, dim=-1)[..., None] + hc_eps
    comb = comb / (_sum_in_order(comb, dim=-2)[..., None, :] + hc_eps)
    for _ in range(1, sinkhorn_iters):
        comb = comb / (_sum_in_order(comb, dim=-1)[..., None] + hc_eps)
        comb = comb / (_sum_in_order(comb, dim=-2)[..., None, :] + hc_eps)

    layer_input = _weighted_streams(x, pre).to(x.dtype)
    return layer_input, post.to(torch.float32), comb.to(torch.float32)


def hc_post_fused_cpu(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """mHC post block: ``out[t, h] = post[t, h] * x[t] + sum_i comb[t, i, h] * residual[t, i]``.

    ``x`` ``(T, d)``, ``residual`` ``(T, hc, d)`` (same dtype), ``post`` ``(T, hc)`` and
    ``comb`` ``(T, hc, hc)`` float32; returns ``(T, hc, d)`` in ``x``'s dtype. Note the
    transpose: stream ``h`` mixes column ``h`` of ``comb``. The kernel's float32 steps are
    replayed exactly: ``acc = post * x`` (rounded), then for ``i = 0..hc-1`` a fused
    multiply-add ``acc = fma(comb[i, h], residual[i], acc)`` (one rounding each), then
    one rounding to ``x``'s dtype. Bit-identical to the real op.
    """
    num_tokens, d = x.shape
    hc = residual.shape[1]
    if tuple(residual.shape) != (num_tokens, hc, d):
        raise ValueError("residual must be [T, hc, d]")
    post32 = post.to(torch.float32).reshape(num_tokens, hc)
    comb64 = comb.to(torch.float32).reshape(num_tokens, hc, hc).to(torch.float64)
    x32 = x.to(torch.float32)
    res64 = residual.to(torch.float64)
    acc = post32[:, :, None] * x32[:, None, :]
    for i in range(hc):
        # float64 holds comb (24-bit) * residual (<= 11-bit) exactly, and (barring huge
        # magnitude gaps) its sum with acc; one rounding to float32 is then an FMA.
        prod = comb64[:, i, :, None] * res64[:, i, None, :]
        acc = (prod + acc.to(torch.float64)).to(torch.float32)
    return acc.to(x.dtype)


def hc_head_fused_cpu(
    x: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
) -> torch.Tensor:
    """mHC head reduction: ``(T, hc, d)`` -> ``(T, d)`` in ``x``'s dtype.

    ``gate = sigmoid((x_flat @ hc_fn.T) / sqrt(mean(x_flat**2) + norm_eps) * hc_scale
    + hc_base) + hc_eps`` with ``hc_fn`` ``(hc, hc*d)``, ``hc_scale`` one element,
    ``hc_base`` ``(hc,)``; output ``sum_h gate[h] * x[:, h]``. Note the argument order
    ``(hc_eps, norm_eps)``, the reverse of vLLM's Python wrapper.
    """
    num_tokens, hc, d = x.shape
    if tuple(hc_fn.shape) != (hc, hc * d) or hc_base.numel() != hc or hc_scale.numel() != 1:
        raise ValueError("hc_fn must be [hc, hc*d], hc_base [hc], hc_scale one element")
    mixes, sq = _mixes_and_rms(x.reshape(num_tokens, hc * d), hc_fn)
    mixes = mixes * (1.0 / torch.sqrt(sq / (hc * d) + norm_eps))[:, None]
    scale = float(hc_scale.reshape(-1)[0])
    gate = _sigmoid(mixes * scale + hc_base.to(torch.float64).reshape(hc)) + hc_eps
    return _weighted_streams(x, gate).to(x.dtype)


def _one_plus_exp(x: torch.Tensor) -> torch.Tensor:
    """``1 + exp(x)`` rounded to float32, as the kernel forms it (no log1p), back in float64."""
    return (1.0 + torch.exp(x)).to(torch.float32).to(torch.float64)


def _expert_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """Per-expert float32 scores from float64 logits.

    'sigmoid': ``1 / (1 + exp(-x))``; 'sqrtsoftplus': ``sqrt(log(1 + exp(x)))``, but ``x``
    above 20 and ``exp(x / 2)`` below -15. The kernel rounds ``1 + exp(.)`` to float32
    before the division / log, which makes small softplus values coarse (at x = -14.9 the
    score is ~3% above the exact one); that rounding point is kept.
    """
    if scoring_func == "sigmoid":
        return (1.0 / _one_plus_exp(-logits)).to(torch.float32)
    softplus = torch.log(_one_plus_exp(logits))
    softplus = torch.where(logits > 20.0, logits, softplus)
    score = torch.where(logits < -15.0, torch.exp(logits * 0.5), torch.sqrt(softplus))
    return score.to(torch.float32)


def biased_topk_cpu(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    correction_bias: torch.Tensor,
    topk: int,
    renormalize: bool,
    scoring_func: str,
    num_fused_shared_experts: int,
    routed_scaling_factor: float | None,
    apply_routed_scaling_factor_on_output: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (non-grouped) bias-corrected top-k routing: ``(weights f32, ids i32)``, ``(T, topk)``.

    ``score = sigmoid(logit)`` or ``sqrt(softplus(logit))`` (``scoring_func`` 'sigmoid' /
    'sqrtsoftplus'; the real op rejects anything else), rounded to float32; experts are
    chosen by ``score + correction_bias`` (float32), best first; ties go to the lower
    expert id (the real op's ``std::partial_sort`` leaves tie order unspecified). The
    returned weights are the *unbiased* scores; with ``renormalize`` they are multiplied
    by ``1 / sum`` (float32, summed in slot order) and, if
    ``apply_routed_scaling_factor_on_output``, by ``routed_scaling_factor`` -- which the
    real op reads as 0.0 when None, zeroing the weights; replayed here. ``hidden_states``
    only gives the token count. Fused shared experts (``num_fused_shared_experts > 0``)
    take a random id from a per-thread RNG in the real op, so they are not supported.
    """
    if scoring_func not in ("sigmoid", "sqrtsoftplus"):
        raise ValueError(f"Unsupported scoring_func: {scoring_func}")
    if num_fused_shared_experts != 0:
        raise NotImplementedError("fused shared experts: the real op picks their ids at random")
    num_tokens = hidden_states.shape[0]
    num_experts = gating_output.shape[1]
    if gating_output.shape[0] != num_tokens or correction_bias.numel() != num_experts:
        raise ValueError("gating_output must be [T, E] and correction_bias [E]")
    if not 0 < topk <= num_experts:
        raise ValueError(f"topk {topk} out of range for {num_experts} experts")

    scores = _expert_scores(gating_output.to(torch.float32).to(torch.float64), scoring_func)
    biased = scores + correction_bias.to(torch.float32).reshape(1, num_experts)
    order = torch.sort(biased, dim=1, descending=True, stable=True).indices[:, :topk]
    weights = torch.gather(scores, 1, order)

    if renormalize:
        total = _sum_in_order(weights, dim=1)
        factor = 1.0 / total
        if apply_routed_scaling_factor_on_output:
            rsf = 0.0 if routed_scaling_factor is None else routed_scaling_factor
            factor = factor * torch.tensor(rsf, dtype=torch.float32)
        weights = weights * factor[:, None]
    return weights.contiguous(), order.to(torch.int32).contiguous()


def convert_weight_packed(weight: torch.Tensor) -> torch.Tensor:
    """Stand-in for the VNNI weight pre-pack: returns a plain contiguous COPY of ``weight``.

    The real op returns the same shape and dtype with K pairs interleaved within blocks
    of N (VNNI); that layout is only ever read by ``bmm_cpu``/GEMM kernels, and where
    the real kernels are missing both are replaced by these stand-ins, so the reference
    ``bmm_cpu(..., is_vnni=True)`` reads this plain ``(B, N, K)`` copy instead. Never mix
    the reference packer with the real GEMM or vice versa.
    """
    return weight.clone(memory_format=torch.contiguous_format)


def bmm_cpu(
    out: torch.Tensor,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    is_vnni: bool,
    scale: torch.Tensor | None = None,
) -> None:
    """``out[b] = mat1[b] @ mat2[b].T`` written into ``out`` (may be a strided view).

    ``mat1`` ``(B, M, K)`` bf16/fp16, ``mat2`` ``(B, N, K)``: with ``is_vnni`` the output of
    the reference ``convert_weight_packed`` (a plain copy), else the plain weight (the
    real op then packs it itself; both forms are the same here). With ``scale`` (a 0-dim
    tensor) ``mat2`` is float8_e4m3fn and the real op multiplies the float32 accumulator
    by the scale before rounding to bf16: ``out = (mat1 @ mat2.T) * scale``. Products
    are summed in float64; for bf16/fp8 operands those sums are exact unless the products
    span more than about 2^25 in magnitude, so rows do not depend on the batch size.
    """
    if mat1.dim() != 3 or mat2.dim() != 3 or out.dim() != 3:
        raise ValueError("bmm_cpu: out, mat1 and mat2 must be 3-D")
    batch, m, k = mat1.shape
    n = mat2.shape[1]
    if mat2.shape[0] != batch or mat2.shape[2] != k:
        raise ValueError("bmm: mat2 shape mismatch!")
    if tuple(out.shape) != (batch, m, n):
        raise ValueError("bmm: out shape mismatch!")
    del is_vnni  # the reference packer keeps the plain layout: both forms read alike
    result = torch.matmul(mat1.to(torch.float64), mat2.to(torch.float64).transpose(1, 2))
    if scale is not None:
        if scale.dim() != 0:
            raise ValueError("bmm: expect scale to be 0-dim tensor.")
        result = result * float(scale.to(torch.float32))
    out.copy_(result.to(out.dtype))


def inverse_gptj_rope_o_proj_cpu(
    o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_dim: int
) -> torch.Tensor:
    """Undo the query's GPT-J (interleaved) rotary embedding on the last ``rope_dim`` dims.

    ``o`` ``(T, H, head_dim)`` bf16/fp16, ``positions`` ``(T,)`` int64, ``cos_sin_cache``
    ``(max_pos, rope_dim)`` float32 laid out half-half: ``[cos_0..cos_{r/2-1} |
    sin_0..sin_{r/2-1}]``. Returns ``(T, H, head_dim)`` float32 (no reshape): dims
    ``[0, head_dim - rope_dim)`` copied, then each pair ``(e, o)`` at
    ``head_dim - rope_dim + 2j`` rotated by ``-pos``:
    ``e' = e*cos_j + o*sin_j``, ``o' = o*cos_j - e*sin_j``. The kernel computes each as
    ``fma(x, cos, fl(partner * +-sin))`` in float32; replayed exactly (bit-identical).
    """
    num_tokens, num_heads, head_dim = o.shape
    nope = head_dim - rope_dim
    half = rope_dim // 2
    if nope < 0 or rope_dim % 2:
        raise ValueError("rope_dim must be even and not exceed head_dim")
    out = o.to(dtype=torch.float32, copy=True)
    table = cos_sin_cache.to(torch.float32)[positions.to(torch.int64)]
    cos = table[:, None, :half].to(torch.float64)
    sin = table[:, None, half:rope_dim].to(torch.float64)
    pairs = out[..., nope:].reshape(num_tokens, num_heads, half, 2).to(torch.float64)
    even, odd = pairs[..., 0], pairs[..., 1]
    # fl32(partner * sin) is the product's single float32 rounding; x*cos is exact in
    # float64 (and, barring huge magnitude gaps, so is the sum), so rounding the sum
    # once more is the kernel's float32 FMA.
    even_out = even * cos + (odd * sin).to(torch.float32).to(torch.float64)
    odd_out = odd * cos + (even * -sin).to(torch.float32).to(torch.float64)
    rotated = torch.stack((even_out, odd_out), dim=-1).to(torch.float32)
    out[..., nope:] = rotated.reshape(num_tokens, num_heads, rope_dim)
    return out
