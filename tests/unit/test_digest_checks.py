"""``verify_kv``'s checks as the planner builds them (``rd2h.domain.planning.digests``): only the
blocks this rank read, at their destination addresses, each with the digest Prefill
stated for that source block; digests that do not fit the blocks fail the layer."""

from __future__ import annotations

import dataclasses

import pytest

from rd2h.domain.errors import PlanningError
from rd2h.domain.planning.digests import stated_digests
from rd2h.domain.planning.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.planning.planning import Destination, plan_reads
from rd2h.domain.wire.protocol import ReadReadyBatch, ReadRequest

SRC = SourceLayout("L", (TensorComponent(0x1000, 64, num_blocks=8),),
                   indexer=TensorComponent(0x8000, 16, num_blocks=8))
DST = DestinationLayout("L", (DestTensor(0x20000, 64, 8),), indexer=DestTensor(0x30000, 16, 8))
DIGESTS = ((101, 102), (201, 202))  # main over blocks (1, 2), indexer over (3, 4)


def _plan(req: ReadRequest, d_rank: int = 0, d_tp: int = 1, shared: bool = False):
    return plan_reads(ReadReadyBatch(0, "L", (req,)), SRC, DST,
                      {"r": Destination((5, 6), (0, 7))}, d_rank=d_rank, d_tp=d_tp,
                      main_shared=shared)


def test_every_block_read_is_checked_at_its_destination() -> None:
    checks = _plan(ReadRequest("r", (1, 2), (3, 4), 0, 0, DIGESTS)).checks
    assert checks is not None
    assert checks.addrs.tolist() == [0x20000 + 5 * 64, 0x20000 + 6 * 64,
                                     0x30000 + 0 * 16, 0x30000 + 7 * 16]
    assert checks.sizes.tolist() == [64, 64, 16, 16]
    assert checks.expected.tolist() == [101, 102, 201, 202]
    assert checks.what == (("r", "main", 1), ("r", "main", 2), ("r", "indexer", 3),
                           ("r", "indexer", 4))


def test_a_rank_checks_only_its_share_of_a_shared_pool() -> None:
    shares = [_plan(ReadRequest("r", (1, 2), (3, 4), 0, 0, DIGESTS), rank, 2, True).checks
              for rank in (0, 1)]
    main = [[w for w in c.what if w[1] == "main"] for c in shares if c is not None]
    assert sorted(w for part in main for w in part) == [("r", "main", 1), ("r", "main", 2)]
    assert all(len(part) == 1 for part in main)  # each rank its own block


def test_no_digests_no_checks_and_wrong_ones_fail_the_layer() -> None:
    assert _plan(ReadRequest("r", (1, 2), (3, 4), 0, 0)).checks is None
    with pytest.raises(PlanningError, match="KV digests"):
        _plan(ReadRequest("r", (1, 2), (3, 4), 0, 0, ((101,), (201, 202))))


def test_checks_name_the_block_of_each_check_in_order() -> None:
    checks = _plan(ReadRequest("r", (2, 1), (4, 3), 0, 0, ((102, 101), (202, 201)))).checks
    assert checks is not None
    assert checks.expected.tolist() == [102, 101, 202, 201]  # by position, not by order
    assert checks.describe([1, 3]) == [("r", "main", 1), ("r", "indexer", 3)]


def test_a_tensor_stated_empty_is_fine_unless_this_rank_reads_it() -> None:
    """Member 1 states no main digests (main is read from member 0 alone)."""
    req = ReadRequest("r", (1, 2), (3, 4), 0, 0, ((), (201, 202)))
    batch = ReadReadyBatch(0, "L", (req,), group_member_idx=1, tp_ratio=2)
    checks = plan_reads(batch, SRC, DST, {"r": Destination((5, 6), (0, 7))}, d_rank=0,
                        d_tp=1, main_shared=False).checks
    assert checks is not None and checks.what == (("r", "indexer", 4),)  # member 1's half
    with pytest.raises(PlanningError, match="stated no KV digests for the main blocks"):
        _plan(req)  # member 0: this rank reads main from it


def test_prefill_members_other_than_0_state_and_hash_no_main() -> None:
    hashed: list[list[int]] = []

    def digest(addrs, sizes):
        hashed.append(addrs.tolist())
        return addrs * 0 + 7

    req = ReadRequest("r", (1, 2), (3, 4), 0, 0)
    assert stated_digests(SRC, req, digest) == ((7, 7), (7, 7))
    assert hashed == [[0x1000 + 64, 0x1000 + 128], [0x8000 + 48, 0x8000 + 64]]
    hashed.clear()
    assert stated_digests(SRC, req, digest, member=1, ratio=2) == ((), (7,))
    assert hashed == [[0x8000 + 64]]  # main never read from it; its half of the indexer


def _by_addr(addrs, sizes):
    return addrs + 1  # a digest Decode can predict: the source address plus one


def test_a_shared_pool_reader_gets_and_checks_only_its_share_of_main() -> None:
    """Prefill states (and hashes) main only for the reading Decode rank's share when the
    pool is shared; that rank maps each digest to the right block; the other rank's
    share was never hashed."""
    req = ReadRequest("r", (1, 2, 5), (3, 4), 0, 0)
    for d_rank in (0, 1):
        stated = stated_digests(SRC, req, _by_addr, main_owner=(d_rank, 2))
        assert len(stated[0]) == (2, 1)[d_rank] and len(stated[1]) == 2
        plan = plan_reads(ReadReadyBatch(0, "L", (dataclasses.replace(req, digests=stated),)),
                          SRC, DST, {"r": Destination((5, 6, 7), (0, 7))}, d_rank=d_rank,
                          d_tp=2, main_shared=True)
        checks = plan.checks
        assert checks is not None
        main = [(b, e) for (_, t, b), e in zip(checks.what, checks.expected.tolist())
                if t == "main"]
        assert main and all(e == 0x1000 + b * 64 + 1 for b, e in main), main
    # The same partial list where the reader is not the one it was stated for: the
    # lengths do not fit, so the layer fails instead of checking against wrong digests.
    stated = stated_digests(SRC, req, _by_addr, main_owner=(0, 2))
    with pytest.raises(PlanningError, match="KV digests"):
        plan_reads(ReadReadyBatch(0, "L", (dataclasses.replace(req, digests=stated),)), SRC,
                   DST, {"r": Destination((5, 6, 7), (0, 7))}, d_rank=1, d_tp=2,
                   main_shared=True)
