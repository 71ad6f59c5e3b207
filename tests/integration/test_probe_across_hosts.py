"""``rd2h probe mooncake`` across two hosts (issue 42): the Prefill host serves a
patterned buffer and prints the Decode host's command; that command, run in the other
network namespace, reads it over Mooncake TCP through the bridge, verifies every byte
and reports the bandwidth; with the Decode host's link down it fails within its
deadline with one sentence saying why."""

from __future__ import annotations

import json
import queue
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import hosts as net
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RD2H = str(Path(sys.executable).parent / "rd2h")
SIZE = 16 << 20


def _lines(proc: subprocess.Popen) -> queue.Queue[str]:
    """The process's stdout lines, as they come (a thread reads them)."""
    out: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return out


def _line(lines: queue.Queue[str], deadline_s: float) -> str:
    try:
        return lines.get(timeout=deadline_s)
    except queue.Empty:
        raise AssertionError("the serving probe printed nothing in time") from None


def test_probe_reads_across_two_hosts_and_fails_cleanly_on_a_cut_link() -> None:
    made = net.create("pr", ("prefill", "decode"), subnet="10.231.11")
    p, d = made["prefill"], made["decode"]
    serve = subprocess.Popen(
        [*p.exec_prefix(), RD2H, "probe", "mooncake", "--serve", "--host", p.addr,
         "--bytes", str(SIZE), "--timeout", "240"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = _lines(serve)
    try:
        first = _line(lines, 60)
        assert first.startswith(f"rd2h probe: serving {SIZE} bytes at {p.addr}:"), first
        command = _line(lines, 5).strip()
        argv = shlex.split(command.replace("DECODE_HOST_ADDRESS", d.addr))
        assert argv[:3] == ["rd2h", "probe", "mooncake"], command
        read = [*d.exec_prefix(), RD2H, *argv[1:], "--iterations", "2", "--json"]
        rx0 = d.rx_tx_bytes()[0]
        done = subprocess.run(read, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        rx = d.rx_tx_bytes()[0] - rx0
        print(f"\nprobe across hosts: {report['bytes']} bytes x 3 reads verified, best "
              f"{report['best_gbps']:.2f} GB/s; the Decode host's link received {rx} B")
        assert report["verified"] and report["bytes"] == SIZE
        assert report["prefill_session"].startswith(p.addr + ":")
        assert rx >= 3 * SIZE, "the reads did not cross the Decode host's link"
        # The link cut: the reading side fails within its deadline, saying why.
        d.link(up=False)
        t0 = time.monotonic()
        cut = subprocess.run([*read[:-1], "--timeout", "10"], capture_output=True,
                             text=True, timeout=60)
        took = time.monotonic() - t0
        print(f"link cut: exit {cut.returncode} after {took:.1f} s: {cut.stderr.strip()}")
        assert cut.returncode == 1, cut.stderr
        assert cut.stderr.startswith("rd2h probe mooncake: "), cut.stderr
        assert len(cut.stderr.strip().splitlines()) == 1, cut.stderr
        assert took < 30
    finally:
        d.link(up=True)
        serve.terminate()  # SIGTERM: the serving probe stops cleanly
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait(10)
        net.delete(made)
    err = serve.stderr.read() if serve.stderr else ""
    assert serve.returncode == 0, err
    assert "stopped serving" in err, err
