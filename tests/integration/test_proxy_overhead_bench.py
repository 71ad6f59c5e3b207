"""``benchmarks/proxy_overhead.py``'s smoke run: the real ``rd2h proxy`` process in front of
fake engines, four configurations (one on httpcore's default sockets), every request
answered 200 (the benchmark exits otherwise), the proxy's CPU counted and the fast probes
seen. No figure is judged against a time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "proxy_overhead.py"


def test_smoke_run_measures_the_proxy_per_configuration() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--requests", "24", "--concurrency", "4", "--rounds", "1",
         "--config", "base", "--config", "affinity", "--config", "probes 0.1 s",
         "--config", "anyio sockets", "--json"],
        check=True, capture_output=True, text=True, timeout=300)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    med = res["medians"]
    assert set(med) == {"base", "affinity", "probes 0.1 s", "anyio sockets"}
    for name, m in med.items():
        assert m["cpu_us_per_request"] > 0, name
        assert m["req_per_s"] > 0 and m["latency_p50_ms"] > 0, name
    assert len(res["runs"]["base"]) == 1
    assert med["probes 0.1 s"]["probes"] > med["base"]["probes"]


def test_answers_streamed_event_by_event_are_relayed_whole() -> None:
    """``--tokens 6 --token-gap-ms 1``: the fake Decode sends each event on its own, and
    the benchmark exits non-zero unless every answer reached the client with all 7."""
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--requests", "16", "--concurrency", "4", "--rounds", "1",
         "--config", "defaults", "--tokens", "6", "--token-gap-ms", "1", "--json"],
        check=True, capture_output=True, text=True, timeout=300)
    med = json.loads(out.stdout.strip().splitlines()[-1])["medians"]["defaults"]
    assert med["cpu_us_per_request"] > 0
    assert med["latency_p50_ms"] >= 7 * 1.0  # seven events, each after a 1 ms pause
