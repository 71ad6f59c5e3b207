"""The demo parent's cues to its rank processes: multiprocessing events, one per phase
of each round, created before the ranks start (so every rank inherits them).

The Decode ranks' wake-ups are semaphores, not events: a rank killed on purpose (the
demo's faults) may die at any instruction, and an event's internal lock held by a
dead process would block everyone who touches that event later. A semaphore post
takes no lock."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Signals:
    admit: list[Any]  # per round: Decode ranks admit that round's requests and step
    announce: list[Any]  # per round: Prefill ranks announce that round's layers
    bare: list[Any]  # per round: Decode ranks replay round 0's reads on the bare transport
    settle: Any  # every Prefill rank is done: Decode waits out late state
    release: Any  # the run is over: Prefill may free its memory
    wake: list[Any]  # per Decode rank, a semaphore: some Decode rank has news, step now

    @classmethod
    def create(cls, ctx: Any, rounds: int, decode_tp: int) -> Signals:
        return cls(
            admit=[ctx.Event() for _ in range(rounds)],
            announce=[ctx.Event() for _ in range(rounds)],
            bare=[ctx.Event() for _ in range(rounds)],
            settle=ctx.Event(), release=ctx.Event(),
            wake=[ctx.Semaphore(0) for _ in range(decode_tp)],
        )

    def every(self) -> list[Any]:
        """Every event (the parent sets them all when the run ends, whatever happened)."""
        return [*self.admit, *self.announce, *self.bare, self.settle, self.release]

    def wake_all(self) -> None:
        """A Decode rank reached news (a request ended here): every Decode rank steps,
        since a step is a collective all of them must join."""
        for sem in self.wake:
            sem.release()

    def drain_wake(self, d_rank: int) -> None:
        """Forget the wake-ups so far: news from now on wakes ``wait_wake``."""
        while self.wake[d_rank].acquire(False):
            pass

    def wait_wake(self, d_rank: int, timeout: float) -> None:
        self.wake[d_rank].acquire(True, timeout)
