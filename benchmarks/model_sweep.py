"""Every text-generation architecture in the installed vLLM's registry, served through
rd2h on real engines and compared with a plain engine: right, or refused clearly.

For each architecture whose config class ``transformers`` provides
(``sweep_models.registry``): a tiny random-weight checkpoint with the family's features
on (``sweep_models.make_checkpoint``), then together a plain reference engine, a Prefill
and a Decode engine with rd2h over cma (``verify_kv`` on) and ``rd2h proxy`` in front.
The reference computes each prompt in the chunks the P/D pair does (the first N-1 tokens
in 64-token chunks, then the last alone: ``pd_split_scheduler``), one request at a time,
as Prefill does (``--max-num-seqs 1``), so the comparison is exact in bfloat16 too.
Prompts: 1 token to past two blocks (each side of a block boundary of the block size
vLLM chose), then four at once. Each architecture gets one verdict:

  EQUAL+PULLED  every answer equals the reference's, Decode loaded the prompt from rd2h
                for each one (``cached_tokens`` N, or N-1 by the N-1 scheme), bytes were
                pulled, no digest differed
  REFUSED       rd2h refused the model at start, naming what (its own error)
  NOT-RUNNABLE  the plain engine itself fails on this CPU (vLLM's error, where)
  NOT-BUILT     no tiny checkpoint: transformers' config or model raised (the reason)
  CRASH         the P/D engines failed where the plain one runs, or a request failed
  WRONG         an answer differs from the reference, Decode did not load the prompt,
                or a digest differed
  HANG          an engine was not ready or a request not answered within its deadline

Four at once: the reference computes one request at a time, Decode batches them. Where
an answer given at once differs, the same prompt goes through P/D alone and must equal
the reference token for token, and the difference is put down to vLLM only if Decode,
computing the same prompts itself (no KV from rd2h), answers differently at once than
alone; the result keeps a note saying so. Otherwise it is WRONG.

Results go to ``--results`` (JSON, one entry per architecture, merged into what is
there: a long sweep can be resumed with ``--skip-done``); ``scripts/gen_reference.py``
writes the compatibility page (``docs/reference/models.md``) from them.

Run:  .venv/bin/python benchmarks/model_sweep.py [--only A,B] [--skip-done] [--list]
Exit status 0 when no architecture is CRASH, WRONG or HANG; 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import time
import traceback
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import serving_support as sp  # noqa: E402
import sweep_models as sm  # noqa: E402

RESULTS = HERE / "results" / "model_sweep.json"
SCHEDULER_DIR = ROOT / "tests" / "integration" / "vllm"  # pd_split_scheduler.py
DEFAULT_WORKDIR = Path("/tmp/rd2h-model-sweep")
MAX_MODEL_LEN = 512
MAX_TOKENS = 8
CHUNK = 64
START_S = 420.0
REQUEST_S = 120.0
BATCH_ROUNDS = 4  # plain at-once rounds looking for vLLM's own batch variance
FAILING = ("CRASH", "WRONG", "HANG")
T0 = time.monotonic()
# rd2h's refusals at start: its configuration and layout errors.
REFUSAL = re.compile(r"\b(ConnectorConfigError|UnsupportedKvGroup|LayerNameError|"
                     r"TopologyError|LayoutMismatch): (.+)")
_EXC = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception|Exit)|NotImplementedError|"
                  r"AssertionError)(?:: ?(.*))?$")


def progress(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f} s] {msg}", flush=True)


def _prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 131 + i * 17) % (sm.VOCAB - 3) for i in range(n)]


# Exceptions that only wrap the root cause logged above them.
_WRAPPERS = ("Engine core initialization failed", "EngineDeadError", "EngineCore failed",
             "Worker failed", "WorkerProc initialization failed", "CalledProcessError",
             "Error raised in subprocess")
_PREFIX = re.compile(r"^\(\w+ pid=\d+\)\s*(?:(?:ERROR|WARNING|INFO)\s+\S+ \S+ \[[^\]]+\]\s*)?")


def _root_error(log: Path) -> str:
    """The root exception in an engine's log (``Type: message``): the first one logged
    that is not a wrapper of another, trimmed."""
    try:
        lines = sp._ANSI.sub("", log.read_text(errors="replace")).splitlines()
    except OSError:
        return "(no log)"
    clean = [_PREFIX.sub("", line).strip() for line in lines]
    found = [(i, m) for i, line in enumerate(clean) if (m := _EXC.match(line))]
    roots = [(i, m) for i, m in found if not any(w in m.group(0) for w in _WRAPPERS)]
    if not (roots or found):
        return "(no exception in the log)"
    i, pick = (roots or found)[0]
    message = pick.group(2) or ""
    if not message:  # a bare assert: the source line that failed (not the ^^^ marks)
        source = [ln for ln in clean[max(0, i - 4):i] if ln and set(ln) - {"^", " ", "~"}]
        message = f"(at: {source[-1]})" if source else ""
    text = f"{pick.group(1)}: {message}"
    if pick.group(1) == "ValidationError" and i + 1 < len(clean):  # pydantic: the why
        text += " " + clean[i + 1]
    return text[:300]


def _groups(log: Path) -> str:
    found = re.search(r"'kv_groups': '([^']+)'", log.read_text(errors="replace"))
    return found.group(1) if found else ""


def _block(groups: str) -> int:
    sizes = [int(part.split("/")[1].split("x")[0]) for part in groups.split(",") if
             "/" in part and not part.startswith("state/")]
    return min(sizes) if sizes else 32


def _lengths(block: int) -> list[int]:
    fixed = {1, 2, 5, CHUNK, CHUNK + 1, 300}
    around = {block - 1, block, block + 1, 2 * block, 2 * block + 1}
    return sorted(n for n in fixed | around if 1 <= n <= MAX_MODEL_LEN - MAX_TOKENS)


def _mla(ckpt: Path) -> bool:
    cfg = json.loads((ckpt / "config.json").read_text())
    return "kv_lora_rank" in cfg or "kv_lora_rank" in cfg.get("text_config", {})


def _engines(ckpt: Path, dtype: str, work: Path, extra_args: list[str] = (),
             extra_env: dict[str, str] | None = None) -> dict[str, sp.Proc]:
    kv_port = sp.quiet_ports(4)
    opts = {"verify_kv": True,
            "deadlines": {"request_s": 60.0, "layer_ack_s": 20.0, "meta_ack_s": 10.0}}
    common = ["--dtype", dtype, "--no-enable-prefix-caching", "--enforce-eager",
              "--max-num-batched-tokens", str(CHUNK)]
    if _mla(ckpt):  # vLLM 0.32's CPU rotary op is wrong for MLA's strided views
        common += ["--compilation-config", '{"custom_ops":["all","-rotary_embedding"]}']
    common += list(extra_args)  # a harness's arguments win (argparse keeps the last)
    extra_env = dict(extra_env or {})
    base_path = extra_env.pop("PYTHONPATH", None) or os.environ.get("PYTHONPATH")
    path = os.pathsep.join(p for p in (str(SCHEDULER_DIR), base_path) if p)

    def one(name: str, kv: dict | None, extra: list[str], env: dict | None = None):
        port = sp.free_port()
        cmd = [sp.PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt),
               "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
               "--max-model-len", str(MAX_MODEL_LEN), "--disable-uvicorn-access-log",
               *common, *extra]
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        env = {**sp.ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **extra_env,
               **({"PYTHONPATH": base_path} if base_path else {}), **(env or {})}
        return sp.Proc(name, cmd, port, work / f"{name}.log", env)

    procs = {
        "reference": one("reference", None,
                         ["--scheduler-cls", "pd_split_scheduler.PdSplitScheduler",
                          "--max-num-seqs", "1", "--disable-log-stats"],
                         {"PYTHONPATH": path}),
        "prefill": one("prefill", sp.rd2h_kv("kv_producer", kv_port, opts),
                       ["--max-num-seqs", "1", "--disable-log-stats"]),
        "decode": one("decode", {**sp.rd2h_kv("kv_consumer", kv_port, opts),
                                 "kv_load_failure_policy": "fail"},
                      ["--enable-prompt-tokens-details"]),
    }
    return procs


def _post(url: str, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}
    return sp.post_json(url + "/v1/completions", body, timeout=REQUEST_S)


def _metric(url: str, name: str) -> float:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                total += s.value
    return total


class Verdict(Exception):
    def __init__(self, verdict: str, reason: str) -> None:
        super().__init__(reason)
        self.verdict, self.reason = verdict, reason


def _ask(url: str, model: str, prompt: list[int], what: str) -> dict:
    try:
        return _post(url, model, prompt)
    except TimeoutError as exc:
        raise Verdict("HANG", f"{what}: no answer in {REQUEST_S:g} s") from exc
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")[:200]
        raise Verdict("CRASH", f"{what}: HTTP {exc.code} {body}") from exc
    except (urllib.error.URLError, OSError) as exc:
        if "timed out" in str(exc):
            raise Verdict("HANG", f"{what}: no answer in {REQUEST_S:g} s") from exc
        raise Verdict("CRASH", f"{what}: {exc}") from exc


def _split_variant(procs: dict[str, sp.Proc], model: str, prompt: list[int],
                   want: list[int]) -> None:
    """When P/D differs from the reference: whether vLLM itself answers the prompt
    differently when it is split otherwise. The Prefill engine, asked plainly (a
    ``cache_salt``: rd2h does nothing for it), computes the prompt in its own chunks; if
    two plain computations disagree, there is no reference to judge P/D by, and the
    family is vLLM's to fix (NOT-RUNNABLE, both answers named)."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, "cache_salt": "rd2h-sweep-plain"}
    try:
        plain = sp.post_json(procs["prefill"].url + "/v1/completions", body,
                             timeout=REQUEST_S)["choices"][0]["token_ids"]
    except (OSError, urllib.error.URLError, KeyError):
        return
    if plain != want:
        raise Verdict("NOT-RUNNABLE", f"vLLM's own answer depends on how a prompt is split "
                      f"({len(prompt)} tokens: {plain} in {CHUNK}-token chunks, {want} split "
                      f"as P/D splits it), so no plain answer can judge P/D")


def _check(procs: dict[str, sp.Proc], proxy: sp.Proc, model: str, groups: str) -> dict:
    """Prompts through the proxy against the reference; raises Verdict on the first
    failure; returns what was checked. A request the plain engine fails is vLLM's own
    failure (NOT-RUNNABLE, its root error)."""
    dec = procs["decode"].url

    def reference(prompt: list[int], what: str) -> dict:
        try:
            return _ask(procs["reference"].url, model, prompt, what)
        except Verdict as v:
            raise Verdict("NOT-RUNNABLE", f"plain engine, {what}: "
                          f"{_root_error(procs['reference'].log)}") from v

    block = _block(groups)
    lengths = _lengths(block)
    checked = []
    for n in lengths:
        prompt = _prompt(n, seed=n)
        want = reference(prompt, f"{n} tokens")["choices"][0]["token_ids"]
        out = _ask(proxy.url, model, prompt, f"P/D, {n} tokens")
        got = out["choices"][0]["token_ids"]
        if got != want:
            _split_variant(procs, model, prompt, want)
            raise Verdict("WRONG", f"{n}-token prompt: {got} != plain {want}")
        cached = (out.get("usage") or {}).get("prompt_tokens_details") or {}
        # All N tokens, or N-1 where Decode computes the last itself (the N-1 scheme:
        # models with recurrent state, DeepSeek-V4).
        if cached.get("cached_tokens") not in (n - 1, n):
            raise Verdict("WRONG", f"{n}-token prompt: Decode loaded "
                                   f"{cached.get('cached_tokens')} tokens, not {n - 1} or {n}")
        checked.append(n)
    together = [_prompt(n, seed=900 + n) for n in (40, 97, 2 * block + 3, 260)
                if n <= MAX_MODEL_LEN - MAX_TOKENS]
    wants = [reference(p, f"{len(p)} tokens")["choices"][0]["token_ids"] for p in together]
    with ThreadPoolExecutor(len(together)) as pool:
        outs = list(pool.map(lambda p: _ask(proxy.url, model, p,
                                            f"P/D, {len(p)} tokens, 4 at once"), together))
    differing = [(p, w, o["choices"][0]["token_ids"]) for p, w, o in zip(together, wants, outs)
                 if o["choices"][0]["token_ids"] != w]
    pulled = _metric(dec, "vllm:rd2h_bytes_pulled_total")
    mismatches = _metric(dec, "vllm:rd2h_kv_digest_mismatches_total")
    if mismatches:
        raise Verdict("WRONG", f"{mismatches:.0f} block digests differed after the read")
    if pulled <= 0:
        raise Verdict("WRONG", "no bytes pulled")
    checked = {"lengths": checked, "concurrent": [len(p) for p in together],
               "block": block, "bytes_pulled": int(pulled)}
    if differing:
        checked["note"] = _batch_variant(procs, proxy, model, together, differing)
    return checked


def _batch_variant(procs: dict[str, sp.Proc], proxy: sp.Proc, model: str,
                   together: list[list[int]],
                   differing: list[tuple[list[int], list[int], list[int]]]) -> str:
    """When an answer given beside others differs from the reference (which computes one
    request at a time): rd2h is judged by the same prompt through P/D alone, which must
    equal the reference token for token, and the difference is vLLM's only when its own
    plain answers move with the batch: Decode computing the same prompts itself (no KV
    from rd2h), at once against alone, in up to ``BATCH_ROUNDS`` rounds. Otherwise WRONG.
    Returns the note the result keeps."""
    for p, want, got in differing:
        alone = _ask(proxy.url, model, p, f"P/D, {len(p)} tokens, alone again")
        alone_ids = alone["choices"][0]["token_ids"]
        if alone_ids != want:
            raise Verdict("WRONG", f"{len(p)}-token prompt: {got} at once and {alone_ids} "
                                   f"alone != plain {want}")
    dec = procs["decode"].url
    plain = [_ask(dec, model, p, f"Decode plain, {len(p)} tokens")["choices"][0]["token_ids"]
             for p in together]
    for r in range(BATCH_ROUNDS):
        with ThreadPoolExecutor(len(together)) as pool:
            outs = list(pool.map(lambda p: _ask(dec, model, p, "Decode plain, at once"),
                                 together))
        moved = [len(p) for p, a, o in zip(together, plain, outs)
                 if o["choices"][0]["token_ids"] != a]
        if moved:
            lens = ", ".join(str(len(p)) for p, _, _ in differing)
            one = len(differing) == 1
            return (f"at once, the answer{'' if one else 's'} to the {lens}-token "
                    f"prompt{'' if one else 's'} differed from the plain engine's, which "
                    f"computes one request at a time; alone through P/D "
                    f"{'it equals' if one else 'they equal'} it token for token. vLLM's "
                    f"own answers move with the batch here: "
                    f"Decode computing the prompts itself answered the "
                    f"{', '.join(map(str, moved))}-token ones differently at once than "
                    f"alone (round {r + 1})")
    p, want, got = differing[0]
    raise Verdict("WRONG", f"{len(p)}-token prompt, 4 at once: {got} != plain {want} (alone "
                           f"through P/D it equals; vLLM's own answers did not move with the "
                           f"batch in {BATCH_ROUNDS} rounds)")


def sweep_one(arch: str, model_type: str, workdir: Path, guardian: sp.Guardian) -> dict:
    t0 = time.monotonic()
    work = workdir / arch
    shutil.rmtree(work / "logs", ignore_errors=True)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"arch": arch, "model_type": model_type}
    try:
        special = sm.harness(arch, work)
        if special is None:
            ckpt, dtype = sm.make_checkpoint(arch, model_type, work / "model")
            extra_args, extra_env = list(sm.ENGINE_ARGS.get(arch, [])), {}
        else:
            ckpt, extra_args, extra_env, result["harness"] = special
            dtype = extra_args[extra_args.index("--dtype") + 1]
    except Exception as exc:
        line = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return {**result, "verdict": "NOT-BUILT", "reason": line[:300], "groups": "",
                "dtype": "", "seconds": round(time.monotonic() - t0)}
    result["dtype"] = dtype
    procs = _engines(ckpt, dtype, work / "logs", extra_args, extra_env)
    everything = list(procs.values())
    try:
        for p in everything:
            p.start()
            guardian.watch(p.proc.pid)
        verdict, reason, groups, checked = _start_and_check(procs, everything, str(ckpt),
                                                            work, guardian)
    finally:
        sp.stop_all(everything)
    return {**result, "verdict": verdict, "reason": reason, "groups": groups, **checked,
            "seconds": round(time.monotonic() - t0)}


def _start_and_check(procs, everything, model, work, guardian):
    deadline = time.monotonic() + START_S
    waiting = dict(procs)
    failed: dict[str, str] = {}
    while waiting:
        for name, p in list(waiting.items()):
            try:
                if p.poll_ready():
                    del waiting[name]
            except RuntimeError:
                failed[name] = _root_error(p.log)
                del waiting[name]
        if waiting and time.monotonic() > deadline:
            return ("HANG", f"not ready in {START_S:g} s: {', '.join(waiting)}", "", {})
        if "reference" in failed:
            return ("NOT-RUNNABLE", f"plain engine: {failed['reference']}", "", {})
        time.sleep(1.0)
    groups = _groups(procs["decode"].log) if "decode" not in failed else ""
    if failed:
        for name in ("prefill", "decode"):
            text = procs[name].log.read_text(errors="replace")
            found = REFUSAL.search(sp._ANSI.sub("", text))
            if found:
                return ("REFUSED", f"{name}: {found.group(1)}: {found.group(2)[:250]}",
                        groups, {})
        name = sorted(failed)[0]
        return ("CRASH", f"{name} failed to start (the plain engine runs): "
                         f"{failed[name]}", groups, {})
    proxy = sp.proxy(procs["prefill"], procs["decode"], work / "logs" / "proxy.log", {},
                     ("--probe-timeout", "10"))
    everything.append(proxy)
    proxy.start()
    guardian.watch(proxy.proc.pid)
    sp.wait_all_ready([proxy], 60.0, lambda _m: None)
    try:
        checked = _check(procs, proxy, model, groups)
    except Verdict as v:
        return (v.verdict, v.reason, groups, {})
    return ("EQUAL+PULLED", "", groups, checked)


def load(path: Path) -> dict[str, dict]:
    if path.exists():
        return json.loads(path.read_text())["architectures"]
    return {}


def save(path: Path, results: dict[str, dict], not_swept: list[str]) -> None:
    import transformers
    import vllm

    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"vllm": vllm.__version__, "transformers": transformers.__version__,
           "not_swept": not_swept, "architectures": dict(sorted(results.items()))}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--only", default="", help="comma-separated architectures to sweep")
    p.add_argument("--skip-done", action="store_true",
                   help="skip architectures the results file already has")
    p.add_argument("--list", action="store_true",
                   help="print the architectures the sweep covers and exit")
    p.add_argument("--results", type=Path, default=RESULTS, help="results JSON (merged)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR,
                   help="checkpoints and engine logs, one folder per architecture")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    swept, not_swept = sm.registry()
    if args.list:
        for arch, model_type in swept:
            print(f"{arch}\t{model_type}")
        print(f"# {len(swept)} swept; {len(not_swept)} without a transformers config: "
              f"{', '.join(not_swept)}")
        return 0
    only = {a for a in args.only.split(",") if a}
    unknown = only - {a for a, _ in swept}
    if unknown:
        print(f"not in the sweep: {', '.join(sorted(unknown))} (see --list)", file=sys.stderr)
        return 2
    results = load(args.results)
    todo = [(a, t) for a, t in swept if (not only or a in only)
            and not (args.skip_done and a in results)]
    progress(f"{len(todo)} architectures to sweep (of {len(swept)}); results {args.results}")
    guardian = sp.Guardian()
    try:
        for i, (arch, model_type) in enumerate(todo, 1):
            progress(f"[{i}/{len(todo)}] {arch} ({model_type})")
            res = sweep_one(arch, model_type, args.workdir, guardian)
            results[arch] = res
            save(args.results, results, not_swept)
            extra = f": {res['reason']}" if res["reason"] else ""
            progress(f"    {res['verdict']} in {res['seconds']} s  {res['groups']}{extra}")
    finally:
        guardian.release()
    counts: dict[str, int] = {}
    for res in results.values():
        counts[res["verdict"]] = counts.get(res["verdict"], 0) + 1
    progress("verdicts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
             + f"; this run {time.monotonic() - T0:.0f} s for {len(todo)} architectures")
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    return 1 if any(r["verdict"] in FAILING for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
