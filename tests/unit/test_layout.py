"""Source/destination layouts, MF_META metadata round trips and validation (spec 4.1, 6)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.domain.errors import LayoutMismatch, Rd2hError
from rd2h.domain.planning.layout import (
    DestinationLayout,
    DestTensor,
    SourceLayout,
    TensorComponent,
    per_block_bytes_from_rows,
    validate_layout,
)
from rd2h.domain.wire.protocol import LayerMetadata

LAYER = "model.layers.3.self_attn.attn"

# DeepSeek-V3.2-like reference shapes (spec 13), block size 128 tokens.
MAIN_K_BYTES = 128 * 512 * 2  # 131072
MAIN_V_BYTES = 128 * 64 * 2  # 16384
INDEXER_BYTES = 128 * 128  # 16384
SCALE_BYTES = 128 * 4  # 512


def _src(*, mains=2, indexer=True, scale=True) -> SourceLayout:
    main = (
        TensorComponent(0x1000_0000, 512, 256, 0),  # 512 x 256 = 131072
        TensorComponent(0x2000_0000, MAIN_V_BYTES, 1, 0),
    )[:mains]
    return SourceLayout(
        LAYER,
        main,
        TensorComponent(0x3000_0000, INDEXER_BYTES, 1, 1) if indexer else None,
        TensorComponent(0x4000_0000, 128, 4, 1) if scale else None,  # 128 x 4 = 512
    )


def _dst(*, mains=2, indexer=True, scale=True) -> DestinationLayout:
    main = (DestTensor(0x9000_0000, MAIN_K_BYTES, 64), DestTensor(0xA000_0000, MAIN_V_BYTES, 64))
    return DestinationLayout(
        LAYER,
        main[:mains],
        DestTensor(0xB000_0000, INDEXER_BYTES, 64) if indexer else None,
        DestTensor(0xC000_0000, SCALE_BYTES, 64) if scale else None,
    )


# ------------------------------------------------------------------ components


def test_bytes_per_block_is_block_len_times_scale():
    assert TensorComponent(0, 512, 256).bytes_per_block == 131072
    assert TensorComponent(0, 100).bytes_per_block == 100
    assert TensorComponent(0, 0, 5).bytes_per_block == 0


def test_tensors_order_and_storage_keys():
    src = _src()
    assert [t.base_addr for t in src.tensors] == [
        0x1000_0000,
        0x2000_0000,
        0x3000_0000,
        0x4000_0000,
    ]
    assert src.storage_keys == ((0x1000_0000, 0x2000_0000), (0x3000_0000, 0x4000_0000))
    assert _src(scale=False).storage_keys == ((0x1000_0000, 0x2000_0000), (0x3000_0000,))
    assert _src(mains=1, indexer=False, scale=False).storage_keys == ((0x1000_0000,), None)


def test_source_layout_rejects_more_than_two_mains():
    t = TensorComponent(0, 1)
    with pytest.raises(LayoutMismatch) as ei:
        SourceLayout(LAYER, (t, t, t))
    assert (ei.value.layer, ei.value.component) == (LAYER, "main")


def test_source_layout_rejects_scale_without_indexer():
    t = TensorComponent(0, 1)
    with pytest.raises(LayoutMismatch) as ei:
        SourceLayout(LAYER, (t,), None, t)
    assert (ei.value.layer, ei.value.component) == (LAYER, "scale")


# ------------------------------------------------------------------ metadata round trip


@pytest.mark.parametrize("mains", [1, 2])
@pytest.mark.parametrize(("indexer", "scale"), [(False, False), (True, False), (True, True)])
def test_metadata_round_trip(mains, indexer, scale):
    src = _src(mains=mains, indexer=indexer, scale=scale)
    meta = src.to_metadata()
    assert meta.main_tensor_count == mains
    assert meta.has_indexer is indexer
    n = mains + int(indexer) + int(scale)
    assert len(meta.base_addrs) == len(meta.block_len) == n
    assert len(meta.block_size_scale) == len(meta.tensor_group_idx) == n
    assert meta.base_addrs == tuple(t.base_addr for t in src.tensors)
    assert meta.block_len == tuple(t.block_len for t in src.tensors)
    assert meta.block_size_scale == tuple(t.block_size_scale for t in src.tensors)
    assert meta.tensor_group_idx == tuple(t.group_idx for t in src.tensors)
    assert SourceLayout.from_metadata(LAYER, meta) == src


def test_from_metadata_reference_ascend_layout():
    meta = LayerMetadata(
        base_addrs=(100, 200, 300, 400),
        block_len=(512, 128, 16384, 128),
        block_size_scale=(256, 128, 1, 4),
        tensor_group_idx=(0, 0, 1, 1),
        main_tensor_count=2,
        has_indexer=True,
    )
    src = SourceLayout.from_metadata(LAYER, meta)
    assert src.layer_name == LAYER
    assert src.main == (TensorComponent(100, 512, 256, 0), TensorComponent(200, 128, 128, 0))
    assert src.indexer == TensorComponent(300, 16384, 1, 1)
    assert src.scale == TensorComponent(400, 128, 4, 1)


components = st.builds(
    TensorComponent,
    base_addr=st.integers(0, 2**48),
    block_len=st.integers(1, 2**20),
    block_size_scale=st.integers(1, 512),
    group_idx=st.integers(0, 4),
)


@st.composite
def source_layouts(draw):
    main = tuple(draw(st.lists(components, min_size=0, max_size=2)))
    indexer = draw(st.none() | components)
    scale = draw(st.none() | components) if indexer is not None else None
    name = draw(st.text(min_size=1, max_size=30))
    return SourceLayout(name, main, indexer, scale)


@given(source_layouts())
@settings(max_examples=300, deadline=None)
def test_metadata_round_trip_property(src):
    assert SourceLayout.from_metadata(src.layer_name, src.to_metadata()) == src


def _meta(n, mc, has_indexer) -> LayerMetadata:
    return LayerMetadata(
        base_addrs=tuple(range(1, n + 1)),
        block_len=(64,) * n,
        block_size_scale=(1,) * n,
        tensor_group_idx=(0,) * n,
        main_tensor_count=mc,
        has_indexer=has_indexer,
    )


@pytest.mark.parametrize(
    ("n", "mc", "has_indexer", "component"),
    [
        (3, 3, False, "main"),  # more than two main tensors
        (4, 3, True, "main"),
        (1, 2, False, "main"),  # fewer base addresses than main tensors
        (0, 1, False, "main"),
        (3, 2, False, "indexer"),  # extra tensors but has_indexer false
        (4, 2, False, "indexer"),
        (2, 2, True, "indexer"),  # has_indexer but no indexer tensor
        (1, 1, True, "indexer"),
        (5, 2, True, "scale"),  # more than indexer + scale after main
        (4, 1, True, "scale"),
    ],
)
def test_malformed_metadata_is_rejected(n, mc, has_indexer, component):
    with pytest.raises(LayoutMismatch) as ei:
        SourceLayout.from_metadata(LAYER, _meta(n, mc, has_indexer))
    assert ei.value.layer == LAYER
    assert ei.value.component == component
    assert LAYER in str(ei.value)


def test_layout_mismatch_is_an_rd2h_error():
    with pytest.raises(Rd2hError):
        SourceLayout.from_metadata(LAYER, _meta(1, 2, False))


# ------------------------------------------------------------------ validation (spec 6)


@pytest.mark.parametrize("mains", [1, 2])
@pytest.mark.parametrize(("indexer", "scale"), [(False, False), (True, False), (True, True)])
def test_matching_layouts_are_accepted(mains, indexer, scale):
    src = _src(mains=mains, indexer=indexer, scale=scale)
    dst = _dst(mains=mains, indexer=indexer, scale=scale)
    assert validate_layout(src, dst) is None
    # and after travelling through MF_META
    assert validate_layout(SourceLayout.from_metadata(LAYER, src.to_metadata()), dst) is None


def test_bytes_compare_block_len_times_scale():
    # 512 x 256 = 131072 bytes per external block: matches a 131072-byte destination
    src = SourceLayout(LAYER, (TensorComponent(0, 512, 256),))
    validate_layout(src, DestinationLayout(LAYER, (DestTensor(0, 131072, 8),)))
    # block_len alone (512) is not the block size
    with pytest.raises(LayoutMismatch):
        validate_layout(src, DestinationLayout(LAYER, (DestTensor(0, 512, 8),)))


def _swap(layout, **changes):
    return DestinationLayout(
        changes.get("layer_name", layout.layer_name),
        changes.get("main", layout.main),
        changes.get("indexer", layout.indexer),
        changes.get("scale", layout.scale),
    )


WRONG = DestTensor(0xD000_0000, 999, 64)


@pytest.mark.parametrize(
    ("src", "dst", "component"),
    [
        # main tensor count
        (_src(mains=1), _dst(mains=2), "main"),
        (_src(mains=2), _dst(mains=1), "main"),
        (_src(mains=0), _dst(mains=2), "main"),
        # main per-block bytes (K, then V)
        (_src(), _swap(_dst(), main=(WRONG, _dst().main[1])), "main"),
        (_src(), _swap(_dst(), main=(_dst().main[0], WRONG)), "main"),
        (_src(mains=1), _swap(_dst(mains=1), main=(WRONG,)), "main"),
        # indexer presence, both directions
        (_src(indexer=False, scale=False), _dst(scale=False), "indexer"),
        (_src(scale=False), _dst(indexer=False, scale=False), "indexer"),
        # indexer bytes
        (_src(), _swap(_dst(), indexer=WRONG), "indexer"),
        # scale presence, both directions
        (_src(scale=False), _dst(scale=True), "scale"),
        (_src(scale=True), _dst(scale=False), "scale"),
        # scale bytes
        (_src(), _swap(_dst(), scale=WRONG), "scale"),
    ],
)
def test_each_mismatch_kind_is_rejected(src, dst, component):
    with pytest.raises(LayoutMismatch) as ei:
        validate_layout(src, dst)
    assert ei.value.layer == dst.layer_name == LAYER
    assert ei.value.component == component
    assert component in str(ei.value)


def test_main_checked_before_indexer_and_scale():
    dst = _swap(_dst(), main=(WRONG, WRONG), indexer=WRONG, scale=WRONG)
    with pytest.raises(LayoutMismatch) as ei:
        validate_layout(_src(), dst)
    assert ei.value.component == "main"


def test_indexer_checked_before_scale():
    with pytest.raises(LayoutMismatch) as ei:
        validate_layout(_src(), _swap(_dst(), indexer=WRONG, scale=WRONG))
    assert ei.value.component == "indexer"


@pytest.mark.parametrize(("block_len", "scale"), [(0, 1), (512, 0), (0, 0)])
def test_zero_byte_source_blocks_are_rejected_even_if_destination_agrees(block_len, scale):
    src = SourceLayout(LAYER, (TensorComponent(0, block_len, scale),))
    dst = DestinationLayout(LAYER, (DestTensor(0, 0, 8),))
    with pytest.raises(LayoutMismatch) as ei:
        validate_layout(src, dst)
    assert ei.value.component == "main"


@pytest.mark.parametrize(
    ("tensor_idx", "component"), [(0, "main"), (1, "main"), (2, "indexer"), (3, "scale")]
)
@given(delta=st.integers(1, 4096), sign=st.sampled_from([-1, 1]))
@settings(max_examples=25, deadline=None)
def test_any_byte_difference_is_caught(tensor_idx, component, delta, sign):
    src = _src()
    dsts = [*_dst().main, _dst().indexer, _dst().scale]
    d = dsts[tensor_idx]
    dsts[tensor_idx] = DestTensor(d.base_addr, d.bytes_per_block + sign * delta, d.num_blocks)
    dst = DestinationLayout(LAYER, tuple(dsts[:2]), dsts[2], dsts[3])
    with pytest.raises(LayoutMismatch) as ei:
        validate_layout(src, dst)
    assert ei.value.component == component


# ------------------------------------------------------------------ per_block_bytes_from_rows


@pytest.mark.parametrize(
    ("row_bytes", "rows", "num_blocks", "expected"),
    [
        (128, 128 * 64, 64, INDEXER_BYTES),  # indexer: 128 int8 per token, 128 tokens
        (4, 128 * 10, 10, SCALE_BYTES),  # LIC8 scale: one fp32 per token
        (1024, 128 * 3, 3, MAIN_K_BYTES),  # main K rows of 512 bf16
        (7, 5, 1, 35),
        (16, 0, 4, 0),
    ],
)
def test_per_block_bytes_from_rows(row_bytes, rows, num_blocks, expected):
    assert per_block_bytes_from_rows(row_bytes, rows, num_blocks) == expected


@pytest.mark.parametrize(("rows", "num_blocks"), [(100, 0), (100, -1), (100, 3), (5, 10)])
def test_per_block_bytes_from_rows_rejects(rows, num_blocks):
    with pytest.raises(ValueError):
        per_block_bytes_from_rows(16, rows, num_blocks)


def test_indexer_destination_from_rows_validates_against_source():
    rows_per_block = 128
    dst_idx = DestTensor(0, per_block_bytes_from_rows(128, 64 * rows_per_block, 64), 64)
    dst = _swap(_dst(), indexer=dst_idx)
    validate_layout(_src(), dst)
