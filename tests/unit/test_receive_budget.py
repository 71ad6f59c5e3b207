"""The Decode control socket's receive budget (``rd2h.adapters.zmq.inbox``): bytes per
peer and in all, eviction of the biggest holder, round-robin serving, drop reports."""

from __future__ import annotations

import pytest

from rd2h.adapters.zmq.inbox import OVERHEAD, Inbox


def cost(identity: bytes, size: int) -> int:
    return size + len(identity) + OVERHEAD


def test_a_peer_over_its_share_is_dropped_and_reported_and_others_still_get_in() -> None:
    box = Inbox(per_peer=3 * cost(b"A", 100), total=100 * cost(b"A", 100))
    for _ in range(5):
        box.put(b"A", b"a" * 100)
    assert box.put(b"B", b"b" * 100)
    assert len(box) == 4  # three of A's, B's one
    assert box.nbytes == 3 * cost(b"A", 100) + cost(b"B", 100)
    shed = box.shed()
    assert [(s.identity, s.messages, s.nbytes) for s in shed] == [(b"A", 2, 200)]
    assert box.shed() == []  # reported once
    assert (box.dropped, box.dropped_bytes) == (2, 200)


def test_over_the_total_the_biggest_holder_gives_way_to_a_small_peer() -> None:
    unit = cost(b"F1", 1000)
    box = Inbox(per_peer=4 * unit, total=6 * unit)
    for _ in range(4):
        assert box.put(b"F1", b"x" * 1000)
    for _ in range(2):
        assert box.put(b"F2", b"y" * 1000)
    assert box.nbytes == 6 * unit  # full
    assert box.put(b"V", b"v" * 10)  # the valid peer gets in: F1's newest goes
    assert box.nbytes <= box.total
    shed = {s.identity: s.messages for s in box.shed()}
    assert shed == {b"F1": 1}
    # A flooder that is itself the biggest holder is refused instead of evicting.
    assert not box.put(b"F1", b"x" * 1000)
    assert {s.identity: s.messages for s in box.shed()} == {b"F1": 1}
    assert box.peak <= box.total


def test_the_total_is_never_exceeded_whatever_the_mix() -> None:
    box = Inbox(per_peer=5000, total=12_000)
    sizes = [17, 900, 4000, 3, 2500, 1200, 4600]
    for n in range(2000):
        peer = bytes([n % 7])
        box.put(peer, b"z" * sizes[(n * 5) % len(sizes)])
        assert box.nbytes <= box.total
        if n % 13 == 0:
            box.take(3, 10_000)
    kept = box.take(10_000, 1 << 30)
    assert box.nbytes == 0 and len(box) == 0
    assert box.peak <= box.total
    assert kept  # something got through at every step of the mix


def test_peers_are_served_in_turn_so_a_backlog_does_not_delay_a_valid_peer() -> None:
    box = Inbox(per_peer=1 << 20, total=1 << 22)
    for n in range(50):
        box.put(b"flood", b"f%d" % n)
    box.put(b"valid", b"announcement")
    first = box.take(2, 1 << 20)
    assert [ident for ident, _ in first] == [b"flood", b"valid"]
    rest = box.take(100, 1 << 20)
    assert [p for _, p in rest] == [b"f%d" % n for n in range(1, 50)]  # in order per peer


def test_a_take_stops_at_its_byte_cap_but_always_returns_one() -> None:
    box = Inbox(per_peer=1 << 20, total=1 << 22)
    for peer in (b"a", b"b", b"c"):
        box.put(peer, b"x" * 1000)
    assert len(box.take(64, 10)) == 1
    assert len(box.take(64, 1500)) == 2


@pytest.mark.parametrize(("per_peer", "total"), [(0, 10), (10, 5)])
def test_a_budget_that_cannot_work_is_refused(per_peer: int, total: int) -> None:
    with pytest.raises(ValueError, match="per_peer"):
        Inbox(per_peer, total)


def test_settings_refuse_a_per_peer_budget_below_one_frame_and_a_total_below_it() -> None:
    from fakes.rig import settings_of
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="must hold one frame"):
        settings_of("decode", {"max_frame_bytes": 1 << 20,
                               "limits": {"max_queued_bytes_per_peer": 1 << 20}})
    with pytest.raises(ValidationError, match="is below"):
        settings_of("decode", {"limits": {"max_queued_bytes": 1 << 20}})
    s = settings_of("decode", {"max_frame_bytes": 1 << 20,
                               "limits": {"max_queued_bytes_per_peer": 2 << 20,
                                          "max_queued_bytes": 8 << 20}})
    assert (s.limits.max_queued_bytes_per_peer, s.limits.max_queued_bytes) == (2 << 20, 8 << 20)
