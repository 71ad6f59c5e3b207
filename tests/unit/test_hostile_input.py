"""Hostile numbers on the control plane, in the pure core: wire bounds (int64), Prefill's
advertised region sizes (``num_blocks``), and the planner's two bounds (reads inside
Prefill's advertised regions, writes inside the request's own destination blocks)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.adapters.msgpack import MsgpackCodec
from rd2h.domain.errors import LayoutMismatch, PlanningError, ProtocolError, UnknownMessageType
from rd2h.domain.planning.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.planning.planning import Destination, plan_reads
from rd2h.domain.wire.protocol import (
    MAX_ERROR_CHARS,
    MAX_WIRE_INT,
    MF_META,
    READ_READY_BATCH,
    LayerMetadata,
    MfMeta,
    ReadReadyBatch,
    ReadRequest,
    clip,
)

CODEC = MsgpackCodec()
LAYER = "model.layers.0.self_attn"
P_BLOCKS = 8
D_BLOCKS = 12
SIZES = {"k": 64, "v": 16, "idx": 8, "scale": 4}
GIB = 1 << 30


def pack(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def ready(*entries, tail=([], 0, 1), layer=3) -> bytes:
    return pack([READ_READY_BATCH, layer, LAYER, list(entries), *tail])


# ====================================================================== wire bounds


@pytest.mark.parametrize(
    "frame",
    [
        ready(["r", [2**63], [1], 0, 0]),
        ready(["r", [1], [2**64 - 1], 0, 0]),
        ready(["r", [2**63]]),
        ready(["r", [1], [1], 2**63, 0]),
        ready(["r", [1], [1], 0, 2**64 - 1]),
        ready(tail=([], 2**63, 2**64 - 1)),
        ready(tail=([], 0, 2**63)),
    ],
)
def test_numbers_beyond_int64_are_malformed_for_their_layer(frame):
    with pytest.raises(ProtocolError) as ei:
        CODEC.decode(frame)
    assert ei.value.layer_idx == 3


def test_int64_edge_values_still_decode():
    msg = CODEC.decode(ready(["r", [MAX_WIRE_INT], [0], MAX_WIRE_INT, 0],
                             tail=([], MAX_WIRE_INT - 1, MAX_WIRE_INT)))
    assert msg.read_reqs[0].p_main_block_ids == (MAX_WIRE_INT,)
    assert msg.read_reqs[0].main_start_block == MAX_WIRE_INT
    assert (msg.group_member_idx, msg.tp_ratio) == (MAX_WIRE_INT - 1, MAX_WIRE_INT)


def test_error_texts_about_hostile_values_stay_short():
    with pytest.raises(UnknownMessageType) as ei:
        CODEC.decode(pack([b"x" * 1_000_000, 1]))
    assert len(str(ei.value)) < 200
    with pytest.raises(ProtocolError) as ei:
        CODEC.decode(ready(["r", ["y" * 500_000]]))
    assert len(ei.value.detail) < 300
    with pytest.raises(ProtocolError) as ei:
        CODEC.decode(pack([MF_META, "s", {"z" * 500_000: {}}]))
    assert len(ei.value.detail) < 300
    assert clip("a" * 5000) == "a" * (MAX_ERROR_CHARS - 3) + "..."
    assert clip("short") == "short"


# ====================================================================== advertised regions


META_MAP = {
    "base_addrs": [GIB, 2 * GIB],
    "block_len": [64, 8],
    "block_size_scale": [1, 1],
    "tensor_group_idx": [0, 1],
    "main_tensor_count": 1,
    "has_indexer": True,
}


def meta_frame(layer_map) -> bytes:
    return pack([MF_META, "sess", pack({LAYER: layer_map})])


def test_legacy_metadata_without_region_sizes_keeps_its_old_shape():
    meta = CODEC.decode(meta_frame(META_MAP)).layers[LAYER]
    assert meta.num_blocks == ()
    assert meta.to_map() == META_MAP  # no new key appears on re-encoding
    src = SourceLayout.from_metadata(LAYER, meta)
    assert src.main[0].num_blocks is None and src.indexer.num_blocks is None


def test_region_sizes_round_trip_through_the_wire_and_the_layout():
    meta = CODEC.decode(meta_frame({**META_MAP, "num_blocks": [8, 4]})).layers[LAYER]
    assert meta.num_blocks == (8, 4)
    src = SourceLayout.from_metadata(LAYER, meta)
    assert (src.main[0].num_blocks, src.indexer.num_blocks) == (8, 4)
    assert src.to_metadata() == meta
    again = CODEC.decode(CODEC.encode(MfMeta("sess", {LAYER: src.to_metadata()})))
    assert again.layers[LAYER] == meta


def test_a_partly_sized_layout_advertises_no_sizes():
    src = SourceLayout(LAYER, (TensorComponent(GIB, 64, num_blocks=8),), TensorComponent(GIB, 8))
    assert src.to_metadata().num_blocks == ()


@pytest.mark.parametrize(
    "sizes", [[8], [8, 4, 2], [8, -1], [8, 1.0], [8, None], "8", [8, 2**63], [True, 4]]
)
def test_malformed_region_sizes_are_refused(sizes):
    with pytest.raises(ProtocolError, match="num_blocks"):
        CODEC.decode(meta_frame({**META_MAP, "num_blocks": sizes}))


def test_region_sizes_of_the_wrong_count_are_a_layout_mismatch():
    meta = LayerMetadata((GIB,), (64,), (1,), (0,), 1, False, num_blocks=(8, 8))
    with pytest.raises(LayoutMismatch, match="region sizes"):
        SourceLayout.from_metadata(LAYER, meta)


# ====================================================================== planner bounds


def layouts(
    *, sizes: int | None = P_BLOCKS, bases: tuple[int, ...] = (GIB, 2 * GIB, 3 * GIB, 4 * GIB)
) -> tuple[SourceLayout, DestinationLayout]:
    src = [TensorComponent(b, SIZES[c], num_blocks=sizes) for b, c in zip(bases, SIZES)]
    dst = [DestTensor((8 + i) * GIB, SIZES[c], D_BLOCKS) for i, c in enumerate(SIZES)]
    return (
        SourceLayout(LAYER, tuple(src[:2]), src[2], src[3]),
        DestinationLayout(LAYER, tuple(dst[:2]), dst[2], dst[3]),
    )


def plan(req: ReadRequest, dest: Destination, src=None, dst=None, **kw):
    if src is None:
        src, dst = layouts()
    batch = ReadReadyBatch(0, LAYER, (req,), (), kw.pop("member", 0), kw.pop("ratio", 1))
    return plan_reads(batch, src, dst, {req.ext_req_id: dest}, d_rank=0, d_tp=1, **kw)


DEST = Destination((0, 1, 2, 3), (4, 5, 6, 7))


def test_last_advertised_block_is_read_and_the_next_is_refused():
    p = plan(ReadRequest("r", (P_BLOCKS - 1,), (P_BLOCKS - 1,)), DEST)
    assert p.num_descriptors == 4
    with pytest.raises(PlanningError, match=f"main source block {P_BLOCKS} is beyond the "
                                            f"{P_BLOCKS} blocks prefill advertised") as ei:
        plan(ReadRequest("r", (0, P_BLOCKS), (0,)), DEST)
    assert ei.value.ext_req_id == "r"
    with pytest.raises(PlanningError, match="indexer source block 9"):
        plan(ReadRequest("r", (0,), (9,)), DEST)


def test_the_request_at_fault_is_named_among_several():
    src, dst = layouts()
    batch = ReadReadyBatch(0, LAYER, (
        ReadRequest("good", (1, 2), (1, 2)),
        ReadRequest("bad", (3, 50), (3, 4)),
    ))
    dests = {"good": DEST, "bad": Destination((8, 9), (8, 9))}
    with pytest.raises(PlanningError) as ei:
        plan_reads(batch, src, dst, dests, d_rank=0, d_tp=1)
    assert ei.value.ext_req_id == "bad" and "50" in ei.value.detail


def test_zero_advertised_blocks_refuse_every_read():
    src, dst = layouts(sizes=0)
    with pytest.raises(PlanningError, match="the 0 blocks"):
        plan(ReadRequest("r", (0,), (0,)), DEST, src, dst)


@pytest.mark.parametrize("base", [2**63 - 1, 2**63, 2**64 - 1, 2**63 - 64 * 3])
def test_legacy_source_addresses_beyond_64_bits_are_refused(base):
    src, dst = layouts(sizes=None, bases=(base, 2 * GIB, 3 * GIB, 4 * GIB))
    with pytest.raises(PlanningError, match="64-bit address space"):
        plan(ReadRequest("r", (3,), (3,)), DEST, src, dst)


def test_legacy_source_block_ids_beyond_64_bits_are_refused():
    src, dst = layouts(sizes=None)
    with pytest.raises(PlanningError, match="64-bit address space"):
        plan(ReadRequest("r", (MAX_WIRE_INT // 64,), ()), DEST, src, dst)


@pytest.mark.parametrize("start", [MAX_WIRE_INT, MAX_WIRE_INT - 1, 2**62, D_BLOCKS])
def test_start_offsets_near_int64_max_do_not_wrap_around(start):
    with pytest.raises(PlanningError, match="do not fit"):
        plan(ReadRequest("r", (1, 2), (1, 2), start, 0), DEST)
    with pytest.raises(PlanningError, match="do not fit"):
        plan(ReadRequest("r", (1, 2), (1, 2), 0, start), DEST)


# -------------------------------------------------- the two bounds, as a property

edge_blocks = st.integers(0, P_BLOCKS + 2) | st.sampled_from([MAX_WIRE_INT, 2**40])
edge_starts = st.integers(0, 5) | st.sampled_from([MAX_WIRE_INT, MAX_WIRE_INT - 1, 2**40])


@st.composite
def hostile_batches(draw):
    exts = [f"r{i}" for i in range(draw(st.integers(1, 3)))]
    reqs, dests = [], {}
    for ext in exts:
        reqs.append(ReadRequest(
            ext,
            tuple(draw(st.lists(edge_blocks, max_size=5))),
            tuple(draw(st.lists(edge_blocks, max_size=5))),
            draw(edge_starts),
            draw(edge_starts),
        ))
        # Decode's own lists may be wrong too (beyond its allocation): refused, not written
        ids = st.lists(st.integers(0, D_BLOCKS + 2), max_size=6)
        dests[ext] = Destination(tuple(draw(ids)), tuple(draw(ids)))
    ratio = draw(st.integers(1, 3))
    batch = ReadReadyBatch(0, LAYER, tuple(reqs), (), draw(st.integers(0, ratio - 1)), ratio)
    d_tp = draw(st.integers(1, 3))
    return batch, dests, draw(st.integers(0, d_tp - 1)), d_tp, draw(st.booleans())


def inside(addrs, lens, regions) -> bool:
    """Every range ``[addrs[i], addrs[i] + lens[i])`` lies inside one of ``regions``."""
    return all(
        any(lo <= a and a + n <= hi for lo, hi in regions)
        for a, n in zip(addrs.tolist(), lens.tolist())
    )


@given(hostile_batches())
@settings(max_examples=400, deadline=None)
def test_plans_read_only_advertised_blocks_and_write_only_the_requests_blocks(case):
    batch, dests, d_rank, d_tp, sized = case
    src, dst = layouts(sizes=P_BLOCKS if sized else None)
    try:
        p = plan_reads(batch, src, dst, dests, d_rank=d_rank, d_tp=d_tp)
    except (PlanningError, LayoutMismatch):
        return
    assert (p.lengths > 0).all()
    # reads: inside the advertised regions (legacy: inside the 64-bit range)
    if sized:
        readable = [(t.base_addr, t.base_addr + P_BLOCKS * t.bytes_per_block)
                    for t in src.tensors]
    else:
        readable = [(0, 2**63)]
    assert inside(p.remote_addrs, p.lengths, readable)
    # writes: only blocks of the requests this message names, of the right component
    named = {r.ext_req_id for r in batch.read_reqs}
    writable = []
    for comp, tensors in (("main", dst.main), ("idx", (dst.indexer, dst.scale))):
        for t in tensors:
            for ext in named:
                ids = dests[ext].main_block_ids if comp == "main" else dests[ext].indexer_block_ids
                writable += [
                    (t.base_addr + b * t.bytes_per_block, t.base_addr + (b + 1) * t.bytes_per_block)
                    for b in ids.tolist() if b < t.num_blocks
                ]
    # coalesced descriptors span several blocks: check block by block
    for a, n in zip(p.local_addrs.tolist(), p.lengths.tolist()):
        step = min(t.bytes_per_block for t in (*dst.main, dst.indexer, dst.scale)
                   if t.base_addr <= a < t.base_addr + t.num_blocks * t.bytes_per_block)
        for at in range(a, a + n, step):
            assert any(lo <= at and at + step <= hi for lo, hi in writable), (at, step)
    assert np.all(p.local_addrs >= 0)
