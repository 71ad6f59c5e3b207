"""Head-split main KV (docs/guide/vllm.md "Head-split main KV"): a GQA model's KV heads split over
the Prefill ranks of a contributor group; each member pulls its own heads into its
slice of the Decode block. Real bytes: the plans are executed with memmove on numpy
buffers laid out like vLLM's CPU cache ([blocks, heads, block_size, 2 x head_size])."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from rd2h.domain.errors import LayoutMismatch, ProtocolError
from rd2h.domain.planning.layout import (
    DestinationLayout,
    DestTensor,
    HeadRange,
    MainSlice,
    SourceLayout,
    TensorComponent,
    main_slices,
    validate_layout,
)
from rd2h.domain.planning.planning import Destination, plan_reads
from rd2h.domain.wire.protocol import ReadReadyBatch, ReadRequest, decode_layer_metadata

LAYER = "model.layers.0.self_attn.attn"
HEADS, BLOCK, WIDTH = 4, 16, 8  # total KV heads, tokens per block, floats per token row
PER_HEAD = BLOCK * WIDTH * 4  # bytes of one head in one block (float32)


def _cache(blocks: int, heads: int, fill: float = 0.0) -> np.ndarray:
    return np.full((blocks, heads, BLOCK, WIDTH), fill, dtype=np.float32)


def _src(arr: np.ndarray, heads: HeadRange | None) -> SourceLayout:
    return SourceLayout(LAYER, (TensorComponent(arr.ctypes.data, arr.strides[0],
                                                num_blocks=arr.shape[0]),), heads=heads)


def _dst(arr: np.ndarray, heads: HeadRange | None) -> DestinationLayout:
    return DestinationLayout(LAYER, (DestTensor(arr.ctypes.data, arr.strides[0],
                                                arr.shape[0]),), heads=heads)


def _run(plan) -> None:
    for local, remote, length in zip(plan.local_addrs, plan.remote_addrs, plan.lengths):
        ctypes.memmove(int(local), int(remote), int(length))


def _batch(member: int, ratio: int, src_blocks, done=False) -> ReadReadyBatch:
    req = ReadRequest("r1", tuple(src_blocks), ())
    return ReadReadyBatch(0, LAYER, (req,), ("r1",) if done else (), member, ratio)


@pytest.mark.parametrize("ratio", [2, 4])
def test_each_member_fills_its_heads_of_every_decode_block(ratio):
    """Prefill TP = ratio x Decode TP 1: member m holds heads [m*h, (m+1)*h); after every
    member's plan runs, Decode's blocks hold every head, in order, in the right blocks."""
    h = HEADS // ratio
    src_blocks, dst_blocks = [5, 2, 3], [1, 7, 8]
    prefill = [_cache(10, h, fill=0.0) for _ in range(ratio)]
    for m, arr in enumerate(prefill):
        for b in src_blocks:
            for j in range(h):
                arr[b, j] = 100 * (m * h + j) + b  # head id and source block in the value
    decode = _cache(12, HEADS, fill=-1.0)
    dst = _dst(decode, HeadRange(0, HEADS, HEADS))
    dests = {"r1": Destination(np.array(dst_blocks), np.array([], dtype=np.int64))}
    for m, arr in enumerate(prefill):
        src = _src(arr, HeadRange(m * h, h, HEADS))
        assert main_slices(src, dst) == (MainSlice(0, m * h * PER_HEAD, h * PER_HEAD),)
        plan = plan_reads(_batch(m, ratio, src_blocks), src, dst, dests, d_rank=0, d_tp=1,
                          main_shared=False)
        assert plan.num_descriptors == len(src_blocks)  # one per block: no runs on Decode
        assert set(plan.lengths.tolist()) == {h * PER_HEAD}
        _run(plan)
    for sb, db in zip(src_blocks, dst_blocks):
        for head in range(HEADS):
            assert (decode[db, head] == 100 * head + sb).all(), (db, head)
    untouched = [b for b in range(12) if b not in dst_blocks]
    assert (decode[untouched] == -1.0).all()


def test_replicated_heads_still_read_from_member_zero_only():
    """Every member holds all heads (MLA's latent, or heads stated equal): only member 0
    reads main, whole blocks, runs merged."""
    arr, decode = _cache(8, HEADS), _cache(8, HEADS)
    same = HeadRange(0, HEADS, HEADS)
    src, dst = _src(arr, same), _dst(decode, same)
    dests = {"r1": Destination(np.array([3, 4]), np.array([], dtype=np.int64))}
    assert main_slices(src, dst) is None
    one = plan_reads(_batch(1, 2, [0, 1]), src, dst, dests, d_rank=0, d_tp=1,
                     main_shared=False)
    assert one.num_descriptors == 0
    zero = plan_reads(_batch(0, 2, [0, 1]), src, dst, dests, d_rank=0, d_tp=1,
                      main_shared=False)
    assert zero.num_descriptors == 1 and int(zero.lengths[0]) == 2 * arr.strides[0]


def test_a_peer_without_the_extension_is_refused_as_before():
    """Either side not stating heads: blocks must match whole, so half-size blocks are
    the clear "main layout mismatch" they always were."""
    half, full = _cache(4, HEADS // 2), _cache(4, HEADS)
    for sh, dh in [(None, HeadRange(0, HEADS, HEADS)), (HeadRange(0, 2, HEADS), None)]:
        with pytest.raises(LayoutMismatch, match="source block is"):
            validate_layout(_src(half, sh), _dst(full, dh))


@pytest.mark.parametrize(("src_heads", "match"), [
    (HeadRange(2, 2, 8), "not a part of them"),  # another model (8 heads)
    (HeadRange(1, 2, HEADS), "bytes for 2 heads"),  # inside, but the block size is off
])
def test_heads_that_do_not_fit_are_a_layout_mismatch(src_heads, match):
    src = _src(_cache(4, 1), src_heads)  # a one-head block
    dst = _dst(_cache(4, HEADS), HeadRange(0, HEADS, HEADS))
    with pytest.raises(LayoutMismatch, match=match):
        validate_layout(src, dst)


def test_decode_heads_outside_its_own_range_are_refused():
    """Decode rank 1 of 2 holds heads [2, 4): Prefill's heads [0, 1) are not its own."""
    src = _src(_cache(4, 1), HeadRange(0, 1, HEADS))
    dst = _dst(_cache(4, 2), HeadRange(2, 2, HEADS))
    with pytest.raises(LayoutMismatch, match="not a part of them"):
        main_slices(src, dst)


def test_main_heads_travel_in_mf_meta_and_bad_ones_are_refused():
    layout = _src(_cache(4, 2), HeadRange(2, 2, HEADS))
    meta = layout.to_metadata()
    wire = meta.to_map()
    assert wire["main_heads"] == [2, 2, HEADS]
    back = SourceLayout.from_metadata(LAYER, decode_layer_metadata(LAYER, wire))
    assert back.heads == HeadRange(2, 2, HEADS)
    # A layout without heads sends no key (older peers' shape).
    assert "main_heads" not in _src(_cache(4, 2), None).to_metadata().to_map()
    for bad in ([2, 2], [0, 0, 4], [3, 2, 4], [0, 1, 0], [True, 1, 4], "x"):
        with pytest.raises(ProtocolError, match="main_heads"):
            decode_layer_metadata(LAYER, {**wire, "main_heads": bad})


@pytest.mark.parametrize("fan", [2, 4])
def test_decode_ranks_above_prefill_each_read_their_heads_of_the_prefill_block(fan):
    """Decode TP = fan x Prefill TP 1: Decode rank d holds heads [d*h, (d+1)*h) and reads
    exactly that slice of every Prefill block (member 0 of a group of 1)."""
    h = HEADS // fan
    src_blocks, dst_blocks = [4, 0, 9], [2, 3, 6]
    prefill = _cache(10, HEADS)
    for b in src_blocks:
        for head in range(HEADS):
            prefill[b, head] = 100 * head + b
    src = _src(prefill, HeadRange(0, HEADS, HEADS))
    dests = {"r1": Destination(np.array(dst_blocks), np.array([], dtype=np.int64))}
    for d in range(fan):
        decode = _cache(8, h, fill=-1.0)
        dst = _dst(decode, HeadRange(d * h, h, HEADS))
        assert main_slices(src, dst) == (MainSlice(d * h * PER_HEAD, 0, h * PER_HEAD),)
        plan = plan_reads(_batch(0, 1, src_blocks), src, dst, dests, d_rank=d, d_tp=fan,
                          main_shared=False)
        _run(plan)
        for sb, db in zip(src_blocks, dst_blocks):
            for j in range(h):
                assert (decode[db, j] == 100 * (d * h + j) + sb).all(), (d, db, j)
        assert (decode[[b for b in range(8) if b not in dst_blocks]] == -1.0).all()
