"""The pull pipeline against the bare transport, A/B, in the same processes.

Each case is one ``rd2h demo`` run with ``--rounds R`` (default 6): every round pulls every
request anew through the whole pipeline (ZeroMQ announcements, planning, one batched
read per layer and contributor, replies, the gloo completion exchange; every byte
verified) and replays round 0's reads on the bare transport with every Decode rank
starting together; the order alternates per round (pipeline first, bare first, ...).
A ratio compares two measurements taken moments apart, so a noisy neighbour moves both.
An in-process memcpy of the same size is the ceiling. Rates are in 10^9 bytes/s.

Each round also reports the CPU both sides spent per byte moved, counting the same
processes (every thread of every Decode and Prefill rank; Prefill idles during a
replay) and its pipeline/bare ratio, per round and as a median (issue #24: <= 1.25).

Cases (``--case`` to pick; all by default):
  defaults   4 Prefill -> 2 Decode ranks, 8 layers x 8 requests x 8000 tokens, cma
             target: pipeline >= 0.8x bare in every round
  long       the same at 16 requests x 16384 tokens; target: median >= 0.9x
  overlap    defaults with --layer-compute-ms 20 (each Prefill rank spends 20 ms per
             layer, host idle); target: tail p50 <= 1.5x the bare read of that layer
             (tail: last layer ready on Prefill -> request complete on every Decode rank)
  mooncake   Mooncake Transfer Engine over TCP, 2 Prefill -> 1 Decode rank;
             target: median >= 0.9x

Run:  .venv/bin/python benchmarks/pipeline_vs_bare.py [--rounds R] [--case NAME ...]
      [--json]
Figures are only reported: the exit status is 1 only when a run did not verify
(a wrong byte, a failed or hung request, leaked state), never because of a target.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rd2h.demo.config import DemoConfig
from rd2h.demo.report import DemoResult
from rd2h.demo.run import run_demo

CASES: dict[str, tuple[DemoConfig, str]] = {
    "defaults": (DemoConfig(), "every round >= 0.8x"),
    "long": (DemoConfig(requests=16, prompt_tokens=16384), "median >= 0.9x"),
    "overlap": (DemoConfig(layer_compute_ms=20.0), "tail p50 <= 1.5x bare layer"),
    "mooncake": (DemoConfig(transport="mooncake", prefill_tp=2, decode_tp=1),
                 "median >= 0.9x"),
}


def _met(case: str, res: DemoResult) -> bool | None:
    if case == "overlap":
        if res.tail_ms_p50 is None or not res.bare_layer_ms:
            return None
        return res.tail_ms_p50 <= 1.5 * res.bare_layer_ms
    ratios = [r["ratio"] for r in res.rounds if "ratio" in r]
    if not ratios:
        return None
    if case == "defaults":
        return min(ratios) >= 0.8
    return (res.ratio_median or 0.0) >= 0.9


def _mooncake_available() -> str | None:
    try:
        import mooncake.engine  # noqa: F401
    except Exception as exc:  # the wheel or libibverbs missing
        return f"{type(exc).__name__}: {exc}"
    return None


def _fmt(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _print_case(case: str, res: DemoResult, target: str, met: bool | None) -> None:
    print(f"\n== {case}: P TP {res.prefill_tp} -> D TP {res.decode_tp} over {res.transport}, "
          f"{res.layers} layers x {res.requests} requests x {res.prompt_tokens} tokens, "
          f"{res.bytes / 2**20:.1f} MiB per round"
          + (f", {res.layer_compute_ms:g} ms compute per layer" if res.layer_compute_ms else ""))
    print("  round  order           pipeline s  pipeline GB/s  bare s  bare GB/s  ratio  "
          "CPU/byte pipeline/bare")
    for r in res.rounds:
        print(f"  {r['round']:5d}  {r['order']:14s}  {_fmt(r.get('seconds'), 3):>10s}  "
              f"{_fmt(r.get('gbps')):>13s}  {_fmt(r.get('bare_seconds'), 3):>6s}  "
              f"{_fmt(r.get('bare_gbps')):>9s}  {_fmt(r.get('ratio')):>5s}  "
              f"{_fmt(r.get('cpu_per_byte', {}).get('ratio')):>22s}")
    print(f"  median: pipeline {_fmt(res.gbps)} GB/s, bare {_fmt(res.raw_gbps)} GB/s, "
          f"memcpy ceiling {_fmt(res.memcpy_gbps)} GB/s; ratio median "
          f"{_fmt(res.ratio_median)} (min {_fmt(res.ratio_min)}, max {_fmt(res.ratio_max)})")
    if res.cpu.get("pipeline"):
        c = res.cpu
        print(f"  CPU per round, all ranks and threads (median): pipeline "
              f"{c['pipeline'] * 1e3:.0f} ms = Decode user {c['decode_user'] * 1e3:.0f} + "
              f"Decode kernel {c['decode_sys'] * 1e3:.0f} + Prefill {c['prefill'] * 1e3:.0f}"
              + (f"; bare {c['bare'] * 1e3:.0f} ms" if "bare" in c else "")
              + (f" (Prefill idle {c['bare_prefill'] * 1e3:.1f})" if "bare_prefill" in c else "")
              + f"; {res.cores} core(s): the CPU spent allows a ratio of at most "
              f"{_fmt(res.cpu_ratio_ceiling)}")
    if res.cpu_per_byte.get("ratio"):
        c = res.cpu_per_byte
        print(f"  CPU per byte moved (median): pipeline {c['pipeline']:.3f} ns, bare "
              f"{c['bare']:.3f} ns (Prefill's idle CPU during the replay included); "
              f"pipeline/bare {_fmt(c['ratio'])} (target <= 1.25)")
    if res.layer_compute_ms:
        tail_x = (res.tail_ms_p50 / res.bare_layer_ms if res.tail_ms_p50 is not None
                  and res.bare_layer_ms else None)
        print(f"  tail: p50 {_fmt(res.tail_ms_p50)} ms, p99 {_fmt(res.tail_ms_p99)} ms; bare "
              f"read of that layer {_fmt(res.bare_layer_ms)} ms (p50 {_fmt(tail_x)}x); "
              f"layer ack p50 {_fmt(res.layer_ack_p50_ms)} ms")
    verdict = {True: "met", False: "NOT met", None: "not measured"}[met]
    print(f"  target ({target}): {verdict}; verified: {'yes' if res.verified else 'NO'}")
    for e in res.errors[:5]:
        print(f"  error: {e.splitlines()[0]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6,
                    help="A/B rounds per case (default 6: as many of each order)")
    ap.add_argument("--case", action="append", choices=sorted(CASES),
                    help="run only this case (repeatable)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--layers-per-frame", type=int, default=64, metavar="N",
                    help="layer runs: at most N layers per READ_READY_BATCH (1: one layer "
                    "per frame; default 64)")
    args = ap.parse_args(argv)
    out: dict[str, Any] = {}
    failed = False
    for case in args.case or list(CASES):
        cfg, target = CASES[case]
        if cfg.transport == "mooncake" and (why := _mooncake_available()):
            out[case] = {"skipped": f"Mooncake is not importable here ({why})"}
            if not args.json:
                print(f"\n== {case}: skipped, Mooncake is not importable here ({why})")
            continue
        res = run_demo(replace(cfg, rounds=args.rounds,
                               max_layers_per_frame=args.layers_per_frame), progress=False)
        met = _met(case, res)
        failed |= not res.verified
        row = {k: v for k, v in asdict(res).items() if k not in ("outcomes", "deadlines")}
        out[case] = {"target": target, "met": met, "result": row}
        if not args.json:
            _print_case(case, res, target, met)
    if args.json:
        print(json.dumps(out, sort_keys=True))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
