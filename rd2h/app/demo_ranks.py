"""The rank processes of ``rd2h demo``: Prefill ranks announce synthetic KV layer by
layer, Decode ranks pull it, complete requests over a gloo exchange and verify bytes.

Each rank reports to the parent through one queue as ``(kind, who, payload)``:
Decode sends ``bound``, ``ready``, ``admitted``, ``progress``, ``decode_done``
(per-request outcomes and byte checks) and ``decode_final`` (leak counters after
the run settled, replay timing); Prefill sends ``ready`` and ``prefill_done``
(layer errors, leak counters); any rank may send ``error``. Injected faults
(``rd2h.app.faults``) wrap the real components; a killed rank exits with
``KILLED_EXIT_CODE``.
"""

from __future__ import annotations

import os
import time
import traceback
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from rd2h.app.demo_config import (
    SENTINEL,
    STEP_INTERVAL_S,
    DemoConfig,
    chunk_bounds,
    internal_id,
    layer_name,
    main_pool_mismatches,
    main_pool_offsets,
)
from rd2h.app.faults import (
    KILLED_EXIT_CODE,
    decode_server,
    decode_transfer,
    prefill_kill_layer,
)
from rd2h.app.synthetic import Allocation, block_pattern
from rd2h.domain.chunks import chunk_block_range, external_request_id
from rd2h.domain.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.protocol import ReadRequest
from rd2h.domain.topology import compute_mapping, remote_port


def _enter_netns(name: str) -> None:
    # c10d warns that it cannot resolve peer host names inside a namespace; harmless.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if name:
        from rd2h.adapters.netns import enter

        enter(name)


def _killed() -> None:
    """An injected kill: no cleanup, no goodbye (sockets close with the process)."""
    os._exit(KILLED_EXIT_CODE)


# ====================================================================== Prefill


def prefill_main(cfg: DemoConfig, p_rank: int, base_port: int, alloc: Allocation,
                 go: Any, release: Any, out: Any) -> None:
    try:
        _enter_netns(cfg.prefill_netns)
        if cfg.via_provider:
            from rd2h.app.demo_provider import prefill_rank_via_provider

            prefill_rank_via_provider(cfg, p_rank, base_port, alloc, go, release, out)
        else:
            _prefill_rank(cfg, p_rank, base_port, alloc, go, release, out)
    except BaseException as exc:
        out.put(("error", f"prefill {p_rank}", f"{exc!r}\n{traceback.format_exc()}"))
        raise SystemExit(1) from exc


def prefill_memory(cfg: DemoConfig, p_rank: int, alloc: Allocation) -> tuple[Any, ...]:
    """A Prefill rank's container, transport, registered source buffers (one per
    physical buffer and component), per-layer layouts and per-request block ids."""
    from rd2h.app.container import build_container
    from rd2h.app.settings import Rd2hSettings

    shapes = cfg.shapes
    settings = Rd2hSettings(role="prefill", transport=cfg.transport, tp_size=cfg.prefill_tp,
                            host=cfg.prefill_host, mooncake_protocol=cfg.mooncake_protocol,
                            tp_rank=p_rank, cma_threads=cfg.cma_threads, log_level=cfg.log_level,
                            deadlines=cfg.deadlines(), auth_secret=cfg.auth_secret)
    container = build_container(settings)
    transport = container.transport()
    n_phys = cfg.shared_buffers or cfg.layers
    buffers = {
        (b, c): np.zeros((alloc.p_pool_blocks, shapes.bytes_per_block(c)), dtype=np.uint8)
        for b in range(n_phys) for c in shapes.components
    }
    for arr in buffers.values():
        transport.register_memory(arr.ctypes.data, arr.nbytes)

    def tc(b: int, c: str) -> TensorComponent:
        return TensorComponent(buffers[(b, c)].ctypes.data, shapes.bytes_per_block(c), 1, 0,
                               num_blocks=alloc.p_pool_blocks)

    layouts = {
        layer: SourceLayout(
            layer_name(layer),
            main=(tc(layer % n_phys, "main_k"), tc(layer % n_phys, "main_v")),
            indexer=tc(layer % n_phys, "indexer") if shapes.indexer else None,
            scale=tc(layer % n_phys, "scale") if shapes.scale else None,
        )
        for layer in range(cfg.layers)
    }
    p_ids = [np.asarray(ids, dtype=np.int64) for ids in alloc.p_blocks]
    return container, transport, buffers, layouts, p_ids


def _prefill_rank(cfg: DemoConfig, p_rank: int, base_port: int, alloc: Allocation,
                  go: Any, release: Any, out: Any) -> None:
    from rd2h.adapters.zmq.channel import tcp_endpoint
    from rd2h.app.prefill import LayerTarget
    from rd2h.domain.errors import LayerSendError

    shapes = cfg.shapes
    deadlines = cfg.deadlines()
    container, transport, buffers, layouts, p_ids = prefill_memory(cfg, p_rank, alloc)
    n_phys = cfg.shared_buffers or cfg.layers
    comps = shapes.components

    def write(layer: int, start: int, end: int) -> None:
        b = layer % n_phys
        idx = np.arange(start, end)
        for r in range(cfg.requests):
            for c in comps:
                buffers[(b, c)][p_ids[r][start:end]] = block_pattern(
                    r, layer, c, idx, shapes.bytes_per_block(c)
                )

    ranges = []
    transferred = 0
    bounds = chunk_bounds(cfg)
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
    kill_layer = prefill_kill_layer(cfg.faults, p_rank)
    sender.start()
    # Connections persist across requests in serving: set this one up before timing.
    failed = sender.prepare([endpoint], deadlines.meta_ack_s)
    if failed:
        raise ConnectionError(f"decode endpoint handshake failed: {failed}")
    out.put(("ready", f"prefill {p_rank}", None))
    if not go.wait(cfg.timeout_s):
        raise TimeoutError("no start signal from the demo parent")
    # A layer's gate resolves (acknowledged, failed or expired) within this budget.
    gate_s = deadlines.device_event_s + deadlines.meta_ack_s + deadlines.layer_ack_s + 1.0
    layer_errors: dict[str, None] = {}

    def wait_gate(layer: int) -> None:
        try:
            sender.wait_for_layer_send(layer, gate_s)
        except LayerSendError as exc:
            layer_errors[str(exc)] = None
            if not sender.gate_open(layer):  # never reuse storage Decode may still read
                raise RuntimeError(f"layer {layer}'s gate still closed after {gate_s:g} s") from exc

    for chunk, (start, end, final) in enumerate(ranges):
        for layer in range(cfg.layers):
            if chunk == 0 and layer == kill_layer:
                # Die mid-request: Decode has read (and acknowledged) the layers before.
                for earlier in range(layer):
                    wait_gate(earlier)
                _killed()
            if cfg.shared_buffers:
                wait_gate(layer)
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
    for layer in range(cfg.layers):
        wait_gate(layer)
    drained = sender.drain(gate_s)
    out.put(("prefill_done", f"prefill {p_rank}", {
        "ack_ms": sender.stats.ack_latencies_ms,
        "layers_sent": sender.stats.layers_sent,
        "layers_failed": sender.stats.layers_failed,
        "layer_errors": list(layer_errors),
        "drained": drained,
        "counters": sender.counters(),
    }))
    release.wait(cfg.timeout_s)  # keep memory alive for the raw replay
    sender.stop(deadlines.stop_s)
    transport.close()


# ====================================================================== Decode


def decode_main(cfg: DemoConfig, d_rank: int, base_port: int, dist_port: int, shm_name: str,
                alloc: Allocation, go: Any, settle: Any, out: Any) -> None:
    try:
        _enter_netns(cfg.decode_netns)
        _decode_rank(cfg, d_rank, base_port, dist_port, shm_name, alloc, go, settle, out)
    except BaseException as exc:
        out.put(("error", f"decode {d_rank}", f"{exc!r}\n{traceback.format_exc()}"))
        raise SystemExit(1) from exc


def _verify_local(cfg: DemoConfig, alloc: Allocation, local: dict[tuple[int, str], np.ndarray],
                  requests: list[int]) -> dict[int, int]:
    """Per request: rank-local indexer / scale blocks that differ from Prefill's."""
    shapes = cfg.shapes
    bad = dict.fromkeys(requests, 0)
    blocks = np.arange(alloc.blocks_per_request)
    for r in requests:
        idx_ids = np.asarray(alloc.d_indexer_blocks[r], dtype=np.int64)
        for layer in range(cfg.layers):
            for c in shapes.components[2:]:
                got = local[(layer, c)][idx_ids]
                want = block_pattern(r, layer, c, blocks, shapes.bytes_per_block(c))
                bad[r] += int((got != want).any(axis=1).sum())
    return bad


def _decode_rank(cfg: DemoConfig, d_rank: int, base_port: int, dist_port: int, shm_name: str,
                 alloc: Allocation, go: Any, settle: Any, out: Any) -> None:
    from rd2h.adapters.torch.exchange import TorchDistExchange
    from rd2h.app.container import build_container
    from rd2h.app.settings import Rd2hSettings

    who = f"decode {d_rank}"
    shapes = cfg.shapes
    deadlines = cfg.deadlines()
    settings = Rd2hSettings(role="decode", transport=cfg.transport, host=cfg.host,
                            mooncake_protocol=cfg.mooncake_protocol,
                            kv_port=base_port, tp_size=cfg.decode_tp, tp_rank=d_rank,
                            cma_threads=cfg.cma_threads, log_level=cfg.log_level,
                            deadlines=deadlines, auth_secret=cfg.auth_secret)
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
    codec = container.codec()
    receiver = container.decode_receiver(
        destinations=destinations,
        on_read=(lambda session, plan: recorded.append((session, plan))) if cfg.replay else None,
        transfer=decode_transfer(cfg.faults, d_rank, transport, cfg.seed),
        server_factory=lambda: decode_server(
            cfg.faults, d_rank, container.control_server(), codec, _killed
        ),
    )
    receiver.start()
    out.put(("bound", who, None))
    exchange = TorchDistExchange(rank=d_rank, world_size=cfg.decode_tp,
                                 init_method=f"tcp://127.0.0.1:{dist_port}",
                                 timeout_s=deadlines.tp_exchange_s)
    out.put(("ready", who, None))
    if not go.wait(cfg.timeout_s):  # admission and worker steps start with the run
        raise TimeoutError("no start signal from the demo parent")
    admitted_at = time.monotonic()
    for r in range(cfg.requests):
        receiver.admit(internal_id(r), alloc.d_main_blocks[r], alloc.d_indexer_blocks[r])
    out.put(("admitted", who, admitted_at))

    ids = [internal_id(r) for r in range(cfg.requests)]
    outcomes: dict[str, str | None] = {}  # internal id -> None (ok) or why it failed
    ended_s: dict[str, float] = {}
    exchange_error = None
    run_deadline = admitted_at + cfg.timeout_s
    last_progress = 0
    while len(outcomes) < cfg.requests and time.monotonic() < run_deadline:
        try:
            outcome = receiver.step(exchange, (), deadlines.tp_exchange_s)
        except TimeoutError as exc:  # a Decode rank died or hung: no step can resolve more
            exchange_error = str(exc).splitlines()[0][:200]  # gloo's messages run long
            break
        for rid in outcome.finished:
            ended_s[rid] = time.monotonic() - admitted_at
            outcomes[rid] = (outcome.reasons.get(rid, "failed") if rid in outcome.failed
                             else None)
        if d_rank == 0 and len(outcomes) != last_progress:
            last_progress = len(outcomes)
            out.put(("progress", who, last_progress))
        if len(outcomes) < cfg.requests:
            # Step when this rank has news, at least every STEP_INTERVAL_S: all ranks
            # step in lockstep (the exchange is a collective).
            receiver.wait_for_progress(STEP_INTERVAL_S)
    t_end = time.monotonic()
    if exchange_error is not None:
        left = [rid for rid in ids if rid not in outcomes]
        for rid in left:
            outcomes[rid] = f"decode {d_rank}: {exchange_error}"
            ended_s[rid] = t_end - admitted_at
        receiver.abandon(left)
    ok = [r for r in range(cfg.requests) if internal_id(r) in outcomes
          and outcomes[internal_id(r)] is None]
    mismatched = _verify_local(cfg, alloc, local, ok)
    if d_rank == 0:
        for r, n in main_pool_mismatches(cfg, alloc, pool, ok).items():
            mismatched[r] += n
    stats = receiver.stats
    out.put(("decode_done", who, {
        "outcomes": outcomes, "ended_s": ended_s, "t_end": t_end,
        "mismatched": {internal_id(r): n for r, n in mismatched.items()},
        "exchange_error": exchange_error, "bytes": stats.bytes_read,
        "layers_done": stats.layers_done, "layers_failed": stats.layers_failed,
        "descriptors": stats.descriptors, "read_seconds": stats.read_seconds,
        "first_ready_at": stats.first_ready_at, "last_read_end_at": stats.last_read_end_at,
    }))
    # Settle: every Prefill rank is done (or dead). State about requests announced after
    # Decode finished them ends at the request deadline; wait for that, boundedly.
    settle.wait(cfg.timeout_s)
    settle_deadline = time.monotonic() + deadlines.request_s + 1.0
    while _held(receiver.counters()) and time.monotonic() < settle_deadline:
        receiver.expire()
        receiver.wait_for_progress(STEP_INTERVAL_S)
    raw = None
    if cfg.replay:  # the same reads again on the bare transport (Prefill memory still held)
        t0 = time.monotonic()
        for session, plan in recorded:
            transport.batch_read(session, plan.local_addrs, plan.remote_addrs, plan.lengths)
        raw = {"t0": t0, "t1": time.monotonic(),
               "bytes": int(sum(p.total_bytes for _, p in recorded))}
    out.put(("decode_final", who, {"counters": receiver.counters(), "raw": raw}))
    receiver.stop(deadlines.stop_s)
    if exchange_error is None:  # a broken group is left to the process exit
        exchange.close()
    del pool
    shm.close()


def _held(counters: dict[str, int]) -> int:
    """Request state still held (connection state, ``peers``, is not request state)."""
    return sum(v for k, v in counters.items() if k != "peers")
