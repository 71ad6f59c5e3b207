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

import contextlib
import importlib.util
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from fakes.net import free_port, wait_until
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

from rd2h.adapters.zmq.channel import ZmqControlServer
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


# ---------------------------------------------------------------- a flood of full frames

FRAME = 1 << 20  # the Decode's max_frame_bytes here
PER_PEER_BUDGET, TOTAL_BUDGET = 4 * FRAME, 16 * FRAME
FLOODERS = 8
FLOOD_S = 6.0
# Peak RSS over its level before the flood: the inbox's budget (16 MiB), one batch the
# loop holds, what libzmq decodes between two drains (20 ms) or while the drain waits
# for the GIL, and glibc's per-thread arenas keeping what libzmq's I/O threads freed.
# Measured here: +41..+122 MiB, flat after the first second. Without the receive
# budget the same flood grew Decode by 2 GiB in 5 s, still climbing (RESULTS.md).
RSS_GROWTH_BOUND_MIB = 384

def _flood_script() -> str:
    """The flooder of ``benchmarks/decode_flood.py`` (one flood, measured both ways)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_flood.py"
    spec = importlib.util.spec_from_file_location("decode_flood", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.FLOOD)


@contextlib.contextmanager
def flooding(endpoint: str, seconds: float) -> Iterator[subprocess.Popen[str]]:
    """``FLOODERS`` connections sending ``FRAME``-byte frames to ``endpoint`` for
    ``seconds``, from a child process, started (and killed if still running at exit);
    its last line is ``"<frames> <bytes>"``."""
    flood = subprocess.Popen(
        [sys.executable, "-c", _flood_script(), endpoint, str(FLOODERS), str(seconds),
         str(FRAME)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield flood
    finally:
        if flood.poll() is None:
            flood.kill()
            flood.wait()


def flood_figures(out_text: str) -> tuple[int, int]:
    sent, nbytes = (int(v) for v in out_text.strip().splitlines()[-1].split())
    return sent, nbytes


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)


def test_a_flood_of_full_frames_from_many_connections_keeps_decode_bounded(capsys) -> None:
    """Eight connections send full-size frames as fast as TCP takes them while a valid
    Prefill transfers: Decode's memory stays within its receive budget plus a fixed
    margin, every valid transfer lands intact, and what was dropped is counted."""
    rig = Rig()
    try:
        p = rig.prefill_memory(LAYERS, seed=13)
        budget = {"max_queued_bytes_per_peer": PER_PEER_BUDGET,
                  "max_queued_bytes": TOTAL_BUDGET}
        d = rig.decode(LAYERS, settings={"max_frame_bytes": FRAME, "limits": budget})
        sender = rig.start_sender(p)
        warm = Transfer("warm", (1, 4, 6), (2, 0, 7), (3, 9, 12), (8, 1, 15))
        assert run_transfer(p, d, sender, warm, [(0, 3)]).failed == frozenset()
        with flooding(d.endpoint, FLOOD_S) as flood:
            assert flood.stdout is not None
            assert flood.stdout.readline().strip() == "ready"
            before = rss_mib()
            reset_peak_rss()
            t0 = time.monotonic()
            done = 0
            while flood.poll() is None and time.monotonic() - t0 < FLOOD_S + 30:
                t = Transfer(f"valid-{done}", (1, 4, 6), (2, 0, 7), (3, 9, 12), (8, 1, 15))
                reset_blocks(d, t)
                out = run_transfer(p, d, sender, t, [(0, 2), (2, 3)])
                assert out.failed == frozenset(), (done, out)
                assert_transfer_landed(p, d, t)
                done += 1
            out_text, _ = flood.communicate(timeout=30)
        peak = peak_rss_mib()
        sent, nbytes = flood_figures(out_text)
        figures = d.receiver._server.queue_figures()  # type: ignore[attr-defined]
        wait_until(lambda: d.receiver.stats.shed > 0, "the drops to be reported", WAIT)
        stats = d.receiver.stats
        assert done >= 3, f"only {done} valid transfers during the flood"
        assert figures["peak_bytes"] <= TOTAL_BUDGET
        assert figures["dropped"] > 0 and stats.shed > 0
        assert any("dropped unread" in line for line in d.log.lines("warning"))
        assert peak - before <= RSS_GROWTH_BOUND_MIB, (before, peak)
        assert d.receiver.running
        assert_guarded(d, {"main": (3, 9, 12), "indexer": (8, 1, 15)})
        with capsys.disabled():
            print(f"\n[full-frame flood] {FLOODERS} connections sent {sent} frames "
                  f"({nbytes / 2**20:.0f} MiB) of up to {FRAME >> 20} MiB in {FLOOD_S:g} s; "
                  f"Decode dropped {figures['dropped']} unread "
                  f"({figures['dropped_bytes'] / 2**20:.0f} MiB), its inbox held at most "
                  f"{figures['peak_bytes'] / 2**20:.1f} MiB (budget {PER_PEER_BUDGET >> 20} MiB "
                  f"per peer, {TOTAL_BUDGET >> 20} MiB in all); process RSS {before:.0f} MiB "
                  f"before, peak {peak:.0f} MiB (+{peak - before:.0f}, bound "
                  f"+{RSS_GROWTH_BOUND_MIB}); {done} valid transfers verified meanwhile")
    finally:
        rig.close()


def test_while_the_loop_is_away_a_flood_is_drained_into_the_budget_and_a_valid_peer_kept(
        capsys) -> None:
    """The loop does not read at all for the whole flood (a long KV read): the drain
    thread alone keeps libzmq empty, the inbox within its budget and the process
    bounded; the valid peer's messages all wait in the inbox, in order, when the loop
    comes back (the flooders gave way)."""
    port = free_port()
    server = ZmqControlServer("127.0.0.1", port, max_frame_bytes=FRAME + 4096,
                              max_queued_bytes_per_peer=PER_PEER_BUDGET,
                              max_queued_bytes=TOTAL_BUDGET)
    valid = zmq.Context.instance().socket(zmq.DEALER)
    valid.setsockopt(zmq.LINGER, 0)
    try:
        endpoint = f"tcp://127.0.0.1:{port}"
        valid.connect(endpoint)
        with flooding(endpoint, 3.0) as flood:
            assert flood.stdout is not None
            assert flood.stdout.readline().strip() == "ready"
            before = rss_mib()
            reset_peak_rss()
            sent_valid = 0
            while flood.poll() is None:
                valid.send(b"valid-%04d" % sent_valid)
                sent_valid += 1
                time.sleep(0.05)
            out_text, _ = flood.communicate(timeout=30)
        peak = peak_rss_mib()
        sent, nbytes = flood_figures(out_text)
        figures = server.queue_figures()
        got: list[bytes] = []
        deadline = time.monotonic() + WAIT
        while len(got) < sent_valid and time.monotonic() < deadline:
            got += [p for ident, p in server.recv_many(0.2, 64) if p.startswith(b"valid-")]
            server.disconnected()  # as the loop does: the flooders' losses
        assert got == [b"valid-%04d" % n for n in range(sent_valid)]
        assert figures["dropped"] > 0
        assert figures["peak_bytes"] <= TOTAL_BUDGET
        assert peak - before <= RSS_GROWTH_BOUND_MIB, (before, peak)
        with capsys.disabled():
            print(f"\n[flood, loop away] {FLOODERS} connections sent {sent} frames "
                  f"({nbytes / 2**20:.0f} MiB) in 3 s to a loop that read nothing; the drain "
                  f"thread dropped {figures['dropped']} and held at most "
                  f"{figures['peak_bytes'] / 2**20:.1f} MiB; RSS {before:.0f} MiB before, peak "
                  f"{peak:.0f} MiB (+{peak - before:.0f}); all {sent_valid} messages of the "
                  f"valid peer kept, in order")
    finally:
        valid.close(0)
        server.close()
