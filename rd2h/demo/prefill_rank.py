"""A Prefill rank process of ``rd2h demo``: synthetic KV announced layer by layer
through ``PrefillSender`` (or, with ``--via-provider``, through the connector's worker
role: ``rd2h.demo.provider``).

It reports to the parent through one queue as ``(kind, who, payload)``: ``ready``, per
round ``prefill_done/K`` (layer errors, leak counters, when the last layer was ready),
or ``error``. With ``--layer-compute-ms`` each layer first takes that long, the host
idle, as a device computing it would.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from typing import Any

import numpy as np

from rd2h.app.prefill import LayerTarget
from rd2h.demo.config import DemoConfig, chunk_ranges, demo_compat, internal_id
from rd2h.demo.faults import prefill_kill_layer
from rd2h.demo.memory import enter_netns, killed, prefill_memory, prefill_report, process_cpu
from rd2h.demo.signals import Signals
from rd2h.demo.synthetic import Allocation, block_pattern
from rd2h.domain.errors import LayerSendError
from rd2h.domain.planning.chunks import external_request_id
from rd2h.domain.planning.digests import stated_digests
from rd2h.domain.planning.layout import SourceLayout
from rd2h.domain.planning.topology import compute_mapping, remote_port, tcp_endpoint
from rd2h.domain.wire.protocol import ReadRequest
from rd2h.ports.runtime import Digest


def prefill_main(cfg: DemoConfig, p_rank: int, base_port: int, alloc: Allocation,
                 sig: Signals, out: Any) -> None:
    try:
        enter_netns(cfg.prefill_netns)
        if cfg.via_provider:
            from rd2h.demo.provider import prefill_rank_via_provider

            prefill_rank_via_provider(cfg, p_rank, base_port, alloc, sig, out)
        else:
            _prefill_rank(cfg, p_rank, base_port, alloc, sig, out)
    except BaseException as exc:
        out.put(("error", f"prefill {p_rank}", f"{exc!r}\n{traceback.format_exc()}"))
        raise SystemExit(1) from exc


def _prefill_rank(cfg: DemoConfig, p_rank: int, base_port: int, alloc: Allocation,
                  sig: Signals, out: Any) -> None:
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

    ranges = chunk_ranges(cfg, alloc)
    chunk_ids = [[tuple(p_ids[r][start:end].tolist()) for r in range(cfg.requests)]
                 for start, end, _ in ranges]
    if not cfg.shared_buffers:  # every (layer, block) is written once: write it before timing
        for layer in range(cfg.layers):
            write(layer, 0, alloc.blocks_per_request)

    mapping = compute_mapping(cfg.prefill_tp, cfg.decode_tp, p_rank)
    endpoint = tcp_endpoint(cfg.host, remote_port(base_port, mapping.d_rank))
    sender = container.prefill_sender(p_session=transport.session_id, layers=layouts,
                                      compat=demo_compat(cfg))
    events = container.device_events()
    digest = container.digest() if cfg.verify_kv else None
    kill_layer = prefill_kill_layer(cfg.faults, p_rank)
    sender.start()
    # Connections persist across requests in serving: set this one up before timing.
    failed = sender.prepare([endpoint], deadlines.meta_ack_s)
    if failed:
        raise ConnectionError(f"decode endpoint handshake failed: {failed}")
    out.put(("ready", f"prefill {p_rank}", None))
    # A layer's gate resolves (acknowledged, failed or expired) within this budget.
    gate_s = sender.timeouts.gate_budget_s
    compute_s = cfg.layer_compute_ms / 1e3

    def wait_gate(layer: int, errors: dict[str, None]) -> None:
        try:
            sender.wait_for_layer_send(layer, gate_s)
        except LayerSendError as exc:
            errors[str(exc)] = None
            if not sender.gate_open(layer):  # never reuse storage Decode may still read
                raise RuntimeError(f"layer {layer}'s gate still closed after {gate_s:g} s") from exc

    for k in range(cfg.rounds):
        if not sig.announce[k].wait(cfg.timeout_s):
            raise TimeoutError(f"no start signal for round {k} from the demo parent")
        acks_before = len(sender.stats.ack_latencies_ms)
        cpu0 = process_cpu()
        layer_errors: dict[str, None] = {}
        ready_at = 0.0
        for chunk, (start, end, final) in enumerate(ranges):
            # Every layer of a chunk announces the same blocks (what vLLM's scheduler
            # output gives once per step); only the final layer marks requests done.
            plain = _targets(cfg, k, endpoint, mapping, chunk_ids[chunk], start, False)
            last = _targets(cfg, k, endpoint, mapping, chunk_ids[chunk], start, final)
            for layer in range(cfg.layers):
                if chunk == 0 and layer == kill_layer:
                    # Die mid-request: Decode has read (and acknowledged) the layers before.
                    for earlier in range(layer):
                        wait_gate(earlier, layer_errors)
                    killed()
                if cfg.shared_buffers:
                    wait_gate(layer, layer_errors)
                    write(layer, start, end)
                if compute_s:
                    time.sleep(compute_s)  # the device computes this layer; the host is free
                event = events.record()
                done = final and layer == cfg.layers - 1
                if done:
                    ready_at = time.monotonic()  # the last layer of the prompt is ready
                targets = last if layer == cfg.layers - 1 else plain
                if digest is not None:  # --verify-kv: this layer's blocks as written
                    targets = _digested(targets, layouts[layer], digest,
                                        (mapping.d_rank, cfg.decode_tp))
                sender.submit(layer, event, targets)
        for layer in range(cfg.layers):
            wait_gate(layer, layer_errors)
        drained = sender.drain(gate_s)
        report = prefill_report(sender, layer_errors, drained, sender.counters(),
                                ready_at=ready_at, cpu=process_cpu(cpu0))
        report["ack_ms"] = report["ack_ms"][acks_before:]
        out.put((f"prefill_done/{k}", f"prefill {p_rank}", report))
    sig.release.wait(cfg.timeout_s)  # keep memory alive for the bare replays
    sender.stop(deadlines.stop_s)
    transport.close()


def _digested(targets: list[LayerTarget], layout: SourceLayout, digest: Digest,
              main_owner: tuple[int, int]) -> list[LayerTarget]:
    """The targets with each read entry's block digests for this layer (``verify_kv``):
    what the reading Decode rank reads (the demo states a shared main pool)."""
    return [t if t.request is None else dataclasses.replace(t, request=dataclasses.replace(
        t.request, digests=stated_digests(layout, t.request, digest, member=t.member,
                                          ratio=t.ratio, main_owner=main_owner)))
            for t in targets]


def _targets(cfg: DemoConfig, k: int, endpoint: str, mapping: Any, ids: list[tuple[int, ...]],
             start: int, done: bool) -> list[LayerTarget]:
    """One layer's announcement of a chunk for round ``k``'s requests."""
    targets = []
    for r in range(cfg.requests):
        ext = external_request_id(internal_id(r, k))
        req = ReadRequest(ext, ids[r], ids[r], start, start) if ids[r] else None
        if req is not None or done:
            targets.append(LayerTarget(endpoint, req, done, mapping.member, mapping.ratio, ext))
    return targets
