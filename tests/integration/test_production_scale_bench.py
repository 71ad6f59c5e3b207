"""The production-scale control-plane benchmark's smoke run (``--smoke``: 4 layers, 4K-token
prompts, two Prefill instances of 4 contributors): it runs end to end over real ZeroMQ
and processes, every announcement is answered READ_DONE, and its figures add up. No
figure is judged against a time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "production_scale.py"


def test_smoke_run_completes_and_counts_every_message() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--repeat", "1", "--json"],
                         check=True, capture_output=True, text=True, timeout=300)
    res = json.loads(out.stdout)["smoke"]["new"]
    d, p, case = res["decode"], res["prefill"], res["case"]
    chunks = -(-case["prompt"] // case["chunk"])
    per_request = 4 * case["layers"] * chunks  # 4 contributors x layers x chunks
    assert d["messages"] == per_request * case["fan_in"] * case["per_instance"]
    assert d["replies"] == d["layers_done"] == d["messages"]
    assert d["replies_failed"] == d["layers_failed"] == 0
    assert d["messages_per_request"] == per_request
    # Decode rank 0 of 4 reads a quarter of main (member 0) and the whole indexer + scale
    # (split over the members): per request and layer.
    blocks = -(-case["prompt"] // 128)
    per_layer = (blocks // 4) * (128 + 16) * 1024 + blocks * (16 * 1024 + 512)
    assert d["kv_bytes_per_request"] == per_layer * case["layers"]
    for key in ("loop_us_per_message", "process_us_per_message", "announcements_per_s",
                "peak_rss_mib"):
        assert d[key] > 0, key
    assert p["decode_layers_done"] == p["layers"] == case["layers"] * chunks
    assert p["decode_layers_failed"] == 0 and p["sender_thread_us_per_layer"] > 0
