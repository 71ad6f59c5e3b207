"""Free ports and bounded waits for tests (the one copy)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from rd2h.demo.run import free_ports  # consecutive free ports (the demo's own helper)

__all__ = ["HOST", "free_port", "free_ports", "wait_until"]

HOST = "127.0.0.1"


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
