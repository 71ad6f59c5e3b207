"""rd2h's Prometheus series through vLLM's own per-connector machinery.

vLLM's ``KVConnectorProm`` (what its Prometheus stat logger holds) resolves the
connector class from a real ``KVTransferConfig`` and calls its ``build_prom_metrics``;
here its metric classes register into a fresh ``CollectorRegistry`` per test, so
every series is read back exactly and nothing leaks into the process-wide registry.
Payloads are what the frontend receives: ``Rd2hConnectorStats.to_dict()`` after a
msgpack round trip through vLLM's ``SchedulerStats`` encoder.
"""

from __future__ import annotations

import functools
import math
import random
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from rd2h.adapters.vllm.prom import COUNTERS, PREFIX, READ_LATENCY, Rd2hPromMetrics
from rd2h.adapters.vllm.stats import (
    MAX_LATENCY_SAMPLES,
    OVERFLOW,
    READ_LATENCY_BUCKETS_MS,
    Rd2hConnectorStats,
)
from rd2h.entry.connector import SfaRemoteD2HConnector

LABELNAMES = ["model_name", "engine"]
ENGINES = {0: ["tiny", "0"], 1: ["tiny", "1"]}
RD2H = {"kv_connector": "SfaRemoteD2HConnector",
        "kv_connector_module_path": "rd2h.entry.connector",
        "kv_role": "kv_consumer"}
PLAIN = {"kv_connector": "RecordingPlain", "kv_connector_module_path": "fakes.vllm_connectors",
         "kv_role": "kv_both"}


def _prom(registry: CollectorRegistry, ktc: KVTransferConfig) -> KVConnectorProm:
    """vLLM's KVConnectorProm, its metric classes bound to ``registry``."""
    bound = {f"_{kind}_cls": functools.partial(cls, registry=registry)
             for kind, cls in (("gauge", Gauge), ("counter", Counter),
                               ("histogram", Histogram))}
    prom_cls = type("RegistryKVConnectorProm", (KVConnectorProm,), bound)
    return prom_cls(VllmConfig(kv_transfer_config=ktc), LABELNAMES, ENGINES)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def rd2h_prom(registry: CollectorRegistry) -> KVConnectorProm:
    return _prom(registry, KVTransferConfig(**RD2H))


def _shipped(data: dict[str, Any]) -> dict[str, Any]:
    """A payload as the frontend gets it: stats built, to_dict, msgpack both ways."""
    payload = Rd2hConnectorStats(data=data).to_dict()
    bufs = MsgpackEncoder().encode(SchedulerStats(kv_connector_stats=payload))
    return MsgpackDecoder(SchedulerStats).decode(bufs).kv_connector_stats


def _rd2h_samples(registry: CollectorRegistry) -> dict[tuple[str, str, str], float]:
    """Every sample of rd2h's series: (sample name, engine, le) -> value."""
    out = {}
    for family in registry.collect():
        if not family.name.startswith(PREFIX):
            continue
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            assert s.labels["model_name"] == "tiny"
            out[(s.name, s.labels["engine"], s.labels.get("le", ""))] = s.value
    return out


def _moved(registry: CollectorRegistry) -> dict[tuple[str, str, str], float]:
    return {k: v for k, v in _rd2h_samples(registry).items() if v}


def _value(registry: CollectorRegistry, name: str, engine: str, **labels: str) -> float:
    got = registry.get_sample_value(name, {"model_name": "tiny", "engine": engine, **labels})
    assert got is not None, name
    return got


def test_vllm_builds_rd2h_metrics_with_every_series_per_engine(rd2h_prom, registry) -> None:
    assert isinstance(rd2h_prom.prom_metrics, Rd2hPromMetrics)
    samples = _rd2h_samples(registry)
    for name, _ in COUNTERS.values():
        for engine in ("0", "1"):
            assert samples[(f"{PREFIX}{name}_total", engine, "")] == 0
    for engine in ("0", "1"):
        assert samples[(READ_LATENCY + "_count", engine, "")] == 0
        les = {le for (n, e, le) in samples if n == READ_LATENCY + "_bucket" and e == engine}
        assert len(les) == len(READ_LATENCY_BUCKETS_MS) + 1  # and +Inf
    assert float(min(les, key=float)) == pytest.approx(1e-4)
    assert max(float(le) for le in les if le != "+Inf") == pytest.approx(5.0)
    assert not _moved(registry)


def test_observe_moves_exactly_the_right_series_on_the_right_engine(rd2h_prom,
                                                                    registry) -> None:
    data = {"bytes_pulled": 4096, "layers_done": 3, "layers_failed": 1, "reads_failed": 2,
            "requests_failed": 1, "requests_done": 0, "read_seconds": 7.0025,
            "read_latency_ms": [0.05, 2.5, 7000.0]}
    rd2h_prom.observe(_shipped(data), engine_idx=1)
    latency = {("_bucket", le): n for le, n in (
        ("0.0001", 1), ("0.00025", 1), ("0.0005", 1), ("0.001", 1), ("0.0025", 2),
        ("0.005", 2), ("0.01", 2), ("0.025", 2), ("0.05", 2), ("0.1", 2), ("0.25", 2),
        ("0.5", 2), ("1.0", 2), ("2.5", 2), ("5.0", 2), ("+Inf", 3))}
    want = {(f"{PREFIX}bytes_pulled_total", "1", ""): 4096,
            (f"{PREFIX}layers_done_total", "1", ""): 3,
            (f"{PREFIX}layers_failed_total", "1", ""): 1,
            (f"{PREFIX}reads_failed_total", "1", ""): 2,
            (f"{PREFIX}requests_failed_total", "1", ""): 1,
            (READ_LATENCY + "_count", "1", ""): 3,
            (READ_LATENCY + "_sum", "1", ""): pytest.approx(7.00255),
            **{(READ_LATENCY + suffix, "1", le): n for (suffix, le), n in latency.items()}}
    assert _moved(registry) == want
    # A second interval adds up; engine 0 stays untouched.
    rd2h_prom.observe(_shipped({"bytes_pulled": 4, "read_latency_ms": [1.0]}), engine_idx=1)
    assert _value(registry, f"{PREFIX}bytes_pulled_total", "1") == 4100
    assert _value(registry, READ_LATENCY + "_count", "1") == 4
    assert _value(registry, READ_LATENCY + "_bucket", "1", le="0.001") == 2
    assert not {k for k in _moved(registry) if k[1] == "0"}


def test_a_prefill_payload_moves_its_own_series(rd2h_prom, registry) -> None:
    rd2h_prom.observe(_shipped({"layers_announced": 8, "requests_failed": 0}), engine_idx=0)
    assert _moved(registry) == {(f"{PREFIX}layers_announced_total", "0", ""): 8}


def test_empty_stats_move_nothing(rd2h_prom, registry) -> None:
    for data in ({}, {"bytes_pulled": 0, "layers_done": 0, "read_latency_ms": []},
                 {"read_seconds": 0.0, "requests_failed": 0}):
        rd2h_prom.observe(_shipped(data), engine_idx=0)
        rd2h_prom.observe(data, engine_idx=1)
    assert not _moved(registry)


def test_a_negative_delta_never_moves_a_counter_backwards(rd2h_prom, registry) -> None:
    rd2h_prom.observe({"bytes_pulled": -5, "layers_done": 2}, engine_idx=0)
    assert _moved(registry) == {(f"{PREFIX}layers_done_total", "0", ""): 2}


# ====================================================================== bounded payloads


def _latencies(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [round(10 ** rng.uniform(-1.5, 3.9), 4) for _ in range(n)]  # ~0.03 ms .. 8 s


def test_shipped_latencies_are_bounded_yet_the_histogram_stays_exact(rd2h_prom,
                                                                     registry) -> None:
    lat = _latencies(5 * MAX_LATENCY_SAMPLES + 17, seed=3)
    stats = Rd2hConnectorStats(data={"read_latency_ms": lat, "bytes_pulled": 1})
    assert len(stats.data["read_latency_ms"]) == MAX_LATENCY_SAMPLES
    assert stats.data["read_latency_ms"] == lat[-MAX_LATENCY_SAMPLES:]  # the latest kept
    assert len(stats.data[OVERFLOW]) == len(READ_LATENCY_BUCKETS_MS) + 1
    reduced = stats.reduce()
    assert reduced["reads"] == len(lat) and reduced["read_latency_max_ms"] == round(max(lat), 3)

    rd2h_prom.observe(_shipped(stats.to_dict()), engine_idx=0)
    reference = CollectorRegistry()
    hist = Histogram("ref", "all samples, one by one", buckets=[b / 1e3 for b in
                                                                READ_LATENCY_BUCKETS_MS],
                     registry=reference)
    for value in lat:
        hist.observe(value / 1e3)
    got = {(s.name.removeprefix(READ_LATENCY), s.labels.get("le")): s.value
           for f in registry.collect() if f.name == READ_LATENCY for s in f.samples
           if s.labels["engine"] == "0" and not s.name.endswith("_created")}
    want = {(s.name.removeprefix("ref"), s.labels.get("le")): s.value
            for f in reference.collect() for s in f.samples if not s.name.endswith("_created")}
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=1e-9), key


def test_aggregation_stays_bounded_and_counts_every_read() -> None:
    total: Rd2hConnectorStats | None = None
    every: list[float] = []
    for seed in range(6):
        lat = _latencies(700, seed)
        every += lat
        step = Rd2hConnectorStats(data={"read_latency_ms": lat, "layers_done": 1})
        total = step if total is None else total.aggregate(step)
    assert total is not None
    assert len(total.data["read_latency_ms"]) == MAX_LATENCY_SAMPLES
    assert total.data["read_latency_ms"] == every[-MAX_LATENCY_SAMPLES:]
    folded = total.data[OVERFLOW]
    assert sum(b[0] for b in folded) == len(every) - MAX_LATENCY_SAMPLES
    assert math.isclose(sum(b[1] for b in folded) + sum(total.data["read_latency_ms"]),
                        sum(every))
    reduced = total.reduce()
    assert reduced["reads"] == len(every) and reduced["layers_done"] == 6
    assert reduced["read_latency_max_ms"] == round(max(every), 3)


def test_rebuilt_stats_own_their_lists() -> None:
    """vLLM rebuilds stats from a payload; aggregating must not edit the payload."""
    payload = {"read_latency_ms": [1.0], "bytes_pulled": 1}
    stats = SfaRemoteD2HConnector.build_kv_connector_stats(payload)
    assert stats is not None
    stats.aggregate(Rd2hConnectorStats(data={"read_latency_ms": [2.0]}))
    assert payload["read_latency_ms"] == [1.0]
    assert stats.data["read_latency_ms"] == [1.0, 2.0]


# ====================================================================== multi-connector


def _multi(connector: str, module: str | None) -> KVTransferConfig:
    return KVTransferConfig(kv_connector=connector, kv_connector_module_path=module,
                            kv_role="kv_consumer",
                            kv_connector_extra_config={"connectors": [RD2H, PLAIN]})


def test_rd2h_multi_connector_exposes_rd2h_series_and_skips_siblings_without_any(
        registry) -> None:
    prom = _prom(registry, _multi("Rd2hMultiConnector", "rd2h.adapters.vllm.multi"))
    payload = {"SfaRemoteD2HConnector": _shipped({"bytes_pulled": 64, "layers_done": 2,
                                                  "read_latency_ms": [0.3, 0.7]}),
               "RecordingPlain": {"whatever": 1}}
    prom.observe(payload, engine_idx=1)
    assert _moved(registry) == {
        (f"{PREFIX}bytes_pulled_total", "1", ""): 64,
        (f"{PREFIX}layers_done_total", "1", ""): 2,
        (READ_LATENCY + "_count", "1", ""): 2,
        (READ_LATENCY + "_sum", "1", ""): pytest.approx(0.001),
        **{(READ_LATENCY + "_bucket", "1", le): n for le, n in (
            ("0.0005", 1), ("0.001", 2), ("0.0025", 2), ("0.005", 2), ("0.01", 2),
            ("0.025", 2), ("0.05", 2), ("0.1", 2), ("0.25", 2), ("0.5", 2), ("1.0", 2),
            ("2.5", 2), ("5.0", 2), ("+Inf", 2))},
    }


def test_vanilla_multi_connector_fails_on_a_sibling_without_metrics(registry) -> None:
    """Why Rd2hMultiConnector overrides build_prom_metrics: vLLM's asserts."""
    prom = _prom(registry, _multi("MultiConnector", None))
    prom.observe({"SfaRemoteD2HConnector": {"bytes_pulled": 1}}, engine_idx=0)
    assert _value(registry, f"{PREFIX}bytes_pulled_total", "0") == 1
    with pytest.raises(AssertionError, match="RecordingPlain"):
        prom.observe({"RecordingPlain": {"whatever": 1}}, engine_idx=0)
