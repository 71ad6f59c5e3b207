"""Decode destination memory port: where pulled KV lands (spec 2).

Two adapters: vLLM's own registered KV caches (each Decode rank has a rank-local
main cache, so every rank pulls all main blocks) and a SparseKVOffloadManager-style
TP-shared pinned host pool (each rank pulls a disjoint share of main KV).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, Protocol

from rd2h.domain.planning.layout import DestinationLayout

MainSharing = Literal["rank_local", "shared_pool"]


class DecodeDestinations(Protocol):
    @property
    def main_sharing(self) -> MainSharing:
        """``shared_pool``: one main pool for all Decode TP ranks (each reads its share);
        ``rank_local``: every rank has its own main cache and reads every main block."""
        ...

    def layouts(self) -> Mapping[str, DestinationLayout]:
        """Per cache layer name, the destination tensors (main, indexer, scale)."""
        ...

    def regions(self) -> Sequence[tuple[int, int]]:
        """``(addr, size)`` of every destination region, to register with the transport."""
        ...
