"""The figures of a demo run's rounds: each round pulls with the whole pipeline and
replays round 0's reads on the bare transport (``round_order`` alternates which goes
first), so every ratio compares two measurements taken moments apart on the same
machine. Also the transfer tail: from the moment the prompt's last layer was ready on
Prefill to the moment each request was complete on every Decode rank."""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from rd2h.demo.config import DemoConfig, chunk_ranges, internal_id
from rd2h.demo.synthetic import Allocation


@dataclass
class RoundFigures:
    rounds: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0  # median pipeline time of a round
    bytes: int = 0
    gbps: float = 0.0  # median pipeline rate
    raw_gbps: float | None = None  # median bare rate
    raw_seconds: float | None = None
    ratio_median: float | None = None
    ratio_min: float | None = None
    ratio_max: float | None = None
    tail_ms: list[float] = field(default_factory=list)
    bare_layer_ms: float | None = None  # bare read of the final chunk of one layer
    cores: int = 1
    # Median CPU seconds of a pipeline round, all ranks and threads: Decode user / kernel
    # (the copy itself is kernel time), Prefill; and of a bare replay.
    cpu: dict[str, float] = field(default_factory=dict)
    # Best ratio the CPU spent allows on this machine: bare time / (pipeline CPU / cores).
    cpu_ratio_ceiling: float | None = None
    # CPU per byte moved (ns/byte), median over rounds: "pipeline", "bare" and "ratio"
    # (pipeline / bare, the median of the per-round ratios).
    cpu_per_byte: dict[str, float] = field(default_factory=dict)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(cfg: DemoConfig, alloc: Allocation, msgs: dict[str, dict[str, Any]],
              t0: dict[int, float]) -> RoundFigures:
    fig = RoundFigures()
    for k in range(cfg.rounds):
        dec = msgs.get(f"decode_done/{k}", {})
        pre = msgs.get(f"prefill_done/{k}", {})
        row: dict[str, Any] = {"round": k, "order": "pipeline first" if k % 2 == 0
                               else "bare first"}
        if dec and k in t0:
            nbytes = sum(p["bytes"] for p in dec.values())
            seconds = max(0.0, max(p["t_end"] for p in dec.values()) - t0[k])
            row.update(bytes=nbytes, seconds=seconds,
                       gbps=nbytes / seconds / 1e9 if seconds > 0 else 0.0)
        bare = msgs.get(f"bare/{k}", {})
        if len(bare) == cfg.decode_tp and not any("skipped" in b for b in bare.values()):
            span = max(b["t1"] for b in bare.values()) - min(b["t0"] for b in bare.values())
            nbytes = sum(b["bytes"] for b in bare.values())
            row.update(bare_seconds=span, bare_gbps=nbytes / span / 1e9 if span > 0 else None)
        if row.get("gbps") and row.get("bare_gbps"):
            row["ratio"] = row["gbps"] / row["bare_gbps"]
        _cpu(row, dec, pre, bare, msgs.get(f"bare_prefill_cpu/{k}"))
        ready = [p.get("ready_at") or 0.0 for p in pre.values()]
        if len(dec) == cfg.decode_tp and len(pre) == cfg.prefill_tp and all(ready):
            for r in range(cfg.requests):
                rid = internal_id(r, k)
                ends = [p["ended_at"].get(rid) for p in dec.values()]
                if all(e is not None for e in ends) and all(
                    p["outcomes"].get(rid, "") is None for p in dec.values()
                ):
                    fig.tail_ms.append((max(ends) - max(ready)) * 1e3)
        fig.rounds.append(row)
    timed = [r for r in fig.rounds if "seconds" in r]
    if timed:
        fig.seconds = _median([r["seconds"] for r in timed]) or 0.0
        fig.gbps = _median([r["gbps"] for r in timed]) or 0.0
        fig.bytes = timed[0]["bytes"]
    fig.raw_gbps = _median([r["bare_gbps"] for r in fig.rounds if r.get("bare_gbps")])
    fig.raw_seconds = _median([r["bare_seconds"] for r in fig.rounds if "bare_seconds" in r])
    ratios = [r["ratio"] for r in fig.rounds if "ratio" in r]
    if ratios:
        fig.ratio_median, fig.ratio_min, fig.ratio_max = _median(ratios), min(ratios), max(ratios)
    fig.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    with_cpu = [r for r in fig.rounds if "cpu" in r]
    for key in ("decode_user", "decode_sys", "prefill", "pipeline", "bare", "bare_prefill"):
        values = [r["cpu"][key] for r in with_cpu if key in r["cpu"]]
        if values:
            fig.cpu[key] = _median(values) or 0.0
    ceilings = [r["bare_seconds"] / (r["cpu"]["pipeline"] / fig.cores) for r in with_cpu
                if r.get("bare_seconds") and r["cpu"].get("pipeline")]
    fig.cpu_ratio_ceiling = _median(ceilings)
    for key in ("pipeline", "bare", "ratio"):
        values = [r["cpu_per_byte"][key] for r in fig.rounds if "cpu_per_byte" in r]
        if values:
            fig.cpu_per_byte[key] = _median(values) or 0.0
    if fig.raw_seconds:
        start, end, _ = chunk_ranges(cfg, alloc)[-1]
        # Bytes scale with blocks: the final chunk of one layer is this share of a round.
        share = (end - start) / alloc.blocks_per_request / cfg.layers
        fig.bare_layer_ms = fig.raw_seconds * share * 1e3
    return fig


def _cpu(row: dict[str, Any], dec: dict[str, Any], pre: dict[str, Any],
         bare: dict[str, Any], bare_prefill: dict[str, Any] | None = None) -> None:
    """CPU seconds of the round's pipeline (every rank) and bare replay, when every
    rank reported them, and the CPU each spent per byte moved.

    Both sides count the same processes, every thread: the Decode ranks, and the
    Prefill ranks (idle during a replay: ``bare_prefill``, their CPU over the replay
    as the parent measured it, ``bare_prefill_cpu/K``; a run without it counts the
    Decode ranks alone on the bare side, which only raises the ratio)."""
    cpu: dict[str, float] = {}
    if dec and pre and all("cpu" in p for p in (*dec.values(), *pre.values())):
        cpu["decode_user"] = sum(p["cpu"]["user"] for p in dec.values())
        cpu["decode_sys"] = sum(p["cpu"]["sys"] for p in dec.values())
        cpu["prefill"] = sum(p["cpu"]["user"] + p["cpu"]["sys"] for p in pre.values())
        cpu["pipeline"] = cpu["decode_user"] + cpu["decode_sys"] + cpu["prefill"]
    if bare and all("cpu" in b for b in bare.values()):
        cpu["bare"] = sum(b["cpu"]["user"] + b["cpu"]["sys"] for b in bare.values())
        if bare_prefill:
            cpu["bare_prefill"] = sum(bare_prefill.values())
            cpu["bare"] += cpu["bare_prefill"]
    if cpu:
        row["cpu"] = cpu
    nbytes = row.get("bytes")
    bare_bytes = sum(b.get("bytes", 0) for b in bare.values()) if bare else 0
    if cpu.get("pipeline") and cpu.get("bare") and nbytes and bare_bytes:
        per = {"pipeline": cpu["pipeline"] / nbytes * 1e9, "bare": cpu["bare"] / bare_bytes * 1e9}
        per["ratio"] = per["pipeline"] / per["bare"]
        row["cpu_per_byte"] = per  # ns of CPU per byte moved
