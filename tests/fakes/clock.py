"""Clocks a test controls."""

from __future__ import annotations

import time
from collections.abc import Callable


class ManualClock:
    """Monotonic time that a test can jump forward: deadlines pass without sleeping,
    while threads that wait on real conditions still make progress. The drivers sleep
    until their next deadline, so a jump wakes those registered with ``wakes``."""

    def __init__(self) -> None:
        self.offset = 0.0
        self._wakes: list[Callable[[], None]] = []

    def now(self) -> float:
        return time.monotonic() + self.offset

    def wakes(self, *drivers: Callable[[], None]) -> None:
        """Call each of ``drivers`` (e.g. a sender's ``wake``) after every ``advance``."""
        self._wakes.extend(drivers)

    def advance(self, seconds: float) -> None:
        self.offset += seconds
        for wake in self._wakes:
            wake()
