"""Planning reuses a block plan across the layers of a chunk: its descriptor template
(offsets once, each layer's bases added) and its layout check must give exactly the
descriptors a fresh plan of that layer gives, for random layers and messages."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.domain.errors import LayoutMismatch
from rd2h.domain.planning.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.planning.planning import Destination, PlanMemo, plan_reads
from rd2h.domain.wire.protocol import ReadReadyBatch, ReadRequest

BPB = (4096, 512, 512, 16)  # main K, main V, indexer, scale: bytes per block
POOL = 64


def layouts(layer: int, packed: bool, base_step: int) -> tuple[SourceLayout, DestinationLayout]:
    """One layer's layouts; ``packed``: each tensor starts where the previous one ends
    (descriptors may merge across the tensor boundary)."""
    p_at, d_at = (1 << 30) + layer * base_step, (1 << 40) + layer * base_step
    src, dst = [], []
    for size in BPB:
        src.append(TensorComponent(p_at, size, 1, 0, num_blocks=POOL))
        dst.append(DestTensor(d_at, size, POOL))
        gap = 0 if packed else 1 << 20
        p_at += size * POOL + gap
        d_at += size * POOL + gap
    name = f"model.layers.{layer}.self_attn"
    return (SourceLayout(name, (src[0], src[1]), src[2], src[3]),
            DestinationLayout(name, (dst[0], dst[1]), dst[2], dst[3]))


def descriptors(plan) -> list[tuple[int, int, int]]:
    return list(zip(plan.local_addrs.tolist(), plan.remote_addrs.tolist(),
                    plan.lengths.tolist(), strict=True))


@settings(deadline=None, max_examples=80)
@given(
    data=st.data(),
    member=st.integers(0, 3),
    d_rank=st.integers(0, 3),
    packed=st.booleans(),
    layers=st.integers(2, 5),
)
def test_reused_block_plan_gives_each_layer_its_fresh_descriptors(data, member, d_rank, packed,
                                                                  layers) -> None:
    n = data.draw(st.integers(1, 24))
    contiguous = data.draw(st.booleans())
    p_ids = tuple(range(5, 5 + n)) if contiguous else tuple(
        data.draw(st.permutations(range(POOL)))[:n])
    d_main = np.array(data.draw(st.permutations(range(POOL)))[:n], dtype=np.int64)
    d_idx = np.arange(n, dtype=np.int64) + 3 if contiguous else d_main[::-1].copy()
    dests = {"r": Destination(d_main, d_idx)}
    memo = PlanMemo()
    for layer in range(layers):
        src, dst = layouts(layer, packed, base_step=1 << 32)
        batch = ReadReadyBatch(layer, src.layer_name, (ReadRequest("r", p_ids, p_ids, 0, 0),),
                               (), member, 4)
        kw = {"d_rank": d_rank, "d_tp": 4, "main_shared": True}
        fresh = plan_reads(batch, src, dst, dests, **kw)
        reused = plan_reads(batch, src, dst, dests, memo=memo, owner="peer", **kw)
        assert descriptors(reused) == descriptors(fresh)
        assert reused.requests == fresh.requests
    assert memo.hits == layers - 1


def test_a_layout_mismatch_is_refused_on_every_layer_even_with_the_memo() -> None:
    memo = PlanMemo()
    src, dst = layouts(0, False, 1 << 32)
    bad = DestinationLayout(dst.layer_name, dst.main, DestTensor(dst.indexer.base_addr, 1024, POOL),
                            dst.scale)
    batch = ReadReadyBatch(0, src.layer_name, (ReadRequest("r", (1, 2), (1, 2), 0, 0),), (), 0, 1)
    dests = {"r": Destination(np.array([3, 4]), np.array([5, 6]))}
    for _ in range(2):
        with pytest.raises(LayoutMismatch):
            plan_reads(batch, src, bad, dests, d_rank=0, d_tp=1, memo=memo, owner="p")
    ok = plan_reads(batch, src, dst, dests, d_rank=0, d_tp=1, memo=memo, owner="p")
    assert ok.num_descriptors > 0
