"""``rd2h demo``'s report: the result record, the human summary, JSON, progress."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


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
    faults: list[str] = field(default_factory=list)
    # internal request id -> {"status": "ok" | "failed" | "hung", "reason", "ended_s"}
    outcomes: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests_hung: int = 0
    corrupted_ok: int = 0
    leaks: dict[str, dict[str, int] | None] = field(default_factory=dict)
    layer_errors: list[str] = field(default_factory=list)
    # Layers the Prefill senders saw fail (a READ_FAILED, a deadline, a lost connection);
    # ``layer_errors`` lists what the layers' gates still held at the end of a round.
    prefill_layers_failed: int = 0
    exits: dict[str, int | None] = field(default_factory=dict)
    deadlines: dict[str, float] = field(default_factory=dict)
    # "provider": Prefill drove rd2h's connector worker (--via-provider), else "sender"
    prefill_driver: str = "sender"
    early_dispatches: int | None = None  # --via-provider: layers announced on write
    # --rounds: per round the pipeline and the bare replay of the same reads, A/B
    rounds: list[dict[str, Any]] = field(default_factory=list)
    ratio_median: float | None = None  # pipeline / bare, per round
    ratio_min: float | None = None
    ratio_max: float | None = None
    layer_compute_ms: float = 0.0
    # last layer ready on Prefill -> request complete on every Decode rank
    tail_ms_p50: float | None = None
    tail_ms_p99: float | None = None
    bare_layer_ms: float | None = None  # bare read of one layer's final chunk
    cores: int = 1
    cpu: dict[str, float] = field(default_factory=dict)  # median CPU s per round
    cpu_ratio_ceiling: float | None = None  # bare s / (pipeline CPU s / cores)
    # ns of CPU per byte moved, medians over rounds: pipeline, bare, ratio (pipeline / bare)
    cpu_per_byte: dict[str, float] = field(default_factory=dict)


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


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


class Progress:
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


def summary_text(res: DemoResult) -> str:
    def f(x: float | None, unit: str = "") -> str:
        return "n/a" if x is None else f"{x:.2f}{unit}"

    lines = [
        f"rd2h demo: P TP {res.prefill_tp} -> D TP {res.decode_tp} over {res.transport}, "
        f"{res.layers} layers x {res.requests} requests x {res.prompt_tokens} tokens, "
        f"{res.chunks} chunk(s), shared buffers {res.shared_buffers or 'off'}; {res.network}"
        + ("; Prefill via the connector's provider interface"
           if res.prefill_driver == "provider" else ""),
    ]
    if res.faults:
        lines.append(f"  faults: {', '.join(res.faults)}")
    lines += [
        f"  requests ok {res.requests_ok}, failed {res.requests_failed}, hung "
        f"{res.requests_hung}; mismatched blocks {res.mismatched_blocks} (corrupted ok "
        f"requests {res.corrupted_ok}); leaked state {res.leaked_state}",
        f"  pulled {res.bytes / 2**20:.1f} MiB in {res.seconds:.3f} s = {f(res.gbps)} GB/s "
        f"({res.descriptors} descriptors)",
        f"  bare transport {f(res.raw_gbps)} GB/s; in-process memcpy {f(res.memcpy_gbps)} GB/s",
        f"  layer ack p50 {f(res.layer_ack_p50_ms, ' ms')}, p99 {f(res.layer_ack_p99_ms, ' ms')}",
    ]
    if len(res.rounds) > 1:
        lines.append("  round  order           pipeline GB/s  bare GB/s  ratio")
        for r in res.rounds:
            lines.append(f"  {r['round']:5d}  {r['order']:14s}  {f(r.get('gbps')):>13s}  "
                         f"{f(r.get('bare_gbps')):>9s}  {f(r.get('ratio'))}")
        lines.append(f"  pipeline/bare ratio: median {f(res.ratio_median)}, min "
                     f"{f(res.ratio_min)}, max {f(res.ratio_max)} over {len(res.rounds)} "
                     "rounds (rates above are medians)")
    if res.cpu.get("pipeline"):
        c = res.cpu
        lines.append(
            f"  CPU per round (all ranks and threads): pipeline {c['pipeline'] * 1e3:.0f} ms "
            f"(Decode user {c['decode_user'] * 1e3:.0f}, kernel {c['decode_sys'] * 1e3:.0f};"
            f" Prefill {c['prefill'] * 1e3:.0f})"
            + (f", bare {c['bare'] * 1e3:.0f} ms" if "bare" in c else "")
            + f" on {res.cores} core(s): ratio ceiling {f(res.cpu_ratio_ceiling)}")
    if res.cpu_per_byte.get("ratio"):
        c = res.cpu_per_byte
        lines.append(f"  CPU per byte (median): pipeline {c['pipeline']:.3f} ns, bare "
                     f"{c['bare']:.3f} ns; pipeline/bare {f(c['ratio'])} (per round: "
                     + ", ".join(f(r.get("cpu_per_byte", {}).get("ratio")) for r in res.rounds)
                     + ")")
    if res.tail_ms_p50 is not None and res.layer_compute_ms:
        # Without compute every layer is ready at once: the "tail" is the whole pull.
        compute = f"{res.layer_compute_ms:g} ms compute per layer"
        lines.append(f"  tail (last layer ready -> complete on every Decode rank; {compute}):"
                     f" p50 {f(res.tail_ms_p50, ' ms')}, p99 {f(res.tail_ms_p99, ' ms')};"
                     f" bare read of that layer {f(res.bare_layer_ms, ' ms')}")
    failed = [(rid, o) for rid, o in res.outcomes.items() if o["status"] != "ok"]
    for rid, o in failed[:10]:
        lines.append(f"  {o['status']}: {rid}: {o['reason']}")
    if len(failed) > 10:
        lines.append(f"  ... {len(failed) - 10} more not ok")
    lines += [f"  layer error: {e.splitlines()[0]}" for e in res.layer_errors[:5]]
    lines.append(f"  VERIFIED: {'yes' if res.verified else 'NO'}")
    lines += [f"  error: {e.splitlines()[0]}" for e in res.errors[:10]]
    return "\n".join(lines)


def to_json(res: DemoResult) -> str:
    return json.dumps(asdict(res), sort_keys=True)
