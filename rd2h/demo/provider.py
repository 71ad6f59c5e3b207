"""``rd2h demo --via-provider``: a Prefill rank driven the way vLLM drives rd2h's
connector, through its buffer-reuse provider interface (spec 11), instead of calling
``PrefillSender.submit`` / ``wait_for_layer_send`` directly.

Every request is tracked through ``update_state_after_alloc``. Per chunk (one engine
step) the connector's scheduler role (``PrefillScheduler``) turns each request's progress
into this step's plan (``build_connector_meta``), and the worker role (``PrefillWorker``)
gets it in ``bind_connector_metadata``. Per layer, the rank plays a forward pass under a
multi-connector with a layer-wise offload sink:

1. ``wait_for_layer_reuse(layer)``: the waiter a sink calls before it overwrites a
   shared physical buffer (with ``--shared-buffers``);
2. the KV write (the scatter into the buffer);
3. ``save_kv_layer(name)`` as Ascend's ``on_kv_cache_written`` early dispatch, which
   announces the layer;
4. ``save_kv_layer(name)`` again as vLLM's own hook, which must skip the layer already
   dispatched this step (a second announcement is an error).

At the end, ``get_transfer_results`` must release every request (all announcements
answered), which is what lets vLLM free a finished request's blocks.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from rd2h.app.connector.roles import RequestFacts, ScheduledRequest
from rd2h.demo.config import DemoConfig, chunk_bounds, demo_compat, internal_id, layer_name
from rd2h.demo.faults import prefill_kill_layer
from rd2h.demo.memory import killed, prefill_memory, prefill_report
from rd2h.demo.signals import Signals
from rd2h.demo.synthetic import Allocation, block_pattern
from rd2h.domain.errors import LayerSendError
from rd2h.domain.planning.topology import compute_mapping, remote_port, tcp_endpoint

ENGINE_ID = "demo-decode"


def prefill_rank_via_provider(cfg: DemoConfig, p_rank: int, base_port: int,
                              alloc: Allocation, sig: Signals, out: Any) -> None:
    """One Prefill rank process (reports ``ready`` and ``prefill_done/0`` like the
    direct path, so the demo parent treats both alike; one round only)."""
    shapes = cfg.shapes
    deadlines = cfg.deadlines()
    container, transport, buffers, layouts, p_ids = prefill_memory(cfg, p_rank, alloc)
    n_phys = cfg.shared_buffers or cfg.layers
    comps = shapes.components
    request_of = {internal_id(r): r for r in range(cfg.requests)}

    def write(layer: int, r: int, start: int, end: int) -> None:
        idx = np.arange(start, end)
        for c in comps:
            buffers[(layer % n_phys, c)][p_ids[r][start:end]] = block_pattern(
                r, layer, c, idx, shapes.bytes_per_block(c)
            )

    sender = container.prefill_sender(p_session=transport.session_id, layers=layouts,
                                      compat=demo_compat(cfg))
    # A layer's gate resolves (acknowledged, failed or expired) within this budget.
    gate_s = sender.timeouts.gate_budget_s
    worker = container.prefill_worker(
        sender=sender, layer_names={i: layer_name(i) for i in range(cfg.layers)},
        buffer_reuse=cfg.shared_buffers > 0, reuse_timeout_s=gate_s,
    )
    scheduler = container.prefill_scheduler(block_size=cfg.block_size, main_group=0,
                                            indexer_group=1)
    params = {"do_remote_decode": True, "remote_host": cfg.host, "remote_port": base_port,
              "remote_tp_size": cfg.decode_tp, "remote_engine_id": ENGINE_ID}
    for n, rid in enumerate(request_of, 1):
        scheduler.update_state_after_alloc(RequestFacts(
            rid, prompt_len=cfg.prompt_tokens, num_prompt_tokens=cfg.prompt_tokens,
            num_computed_tokens=0, params=params), (), 0)
        if scheduler.counters()["tracked"] < n:
            raise RuntimeError(f"the Prefill scheduler refused request {rid}")
    if not cfg.shared_buffers:  # every (layer, block) is written once: before timing
        for layer in range(cfg.layers):
            for r in range(cfg.requests):
                write(layer, r, 0, alloc.blocks_per_request)

    mapping = compute_mapping(cfg.prefill_tp, cfg.decode_tp, p_rank)
    endpoint = tcp_endpoint(cfg.host, remote_port(base_port, mapping.d_rank))
    kill_layer = prefill_kill_layer(cfg.faults, p_rank)
    worker.start()
    failed = sender.prepare([endpoint], deadlines.meta_ack_s)  # connect before timing
    if failed:
        raise ConnectionError(f"decode endpoint handshake failed: {failed}")
    out.put(("ready", f"prefill {p_rank}", None))
    if not sig.announce[0].wait(cfg.timeout_s):
        raise TimeoutError("no start signal from the demo parent")
    layer_errors: dict[str, None] = {}

    def reuse(layer: int) -> None:
        """The sink's waiter: the buffer may be overwritten once Decode read it."""
        try:
            worker.wait_for_layer_reuse(layer)
        except LayerSendError as exc:
            layer_errors[str(exc)] = None
            if not sender.gate_open(layer):  # never reuse storage Decode may still read
                raise RuntimeError(f"layer {layer}'s gate still closed after {gate_s:g} s") from exc

    computed = 0
    early = 0
    ready_at = 0.0
    for chunk, upto in enumerate(chunk_bounds(cfg)):
        scheduled = []
        for rid, r in request_of.items():
            ids = [int(b) for b in p_ids[r]]
            scheduled.append(ScheduledRequest(rid, [ids, ids] if chunk == 0 else None,
                                              computed, upto - computed, chunk == 0))
        plan = scheduler.build_connector_meta(scheduled)
        sends = plan.sends
        computed = upto
        worker.bind_connector_metadata(plan)
        for layer in range(cfg.layers):
            if chunk == 0 and layer == kill_layer:
                for earlier in range(layer):  # die once Decode acknowledged these
                    reuse(earlier)
                killed()
            if cfg.shared_buffers:
                reuse(layer)
                for s in sends:
                    start = s.main_start
                    write(layer, request_of[s.internal_id], start, start + len(s.main_block_ids))
            name = layer_name(layer)
            if cfg.layer_compute_ms:
                time.sleep(cfg.layer_compute_ms / 1e3)  # the device computes this layer
            if upto == cfg.prompt_tokens and layer == cfg.layers - 1:
                ready_at = time.monotonic()  # the last layer of the prompt is ready
            before = worker.layers_announced
            worker.save_kv_layer(name)  # on_kv_cache_written
            early += worker.layers_announced - before
            before = worker.layers_announced
            worker.save_kv_layer(name)  # vLLM's save_kv_layer
            if worker.layers_announced > before:
                raise RuntimeError(f"save_kv_layer announced {name} a second time this step")
    for layer in range(cfg.layers):
        reuse(layer)
    drained = sender.drain(gate_s)
    released: set[str] = set()
    end = container.clock().now() + gate_s
    while len(released) < len(request_of) and container.clock().now() < end:
        # vLLM finished every request
        released |= worker.get_transfer_results(request_of).finished_sending
        if len(released) < len(request_of):
            time.sleep(0.01)
    # counters: the worker's requests and tickets left, with the sender's
    out.put(("prefill_done/0", f"prefill {p_rank}",
             prefill_report(sender, layer_errors, drained, worker.counters(),
                            early_dispatches=early, released=len(released),
                            ready_at=ready_at)))
    sig.release.wait(cfg.timeout_s)  # keep memory alive for the bare replay
    worker.shutdown()
    transport.close()
