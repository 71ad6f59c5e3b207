"""What pulling new requests' KV costs the requests a Decode engine is already decoding:
inter-token latency (ITL) with and without incoming pulls, rd2h and vLLM's NixlConnector.

Per connector (each with nothing else alive): Prefill, Decode and the proxy start (rd2h:
``rd2h proxy``; NIXL: ``nixl_proxy.py``), Prefill and the proxies pinned to core 0 and
Decode to core 1 with ``taskset``, so Prefill's own compute is held out of Decode's
figures and what is measured is what the connector costs the Decode process. Then two
phases, each with ``--running`` streamed requests (short prompts, ``--output`` tokens,
ignore-eos, greedy) decoding on Decode:

- ``alone``: nothing else arrives;
- ``pulls``: meanwhile new requests with ``--prompt``-token prompts arrive back to back
  (one at a time, 2 output tokens), so Decode pulls their KV while it decodes.

ITL = the gap between consecutive streamed tokens of the running requests, over the
window in which every one of them is past its first ``--skip`` tokens and before the
first ends; p50 / p99 per phase, and pulls / alone. The default model is the KV-heavy
tiny Llama (16 KiB of float32 KV per token: 32 MiB per 2,048-token prompt).

Run:  .venv/bin/python benchmarks/itl_under_pulls.py [--connectors rd2h,nixl]
      [--running 4] [--prompt 2048] [--output 400] [--json OUT]
NIXL needs the ``bench`` extra (``pip install -e '.[bench]'``). Figures are only
reported; the exit status is 1 only when a request failed.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving_support as sp

from rd2h.demo.tiny_model import KV_HEAVY, make_kv_heavy_llama, make_word_tokenizer

WORKDIR = Path("/tmp/rd2h-bench-itl")


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pinned(proc: sp.Proc, core: int) -> sp.Proc:
    proc.cmd = ["taskset", "-c", str(core), *proc.cmd]
    return proc


def start_target(name: str, model: Path, folder: Path, max_len: int,
                 rd2h_src: str | None = None) -> dict[str, sp.Proc]:
    folder.mkdir(parents=True, exist_ok=True)
    extra = ["--no-enable-prefix-caching", "--max-num-batched-tokens", "2048"]
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}
    if rd2h_src is not None:  # another tree's rd2h (e.g. a worktree of an older commit)
        env["PYTHONPATH"] = rd2h_src

    def eng(role: str, kv: dict, more: dict | None = None) -> sp.Proc:
        return sp.engine(f"{name} {role}", model, folder / f"{role}.log", max_model_len=max_len,
                         kv=kv, extra_args=extra, env={**env, **(more or {})})

    if name in ("rd2h", "rd2h-baseline"):
        port = sp.quiet_ports(4)
        procs = {"prefill": pinned(eng("prefill", sp.rd2h_kv("kv_producer", port)), 0),
                 "decode": pinned(eng("decode", sp.rd2h_kv("kv_consumer", port)), 1)}
        procs["proxy"] = pinned(sp.proxy(procs["prefill"], procs["decode"],
                                         folder / "proxy.log",
                                         {"PYTHONPATH": rd2h_src} if rd2h_src else {}), 0)
    else:
        def side(role: str, core: int) -> sp.Proc:  # NIXL as shipped; a side channel each
            port = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(sp.quiet_ports(2))}
            return pinned(eng(role, sp.nixl_kv(), port), core)

        procs = {"prefill": side("prefill", 0), "decode": side("decode", 1)}
        procs["proxy"] = pinned(sp.peer_proxy(procs["prefill"], procs["decode"],
                                              folder / "proxy.log"), 0)
    for p in procs.values():
        p.start()
    try:
        sp.wait_all_ready(list(procs.values()), 600, progress)
    except BaseException:
        sp.stop_all(list(procs.values())[::-1])
        raise
    return procs


def stream(port: int, model: str, prompt: str, max_tokens: int, stamps: list[float],
           errors: list[str]) -> None:
    """One streamed completion; appends the arrival time of every token chunk."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True})
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            errors.append(f"HTTP {resp.status}: {resp.read()[:200]!r}")
            return
        while True:
            line = resp.readline()
            if not line:
                break
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                stamps.append(time.monotonic())
        conn.close()
    except OSError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")


def words(n: int, seed: int) -> str:
    return " ".join(f"w{(seed * 7919 + i * 104729) % 997}" for i in range(n))


def phase(port: int, model: str, args: argparse.Namespace, pulls: bool) -> dict[str, Any]:
    errors: list[str] = []
    stamps: list[list[float]] = [[] for _ in range(args.running)]
    runners = [threading.Thread(target=stream, args=(port, model, words(32, 1000 + i),
                                                     args.output, stamps[i], errors))
               for i in range(args.running)]
    for t in runners:
        t.start()
    injected = 0
    if pulls:
        deadline = time.monotonic() + 600
        while any(len(s) < args.skip for s in stamps) and time.monotonic() < deadline:
            time.sleep(0.01)
        while all(t.is_alive() for t in runners) and time.monotonic() < deadline:
            s: list[float] = []
            stream(port, model, words(args.prompt - 2, injected), 2, s, errors)
            injected += 1
    for t in runners:
        t.join(600)
    start = max(s[args.skip] for s in stamps if len(s) > args.skip)
    end = min(s[-1] for s in stamps if s)
    gaps = [(b - a) * 1e3 for s in stamps for a, b in itertools.pairwise(s)
            if a >= start and b <= end]
    gaps.sort()
    q = statistics.quantiles(gaps, n=100) if len(gaps) > 2 else [float("nan")] * 99
    return {"itl_p50_ms": q[49], "itl_p99_ms": q[98], "gaps": len(gaps),
            "window_s": end - start, "injected": injected, "errors": errors}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connectors", default="rd2h,nixl",
                    help="rd2h, nixl, and rd2h-baseline (rd2h from --baseline-src)")
    ap.add_argument("--baseline-src", metavar="DIR",
                    help="the tree whose rd2h package rd2h-baseline runs")
    ap.add_argument("--running", type=int, default=4, help="requests decoding throughout")
    ap.add_argument("--prompt", type=int, default=2048, help="tokens of each pulled prompt")
    ap.add_argument("--output", type=int, default=400, help="tokens of each running request")
    ap.add_argument("--skip", type=int, default=10, help="first tokens left out per request")
    ap.add_argument("--rounds", type=int, default=1, help="alone/pulls pairs per connector")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if "rd2h-baseline" in args.connectors.split(",") and not args.baseline_src:
        ap.error("rd2h-baseline needs --baseline-src DIR")
    model = WORKDIR / "model-kv-heavy"
    make_kv_heavy_llama(model)
    make_word_tokenizer(model, max_length=KV_HEAVY["max_positions"])
    results: dict[str, Any] = {}
    failed = False
    for name in args.connectors.split(","):
        progress(f"{name}: starting Prefill (core 0), Decode (core 1), proxy (core 0)")
        guardian = sp.Guardian()
        procs: dict[str, sp.Proc] = {}
        try:
            procs = start_target(name, model, WORKDIR / name, args.prompt + args.output + 64,
                                 args.baseline_src if name == "rd2h-baseline" else None)
            for p in procs.values():
                guardian.watch(p.proc.pid)
            port = procs["proxy"].port
            phase(port, str(model), argparse.Namespace(**{**vars(args), "output": 20}), True)
            runs = []
            for rnd in range(args.rounds):
                for pulls in ((False, True) if rnd % 2 == 0 else (True, False)):
                    progress(f"{name}: round {rnd} {'pulls' if pulls else 'alone'}")
                    runs.append({"pulls": pulls, **phase(port, str(model), args, pulls)})
            results[name] = runs
            failed = failed or any(r["errors"] for r in runs)
        except (RuntimeError, TimeoutError, OSError) as exc:
            progress(f"{name}: failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            failed = True
        finally:
            sp.stop_all(list(procs.values())[::-1])
            guardian.release()
    print(f"\n{args.running} running requests x {args.output} tokens on Decode; pulled "
          f"prompts of {args.prompt} tokens; ITL in ms (Prefill + proxy on core 0, Decode on 1)")
    print(f"{'connector':<10} {'p50 alone':>10} {'p50 pulls':>10} {'ratio':>6}  "
          f"{'p99 alone':>10} {'p99 pulls':>10} {'ratio':>6}  {'pulled':>7}")
    summary = {}
    for name, runs in results.items():
        alone = [r for r in runs if not r["pulls"]]
        pulls = [r for r in runs if r["pulls"]]
        a50 = statistics.median(r["itl_p50_ms"] for r in alone)
        p50 = statistics.median(r["itl_p50_ms"] for r in pulls)
        a99 = statistics.median(r["itl_p99_ms"] for r in alone)
        p99 = statistics.median(r["itl_p99_ms"] for r in pulls)
        summary[name] = {"p50_alone": a50, "p50_pulls": p50, "p99_alone": a99,
                         "p99_pulls": p99, "pulled": sum(r["injected"] for r in pulls)}
        print(f"{name:<10} {a50:>10.2f} {p50:>10.2f} {p50 / a50:>6.2f}  {a99:>10.2f} "
              f"{p99:>10.2f} {p99 / a99:>6.2f}  {summary[name]['pulled']:>7}")
        for r in runs:
            for e in r["errors"][:3]:
                print(f"  {name} error: {e}")
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "summary": summary}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
