"""Smoke run of ``benchmarks/serving_vs_peers.py`` with rd2h as the connector (vLLM's
NixlConnector needs the optional ``bench`` extra, which CI does not install; its proxy
is tested in ``tests/integration/test_peer_proxy.py``): the plain engine alone, then
Prefill + Decode with rd2h behind ``rd2h proxy``, on the tiny Llama, chunked prefill in
128-token steps so that a 256-token prompt is two chunks.

Asserts what the script decides its exit status on (every request completed with the
plain engine's text, nothing pending, no error-level line), that each figure exists,
and that the pull overlap was measured from the engines' stamps: some of each
request's bytes were read before Prefill's last layer was ready (its first chunk's
layers at least). Never speed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from servers import log_tail, run_script

pytestmark = [pytest.mark.integration, pytest.mark.timeout(480)]

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "serving_vs_peers.py"
DEADLINE_S = 400.0
CASES = ((64, 1, 2), (256, 2, 4))


def test_serving_vs_peers_smoke(tmp_path) -> None:
    out, log = tmp_path / "result.json", tmp_path / "bench.out"
    cmd = [sys.executable, str(SCRIPT), "--connectors", "rd2h", "--model", "tiny",
           "--cases", ",".join(f"{n}x{c}:{p}" for n, c, p in CASES), "--rounds", "1",
           "--chunk", "128", "--output-len", "4", "--eager", "--workdir",
           str(tmp_path / "work"), "--json", str(out), "--startup-timeout", "240",
           "--run-timeout", "120"]
    rc = run_script(cmd, log, DEADLINE_S)
    assert rc == 0, log_tail(log)
    report = json.loads(out.read_text())
    printed = log.read_text(errors="replace")
    assert report["ok"] is True, printed[-4000:]
    assert [(r["target"], r["round"]) for r in report["rounds"]] == [("plain", 0), ("rd2h", 0)]
    assert all(r["error"] is None for r in report["rounds"])
    rows = report["summary"]["cases"]
    assert [(r["input_len"], r["concurrency"]) for r in rows] == [(n, c) for n, c, _ in CASES]
    for row, (_, _, prompts) in zip(rows, CASES):
        for name in ("plain", "rd2h"):
            t = row["targets"][name]
            assert t["runs"] == 1 and t["completed"] == prompts and t["failed"] == 0, t
            assert t["outputs_equal"] == t["outputs_total"] == prompts, t
            for key in ("req_s", "ttft_p50_ms", "ttft_p99_ms"):
                assert t[key]["median"] > 0, (name, key, t[key])
        rd = row["targets"]["rd2h"]
        assert rd["pending"] == [0] and rd["error_lines"] == 0
        share = rd["pull_before_last_p50"]["median"]
        assert 0 <= share < 1, rd  # the last layer is read after it was announced
        assert row["kv_mib_per_request"] > 0
        # CPU by thread: the engine core's main thread (named by py-spy) did the work
        threads = rd["thread_cpu_ms_per_request"]
        assert set(threads) == {"prefill", "decode", "proxy"}, threads
        assert threads["decode"]["core MainThread"] > 0, threads
        assert threads["proxy"]["api MainThread"] > 0, threads
    # Two (or more) chunks: the first chunk's layers, half of the bytes, were read
    # while a later chunk was computed.
    assert rows[1]["targets"]["rd2h"]["pull_before_last_p50"]["median"] >= 0.5, rows[1]
    idle = report["summary"]["idle_cores"]
    assert set(idle["rd2h"]) == {"rd2h prefill", "rd2h decode"}
    assert set(idle["plain"]) == {"plain engine"}
    assert "== 256 prompt tokens x concurrency 2" in printed
    assert "rd2h pull before Prefill's last layer" in printed
    assert "decode by thread: core MainThread" in printed
