"""vLLM's per-layer KV cache tensors as rd2h layouts (``rd2h.adapters.vllm.caches``)
and the Ascend TP-shared host pool (``rd2h.adapters.ascend.sparse_pool``), with real
torch tensors: addresses and per-block strides must match the memory exactly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rd2h.adapters.ascend.sparse_pool import SparseKvPoolDestinations
from rd2h.adapters.vllm.caches import (
    VllmCacheDestinations,
    main_views,
    region_of,
    source_layouts,
)
from rd2h.domain.errors import LayoutMismatch
from rd2h.domain.planning.layout import (
    DestinationLayout,
    DestTensor,
    HeadRange,
    SourceLayout,
    TensorComponent,
)

NB, BS = 6, 4


def _mla(num_blocks: int = NB) -> torch.Tensor:
    return torch.zeros(num_blocks, 1, BS, 576, dtype=torch.bfloat16)


def _kv(num_blocks: int = NB) -> torch.Tensor:
    return torch.zeros(2, num_blocks, BS, 2, 8, dtype=torch.float16)


def test_mla_cache_is_one_main_tensor_of_whole_blocks() -> None:
    t = _mla()
    ((base, per_block, page),) = main_views("model.layers.0.attn", t, NB)
    assert base == t.data_ptr() and page == per_block
    assert per_block == 1 * BS * 576 * 2 == t[0].numel() * t.element_size()
    assert t[3].data_ptr() == base + 3 * per_block  # block b starts where rd2h thinks


def test_kv_cache_is_two_main_tensors_behind_the_kv_axis() -> None:
    t = _kv()
    (k_base, k_bpb, k_page), (v_base, v_bpb, v_page) = main_views("model.layers.0.attn", t, NB)
    assert (k_base, v_base) == (t[0].data_ptr(), t[1].data_ptr())
    assert (k_page, v_page) == (k_bpb, v_bpb)
    assert k_bpb == v_bpb == BS * 2 * 8 * 2
    assert t[1, 4].data_ptr() == v_base + 4 * v_bpb


def test_a_leading_axis_of_one_is_one_main_tensor() -> None:
    t = torch.zeros(1, NB, BS, 8, dtype=torch.float32)
    ((base, per_block, page),) = main_views("l", t, NB)
    assert (base, per_block, page) == (t.data_ptr(), BS * 8 * 4, BS * 8 * 4)


def test_a_view_into_a_larger_allocation_keeps_its_own_offset_stride_and_page() -> None:
    backing = torch.zeros(NB, 2, BS, 8, dtype=torch.float32)
    t = backing[:, 1]  # non-contiguous: every other half-block
    ((base, per_block, page),) = main_views("l", t, NB)
    assert base == backing[0, 1].data_ptr()
    assert per_block == 2 * BS * 8 * 4  # the stride between blocks
    assert page == BS * 8 * 4  # the view's own bytes of a block, not the next block's


def test_a_view_with_gaps_in_its_page_is_refused_naming_it() -> None:
    backing = torch.zeros(NB, BS, 16, dtype=torch.float32)
    with pytest.raises(LayoutMismatch, match=r"model\.layers\.2\.attn.*gaps in its page"):
        main_views("model.layers.2.attn", backing[:, :, :8], NB)  # half of each row


@pytest.mark.parametrize(
    ("tensor", "match"),
    [
        (torch.tensor(1.0), "must have a block dimension"),
        (torch.zeros(BS, 576), r"cannot find 6 blocks in a KV cache of shape \(4, 576\)"),
        (torch.zeros(3, NB, BS), r"cannot find 6 blocks"),  # 3 is not a K/V axis
        (torch.zeros(NB + 1, BS), r"cannot find 6 blocks"),
    ],
)
def test_shapes_without_the_block_dimension_are_refused(tensor, match) -> None:
    with pytest.raises(LayoutMismatch, match=match) as info:
        main_views("model.layers.3.attn", tensor, NB)
    assert "model.layers.3.attn" in str(info.value)


def test_region_is_the_whole_storage() -> None:
    backing = torch.zeros(2 * NB * 16, dtype=torch.uint8)
    view = backing[NB * 16:].view(NB, 16)
    assert region_of(view) == (backing.data_ptr(), backing.numel())


def test_source_layouts_for_mla_layers() -> None:
    caches = {f"model.layers.{i}.self_attn.attn": _mla() for i in range(3)}
    layouts, regions = source_layouts(caches, NB)
    for name, t in caches.items():
        bpb = t[0].numel() * t.element_size()
        assert layouts[name] == SourceLayout(name, (TensorComponent(t.data_ptr(), bpb,
                                                                    num_blocks=NB),))
    assert regions == [(t.data_ptr(), t.numel() * t.element_size()) for t in caches.values()]


def test_source_layouts_of_layers_sharing_one_allocation_register_it_once() -> None:
    backing = torch.zeros(2, NB, 1, BS, 576, dtype=torch.bfloat16)
    caches = {"model.layers.0.attn": backing[0], "model.layers.1.attn": backing[1]}
    layouts, regions = source_layouts(caches, NB)
    assert regions == [(backing.data_ptr(), backing.numel() * 2)]
    assert layouts["model.layers.1.attn"].main[0].base_addr == backing[1].data_ptr()


def test_source_layouts_for_kv_layers_and_their_errors() -> None:
    t = _kv()
    layouts, _ = source_layouts({"model.layers.0.attn": t}, NB)
    assert [c.base_addr for c in layouts["model.layers.0.attn"].main] == [
        t[0].data_ptr(), t[1].data_ptr()]
    with pytest.raises(LayoutMismatch, match=r"model\.layers\.1\.attn"):
        source_layouts({"model.layers.0.attn": t, "model.layers.1.attn": _kv(NB - 1)}, NB)


def test_vllm_cache_destinations_are_rank_local() -> None:
    mla, kv = _mla(), _kv()
    dest = VllmCacheDestinations({"model.layers.0.attn": mla, "model.layers.1.attn": kv}, NB)
    assert dest.main_sharing == "rank_local"
    bpb = BS * 576 * 2
    assert dest.layouts()["model.layers.0.attn"] == DestinationLayout(
        "model.layers.0.attn", (DestTensor(mla.data_ptr(), bpb, NB),))
    kv_bpb = BS * 2 * 8 * 2
    assert dest.layouts()["model.layers.1.attn"].main == (
        DestTensor(kv[0].data_ptr(), kv_bpb, NB), DestTensor(kv[1].data_ptr(), kv_bpb, NB))
    assert list(dest.regions()) == [region_of(mla), region_of(kv)]
    with pytest.raises(LayoutMismatch, match="cannot find"):
        VllmCacheDestinations({"model.layers.0.attn": torch.zeros(BS, 8)}, NB)


# ---------------------------------------------------------------- Ascend shared pool

K_BPB, V_BPB = BS * 512 * 2, BS * 64 * 2


class FakeOffloadManager:
    """SparseKVOffloadManager's duck-typed surface, over real host tensors."""

    def __init__(self, names: list[str], *, with_v: bool = True, num_blocks: int = NB,
                 host_blocks: int = NB) -> None:
        self.offload_layer_names = names
        self.num_blocks = num_blocks
        self.block_bytes = (K_BPB, V_BPB if with_v else 0)
        self.host_kv_caches = {
            n: (torch.zeros(host_blocks, BS, 512, dtype=torch.bfloat16),
                torch.zeros(host_blocks, BS, 64, dtype=torch.bfloat16) if with_v else None)
            for n in names
        }
        self.host_base_addrs = {
            n: (k.data_ptr(), v.data_ptr() if v is not None else 0)
            for n, (k, v) in self.host_kv_caches.items()
        }
        self._ids = {n: i for i, n in enumerate(names)}

    def layer_id(self, name: str) -> int:
        return self._ids[name]


def test_sparse_pool_main_kv_comes_from_the_shared_host_pool() -> None:
    names = ["model.layers.0.attn", "model.layers.1.attn"]
    mgr = FakeOffloadManager(names)
    idx = {n: torch.zeros(10, BS, 128, dtype=torch.uint8) for n in names}
    scale = {names[0]: torch.zeros(10, BS, 4, dtype=torch.float32)}
    dest = SparseKvPoolDestinations(mgr, indexer_caches=idx, scale_caches=scale)
    assert dest.main_sharing == "shared_pool"
    k0, v0 = mgr.host_kv_caches[names[0]]
    lay0 = dest.layouts()[names[0]]
    assert lay0.main == (DestTensor(k0.data_ptr(), K_BPB, NB), DestTensor(v0.data_ptr(), V_BPB, NB))
    assert lay0.indexer == DestTensor(idx[names[0]].data_ptr(), BS * 128, 10)
    assert lay0.scale == DestTensor(scale[names[0]].data_ptr(), BS * 4 * 4, 10)
    assert dest.layouts()[names[1]].scale is None
    regions = set(dest.regions())
    assert (k0.data_ptr(), K_BPB * NB) in regions and (v0.data_ptr(), V_BPB * NB) in regions
    assert region_of(idx[names[1]]) in regions and region_of(scale[names[0]]) in regions
    assert len(dest.regions()) == 2 * 2 + 2 + 1


def test_sparse_pool_without_v_and_without_indexer() -> None:
    mgr = FakeOffloadManager(["model.layers.0.attn"], with_v=False)
    dest = SparseKvPoolDestinations(mgr)
    lay = dest.layouts()["model.layers.0.attn"]
    k, _ = mgr.host_kv_caches["model.layers.0.attn"]
    assert lay == DestinationLayout("model.layers.0.attn", (DestTensor(k.data_ptr(), K_BPB, NB),))
    assert list(dest.regions()) == [(k.data_ptr(), K_BPB * NB)]


def test_sparse_pool_indexer_block_count_can_be_given() -> None:
    mgr = FakeOffloadManager(["model.layers.0.attn"])
    idx = torch.zeros(12, BS, 128, dtype=torch.uint8)
    dest = SparseKvPoolDestinations(mgr, indexer_caches={"model.layers.0.attn": idx},
                                    indexer_num_blocks=12)
    assert dest.layouts()["model.layers.0.attn"].indexer == DestTensor(
        idx.data_ptr(), BS * 128, 12)
    with pytest.raises(LayoutMismatch, match="indexer"):
        SparseKvPoolDestinations(mgr, indexer_caches={"model.layers.0.attn": idx},
                                 indexer_num_blocks=5)


def test_sparse_pool_host_tensor_of_the_wrong_size_is_refused() -> None:
    mgr = FakeOffloadManager(["model.layers.2.attn"], host_blocks=NB - 1)
    with pytest.raises(LayoutMismatch, match=r"model\.layers\.2\.attn.*5 blocks, manager says 6"):
        SparseKvPoolDestinations(mgr)


def test_sparse_pool_layer_unknown_to_the_manager_is_refused() -> None:
    mgr = FakeOffloadManager(["model.layers.0.attn"])
    mgr.offload_layer_names = ["model.layers.0.attn", "model.layers.1.attn"]
    with pytest.raises(KeyError, match=r"model\.layers\.1\.attn"):
        SparseKvPoolDestinations(mgr)


def test_sparse_pool_reads_only_the_documented_attributes() -> None:
    k = torch.zeros(NB, 8, dtype=torch.uint8)
    mgr = SimpleNamespace(
        offload_layer_names=["model.layers.0.attn"], num_blocks=NB, block_bytes=(8, 0),
        host_kv_caches={"model.layers.0.attn": (k, None)},
        host_base_addrs={"model.layers.0.attn": (0x7000_0000, 0)},  # registered address
        layer_id=lambda name: 0,
    )
    lay = SparseKvPoolDestinations(mgr).layouts()["model.layers.0.attn"]
    assert lay.main == (DestTensor(0x7000_0000, 8, NB),)  # the transfer engine's view


# ---------------------------------------------------------------- head split
def test_head_major_blocks_are_recognised() -> None:
    from rd2h.adapters.torch.tensors import head_major

    cpu = torch.zeros(10, 2, 16, 16)  # vLLM's CPU cache: [blocks, heads, block, 2 x dim]
    assert head_major(cpu, 10, 2) and not head_major(cpu, 10, 4)
    assert head_major(torch.zeros(2, 10, 2, 16, 8), 10, 2)  # behind a K/V axis
    assert not head_major(torch.zeros(10, 16, 2, 8), 10, 2)  # heads inside each token row
    padded = torch.zeros(10, 3, 16, 16)[:, :2]  # a view that does not fill its blocks
    assert not head_major(padded, 10, 2)


def test_layouts_state_their_heads_only_for_head_major_blocks() -> None:
    heads = HeadRange(1, 1, 2)
    caches = {"l0": torch.zeros(6, 1, 16, 16)}
    layouts, _ = source_layouts(caches, 6, heads)
    assert layouts["l0"].heads == heads
    assert source_layouts(caches, 6)[0]["l0"].heads is None
    token_major = {"l0": torch.zeros(6, 16, 1, 16)}
    assert source_layouts(token_major, 6, heads)[0]["l0"].heads is None
    dest = VllmCacheDestinations({"l0": torch.zeros(6, 2, 16, 16)}, 6, HeadRange(0, 2, 2))
    assert dest.layouts()["l0"].heads == HeadRange(0, 2, 2)


@pytest.mark.parametrize(("total", "tp", "rank", "want"), [
    (2, 2, 1, HeadRange(1, 1, 2)),
    (4, 2, 1, HeadRange(2, 2, 4)),
    (2, 1, 0, HeadRange(0, 2, 2)),
    (2, 4, 3, HeadRange(1, 1, 2)),  # fewer heads than ranks: ranks 2 and 3 share head 1
    (3, 2, 0, None),  # vLLM does not split 3 heads over 2 ranks
    (None, 2, 0, None),  # MLA or unknown
])
def test_engine_facts_name_the_heads_of_their_rank(total, tp, rank, want) -> None:
    from rd2h.app.connector.facts import EngineFacts

    facts = EngineFacts("prefill", 1000, 0, tp, rank, "e", 16, (), total_kv_heads=total)
    assert facts.kv_heads() == want
