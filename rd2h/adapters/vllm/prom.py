"""rd2h's series on vLLM's ``/metrics``, through vLLM's per-connector hook
(``KVConnectorBase_V1.build_prom_metrics``): the frontend's Prometheus stat logger
builds one ``Rd2hPromMetrics`` and hands it every stats payload
(``Rd2hConnectorStats.to_dict()``, one step's worth, summed over the TP workers).

Labels are vLLM's (``model_name``, ``engine``). A Decode engine moves the pull series;
a Prefill engine ``layers_announced`` and ``requests_failed``. The engine must run with
stats on: ``--disable-log-stats`` makes vLLM build no stat logger at all, so no
``vllm:`` series, rd2h's included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

from rd2h.adapters.vllm.stats import READ_LATENCY_BUCKETS_MS, read_latencies

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT

# The labels vLLM gives every engine series (its Prometheus logger: the model name and
# the engine index); rd2h's series get them from vLLM at start (``labelnames``).
VLLM_ENGINE_LABELS = ("model_name", "engine")
PREFIX = "vllm:rd2h_"

# stats key -> (series name without the prefix; Counter adds "_total"), help text
COUNTERS: dict[str, tuple[str, str]] = {
    "bytes_pulled": ("bytes_pulled", "Bytes of KV cache this Decode engine pulled from "
                     "Prefill engines (successful batched reads)."),
    "layers_done": ("layers_done", "Request layers whose KV this Decode engine received "
                    "completely (one per layer, request and TP rank)."),
    "layers_failed": ("layers_failed", "Request layers this Decode engine failed to "
                      "receive."),
    "reads_failed": ("reads_failed", "Batched reads from a Prefill engine that failed."),
    "requests_failed": ("requests_failed", "Requests whose KV transfer failed on this "
                        "engine (counted per TP rank)."),
    "requests_done": ("requests_done", "Requests whose KV this Decode engine received "
                      "completely (counted per TP rank)."),
    "layers_announced": ("layers_announced", "Request layers this Prefill engine "
                         "announced to Decode engines."),
    "requests_aborted": ("requests_aborted", "Decode: requests vLLM aborted while their KV "
                         "was still coming (client gone). Prefill: requests a Decode engine "
                         "no longer knew, so no more of them was announced."),
    "requests_skipped": ("requests_skipped", "Announced requests this Decode engine did not "
                         "read because it no longer knew them (per layer and TP rank)."),
    "kv_digest_mismatches": ("kv_digest_mismatches", "verify_kv: blocks this Decode engine "
                             "read whose bytes differed from the digest Prefill stated "
                             "(each fails its layer)."),
    "kv_blocks_verified": ("kv_blocks_verified", "verify_kv: blocks this Decode engine "
                           "checked against Prefill's digests after reading them."),
    "control_frames_shed": ("control_frames_shed", "Control frames this Decode engine "
                            "dropped unread because their connection sent past its "
                            "receive budget (limits.max_queued_bytes*): a flood."),
    "announcements_parked": ("announcements_parked", "Parallel dispatch: layer "
                             "announcements this Decode engine kept until it admitted the "
                             "requests they name (per TP rank)."),
    "announcements_parked_expired": ("announcements_parked_expired", "Parallel dispatch: "
                                     "kept announcements whose wait ended before their "
                                     "requests were admitted here (those were answered "
                                     "skipped)."),
    "reads_past_hold": ("reads_past_hold", "Layers this Decode engine failed because the "
                        "read would have ended after Prefill's hold on the blocks (Decode "
                        "too slow: Prefill may have reused them)."),
}
# series -> help text, {stats key: value of the "cause" label}
CAUSED: dict[str, tuple[str, dict[str, str]]] = {
    "requests_failed_by_cause": (
        "Requests this Decode engine failed to receive, by what it learned (counted per "
        "TP rank): the proxy could not dispatch them to Prefill, their Prefill peer "
        "disconnected, no KV arrived by the request deadline, or their Prefill peer "
        "reported the final layer before every layer they need was read.",
        {"failed_dispatch": "prefill_dispatch_failed", "failed_prefill_lost":
         "prefill_disconnected", "failed_deadline": "deadline",
         "failed_incomplete": "incomplete"}),
    "handshakes_refused": (
        "MF_META handshakes refused: by this Decode engine (incompatible build, failed "
        "authentication, peer cap), or refused to this Prefill engine by a Decode engine.",
        {"refused_incompatible": "incompatible", "refused_unauthenticated":
         "unauthenticated", "refused_peer_cap": "peer_cap"}),
}
# stats key -> (series name, help text): gauges, moved by the payload's change
GAUGES: dict[str, tuple[str, str]] = {
    "held_requests": ("prefill_held_requests", "Requests whose KV this Prefill engine still "
                      "holds for Decode engines (an announcement unanswered, or finished by "
                      "vLLM and not yet released), summed over TP ranks."),
    "held_blocks": ("prefill_held_blocks", "KV blocks (main) of the requests this Prefill "
                    "engine still holds for Decode engines, summed over TP ranks."),
}
READ_LATENCY = PREFIX + "read_latency_seconds"
READ_LATENCY_BUCKETS_S = tuple(ms / 1e3 for ms in READ_LATENCY_BUCKETS_MS)


class Rd2hPromMetrics(KVConnectorPromMetrics):
    """One counter per ``COUNTERS`` entry and the per-read latency histogram."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in COUNTERS.items():
            counter = self._counter_cls(name=PREFIX + name, documentation=doc,
                                        labelnames=labelnames)
            self.counters[key] = create_metric_per_engine(counter, per_engine_labelvalues)
        self.caused: dict[str, tuple[dict[int, Any], str]] = {}
        for name, (doc, causes) in CAUSED.items():
            counter = self._counter_cls(name=PREFIX + name, documentation=doc,
                                        labelnames=[*labelnames, "cause"])
            for key, cause in causes.items():
                self.caused[key] = ({i: counter.labels(*values, cause) for i, values
                                     in per_engine_labelvalues.items()}, cause)
        self.gauges: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in GAUGES.items():
            gauge = self._gauge_cls(name=PREFIX + name, documentation=doc,
                                    labelnames=labelnames, multiprocess_mode="sum")
            self.gauges[key] = create_metric_per_engine(gauge, per_engine_labelvalues)
        histogram = self._histogram_cls(
            name=READ_LATENCY,
            documentation="Duration of one batched read of KV cache from a Prefill engine "
                          "(one per layer and request on each TP rank).",
            buckets=list(READ_LATENCY_BUCKETS_S), labelnames=labelnames,
        )
        self.read_latency = create_metric_per_engine(histogram, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self.counters.items():
            value = transfer_stats_data.get(key)
            if value and value > 0:  # a counter only goes up
                per_engine[engine_idx].inc(value)
        for key, (per_engine, _) in self.caused.items():
            value = transfer_stats_data.get(key)
            if value and value > 0:
                per_engine[engine_idx].inc(value)
        for key, per_engine in self.gauges.items():
            value = transfer_stats_data.get(key)
            if value:  # a change since the last payload (payloads carry deltas)
                per_engine[engine_idx].inc(value)
        histogram = self.read_latency[engine_idx]
        for latency_ms, times in read_latencies(transfer_stats_data):
            for _ in range(times):
                histogram.observe(latency_ms / 1e3)

