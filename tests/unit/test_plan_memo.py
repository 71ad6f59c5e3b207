"""``PlanMemo``: a layer that names the same requests, blocks and destinations as
the peer's previous message reuses its block ownership, and the plan is exactly the
plan made without the memo; anything else is planned afresh."""

from __future__ import annotations

import random

import numpy as np
import pytest

from rd2h.domain.errors import PlanningError
from rd2h.domain.planning.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.planning.planning import Destination, PlanMemo, plan_reads
from rd2h.domain.wire.protocol import ReadReadyBatch, ReadRequest

SIZES = {"k": 4096, "v": 512, "idx": 512, "scale": 16}
N_BLOCKS = 64


def layouts(layer: int) -> tuple[SourceLayout, DestinationLayout]:
    """Each layer's tensors at their own addresses (all that differs between layers)."""
    base = (layer + 1) << 32

    def s(i: int, c: str) -> TensorComponent:
        return TensorComponent(base + (i << 24), SIZES[c], 1, 0, num_blocks=N_BLOCKS)

    def d(i: int, c: str) -> DestTensor:
        return DestTensor(base + (1 << 31) + (i << 24), SIZES[c], N_BLOCKS)

    name = f"model.layers.{layer}.self_attn"
    src = SourceLayout(name, main=(s(0, "k"), s(1, "v")), indexer=s(2, "idx"),
                       scale=s(3, "scale"))
    dst = DestinationLayout(name, main=(d(0, "k"), d(1, "v")), indexer=d(2, "idx"),
                            scale=d(3, "scale"))
    return src, dst


def batch(layer: int, reqs: tuple[ReadRequest, ...], member: int = 0,
          ratio: int = 2) -> ReadReadyBatch:
    return ReadReadyBatch(layer, f"model.layers.{layer}.self_attn", reqs, (), member, ratio)


def random_requests(rng: random.Random, n: int) -> tuple[ReadRequest, ...]:
    out = []
    for r in range(n):
        k = rng.randint(1, 8)
        ids = tuple(rng.sample(range(N_BLOCKS), k))
        out.append(ReadRequest(f"req-{r}", ids, ids, 0, 0))
    return tuple(out)


def random_dests(rng: random.Random, reqs: tuple[ReadRequest, ...]) -> dict[str, Destination]:
    return {r.ext_req_id: Destination(rng.sample(range(N_BLOCKS), 8),
                                      rng.sample(range(N_BLOCKS), 8)) for r in reqs}


def same(a, b) -> bool:
    return (np.array_equal(a.local_addrs, b.local_addrs)
            and np.array_equal(a.remote_addrs, b.remote_addrs)
            and np.array_equal(a.lengths, b.lengths) and a.requests == b.requests)


@pytest.mark.parametrize("seed", range(40))
def test_memoised_plans_equal_fresh_plans(seed: int) -> None:
    rng = random.Random(seed)
    memo = PlanMemo(capacity=2)
    reqs = random_requests(rng, rng.randint(1, 4))
    dests = random_dests(rng, reqs)
    for step in range(30):
        change = rng.random()
        if change < 0.15:  # another chunk: other blocks
            reqs = random_requests(rng, rng.randint(1, 4))
            dests = random_dests(rng, reqs)
        elif change < 0.25:  # the same ids re-admitted with other destination blocks
            dests = random_dests(rng, reqs)
        elif change < 0.3:  # equal content, new objects (as a fresh decode makes)
            reqs = tuple(ReadRequest(r.ext_req_id, tuple(r.p_main_block_ids),
                                     tuple(r.p_indexer_block_ids), 0, 0) for r in reqs)
        member = rng.randint(0, 1)
        owner = rng.choice(["peer-a", "peer-b", "peer-c"])
        src, dst = layouts(step % 5)
        b = batch(step % 5, reqs, member)
        kw = dict(d_rank=rng.randint(0, 1), d_tp=2)
        fresh = plan_reads(b, src, dst, dests, **kw)
        memoised = plan_reads(b, src, dst, dests, memo=memo, owner=owner, **kw)
        again = plan_reads(b, src, dst, dests, memo=memo, owner=owner, **kw)
        assert same(fresh, memoised) and same(fresh, again)
    assert memo.hits > 0 and len(memo) <= 2


def test_a_readmitted_request_is_planned_with_its_new_blocks() -> None:
    memo = PlanMemo()
    reqs = (ReadRequest("r", (1, 2), (1, 2), 0, 0),)
    old = {"r": Destination([10, 11], [20, 21])}
    src, dst = layouts(0)
    plan_reads(batch(0, reqs), src, dst, old, d_rank=0, d_tp=1, memo=memo, owner="p")
    new = {"r": Destination([30, 31], [40, 41])}
    src, dst = layouts(1)
    plan = plan_reads(batch(1, reqs), src, dst, new, d_rank=0, d_tp=1, memo=memo, owner="p")
    assert memo.hits == 0
    k = dst.main[0]
    assert plan.local_addrs[0] == k.base_addr + 30 * k.bytes_per_block


def test_per_layer_checks_still_run_on_a_memo_hit() -> None:
    memo = PlanMemo()
    reqs = (ReadRequest("r", (1, 2), (1, 2), 0, 0),)
    dests = {"r": Destination([10, 11], [20, 21])}
    src, dst = layouts(0)
    plan_reads(batch(0, reqs), src, dst, dests, d_rank=0, d_tp=1, memo=memo, owner="p")
    # The next layer advertises fewer source blocks: block 2 is beyond them.
    small = SourceLayout(src.layer_name, main=tuple(
        TensorComponent(t.base_addr, t.bytes_per_block, 1, 0, num_blocks=2) for t in src.main),
        indexer=src.indexer, scale=src.scale)
    with pytest.raises(PlanningError, match="beyond"):
        plan_reads(batch(0, reqs), small, dst, dests, d_rank=0, d_tp=1, memo=memo, owner="p")
    assert memo.hits == 1


def test_forget_and_capacity() -> None:
    memo = PlanMemo(capacity=2)
    reqs = (ReadRequest("r", (1,), (1,), 0, 0),)
    dests = {"r": Destination([10], [20])}
    src, dst = layouts(0)
    for owner in ("a", "b", "c"):
        plan_reads(batch(0, reqs), src, dst, dests, d_rank=0, d_tp=1, memo=memo, owner=owner)
    assert len(memo) == 2  # "a" went first
    plan_reads(batch(0, reqs), src, dst, dests, d_rank=0, d_tp=1, memo=memo, owner="a")
    assert memo.hits == 0
    memo.forget("a")
    memo.forget("never-seen")
    assert len(memo) == 1
