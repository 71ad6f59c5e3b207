"""CPU cost of rd2h's own Python per control message, on the Decode hot path and the
Prefill announce path, with the demo's shapes.

Workload (as ``rd2h demo``'s defaults): Prefill TP 4 -> Decode TP 2 (ratio 2), 8 layers
x 2 chunks, 8 requests of 8000 tokens in 128-token blocks (63 blocks: chunks of 31 and
32), spec-13 block sizes (main K 128 KiB, main V 16 KiB, indexer 16 KiB, LIC8 scale
512 B), block ids from a seeded shuffle. Decode rank 0 gets 32 READ_READY_BATCH
messages: 2 contributors (members 0 and 1) x 8 layers x 2 chunks; the last layer of
the last chunk carries the "done" ids.

Stages (CPU microseconds per message; ``time.thread_time`` of the thread doing the
work, median over ``--repeat`` repeats of the whole 32-message sequence):

- ``decode``: ``MsgpackCodec.decode`` of one frame on its connection (the layers after
  a chunk's first carry the same read entries, byte for byte: the codec reuses the
  entries it checked, so only the first layer of each chunk checks every id).
- ``plan``: ``plan_reads`` alone, without a memo: every message planned in full.
- ``receive``: ``DecodeSession.receive`` (validation, planning, book-keeping); the
  session's ``PlanMemo`` reuses a peer's block ownership for the next layer of the
  same chunk, so only the first layer of each chunk pays the full ``plan``.
- ``read_done+encode``: ``begin_read`` + ``read_done`` + encoding the reply.
- ``batch_read (no copy)``: ``CmaTransferEngine.batch_read`` with ``process_vm_readv``
  replaced by a stub that reports every byte copied (the batch checks, the region
  check and the iovec building stay).
- ``loop (zmq)``: the whole ``DecodeReceiver`` loop thread over a real ZeroMQ ROUTER
  fed by two DEALERs (frames queued in advance), with the no-copy engine above: recv,
  loss checks, decode, session, the read, telemetry and the reply. CPU of the loop
  thread only (``pthread_getcpuclockid``), per READ_READY_BATCH.
- ``prefill encode``: ``MsgpackCodec.encode`` of one announcement.
- ``prefill submit``: ``PrefillSender.submit`` (grouping and ``announce``) of one
  layer's 8 targets, in the caller's thread.
- ``prefill sender loop``: the ``PrefillSender`` thread's CPU per announcement (event
  done, encode, send, the reply's decode and bookkeeping), two senders feeding one
  ``DecodeReceiver`` over ZeroMQ.

Only figures are printed; nothing asserts on time.

Run:  .venv/bin/python benchmarks/decode_hot_path.py [--repeat N] [--json]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from rd2h.adapters.cma.transport import CmaTransferEngine
from rd2h.adapters.logging import configure_logging, make_logger
from rd2h.adapters.msgpack import MsgpackCodec
from rd2h.adapters.zmq.channel import ZmqControlClients, ZmqControlServer
from rd2h.app.clock import MonotonicClock
from rd2h.app.decode import DecodeReceiver
from rd2h.app.prefill import LayerTarget, PrefillSender
from rd2h.domain.decode.decode_session import DecodeSession, Read
from rd2h.domain.planning.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.planning.planning import Destination, plan_reads
from rd2h.domain.planning.topology import compute_mapping
from rd2h.domain.prefill.announce import group_batches
from rd2h.domain.wire.protocol import MfMeta, ReadReadyBatch, ReadRequest

P_TP, D_TP = 4, 2
LAYERS, CHUNKS, REQUESTS, PROMPT_TOKENS, BLOCK = 8, 2, 8, 8000, 128
BPB = {"main_k": 1024 * BLOCK, "main_v": 128 * BLOCK, "indexer": 128 * BLOCK,
       "scale": 4 * BLOCK}
SUFFIX = "-e0000001"
HOST = socket.gethostname()
P_SESSION = f"{HOST}:1"  # the cma engine only checks the host part and the pid's form
_WINDOW = 1 << 36
_P_BASE = 1 << 44
_D_BASE = 1 << 46


def layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn"


def ext_id(r: int) -> str:
    return f"req-{r:05d}"


# ------------------------------------------------------------------ workload


@dataclass(frozen=True)
class Workload:
    p_blocks: list[tuple[int, ...]]
    d_main: list[tuple[int, ...]]
    d_idx: list[tuple[int, ...]]
    pool: int
    ranges: list[tuple[int, int, bool]]
    src: dict[int, SourceLayout]
    dst: dict[str, DestinationLayout]


def workload(seed: int = 0) -> Workload:
    per_req = -(-PROMPT_TOKENS // BLOCK)
    need = REQUESTS * per_req
    pool = need + max(8, need // 8)
    rng = np.random.default_rng(seed)

    def split(perm: np.ndarray) -> list[tuple[int, ...]]:
        return [tuple(int(x) for x in perm[i * per_req:(i + 1) * per_req])
                for i in range(REQUESTS)]

    p_blocks, d_main, d_idx = (split(rng.permutation(pool)) for _ in range(3))
    step = -(-PROMPT_TOKENS // CHUNKS)
    ranges, transferred = [], 0
    for i in range(CHUNKS):
        computed = min(PROMPT_TOKENS, step * (i + 1))
        final = i == CHUNKS - 1
        start = transferred // BLOCK
        end = -(-computed // BLOCK) if final else computed // BLOCK
        ranges.append((start, end, final))
        transferred = end * BLOCK
    comps = list(BPB)
    src, dst = {}, {}
    for layer in range(LAYERS):
        def s(c: str, layer: int = layer) -> TensorComponent:
            base = _P_BASE + (layer * len(comps) + comps.index(c)) * _WINDOW
            return TensorComponent(base, BPB[c], 1, 0, num_blocks=pool)

        def d(c: str, layer: int = layer) -> DestTensor:
            base = _D_BASE + (layer * len(comps) + comps.index(c)) * _WINDOW
            return DestTensor(base, BPB[c], pool)

        src[layer] = SourceLayout(layer_name(layer), (s("main_k"), s("main_v")),
                                  s("indexer"), s("scale"))
        dst[layer_name(layer)] = DestinationLayout(
            layer_name(layer), (d("main_k"), d("main_v")), d("indexer"), d("scale"))
    return Workload(p_blocks, d_main, d_idx, pool, ranges, src, dst)


def layer_targets(w: Workload, p_rank: int, layer: int, chunk: int,
                  endpoint: str) -> list[LayerTarget]:
    """What the demo's Prefill rank ``p_rank`` submits for one layer of one chunk."""
    mapping = compute_mapping(P_TP, D_TP, p_rank)
    start, end, final = w.ranges[chunk]
    done = final and layer == LAYERS - 1
    out = []
    for r in range(REQUESTS):
        ids = w.p_blocks[r][start:end]
        req = ReadRequest(ext_id(r), ids, ids, start, start) if end > start else None
        if req is not None or done:
            out.append(LayerTarget(endpoint, req, done, mapping.member, mapping.ratio, ext_id(r)))
    return out


def decode_messages(w: Workload, d_rank: int = 0) -> list[tuple[int, ReadReadyBatch]]:
    """``(member, batch)`` Decode rank ``d_rank`` receives, in the demo's order."""
    members = [p for p in range(P_TP) if compute_mapping(P_TP, D_TP, p).d_rank == d_rank]
    out = []
    for chunk in range(CHUNKS):
        for layer in range(LAYERS):
            for p in members:
                (batch,) = group_batches(layer, layer_name(layer),
                                         layer_targets(w, p, layer, chunk, "ep")).values()
                out.append((p, batch))
    return out


def metadata(w: Workload) -> MfMeta:
    return MfMeta(P_SESSION, {lay.layer_name: lay.to_metadata() for lay in w.src.values()})


# ------------------------------------------------------------------ helpers


def no_copy_readv(pid: int, local: int, lcount: int, remote: int, rcount: int, flags: int) -> int:
    """``process_vm_readv`` that copies nothing and reports every byte copied."""
    iov = np.frombuffer((ctypes.c_char * (16 * lcount)).from_address(local), dtype=np.int64)
    return int(iov[1::2].sum())


def no_copy_engine(w: Workload) -> CmaTransferEngine:
    engine = CmaTransferEngine()
    engine._readv = no_copy_readv  # type: ignore[assignment]
    for lay in w.dst.values():
        for t in (*lay.main, lay.indexer, lay.scale):
            assert t is not None
            engine.register_memory(t.base_addr, t.bytes_per_block * t.num_blocks)
    return engine


def thread_cpu(ident: int) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def admit_all(admit: Callable[[str, tuple[int, ...], tuple[int, ...]], object],
              w: Workload) -> None:
    for r in range(REQUESTS):
        admit(ext_id(r) + SUFFIX, w.d_main[r], w.d_idx[r])


# ------------------------------------------------------------------ stages


def bench_stages(w: Workload, repeat: int) -> dict[str, list[float]]:
    codec = MsgpackCodec()
    msgs = decode_messages(w)
    frames = [codec.encode(b) for _, b in msgs]
    peers = {0: b"peer-0", 1: b"peer-1"}
    engine = no_copy_engine(w)
    samples: dict[str, list[float]] = {k: [] for k in (
        "decode", "plan", "receive", "read_done+encode", "batch_read (no copy)")}
    n = len(frames)
    for _ in range(repeat):
        s = DecodeSession(destinations=w.dst, d_rank=0, d_tp=D_TP, main_shared=True)
        meta = metadata(w)
        for peer in peers.values():
            s.receive(peer, meta, 0.0)
        admit_all(lambda i, m, x, s=s: s.admit(i, m, x, 0.0), w)
        dests = {ext_id(r): Destination(w.d_main[r], w.d_idx[r]) for r in range(REQUESTS)}
        src_of = {lay.layer_name: lay for lay in w.src.values()}
        gc.collect()
        acc = dict.fromkeys(samples, 0.0)
        clock = time.thread_time
        for (member, _), frame in zip(msgs, frames):
            peer = peers[member]
            t0 = clock()
            message = codec.decode(frame, peer)
            t1 = clock()
            plan_reads(message, src_of[message.layer_name], w.dst[message.layer_name], dests,
                       d_rank=0, d_tp=D_TP, main_shared=True)
            t2 = clock()
            outs = s.receive(peer, message, 1.0)
            t3 = clock()
            (read,) = [o for o in outs if isinstance(o, Read)]
            plan = read.plan
            engine.batch_read(read.p_session, plan.local_addrs, plan.remote_addrs, plan.lengths)
            t4 = clock()
            assert s.begin_read(read.token)
            replies = s.read_done(read.token, 1.0)
            codec.encode(replies[0].message, peer)
            t5 = clock()
            acc["decode"] += t1 - t0
            acc["plan"] += t2 - t1
            acc["receive"] += t3 - t2
            acc["batch_read (no copy)"] += t4 - t3
            acc["read_done+encode"] += t5 - t4
        for k, v in acc.items():
            samples[k].append(v / n * 1e6)
    engine.close()
    return samples


def started_receiver(w: Workload, codec: MsgpackCodec,
                     log: Any) -> tuple[CmaTransferEngine, DecodeReceiver, str]:
    """A Decode rank 0 receive loop over ZeroMQ with the no-copy engine, every request of
    the workload admitted."""
    engine = no_copy_engine(w)
    receiver = DecodeReceiver(
        server_factory=lambda: ZmqControlServer("127.0.0.1", _free_port()), codec=codec,
        transfer=engine, destinations=w.dst, d_rank=0, d_tp=D_TP,
        clock=MonotonicClock(), log=log, main_shared=True)
    endpoint = receiver.start()
    admit_all(receiver.admit, w)
    return engine, receiver, endpoint


def bench_loop(w: Workload, repeat: int) -> list[float]:
    """The DecodeReceiver loop thread's CPU per READ_READY_BATCH over real ZeroMQ."""
    codec = MsgpackCodec()
    msgs = decode_messages(w)
    frames = [(member, codec.encode(b)) for member, b in msgs]
    log = make_logger("decode", 0)
    ctx = zmq.Context.instance()
    out = []
    for _ in range(repeat):
        engine, receiver, endpoint = started_receiver(w, codec, log)
        dealers = {}
        for member in (0, 1):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            sock.send(codec.encode(metadata(w)))
            assert sock.poll(5000) and sock.recv_multipart()[-1] == b"ACK"
            dealers[member] = sock
        gc.collect()
        ident = receiver._thread.ident  # type: ignore[union-attr]
        time.sleep(0.06)  # let the loop settle into its poll
        c0 = thread_cpu(ident)
        for member, frame in frames:
            dealers[member].send(frame)
        got = 0
        poller = zmq.Poller()
        for sock in dealers.values():
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + 30
        while got < len(frames) and time.monotonic() < deadline:
            for sock, _ in poller.poll(1000):
                while sock.poll(0):
                    sock.recv_multipart()
                    got += 1
        c1 = thread_cpu(ident)
        assert got == len(frames), f"only {got} replies"
        assert receiver.stats.layers_done == len(frames), receiver.stats
        out.append((c1 - c0) / len(frames) * 1e6)
        for sock in dealers.values():
            sock.close(0)
        receiver.stop()
        engine.close()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bench_prefill(w: Workload, repeat: int) -> dict[str, list[float]]:
    codec = MsgpackCodec()
    log = make_logger("prefill", 0)
    samples: dict[str, list[float]] = {"prefill encode": [], "prefill submit": [],
                                       "prefill sender loop": []}
    batches = [b for _, b in decode_messages(w)]
    for _ in range(repeat):
        t0 = time.thread_time()
        for b in batches:
            codec.encode(b, "ep")
        samples["prefill encode"].append((time.thread_time() - t0) / len(batches) * 1e6)
    for _ in range(repeat):
        engine, receiver, endpoint = started_receiver(w, codec, log)
        senders = {}
        for p in (0, 1):
            # One Prefill process per contributor: each its own session (Decode takes a
            # second MF_META of one session as that process restarted).
            sender = PrefillSender(clients_factory=ZmqControlClients, codec=codec,
                                   p_session=f"{HOST}:{1 + p}", layers=w.src,
                                   clock=MonotonicClock(), log=log)
            sender.start()
            assert not sender.prepare([endpoint], 5.0)
            senders[p] = sender
        gc.collect()
        time.sleep(0.05)
        idents = [s._thread.ident for s in senders.values()]  # type: ignore[union-attr]
        c0 = [thread_cpu(i) for i in idents]
        submit = 0.0
        count = 0
        for chunk in range(CHUNKS):
            for layer in range(LAYERS):
                for p, sender in senders.items():
                    targets = layer_targets(w, p, layer, chunk, endpoint)
                    t0 = time.thread_time()
                    sender.submit(layer, None, targets)
                    submit += time.thread_time() - t0
                    count += 1
        for sender in senders.values():
            assert sender.drain(30.0)
        c1 = [thread_cpu(i) for i in idents]
        assert receiver.stats.layers_done == count, receiver.stats
        samples["prefill submit"].append(submit / count * 1e6)
        samples["prefill sender loop"].append(
            sum(b - a for a, b in zip(c0, c1)) / count * 1e6)
        for sender in senders.values():
            sender.stop()
        receiver.stop()
        engine.close()
    return samples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=15, help="repeats of the 32 messages")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    configure_logging("WARNING")
    w = workload()
    results = bench_stages(w, args.repeat)
    results["loop (zmq)"] = bench_loop(w, max(3, args.repeat // 2))
    results.update(bench_prefill(w, max(3, args.repeat // 2)))
    table = {k: round(statistics.median(v), 1) for k, v in results.items()}
    if args.json:
        json.dump({"us_per_message": table, "python": sys.version.split()[0]}, sys.stdout,
                  indent=2)
        print()
        return 0
    print(f"{'stage':<24} {'median us/message':>18}   (min .. max)")
    for k, v in results.items():
        print(f"{k:<24} {table[k]:>18.1f}   ({min(v):.1f} .. {max(v):.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
