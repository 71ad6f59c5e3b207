"""A one-entry-per-peer memo of read planning's layer-independent part."""

from __future__ import annotations

from typing import Any


class PlanMemo:
    """The last block plan (``rd2h.domain.planning.BlockPlan``) per owner (a Prefill
    connection), reused when the next message of that owner names equal requests
    (ids, blocks, starts), the same contributor position and rank topology, and the
    very same ``Destination`` objects. The memo holds those objects, so an identity
    match can never be a recycled object. At most ``capacity`` owners are remembered
    (the oldest is forgotten first)."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._entries: dict[object, tuple[tuple[object, ...], tuple[object, ...], Any]] = {}
        self.hits = 0

    def get(self, owner: object, key: tuple[object, ...],
            dests: tuple[object, ...]) -> Any:
        entry = self._entries.get(owner)
        if entry is None or entry[0] != key or len(entry[1]) != len(dests):
            return None
        if not all(a is b for a, b in zip(entry[1], dests)):
            return None
        self.hits += 1
        return entry[2]

    def put(self, owner: object, key: tuple[object, ...], dests: tuple[object, ...],
            plan: Any) -> None:
        self._entries.pop(owner, None)
        while len(self._entries) >= self.capacity:
            self._entries.pop(next(iter(self._entries)))
        self._entries[owner] = (key, dests, plan)

    def forget(self, owner: object) -> None:
        self._entries.pop(owner, None)

    def __len__(self) -> int:
        return len(self._entries)
