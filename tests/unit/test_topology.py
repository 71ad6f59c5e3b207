"""P/D TP mapping, contributor groups, owned ranges and port plans (spec 5, 8, 9)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.domain.errors import Rd2hError, TopologyError
from rd2h.domain.planning.topology import (
    MAX_PORT,
    PortPlan,
    TpMapping,
    check_topology,
    compute_mapping,
    contributor_group,
    fanout,
    owned_range,
    plan_ports,
    remote_port,
)

PROPS = settings(max_examples=300, deadline=None)

# ------------------------------------------------------------------ mapping (spec 8)


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "p_rank", "d_rank", "member"),
    [
        # reference topologies
        (8, 8, 7, 7, 0),
        (8, 4, 3, 1, 1),
        (16, 4, 4, 1, 0),
        # more table rows
        (1, 1, 0, 0, 0),
        (8, 8, 0, 0, 0),
        (8, 4, 0, 0, 0),
        (8, 4, 1, 0, 1),
        (8, 4, 7, 3, 1),
        (16, 4, 15, 3, 3),
        (16, 4, 7, 1, 3),
        (8, 1, 5, 0, 5),
        (8, 2, 4, 1, 0),
    ],
)
def test_compute_mapping_table(p_tp, d_tp, p_rank, d_rank, member):
    m = compute_mapping(p_tp, d_tp, p_rank)
    assert m == TpMapping(
        p_tp=p_tp, d_tp=d_tp, p_rank=p_rank, ratio=p_tp // d_tp, d_rank=d_rank, member=member
    )
    assert m.d_ranks == (d_rank,)


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "ratio"), [(1, 1, 1), (8, 8, 1), (8, 4, 2), (16, 4, 4), (8, 1, 8)]
)
def test_check_topology_returns_ratio(p_tp, d_tp, ratio):
    assert check_topology(p_tp, d_tp) == ratio


@pytest.mark.parametrize(
    ("p_tp", "d_tp"),
    [
        (4, 6),  # neither a multiple of the other
        (2, 3),
        (8, 3),  # not a multiple
        (0, 1),  # size < 1
        (1, 0),
        (-8, 4),
        (8, -4),
        (6, 4),
        (True, 1),  # bool is not a size
        (8, 4.0),
        ("8", 4),
    ],
)
def test_unsupported_topologies_are_rejected(p_tp, d_tp):
    with pytest.raises(TopologyError):
        check_topology(p_tp, d_tp)
    with pytest.raises(TopologyError):
        compute_mapping(p_tp, d_tp, 0)
    with pytest.raises(TopologyError):
        contributor_group(p_tp, d_tp, 0)


def test_topology_error_is_a_value_error_and_rd2h_error():
    with pytest.raises(ValueError):
        check_topology(4, 6)
    with pytest.raises(Rd2hError):
        check_topology(4, 6)


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "p_rank"), [(8, 8, 8), (8, 8, -1), (8, 4, 8), (4, 4, 100)]
)
def test_prefill_rank_outside_range_is_rejected(p_tp, d_tp, p_rank):
    with pytest.raises(TopologyError):
        compute_mapping(p_tp, d_tp, p_rank)


@pytest.mark.parametrize("p_rank", [True, 1.0, "1", None])
def test_prefill_rank_must_be_int(p_rank):
    with pytest.raises(TopologyError):
        compute_mapping(8, 4, p_rank)


def test_rank_8_of_8_error_message_names_the_range():
    with pytest.raises(TopologyError, match=r"\[0, 8\)"):
        compute_mapping(8, 8, 8)


@given(
    d_tp=st.integers(1, 16),
    ratio=st.integers(1, 16),
    data=st.data(),
)
@PROPS
def test_mapping_inverts_contributor_group(d_tp, ratio, data):
    p_tp = d_tp * ratio
    p_rank = data.draw(st.integers(0, p_tp - 1))
    m = compute_mapping(p_tp, d_tp, p_rank)
    assert m.ratio == ratio
    assert 0 <= m.d_rank < d_tp
    assert 0 <= m.member < ratio
    assert m.d_rank * ratio + m.member == p_rank
    group = contributor_group(p_tp, d_tp, m.d_rank)
    assert group[m.member] == p_rank


# ------------------------------------------------------------------ contributor groups


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "d_rank", "group"),
    [
        (8, 8, 7, (7,)),
        (8, 8, 0, (0,)),
        (8, 4, 0, (0, 1)),
        (8, 4, 1, (2, 3)),
        (8, 4, 3, (6, 7)),
        (16, 4, 1, (4, 5, 6, 7)),
        (16, 4, 3, (12, 13, 14, 15)),
        (8, 1, 0, (0, 1, 2, 3, 4, 5, 6, 7)),
    ],
)
def test_contributor_group_table(p_tp, d_tp, d_rank, group):
    assert contributor_group(p_tp, d_tp, d_rank) == group


@pytest.mark.parametrize("d_rank", [-1, 4, 100, True, 1.5, None])
def test_contributor_group_rejects_bad_decode_rank(d_rank):
    with pytest.raises(TopologyError):
        contributor_group(8, 4, d_rank)


@given(d_tp=st.integers(1, 12), ratio=st.integers(1, 12))
@PROPS
def test_contributor_groups_partition_prefill_ranks(d_tp, ratio):
    p_tp = d_tp * ratio
    seen: list[int] = []
    for d_rank in range(d_tp):
        group = contributor_group(p_tp, d_tp, d_rank)
        assert len(group) == ratio
        for member, p_rank in enumerate(group):
            m = compute_mapping(p_tp, d_tp, p_rank)
            assert (m.d_rank, m.member) == (d_rank, member)
        seen.extend(group)
    assert sorted(seen) == list(range(p_tp))


# ------------------------------------------------------------------ owned ranges (spec 5)


@pytest.mark.parametrize(
    ("n", "k", "r", "s", "expected"),
    [
        # no rotation (s = 0)
        (10, 4, 0, 0, (0, 3)),
        (10, 4, 1, 0, (3, 6)),
        (10, 4, 2, 0, (6, 8)),
        (10, 4, 3, 0, (8, 10)),
        (8, 4, 2, 0, (4, 6)),
        (0, 4, 3, 0, (0, 0)),
        (5, 1, 0, 0, (0, 5)),
        (5, 1, 0, 7, (0, 5)),
        # fewer blocks than owners: a single block goes to owner s mod k
        (1, 4, 0, 0, (0, 1)),
        (1, 4, 1, 0, (1, 1)),
        (1, 4, 1, 1, (0, 1)),
        (1, 4, 0, 1, (1, 1)),
        (1, 4, 3, 3, (0, 1)),
        (1, 4, 2, 6, (0, 1)),  # 6 mod 4 = 2
        (1, 4, 3, 7, (0, 1)),
        # rotation: owner (s mod k) is logical owner 0
        (10, 4, 1, 1, (0, 3)),
        (10, 4, 2, 1, (3, 6)),
        (10, 4, 3, 1, (6, 8)),
        (10, 4, 0, 1, (8, 10)),
        (2, 4, 2, 2, (0, 1)),
        (2, 4, 3, 2, (1, 2)),
        (2, 4, 0, 2, (2, 2)),
        (2, 4, 1, 2, (2, 2)),
        (3, 2, 1, 5, (0, 2)),
        (3, 2, 0, 5, (2, 3)),
    ],
)
def test_owned_range_table(n, k, r, s, expected):
    assert owned_range(n, k, r, s) == expected


def test_rotation_spreads_consecutive_single_block_chunks():
    k = 4
    owners = []
    for s in range(8):
        (owner,) = [r for r in range(k) if owned_range(1, k, r, s) == (0, 1)]
        owners.append(owner)
    assert owners == [0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize(
    ("n", "k", "r", "s"), [(-1, 4, 0, 0), (4, 0, 0, 0), (4, -1, 0, 0), (4, 4, 4, 0), (4, 4, -1, 0)]
)
def test_owned_range_rejects_bad_arguments(n, k, r, s):
    with pytest.raises(ValueError):
        owned_range(n, k, r, s)


@given(n=st.integers(0, 5000), k=st.integers(1, 64), s=st.integers(0, 10**9))
@settings(max_examples=500, deadline=None)
def test_owned_ranges_partition_exactly(n, k, s):
    ranges = [owned_range(n, k, r, s) for r in range(k)]
    covered: list[int] = []
    for start, end in ranges:
        assert 0 <= start <= end <= n
        covered.extend(range(start, end))
    # disjoint and covering [0, n)
    assert sorted(covered) == list(range(n))
    assert len(covered) == n
    sizes = [end - start for start, end in ranges]
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == n
    # contiguous in logical order starting from owner s mod k
    ordered = sorted(ranges)
    for (_, e1), (s2, _) in itertools.pairwise(ordered):
        assert e1 == s2
    assert owned_range(n, k, s % k, s)[0] == 0


# ------------------------------------------------------------------ ports (spec 9)


@pytest.mark.parametrize(
    ("kv_port", "dp", "d_tp", "base", "ports"),
    [
        (30000, 0, 4, 30000, (30000, 30001, 30002, 30003)),
        (30000, 1, 4, 30004, (30004, 30005, 30006, 30007)),
        (30000, 3, 2, 30006, (30006, 30007)),
        (5555, 2, 1, 5557, (5557,)),
        (1, 0, 1, 1, (1,)),
        (65532, 0, 4, 65532, (65532, 65533, 65534, 65535)),
        (65531, 1, 2, 65533, (65533, 65534)),
    ],
)
def test_port_plan_table(kv_port, dp, d_tp, base, ports):
    plan = plan_ports(kv_port, dp, d_tp)
    assert plan == PortPlan(kv_port=kv_port, global_dp_rank=dp, d_tp=d_tp)
    assert plan.base_port == base
    assert plan.rank_ports == ports
    assert plan.highest_port == ports[-1]
    assert [plan.rank_port(r) for r in range(d_tp)] == list(ports)


@pytest.mark.parametrize("tp_rank", [-1, 4, 10])
def test_rank_port_outside_tp_is_rejected(tp_rank):
    plan = plan_ports(30000, 0, 4)
    with pytest.raises(TopologyError):
        plan.rank_port(tp_rank)


@pytest.mark.parametrize(
    ("kv_port", "dp", "d_tp"),
    [
        (65533, 0, 4),  # highest 65536
        (65535, 0, 2),
        (65000, 200, 4),  # 65800
        (60000, 2000, 8),
        (0, 0, 1),  # kv_port < 1
        (-5, 0, 1),
        (30000, -1, 4),  # negative dp rank
        (30000, 0, 0),  # d_tp < 1
        (30000, 0, -2),
        (True, 0, 1),
        (30000, True, 1),
        (30000.0, 0, 1),
        (30000, 0.0, 1),
        ("30000", 0, 1),
    ],
)
def test_bad_port_plans_are_refused(kv_port, dp, d_tp):
    with pytest.raises(TopologyError):
        plan_ports(kv_port, dp, d_tp)


def test_highest_port_boundary():
    assert plan_ports(65535, 0, 1).highest_port == MAX_PORT == 65535
    with pytest.raises(TopologyError, match="65535"):
        plan_ports(65535, 1, 1)


@pytest.mark.parametrize(
    ("base", "d_rank", "port"), [(30000, 0, 30000), (30004, 3, 30007), (1, 0, 1), (65534, 1, 65535)]
)
def test_remote_port_table(base, d_rank, port):
    assert remote_port(base, d_rank) == port


@pytest.mark.parametrize(
    ("base", "d_rank"), [(65535, 1), (65530, 10), (0, 0), (-4, 2), (30000, -1), (70000, 0)]
)
def test_remote_port_outside_range_is_refused(base, d_rank):
    with pytest.raises(TopologyError):
        remote_port(base, d_rank)


@given(
    kv_port=st.integers(1, 20000),
    dp_size=st.integers(1, 32),
    d_tp=st.integers(1, 16),
)
@PROPS
def test_many_engines_on_one_host_never_collide(kv_port, dp_size, d_tp):
    owner: dict[int, tuple[int, int]] = {}
    for dp in range(dp_size):
        plan = plan_ports(kv_port, dp, d_tp)
        for tp_rank in range(d_tp):
            port = plan.rank_port(tp_rank)
            assert 1 <= port <= MAX_PORT
            assert port not in owner, f"port {port} of {(dp, tp_rank)} taken by {owner[port]}"
            owner[port] = (dp, tp_rank)
    assert len(owner) == dp_size * d_tp


@given(
    kv_port=st.integers(1, 30000),
    dp=st.integers(0, 64),
    ratio=st.integers(1, 8),
    d_tp=st.integers(1, 8),
    data=st.data(),
)
@PROPS
def test_prefill_reaches_the_port_its_decode_rank_binds(kv_port, dp, ratio, d_tp, data):
    p_tp = ratio * d_tp
    p_rank = data.draw(st.integers(0, p_tp - 1))
    plan = plan_ports(kv_port, dp, d_tp)
    m = compute_mapping(p_tp, d_tp, p_rank)
    # D advertises base_port; P adds its mapped D rank.
    assert remote_port(plan.base_port, m.d_rank) == plan.rank_port(m.d_rank)


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "p_rank", "d_ranks"),
    [(1, 2, 0, (0, 1)), (2, 4, 1, (2, 3)), (4, 8, 3, (6, 7)), (1, 4, 0, (0, 1, 2, 3)),
     (2, 16, 1, tuple(range(8, 16)))],
)
def test_decode_tp_above_prefill_tp_fans_each_prefill_rank_out(p_tp, d_tp, p_rank, d_ranks):
    """Decode TP = fan-out x Prefill TP: Prefill rank p serves Decode ranks
    [p * fan-out, (p + 1) * fan-out), as the one member (0) of a group of 1 each."""
    m = compute_mapping(p_tp, d_tp, p_rank)
    assert (m.d_ranks, m.d_rank, m.member, m.ratio) == (d_ranks, d_ranks[0], 0, 1)
    assert check_topology(p_tp, d_tp) == 1 and fanout(p_tp, d_tp) == d_tp // p_tp
    for d in d_ranks:
        assert contributor_group(p_tp, d_tp, d) == (p_rank,)
