"""``benchmarks/serving_vs_peers.py``'s summary: medians over rounds, and the #43 verdict
with rd2h's throughput over the tuned NIXL's in each round the two ran back to back."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _module():
    saved = list(sys.path)  # the script puts its own folders on the path
    sys.path.insert(0, str(BENCH))
    try:
        import serving_vs_peers
    finally:
        sys.path[:] = saved
    return serving_vs_peers


def _round(k: int, target: str, req_s: float, p99: float) -> dict:
    figures = {"request_throughput": req_s, "p50_ttft_ms": p99 / 2, "p99_ttft_ms": p99,
               "p50_tpot_ms": 5.0, "completed": 4, "failed": 0}
    case = {"input_len": 128, "concurrency": 8, "figures": figures, "texts": ["a"] * 4,
            "error_lines": {}, "idle": None}
    return {"round": k, "target": target, "cases": [case], "error": None,
            "idle_cores": {f"{target} decode": 0.01 * (k + 1)}}


def test_the_c8_verdict_gives_each_rounds_ratio_beside_the_ratio_of_medians() -> None:
    svp = _module()
    args = SimpleNamespace(skip_plain=True, connectors=["rd2h-parallel", "nixl-tuned"],
                           cases=[(128, 8, 4)])
    rd, nx = [30.0, 27.0, 33.0, 24.0], [25.0, 30.0, 30.0, 24.0]
    rounds = [r for k in range(4) for r in (_round(k, "rd2h-parallel", rd[k], 200),
                                            _round(k, "nixl-tuned", nx[k], 210))]
    rounds.pop()  # NIXL's last round is missing: only rounds both ran are paired
    summary = svp.summarize(args, rounds)
    [line] = [v for v in summary["verdicts"] if "c8 rd2h-parallel" in v]
    # Medians: rd2h 28.50 (4 rounds), NIXL 30.00 (3): 0.95x; rounds 1.20, 0.90, 1.10.
    assert "req/s 28.50 vs 30.00 = 0.95x (NOT met, target 1.1x)" in line, line
    assert line.endswith("per round 1.20, 0.90, 1.10 (median 1.10x)"), line
    text = svp.render(summary)
    assert "- rd2h-parallel decode: 0.025" in text, text
    assert "rd2h-parallelrd2h-parallel" not in text
