"""What every process was doing when a real-engine request was late (issue #22 part 1).

``post`` sends a request under a watch: once it has taken ``LATE_S`` seconds (and again
``AGAIN_S`` later if it is still not answered) every live server's processes are
captured, so that a stall explains itself instead of ending as a bare deadline error:

- each thread of each process of each server's process group: its name, state, kernel
  wait channel (``wchan``), CPU share over one second (``/proc/<pid>/task``) and
  context switches;
- ``py-spy dump`` of each Python process (every thread's stack, which thread holds
  the GIL: ``active+gil``), taken without pausing the process (``--nonblocking``);
- the machine: load average, runnable threads, context switches per second;
- rd2h's own view: each engine's ``rd2h_`` Prometheus series, and the last timeline
  stamps (``RD2H_TIMELINE_DIR``) of every process.

A capture is written whole to a file under ``capture_dir()``; its summary (one line
per busy or rd2h thread) is what a failing test's report shows (``conftest.py``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

LATE_S = float(os.environ.get("RD2H_STALL_AFTER_S", "5"))
AGAIN_S = float(os.environ.get("RD2H_STALL_AGAIN_S", "15"))
_TICK = os.sysconf("SC_CLK_TCK")
_PYSPY = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")

# Started servers (``servers.Server`` registers itself): whose processes a capture
# looks at. ``captures``: what this session captured, for the test reports.
live: dict[int, object] = {}
captures: list[Capture] = []
_lock = threading.Lock()


@dataclass
class Capture:
    label: str
    late_s: float
    path: Path
    summary: str
    nodeid: str = ""
    taken_at: float = field(default_factory=time.time)


def capture_dir() -> Path:
    d = Path(os.environ.get("RD2H_STALL_DIR", "/tmp/rd2h-stalls"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def timeline_dir() -> Path:
    """Where the engines and proxies of this test session stamp their timelines."""
    d = capture_dir() / f"timeline-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    return d


# ---------------------------------------------------------------- /proc
def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def _group_pids(pgid: int) -> list[int]:
    """Every process whose process group is ``pgid`` (a server and its children)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _read(f"/proc/{entry}/stat")
        rest = stat.rpartition(")")[2].split()
        if len(rest) > 3 and int(rest[2]) == pgid:
            out.append(int(entry))
    return sorted(out)


@dataclass
class _Thread:
    tid: int
    name: str
    state: str
    ticks: int
    wchan: str
    switches: str
    cpus: str
    sched: str


def _threads(pid: int) -> dict[int, _Thread]:
    out: dict[int, _Thread] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            base = f"/proc/{pid}/task/{tid}"
            stat = _read(f"{base}/stat")
            if not stat:
                continue
            name = stat[stat.find("(") + 1:stat.rfind(")")]
            rest = stat.rpartition(")")[2].split()
            status = _read(f"{base}/status")
            vol = next((ln.split()[1] for ln in status.splitlines()
                        if ln.startswith("voluntary_ctxt_switches")), "?")
            inv = next((ln.split()[1] for ln in status.splitlines()
                        if ln.startswith("nonvoluntary_ctxt_switches")), "?")
            cpus = next((ln.split()[1] for ln in status.splitlines()
                         if ln.startswith("Cpus_allowed_list")), "?")
            # nice (stat field 19) and scheduling policy (field 41: 0 normal, 1 FIFO,
            # 2 RR, 3 batch, 5 idle)
            sched = f"nice={rest[16]} policy={rest[38]}" if len(rest) > 38 else "?"
            out[int(tid)] = _Thread(int(tid), name, rest[0], int(rest[11]) + int(rest[12]),
                                    _read(f"{base}/wchan") or "-", f"{vol}/{inv}", cpus,
                                    sched)
    return out


def _system() -> dict[str, int]:
    out = {}
    for line in _read("/proc/stat").splitlines():
        key, _, value = line.partition(" ")
        if key in ("ctxt", "procs_running", "procs_blocked"):
            out[key] = int(value.split()[0])
    return out


def _pyspy(pid: int) -> str:
    try:
        done = subprocess.run([_PYSPY, "dump", "--nonblocking", "--pid", str(pid)],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(py-spy failed: {exc})"
    return done.stdout if done.returncode == 0 else f"(py-spy: {done.stderr.strip()[:200]})"


def _top_frames(dump: str) -> dict[int, tuple[str, list[str]]]:
    """py-spy's dump by native thread id: (its header, its first frames)."""
    out: dict[int, tuple[str, list[str]]] = {}
    tid, header, frames = None, "", []
    for line in dump.splitlines():
        if line.startswith("Thread "):
            if tid is not None:
                out[tid] = (header, frames)
            header, frames, tid = line.strip(), [], None
            # 'Thread 1234 (idle): "MainThread"' or 'Thread 0x7f.. (active+gil)'
            word = line.split()[1]
            with contextlib.suppress(ValueError):
                tid = int(word, 16) if word.startswith("0x") else int(word)
        elif line.startswith("    ") and tid is not None and len(frames) < 4:
            frames.append(line.strip())
    if tid is not None:
        out[tid] = (header, frames)
    return out


# ---------------------------------------------------------------- the capture
def snapshot(label: str, late_s: float) -> Capture:
    """Capture every live server's processes now (takes a few seconds)."""
    with _lock:
        servers = list(live.values())
    pids: dict[int, str] = {}
    for server in servers:
        proc = getattr(server, "proc", None)
        if proc is None or proc.poll() is not None:
            continue
        for pid in _group_pids(proc.pid):
            pids[pid] = getattr(server, "name", "?")
    queued = _sockets(set(pids))  # first: the rest takes seconds on a loaded machine
    sys0, before = _system(), {pid: _threads(pid) for pid in pids}
    t0 = time.monotonic()
    time.sleep(1.0)
    sys1, after = _system(), {pid: _threads(pid) for pid in pids}
    span = time.monotonic() - t0
    dumps = {pid: _pyspy(pid) for pid in pids}
    load = _read("/proc/loadavg").strip()
    full: list[str] = [f"# {label}: unanswered after {late_s:.1f} s", f"loadavg {load}",
                       f"procs_running {sys1.get('procs_running')} procs_blocked "
                       f"{sys1.get('procs_blocked')} ctxt/s "
                       f"{(sys1.get('ctxt', 0) - sys0.get('ctxt', 0)) / span:.0f}"]
    summary = list(full)
    for pid, owner in pids.items():
        comm = _read(f"/proc/{pid}/comm").strip()
        threads = after[pid]
        share = {tid: (t.ticks - before[pid][tid].ticks) / _TICK / span * 100
                 if tid in before[pid] else 0.0 for tid, t in threads.items()}
        head = (f"== {owner} pid {pid} ({comm}): {sum(share.values()):.0f}% CPU, "
                f"{len(threads)} threads")
        full.append(head)
        summary.append(head)
        stacks = _top_frames(dumps[pid])
        for tid, t in sorted(threads.items(), key=lambda kv: -share[kv[0]]):
            header, frames = stacks.get(tid, ("", []))
            line = (f"  {tid} {t.name!r} {t.state} {share[tid]:.0f}% wchan={t.wchan} "
                    f"cs={t.switches} cpus={t.cpus} {t.sched} {header}")
            full.append(line)
            full += [f"      {f}" for f in frames]
            if share[tid] >= 5 or "rd2h" in " ".join([header, *frames, t.name]):
                summary.append(line + (f" | {frames[0]}" if frames else ""))
        full += _io_threads(pid, threads)
        full += ["  -- py-spy dump", *("    " + ln for ln in dumps[pid].splitlines())]
    full += queued + _rd2h_state(servers)
    path = capture_dir() / f"stall-{os.getpid()}-{int(time.time() * 1000)}.txt"
    path.write_text("\n".join(full) + "\n")
    cap = Capture(label, late_s, path, "\n".join(summary))
    with _lock:
        captures.append(cap)
    return cap


def _io_threads(pid: int, threads: dict[int, _Thread]) -> list[str]:
    """Each ZeroMQ I/O thread's current system call (an ``epoll_wait``: its timeout is
    the last argument) and what its epoll set watches: ``events`` 0x1 is POLLIN, 0x4
    POLLOUT; a TCP socket missing from the set, or with neither, is not being served."""
    out = []
    for tid, t in threads.items():
        if not t.name.startswith("ZMQbg/IO"):
            continue
        call = _read(f"/proc/{pid}/task/{tid}/syscall").split()
        out.append(f"  -- {t.name} {tid} syscall {' '.join(call[:5])}")
        if len(call) < 2 or call[0] not in ("232", "281", "441"):  # epoll_wait/pwait/pwait2
            continue
        epfd = int(call[1], 16)
        for line in _read(f"/proc/{pid}/fdinfo/{epfd}").splitlines():
            if not line.startswith("tfd:"):
                continue
            tfd = line.split()[1]
            try:
                target = os.readlink(f"/proc/{pid}/fd/{tfd}")
            except OSError:
                target = "?"
            out.append(f"      {line.strip()} -> {target}")
    return out


def _sockets(pids: set[int]) -> list[str]:
    """The servers' TCP connections with bytes queued in the kernel (``ss``): data
    waiting in a receive queue was not read by its process's ZeroMQ I/O thread; in a
    send queue, not taken by the peer."""
    try:
        done = subprocess.run(["ss", "-tnpeH"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"== sockets: ss failed ({exc})"]
    out = ["== TCP connections of these processes with bytes queued (Recv-Q Send-Q)"]
    for line in done.stdout.splitlines():
        cols = line.split()
        if len(cols) < 5 or (cols[1] == "0" and cols[2] == "0"):
            continue
        if any(f"pid={pid}," in line for pid in pids):
            out.append("  " + " ".join(cols))
    return out


def _rd2h_state(servers: list) -> list[str]:
    """rd2h's counters as each server exports them, and the last timeline stamps."""
    out = ["== rd2h series"]
    for server in servers:
        url = getattr(server, "url", None)
        if url is None:
            continue
        try:
            text = httpx.get(url + "/metrics", timeout=2.0).text
        except httpx.HTTPError as exc:
            out.append(f"  {server.name}: /metrics unanswered ({type(exc).__name__})")
            continue
        out += [f"  {server.name}: {ln}" for ln in text.splitlines()
                if ln.startswith("rd2h_") and not ln.endswith(" 0.0")]
    out.append("== last timeline stamps")
    for stamps in sorted(timeline_dir().glob("*.jsonl")):
        lines = _read(str(stamps)).splitlines()[-8:]
        out += [f"  {stamps.name}: {ln}" for ln in lines]
    return out


@contextlib.contextmanager
def watch(label: str) -> Iterator[None]:
    """Capture the servers if the body runs past ``LATE_S`` (and again ``AGAIN_S``
    later); the capture runs on its own thread, the body is not disturbed."""
    done = threading.Event()
    t0 = time.monotonic()

    def run() -> None:
        for wait in (LATE_S, AGAIN_S):
            if done.wait(wait):
                return
            with contextlib.suppress(Exception):  # a capture never fails the test
                snapshot(label, time.monotonic() - t0)

    thread = threading.Thread(target=run, name="stall-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(60)


def post(url: str, body: dict, timeout: float) -> httpx.Response:
    """``httpx.post`` under ``watch``."""
    with watch(f"POST {url} ({str(body.get('prompt'))[:40]}...)"):
        return httpx.post(url, json=body, timeout=timeout)
