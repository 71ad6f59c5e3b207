"""All-gather of small objects among the Decode TP ranks."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any


class TorchDistExchange:
    """torch.distributed over gloo (CPU), for real multi-process Decode groups.

    Either joins an existing process group (``group``, e.g. vLLM's TP CPU group)
    or initialises the default one from ``init_method``. gloo's own timeout bounds
    every collective; ``all_gather``'s ``timeout`` must not exceed it.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        init_method: str | None = None,
        group: Any = None,
        timeout_s: float = 60.0,
    ) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._rank = rank
        self._world = world_size
        self._group = group
        self._owns_group = False
        if group is None:
            if init_method is None:
                raise ValueError("TorchDistExchange needs a group or an init_method")
            dist.init_process_group(
                "gloo", init_method=init_method, rank=rank, world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )
            self._owns_group = True

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def all_gather(self, obj: Any, timeout: float) -> Sequence[Any]:
        out: list[Any] = [None] * self._world
        try:
            self._dist.all_gather_object(out, obj, group=self._group)
        except RuntimeError as exc:  # gloo reports its timeout and peer loss this way
            raise TimeoutError(f"TP exchange failed: {exc}") from exc
        return out

    def close(self) -> None:
        if self._owns_group and self._dist.is_initialized():
            self._dist.destroy_process_group()
            self._owns_group = False


class InMemoryExchangeGroup:
    """Threads standing in for TP ranks (tests)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._slots: list[Any] = [None] * world_size
        self._barrier = threading.Barrier(world_size)
        self._lock = threading.Lock()

    def member(self, rank: int) -> InMemoryExchange:
        return InMemoryExchange(self, rank)

    def _gather(self, rank: int, obj: Any, timeout: float) -> list[Any]:
        try:
            with self._lock:
                self._slots[rank] = obj
            self._barrier.wait(timeout)
            out = list(self._slots)
            self._barrier.wait(timeout)
        except threading.BrokenBarrierError as exc:
            raise TimeoutError("TP exchange timed out or a rank left") from exc
        return out


class InMemoryExchange:
    def __init__(self, group: InMemoryExchangeGroup, rank: int) -> None:
        self._group = group
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._group.world_size

    def all_gather(self, obj: Any, timeout: float) -> Sequence[Any]:
        return self._group._gather(self._rank, obj, timeout)
