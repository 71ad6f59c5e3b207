"""The serving benchmark's CPU per thread (``benchmarks/serving_support.py``): a real
process group with a named thread that burns CPU and one that sleeps; the readings come
from /proc and the names from py-spy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import serving_support as sp

CHILD = """
import sys, threading, time
def spin():
    end = time.thread_time() + 1.2
    while time.thread_time() < end:
        pass
    time.sleep(60)
threading.Thread(target=lambda: time.sleep(60), name="rd2h-idle-3", daemon=True).start()
go = threading.Event()
threading.Thread(target=lambda: (go.wait(), spin()), name="rd2h-spin-12345",
                 daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
go.set()
time.sleep(60)
"""


def _child():
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def _wait_spun(p, pid: int, tid_min_s: float = 0.55, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        spent = max(s for (_, _, s) in sp.group_thread_cpu_s(pid).values())
        if spent >= tid_min_s:
            return
        time.sleep(0.05)
    raise AssertionError("the spinning thread did not run")


def test_cpu_goes_to_the_thread_that_spent_it_named_as_python_names_it():
    p = _child()
    try:
        before = sp.group_thread_cpu_s(p.pid)
        assert {pid for pid, _ in before} == {p.pid}
        assert len(before) >= 3  # main thread and the two named ones
        p.stdin.write("go\n")
        p.stdin.flush()
        _wait_spun(p, p.pid, 0.3)
        names = sp.python_thread_names([p.pid])  # while it spins, holding the GIL
        _wait_spun(p, p.pid, 1.15)
        time.sleep(0.1)
        after = sp.group_thread_cpu_s(p.pid)
        assert sorted(n for n in names.values() if n.startswith("rd2h")) == [
            "rd2h-idle-3", "rd2h-spin-12345"]
        per = sp.thread_cpu_ms(before, after, names, per=4)
        # instance numbers dropped; the process is no engine core: "api"
        assert 250 <= per["api rd2h-spin"] <= 400, per
        assert next(iter(per)) == "api rd2h-spin"  # largest first
        assert per.get("api rd2h-idle", 0.0) < 20, per
        # without py-spy's names a thread is labelled by its OS name
        bare = sp.thread_cpu_ms(before, after, {}, per=1)
        assert max(bare.values()) >= 1100 and all(k.startswith("api native:") for k in bare)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


def test_py_spy_thread_lines_in_every_state_are_parsed():
    dump = (
        "Process 9926: VLLM::EngineCore\n"
        "Python v3.11.7 (/usr/bin/python3.11)\n\n"
        'Thread 9926 (active+gil): "MainThread"\n'
        "    step (vllm/v1/engine/core.py:668)\n"
        'Thread 10159 (idle): "rd2h-decode-0"\n'
        'Thread 10160 (active): "rd2h-zmq-drain-15504"\n'
        'Thread 0x7F1C2E5FF640 (idle): "no-native-id"\n'
    )
    assert sp.parse_pyspy_threads(dump) == {
        9926: "MainThread", 10159: "rd2h-decode-0", 10160: "rd2h-zmq-drain-15504"}


def test_other_groups_and_dead_processes_are_not_counted():
    p = _child()
    try:
        assert sp.group_thread_cpu_s(p.pid + 10**7) == {}
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
        assert sp.group_thread_cpu_s(p.pid) == {}
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
