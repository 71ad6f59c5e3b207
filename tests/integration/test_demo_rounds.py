"""``rd2h demo --rounds`` and ``--layer-compute-ms`` on real processes: every round
pulls anew (new request ids, every byte verified) and is compared with the bare
replay of the same reads; the tail after the last layer is measured."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rd2h.demo import DemoConfig, run_demo, summary_text
from rd2h.demo.config import internal_id

pytestmark = pytest.mark.integration

SMALL = dict(layers=3, requests=3, prompt_tokens=700, block_size=64, chunks=2, timeout_s=180)


def test_rounds_pull_anew_and_compare_with_the_bare_transport() -> None:
    cfg = DemoConfig(prefill_tp=4, decode_tp=2, rounds=3, **SMALL)
    res = run_demo(cfg, progress=False)
    assert res.errors == [] and res.verified, res.errors
    assert res.requests_ok == 9 and res.mismatched_blocks == 0 and res.leaked_state == 0
    # Each round's requests are new requests (own ids), each verified on its own.
    assert set(res.outcomes) == {internal_id(r, k) for r in range(3) for k in range(3)}
    assert all(o["status"] == "ok" for o in res.outcomes.values())
    assert [r["order"] for r in res.rounds] == ["pipeline first", "bare first", "pipeline first"]
    for row in res.rounds:
        assert row["bytes"] == res.bytes > 0
        assert row["gbps"] > 0 and row["bare_gbps"] > 0
        assert row["ratio"] == pytest.approx(row["gbps"] / row["bare_gbps"])
    assert res.ratio_min <= res.ratio_median <= res.ratio_max
    assert res.raw_gbps is not None and res.memcpy_gbps > 0
    text = summary_text(res)
    assert "pipeline/bare ratio: median" in text and "ratio ceiling" in text
    assert "tail (" not in text  # every layer was ready at once: no tail to speak of


def test_layer_compute_delays_announcements_and_the_tail_is_reported() -> None:
    cfg = DemoConfig(prefill_tp=2, decode_tp=1, rounds=2, layer_compute_ms=10.0, **SMALL)
    res = run_demo(cfg, progress=False)
    assert res.verified, res.errors
    # Prefill spent 10 ms on each of 3 layers x 2 chunks before announcing it.
    assert all(r["seconds"] >= 0.06 for r in res.rounds)
    # One tail per request and round, from the last layer ready to complete everywhere.
    assert res.tail_ms_p50 is not None and 0 < res.tail_ms_p50 <= res.tail_ms_p99
    assert res.tail_ms_p99 < 60_000
    assert res.bare_layer_ms is not None and res.bare_layer_ms > 0
    assert res.layer_compute_ms == 10.0
    assert "tail (last layer ready" in summary_text(res)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rounds", "0"], "--rounds"),
        (["--rounds", "2", "--fault", "read-error@rate=0.5"], "--rounds > 1"),
        (["--rounds", "2", "--via-provider"], "--rounds > 1"),
        (["--layer-compute-ms", "-1"], "--layer-compute-ms"),
    ],
)
def test_cli_rejects_bad_round_settings(args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "rd2h", "demo", *args], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
