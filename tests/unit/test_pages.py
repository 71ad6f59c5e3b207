"""A tensor's page smaller than its block (issue #58): vLLM's packed layouts put other
layers' pages between a layer's blocks. Planning reads exactly each page, the wire
states it, digests cover it, and a side whose page differs is refused."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from rd2h.domain.errors import LayoutMismatch, ProtocolError
from rd2h.domain.planning.digests import source_spans
from rd2h.domain.planning.layout import (
    DestinationLayout,
    DestTensor,
    SourceLayout,
    TensorComponent,
    validate_layout,
)
from rd2h.domain.planning.planning import Destination, plan_reads
from rd2h.domain.wire.protocol import ReadReadyBatch, ReadRequest, decode_layer_metadata

LAYER = "model.layers.1.attn"
BLOCK, PAGE, OFFSET = 96, 40, 24  # bytes: a packed block, this layer's page, its offset


def _packed(blocks: int, fill: int) -> np.ndarray:
    return np.full((blocks, BLOCK), fill, dtype=np.uint8)


def _src(arr: np.ndarray) -> SourceLayout:
    return SourceLayout(LAYER, (TensorComponent(arr.ctypes.data + OFFSET, BLOCK,
                                                num_blocks=arr.shape[0], page_bytes=PAGE),))


def _dst(arr: np.ndarray, page: int | None = PAGE) -> DestinationLayout:
    return DestinationLayout(LAYER, (DestTensor(arr.ctypes.data + OFFSET, BLOCK,
                                                arr.shape[0], page),))


def test_consecutive_blocks_are_read_page_by_page_and_nothing_else() -> None:
    prefill = np.arange(10 * BLOCK, dtype=np.int64).astype(np.uint8).reshape(10, BLOCK)
    decode = _packed(12, 0xEE)
    src_blocks, dst_blocks = [3, 4, 5], [7, 8, 9]  # runs on both sides: still one a page
    req = ReadRequest("r1", tuple(src_blocks), ())
    plan = plan_reads(ReadReadyBatch(0, LAYER, (req,), ("r1",), 0, 1), _src(prefill),
                      _dst(decode), {"r1": Destination(np.array(dst_blocks),
                                                       np.array([], dtype=np.int64))},
                      d_rank=0, d_tp=1, main_shared=False)
    assert plan.num_descriptors == 3 and set(plan.lengths.tolist()) == {PAGE}
    for local, remote, length in zip(plan.local_addrs, plan.remote_addrs, plan.lengths):
        ctypes.memmove(int(local), int(remote), int(length))
    want = _packed(12, 0xEE)
    for s, d in zip(src_blocks, dst_blocks):
        want[d, OFFSET:OFFSET + PAGE] = prefill[s, OFFSET:OFFSET + PAGE]
    assert (decode == want).all()


def test_pages_travel_in_mf_meta_only_where_a_page_is_not_its_block() -> None:
    arr = _packed(4, 0)
    wire = _src(arr).to_metadata().to_map()
    assert wire["page_bytes"] == [PAGE]
    back = SourceLayout.from_metadata(LAYER, decode_layer_metadata(LAYER, wire))
    assert back.main[0].page == PAGE and back.main[0].bytes_per_block == BLOCK
    whole = SourceLayout(LAYER, (TensorComponent(arr.ctypes.data, BLOCK, num_blocks=4),))
    assert "page_bytes" not in whole.to_metadata().to_map()  # the legacy shape
    for bad in ([0], [PAGE, PAGE], ["x"], -1):
        with pytest.raises(ProtocolError, match="page_bytes"):
            decode_layer_metadata(LAYER, {**wire, "page_bytes": bad})
    with pytest.raises(LayoutMismatch, match="page"):
        SourceLayout.from_metadata(LAYER, decode_layer_metadata(
            LAYER, {**wire, "page_bytes": [BLOCK + 1]}))


def test_a_side_whose_page_differs_is_refused_naming_both() -> None:
    arr = _packed(4, 0)
    validate_layout(_src(arr), _dst(arr))
    legacy = SourceLayout(LAYER, (TensorComponent(arr.ctypes.data, BLOCK, num_blocks=4),))
    with pytest.raises(LayoutMismatch, match=rf"{BLOCK} bytes, destination block is a "
                                             rf"{PAGE}-byte page of {BLOCK}"):
        validate_layout(legacy, _dst(arr))
    # Blocks of other sizes around the same page are fine (one side packed, one not).
    other = np.zeros((4, PAGE), dtype=np.uint8)
    validate_layout(_src(arr), DestinationLayout(LAYER, (DestTensor(other.ctypes.data, PAGE,
                                                                     4),)))


def test_digests_cover_the_page() -> None:
    arr = _packed(6, 0)
    spans = source_spans(_src(arr), ReadRequest("r1", (2, 5), ()))
    (addrs, size), = spans
    assert size == PAGE
    assert addrs.tolist() == [arr.ctypes.data + OFFSET + b * BLOCK for b in (2, 5)]
