"""A Decode rank process of ``rd2h demo``: binds its control socket, maps the TP-shared
main pool, pulls, completes requests over a gloo exchange and verifies every byte.

It reports to the parent through one queue as ``(kind, who, payload)``: ``bound``,
``ready``, then per round ``admitted/K``, ``progress``, ``decode_done/K`` (per-request
outcomes and byte checks) and ``bare/K`` (the bare replay's timing), at the end
``decode_final`` (leak counters after the run settled), or ``error``. Injected faults
(``rd2h.demo.faults``) wrap the real components.
"""

from __future__ import annotations

import time
import traceback
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from rd2h.bootstrap.container import build_container
from rd2h.demo.config import (
    SENTINEL,
    STEP_INTERVAL_S,
    DemoConfig,
    demo_compat,
    internal_id,
    layer_name,
    main_pool_mismatches,
    main_pool_offsets,
    round_order,
)
from rd2h.demo.faults import decode_server, decode_transfer
from rd2h.demo.memory import enter_netns, killed, process_cpu, rank_settings
from rd2h.demo.signals import Signals
from rd2h.demo.synthetic import Allocation, block_pattern
from rd2h.domain.planning.layout import DestinationLayout, DestTensor


def decode_main(cfg: DemoConfig, d_rank: int, base_port: int, dist_port: int, shm_name: str,
                alloc: Allocation, sig: Signals, out: Any) -> None:
    try:
        enter_netns(cfg.decode_netns)
        _decode_rank(cfg, d_rank, base_port, dist_port, shm_name, alloc, sig, out)
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
                 alloc: Allocation, sig: Signals, out: Any) -> None:
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
    recorded: list[tuple[str, Any]] = []  # round 0's reads, for the bare replays
    recording = [cfg.replay]

    def on_read(session: str, plan: Any) -> None:
        if recording[0]:
            recorded.append((session, plan))

    peek = container.peek_codec()  # the fault wrappers only look at frames
    receiver = container.decode_receiver(
        destinations=destinations, on_read=on_read if cfg.replay else None,
        on_progress=sig.wake_all, compat=demo_compat(cfg),
        transfer=decode_transfer(cfg.faults, d_rank, transport, cfg.seed),
        server_factory=lambda: decode_server(
            cfg.faults, d_rank, container.control_server(), peek, killed
        ),
    )
    receiver.start()
    out.put(("bound", who, None))
    exchange = container.tp_exchange(init_method=f"tcp://127.0.0.1:{dist_port}")
    out.put(("ready", who, None))
    rank = _Rank(cfg, d_rank, alloc, receiver, exchange, pool, local, sig, out)
    for k in range(cfg.rounds):
        for phase in round_order(k):
            if phase == "bare" and not cfg.replay:
                continue
            if not (sig.admit[k] if phase == "pipeline" else sig.bare[k]).wait(cfg.timeout_s):
                raise TimeoutError(f"no {phase} signal for round {k} from the demo parent")
            if phase == "pipeline":
                rank.pull(k)
                recording[0] = False  # later rounds replay round 0's reads
            else:
                rank.bare(k, recorded, transport)
    # Settle: every Prefill rank is done (or dead). State about requests announced after
    # Decode finished them ends at the request deadline; wait for that, boundedly.
    sig.settle.wait(cfg.timeout_s)
    settle_deadline = time.monotonic() + deadlines.request_s + 1.0
    while _held(receiver.counters()) and time.monotonic() < settle_deadline:
        receiver.expire()
        receiver.wait_for_progress(STEP_INTERVAL_S)
    out.put(("decode_final", who, {"counters": receiver.counters()}))
    receiver.stop(deadlines.stop_s)
    if rank.exchange_error is None:  # a broken group is left to the process exit
        exchange.close()
    del pool, rank
    shm.close()


class _DoneFlags:
    """The TP exchange with one flag beside each rank's report: whether that rank had
    every outcome of the round before this step. Every rank gathers the same flags, so
    ``all_done`` turns true after the same step everywhere."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.done = False
        self.all_done = False

    @property
    def rank(self) -> int:
        return int(self.inner.rank)

    @property
    def world_size(self) -> int:
        return int(self.inner.world_size)

    def all_gather(self, obj: Any, timeout: float) -> list[Any]:
        pairs = self.inner.all_gather((obj, self.done), timeout)
        self.all_done = all(done for _, done in pairs)
        return [report for report, _ in pairs]


class _Rank:
    """One Decode rank's rounds: pull (admit, step until every request ended, verify)
    and the bare replay of round 0's reads."""

    def __init__(self, cfg: DemoConfig, d_rank: int, alloc: Allocation, receiver: Any,
                 exchange: Any, pool: np.ndarray, local: dict[tuple[int, str], np.ndarray],
                 sig: Signals, out: Any) -> None:
        self.cfg, self.d_rank, self.alloc = cfg, d_rank, alloc
        self.receiver, self.exchange, self.pool, self.local = receiver, exchange, pool, local
        self.sig, self.out = sig, out
        self.who = f"decode {d_rank}"
        self.exchange_error: str | None = None

    def pull(self, k: int) -> None:
        cfg, receiver, stats = self.cfg, self.receiver, self.receiver.stats
        if k:  # every byte of this round is checked: forget what earlier rounds wrote
            if self.d_rank == 0:
                self.pool.fill(SENTINEL)
            for arr in self.local.values():
                arr.fill(SENTINEL)
        before = (stats.bytes_read, stats.read_seconds, stats.descriptors)
        admitted_at = time.monotonic()
        cpu0 = process_cpu()
        for r in range(cfg.requests):
            receiver.admit(internal_id(r, k), self.alloc.d_main_blocks[r],
                           self.alloc.d_indexer_blocks[r])
        self.out.put((f"admitted/{k}", self.who, admitted_at))
        ids = [internal_id(r, k) for r in range(cfg.requests)]
        outcomes: dict[str, str | None] = {}  # internal id -> None (ok) or why it failed
        ended_at: dict[str, float] = {}
        run_deadline = admitted_at + cfg.timeout_s
        last_progress = 0
        # Steps are collectives, so every rank stops after the same one: each step also
        # gathers whether each rank had all its outcomes before it. A request can end on
        # one rank a step before another (held there while a read into it is in flight),
        # and a rank that stopped on its own count would leave the others' next step
        # waiting for it until the exchange deadline.
        group = _DoneFlags(self.exchange)
        # (A broken TP group, from an earlier round, resolves nothing: every request fails.)
        while (not group.all_done and time.monotonic() < run_deadline
               and self.exchange_error is None):
            self.sig.drain_wake(self.d_rank)  # news from now on wakes the next wait
            try:
                outcome = receiver.step(group, (), cfg.deadlines().tp_exchange_s)
            except TimeoutError as exc:  # a Decode rank died or hung: no step resolves more
                self.exchange_error = str(exc).splitlines()[0][:200]  # gloo's run long
                break
            for rid in outcome.finished:
                ended_at[rid] = time.monotonic()
                outcomes[rid] = (outcome.reasons.get(rid, "failed") if rid in outcome.failed
                                 else None)
            if self.d_rank == 0 and len(outcomes) != last_progress:
                last_progress = len(outcomes)
                self.out.put(("progress", self.who, k * cfg.requests + last_progress))
            if group.all_done:
                break
            if len(outcomes) == cfg.requests and not group.done:
                group.done = True  # the next step tells the others: step it at once
                self.sig.wake_all()
            else:
                # Step when any Decode rank has news (a step is a collective all ranks
                # join), at least every STEP_INTERVAL_S.
                self.sig.wait_wake(self.d_rank, STEP_INTERVAL_S)
        t_end = time.monotonic()
        cpu = process_cpu(cpu0)
        if self.exchange_error is not None:
            left = [rid for rid in ids if rid not in outcomes]
            for rid in left:
                outcomes[rid] = f"decode {self.d_rank}: {self.exchange_error}"
                ended_at[rid] = t_end
            receiver.abandon(left)
        ok = [r for r in range(cfg.requests) if outcomes.get(internal_id(r, k), "") is None]
        mismatched = _verify_local(cfg, self.alloc, self.local, ok)
        if self.d_rank == 0:
            for r, n in main_pool_mismatches(cfg, self.alloc, self.pool, ok).items():
                mismatched[r] += n
        self.out.put((f"decode_done/{k}", self.who, {
            "outcomes": outcomes, "ended_s": {rid: t - admitted_at for rid, t in ended_at.items()},
            "ended_at": ended_at, "t_end": t_end,
            "mismatched": {internal_id(r, k): n for r, n in mismatched.items()},
            "exchange_error": self.exchange_error,
            "bytes": stats.bytes_read - before[0], "read_seconds": stats.read_seconds - before[1],
            "descriptors": stats.descriptors - before[2],
            "layers_done": stats.layers_done, "layers_failed": stats.layers_failed,
            "cpu": cpu,
        }))

    def bare(self, k: int, recorded: list[tuple[str, Any]], transport: Any) -> None:
        """Round 0's reads again on the bare transport (Prefill memory is still held),
        every Decode rank starting together (an all-gather is the barrier)."""
        try:
            if self.exchange_error is None:
                self.exchange.all_gather(None, self.cfg.deadlines().tp_exchange_s)
        except TimeoutError as exc:
            self.exchange_error = str(exc).splitlines()[0][:200]
        if self.exchange_error is not None:
            self.out.put((f"bare/{k}", self.who, {"skipped": self.exchange_error}))
            return
        t0, cpu0 = time.monotonic(), process_cpu()
        for session, plan in recorded:
            transport.batch_read(session, plan.local_addrs, plan.remote_addrs, plan.lengths)
        t1, cpu = time.monotonic(), process_cpu(cpu0)
        self.out.put((f"bare/{k}", self.who, {
            "t0": t0, "t1": t1, "bytes": int(sum(p.total_bytes for _, p in recorded)),
            "cpu": cpu,
        }))


def _held(counters: dict[str, int]) -> int:
    """Request state still held (connection state, ``peers``, is not request state)."""
    return sum(v for k, v in counters.items() if k != "peers")
