"""Clocks a test controls."""

from __future__ import annotations

import time


class ManualClock:
    """Monotonic time that a test can jump forward: deadlines pass without sleeping,
    while threads that wait on real conditions still make progress."""

    def __init__(self) -> None:
        self.offset = 0.0

    def now(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds
