"""Device events: record after a layer's KV scatter, wait with a deadline."""

from __future__ import annotations

import time
from typing import Any


class CpuDeviceEvents:
    """CPU tensors: the scatter is complete when the call returns, so there is nothing
    to wait for (None: the sender announces the layer at once, with no hand-off to its
    event-waiting thread)."""

    def record(self) -> None:
        return None


class NpuEvent:
    """An Ascend NPU event, polled until complete or the deadline passes."""

    def __init__(self, event: Any, poll_s: float = 0.0005) -> None:
        self._event = event
        self._poll = poll_s

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._event.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(self._poll)
        return True


class NpuDeviceEvents:
    """Records events on the current NPU stream. torch_npu is imported here, lazily,
    so that CPU machines never load it."""

    def __init__(self) -> None:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)

        self._torch = torch

    def record(self) -> NpuEvent:
        event = self._torch.npu.Event()
        event.record()
        return NpuEvent(event)
