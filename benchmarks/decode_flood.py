"""Decode's memory under a flood of full-size control frames (issue #43, item 5).

A Decode control server (the real ``ZmqControlServer``) in a child process, with a
loop thread that takes batches and decodes every frame with msgpack (the codec's
first cost; it refuses the junk ones) like the receive loop. A second child floods
it from ``--connections`` DEALERs with frames of ``--frame-mib`` as fast as TCP takes
them: half bytes that are not msgpack, half READ_READY_BATCHes naming ~40,000 ids per
MiB. The Decode child prints its resident memory every half second; the summary is
its growth over the level before the flood, what its loop handled and what was
dropped over the receive budget.

``--baseline-src DIR`` runs the same flood against the ``rd2h`` package in DIR (e.g.
a ``git archive`` of an older commit) side by side. A tree without a receive budget
shows libzmq buffering the flood without bound.

    .venv/bin/python benchmarks/decode_flood.py --baseline-src /tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DECODE = r"""
import inspect, json, sys, threading, time
import msgpack
import rd2h
from rd2h.adapters.zmq.channel import ZmqControlServer
print("rd2h from", rd2h.__file__, file=sys.stderr, flush=True)
port, frame, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
kw = {}
params = inspect.signature(ZmqControlServer).parameters
if "max_queued_bytes_per_peer" in params:
    kw = {"max_queued_bytes_per_peer": 4 * frame + 8192,
          "max_queued_bytes": 16 * frame + 32768}
server = ZmqControlServer("127.0.0.1", port, max_frame_bytes=frame + 4096, **kw)
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
handled = 0
stop = False
def loop():
    global handled
    while not stop:
        for _, payload in server.recv_many(0.1, 64):
            try:
                msgpack.unpackb(payload)
            except Exception:
                pass
            handled += 1
        server.disconnected()
threading.Thread(target=loop, daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()  # the flood starts
base, samples, t0 = rss(), [], time.monotonic()
while time.monotonic() - t0 < seconds + 1.0:
    time.sleep(0.5)
    samples.append(round(rss(), 1))
stop = True
figures = server.queue_figures() if hasattr(server, "queue_figures") else {}
print(json.dumps({"base": base, "samples": samples, "handled": handled, **figures}),
      flush=True)
server.close()
"""

FLOOD = r"""
import os, sys, time, zmq, msgpack
endpoint, conns, seconds, frame = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), \
    int(sys.argv[4])
ctx = zmq.Context(4)
socks = []
for _ in range(conns):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 4)
    s.connect(endpoint)
    socks.append(s)
junk = b"\xc1" + os.urandom(frame - 1)
ids, size, n = [], 40, 0
while size < frame - 64:
    ids.append(f"flood-{n:010d}-pad-pad-pad")
    size += len(ids[-1]) + 2
    n += 1
costly = msgpack.packb([1, 0, "model.layers.0.self_attn.attn", [], ids, 0, 2],
                       use_bin_type=True)
print("ready", flush=True)
sent = nbytes = 0
t0 = time.monotonic()
while time.monotonic() - t0 < seconds:
    progressed = False
    for i, s in enumerate(socks):
        payload = costly if (sent + i) % 2 else junk
        try:
            s.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            continue
        sent += 1
        nbytes += len(payload)
        progressed = True
    if not progressed:
        time.sleep(0.0005)
print(sent, nbytes, flush=True)
for s in socks:
    s.close(0)
ctx.term()
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(src: Path, args: argparse.Namespace) -> dict[str, object]:
    frame = int(args.frame_mib * 2**20)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(src)}
    decode = subprocess.Popen(
        [sys.executable, "-c", DECODE, str(port), str(frame), str(args.seconds)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=src)
    assert decode.stdout is not None and decode.stdin is not None
    try:
        if decode.stdout.readline().strip() != "ready":
            raise SystemExit(f"the Decode child for {src} did not start")
        flood = subprocess.Popen(
            [sys.executable, "-c", FLOOD, f"tcp://127.0.0.1:{port}", str(args.connections),
             str(args.seconds), str(frame)], stdout=subprocess.PIPE, text=True)
        decode.stdin.write("go\n")
        decode.stdin.flush()
        flood_out, _ = flood.communicate(timeout=args.seconds + 60)
        out, _ = decode.communicate(timeout=args.seconds + 60)
    finally:
        for proc in (decode,):
            if proc.poll() is None:
                proc.kill()
    figures: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    sent, nbytes = (int(v) for v in flood_out.strip().splitlines()[-1].split())
    figures.update(sent=sent, sent_mib=nbytes / 2**20)
    return figures


def show(name: str, f: dict[str, object]) -> None:
    base = float(f["base"])  # type: ignore[arg-type]
    samples = [float(s) for s in f["samples"]]  # type: ignore[union-attr]
    print(f"{name}: flood {f['sent']} frames ({f['sent_mib']:.0f} MiB); loop handled "
          f"{f['handled']}; dropped over the budget: {f.get('dropped', 'n/a (no budget)')}; "
          f"RSS before {base:.0f} MiB, peak {max(samples):.0f} MiB (+{max(samples) - base:.0f})")
    print("  RSS every 0.5 s (MiB): " + ", ".join(f"{s:.0f}" for s in samples))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="flood length (default 5)")
    parser.add_argument("--connections", type=int, default=8,
                        help="flooding connections (default 8)")
    parser.add_argument("--frame-mib", type=float, default=1.0,
                        help="frame size and the Decode's max_frame_bytes (default 1 MiB); "
                        "the budget is 4 frames per peer, 16 in all")
    parser.add_argument("--baseline-src", type=Path, help="also run the rd2h package in DIR")
    args = parser.parse_args(argv)
    show("this tree", run(ROOT, args))
    if args.baseline_src is not None:
        show(f"baseline ({args.baseline_src})", run(args.baseline_src, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
