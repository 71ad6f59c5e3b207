"""What read planning produces: one batched read and its per-request facts."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from rd2h.domain.wire.digests import BlockChecks


class RequestOwnership(NamedTuple):
    """What this rank owns of one request in one message, and what it built for it
    (``descriptors`` counts one per owned block per tensor, before coalescing)."""

    ext_req_id: str
    main_blocks: int
    indexer_blocks: int
    descriptors: int

    @property
    def owns_nothing(self) -> bool:
        return self.main_blocks == 0 and self.indexer_blocks == 0


@dataclass(frozen=True)
class ReadPlan:
    """One batched read: ``lengths[i]`` bytes from ``remote_addrs[i]`` to ``local_addrs[i]``.

    ``requests`` gives the per-request ownership facts, in message order (built on
    first access from the per-request counts).
    """

    local_addrs: np.ndarray
    remote_addrs: np.ndarray
    lengths: np.ndarray
    ext_req_ids: tuple[str, ...]
    main_blocks: np.ndarray
    indexer_blocks: np.ndarray
    descriptors_built: np.ndarray
    blocks: int
    # ``verify_kv``: the digests to check after the read (None: none stated).
    checks: BlockChecks | None = None
    nbytes: int | None = None  # ``lengths``' sum, where the planner knows it already

    @cached_property
    def requests(self) -> tuple[RequestOwnership, ...]:
        return tuple(
            map(
                RequestOwnership,
                self.ext_req_ids,
                self.main_blocks.tolist(),
                self.indexer_blocks.tolist(),
                self.descriptors_built.tolist(),
            )
        )

    @property
    def num_descriptors(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def total_bytes(self) -> int:
        if self.nbytes is not None:
            return self.nbytes
        return int(self.lengths.sum()) if self.lengths.size else 0

    @property
    def owns_nothing(self) -> bool:
        return not (self.main_blocks.any() or self.indexer_blocks.any())


def coalesce(
    local: np.ndarray, remote: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge runs of descriptors that are contiguous on both sides, keeping order."""
    if lengths.size <= 1:
        return local, remote, lengths
    ends_l = local[:-1] + lengths[:-1]
    ends_r = remote[:-1] + lengths[:-1]
    joins = (ends_l == local[1:]) & (ends_r == remote[1:])
    if not joins.any():
        return local, remote, lengths
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return local[starts], remote[starts], np.add.reduceat(lengths, starts)
