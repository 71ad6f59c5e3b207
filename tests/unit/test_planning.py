"""Read planning on Decode (spec 5): ``plan_reads``, ``coalesce`` and the plan objects.

The heart of this file is an independent reference planner written with plain
loops straight from spec section 5; hypothesis checks that ``plan_reads``
copies exactly the same bytes for random messages, topologies and layouts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.domain.errors import LayoutMismatch, PlanningError
from rd2h.domain.planning.kv_groups import NO_BLOCK
from rd2h.domain.planning.layout import (
    DestinationLayout,
    DestTensor,
    SourceLayout,
    TensorComponent,
    per_block_bytes_from_rows,
)
from rd2h.domain.planning.planning import (
    Destination,
    ReadPlan,
    RequestOwnership,
    coalesce,
    plan_reads,
)
from rd2h.domain.wire.protocol import ReadReadyBatch, ReadRequest, decode_read_request

LAYER = "model.layers.3.self_attn"
HSETTINGS = settings(deadline=None, max_examples=120)

P_BASE = 1 << 20
D_BASE = 1 << 32
MAX_LIST = 8  # longest destination list per request and component
# Block ids drawn per tensor kind; destinations hold this many blocks. Requests use
# consecutive slices, so the last one can reach the last block of a tensor and, with
# packed tensors, run on into the next tensor (a merge across the tensor boundary).
ID_POOL = 4 * MAX_LIST


# ------------------------------------------------------------ the reference


class RefError(Exception):
    """The reference planner says the layer fails."""


def ref_owners(n: int, k: int, s: int) -> list[int]:
    """Owner of each of ``n`` blocks split over ``k`` owners rotated by ``s`` (spec 5).

    Logical owner ``l`` gets the ``l``-th contiguous share (the first ``n % k``
    shares hold one extra block); physical owner ``r`` is logical ``(r - s) mod k``.
    """
    owners: list[int] = []
    for logical in range(k):
        size = n // k + (1 if logical < n % k else 0)
        owners.extend([(logical + s) % k] * size)
    assert len(owners) == n
    return owners


def ref_plan(
    batch: ReadReadyBatch,
    src: SourceLayout,
    dst: DestinationLayout,
    destinations: dict[str, Destination],
    d_rank: int,
    d_tp: int,
) -> tuple[list[tuple[int, int, int]], list[tuple[str, int, int]]]:
    """Per-block copies ``(dst_addr, src_addr, length)`` and per-request owned counts."""
    member = batch.group_member_idx
    ratio = max(1, batch.tp_ratio)
    copies: list[tuple[int, int, int]] = []
    facts: list[tuple[str, int, int]] = []
    for req in batch.read_reqs:
        if req.ext_req_id not in destinations:
            raise RefError("missing destination")
        p_main, p_idx = list(req.p_main_block_ids), list(req.p_indexer_block_ids)
        if not p_main and not p_idx:
            raise RefError("both lists empty")
        dest = destinations[req.ext_req_id]
        owned_main = owned_idx = 0
        if member == 0 and src.main and p_main:
            s = req.main_start_block
            d_slice = list(dest.main_block_ids)[s : s + len(p_main)]
            if len(d_slice) != len(p_main):
                raise RefError("main does not fit")
            owners = ref_owners(len(p_main), d_tp, s)
            for i in range(len(p_main)):
                if owners[i] != d_rank:
                    continue
                owned_main += 1
                for s_t, d_t in zip(src.main, dst.main):
                    if d_slice[i] >= d_t.num_blocks:
                        raise RefError("main block beyond destination")
                    size = s_t.block_len * s_t.block_size_scale
                    copies.append(
                        (d_t.base_addr + d_slice[i] * size, s_t.base_addr + p_main[i] * size, size)
                    )
        if src.indexer is not None and p_idx:
            s = req.indexer_start_block
            d_slice = list(dest.indexer_block_ids)[s : s + len(p_idx)]
            if len(d_slice) != len(p_idx):
                raise RefError("indexer does not fit")
            pairs = [(src.indexer, dst.indexer)]
            if src.scale is not None:
                pairs.append((src.scale, dst.scale))
            owners = ref_owners(len(p_idx), ratio, s)
            for i in range(len(p_idx)):
                if owners[i] != member:
                    continue
                owned_idx += 1
                for s_t, d_t in pairs:
                    if d_slice[i] >= d_t.num_blocks:
                        raise RefError("indexer block beyond destination")
                    size = s_t.block_len * s_t.block_size_scale
                    copies.append(
                        (d_t.base_addr + d_slice[i] * size, s_t.base_addr + p_idx[i] * size, size)
                    )
        facts.append((req.ext_req_id, owned_main, owned_idx))
    return copies, facts


# ------------------------------------------------------------ helpers


def byte_pairs(copies) -> Counter:
    """Multiset of ``(dst_byte, src_byte)`` pairs covered by ``(dst, src, length)`` triples."""
    pairs: Counter = Counter()
    for d, s, n in copies:
        for i in range(int(n)):
            pairs[(int(d) + i, int(s) + i)] += 1
    return pairs


def plan_copies(plan: ReadPlan) -> list[tuple[int, int, int]]:
    return list(
        zip(plan.local_addrs.tolist(), plan.remote_addrs.tolist(), plan.lengths.tolist())
    )


def assert_well_formed(plan: ReadPlan) -> None:
    arrays = (plan.local_addrs, plan.remote_addrs, plan.lengths)
    for a in arrays:
        assert a.dtype == np.int64
        assert a.ndim == 1
    assert len({a.shape[0] for a in arrays}) == 1
    assert plan.num_descriptors == plan.lengths.shape[0]
    assert plan.total_bytes == int(plan.lengths.sum())
    assert (plan.lengths > 0).all()
    assert_no_mergeable_neighbours(*arrays)


def assert_no_mergeable_neighbours(local, remote, lengths) -> None:
    for i in range(len(lengths) - 1):
        both = (
            local[i] + lengths[i] == local[i + 1] and remote[i] + lengths[i] == remote[i + 1]
        )
        assert not both, f"descriptors {i} and {i + 1} are contiguous on both sides"


@dataclass(frozen=True)
class Scenario:
    src: SourceLayout
    dst: DestinationLayout
    destinations: dict[str, Destination]
    reqs: tuple[ReadRequest, ...]
    d_tp: int
    ratio: int

    def batch(self, member: int) -> ReadReadyBatch:
        return ReadReadyBatch(7, LAYER, self.reqs, (), member, self.ratio)

    def plan(self, d_rank: int, member: int) -> ReadPlan:
        return plan_reads(
            self.batch(member), self.src, self.dst, self.destinations,
            d_rank=d_rank, d_tp=self.d_tp,
        )

    def ref(self, d_rank: int, member: int):
        return ref_plan(
            self.batch(member), self.src, self.dst, self.destinations, d_rank, self.d_tp
        )

    def region(self, tensors) -> list[tuple[int, int]]:
        return [(t.base_addr, t.base_addr + ID_POOL * t.bytes_per_block) for t in tensors]

    def full_copies(self, component: str) -> list[tuple[int, int, int]]:
        """Every block copy of ``component`` ("main" or "indexer"), ignoring ownership."""
        out = []
        for req in self.reqs:
            dest = self.destinations[req.ext_req_id]
            if component == "main":
                ids, start, d_list = req.p_main_block_ids, req.main_start_block, dest.main_block_ids
                pairs = list(zip(self.src.main, self.dst.main))
            else:
                if self.src.indexer is None:
                    continue
                ids, start = req.p_indexer_block_ids, req.indexer_start_block
                d_list = dest.indexer_block_ids
                pairs = [(self.src.indexer, self.dst.indexer)]
                if self.src.scale is not None:
                    pairs.append((self.src.scale, self.dst.scale))
            for i, p_block in enumerate(ids):
                for s_t, d_t in pairs:
                    size = s_t.bytes_per_block
                    out.append(
                        (d_t.base_addr + d_list[start + i] * size, s_t.base_addr + p_block * size,
                         size)
                    )
        return out


def in_regions(addr: int, regions) -> bool:
    return any(lo <= addr < hi for lo, hi in regions)


@st.composite
def scenarios(draw, *, valid: bool) -> Scenario:
    """Random topology, layout, destinations and read requests.

    ``valid=False`` also draws the failure cases: a missing destination, both
    lists empty, ranges that do not fit, destination ids beyond the tensor.
    """
    d_tp = draw(st.integers(1, 4))
    ratio = draw(st.integers(1, 3))  # p_tp = d_tp * ratio, so p_tp % d_tp == 0
    n_main = draw(st.sampled_from([1, 2]))
    has_idx = draw(st.booleans())
    has_scale = has_idx and draw(st.booleans())
    packed = draw(st.booleans())  # tensors back to back: coalescing may cross tensors
    sizes = [
        (draw(st.integers(1, 4)), draw(st.integers(1, 3)))
        for _ in range(n_main + has_idx + has_scale)
    ]

    p_addr, d_addr = P_BASE, D_BASE
    src_t, dst_t = [], []
    for block_len, scale in sizes:
        bpb = block_len * scale
        num_blocks = ID_POOL if valid else draw(st.integers(ID_POOL - 8, ID_POOL))
        src_t.append(TensorComponent(p_addr, block_len, scale))
        dst_t.append(DestTensor(d_addr, bpb, num_blocks))
        gap = 0 if packed else draw(st.integers(1, 64))
        p_addr += ID_POOL * bpb + gap
        d_addr += ID_POOL * bpb + gap
    src = SourceLayout(
        LAYER, tuple(src_t[:n_main]),
        src_t[n_main] if has_idx else None, src_t[n_main + 1] if has_scale else None,
    )
    dst = DestinationLayout(
        LAYER, tuple(dst_t[:n_main]),
        dst_t[n_main] if has_idx else None, dst_t[n_main + 1] if has_scale else None,
    )

    def pool() -> list[int]:
        ids = list(range(ID_POOL))
        return draw(st.permutations(ids)) if draw(st.integers(0, 2)) == 0 else ids

    d_main_pool, d_idx_pool, p_main_pool, p_idx_pool = pool(), pool(), pool(), pool()
    # "full": every request reads its whole lists, so with sorted pools the blocks
    # cover whole tensors (and, packed, merge across tensor boundaries).
    full = draw(st.integers(0, 3)) == 0
    n_reqs = ID_POOL // MAX_LIST if full else draw(st.integers(1, 4))
    destinations: dict[str, Destination] = {}
    reqs: list[ReadRequest] = []
    slack = 0 if valid else 1
    for r in range(n_reqs):
        ext = f"req-{r}"
        at = r * MAX_LIST
        req: ReadRequest | None = None
        if full:
            m_len = i_len = mn = inn = MAX_LIST
            ms = is_ = 0
        elif draw(st.booleans()):  # legacy 2-field entry: one id list, starts 0
            m_len = i_len = draw(st.integers(1, MAX_LIST))
            n = draw(st.integers(0 if not valid else 1, m_len + slack))
            req = decode_read_request([ext, p_main_pool[at : at + n]], 0)
        else:
            m_len, i_len = draw(st.integers(0, MAX_LIST)), draw(st.integers(0, MAX_LIST))
            ms = draw(st.integers(0, m_len + slack))
            mn = draw(st.integers(0, max(0, m_len - ms) + slack))
            is_ = draw(st.integers(0, i_len + slack))
            inn = draw(st.integers(0, max(0, i_len - is_) + slack))
            if valid and mn + inn == 0:
                # one main block at the start; the start must leave it room inside the
                # request's MAX_LIST-long slice of the destination pool
                ms = min(ms, MAX_LIST - 1)
                m_len, mn = max(m_len, ms + 1), 1
        if req is None:
            req = ReadRequest(
                ext, tuple(p_main_pool[at : at + mn]), tuple(p_idx_pool[at : at + inn]), ms, is_
            )
        reqs.append(req)
        destinations[ext] = Destination(
            d_main_pool[at : at + m_len], d_idx_pool[at : at + i_len]
        )
    if not valid and draw(st.booleans()):
        del destinations[draw(st.sampled_from(sorted(destinations)))]
    return Scenario(src, dst, destinations, tuple(reqs), d_tp, ratio)


# ------------------------------------------------------------ equivalence


@HSETTINGS
@given(scenarios(valid=False))
def test_plan_reads_copies_exactly_what_the_reference_copies(scn: Scenario) -> None:
    for d_rank in range(scn.d_tp):
        for member in range(scn.ratio):
            try:
                copies, facts = scn.ref(d_rank, member)
            except RefError:
                with pytest.raises(PlanningError) as info:
                    scn.plan(d_rank, member)
                assert info.value.layer == LAYER
                continue
            plan = scn.plan(d_rank, member)
            assert_well_formed(plan)
            assert byte_pairs(plan_copies(plan)) == byte_pairs(copies)
            got = [(f.ext_req_id, f.main_blocks, f.indexer_blocks) for f in plan.requests]
            assert got == facts
            assert plan.blocks == sum(m + i for _, m, i in facts)
            idx_tensors = (scn.src.indexer is not None) + (scn.src.scale is not None)
            for f in plan.requests:
                assert f.descriptors == f.main_blocks * len(scn.src.main) + (
                    f.indexer_blocks * idx_tensors
                )
                assert f.owns_nothing == (f.main_blocks == 0 and f.indexer_blocks == 0)
            assert plan.owns_nothing == all(m == 0 and i == 0 for _, m, i in facts)


# ------------------------------------------------------------ ownership properties


@HSETTINGS
@given(scenarios(valid=True))
def test_main_once_over_decode_ranks_and_full_indexer_on_every_rank(scn: Scenario) -> None:
    main_regions = scn.region(scn.dst.main)
    idx_regions = scn.region(t for t in (scn.dst.indexer, scn.dst.scale) if t is not None)
    main_union: Counter = Counter()
    for d_rank in range(scn.d_tp):
        idx_union: Counter = Counter()
        for member in range(scn.ratio):
            plan = scn.plan(d_rank, member)
            assert_well_formed(plan)
            pairs = byte_pairs(plan_copies(plan))
            main_part = Counter({p: c for p, c in pairs.items() if in_regions(p[0], main_regions)})
            idx_part = Counter({p: c for p, c in pairs.items() if in_regions(p[0], idx_regions)})
            assert main_part + idx_part == pairs
            if member != 0:
                assert not main_part, "a member other than 0 read main KV"
                assert all(f.main_blocks == 0 for f in plan.requests)
            main_union += main_part
            idx_union += idx_part
        # The contributor members of one Decode rank together pull the full indexer
        # (and scale) copy, every block exactly once.
        assert idx_union == byte_pairs(scn.full_copies("indexer"))
    # Over all Decode ranks (member 0), every main block is pulled exactly once.
    assert main_union == byte_pairs(scn.full_copies("main"))


@HSETTINGS
@given(scenarios(valid=True))
def test_owned_block_counts_add_up_per_request(scn: Scenario) -> None:
    main_total: Counter = Counter()
    for d_rank in range(scn.d_tp):
        idx_total: Counter = Counter()
        for member in range(scn.ratio):
            for f in scn.plan(d_rank, member).requests:
                main_total[f.ext_req_id] += f.main_blocks
                idx_total[f.ext_req_id] += f.indexer_blocks
        for req in scn.reqs:
            want = len(req.p_indexer_block_ids) if scn.src.indexer is not None else 0
            assert idx_total[req.ext_req_id] == want
    for req in scn.reqs:
        assert main_total[req.ext_req_id] == len(req.p_main_block_ids)


# ------------------------------------------------------------ coalesce


@st.composite
def descriptor_runs(draw):
    """Descriptors that are often contiguous on both sides, sometimes on one only."""
    n = draw(st.integers(0, 30))
    local, remote, lengths = [], [], []
    loc, rem = draw(st.integers(0, 1000)), draw(st.integers(0, 1000))
    for _ in range(n):
        length = draw(st.integers(1, 6))
        local.append(loc)
        remote.append(rem)
        lengths.append(length)
        step = draw(st.sampled_from(["both", "both", "local", "remote", "jump", "back"]))
        loc += length + (0 if step in ("both", "local") else draw(st.integers(1, 9)))
        rem += length + (0 if step in ("both", "remote") else draw(st.integers(1, 9)))
        if step == "back":
            loc -= 2 * length + 12
    arr = [np.asarray(x, dtype=np.int64) for x in (local, remote, lengths)]
    return arr[0], arr[1], arr[2]


def ordered_bytes(local, remote, lengths) -> list[tuple[int, int]]:
    out = []
    for d, s, n in zip(local.tolist(), remote.tolist(), lengths.tolist()):
        out.extend((d + i, s + i) for i in range(n))
    return out


@HSETTINGS
@given(descriptor_runs())
def test_coalesce_preserves_bytes_and_leaves_nothing_to_merge(arrays) -> None:
    local, remote, lengths = arrays
    c_local, c_remote, c_lengths = coalesce(local, remote, lengths)
    for a in (c_local, c_remote, c_lengths):
        assert a.dtype == np.int64
    assert c_local.shape == c_remote.shape == c_lengths.shape
    assert len(c_lengths) <= len(lengths)
    # Same bytes in the same order (hence the same multiset of pairs).
    assert ordered_bytes(c_local, c_remote, c_lengths) == ordered_bytes(local, remote, lengths)
    assert_no_mergeable_neighbours(c_local, c_remote, c_lengths)
    again = coalesce(c_local, c_remote, c_lengths)
    for a, b in zip(again, (c_local, c_remote, c_lengths)):
        assert np.array_equal(a, b)


def test_coalesce_merges_a_contiguous_run_and_keeps_a_one_sided_neighbour() -> None:
    local = np.array([0, 10, 20, 30, 100], dtype=np.int64)
    remote = np.array([500, 510, 520, 999, 530], dtype=np.int64)
    lengths = np.array([10, 10, 10, 5, 5], dtype=np.int64)
    c = coalesce(local, remote, lengths)
    assert [x.tolist() for x in c] == [[0, 30, 100], [500, 999, 530], [30, 5, 5]]


def test_coalesce_empty_and_single() -> None:
    empty = np.zeros(0, dtype=np.int64)
    assert all(x.size == 0 for x in coalesce(empty, empty, empty))
    one = np.array([4], dtype=np.int64)
    assert [x.tolist() for x in coalesce(one, one + 1, one)] == [[4], [5], [4]]


# ------------------------------------------------------------ table cases


def make_layout(
    *, n_main: int = 2, indexer: bool = True, scale: bool = False, bpb: int = 16,
    num_blocks: int = 64,
) -> tuple[SourceLayout, DestinationLayout]:
    src_t, dst_t = [], []
    for i in range(n_main + indexer + scale):
        src_t.append(TensorComponent(P_BASE * (i + 1), bpb))
        dst_t.append(DestTensor(D_BASE * (i + 1), bpb, num_blocks))
    src = SourceLayout(
        LAYER, tuple(src_t[:n_main]),
        src_t[n_main] if indexer else None, src_t[n_main + 1] if scale else None,
    )
    dst = DestinationLayout(
        LAYER, tuple(dst_t[:n_main]),
        dst_t[n_main] if indexer else None, dst_t[n_main + 1] if scale else None,
    )
    return src, dst


def batch_of(*reqs: ReadRequest, member: int = 0, ratio: int = 1) -> ReadReadyBatch:
    return ReadReadyBatch(1, LAYER, tuple(reqs), (), member, ratio)


def test_missing_destination_fails_naming_the_request() -> None:
    src, dst = make_layout()
    batch = batch_of(
        ReadRequest("known", (1,), (1,)), ReadRequest("ghost", (2,), (2,))
    )
    with pytest.raises(PlanningError) as info:
        plan_reads(batch, src, dst, {"known": Destination([5], [5])}, d_rank=0, d_tp=1)
    assert info.value.ext_req_id == "ghost"
    assert "ghost" in str(info.value)
    assert LAYER in str(info.value)


def test_both_lists_empty_fails() -> None:
    src, dst = make_layout()
    with pytest.raises(PlanningError) as info:
        plan_reads(
            batch_of(ReadRequest("r", (), ())), src, dst, {"r": Destination([1], [1])},
            d_rank=0, d_tp=1,
        )
    assert info.value.ext_req_id == "r"


@pytest.mark.parametrize(
    ("req", "dest", "member", "ratio"),
    [
        # main [2, 5) of 4 destination blocks
        (ReadRequest("r", (1, 2, 3), (), 2, 0), Destination([0, 1, 2, 3], []), 0, 1),
        # main start beyond the list
        (ReadRequest("r", (1,), (), 9, 0), Destination([0, 1], []), 0, 1),
        # indexer [1, 3) of 2 destination blocks (member 1 still checks the indexer)
        (ReadRequest("r", (), (1, 2), 0, 1), Destination([], [7, 8]), 1, 2),
    ],
)
def test_range_not_fitting_destination_fails(req, dest, member, ratio) -> None:
    src, dst = make_layout()
    with pytest.raises(PlanningError) as info:
        plan_reads(
            batch_of(req, member=member, ratio=ratio), src, dst, {"r": dest}, d_rank=0, d_tp=1
        )
    assert info.value.ext_req_id == "r"
    assert "do not fit" in info.value.detail


@pytest.mark.parametrize(
    ("main_ids", "idx_ids", "component"),
    [([3, 64], [1, 2], "main"), ([3, 4], [1, 99], "indexer")],
)
def test_destination_block_beyond_tensor_fails(main_ids, idx_ids, component) -> None:
    src, dst = make_layout(scale=True, num_blocks=64)
    batch = batch_of(ReadRequest("r", (0, 1), (0, 1)))
    with pytest.raises(PlanningError) as info:
        plan_reads(batch, src, dst, {"r": Destination(main_ids, idx_ids)}, d_rank=0, d_tp=1)
    assert component in info.value.detail
    assert "beyond" in info.value.detail


def test_negative_destination_block_fails() -> None:
    src, dst = make_layout()
    with pytest.raises(PlanningError, match="negative"):
        plan_reads(
            batch_of(ReadRequest("r", (0,), (0,))), src, dst, {"r": Destination([-2], [2])},
            d_rank=0, d_tp=1,
        )


def test_no_block_destinations_are_not_read() -> None:
    """NO_BLOCK (vLLM's null block outside a sliding window): that position gets no read,
    the rest of the request is read; a request with nothing held owns nothing."""
    src, dst = make_layout(indexer=False)
    plan = plan_reads(
        batch_of(ReadRequest("r", (4, 5, 6), ()), ReadRequest("s", (7,), ())), src, dst,
        {"r": Destination([NO_BLOCK, NO_BLOCK, 9], []), "s": Destination([NO_BLOCK], [])},
        d_rank=0, d_tp=1, main_shared=False,
    )
    assert plan.main_blocks.tolist() == [1, 0]
    pairs = sorted(zip(plan.remote_addrs.tolist(), plan.local_addrs.tolist()))
    assert pairs == [(t.base_addr + 6 * t.bytes_per_block, d.base_addr + 9 * d.bytes_per_block)
                     for t, d in zip(src.main, dst.main)]


def test_a_layer_of_another_group_reads_into_that_groups_blocks() -> None:
    """Each KV cache group has its own block table: a layer whose destination layout
    names group 1 reads into the request's group-1 blocks, not its main list."""
    src, dst = make_layout(indexer=False)
    dest = {"r": Destination([1, 2], [], groups=([1, 2], [NO_BLOCK, 40]))}
    batch = batch_of(ReadRequest("r", (5, 6), (), 0, 0))
    for group, want in ((None, [1, 2]), (0, [1, 2]), (1, [40])):
        layout = replace(dst, group=group)
        plan = plan_reads(batch, src, layout, dest, d_rank=0, d_tp=1, main_shared=False)
        t = dst.main[0]
        got = sorted(
            b for a, n in zip(plan.local_addrs.tolist(), plan.lengths.tolist())
            if t.base_addr <= a < t.base_addr + t.bytes_per_block * t.num_blocks
            for b in range((a - t.base_addr) // t.bytes_per_block,
                           (a + n - t.base_addr) // t.bytes_per_block))
        assert got == want, group


def test_destination_accepts_arrays_and_keeps_read_only_int64_ids() -> None:
    dest = Destination(np.array([5, 6], dtype=np.int32), range(3))
    assert dest.main_block_ids.dtype == np.int64 and dest.indexer_block_ids.dtype == np.int64
    assert dest.main_block_ids.tolist() == [5, 6] and dest.indexer_block_ids.tolist() == [0, 1, 2]
    with pytest.raises(ValueError):
        dest.main_block_ids[0] = 1
    src, dst = make_layout(indexer=False)
    plan = plan_reads(
        batch_of(ReadRequest("r", (1, 2), ())), src, dst, {"r": dest}, d_rank=0, d_tp=1
    )
    assert sorted(plan_copies(plan)) == [
        (D_BASE + 5 * 16, P_BASE + 16, 32), (2 * D_BASE + 5 * 16, 2 * P_BASE + 16, 32),
    ]


def test_packed_tensors_merge_across_the_tensor_boundary() -> None:
    """K, V, indexer and scale back to back, every block read: one descriptor."""
    sizes = (64, 8, 8, 2)
    src_t, dst_t, p_at, d_at = [], [], 0, 1 << 20
    for size in sizes:
        src_t.append(TensorComponent(p_at, size))
        dst_t.append(DestTensor(d_at, size, 4))
        p_at += 4 * size
        d_at += 4 * size
    src = SourceLayout(LAYER, tuple(src_t[:2]), src_t[2], src_t[3])
    dst = DestinationLayout(LAYER, tuple(dst_t[:2]), dst_t[2], dst_t[3])
    ids = (0, 1, 2, 3)
    plan = plan_reads(
        batch_of(ReadRequest("r", ids, ids)), src, dst, {"r": Destination(ids, ids)},
        d_rank=0, d_tp=1,
    )
    assert plan_copies(plan) == [(1 << 20, 0, 4 * sum(sizes))]
    assert plan.requests == (RequestOwnership("r", 4, 4, 16),)
    assert plan.blocks == 8
    # Only the first three blocks: no tensor boundary is contiguous any more.
    part = plan_reads(
        batch_of(ReadRequest("r", ids[:3], ids[:3])), src, dst, {"r": Destination(ids, ids)},
        d_rank=0, d_tp=1,
    )
    assert part.num_descriptors == 4
    assert_well_formed(part)


def test_last_destination_block_is_accepted() -> None:
    src, dst = make_layout(num_blocks=64)
    plan = plan_reads(
        batch_of(ReadRequest("r", (0,), (0,))), src, dst, {"r": Destination([63], [63])},
        d_rank=0, d_tp=1,
    )
    assert plan.blocks == 2


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s, d: (s, replace(d, main=d.main[:1])),  # main tensor count differs
        lambda s, d: (s, replace(d, main=(replace(d.main[0], bytes_per_block=32), d.main[1]))),
        lambda s, d: (s, replace(d, indexer=None, scale=None)),  # indexer presence differs
        lambda s, d: (replace(s, indexer=None, scale=None), d),
        lambda s, d: (s, replace(d, scale=None)),  # scale presence differs
        lambda s, d: (s, replace(d, scale=replace(d.scale, bytes_per_block=8))),
        lambda s, d: (replace(s, indexer=replace(s.indexer, block_size_scale=2)), d),
    ],
)
def test_layout_mismatch_is_raised_before_planning(mutate) -> None:
    src, dst = mutate(*make_layout(scale=True))
    with pytest.raises(LayoutMismatch) as info:
        plan_reads(
            batch_of(ReadRequest("r", (0,), (0,))), src, dst, {"r": Destination([1], [1])},
            d_rank=0, d_tp=1,
        )
    assert info.value.layer == LAYER


def test_member_other_than_zero_on_main_only_layer_owns_nothing() -> None:
    src, dst = make_layout(indexer=False)
    batch = batch_of(
        ReadRequest("a", (0, 1, 2), (), 0, 0), ReadRequest("b", (5,), (), 0, 0),
        member=1, ratio=2,
    )
    dests = {"a": Destination([10, 11, 12], []), "b": Destination([20], [])}
    plan = plan_reads(batch, src, dst, dests, d_rank=0, d_tp=1)
    assert plan.owns_nothing
    assert plan.num_descriptors == 0 and plan.total_bytes == 0 and plan.blocks == 0
    assert plan.requests == (
        RequestOwnership("a", 0, 0, 0), RequestOwnership("b", 0, 0, 0),
    )
    for a in (plan.local_addrs, plan.remote_addrs, plan.lengths):
        assert a.dtype == np.int64 and a.shape == (0,)
    # Member 0 of the same group does read it.
    plan0 = plan_reads(replace(batch, group_member_idx=0), src, dst, dests, d_rank=0, d_tp=1)
    assert not plan0.owns_nothing
    assert plan0.blocks == 4


def test_single_block_split_over_two_decode_ranks() -> None:
    src, dst = make_layout(indexer=False)
    dests = {"r": Destination([9], [])}
    plans = [
        plan_reads(batch_of(ReadRequest("r", (4,), ())), src, dst, dests, d_rank=r, d_tp=2)
        for r in range(2)
    ]
    # With start 0 the one block belongs to rank 0; rank 1 owns nothing but still
    # gets per-request facts (it answers READ_DONE).
    assert plans[0].requests == (RequestOwnership("r", 1, 0, 2),)
    assert plans[1].requests == (RequestOwnership("r", 0, 0, 0),)
    assert plans[1].owns_nothing and plans[1].num_descriptors == 0
    assert not plans[0].owns_nothing
    # Both main tensors of the block are copied (2 descriptors, not contiguous).
    assert sorted(plan_copies(plans[0])) == [
        (D_BASE * 1 + 9 * 16, P_BASE * 1 + 4 * 16, 16),
        (D_BASE * 2 + 9 * 16, P_BASE * 2 + 4 * 16, 16),
    ]


@pytest.mark.parametrize(
    ("start", "expected"),
    [
        # n = 5 blocks over d_tp = 2: logical owner 0 gets 3 blocks, owner 1 gets 2.
        (0, {0: [0, 1, 2], 1: [3, 4]}),
        (1, {1: [0, 1, 2], 0: [3, 4]}),  # rotated: rank 1 is logical owner 0
        (2, {0: [0, 1, 2], 1: [3, 4]}),
        (3, {1: [0, 1, 2], 0: [3, 4]}),
    ],
)
def test_main_rotation_by_start_block(start: int, expected: dict[int, list[int]]) -> None:
    src, dst = make_layout(n_main=1, indexer=False, num_blocks=128)
    d_list = list(range(100, 110))
    p_ids = (50, 51, 52, 53, 54)
    for d_rank in range(2):
        plan = plan_reads(
            batch_of(ReadRequest("r", p_ids, (), start, 0)), src, dst,
            {"r": Destination(d_list, [])}, d_rank=d_rank, d_tp=2,
        )
        want_dst = [d_list[start + i] for i in expected[d_rank]]
        assert sorted(
            (D_BASE + b * 16, P_BASE + p_ids[i] * 16)
            for b, i in zip(want_dst, expected[d_rank])
        ) == sorted(
            (d + k * 16, s + k * 16) for d, s, n in plan_copies(plan) for k in range(n // 16)
        )
        assert plan.requests[0].main_blocks == len(expected[d_rank])


def test_rotation_spreads_consecutive_single_block_chunks() -> None:
    """Spec 5: small consecutive chunks must not all land on rank 0."""
    src, dst = make_layout(n_main=1, indexer=False)
    d_list = list(range(8))
    owner_of_chunk = []
    for start in range(4):
        owners = [
            r for r in range(4)
            if plan_reads(
                batch_of(ReadRequest("r", (start,), (), start, 0)), src, dst,
                {"r": Destination(d_list, [])}, d_rank=r, d_tp=4,
            ).blocks
        ]
        owner_of_chunk.append(owners)
    assert owner_of_chunk == [[0], [1], [2], [3]]


def test_indexer_rotation_over_members() -> None:
    src, dst = make_layout(n_main=1, indexer=True)
    req = ReadRequest("r", (), (10, 11, 12), 0, 2)  # idx start 2 over ratio 3
    dests = {"r": Destination([], [0, 1, 40, 41, 42])}
    owned = {}
    for member in range(3):
        plan = plan_reads(batch_of(req, member=member, ratio=3), src, dst, dests, d_rank=0, d_tp=1)
        owned[member] = [(d - 2 * D_BASE) // 16 for d, _, _ in plan_copies(plan)]
    # (member - 2 mod 3) mod 3: member 2 is logical 0 -> first block, member 0 -> second.
    assert owned == {2: [40], 0: [41], 1: [42]}


def test_legacy_two_field_request_uses_same_ids_for_main_and_indexer() -> None:
    src, dst = make_layout(n_main=2, indexer=True, scale=True)
    req = decode_read_request(["legacy", [3, 7]], 1)
    assert req == ReadRequest("legacy", (3, 7), (3, 7), 0, 0)
    dests = {"legacy": Destination([20, 21, 22], [30, 31])}
    plan = plan_reads(batch_of(req), src, dst, dests, d_rank=0, d_tp=1)
    assert plan.requests == (RequestOwnership("legacy", 2, 2, 2 * 2 + 2 * 2),)
    expected = []
    for tensor, (d_ids, p_ids) in enumerate(
        [([20, 21], [3, 7])] * 2 + [([30, 31], [3, 7])] * 2, start=1
    ):
        for d, p in zip(d_ids, p_ids):
            expected.append((D_BASE * tensor + d * 16, P_BASE * tensor + p * 16, 16))
    assert byte_pairs(plan_copies(plan)) == byte_pairs(expected)


def test_indexer_only_request_on_member_zero_reads_no_main() -> None:
    src, dst = make_layout(n_main=2, indexer=True)
    plan = plan_reads(
        batch_of(ReadRequest("r", (), (1, 2), 0, 0)), src, dst,
        {"r": Destination([], [5, 6])}, d_rank=0, d_tp=1,
    )
    assert plan.requests == (RequestOwnership("r", 0, 2, 2),)
    # Destinations 5, 6 and sources 1, 2 are contiguous: one merged descriptor.
    assert plan_copies(plan) == [(3 * D_BASE + 5 * 16, 3 * P_BASE + 1 * 16, 32)]


def test_reference_shapes_from_spec_13() -> None:
    """DeepSeek-V3.2-like layer, 256 blocks of 128 tokens (a 32K prompt)."""
    tokens, blocks, d_blocks = 128, 256, 1024
    k_bytes, v_bytes = 512 * 2 * tokens, 64 * 2 * tokens
    idx_bytes, scale_bytes = 128 * 1 * tokens, 1 * 4 * tokens
    assert (k_bytes, v_bytes, idx_bytes, scale_bytes) == (131072, 16384, 16384, 512)
    assert per_block_bytes_from_rows(128, d_blocks * tokens, d_blocks) == idx_bytes
    gib = 1 << 30
    src = SourceLayout(
        LAYER,
        # kernel blocks of 64 tokens, 2 per external block for K; plain blocks for V
        (TensorComponent(1 * gib, k_bytes // 2, 2), TensorComponent(2 * gib, v_bytes)),
        TensorComponent(3 * gib, idx_bytes),
        TensorComponent(4 * gib, scale_bytes // 4, 4),
    )
    dst = DestinationLayout(
        LAYER,
        (DestTensor(8 * gib, k_bytes, d_blocks), DestTensor(9 * gib, v_bytes, d_blocks)),
        DestTensor(10 * gib, per_block_bytes_from_rows(128, d_blocks * tokens, d_blocks),
                   d_blocks),
        DestTensor(11 * gib, per_block_bytes_from_rows(4, d_blocks * tokens, d_blocks),
                   d_blocks),
    )
    p_ids = tuple(range(blocks))
    dests = {"big": Destination(range(500, 500 + blocks), range(700, 700 + blocks))}
    req = ReadRequest("big", p_ids, p_ids, 0, 0)

    whole = plan_reads(batch_of(req), src, dst, dests, d_rank=0, d_tp=1)
    main_bytes = blocks * (k_bytes + v_bytes)
    assert main_bytes == 36 * (1 << 20)
    assert whole.total_bytes == main_bytes + blocks * (idx_bytes + scale_bytes)
    assert whole.num_descriptors == 4  # contiguous ids: one descriptor per tensor
    assert sorted(plan_copies(whole)) == [
        (8 * gib + 500 * k_bytes, 1 * gib, blocks * k_bytes),
        (9 * gib + 500 * v_bytes, 2 * gib, blocks * v_bytes),
        (10 * gib + 700 * idx_bytes, 3 * gib, blocks * idx_bytes),
        (11 * gib + 700 * scale_bytes, 4 * gib, blocks * scale_bytes),
    ]

    # p_tp 8, d_tp 4: each D rank reads a quarter of main (member 0) and each of its
    # two members half of the indexer and scale.
    total_main = 0
    for d_rank in range(4):
        per_rank_idx = 0
        for member in range(2):
            plan = plan_reads(
                batch_of(req, member=member, ratio=2), src, dst, dests, d_rank=d_rank, d_tp=4
            )
            f = plan.requests[0]
            assert f.main_blocks == (64 if member == 0 else 0)
            assert f.indexer_blocks == 128
            total_main += f.main_blocks * (k_bytes + v_bytes)
            per_rank_idx += f.indexer_blocks * (idx_bytes + scale_bytes)
            assert plan.total_bytes == f.main_blocks * (k_bytes + v_bytes) + (
                f.indexer_blocks * (idx_bytes + scale_bytes)
            )
        assert per_rank_idx == blocks * (idx_bytes + scale_bytes)
    assert total_main == main_bytes
