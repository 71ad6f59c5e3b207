"""Decode's destination block lists for one request, as the read planner slices them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rd2h.domain.planning.kv_groups import NO_BLOCK


def _as_ids(values: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.array(values, dtype=np.int64).reshape(-1)
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class Destination:
    """Decode's own destination block lists for one request (never leave Decode).

    Stored once as read-only int64 arrays: every layer's plan slices them. ``groups``:
    every KV cache group's list (vLLM), for layers whose ``DestinationLayout.group``
    names their group. ``NO_BLOCK`` (negative) marks a position with no block (outside
    a sliding window): nothing is read into it.
    """

    main_block_ids: np.ndarray
    indexer_block_ids: np.ndarray
    groups: tuple[np.ndarray, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "main_block_ids", _as_ids(self.main_block_ids))
        object.__setattr__(self, "indexer_block_ids", _as_ids(self.indexer_block_ids))
        object.__setattr__(self, "groups", tuple(map(_as_ids, self.groups)))

    def main_for(self, group: int | None) -> np.ndarray:
        """The list a layer's main tensors read into: its group's, else the main list."""
        if group is None or not self.groups:
            return self.main_block_ids
        if group >= len(self.groups):
            raise IndexError(f"no block ids for KV cache group {group}")
        return self.groups[group]

    def block_ids(self) -> set[int]:
        """Every real block of the request, over all lists (``NO_BLOCK`` left out)."""
        out: set[int] = set()
        for ids in (self.main_block_ids, self.indexer_block_ids, *self.groups):
            out.update(ids[ids != NO_BLOCK].tolist())
        return out
