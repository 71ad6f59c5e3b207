"""rd2h's transfer figures in vLLM's KV-connector stats: vLLM's log line (``reduce``)
and its Prometheus metrics (``rd2h.adapters.vllm.prom``, fed by ``to_dict``).

The stats go from each worker to the scheduler once per step, and from there to the
frontend, so they stay bounded: at most ``MAX_LATENCY_SAMPLES`` read latencies travel
as they are; older ones of the same interval are folded into per-bucket
``[count, sum_ms, max_ms]`` (``read_latency_overflow``, buckets
``READ_LATENCY_BUCKETS_MS``, the Prometheus histogram's), which keeps the histogram's
count, sum and buckets exact.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

_SUMS = ("bytes_pulled", "layers_done", "layers_failed", "reads_failed", "read_seconds",
         "requests_done", "requests_failed", "layers_announced", "requests_aborted",
         "requests_skipped", "failed_dispatch", "failed_prefill_lost", "failed_deadline",
         "failed_incomplete",
         "refused_incompatible", "refused_unauthenticated", "refused_peer_cap",
         "held_requests", "held_blocks", "reads_past_hold",
         "kv_digest_mismatches", "kv_blocks_verified", "control_frames_shed",
         "announcements_parked", "announcements_parked_expired")

LATENCIES = "read_latency_ms"
OVERFLOW = "read_latency_overflow"
# Upper bounds (ms) of the read-latency buckets, 0.1 ms .. 5 s (a last bucket: above).
READ_LATENCY_BUCKETS_MS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0,
                           500.0, 1000.0, 2500.0, 5000.0)
MAX_LATENCY_SAMPLES = 1024


@dataclass
class Rd2hConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        # Own the lists (vLLM rebuilds stats from a shallow copy of another's data) and
        # keep them bounded.
        if LATENCIES in self.data:
            self.data[LATENCIES] = list(self.data[LATENCIES])
        if OVERFLOW in self.data:
            self.data[OVERFLOW] = [list(b) for b in self.data[OVERFLOW]]
        _bound(self.data)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> Rd2hConnectorStats:
        for key, value in other.data.items():
            if key == LATENCIES:
                self.data.setdefault(key, []).extend(value)
            elif key == OVERFLOW:
                _merge_overflow(self.data, value)
            else:
                self.data[key] = self.data.get(key, 0) + value
        _bound(self.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in _SUMS if k in self.data}
        lat = sorted(self.data.get(LATENCIES, []))
        folded = [b for b in self.data.get(OVERFLOW, []) if b[0]]
        if lat:
            # The median of the latest samples once older ones were folded.
            out["read_latency_p50_ms"] = round(lat[len(lat) // 2], 3)
        if lat or folded:
            out["read_latency_max_ms"] = round(max(lat[-1:] + [b[2] for b in folded]), 3)
            out["reads"] = len(lat) + sum(int(b[0]) for b in folded)
        if out.get("read_seconds"):
            out["pull_gbps"] = round(out.get("bytes_pulled", 0) / out["read_seconds"] / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not any(v for v in self.data.values())


def read_latencies(data: dict[str, Any]) -> Iterator[tuple[float, int]]:
    """``(latency_ms, times)`` to observe for one stats payload: each kept sample once,
    each folded bucket's mean as often as it held samples (a bucket's mean lies in it)."""
    for value in data.get(LATENCIES, ()):
        yield float(value), 1
    for count, total, _ in data.get(OVERFLOW, ()):
        if count:
            yield total / count, int(count)


def _bound(data: dict[str, Any]) -> None:
    """Fold the oldest latencies beyond ``MAX_LATENCY_SAMPLES`` into the buckets."""
    lat = data.get(LATENCIES)
    if not lat or len(lat) <= MAX_LATENCY_SAMPLES:
        return
    cut = len(lat) - MAX_LATENCY_SAMPLES
    buckets = data.get(OVERFLOW) or _empty_overflow()
    for value in lat[:cut]:
        b = buckets[bisect_left(READ_LATENCY_BUCKETS_MS, value)]
        b[0] += 1
        b[1] += value
        b[2] = max(b[2], value)
    data[OVERFLOW] = buckets
    data[LATENCIES] = lat[cut:]


def _empty_overflow() -> list[list[float]]:
    return [[0, 0.0, 0.0] for _ in range(len(READ_LATENCY_BUCKETS_MS) + 1)]


def _merge_overflow(data: dict[str, Any], other: list[list[float]]) -> None:
    mine = data.get(OVERFLOW) or _empty_overflow()
    for b, o in zip(mine, other):
        b[0] += o[0]
        b[1] += o[1]
        b[2] = max(b[2], o[2])
    data[OVERFLOW] = mine


def delta(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in now.items():
        if key == LATENCIES:
            out[key] = list(value[len(before.get(key, [])):])
        else:
            out[key] = value - before.get(key, 0)
    return out
