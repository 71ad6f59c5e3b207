"""rd2h's control plane at DeepSeek-V3.2 shapes: what many Prefill ranks cost one Decode rank.

Geometry (spec 13): 61 layers, 128-token blocks, main K 128 KiB + main V 16 KiB, indexer
16 KiB and LIC8 scale 512 B per block and layer. Prefill TP 16 -> Decode TP 4: 4
contributors (members 0..3) per Decode rank; member 0 pulls main, the members split the
indexer and scale. Prompts of ``--prompt`` tokens prefilled in ``--chunk``-token chunks
(one chunk per Prefill step, as vLLM's chunked prefill with that token budget); every
chunk announces each of the 61 layers once per contributor. ``--fan-in`` Prefill
instances feed the one Decode rank, each prefilling its requests back to back; their
announcements interleave. Block ids come from a seeded shuffle (no two adjacent blocks
merge: the planner's worst case).

Everything on the path is rd2h's real code: ``MsgpackCodec`` (every check), the
``DecodeReceiver`` loop over a real ZeroMQ ROUTER, ``DecodeSession``, the planner, the
``CmaTransferEngine`` with ``process_vm_readv`` replaced by a stub that copies nothing and
reports every byte copied (the batch, region and iovec checks stay), the replies; on
Prefill, ``PrefillSender`` (grouping, session, encode, send, the replies). Each side is
measured in its own process, against a peer process: the Decode rank against a feeder
that sends pre-encoded frames from one DEALER per contributor (each its own Prefill
session, MF_META first); one Prefill rank against a Decode rank like the above.

Printed (per case): messages per request per Decode rank, bytes per message (wire; and
KV it makes the rank read), Decode CPU per READ_READY_BATCH and per request, split into
the loop thread, ZeroMQ's I/O threads and all of the process; the most announcements per
second the rank sustains (all frames queued ahead: the loop never waits for input, so
this is the rate past which its queue grows); Prefill CPU per layer (caller's ``submit``,
sender thread, whole process); the Decode process's peak RSS; and the control plane's CPU
per request next to the time its KV takes on the wire at 25, 50 and 100 GB/s per rank.
Nothing asserts on time; the exit status is 1 only if a run did not complete every
announcement (a reply missing, a layer failed).

Before/after: ``--baseline-src DIR`` runs every case a second time with the ``rd2h``
package found in DIR (for instance a ``git worktree`` of an older commit) and prints
both side by side.

Run:  .venv/bin/python benchmarks/production_scale.py [--case NAME ...] [--json]
          [--baseline-src DIR] [--repeat N] [--smoke]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
LAYERS, BLOCK, P_TP, D_TP = 61, 128, 16, 4
RATIO = P_TP // D_TP
BPB = {"main_k": 1024 * BLOCK, "main_v": 128 * BLOCK, "indexer": 128 * BLOCK,
       "scale": 4 * BLOCK}
_WINDOW = 1 << 38
_P_BASE = 1 << 44
_D_BASE = 1 << 46
SUFFIX = "-e0000001"


@dataclass(frozen=True)
class Case:
    name: str
    prompt: int  # tokens per request
    chunk: int  # tokens per Prefill step
    fan_in: int  # Prefill instances feeding the Decode rank
    per_instance: int  # requests each instance prefills, back to back
    layers: int = LAYERS

    @property
    def requests(self) -> int:
        return self.fan_in * self.per_instance

    @property
    def blocks(self) -> int:
        return -(-self.prompt // BLOCK)


CASES = {
    "32k-8k": Case("32k-8k", 32768, 8192, 1, 4),
    "128k-16k": Case("128k-16k", 131072, 16384, 1, 2),
    "fan-in-8": Case("fan-in-8", 32768, 16384, 8, 1),
}
SMOKE = Case("smoke", 4096, 2048, 2, 1, layers=4)


def layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn"


def ext_id(r: int) -> str:
    return f"req-{r:05d}"


# ------------------------------------------------------------------ shapes


def _layouts(case: Case, pool: int) -> tuple[dict[int, Any], dict[str, Any]]:
    from rd2h.domain.planning.layout import (
        DestinationLayout,
        DestTensor,
        SourceLayout,
        TensorComponent,
    )
    comps = list(BPB)
    src, dst = {}, {}
    for layer in range(case.layers):
        def s(c: str, layer: int = layer) -> Any:
            base = _P_BASE + (layer * len(comps) + comps.index(c)) * _WINDOW
            return TensorComponent(base, BPB[c], 1, 0, num_blocks=pool)

        def d(c: str, layer: int = layer) -> Any:
            base = _D_BASE + (layer * len(comps) + comps.index(c)) * _WINDOW
            return DestTensor(base, BPB[c], pool)

        src[layer] = SourceLayout(layer_name(layer), (s("main_k"), s("main_v")),
                                  s("indexer"), s("scale"))
        dst[layer_name(layer)] = DestinationLayout(
            layer_name(layer), (d("main_k"), d("main_v")), d("indexer"), d("scale"))
    return src, dst


@dataclass
class Workload:
    case: Case
    pool: int
    p_blocks: list[tuple[int, ...]]
    d_main: list[tuple[int, ...]]
    d_idx: list[tuple[int, ...]]

    def ranges(self) -> list[tuple[int, int, bool]]:
        """(first block, end block, final) of each chunk, as the connector announces."""
        out, sent, step = [], 0, self.case.chunk
        prompt = self.case.prompt
        for i in range(-(-prompt // step)):
            computed = min(prompt, step * (i + 1))
            final = computed == prompt
            end = -(-computed // BLOCK) if final else computed // BLOCK
            out.append((sent // BLOCK, end, final))
            sent = end * BLOCK
        return out


def workload(case: Case, seed: int = 0) -> Workload:
    import numpy as np
    per = case.blocks
    pool = case.requests * per + 64
    rng = np.random.default_rng(seed)

    def split(perm: Any) -> list[tuple[int, ...]]:
        return [tuple(int(x) for x in perm[i * per:(i + 1) * per])
                for i in range(case.requests)]

    return Workload(case, pool, *(split(rng.permutation(pool)) for _ in range(3)))


def announcements(w: Workload, member: int, instance: int) -> list[tuple[int, Any]]:
    """``(layer, ReadReadyBatch)`` one contributor of one Prefill instance sends to Decode
    rank 0, in order: its requests back to back, chunk by chunk, layer by layer."""
    from rd2h.domain.prefill.announce import LayerTarget, group_batches
    from rd2h.domain.wire.protocol import ReadRequest
    out = []
    case = w.case
    for k in range(case.per_instance):
        r = instance + k * case.fan_in
        for start, end, final in w.ranges():
            ids = w.p_blocks[r][start:end]
            for layer in range(case.layers):
                req = ReadRequest(ext_id(r), ids, ids, start, start) if end > start else None
                done = final and layer == case.layers - 1
                target = LayerTarget("ep", req, done, member, RATIO, ext_id(r))
                (batch,) = group_batches(layer, layer_name(layer), [target]).values()
                out.append((layer, batch))
    return out


def interleaved(w: Workload) -> list[tuple[int, int, Any]]:
    """``(instance, member, batch)`` in arrival order: instances take turns per chunk-layer,
    the members of one instance send each layer together (their ranks run in lockstep)."""
    per = {(i, m): announcements(w, m, i) for i in range(w.case.fan_in) for m in range(RATIO)}
    n = len(per[(0, 0)])
    return [(i, m, per[(i, m)][k][1]) for k in range(n) for i in range(w.case.fan_in)
            for m in range(RATIO)]


# ------------------------------------------------------------------ process measures


def _task_ns() -> dict[str, int]:
    """CPU nanoseconds per thread name of this process (``/proc/self/task``)."""
    out: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            ns = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
        except OSError:
            continue
        key = "zmq" if name.startswith("ZMQbg") else ("loop" if name.startswith("rd2h-") else
                                                      "other")
        out[key] = out.get(key, 0) + ns
    return out


def _thread_cpu(ident: int) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _no_copy_readv(pid: int, local: int, lcount: int, remote: int, rcount: int,
                   flags: int) -> int:
    import numpy as np
    iov = np.frombuffer((ctypes.c_char * (16 * lcount)).from_address(local), dtype=np.int64)
    return int(iov[1::2].sum())


def _receiver(w: Workload, dst: dict[str, Any]) -> tuple[Any, Any, str]:
    from rd2h.adapters.cma.transport import CmaTransferEngine
    from rd2h.adapters.logging import make_logger
    from rd2h.adapters.msgpack import MsgpackCodec
    from rd2h.adapters.zmq.channel import ZmqControlServer
    from rd2h.app.clock import MonotonicClock
    from rd2h.app.decode import DecodeReceiver
    engine = CmaTransferEngine()
    engine._readv = _no_copy_readv
    for lay in dst.values():
        for t in (*lay.main, lay.indexer, lay.scale):
            engine.register_memory(t.base_addr, t.bytes_per_block * t.num_blocks)
    port = _free_port()
    receiver = DecodeReceiver(
        server_factory=lambda: ZmqControlServer("127.0.0.1", port), codec=MsgpackCodec(),
        transfer=engine, destinations=dst, d_rank=0, d_tp=D_TP, clock=MonotonicClock(),
        log=make_logger("decode", 0), main_shared=True, request_timeout_s=3600.0)
    endpoint = receiver.start()
    for r in range(w.case.requests):
        receiver.admit(ext_id(r) + SUFFIX, w.d_main[r], w.d_idx[r])
    return engine, receiver, endpoint


def _session(instance: int, member: int) -> str:
    # The cma engine checks only the host part and the pid's form of a Prefill session.
    return f"{socket.gethostname()}:{1000 + instance * RATIO + member}"


# ------------------------------------------------------------------ Decode side


def _meta(session: str, meta_map: Any, runs: int) -> Any:
    """MF_META as rd2h's Prefill sends it (a compat map, a generation); stating layer runs
    when ``runs`` > 1 and the tree knows them (an older tree's MfMeta has no features)."""
    from rd2h.domain.wire.compat import compat_of
    from rd2h.domain.wire.protocol import MfMeta
    try:
        from rd2h.domain.wire.protocol import FEATURE_LAYER_RUNS
    except ImportError:  # a tree before layer runs
        return MfMeta(session, meta_map, compat_of(), 1)
    return MfMeta(session, meta_map, compat_of(), 1, (FEATURE_LAYER_RUNS,) if runs > 1 else ())


def _runs(batches: list[Any], runs: int) -> list[Any]:
    """What a Prefill that is ahead of Decode sends one contributor's ``batches`` as: up to
    ``runs`` consecutive layers with the same read entries in one frame (a layer run)."""
    from dataclasses import replace

    from rd2h.domain.wire.protocol import RunLayer
    out: list[Any] = []
    for b in batches:
        head = out[-1] if out else None
        if (head is not None and runs > 1 and len(head[1]) < runs
                and head[0].read_reqs == b.read_reqs):
            head[1].append(RunLayer(b.layer_idx, b.layer_name, b.seq, b.done_ext_ids))
        else:
            out.append((b, []))
    return [replace(b, also=tuple(also)) if also else b for b, also in out]


def _feeder(endpoint: str, case: Case, conn: Any, runs: int) -> None:
    """Child: one DEALER per contributor; MF_META on each, then every frame at once (up
    to ``runs`` layers per frame where Decode's ACK says it reads layer runs)."""
    from dataclasses import replace

    import zmq

    from rd2h.adapters.msgpack import MsgpackCodec
    w = workload(case)
    src, _ = _layouts(case, w.pool)
    meta_map = {lay.layer_name: lay.to_metadata() for lay in src.values()}
    codec = MsgpackCodec()
    ctx = zmq.Context()
    socks = {}
    reads_runs = True
    for i in range(case.fan_in):
        for m in range(RATIO):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
            s.connect(endpoint)
            s.send(codec.encode(_meta(_session(i, m), meta_map, runs)))
            assert s.poll(10000), "no ACK"
            ack = codec.decode(s.recv_multipart()[-1])
            reads_runs = reads_runs and bool(getattr(ack, "layer_runs", False))
            socks[(i, m)] = s
    per: dict[tuple[int, int], list[Any]] = {}
    order: list[tuple[int, int]] = []
    hold = int((time.time() + 3600) * 1000)  # as Prefill states: announcement id and hold
    for k, (i, m, b) in enumerate(interleaved(w)):
        per.setdefault((i, m), []).append(replace(b.numbered(k), hold_until_ms=hold))
        order.append((i, m))
    layers = len(order)
    if reads_runs and runs > 1:  # each contributor's frames, contributors taking turns
        grouped = {k: _runs(v, runs) for k, v in per.items()}
        order = []
        left = {k: len(v) for k, v in grouped.items()}
        while any(left.values()):
            for k in grouped:
                if left[k]:
                    order.append(k)
                    left[k] -= 1
        per = grouped
    pos = dict.fromkeys(per, 0)
    frames = []
    for key in order:
        frames.append((key, codec.encode(per[key][pos[key]], "ep")))
        pos[key] += 1
    wire = sum(len(f) for _, f in frames)
    conn.send(("ready", len(frames), layers, wire))
    conn.recv()  # go
    for key, frame in frames:
        socks[key].send(frame)
    poller = zmq.Poller()
    for s in socks.values():
        poller.register(s, zmq.POLLIN)
    got, failed, deadline = 0, 0, time.monotonic() + 600
    while got < layers and time.monotonic() < deadline:
        for s, _ in poller.poll(1000):
            while s.poll(0):
                reply = codec.decode(s.recv_multipart()[-1], "x")
                answered = 1 + len(getattr(reply, "also", ()))
                got += answered
                failed += answered * (type(reply).__name__ != "ReadDone")
    conn.send(("done", got, failed))
    for s in socks.values():
        s.close(0)
    ctx.term()


def decode_side(case: Case, runs: int) -> dict[str, Any]:
    import multiprocessing as mp

    from rd2h.adapters.logging import configure_logging
    configure_logging("ERROR")
    w = workload(case)
    _, dst = _layouts(case, w.pool)
    engine, receiver, endpoint = _receiver(w, dst)
    parent, child = mp.get_context("fork").Pipe()
    feeder = mp.get_context("fork").Process(target=_feeder, args=(endpoint, case, child, runs))
    feeder.start()
    _, frames, n, wire = parent.recv()
    gc.collect()
    time.sleep(0.2)
    ident = receiver._thread.ident
    ns0, c0, p0, t0 = _task_ns(), _thread_cpu(ident), time.process_time(), time.monotonic()
    parent.send("go")
    _, got, failed = parent.recv()
    t1 = time.monotonic()
    ns1, c1, p1 = _task_ns(), _thread_cpu(ident), time.process_time()
    feeder.join(30)
    stats = receiver.stats
    busy = (stats.last_read_end_at or t1) - (stats.first_ready_at or t0)
    out = {
        "messages": n, "replies": got, "replies_failed": failed,
        "layers_done": stats.layers_done, "layers_failed": stats.layers_failed,
        "requests": case.requests, "messages_per_request": n / case.requests,
        "frames": frames, "frames_per_request": frames / case.requests,
        "wire_bytes_per_message": wire / n, "kv_bytes_per_message": stats.bytes_read / n,
        "kv_bytes_per_request": stats.bytes_read / case.requests,
        "descriptors_per_message": stats.descriptors / n,
        "loop_us_per_message": (c1 - c0) / n * 1e6,
        "zmq_us_per_message": (ns1.get("zmq", 0) - ns0.get("zmq", 0)) / n / 1e3,
        "process_us_per_message": (p1 - p0) / n * 1e6,
        "wall_s": t1 - t0, "busy_s": busy,
        "announcements_per_s": n / busy if busy > 0 else 0.0,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    out["process_ms_per_request"] = out["process_us_per_message"] * n / case.requests / 1e3
    receiver.stop()
    engine.close()
    return out


# ------------------------------------------------------------------ Prefill side


def _decode_server(case: Case, conn: Any) -> None:
    from rd2h.adapters.logging import configure_logging
    configure_logging("ERROR")
    w = workload(case)
    _, dst = _layouts(case, w.pool)
    engine, receiver, endpoint = _receiver(w, dst)
    conn.send(endpoint)
    conn.recv()  # stop
    conn.send((receiver.stats.layers_done, receiver.stats.layers_failed))
    receiver.stop()
    engine.close()


def prefill_side(case: Case, runs: int) -> dict[str, Any]:
    """One Prefill rank (member 0 of instance 0) sending every layer of its requests (up
    to ``runs`` layers per frame, where the tree knows layer runs)."""
    import inspect
    import multiprocessing as mp

    from rd2h.adapters.logging import configure_logging, make_logger
    from rd2h.adapters.msgpack import MsgpackCodec
    from rd2h.adapters.zmq.channel import ZmqControlClients
    from rd2h.app.clock import MonotonicClock
    from rd2h.app.prefill import PrefillSender
    from rd2h.domain.prefill.announce import LayerTarget
    from rd2h.domain.wire.protocol import ReadRequest
    configure_logging("ERROR")
    one = Case(case.name, case.prompt, case.chunk, 1, case.per_instance, case.layers)
    w = workload(one)
    src, _ = _layouts(one, w.pool)
    parent, child = mp.get_context("fork").Pipe()
    server = mp.get_context("fork").Process(target=_decode_server, args=(one, child))
    server.start()
    endpoint = parent.recv()
    extra = ({"max_layers_per_frame": runs} if "max_layers_per_frame" in
             inspect.signature(PrefillSender).parameters else {})
    sender = PrefillSender(clients_factory=ZmqControlClients, codec=MsgpackCodec(),
                           p_session=_session(0, 0), layers=src, clock=MonotonicClock(),
                           log=make_logger("prefill", 0), layer_ack_timeout_s=600.0, **extra)
    sender.start()
    assert not sender.prepare([endpoint], 10.0)
    steps = []
    for k in range(one.per_instance):
        for start, end, final in w.ranges():
            steps.append((k, start, end, final))
    gc.collect()
    time.sleep(0.1)
    ident = sender._thread.ident
    s0, p0, submit, layers = _thread_cpu(ident), time.process_time(), 0.0, 0
    for r, start, end, final in steps:
        ids = w.p_blocks[r][start:end]
        for layer in range(one.layers):
            req = ReadRequest(ext_id(r), ids, ids, start, start) if end > start else None
            done = final and layer == one.layers - 1
            targets = [LayerTarget(endpoint, req, done, 0, RATIO, ext_id(r))]
            t0 = time.thread_time()
            sender.submit(layer, None, targets)
            submit += time.thread_time() - t0
            layers += 1
            if layer % 8 == 7:  # as a compute path: reuse waits keep a few layers in flight
                sender.wait_for_layer_send(layer - 4, 600.0)
    assert sender.drain(600.0), "prefill sender did not drain"
    s1, p1 = _thread_cpu(ident), time.process_time()
    parent.send("stop")
    done, failed = parent.recv()
    server.join(30)
    sender.stop()
    frames = getattr(sender.stats, "frames_sent", 0) or sender.stats.layers_sent
    return {"layers": layers, "decode_layers_done": done, "decode_layers_failed": failed,
            "frames": frames, "layers_per_frame": layers / max(frames, 1),
            "submit_us_per_layer": submit / layers * 1e6,
            "sender_thread_us_per_layer": (s1 - s0) / layers * 1e6,
            "process_us_per_layer": (p1 - p0) / layers * 1e6}


# ------------------------------------------------------------------ driver


def run_case(case: Case, runs: int) -> dict[str, Any]:
    d = decode_side(case, runs)
    p = prefill_side(case, runs)
    return {"case": asdict(case), "decode": d, "prefill": p}


def _child(args: argparse.Namespace) -> int:
    case = SMOKE if args.child == "smoke" else CASES[args.child]
    print(json.dumps(run_case(case, args.layers_per_frame)))
    return 0


def _spawn(name: str, src: str | None, runs: int) -> dict[str, Any]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    out = subprocess.run([sys.executable, str(HERE), "--child", name, "--layers-per-frame",
                          str(runs)], env=env, check=True,
                         capture_output=True, text=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure, the median over repeated runs (counts are equal in every run)."""
    out = json.loads(json.dumps(runs[0]))
    for side in ("decode", "prefill"):
        for key, value in out[side].items():
            if isinstance(value, float):
                out[side][key] = statistics.median(r[side][key] for r in runs)
    out["runs"] = len(runs)
    out["complete_every_run"] = all(complete(r) for r in runs)
    return out


def complete(res: dict[str, Any]) -> bool:
    d, p = res["decode"], res["prefill"]
    return bool(res.get("complete_every_run", True)
                and d["replies"] == d["messages"] == d["layers_done"]
                and not d["replies_failed"] and not d["layers_failed"]
                and p["decode_layers_done"] == p["layers"] and not p["decode_layers_failed"])


ROWS = [
    ("announcements per request per Decode rank", "decode", "messages_per_request", 0),
    ("frames per request per Decode rank", "decode", "frames_per_request", 0),
    ("wire bytes per announcement", "decode", "wire_bytes_per_message", 0),
    ("KV bytes read per announcement (MiB)", "decode", "kv_bytes_per_message", -20),
    ("descriptors per announcement", "decode", "descriptors_per_message", 0),
    ("Decode loop thread CPU us/announcement", "decode", "loop_us_per_message", 1),
    ("Decode ZeroMQ I/O threads us/announcement", "decode", "zmq_us_per_message", 1),
    ("Decode process CPU us/announcement", "decode", "process_us_per_message", 1),
    ("Decode process CPU ms/request", "decode", "process_ms_per_request", 1),
    ("announcements/s sustained", "decode", "announcements_per_s", 0),
    ("Decode peak RSS (MiB)", "decode", "peak_rss_mib", 0),
    ("Prefill layers per frame sent", "prefill", "layers_per_frame", 1),
    ("Prefill submit (caller) us/layer", "prefill", "submit_us_per_layer", 1),
    ("Prefill sender thread us/layer", "prefill", "sender_thread_us_per_layer", 1),
    ("Prefill process CPU us/layer", "prefill", "process_us_per_layer", 1),
]


def _value(res: dict[str, Any], side: str, key: str, digits: int) -> str:
    v = res[side].get(key, 0)
    if digits < 0:
        return f"{v / (1 << -digits):.2f}"
    return f"{v:,.{digits}f}"


def _print(name: str, new: dict[str, Any], old: dict[str, Any] | None) -> None:
    c = new["case"]
    print(f"\n== {name}: {c['prompt']:,}-token prompts in {c['chunk']:,}-token chunks, "
          f"{c['layers']} layers, Prefill TP {P_TP} -> Decode TP {D_TP}, fan-in "
          f"{c['fan_in']} instance(s) x {c['per_instance']} request(s)"
          f"{'' if complete(new) else '   ** INCOMPLETE **'}")
    head = f"{'':<42} {'this tree':>14}" + (f" {'baseline':>14} {'new/old':>8}" if old else "")
    print(head)
    for label, side, key, digits in ROWS:
        line = f"{label:<42} {_value(new, side, key, digits):>14}"
        if old is not None:
            a, b = new[side].get(key, 0), old[side].get(key, 0)
            line += f" {_value(old, side, key, digits):>14} {a / b if b else 0:>8.2f}"
        print(line)
    kv = new["decode"]["kv_bytes_per_request"]
    cpu_ms = new["decode"]["process_ms_per_request"]
    wire = "   ".join(f"{g} GB/s: {kv / (g * 1e9) * 1e3:.1f} ms" for g in (25, 50, 100))
    print(f"per request per Decode rank: {kv / 1e9:.2f} GB of KV; on the wire {wire}; "
          f"control-plane CPU {cpu_ms:.1f} ms"
          + (f" (baseline {old['decode']['process_ms_per_request']:.1f} ms)" if old else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", choices=sorted(CASES),
                    help="cases to run (repeatable; default: all)")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny case (4 layers, 4K tokens) that checks the benchmark runs")
    ap.add_argument("--baseline-src", metavar="DIR",
                    help="also run each case with the rd2h package in DIR, side by side")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs per case and tree; figures are medians (default 3)")
    ap.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    ap.add_argument("--layers-per-frame", type=int, default=64, metavar="N",
                    help="layer runs: at most N layers per READ_READY_BATCH where Decode "
                    "reads them (1: one layer per frame; default 64)")
    ap.add_argument("--baseline-layers-per-frame", type=int, metavar="N",
                    help="run the baseline with this --layers-per-frame (e.g. 1: this tree "
                    "without layer runs as the baseline, when no --baseline-src is given)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args)
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if not 1 <= args.layers_per_frame <= 256:
        ap.error("--layers-per-frame must be in [1, 256]")
    base_runs = (args.baseline_layers_per_frame if args.baseline_layers_per_frame is not None
                 else args.layers_per_frame)
    if not 1 <= base_runs <= 256:
        ap.error("--baseline-layers-per-frame must be in [1, 256]")
    base_src = args.baseline_src
    if base_src is None and args.baseline_layers_per_frame is not None:
        base_src = str(HERE.parent.parent)
    names = ["smoke"] if args.smoke else (args.case or list(CASES))
    results: dict[str, Any] = {}
    ok = True
    for name in names:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        new_runs, old_runs = [], []
        for _ in range(args.repeat):  # interleaved: drift hits both trees alike
            new_runs.append(_spawn(name, str(HERE.parent.parent), args.layers_per_frame))
            if base_src:
                old_runs.append(_spawn(name, base_src, base_runs))
        new = _median_of(new_runs)
        old = _median_of(old_runs) if old_runs else None
        results[name] = {"new": new, "baseline": old}
        ok = ok and complete(new) and (old is None or complete(old))
        if not args.json:
            _print(name, new, old)
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
