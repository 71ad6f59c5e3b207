"""Fast paths on the per-message hot path give exactly the answers of the plain checks
they short-cut: the wire block-id range check and the descriptor-batch checks."""

from __future__ import annotations

import random

import numpy as np
import pytest

from rd2h.adapters.regions import RegionTable, validate_batch
from rd2h.domain.errors import ProtocolError, TransferError
from rd2h.domain.wire.protocol import MAX_WIRE_INT, _block_ids, _ids_in_range

EDGES = [0, 1, MAX_WIRE_INT - 1, MAX_WIRE_INT, MAX_WIRE_INT + 1, (1 << 64) - 1, 1 << 64,
         1 << 70, -1, -(1 << 63), -(1 << 64) - 1]


def test_block_id_range_check_matches_min_max() -> None:
    rng = random.Random(7)
    cases = [[v] for v in EDGES] + [[3, v, 5] for v in EDGES]
    for _ in range(3000):
        pool = [*EDGES, rng.randrange(0, 1 << 63), rng.randrange(-(1 << 66), 1 << 66),
                rng.randrange(-2, 600)]
        cases.append([rng.choice(pool) for _ in range(rng.randrange(1, 40))])
    for items in cases:
        want = min(items) >= 0 and max(items) <= MAX_WIRE_INT
        assert _ids_in_range(items) is want, items
        if want:
            assert _block_ids(items, "ids", 0) == tuple(items)
        else:
            with pytest.raises(ProtocolError, match=r"must hold ints in \[0, 2\*\*63\)"):
                _block_ids(items, "ids", 0)


@pytest.mark.parametrize("bad", [True, False, 1.0, None, "1", b"1", [1], {}])
def test_block_ids_still_refuse_every_non_int(bad: object) -> None:
    with pytest.raises(ProtocolError, match="must hold ints"):
        _block_ids([1, bad, 2], "ids", 0)


def _exact_batch_error(local: np.ndarray, remote: np.ndarray, lens: np.ndarray) -> str | None:
    """The descriptor checks written out plainly, descriptor by descriptor."""
    top = (1 << 63) - 1
    for i, n in enumerate(lens.tolist()):
        if n <= 0:
            return f"descriptor {i} has non-positive length"
    for side, addrs in (("local", local), ("remote", remote)):
        for i, (a, n) in enumerate(zip(addrs.tolist(), lens.tolist())):
            if a < 0 or a > top - n:
                return f"descriptor {i} has an invalid {side} range"
    return None


def test_batch_checks_match_the_plain_rules() -> None:
    rng = np.random.default_rng(3)
    top = (1 << 63) - 1
    specials = np.array([0, 1, -1, top, top - 1, -(1 << 63), 1 << 40], dtype=np.int64)
    for _ in range(2000):
        n = int(rng.integers(1, 12))
        lens = rng.integers(1, 1 << 20, n)
        local = rng.integers(0, 1 << 50, n)
        remote = rng.integers(0, 1 << 50, n)
        for arr in (lens, local, remote):
            if rng.random() < 0.3:
                arr[int(rng.integers(0, n))] = rng.choice(specials)
        want = _exact_batch_error(local, remote, lens)
        if want is None:
            validate_batch(local, remote, lens)
        else:
            with pytest.raises(TransferError, match=want):
                validate_batch(local, remote, lens)


def test_region_check_matches_the_plain_rule() -> None:
    rng = np.random.default_rng(5)
    table = RegionTable()
    regions = [(1000, 500), (1200, 2000), (10_000, 100), (50_000, 1)]
    for addr, size in regions:
        table.add(addr, size)
    for _ in range(2000):
        n = int(rng.integers(1, 10))
        addrs = rng.integers(900, 51_000, n)
        lens = rng.integers(1, 600, n)
        want = [i for i, (a, m) in enumerate(zip(addrs.tolist(), lens.tolist()))
                if not any(s <= a and a + m <= s + z for s, z in regions)]
        assert table.outside(addrs, lens).tolist() == want
    assert table.outside(np.zeros(0, np.int64), np.zeros(0, np.int64)).tolist() == []
