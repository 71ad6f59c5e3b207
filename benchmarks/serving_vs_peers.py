"""rd2h against vLLM's own KV connectors on the same engines, next to a plain engine,
at prompt lengths where layer-wise pulling matters; driven by vLLM's serving benchmark.

Each *round* serves one target at a time, with nothing else alive: the plain engine
alone; Prefill + Decode with rd2h (``SfaRemoteD2HConnector`` over cma) behind
``rd2h proxy``; Prefill + Decode with vLLM's ``NixlConnector`` (``kv_buffer_device``
cpu, UCX) behind ``nixl_proxy.py`` (Prefill first with ``do_remote_decode`` and one
token, then Decode with the returned ``kv_transfer_params``). Every target gets the same
model, engine flags and environment. Rounds interleave the targets and reverse their
order every other round (plain, rd2h, nixl, nixl, rd2h, plain, ...) so that drift hits
all of them; figures are medians over rounds with their spread.

Per target and round: start, warm up (unrecorded prompts at every length), measure the
idle CPU of every process group over 5 s, then run each case (prompt length x
concurrency: random prompts, ``--ignore-eos``, greedy, the same seed, so the same
prompts for every target), record TTFT p50/p99 and throughput, check every generated
text against the plain engine's, the proxy's pending requests and error-level log
lines, the CPU each process group (an engine with its engine core, the proxy) spent
per completed request, and the same split by thread (``/proc`` per task, named by py-spy as
Python names them: vLLM's engine-core and API threads, rd2h's ``rd2h-decode`` and
``rd2h-prefill-sender``, UCX's, gloo's); for rd2h, ``rd2h timeline``'s pull overlap: the
share of each request's bytes that Decode had read when Prefill's last layer of the
prompt was ready (``--no-timeline``: rd2h as deployed by default, without the timeline's
per-request stamps, and no overlap figure).

The default model is the KV-heavy tiny Llama (``rd2h.demo.tiny_model.KV_HEAVY``: 16 KiB
of float32 KV per token, 64 MiB at 4,096 tokens), chunked prefill in 1,024-token steps,
prefix caching off (a repeated prompt must not skip its prefill).

``nixl-tuned`` is NixlConnector with its two CPU handicaps on this host switched off by
benchmark-only shims (``benchmarks/nixl_tuned/sitecustomize.py``: the worker's
``os.sched_setaffinity`` call suppressed, the agent without a UCX progress thread); each
engine's log says when a shim acted.

Run:  .venv/bin/python benchmarks/serving_vs_peers.py [--connectors rd2h,nixl-tuned]
      [--cases 128x8:64,512x1:8,...] [--rounds 2] [--json OUT]
NIXL needs the ``bench`` extra (``pip install -e '.[bench]'``).
Exit status 0 when every request of every run completed with the plain engine's text,
nothing was left pending and no log line is at error level; targets never decide it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving_support as sp
import serving_vs_plain as svp

from rd2h.demo.tiny_model import (
    KV_HEAVY,
    kv_bytes_per_token,
    make_kv_heavy_llama,
    make_tiny_llama,
    make_word_tokenizer,
)

DEFAULT_WORKDIR = Path("/tmp/rd2h-bench-peers")
DEFAULT_CASES = "128x8:64,512x1:8,512x4:8,2048x1:6,2048x4:8,4096x1:4,4096x4:8"
CONNECTORS = ("rd2h", "rd2h-parallel", "rd2h-parallel-httpx", "nixl", "nixl-tuned",
              "mooncake")
# rd2h-parallel: its proxy runs --dispatch parallel; rd2h-parallel-httpx: the same with
# the proxy's client to the engines on httpx (--upstream-sockets asyncio, the default
# before aiohttp's), to compare the two in one run.
RD2H = ("rd2h", "rd2h-parallel", "rd2h-parallel-httpx")
_PROXY_ARGS = {"rd2h": (), "rd2h-parallel": ("--dispatch", "parallel"),
               "rd2h-parallel-httpx": ("--dispatch", "parallel", "--upstream-sockets",
                                       "asyncio")}
THREAD_SHOWN_MS = 0.3  # threads below this CPU per request are left out of the printout
# nixl-tuned: NIXL with its two CPU handicaps here switched off by benchmark-only shims
# (``benchmarks/nixl_tuned/sitecustomize.py``, never rd2h): the worker's
# ``os.sched_setaffinity`` call suppressed and the agent without a UCX progress thread.
TUNED_SHIMS = Path(__file__).resolve().parent / "nixl_tuned"
T0 = time.monotonic()


def progress(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f} s] {msg}", flush=True)


def parse_cases(text: str) -> list[tuple[int, int, int]]:
    """``"LENxCONC[:PROMPTS],..."`` -> ``[(len, conc, prompts)]`` (prompts default 4 x C)."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        head, _, n = part.partition(":")
        length, _, conc = head.partition("x")
        try:
            case = (int(length), int(conc), int(n) if n else 4 * int(conc))
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad case {part!r}: want LENxCONC[:N]") from None
        if min(case) < 1:
            raise argparse.ArgumentTypeError(f"bad case {part!r}: every number must be > 0")
        out.append(case)
    if not out:
        raise argparse.ArgumentTypeError("no cases")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--connectors", default="rd2h,nixl-tuned",
                   help=f"comma-separated, from {', '.join(CONNECTORS)} (default: %(default)s)")
    p.add_argument("--cases", type=parse_cases, default=parse_cases(DEFAULT_CASES),
                   help="prompt tokens x concurrency [: prompts] (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every target")
    p.add_argument("--output-len", type=int, default=16, help="generated tokens (ignore_eos)")
    p.add_argument("--model", choices=["kv-heavy", "tiny"], default="kv-heavy",
                   help="kv-heavy: 8 layers x 4 KV heads, float32, 8,192 positions; "
                        "tiny: the 4-layer Llama of serving_vs_plain.py")
    p.add_argument("--chunk", type=int, default=1024,
                   help="--max-num-batched-tokens: chunked prefill's step (default: 1024)")
    p.add_argument("--kv-cache-gib", type=float, default=2.0,
                   help="VLLM_CPU_KVCACHE_SPACE per engine")
    p.add_argument("--engine-args", default="", help="extra vLLM arguments, every engine")
    p.add_argument("--eager", action="store_true", help="--enforce-eager on every engine")
    p.add_argument("--rd2h-options", type=json.loads, default={}, metavar="JSON",
                   help="extra kv_connector_extra_config keys for rd2h")
    p.add_argument("--nixl-options", type=json.loads, default={}, metavar="JSON",
                   help="extra kv_connector_extra_config keys for NixlConnector, e.g. "
                        "'{\"num_threads\": 1}'")
    p.add_argument("--nixl-env", action="append", default=[], metavar="K=V",
                   help="environment for the NIXL engines, e.g. UCX_TLS=sm,self "
                        "(repeat for more)")
    p.add_argument("--no-timeline", action="store_true",
                   help="run rd2h without its per-request timeline (as deployed by default; "
                   "the pull-overlap figure is then not printed)")
    p.add_argument("--skip-plain", action="store_true",
                   help="no plain-engine rounds (for sweeping a connector's settings; "
                        "outputs are then not compared)")
    p.add_argument("--warmup", type=int, default=1,
                   help="warm-up prompts per length = this x the length's top concurrency")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    p.add_argument("--json", type=Path, default=None, metavar="OUT")
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--run-timeout", type=float, default=1200.0)
    args = p.parse_args(argv)
    args.connectors = [c.strip() for c in args.connectors.split(",") if c.strip()]
    bad = [c for c in args.connectors if c not in CONNECTORS]
    if bad or not args.connectors:
        p.error(f"--connectors: unknown {bad}; choose from {', '.join(CONNECTORS)}")
    if args.rounds < 1 or args.output_len < 1 or args.chunk < 16:
        p.error("--rounds and --output-len must be positive, --chunk at least 16")
    try:
        args.nixl_env = dict(kv.split("=", 1) for kv in args.nixl_env)
    except ValueError:
        p.error("--nixl-env: want K=V")
    return args


# ---- the targets


def build_model(args) -> Path:
    model = args.workdir / ("model-kv-heavy" if args.model == "kv-heavy" else "model-tiny")
    if args.model == "kv-heavy":
        make_kv_heavy_llama(model)
        make_word_tokenizer(model, max_length=KV_HEAVY["max_positions"])
    else:
        make_tiny_llama(model)
        make_word_tokenizer(model)
    return model


def targets(args, model: Path, run: Path, name: str) -> dict[str, sp.Proc]:
    """The processes of one target (not started)."""
    longest = max(c[0] for c in args.cases)
    max_len = longest + args.output_len + 64
    extra = ["--max-num-batched-tokens", str(args.chunk), "--no-enable-prefix-caching"]
    extra += (["--enforce-eager"] if args.eager else []) + args.engine_args.split()
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": f"{args.kv_cache_gib:g}"}
    folder = run / name
    folder.mkdir(parents=True, exist_ok=True)

    def eng(role: str, kv: dict | None, more_env: dict | None = None) -> sp.Proc:
        return sp.engine(f"{name} {role}", model, folder / f"{role}.log",
                         max_model_len=max_len, kv=kv, extra_args=extra,
                         env={**env, **(more_env or {})})

    if name == "plain":
        return {"plain": eng("engine", None)}
    if name in RD2H:
        tl = {} if args.no_timeline else {"RD2H_TIMELINE_DIR": str(folder / "timeline")}
        port = sp.quiet_ports(4)
        procs = {"prefill": eng("prefill", sp.rd2h_kv("kv_producer", port, args.rd2h_options),
                                tl),
                 "decode": eng("decode", sp.rd2h_kv("kv_consumer", port, args.rd2h_options),
                               tl)}
        procs["proxy"] = sp.proxy(procs["prefill"], procs["decode"], folder / "proxy.log",
                                  tl, _PROXY_ARGS[name])
        return procs
    if name in ("nixl", "nixl-tuned"):
        shims = {} if name == "nixl" else {
            "RD2H_BENCH_NIXL_TUNED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, (str(TUNED_SHIMS),
                                                        os.environ.get("PYTHONPATH")))),
        }
        procs = {role: eng(role, sp.nixl_kv(args.nixl_options),
                           {**args.nixl_env, **shims,
                            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(sp.quiet_ports(2))})
                 for role in ("prefill", "decode")}
    else:  # mooncake
        procs = {role: eng(role, sp.mooncake_kv(f"kv_{kind}"))
                 for role, kind in (("prefill", "producer"), ("decode", "consumer"))}
    procs["proxy"] = sp.peer_proxy(procs["prefill"], procs["decode"], folder / "proxy.log")
    return procs


def front(procs: dict[str, sp.Proc]) -> sp.Proc:
    return procs.get("proxy") or procs["plain"]


# ---- one round of one target


def bench(args, url: str, model: Path, case, label: str, folder: Path, seed_offset=0):
    length, conc, prompts = case
    ns = SimpleNamespace(input_len=length, output_len=args.output_len,
                         num_prompts=prompts, run_timeout=args.run_timeout)
    return svp.run_bench(ns, url, model, conc, label, folder, prompts)


def warm_up(args, url: str, model: Path, folder: Path) -> None:
    """Unrecorded prompts at every length (prefix caching is off: the same prompts later
    are computed in full again)."""
    top: dict[int, int] = {}
    for length, conc, _ in args.cases:
        top[length] = max(top.get(length, 0), conc)
    for length, conc in sorted(top.items()):
        n = max(1, args.warmup * conc)
        bench(args, url, model, (length, conc, n), f"warmup-{length}", folder)


def one_round(args, model: Path, run: Path, name: str, rnd: int) -> dict[str, Any]:
    procs = targets(args, model, run / f"round{rnd}", name)
    folder = run / f"round{rnd}" / name
    out: dict[str, Any] = {"target": name, "round": rnd, "cases": [], "error": None}
    guardian = sp.Guardian()
    try:
        for p in procs.values():
            p.start()
            guardian.watch(p.proc.pid)
        sp.wait_all_ready(list(procs.values()), args.startup_timeout, progress)
        out["startup_s"] = {k: round(p.ready_s or 0, 1) for k, p in procs.items()}
        url = front(procs).url
        progress(f"round {rnd} {name}: warming up")
        warm_up(args, url, model, folder)
        time.sleep(1.0)
        engines = [p for k, p in procs.items() if k != "proxy"]
        out["idle_cores"] = sp.idle_cores(engines)
        progress(f"round {rnd} {name}: idle CPU per engine (cores) {out['idle_cores']}")
        for case in args.cases:
            offsets = {k: p.size() for k, p in procs.items()}
            label = f"{name}-L{case[0]}"
            progress(f"round {rnd} {name}: {case[0]} tokens x concurrency {case[1]} "
                     f"({case[2]} prompts)")
            groups = {k: p.proc.pid for k, p in procs.items() if p.proc is not None}
            cpu0 = {k: sp.group_cpu_s(g) for k, g in groups.items()}
            thr0 = {k: sp.group_thread_cpu_s(g) for k, g in groups.items()}
            result, t0, t1 = bench(args, url, model, case, label, folder)
            cpu = {k: sp.group_cpu_s(g) - cpu0[k] for k, g in groups.items()}
            thr1 = {k: sp.group_thread_cpu_s(g) for k, g in groups.items()}
            done = result.get("completed") or 0
            names = sp.python_thread_names({pid for t in thr1.values() for pid, _ in t})
            res = {"input_len": case[0], "concurrency": case[1], "prompts": case[2],
                   "figures": sp._figures(result, case[2]),
                   "texts": result.get("generated_texts") or [],
                   "error_lines": {k: p.error_lines(offsets[k]) for k, p in procs.items()},
                   "window": [t0, t1],
                   # CPU per completed request of each process group (an engine with its
                   # engine-core child, the proxy), over the benchmark's whole run
                   "cpu_ms_per_request": {
                       k: round(v * 1e3 / max(1, done), 2)
                       for k, v in cpu.items()},
                   # the same by the thread that spent it (Python thread names by py-spy)
                   "thread_cpu_ms_per_request": {
                       k: sp.thread_cpu_ms(thr0[k], thr1[k], names, done) for k in groups}}
            if "proxy" in procs:
                res["pending"] = svp.pending(procs["proxy"])
            if name in RD2H and not args.no_timeline:
                res["timeline"] = svp.timeline(folder, t0, t1)
            out["cases"].append(res)
    except (RuntimeError, TimeoutError, OSError) as e:
        out["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
        out["log_tail"] = {k: p.tail(15) for k, p in procs.items()}
        out["root_cause"] = root_cause(procs)
        progress(f"round {rnd} {name}: failed: {out['error']}"
                 + (f"; first error in the logs: {out['root_cause']}" if out["root_cause"]
                    else ""))
    finally:
        sp.stop_all(list(procs.values())[::-1])
        guardian.release()
    return out


def root_cause(procs: dict[str, sp.Proc]) -> str | None:
    """The first exception line in the targets' logs that is not vLLM's generic "Engine
    core initialization failed" (which only says that one happened)."""
    for p in procs.values():
        try:
            lines = p.log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for ln in lines:
            if " WARNING " in ln or " INFO " in ln:
                continue
            m = _EXC_LINE.search(ln)
            if m and "Engine core initialization failed" not in ln:
                return f"{p.name}: {m.group(0)[:300]}"
    return None


_EXC_LINE = re.compile(r"\b[A-Z]\w*(Error|Exception): .*")


# ---- figures


def _med(values: list[float]) -> dict[str, float] | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
            "n": len(vals)}


def summarize(args, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per case and target: medians and spread over rounds, texts against the plain
    engine's, and rd2h's pull overlap; then the issue's targets."""
    names = ([] if args.skip_plain else ["plain"]) + args.connectors
    plain_texts: dict[tuple[int, int], list[str]] = {}
    for r in rounds:
        if r["target"] == "plain":
            for c in r["cases"]:
                plain_texts.setdefault((c["input_len"], c["concurrency"]), c["texts"])
    cases = []
    for length, conc, prompts in args.cases:
        row: dict[str, Any] = {"input_len": length, "concurrency": conc, "prompts": prompts,
                               "kv_mib_per_request": None, "targets": {}}
        ref = plain_texts.get((length, conc))
        for name in names:
            runs = [c for r in rounds if r["target"] == name for c in r["cases"]
                    if (c["input_len"], c["concurrency"]) == (length, conc)]
            by_round = {r["round"]: c["figures"].get("request_throughput")
                        for r in rounds if r["target"] == name for c in r["cases"]
                        if (c["input_len"], c["concurrency"]) == (length, conc)}
            figs = [c["figures"] for c in runs]
            equal = sum(1 for c in runs for i, t in enumerate(c["texts"])
                        if (ref is None and args.skip_plain)
                        or (ref is not None and i < len(ref) and ref[i] == t))
            total = sum(len(c["texts"]) for c in runs)
            t: dict[str, Any] = {
                "runs": len(runs),
                "req_s": _med([f.get("request_throughput") for f in figs]),
                # Round -> req/s (rounds run every target back to back: pairs by round).
                "req_s_by_round": {k: v for k, v in by_round.items() if v is not None},
                "ttft_p50_ms": _med([f.get("p50_ttft_ms") for f in figs]),
                "ttft_p99_ms": _med([f.get("p99_ttft_ms") for f in figs]),
                "tpot_p50_ms": _med([f.get("p50_tpot_ms") for f in figs]),
                "completed": sum(f.get("completed") or 0 for f in figs),
                "failed": sum(f.get("failed") or 0 for f in figs),
                "outputs_equal": equal, "outputs_total": total,
                "pending": [c.get("pending") for c in runs if "pending" in c],
                "error_lines": sum(len(v) for c in runs for v in c["error_lines"].values()),
            }
            t["cpu_ms_per_request"] = _med_dict([c.get("cpu_ms_per_request") or {}
                                                 for c in runs])
            by_thread = [c.get("thread_cpu_ms_per_request") or {} for c in runs]
            t["thread_cpu_ms_per_request"] = {
                g: dict(sorted(_med_dict([b.get(g) or {} for b in by_thread]).items(),
                               key=lambda kv: -kv[1]))
                for g in sorted({g for b in by_thread for g in b})}
            overlaps = [(c.get("timeline") or {}).get("json") or {} for c in runs]
            overlaps = [o.get("pull_overlap") for o in overlaps if o.get("pull_overlap")]
            if overlaps:
                t["pull_before_last_p50"] = _med([o["before_last_p50"] for o in overlaps])
                t["pull_before_last_min"] = min(o["before_last_min"] for o in overlaps)
                t["pull_after_last_p50_ms"] = _med([o["after_last_p50_ms"] for o in overlaps])
                row["kv_mib_per_request"] = overlaps[0]["bytes_p50"] / 2**20
            row["targets"][name] = t
        cases.append(row)
    idle = {name: _med_dict([r.get("idle_cores") or {} for r in rounds
                             if r["target"] == name]) for name in names}
    return {"cases": cases, "idle_cores": idle, "verdicts": verdicts(cases)}


def _med_dict(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for d in dicts for k in d})
    return {k: statistics.median([d[k] for d in dicts if k in d]) for k in keys}


def _m(t: dict[str, Any], key: str) -> float | None:
    v = t.get(key)
    return None if v is None else v["median"]


def verdicts(cases: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, one line each, from the medians (reported, never enforced)."""
    lines = []
    for row in cases:
        tg = row["targets"]
        rd, nx, plain = tg.get("rd2h"), tg.get("nixl"), tg.get("plain")
        where = f"{row['input_len']} tokens x c{row['concurrency']}"
        if rd and nx and plain and _m(plain, "ttft_p50_ms") is not None:
            p = _m(plain, "ttft_p50_ms")
            a, b = _m(rd, "ttft_p50_ms"), _m(nx, "ttft_p50_ms")
            ra, rb = _m(rd, "req_s"), _m(nx, "req_s")
            if None not in (a, b, ra, rb):
                short = row["input_len"] <= 128
                want = 1.1 if short else 1.0
                lines.append(
                    f"{where}: TTFT p50 above plain rd2h {a - p:+.0f} ms vs NIXL {b - p:+.0f} "
                    f"ms ({'met' if a - p <= b - p else 'NOT met'}); req/s rd2h {ra:.2f} vs "
                    f"NIXL {rb:.2f} = {ra / rb:.2f}x "
                    f"({'met' if ra >= want * rb else 'NOT met'}, target {want:g}x)")
        tuned = tg.get("nixl-tuned")
        for mine in RD2H:  # issue #43: against the best NIXL can do here
            rd = tg.get(mine)
            if not (rd and tuned):
                continue
            ra, rb = _m(rd, "req_s"), _m(tuned, "req_s")
            a99, b99 = _m(rd, "ttft_p99_ms"), _m(tuned, "ttft_p99_ms")
            a50, b50 = _m(rd, "ttft_p50_ms"), _m(tuned, "ttft_p50_ms")
            if None not in (ra, rb, a99, b99, a50, b50):
                if row["concurrency"] >= 8:
                    lines.append(
                        f"{where} {mine} vs NIXL tuned: req/s {ra:.2f} vs {rb:.2f} = "
                        f"{ra / rb:.2f}x "
                        f"({'met' if ra >= 1.1 * rb else 'NOT met'}, target 1.1x); TTFT p99 "
                        f"{a99:.0f} vs {b99:.0f} ms ({'met' if a99 <= b99 else 'NOT met'})"
                        + _per_round(rd, tuned))
                if row["concurrency"] == 1:
                    lines.append(f"{where} {mine} vs NIXL tuned: TTFT p50 {a50:.1f} vs "
                                 f"{b50:.1f} ms "
                                 f"({'met' if a50 <= b50 else 'NOT met'})")
        rd = tg.get("rd2h")
        if rd and "pull_before_last_p50" in rd and row["input_len"] >= 2048:
            v = rd["pull_before_last_p50"]["median"]
            lines.append(f"{where}: rd2h read {v:.1%} of a request's bytes (p50; min "
                         f"{rd['pull_before_last_min']:.1%}) before Prefill's last layer "
                         f"was ready ({'met' if v >= 0.9 else 'NOT met'}, target 90%)")
    return lines


def _per_round(a: dict[str, Any], b: dict[str, Any]) -> str:
    """``a``'s req/s over ``b``'s in each round both ran (the spread the median hides)."""
    ra, rb = a.get("req_s_by_round") or {}, b.get("req_s_by_round") or {}
    ratios = [ra[k] / rb[k] for k in sorted(set(ra) & set(rb)) if rb[k]]
    if len(ratios) < 2:
        return ""
    return (f"; per round {', '.join(f'{x:.2f}' for x in ratios)} (median "
            f"{statistics.median(ratios):.2f}x)")


def _fmt(v: dict[str, float] | None, f: str = "{:.1f}") -> str:
    if v is None:
        return "-"
    return f"{f.format(v['median'])} ({f.format(v['min'])}-{f.format(v['max'])})"


def render(summary: dict[str, Any]) -> str:
    lines = []
    for row in summary["cases"]:
        kv = row["kv_mib_per_request"]
        lines.append(f"\n== {row['input_len']} prompt tokens x concurrency "
                     f"{row['concurrency']} ({row['prompts']} prompts per run"
                     + (f"; {kv:.1f} MiB of KV per request" if kv else "") + ")")
        lines.append(f"{'target':14}{'req/s med (min-max)':>24}{'TTFT p50 ms':>24}"
                     f"{'TTFT p99 ms':>24}{'p50-plain':>11}{'equal':>10}{'failed':>8}")
        plain = row["targets"].get("plain") or {}
        p50 = _m(plain, "ttft_p50_ms") if plain else None
        for name, t in row["targets"].items():
            above = _m(t, "ttft_p50_ms")
            diff = "-" if above is None or p50 is None or name == "plain" else \
                f"{above - p50:+.0f}"
            lines.append(f"{name:14}{_fmt(t['req_s'], '{:.2f}'):>24}"
                         f"{_fmt(t['ttft_p50_ms'], '{:.0f}'):>24}"
                         f"{_fmt(t['ttft_p99_ms'], '{:.0f}'):>24}{diff:>11}"
                         f"{t['outputs_equal']:>6}/{t['outputs_total']:<3}{t['failed']:>8}")
            if t.get("cpu_ms_per_request"):
                cpu = t["cpu_ms_per_request"]
                lines.append(f"{'':14}CPU ms per request (median): "
                             + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items())
                             + f"; all {sum(cpu.values()):.1f}")
            for group, threads in (t.get("thread_cpu_ms_per_request") or {}).items():
                top = [(k, v) for k, v in threads.items() if v >= THREAD_SHOWN_MS]
                if top:
                    lines.append(f"{'':16}{group} by thread: "
                                 + ", ".join(f"{k} {v:.1f}" for k, v in top))
            if "pull_before_last_p50" in t:
                lines.append(f"{'':14}rd2h pull before Prefill's last layer: p50 "
                             f"{_fmt(t['pull_before_last_p50'], '{:.3f}')} of the bytes, "
                             f"min {t['pull_before_last_min']:.3f}; pull after it p50 "
                             f"{_fmt(t['pull_after_last_p50_ms'])} ms")
    lines.append("\n== idle CPU per engine (cores, median over rounds)")
    for name, d in summary["idle_cores"].items():
        # The keys already name the target ("rd2h-parallel decode").
        lines.append("- " + (", ".join(f"{k}: {v:.3f}" for k, v in d.items()) or name))
    lines.append("\n== targets (issues #24 and #43; reported, never enforced)")
    lines += [f"- {v}" for v in summary["verdicts"]] or ["- (no rd2h and nixl pair)"]
    return "\n".join(lines)


def passed(args, rounds: list[dict[str, Any]], summary: dict[str, Any]) -> bool:
    for r in rounds:
        if r["error"] and r["target"] != "mooncake":
            return False
    for row in summary["cases"]:
        for name, t in row["targets"].items():
            if name == "mooncake" and not t["runs"]:
                continue
            if (t["runs"] < args.rounds or t["failed"] or t["error_lines"]
                    or t["completed"] != t["runs"] * row["prompts"]
                    or t["outputs_equal"] != t["outputs_total"]
                    or any(p != 0 for p in t["pending"])):
                return False
    return True


def order(args) -> list[tuple[int, str]]:
    """plain, rd2h, nixl, then nixl, rd2h, plain, ...: each target's rounds spread over
    the run, so slow drift of the machine lands on all of them alike."""
    names = ([] if args.skip_plain else ["plain"]) + args.connectors
    out = []
    for rnd in range(args.rounds):
        out += [(rnd, n) for n in (names if rnd % 2 == 0 else names[::-1])]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # this process: the client only
    args.workdir.mkdir(parents=True, exist_ok=True)
    run = args.workdir / time.strftime("run-%Y%m%d-%H%M%S")
    run.mkdir()
    progress(f"building the {args.model} Llama and its word tokenizer under {args.workdir}"
             + (f" ({kv_bytes_per_token() / 1024:.0f} KiB of KV per token)"
                if args.model == "kv-heavy" else ""))
    model = build_model(args)
    sp.wait_for_memory(4.0, 600.0, progress)

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    rounds: list[dict[str, Any]] = []
    report: dict[str, Any] = {"config": {k: (str(v) if isinstance(v, Path) else v)
                                         for k, v in vars(args).items()}, "rounds": rounds}
    try:
        for rnd, name in order(args):
            progress(f"round {rnd}: {name}")
            rounds.append(one_round(args, model, run, name, rnd))
    except KeyboardInterrupt as e:
        progress(f"interrupted ({e or 'Ctrl-C'})")
        report["error"] = f"interrupted: {e}"
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    summary = summarize(args, rounds)
    report["summary"] = summary
    print(render(summary), flush=True)
    for r in rounds:
        if r["error"]:
            print(f"\nround {r['round']} {r['target']} failed: {r['error']}")
            if r.get("root_cause"):
                print(f"first error in the logs: {r['root_cause']}")
            for k, tail in (r.get("log_tail") or {}).items():
                print(f"-- {k} log tail\n{tail}")
    ok = passed(args, rounds, summary) and not report.get("error")
    # A target that failed to start (mooncake) keeps the run folder with its logs.
    keep = args.keep_logs or any(r["error"] for r in rounds)
    return svp.finish(report, run, ok, args.json, keep, progress)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (nanobind's leak warnings at exit)
