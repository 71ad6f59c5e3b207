"""Smoke run of ``benchmarks/serving_vs_plain.py``: a plain engine, Prefill + Decode with
``SfaRemoteD2HConnector`` (cma) behind ``rd2h proxy``, both driven by vLLM's own serving
benchmark on the tiny Llama with its word tokenizer.

The script starts its own three engines (the benchmark needs a tokenizer, which the
session's engines skip), so this module does nothing else. It asserts what the script
decides its exit status on (every request completed, outputs equal per prompt, nothing
pending, no error-level log line) and that the printed figures exist; never speed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from servers import log_tail, run_script

pytestmark = [pytest.mark.integration, pytest.mark.timeout(480)]

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "serving_vs_plain.py"
DEADLINE_S = 360.0
NUM_PROMPTS = 8
OUTPUT_LEN = 8
FIGURES = ("request_throughput", "output_throughput", "p50_ttft_ms", "p99_ttft_ms",
           "p50_tpot_ms", "p50_e2el_ms")


def test_serving_benchmark_smoke(tmp_path):
    out = tmp_path / "result.json"
    log = tmp_path / "bench.out"
    cmd = [sys.executable, str(SCRIPT), "--concurrency", "1,4", "--num-prompts",
           str(NUM_PROMPTS), "--input-len", "64", "--output-len", str(OUTPUT_LEN),
           "--workdir", str(tmp_path / "work"), "--json", str(out),
           "--startup-timeout", "240", "--run-timeout", "120", "--eager"]
    rc = run_script(cmd, log, DEADLINE_S)
    assert rc == 0, log_tail(log)
    report = json.loads(out.read_text())
    printed = log.read_text(errors="replace")
    assert report["ok"] is True and not report.get("error"), printed[-4000:]
    assert [r["concurrency"] for r in report["runs"]] == [1, 4]
    assert not any(report["error_lines_total"].values()), report["error_lines_total"]
    for run in report["runs"]:
        where = f"concurrency {run['concurrency']}"
        for side in ("plain", "pd"):
            fig = run[side]
            assert fig["completed"] == NUM_PROMPTS and fig["failed"] == 0, (where, fig)
            assert fig["output_lens"] == [OUTPUT_LEN], (where, side, fig["output_lens"])
            for key in FIGURES:
                assert fig[key] is not None and fig[key] > 0, (where, side, key, fig[key])
        assert run["outputs_equal"] == run["outputs_total"] == NUM_PROMPTS, (where, run)
        assert run["pending"] == 0, (where, run["pending"])
        assert not any(run["error_lines"].values()), (where, run["error_examples"])
        assert run["pd_vs_plain"]["request_throughput"] > 0
        # The breakdown covers exactly this run's P/D requests (the window of the run).
        timeline = run["timeline"]
        assert timeline["error"] is None, timeline
        assert timeline["json"]["requests"] == NUM_PROMPTS, timeline["text"]
        assert f"== concurrency {run['concurrency']}" in printed
    assert "P/D vs plain" in printed and "per-hop breakdown" in printed
