"""All-gather of small objects among the Decode TP ranks."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

SLOT_BYTES = 8192
"""Bytes each rank contributes to one fixed-size all-gather: an 8-byte length and the
pickled object. A step's report (terminal request ids) fits; a larger one makes every
rank fall back to ``all_gather_object`` (two collectives) for that exchange."""

_HEADER = 8
_OVERFLOW = -1


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
        """Every rank's ``obj``, in one collective of fixed-size slots (``all_gather_object``
        needs two: the sizes, then the padded data); one collective is about half the
        latency, which Decode's completion step pays on every engine step). A group of
        one rank has nothing to exchange: no collective at all."""
        if self._world == 1:
            return [obj]
        import torch

        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        fits = len(data) <= SLOT_BYTES - _HEADER
        slot = torch.zeros(SLOT_BYTES, dtype=torch.uint8)
        slot[:_HEADER] = torch.tensor([len(data) if fits else _OVERFLOW],
                                      dtype=torch.int64).view(torch.uint8)
        if fits and data:
            slot[_HEADER:_HEADER + len(data)] = torch.frombuffer(bytearray(data),
                                                                dtype=torch.uint8)
        slots = [torch.empty(SLOT_BYTES, dtype=torch.uint8) for _ in range(self._world)]
        try:
            self._dist.all_gather(slots, slot, group=self._group)
            sizes = [int(s[:_HEADER].view(torch.int64)[0]) for s in slots]
            if _OVERFLOW in sizes:  # every rank sees it: all fall back together
                out: list[Any] = [None] * self._world
                self._dist.all_gather_object(out, obj, group=self._group)
                return out
        except RuntimeError as exc:  # gloo reports its timeout and peer loss this way
            raise TimeoutError(f"TP exchange failed: {exc}") from exc
        if any(not 0 <= n <= SLOT_BYTES - _HEADER for n in sizes):
            raise TimeoutError(f"TP exchange failed: a rank sent a malformed slot ({sizes})")
        return [pickle.loads(s[_HEADER:_HEADER + n].numpy().tobytes())
                for s, n in zip(slots, sizes)]

    def close(self) -> None:
        if self._owns_group and self._dist.is_initialized():
            self._dist.destroy_process_group()
            self._owns_group = False


class SoloExchange:
    """A TP group of one rank (Decode at TP 1): nothing to exchange. Decode resolves its
    completions on every engine step; a one-party barrier there would cost two lock
    round trips a step for no purpose."""

    rank = 0
    world_size = 1

    def all_gather(self, obj: Any, timeout: float) -> Sequence[Any]:
        return [obj]


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
