"""Smoke run of ``benchmarks/proxy_policies.py``: one Prefill and two Decode engines
behind one proxy per picking policy, a throttled Decode, two-turn conversations.

The script starts its own engines, so this module does nothing else. It asserts what
the script decides its exit status on (every request answered, outputs equal to the
plain engine's) and that the figures exist; never speed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from servers import log_tail, run_script

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "proxy_policies.py"


def test_proxy_policies_benchmark_smoke(tmp_path):
    out = tmp_path / "result.json"
    log = tmp_path / "bench.out"
    cmd = [sys.executable, str(SCRIPT), "--requests", "8", "--concurrency", "4",
           "--rounds", "1", "--conversations", "2", "--max-tokens", "8",
           "--workdir", str(tmp_path / "work"), "--json", str(out),
           "--startup-timeout", "300"]
    rc = run_script(cmd, log, 540.0)
    printed = log.read_text(errors="replace")
    assert rc == 0, log_tail(log)
    report = json.loads(out.read_text())
    assert report["ok"] is True
    for policy in ("least_outstanding", "power_of_two", "round_robin"):
        [run] = report["skew"][policy]
        assert run["failed"] == 0 and run["equal"] == 8, run
        assert sum(run["per_decode"]) == 8 and run["req_s"] > 0, run
        assert run["ttft_p99"] > 0
    for kind in ("affinity", "round_robin"):
        r = report["affinity"][kind]
        assert r["equal"] == r["total"] == 4 and len(r["fractions"]) == 2, r
    assert "== skewed pair" in printed and "== two-turn conversations" in printed
