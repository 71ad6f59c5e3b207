"""A Decode rank process of ``rd2h demo``: binds its control socket, maps the TP-shared
main pool, pulls, completes requests over a gloo exchange and verifies every byte.

It reports to the parent through one queue as ``(kind, who, payload)``: ``bound``,
``ready``, ``admitted``, ``progress``, ``decode_done`` (per-request outcomes and byte
checks), ``decode_final`` (leak counters after the run settled, replay timing), or
``error``. Injected faults (``rd2h.demo.faults``) wrap the real components.
"""

from __future__ import annotations

import time
import traceback
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from rd2h.app.container import build_container
from rd2h.demo.config import (
    SENTINEL,
    STEP_INTERVAL_S,
    DemoConfig,
    internal_id,
    layer_name,
    main_pool_mismatches,
    main_pool_offsets,
)
from rd2h.demo.faults import decode_server, decode_transfer
from rd2h.demo.memory import enter_netns, killed, rank_settings
from rd2h.demo.synthetic import Allocation, block_pattern
from rd2h.domain.layout import DestinationLayout, DestTensor


def decode_main(cfg: DemoConfig, d_rank: int, base_port: int, dist_port: int, shm_name: str,
                alloc: Allocation, go: Any, settle: Any, out: Any) -> None:
    try:
        enter_netns(cfg.decode_netns)
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
    who = f"decode {d_rank}"
    shapes = cfg.shapes
    deadlines = cfg.deadlines()
    # One main pool in shared memory for every Decode rank (each pulls its share).
    container = build_container(rank_settings(cfg, "decode", d_rank, host=cfg.host,
                                              kv_port=base_port, tp_size=cfg.decode_tp,
                                              destinations="sparse_kv_pool"))
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
    peek = container.peek_codec()  # the fault wrappers only look at frames
    receiver = container.decode_receiver(
        destinations=destinations,
        on_read=(lambda session, plan: recorded.append((session, plan))) if cfg.replay else None,
        transfer=decode_transfer(cfg.faults, d_rank, transport, cfg.seed),
        server_factory=lambda: decode_server(
            cfg.faults, d_rank, container.control_server(), peek, killed
        ),
    )
    receiver.start()
    out.put(("bound", who, None))
    exchange = container.tp_exchange(init_method=f"tcp://127.0.0.1:{dist_port}")
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
