"""``rd2h demo``: Prefill -> Decode pull between real processes on loopback.

The parent starts ``decode_tp`` Decode rank processes (each binds its ROUTER,
maps the TP-shared main pool from one shared-memory region and owns rank-local
indexer/scale copies) and ``prefill_tp`` Prefill rank processes (each owns
synthetic KV in the spec 13 shapes and announces it layer by layer, in chunks).
Decode ranks pull, acknowledge and complete requests through a real
torch.distributed (gloo) exchange. Every destination byte is then verified;
finally the same descriptors are replayed on the bare transport (``raw_gbps``)
and a same-size in-process copy is timed (``memcpy_gbps``). Rates are in
10^9 bytes per second.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from rd2h.app.synthetic import Allocation, Shapes, allocate, block_pattern
from rd2h.domain.chunks import chunk_block_range, external_request_id
from rd2h.domain.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.protocol import ReadRequest
from rd2h.domain.topology import check_topology, compute_mapping, remote_port

ENGINE_SUFFIX = "-e0000001"  # vLLM appends 9 characters to request ids
SENTINEL = 0xEE  # destination bytes before any pull
STEP_INTERVAL_S = 0.05  # longest pause between Decode worker steps


@dataclass(frozen=True)
class DemoConfig:
    prefill_tp: int = 4
    decode_tp: int = 2
    layers: int = 8
    requests: int = 8
    prompt_tokens: int = 8000
    block_size: int = 128
    chunks: int = 2
    shared_buffers: int = 0
    indexer: bool = True
    scale: bool = True
    transport: str = "cma"
    cma_threads: int = 1
    mooncake_protocol: str = "tcp"
    host: str = "127.0.0.1"  # Decode's address
    prefill_host: str = "127.0.0.1"
    netns: bool = False  # Prefill and Decode in two network namespaces (veth pair)
    prefill_netns: str = ""  # set by run_demo when namespaces are in use
    decode_netns: str = ""
    kv_port: int = 0
    seed: int = 0
    timeout_s: float = 300.0
    replay: bool = True
    log_level: str = "WARNING"

    def validate(self) -> None:
        check_topology(self.prefill_tp, self.decode_tp)
        for name in ("layers", "requests", "prompt_tokens", "block_size", "chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.block_size % 2:
            raise ValueError("--block-size must be even (the LIC8 scale block is 4 B/token)")
        if self.shared_buffers < 0 or self.shared_buffers > self.layers:
            raise ValueError("--shared-buffers must be between 0 (off) and --layers")
        if self.scale and not self.indexer:
            raise ValueError("the LIC8 scale needs the indexer (add --no-scale)")
        if self.transport not in ("cma", "mooncake"):
            raise ValueError(
                f"--transport {self.transport!r}: the multi-process demo runs on 'cma' or "
                "'mooncake' ('inproc' only connects peers inside one process)"
            )
        if self.chunks > -(-self.prompt_tokens // self.block_size):
            raise ValueError("--chunks must not exceed the number of blocks of a prompt")

    @property
    def shapes(self) -> Shapes:
        return Shapes(block_size=self.block_size, indexer=self.indexer, scale=self.scale)


def layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn"


def internal_id(request: int) -> str:
    return f"req-{request:05d}{ENGINE_SUFFIX}"


def chunk_bounds(cfg: DemoConfig) -> list[int]:
    """Computed-token counts after each chunk (the last is the whole prompt)."""
    step = -(-cfg.prompt_tokens // cfg.chunks)
    return [min(cfg.prompt_tokens, step * (i + 1)) for i in range(cfg.chunks)]


def free_ports(count: int, host: str = "127.0.0.1") -> int:
    """A base port with ``count`` consecutive ports free right now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        if base + count > 65535:
            continue
        socks = []
        try:
            for i in range(count):
                t = socket.socket()
                socks.append(t)
                t.bind((host, base + i))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("could not find free consecutive ports")


# ====================================================================== Prefill


def _enter_netns(name: str) -> None:
    # c10d warns that it cannot resolve peer host names inside a namespace; harmless.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if name:
        from rd2h.adapters.netns import enter

        enter(name)


def _prefill_main(cfg: DemoConfig, p_rank: int, base_port: int, alloc: Allocation,
                  go: Any, release: Any, out: Any) -> None:
    try:
        _enter_netns(cfg.prefill_netns)
        _prefill_rank(cfg, p_rank, base_port, alloc, go, release, out)
    except BaseException as exc:
        out.put(("error", f"prefill rank {p_rank}", f"{exc!r}\n{traceback.format_exc()}"))
        raise SystemExit(1) from exc


def _prefill_rank(cfg: DemoConfig, p_rank: int, base_port: int, alloc: Allocation,
                  go: Any, release: Any, out: Any) -> None:
    from rd2h.adapters.zmq.channel import tcp_endpoint
    from rd2h.app.container import build_container
    from rd2h.app.settings import Rd2hSettings

    shapes = cfg.shapes
    settings = Rd2hSettings(role="prefill", transport=cfg.transport, tp_size=cfg.prefill_tp,
                            host=cfg.prefill_host, mooncake_protocol=cfg.mooncake_protocol,
                            tp_rank=p_rank, cma_threads=cfg.cma_threads, log_level=cfg.log_level)
    container = build_container(settings)
    transport = container.transport()
    n_phys = cfg.shared_buffers or cfg.layers
    comps = shapes.components
    buffers = {
        (b, c): np.zeros((alloc.p_pool_blocks, shapes.bytes_per_block(c)), dtype=np.uint8)
        for b in range(n_phys) for c in comps
    }
    for arr in buffers.values():
        transport.register_memory(arr.ctypes.data, arr.nbytes)

    def tc(b: int, c: str) -> TensorComponent:
        return TensorComponent(buffers[(b, c)].ctypes.data, shapes.bytes_per_block(c), 1, 0)

    layouts = {}
    for layer in range(cfg.layers):
        b = layer % n_phys
        layouts[layer] = SourceLayout(
            layer_name(layer),
            main=(tc(b, "main_k"), tc(b, "main_v")),
            indexer=tc(b, "indexer") if shapes.indexer else None,
            scale=tc(b, "scale") if shapes.scale else None,
        )
    p_ids = [np.asarray(ids, dtype=np.int64) for ids in alloc.p_blocks]

    def write(layer: int, start: int, end: int) -> None:
        b = layer % n_phys
        idx = np.arange(start, end)
        for r in range(cfg.requests):
            for c in comps:
                buffers[(b, c)][p_ids[r][start:end]] = block_pattern(
                    r, layer, c, idx, shapes.bytes_per_block(c)
                )

    bounds = chunk_bounds(cfg)
    ranges = []
    transferred = 0
    for i, computed in enumerate(bounds):
        final = i == len(bounds) - 1
        s, e = chunk_block_range(
            block_size=cfg.block_size, computed_tokens=computed, transferred_tokens=transferred,
            remote_cached_tokens=0, final=final, allocated_blocks=alloc.blocks_per_request,
        )
        ranges.append((s, e, final))
        transferred = e * cfg.block_size
    if not cfg.shared_buffers:  # every (layer, block) is written once: write it before timing
        for layer in range(cfg.layers):
            write(layer, 0, alloc.blocks_per_request)

    mapping = compute_mapping(cfg.prefill_tp, cfg.decode_tp, p_rank)
    endpoint = tcp_endpoint(cfg.host, remote_port(base_port, mapping.d_rank))
    sender = container.prefill_sender(p_session=transport.session_id, layers=layouts)
    events = container.device_events()
    sender.start()
    # Connections persist across requests in serving: set this one up before timing.
    failed = sender.prepare([endpoint], settings.deadlines.meta_ack_s)
    if failed:
        raise ConnectionError(f"decode endpoint handshake failed: {failed}")
    out.put(("ready", f"prefill {p_rank}", None))
    if not go.wait(cfg.timeout_s):
        raise TimeoutError("no start signal from the demo parent")
    deadline_s = settings.deadlines.layer_ack_s + settings.deadlines.meta_ack_s
    from rd2h.app.prefill import LayerTarget

    for start, end, final in ranges:
        for layer in range(cfg.layers):
            if cfg.shared_buffers:
                sender.wait_for_layer_send(layer, deadline_s)
                write(layer, start, end)
            event = events.record()
            done = final and layer == cfg.layers - 1
            targets = []
            for r in range(cfg.requests):
                ext = external_request_id(internal_id(r))
                req = None
                if end > start:
                    ids = tuple(int(x) for x in p_ids[r][start:end])
                    req = ReadRequest(ext, ids, ids, start, start)
                if req is not None or done:
                    targets.append(LayerTarget(endpoint, req, done, mapping.member,
                                               mapping.ratio, ext))
            sender.submit(layer, event, targets)
    errors = []
    for layer in range(cfg.layers):
        try:
            sender.wait_for_layer_send(layer, deadline_s)
        except Exception as exc:
            errors.append(str(exc))
    out.put(("prefill_done", f"prefill {p_rank}", {
        "ack_ms": sender.stats.ack_latencies_ms,
        "layers_sent": sender.stats.layers_sent,
        "layers_failed": sender.stats.layers_failed,
        "errors": errors,
        "counters": sender.counters(),
    }))
    release.wait(cfg.timeout_s)  # keep memory alive for the raw replay
    sender.stop(settings.deadlines.stop_s)
    transport.close()


# ====================================================================== Decode


def _decode_main(cfg: DemoConfig, d_rank: int, base_port: int, dist_port: int, shm_name: str,
                 alloc: Allocation, go: Any, replay_go: Any, out: Any) -> None:
    try:
        _enter_netns(cfg.decode_netns)
        _decode_rank(cfg, d_rank, base_port, dist_port, shm_name, alloc, go, replay_go, out)
    except BaseException as exc:
        out.put(("error", f"decode rank {d_rank}", f"{exc!r}\n{traceback.format_exc()}"))
        raise SystemExit(1) from exc


def main_pool_offsets(cfg: DemoConfig, alloc: Allocation, layer: int) -> tuple[int, int]:
    """Byte offsets of layer ``layer``'s K and V regions inside the shared main pool."""
    shapes = cfg.shapes
    k, v = shapes.bytes_per_block("main_k"), shapes.bytes_per_block("main_v")
    per_layer = alloc.d_pool_blocks * (k + v)
    return layer * per_layer, layer * per_layer + alloc.d_pool_blocks * k


def main_pool_bytes(cfg: DemoConfig, alloc: Allocation) -> int:
    shapes = cfg.shapes
    per = shapes.bytes_per_block("main_k") + shapes.bytes_per_block("main_v")
    return cfg.layers * alloc.d_pool_blocks * per


def _decode_rank(cfg: DemoConfig, d_rank: int, base_port: int, dist_port: int, shm_name: str,
                 alloc: Allocation, go: Any, replay_go: Any, out: Any) -> None:
    from rd2h.adapters.torch.exchange import TorchDistExchange
    from rd2h.app.container import build_container
    from rd2h.app.settings import Rd2hSettings

    shapes = cfg.shapes
    settings = Rd2hSettings(role="decode", transport=cfg.transport, host=cfg.host,
                            mooncake_protocol=cfg.mooncake_protocol,
                            kv_port=base_port, tp_size=cfg.decode_tp, tp_rank=d_rank,
                            cma_threads=cfg.cma_threads, log_level=cfg.log_level)
    container = build_container(settings)
    transport = container.transport()
    shm = shared_memory.SharedMemory(name=shm_name)
    pool = np.ndarray((shm.size,), dtype=np.uint8, buffer=shm.buf)
    pool[::4096] = SENTINEL  # map every page of the shared pool here before timing
    pool_addr = pool.ctypes.data
    transport.register_memory(pool_addr, shm.size)
    local: dict[tuple[int, str], np.ndarray] = {}
    for layer in range(cfg.layers):
        for c in shapes.components[2:]:
            # Pinned-pool stand-in: fault every page in now, as a real pinned pool would be.
            arr = np.full((alloc.d_pool_blocks, shapes.bytes_per_block(c)), SENTINEL, np.uint8)
            transport.register_memory(arr.ctypes.data, arr.nbytes)
            local[(layer, c)] = arr
    destinations = {}
    for layer in range(cfg.layers):
        k_off, v_off = main_pool_offsets(cfg, alloc, layer)
        n = alloc.d_pool_blocks

        def dt(c: str, layer: int = layer, n: int = n) -> DestTensor | None:
            arr = local.get((layer, c))
            if arr is None:
                return None
            return DestTensor(arr.ctypes.data, shapes.bytes_per_block(c), n)

        destinations[layer_name(layer)] = DestinationLayout(
            layer_name(layer),
            main=(DestTensor(pool_addr + k_off, shapes.bytes_per_block("main_k"), n),
                  DestTensor(pool_addr + v_off, shapes.bytes_per_block("main_v"), n)),
            indexer=dt("indexer"), scale=dt("scale"),
        )
    recorded: list[tuple[str, Any]] = []
    receiver = container.decode_receiver(
        destinations=destinations,
        on_read=(lambda session, plan: recorded.append((session, plan))) if cfg.replay else None,
    )
    receiver.start()
    for r in range(cfg.requests):
        receiver.admit(internal_id(r), alloc.d_main_blocks[r], alloc.d_indexer_blocks[r])
    out.put(("bound", f"decode {d_rank}", None))
    exchange = TorchDistExchange(rank=d_rank, world_size=cfg.decode_tp,
                                 init_method=f"tcp://127.0.0.1:{dist_port}",
                                 timeout_s=settings.deadlines.tp_exchange_s)
    out.put(("ready", f"decode {d_rank}", None))
    if not go.wait(cfg.timeout_s):  # worker steps start with the run
        raise TimeoutError("no start signal from the demo parent")
    finished: dict[str, bool] = {}
    t_end = None
    last_progress = 0
    while len(finished) < cfg.requests:
        outcome = receiver.step(exchange, (), settings.deadlines.tp_exchange_s)
        for rid in outcome.finished:
            finished[rid] = rid not in outcome.failed
        if d_rank == 0 and len(finished) != last_progress:
            last_progress = len(finished)
            out.put(("progress", "decode 0", last_progress))
        if len(finished) < cfg.requests:
            # Step when this rank has news, at least every STEP_INTERVAL_S: all ranks
            # step in lockstep (the exchange is a collective).
            receiver.wait_for_progress(STEP_INTERVAL_S)
    t_end = time.monotonic()
    # Verify rank-local indexer / scale copies (rank 0 also verifies the shared main pool).
    mismatches = 0
    for r in range(cfg.requests):
        idx_ids = np.asarray(alloc.d_indexer_blocks[r], dtype=np.int64)
        blocks = np.arange(alloc.blocks_per_request)
        for layer in range(cfg.layers):
            for c in shapes.components[2:]:
                got = local[(layer, c)][idx_ids]
                want = block_pattern(r, layer, c, blocks, shapes.bytes_per_block(c))
                mismatches += int((got != want).any(axis=1).sum())
    if d_rank == 0:
        mismatches += verify_main_pool(cfg, alloc, pool)
    stats = receiver.stats
    out.put(("decode_done", f"decode {d_rank}", {
        "finished": finished, "t_end": t_end, "bytes": stats.bytes_read,
        "layers_done": stats.layers_done, "layers_failed": stats.layers_failed,
        "descriptors": stats.descriptors, "mismatched_blocks": mismatches,
        "counters": receiver.counters(), "read_seconds": stats.read_seconds,
        "first_ready_at": stats.first_ready_at, "last_read_end_at": stats.last_read_end_at,
    }))
    raw = None
    if cfg.replay and replay_go.wait(cfg.timeout_s):
        # Let the barrier of the parent line all ranks up, then replay the same reads.
        t0 = time.monotonic()
        for session, plan in recorded:
            transport.batch_read(session, plan.local_addrs, plan.remote_addrs, plan.lengths)
        raw = {"t0": t0, "t1": time.monotonic(),
               "bytes": int(sum(p.total_bytes for _, p in recorded))}
    out.put(("replay_done", f"decode {d_rank}", raw))
    receiver.stop(settings.deadlines.stop_s)
    exchange.close()
    del pool
    shm.close()


def verify_main_pool(cfg: DemoConfig, alloc: Allocation, pool: np.ndarray) -> int:
    """Count main K/V blocks in the shared pool that differ from what Prefill computed."""
    shapes = cfg.shapes
    bad = 0
    blocks = np.arange(alloc.blocks_per_request)
    for layer in range(cfg.layers):
        k_off, v_off = main_pool_offsets(cfg, alloc, layer)
        for c, off in (("main_k", k_off), ("main_v", v_off)):
            bpb = shapes.bytes_per_block(c)
            view = pool[off : off + alloc.d_pool_blocks * bpb].reshape(alloc.d_pool_blocks, bpb)
            for r in range(cfg.requests):
                got = view[np.asarray(alloc.d_main_blocks[r], dtype=np.int64)]
                want = block_pattern(r, layer, c, blocks, bpb)
                bad += int((got != want).any(axis=1).sum())
    return bad


# ====================================================================== parent


@dataclass
class DemoResult:
    verified: bool
    requests_ok: int
    requests_failed: int
    bytes: int
    seconds: float
    gbps: float
    raw_gbps: float | None
    memcpy_gbps: float
    layer_ack_p50_ms: float | None
    layer_ack_p99_ms: float | None
    mismatched_blocks: int
    prefill_tp: int
    decode_tp: int
    transport: str
    layers: int
    requests: int
    prompt_tokens: int
    chunks: int
    shared_buffers: int
    descriptors: int
    leaked_state: int
    read_busy_seconds: float = 0.0
    raw_seconds: float | None = None
    errors: list[str] = field(default_factory=list)
    rate_unit: str = "1e9 bytes/s"
    network: str = "loopback"


def memcpy_gbps(nbytes: int) -> float:
    """Time an in-process copy of ``nbytes`` (capped at 512 MiB, repeated)."""
    size = max(1 << 20, min(nbytes, 512 << 20))
    src = np.full(size, 7, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first
    reps = max(1, -(-nbytes // size))
    t0 = time.perf_counter()
    for _ in range(reps):
        np.copyto(dst, src)
    return size * reps / (time.perf_counter() - t0) / 1e9


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self._last, self._shown = total, enabled, -1.0, -1
        self._tty = sys.stderr.isatty()

    def show(self, done: int, force: bool = False) -> None:
        if not self.enabled or done == self._shown:
            return
        now = time.monotonic()
        if not force and not self._tty and now - self._last < 2.0:
            return
        self._last, self._shown = now, done
        width = 30
        fill = int(width * done / max(1, self.total))
        line = f"[rd2h demo] requests [{'#' * fill}{'.' * (width - fill)}] {done}/{self.total}"
        sys.stderr.write(("\r" + line) if self._tty else line + "\n")
        if self._tty and done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def run_demo(cfg: DemoConfig, *, progress: bool = True) -> DemoResult:
    cfg.validate()
    network, pair = "loopback", None
    if cfg.netns:
        from rd2h.adapters.netns import NetnsUnavailable, create_host_pair

        try:
            pair = create_host_pair(f"{os.getpid() % 100000}")
        except NetnsUnavailable as exc:
            print(f"[rd2h demo] cannot create network namespaces ({exc}); "
                  "running Prefill and Decode on loopback instead", file=sys.stderr)
        else:
            network = f"netns {pair.prefill_addr} -> {pair.decode_addr} (veth)"
            cfg = replace(cfg, host=pair.decode_addr, prefill_host=pair.prefill_addr,
                          prefill_netns=pair.prefill_ns, decode_netns=pair.decode_ns)
    try:
        return _run(cfg, progress, network)
    finally:
        if pair is not None:
            from rd2h.adapters.netns import delete_host_pair

            delete_host_pair(pair)


def _run(cfg: DemoConfig, progress: bool, network: str) -> DemoResult:
    alloc = allocate(cfg.requests, cfg.prompt_tokens, cfg.block_size, cfg.seed)
    # In a fresh Decode namespace every port is free; on loopback pick free ones.
    base_port = cfg.kv_port or free_ports(cfg.decode_tp, "127.0.0.1")
    dist_port = free_ports(1)
    shm = shared_memory.SharedMemory(create=True, size=max(1, main_pool_bytes(cfg, alloc)))
    np.ndarray((shm.size,), dtype=np.uint8, buffer=shm.buf).fill(SENTINEL)
    ctx = mp.get_context("spawn")
    out: Any = ctx.Queue()
    go, release, replay_go = ctx.Event(), ctx.Event(), ctx.Event()
    procs: list[Any] = []
    errors: list[str] = []
    bar = _Progress(cfg.requests, progress)
    try:
        for d in range(cfg.decode_tp):
            procs.append(ctx.Process(target=_decode_main, name=f"rd2h-decode-{d}", args=(
                cfg, d, base_port, dist_port, shm.name, alloc, go, replay_go, out)))
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + cfg.timeout_s
        msgs: dict[str, list[tuple[str, Any]]] = {}

        def collect(kind: str, count: int) -> list[tuple[str, Any]]:
            got = msgs.setdefault(kind, [])
            while len(got) < count:
                try:
                    k, who, payload = out.get(timeout=0.2)
                except queue.Empty:
                    dead = [p.name for p in procs if p.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(f"{', '.join(dead)} exited early") from None
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"demo timed out waiting for {kind}") from None
                    continue
                if k == "error":
                    raise RuntimeError(f"{who} failed: {payload}")
                if k == "progress":
                    bar.show(payload)
                    continue
                msgs.setdefault(k, []).append((who, payload))
            return got

        collect("bound", cfg.decode_tp)  # Decode listens: start Prefill
        for p in range(cfg.prefill_tp):
            proc = ctx.Process(target=_prefill_main, name=f"rd2h-prefill-{p}", args=(
                cfg, p, base_port, alloc, go, release, out))
            procs.append(proc)
            proc.start()
        collect("ready", len(procs))
        t0 = time.monotonic()
        go.set()
        pre = collect("prefill_done", cfg.prefill_tp)
        dec = collect("decode_done", cfg.decode_tp)
        bar.show(cfg.requests, force=True)
        seconds = max(p["t_end"] for _, p in dec) - t0
        raw_gbps = raw_seconds = None
        replay_go.set()
        reps = collect("replay_done", cfg.decode_tp)
        release.set()
        raws = [p for _, p in reps if p]
        if raws and len(raws) == cfg.decode_tp:
            span = max(r["t1"] for r in raws) - min(r["t0"] for r in raws)
            raw_bytes = sum(r["bytes"] for r in raws)
            raw_gbps = raw_bytes / span / 1e9 if span > 0 else None
            raw_seconds = span
        for proc in procs:
            proc.join(max(1.0, deadline - time.monotonic()))
        mem = memcpy_gbps(sum(p["bytes"] for _, p in dec))
    except Exception as exc:
        errors.append(str(exc))
        pre = msgs.get("prefill_done", []) if "msgs" in locals() else []
        dec = msgs.get("decode_done", []) if "msgs" in locals() else []
        seconds, raw_gbps, raw_seconds, mem = 0.0, None, None, 0.0
    finally:
        started = [proc for proc in procs if proc.pid is not None]
        for proc in started:
            if proc.is_alive():
                proc.terminate()
        for proc in started:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
        shm.close()
        shm.unlink()
    ok = failed = 0
    if dec:
        finished = dec[0][1]["finished"]
        ok = sum(1 for v in finished.values() if v)
        failed = len(finished) - ok
    total_bytes = sum(p["bytes"] for _, p in dec)
    mismatched = sum(p["mismatched_blocks"] for _, p in dec)
    acks = [ms for _, p in pre for ms in p["ack_ms"]]
    for who, p in pre:
        errors.extend(f"{who}: {e}" for e in p["errors"])
    leaked = sum(v for _, p in dec for k, v in p["counters"].items() if k != "peers")
    leaked += sum(v for _, p in pre for v in p["counters"].values())
    verified = (
        not errors and len(dec) == cfg.decode_tp and ok == cfg.requests and failed == 0
        and mismatched == 0 and leaked == 0
    )
    return DemoResult(
        verified=verified, requests_ok=ok, requests_failed=failed, bytes=total_bytes,
        seconds=seconds, gbps=total_bytes / seconds / 1e9 if seconds > 0 else 0.0,
        raw_gbps=raw_gbps, memcpy_gbps=mem, layer_ack_p50_ms=_percentile(acks, 50),
        layer_ack_p99_ms=_percentile(acks, 99), mismatched_blocks=mismatched,
        prefill_tp=cfg.prefill_tp, decode_tp=cfg.decode_tp, transport=cfg.transport,
        layers=cfg.layers, requests=cfg.requests, prompt_tokens=cfg.prompt_tokens,
        chunks=cfg.chunks, shared_buffers=cfg.shared_buffers,
        descriptors=sum(p["descriptors"] for _, p in dec), leaked_state=leaked, errors=errors,
        read_busy_seconds=max((p["read_seconds"] for _, p in dec), default=0.0),
        network=network,
        raw_seconds=raw_seconds,
    )


def summary_text(res: DemoResult) -> str:
    def f(x: float | None, unit: str = "") -> str:
        return "n/a" if x is None else f"{x:.2f}{unit}"

    lines = [
        f"rd2h demo: P TP {res.prefill_tp} -> D TP {res.decode_tp} over {res.transport}, "
        f"{res.layers} layers x {res.requests} requests x {res.prompt_tokens} tokens, "
        f"{res.chunks} chunk(s), shared buffers {res.shared_buffers or 'off'}; {res.network}",
        f"  requests ok {res.requests_ok}, failed {res.requests_failed}; "
        f"mismatched blocks {res.mismatched_blocks}; leaked state {res.leaked_state}",
        f"  pulled {res.bytes / 2**20:.1f} MiB in {res.seconds:.3f} s = {f(res.gbps)} GB/s "
        f"({res.descriptors} descriptors)",
        f"  bare transport {f(res.raw_gbps)} GB/s; in-process memcpy {f(res.memcpy_gbps)} GB/s",
        f"  layer ack p50 {f(res.layer_ack_p50_ms, ' ms')}, p99 {f(res.layer_ack_p99_ms, ' ms')}",
        f"  VERIFIED: {'yes' if res.verified else 'NO'}",
    ]
    lines += [f"  error: {e.splitlines()[0]}" for e in res.errors[:10]]
    return "\n".join(lines)


def to_json(res: DemoResult) -> str:
    return json.dumps(asdict(res), sort_keys=True)
