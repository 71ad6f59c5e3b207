"""The stall capture (stall.py) on a real child process: its threads, their CPU share
and py-spy's stacks are in the capture, and ``watch`` captures only a late body."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import pytest
import stall

pytestmark = pytest.mark.integration

_CHILD = textwrap.dedent("""
    import threading, time
    def spinning_here():
        while True:
            sum(range(1000))
    def parked_here():
        time.sleep(3600)
    threading.Thread(target=spinning_here, name="spinner", daemon=True).start()
    print("ready", flush=True)
    parked_here()
""")


@dataclass
class _Proc:
    name: str
    proc: subprocess.Popen
    url: str | None = None


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    server = _Proc("child", proc)
    stall.live[id(server)] = server
    try:
        yield server
    finally:
        stall.live.pop(id(server), None)
        proc.kill()
        proc.wait(10)


def test_a_capture_names_each_thread_its_cpu_and_its_stack(child, tmp_path, monkeypatch):
    monkeypatch.setenv("RD2H_STALL_DIR", str(tmp_path))
    cap = stall.snapshot("probe", 7.0)
    whole = cap.path.read_text()
    assert cap.path.parent == tmp_path
    assert f"== child pid {child.proc.pid}" in cap.summary
    assert "spinning_here" in whole and "parked_here" in whole  # py-spy's stacks
    spinner = next(ln for ln in whole.splitlines() if "'python" in ln or "spinner" in ln
                   if "%" in ln and "wchan" in ln)
    assert spinner  # a per-thread line with CPU share and wait channel
    # The spinning thread is the busy one, and the summary shows where it spins.
    busy = [ln for ln in cap.summary.splitlines() if "spinning_here" in ln]
    assert busy, cap.summary
    share = int(busy[0].split("%")[0].split()[-1])
    assert share >= 20, busy[0]
    stall.captures.remove(cap)


def test_watch_captures_a_late_body_only(child, tmp_path, monkeypatch):
    monkeypatch.setenv("RD2H_STALL_DIR", str(tmp_path))
    monkeypatch.setattr(stall, "LATE_S", 0.3)
    monkeypatch.setattr(stall, "AGAIN_S", 600.0)
    before = len(stall.captures)
    with stall.watch("quick"):
        pass
    assert len(stall.captures) == before
    with stall.watch("slow"):
        time.sleep(0.6)
    # The capture started at 0.3 s and the watch waits for it on the way out.
    assert [c.label for c in stall.captures[before:]] == ["slow"]
    del stall.captures[before:]
