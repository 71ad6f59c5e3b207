"""What every demo rank process shares: entering its network namespace, an injected
kill, and a Prefill rank's source memory (used by both Prefill drivers)."""

from __future__ import annotations

import os
import resource
from typing import Any

import numpy as np

from rd2h.bootstrap.container import build_container
from rd2h.bootstrap.gateways import network_namespaces
from rd2h.demo.config import DemoConfig, layer_name, rank_settings
from rd2h.demo.faults import KILLED_EXIT_CODE
from rd2h.demo.synthetic import Allocation
from rd2h.domain.planning.layout import SourceLayout, TensorComponent


def enter_netns(name: str) -> None:
    # c10d warns that it cannot resolve peer host names inside a namespace; harmless.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if name:
        network_namespaces().enter(name)


def process_cpu(since: dict[str, float] | None = None) -> dict[str, float]:
    """CPU seconds this process (every thread: rd2h's, ZeroMQ's, gloo's) spent in user
    and kernel mode; with ``since``, the part spent after that reading."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    now = {"user": ru.ru_utime, "sys": ru.ru_stime}
    return {k: v - since[k] for k, v in now.items()} if since else now


def threads_cpu(pid: int) -> float | None:
    """CPU seconds every live thread of process ``pid`` ran so far (Linux
    ``/proc/PID/task/*/schedstat``: nanoseconds, user and kernel together); None when
    unreadable. Lets the parent measure a rank that is not reporting (idle)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def killed() -> None:
    """An injected kill: no cleanup, no goodbye (sockets close with the process)."""
    os._exit(KILLED_EXIT_CODE)


def prefill_memory(cfg: DemoConfig, p_rank: int, alloc: Allocation) -> tuple[Any, ...]:
    """A Prefill rank's container, transport, registered source buffers (one per
    physical buffer and component), per-layer layouts and per-request block ids."""
    shapes = cfg.shapes
    container = build_container(rank_settings(cfg, "prefill", p_rank, tp_size=cfg.prefill_tp,
                                              host=cfg.prefill_host))
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


def prefill_report(sender: Any, layer_errors: dict[str, None], drained: bool,
                   counters: dict[str, int], **extra: Any) -> dict[str, Any]:
    """What a Prefill rank tells the parent in ``prefill_done`` (both drivers)."""
    return {"ack_ms": sender.stats.ack_latencies_ms, "layers_sent": sender.stats.layers_sent,
            "layers_failed": sender.stats.layers_failed, "layer_errors": list(layer_errors),
            "drained": drained, "counters": counters, **extra}
