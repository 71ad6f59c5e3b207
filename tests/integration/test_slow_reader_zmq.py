"""A Decode control socket that stops reading for longer than the heartbeat timeout
survives (issue 29, part 1): real libzmq 4.3.5 sockets in two processes.

With a receive high-water mark set on the socket, libzmq stops reading a connection
whose queue to the application is full; when that connection then errors (a heartbeat
timeout, the peer closing it), libzmq aborts the whole process (``Assertion failed:
!_io_error (src/stream_engine_base.cpp:310)``): a Decode engine that was only slow died
on resume. rd2h's sockets set no libzmq limit (``rd2h.adapters.zmq.channel``). Each
case: Decode's ROUTER in a child process, a Prefill DEALER that floods it while Decode
does not read (its loop stuck, or the process stopped), then closes; Decode drains and
must exit normally."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from fakes.net import HOST, free_port

from rd2h.adapters.zmq.channel import ZmqControlClients

pytestmark = pytest.mark.integration

RECV_HWM = 64
STALL_S = 10.0  # past the 2 s heartbeat timeout of both sides

DECODE = r"""
import json, sys, time
from rd2h.adapters.zmq.channel import ZmqControlServer
port, stall, hwm = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
server = ZmqControlServer("127.0.0.1", port, heartbeat_ivl_s=0.5, heartbeat_timeout_s=2.0,
                          recv_hwm=hwm)
print("ready", flush=True)
got = 0
while got < 5:
    if server.recv(10.0) is not None:
        got += 1
print("stalling", flush=True)
time.sleep(stall)  # the loop stuck in a long read (0: the parent stops the process)
quiet_since = time.monotonic()
while time.monotonic() - quiet_since < 2.0:
    item = server.recv(0.5)
    server.disconnected()
    if item is not None:
        got += 1
        quiet_since = time.monotonic()
server.close()
print(json.dumps({"got": got}), flush=True)
"""


def _run(stop_process: bool) -> tuple[subprocess.CompletedProcess[str], dict[str, int]]:
    port = free_port()
    decode = subprocess.Popen(
        [sys.executable, "-c", DECODE, str(port), "0" if stop_process else str(STALL_S),
         str(RECV_HWM)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert decode.stdout is not None
    try:
        assert decode.stdout.readline().strip() == "ready"
        clients = ZmqControlClients(heartbeat_ivl_s=0.5, heartbeat_timeout_s=2.0)
        endpoint = f"tcp://{HOST}:{port}"
        clients.connect(endpoint)
        for _ in range(5):
            clients.send(endpoint, b"m" * 2000)
        assert decode.stdout.readline().strip() == "stalling"
        if stop_process:
            os.kill(decode.pid, signal.SIGSTOP)
        t0, sent = time.monotonic(), 0
        while time.monotonic() - t0 < 3.0:  # flood, then close, mid-stall
            try:
                clients.send(endpoint, b"y" * 2000, timeout=0.0)
                sent += 1
            except ConnectionError:
                time.sleep(0.01)
            clients.poll(0.0)
        clients.close()
        if stop_process:
            time.sleep(1.0)
            os.kill(decode.pid, signal.SIGCONT)
        out, _ = decode.communicate(timeout=60)
    finally:
        if decode.poll() is None:
            decode.kill()
            decode.wait()
    done = subprocess.CompletedProcess(decode.args, decode.returncode, out, "")
    last = out.strip().splitlines()[-1] if out.strip() else ""
    figures = json.loads(last) if last.startswith("{") else {}
    print(f"sent {sent} while Decode did not read; {figures}")
    return done, figures


@pytest.mark.parametrize("stop_process", [False, True], ids=["loop-stuck", "sigstop"])
def test_a_decode_that_stopped_reading_past_the_heartbeat_survives(stop_process: bool) -> None:
    done, figures = _run(stop_process)
    assert done.returncode == 0, f"decode died ({done.returncode}):\n{done.stdout[-2000:]}"
    assert "Assertion failed" not in done.stdout
    assert figures["got"] >= 5
