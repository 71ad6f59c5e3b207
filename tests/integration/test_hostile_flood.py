"""A live Decode receiver (real ROUTER) flooded by hostile peers while a valid Prefill
transfers: nothing a peer sends grows Decode without bound.

The hostile peers do what a review found to leak before: a peer that completed
MF_META names hundreds of thousands of request ids Decode never admitted, as member 0
of a contributor group of 2 (so no id ever completes); a peer without MF_META names
more; others send malformed frames of every shape. Meanwhile every valid transfer
must land intact, and once the request deadline passed the receiver's counters show
no state left at all, whatever the flood was.
"""

from __future__ import annotations

import os
import random
import time

import msgpack
import pytest
from fakes.net import wait_until
from fakes.rig import (
    WAIT,
    Rig,
    Transfer,
    assert_guarded,
    assert_transfer_landed,
    layer_name,
    recv_frames,
    reset_blocks,
    run_transfer,
    step,
)

from rd2h.domain.wire.protocol import MF_META, READ_READY_BATCH

pytestmark = pytest.mark.integration

LAYERS = (0, 1)
HOSTILE_IDS = 200_000
MALFORMED = 2_000
IDS_PER_MESSAGE = 2_000
ROUNDS = 10
PER_PEER, TOTAL = 4096, 16384
REQUEST_S = 3.0


def rss_mib() -> float:
    """This process's resident memory (the receiver runs in it)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def pack(value: object) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def malformed_frames(n: int, seed: int) -> list[tuple[bool, bytes]]:
    """``(counts as malformed, frame)``; a frame of an unknown type is ignored, not
    malformed."""
    rnd = random.Random(seed)
    shapes = [
        lambda: b"\xc1" + os.urandom(rnd.randint(0, 64)),  # not msgpack
        lambda: pack([READ_READY_BATCH, 0])[:-1],  # truncated
        lambda: pack([READ_READY_BATCH, "x", 3, None]),  # wrong types
        lambda: pack([READ_READY_BATCH, 1, layer_name(1), "not-a-list", [1]]),
        lambda: pack([MF_META, 5, b"\xc1"]),  # bad nested metadata
        lambda: pack([b"no-such-type", 1]),
        lambda: pack([[[]] * 50] * 50),  # nested empties
        lambda: pack({"a": 1}),  # not an array
    ]
    picks = [rnd.randrange(len(shapes)) for _ in range(n)]
    return [(i != 5, shapes[i]()) for i in picks]


def test_flood_of_hostile_ids_and_malformed_frames_leaves_no_state(capsys) -> None:
    rig = Rig()
    try:
        p = rig.prefill_memory(LAYERS, seed=11)
        d = rig.decode(LAYERS, request_timeout_s=REQUEST_S, max_orphans_per_peer=PER_PEER,
                       max_orphans=TOTAL)
        sender = rig.start_sender(p)
        meta = pack([MF_META, p.session, pack({layer_name(n): p.layouts[n].to_metadata()
                                               .to_map() for n in LAYERS})])
        insider = rig.dealer(d.endpoint)  # completed MF_META: a known peer
        insider.send(meta)
        assert recv_frames(insider) == [b"ACK"]
        stranger = rig.dealer(d.endpoint)  # never sends MF_META
        junk = rig.dealer(d.endpoint)  # malformed frames only

        ids = (f"ghost-{n}" for n in range(HOSTILE_IDS))
        frames = malformed_frames(MALFORMED, seed=5)
        sent_ids = replies = 0
        peak_orphans = 0
        rss = [rss_mib()]
        t0 = time.monotonic()
        for rnd in range(ROUNDS):
            for _ in range(HOSTILE_IDS // ROUNDS // IDS_PER_MESSAGE):
                batch = [next(ids) for _ in range(IDS_PER_MESSAGE)]
                sent_ids += len(batch)
                layer = rnd % 2
                # member 0 of a group of 2: no id ever completes, every id would linger
                insider.send(pack([READ_READY_BATCH, layer, layer_name(layer), [], batch, 0, 2]))
                stranger.send(pack([READ_READY_BATCH, layer, layer_name(layer), [],
                                    batch[:100], 0, 2]))
                replies += 2
            for _, frame in frames[rnd::ROUNDS]:
                junk.send(frame)
            t = Transfer(f"valid-{rnd}", (1, 4, 6), (2, 0, 7), (3, 9, 12), (8, 1, 15))
            reset_blocks(d, t)
            out = run_transfer(p, d, sender, t, [(0, 2), (2, 3)])
            assert out.failed == frozenset(), out
            assert_transfer_landed(p, d, t)
            peak_orphans = max(peak_orphans, d.receiver.counters()["orphans"])
            rss.append(rss_mib())
        got = 0
        deadline = time.monotonic() + 4 * WAIT
        while got < replies:  # every hostile READ_READY_BATCH was answered
            assert time.monotonic() < deadline, f"{got} of {replies} replies"
            for sock in (insider, stranger):
                while sock.poll(0):
                    sock.recv()
                    got += 1
            time.sleep(0.01)
        flood_s = time.monotonic() - t0
        stats = d.receiver.stats
        malformed = sum(bad for bad, _ in frames)
        wait_until(lambda: stats.malformed >= malformed, "the malformed frames to be seen",
                   WAIT)
        assert peak_orphans <= TOTAL
        assert d.receiver.counters()["orphans"] <= PER_PEER  # one known peer's cap
        assert stats.capped >= 1
        assert any("peer state limit reached" in line for line in d.log.lines("warning"))
        assert d.receiver.running

        time.sleep(REQUEST_S + 0.2)  # every deadline passes
        d.receiver.expire()
        step(d.receiver)
        left = {k: v for k, v in d.receiver.counters().items() if v and k != "peers"}
        assert left == {}, left
        assert d.receiver.counters()["peers"] == 2  # the valid Prefill and the insider
        for sock in (insider, stranger, junk):
            sock.close(0)
        wait_until(lambda: d.receiver.counters()["peers"] == 1, "the insider's loss", WAIT)
        assert_guarded(d, {"main": (3, 9, 12), "indexer": (8, 1, 15)})
        with capsys.disabled():
            print(f"\n[hostile flood] {sent_ids} hostile ids from a known peer (+"
                  f"{sent_ids // 20} from one without MF_META), {MALFORMED} malformed "
                  f"frames, {ROUNDS} valid transfers verified in {flood_s:.1f} s; orphan "
                  f"ids held at most {peak_orphans} (caps {PER_PEER}/peer, {TOTAL} in all), "
                  f"{stats.capped} cap episodes, {stats.malformed} malformed counted; "
                  f"state left after the {REQUEST_S:g} s deadline: none; process RSS "
                  f"{rss[0]:.0f} MiB before, per round "
                  f"{', '.join(f'{r:.0f}' for r in rss[1:])} MiB")
    finally:
        rig.close()
