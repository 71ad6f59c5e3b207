"""How ``rd2h proxy``'s picking policies and prefix affinity do on real engines.

One Prefill and two Decode vLLM engines (tiny Llama, rd2h over cma) behind one proxy
per policy. Two parts, figures printed, never judged on time:

1. Skew: Decode 1 is made slow by stopping its process group ``--stop-ms`` of every
   ``--period-ms`` (SIGSTOP / SIGCONT, as a busier or throttled host would). The same
   streamed requests (``--requests`` at ``--concurrency``) go through each policy's
   proxy in turn, twice, alternating: TTFT p50 / p99 (first streamed byte), end-to-end
   p50 and req/s per policy, and how many requests each Decode took.
2. Affinity: ``--conversations`` two-turn conversations (every first turn, then every
   second turn in a shuffled order, one at a time) through a least-outstanding proxy
   with prefix affinity and through a round-robin proxy without: what each second turn
   pulled as a fraction of a full pull of its prompt (Decode's
   ``vllm:rd2h_bytes_pulled_total``), and whether outputs equal a plain engine's.

    .venv/bin/python benchmarks/proxy_policies.py            # about 5 minutes here
    .venv/bin/python benchmarks/proxy_policies.py --requests 16 --conversations 4

Exit status 1 when a request failed or an output differed from the plain engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_support import (
    PYTHON,
    Proc,
    engine,
    free_port,
    quiet_ports,
    rd2h_kv,
    stop_all,
    wait_all_ready,
)

from rd2h.demo.tiny_model import VOCAB, make_tiny_llama

POLICIES = ("least_outstanding", "power_of_two", "round_robin")
BLOCK = 32


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def prompt_of(n: int, seed: int) -> list[int]:
    return [2 + (seed * 131 + i * 17 + seed * i) % (VOCAB - 2) for i in range(n)]


def proxy_proc(name: str, prefill: Proc, decodes: list[Proc], log: Path,
               args: list[str]) -> Proc:
    port = free_port()
    cmd = [PYTHON, "-m", "rd2h", "proxy", "--port", str(port), "--prefill", prefill.url,
           "--decode", *[d.url for d in decodes], "--log-level", "WARNING", *args]
    return Proc(name, cmd, port, log, {}, ready_path="/health")


class Throttle:
    """Stops a process group ``stop_ms`` of every ``period_ms`` until ``stop``."""

    def __init__(self, pgid: int, stop_ms: float, period_ms: float) -> None:
        self._pgid, self._stop_s, self._period_s = pgid, stop_ms / 1e3, period_ms / 1e3
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Throttle:
        if self._stop_s > 0:
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._done.is_set():
            os.killpg(self._pgid, signal.SIGSTOP)
            time.sleep(self._stop_s)
            os.killpg(self._pgid, signal.SIGCONT)
            self._done.wait(self._period_s - self._stop_s)

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(5)
        os.killpg(self._pgid, signal.SIGCONT)


async def streamed_load(url: str, model: str, prompts: list[list[int]], concurrency: int,
                        max_tokens: int) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    ttft: list[float] = []
    e2e: list[float] = []
    texts: list[list[int] | None] = [None] * len(prompts)
    failed = 0

    async def one(c: httpx.AsyncClient, i: int) -> None:
        nonlocal failed
        async with sem:
            t0 = time.monotonic()
            first = None
            tokens: list[int] = []
            body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens,
                    "temperature": 0, "stream": True, "return_token_ids": True}
            try:
                async with c.stream("POST", url + "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        failed += 1
                        return
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        if first is None:
                            first = time.monotonic() - t0
                        for choice in json.loads(line[6:]).get("choices", []):
                            tokens += choice.get("token_ids") or []
            except httpx.HTTPError:
                failed += 1
                return
            if first is not None:
                ttft.append(first)
            e2e.append(time.monotonic() - t0)
            texts[i] = tokens

    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=300) as c:
        await asyncio.gather(*(one(c, i) for i in range(len(prompts))))
    wall = time.monotonic() - t0
    return {"ttft": sorted(ttft), "e2e": sorted(e2e), "wall": wall, "failed": failed,
            "tokens": texts, "req_s": (len(prompts) - failed) / wall}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def served(proxy: Proc) -> dict[str, int]:
    status = httpx.get(proxy.url + "/status", timeout=10).json()["instances"]["decode"]
    return {i["url"]: i["served"] for i in status}


def pulled(decodes: list[Proc]) -> float:
    total = 0.0
    for d in decodes:
        for line in httpx.get(d.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:rd2h_bytes_pulled_total"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def settled(decodes: list[Proc], before: float, deadline_s: float = 15.0) -> float:
    t0, last, still = time.monotonic(), None, 0.0
    while time.monotonic() - t0 < deadline_s:
        now = pulled(decodes)
        still = still + 0.25 if (now == last and now > before) else 0.0
        if still >= 1.0:
            return now
        last = now
        time.sleep(0.25)
    return pulled(decodes)


def complete(url: str, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    r = httpx.post(url + "/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True}, timeout=180)
    r.raise_for_status()
    return list(r.json()["choices"][0]["token_ids"])


def two_turns(proxy: Proc, base: Proc, decodes: list[Proc], model: str, n: int, seed: int,
              max_tokens: int) -> dict[str, Any]:
    firsts = [prompt_of(200, seed + i) for i in range(n)]
    before = settled(decodes, -1.0)
    seconds, equal = [], 0
    for p in firsts:
        out = complete(proxy.url, model, p, max_tokens)
        equal += out == complete(base.url, model, p, max_tokens)
        seconds.append(p + out + prompt_of(40, seed + 100 + len(seconds)))
    total = settled(decodes, before)
    per_block = (total - before) / sum(-(-len(p) // BLOCK) for p in firsts)
    fractions = []
    for i in random.Random(seed).sample(range(n), n):
        before = total
        out = complete(proxy.url, model, seconds[i], max_tokens)
        equal += out == complete(base.url, model, seconds[i], max_tokens)
        total = settled(decodes, before)
        fractions.append((total - before) / (per_block * -(-len(seconds[i]) // BLOCK)))
    return {"fractions": fractions, "equal": equal, "total": 2 * n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=96)
    ap.add_argument("--stop-ms", type=float, default=60.0,
                    help="Decode 1 stopped this long of every period (default: %(default)s)")
    ap.add_argument("--period-ms", type=float, default=100.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--startup-timeout", type=float, default=420.0)
    args = ap.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="rd2h-policies-"))
    work.mkdir(parents=True, exist_ok=True)
    model = make_tiny_llama(work / "model")
    progress(f"work dir {work}")
    extra = {"deadlines": {"layer_ack_s": 10.0, "meta_ack_s": 5.0}}
    # Token-id prompts: no tokenizer needed.
    eng = ["--enforce-eager", "--max-num-batched-tokens", "512", "--skip-tokenizer-init"]
    prefill = engine("prefill", model, work / "prefill.log", max_model_len=512, extra_args=eng,
                     kv=rd2h_kv("kv_producer", quiet_ports(2), extra))
    decodes = [engine(f"decode {i}", model, work / f"decode{i}.log", max_model_len=512,
                      extra_args=eng,
                      kv=rd2h_kv("kv_consumer", quiet_ports(2), extra)) for i in range(2)]
    for d in decodes:  # bytes pulled are read from vLLM's /metrics, which stats feed
        d.cmd.remove("--disable-log-stats")
    base = engine("plain", model, work / "plain.log", max_model_len=512, extra_args=eng)
    proxies = {p: proxy_proc(p, prefill, decodes, work / f"proxy_{p}.log",
                             ["--decode-policy", p, "--affinity-chunk", "0"]) for p in POLICIES}
    proxies["affinity"] = proxy_proc("affinity", prefill, decodes, work / "proxy_aff.log", [])
    procs = [prefill, *decodes, base, *proxies.values()]
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    ok = True
    try:
        for p in procs:
            p.start()
        wait_all_ready(procs, args.startup_timeout, progress)
        name = str(model)
        # Fresh prompts for every run (no run finds another's prompts in a prefix cache),
        # and a warm-up through every proxy first.
        sets = {(rnd, policy): [prompt_of(args.input_len, 50000 + 1000 * k + i)
                                for i in range(args.requests)]
                for k, (rnd, policy) in enumerate(
                    (r, p) for r in range(args.rounds) for p in POLICIES)}
        wants = {key: [complete(base.url, name, p, args.max_tokens) for p in prompts]
                 for key, prompts in sets.items()}
        progress(f"skew: decode 1 stopped {args.stop_ms:g} of every {args.period_ms:g} ms")
        rows: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
        with Throttle(decodes[1].proc.pid, args.stop_ms, args.period_ms):
            for k, policy in enumerate(POLICIES):  # warm-up, throttled like the runs
                asyncio.run(streamed_load(proxies[policy].url, name, [
                    prompt_of(args.input_len, 90000 + 100 * k + i) for i in range(8)], 4,
                    args.max_tokens))
            for rnd in range(args.rounds):
                # The order turns round each round: no policy always runs first.
                for policy in POLICIES if rnd % 2 == 0 else POLICIES[::-1]:
                    prompts, want = sets[(rnd, policy)], wants[(rnd, policy)]
                    before = served(proxies[policy])
                    res = asyncio.run(streamed_load(proxies[policy].url, name, prompts,
                                                    args.concurrency, args.max_tokens))
                    after = served(proxies[policy])
                    res["per_decode"] = [after[d.url] - before.get(d.url, 0) for d in decodes]
                    res["equal"] = sum(t == w for t, w in zip(res.pop("tokens"), want))
                    ok &= res["failed"] == 0 and res["equal"] == len(prompts)
                    rows[policy].append(res)
                    progress(f"round {rnd + 1} {policy}: {res['req_s']:.2f} req/s, TTFT p99 "
                             f"{pct(res['ttft'], 0.99) * 1e3:.0f} ms")
        print(f"\n== skewed pair: decode 1 stopped {args.stop_ms:g}/{args.period_ms:g} ms, "
              f"{args.requests} requests at concurrency {args.concurrency}, "
              f"{args.max_tokens} tokens each")
        print("| policy | round | req/s | TTFT p50 | TTFT p99 | e2e p50 | decode 0 / 1 | "
              "equal |")
        print("|---|---|---|---|---|---|---|---|")
        for policy in POLICIES:
            for rnd, res in enumerate(rows[policy], 1):
                print(f"| {policy} | {rnd} | {res['req_s']:.2f} | "
                      f"{pct(res['ttft'], 0.5) * 1e3:.0f} ms | "
                      f"{pct(res['ttft'], 0.99) * 1e3:.0f} ms | "
                      f"{pct(res['e2e'], 0.5) * 1e3:.0f} ms | "
                      f"{res['per_decode'][0]} / {res['per_decode'][1]} | "
                      f"{res['equal']}/{args.requests} |")
        report["skew"] = {p: [{k: v for k, v in r.items() if k not in ("ttft", "e2e")}
                              | {"ttft_p50": pct(r["ttft"], .5), "ttft_p99": pct(r["ttft"], .99)}
                              for r in rows[p]] for p in POLICIES}
        progress("affinity: two-turn conversations")
        aff = two_turns(proxies["affinity"], base, decodes, name, args.conversations, 60000,
                        args.max_tokens)
        rr = two_turns(proxies["round_robin"], base, decodes, name, args.conversations, 61000,
                       args.max_tokens)
        ok &= aff["equal"] == aff["total"] and rr["equal"] == rr["total"]
        print(f"\n== two-turn conversations ({args.conversations}): second turn pulled / full "
              "pull")
        print("| proxy | mean | max | whole pulls | outputs equal |")
        print("|---|---|---|---|---|")
        for label, r in (("least outstanding + prefix affinity", aff),
                         ("round robin, no affinity", rr)):
            fr = r["fractions"]
            print(f"| {label} | {sum(fr) / len(fr):.2f} | {max(fr):.2f} | "
                  f"{sum(x > 0.9 for x in fr)}/{len(fr)} | {r['equal']}/{r['total']} |")
        report["affinity"] = {"affinity": aff, "round_robin": rr}
    finally:
        stop_all(procs)
    report["ok"] = ok
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    print(f"\n{'ok' if ok else 'FAILED: a request failed or an output differed'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
