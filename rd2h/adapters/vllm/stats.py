"""rd2h's transfer figures in vLLM's KV-connector stats (they reach its metrics)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

_SUMS = ("bytes_pulled", "layers_done", "layers_failed", "reads_failed", "read_seconds",
         "requests_done", "requests_failed", "layers_announced")


@dataclass
class Rd2hConnectorStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> Rd2hConnectorStats:
        for key, value in other.data.items():
            if key == "read_latency_ms":
                self.data.setdefault(key, []).extend(value)
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in _SUMS if k in self.data}
        lat = sorted(self.data.get("read_latency_ms", []))
        if lat:
            out["read_latency_p50_ms"] = round(lat[len(lat) // 2], 3)
            out["read_latency_max_ms"] = round(lat[-1], 3)
            out["reads"] = len(lat)
        if out.get("read_seconds"):
            out["pull_gbps"] = round(out.get("bytes_pulled", 0) / out["read_seconds"] / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not any(v for v in self.data.values())


def delta(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in now.items():
        if key == "read_latency_ms":
            out[key] = list(value[len(before.get(key, [])):])
        else:
            out[key] = value - before.get(key, 0)
    return out
