"""Free ports and bounded waits for tests (the one copy)."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable

from rd2h.demo.run import free_ports, ports_free  # the demo's own helpers

__all__ = ["HOST", "free_port", "free_ports", "quiet_ports", "wait_until"]

HOST = "127.0.0.1"


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def quiet_ports(count: int, host: str = HOST) -> int:
    """A base port with ``count`` consecutive ports free now, chosen *below* the
    kernel's ephemeral range, so that no process's outgoing connection or port-0 bind
    takes one before it is bound: for ports bound minutes later (a vLLM worker's
    control socket binds after the model loads)."""
    rnd = random.Random()
    top = _ephemeral_low() - count
    for _ in range(200):
        base = rnd.randrange(10_000, top)
        if ports_free(base, count, host):
            return base
    raise RuntimeError("could not find free consecutive ports below the ephemeral range")


def free_port(host: str = HOST) -> int:
    """A TCP port free on ``host`` right now (it may be taken before it is bound:
    binders retry)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])




def wait_until(cond: Callable[[], bool], what: str = "the condition",
               timeout: float = 5.0) -> None:
    """Poll ``cond`` until it holds; ``AssertionError`` naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        pause.wait(0.002)
