"""A one-entry-per-peer memo of read planning's layer-independent part."""

from __future__ import annotations

from typing import Any

from rd2h.domain.planning.layer_pair import LayerPair
from rd2h.domain.planning.layout import DestinationLayout, SourceLayout


class PlanMemo:
    """The last block plan (``rd2h.domain.planning.planning.BlockPlan``) per owner (a Prefill
    connection), reused when the next message of that owner names equal requests
    (ids, blocks, starts), the same contributor position and rank topology, and the
    very same ``Destination`` objects. The memo holds those objects, so an identity
    match can never be a recycled object. At most ``capacity`` owners are remembered
    (the oldest is forgotten first)."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._entries: dict[object, tuple[tuple[object, ...], tuple[object, ...], Any]] = {}
        self.hits = 0
        # (id(src), id(dst)) -> the ``LayerPair`` of a pair that passed
        # ``validate_layout``; it holds both objects, so their ids are not reused.
        self._layouts: dict[tuple[int, int], LayerPair] = {}
        self.layout_capacity = 8 * 1024

    def pair(self, src: SourceLayout, dst: DestinationLayout) -> LayerPair:
        """The ``LayerPair`` of two layouts (``validate_layout`` raises ``LayoutMismatch``),
        derived once per pair of layout objects (a peer's layouts are fixed by its
        MF_META, Decode's by its cache); a pair that failed is checked again each time."""
        key = (id(src), id(dst))
        hit = self._layouts.get(key)
        if hit is not None and hit.src is src and hit.dst is dst:
            return hit
        pair = LayerPair.of(src, dst)
        if len(self._layouts) >= self.layout_capacity:
            self._layouts.clear()  # many peers' MF_META came and went: start again
        self._layouts[key] = pair  # it holds both objects: their ids are not reused
        return pair

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
        self._layouts.clear()  # a peer's layouts went with it (the next ones are new)

    def __len__(self) -> int:
        return len(self._entries)
