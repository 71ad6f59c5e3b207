"""Read planning on Decode for one READ_READY_BATCH (spec 5), vectorised with numpy.

The planner turns a message, the two layouts and this rank's destination block
lists into one batch of read descriptors (three int64 arrays) covering every
request of the message, plus per-request ownership facts. Any rule violation
fails the whole layer with ``PlanningError``: the caller answers READ_FAILED.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from rd2h.domain.errors import PlanningError
from rd2h.domain.layout import (
    DestinationLayout,
    DestTensor,
    SourceLayout,
    TensorComponent,
    validate_layout,
)
from rd2h.domain.protocol import ReadReadyBatch
from rd2h.domain.topology import owned_range

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Destination:
    """Decode's own destination block lists for one request (never leave Decode)."""

    main_block_ids: Sequence[int]
    indexer_block_ids: Sequence[int]


@dataclass(frozen=True)
class RequestOwnership:
    """What this rank owns of one request in one message, and what it built for it."""

    ext_req_id: str
    main_blocks: int
    indexer_blocks: int
    descriptors: int

    @property
    def owns_nothing(self) -> bool:
        return self.main_blocks == 0 and self.indexer_blocks == 0


@dataclass(frozen=True)
class ReadPlan:
    """One batched read: ``lengths[i]`` bytes from ``remote_addrs[i]`` to ``local_addrs[i]``."""

    local_addrs: np.ndarray
    remote_addrs: np.ndarray
    lengths: np.ndarray
    requests: tuple[RequestOwnership, ...]
    blocks: int

    @property
    def num_descriptors(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.lengths.sum()) if self.lengths.size else 0

    @property
    def owns_nothing(self) -> bool:
        return all(r.owns_nothing for r in self.requests)


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


def _gather(parts: list[Sequence[int]], total: int) -> np.ndarray:
    if total == 0:
        return _EMPTY
    return np.fromiter(chain.from_iterable(parts), dtype=np.int64, count=total)


def _descriptors(
    src_blocks: np.ndarray,
    dst_blocks: np.ndarray,
    pairs: Sequence[tuple[TensorComponent, DestTensor]],
    layer: str,
    component: str,
    out: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> None:
    if src_blocks.size == 0:
        return
    for src, dst in pairs:
        if int(dst_blocks.max()) >= dst.num_blocks:
            raise PlanningError(
                layer,
                f"{component} destination block {int(dst_blocks.max())} is beyond the "
                f"{dst.num_blocks} blocks of the destination",
            )
        size = src.bytes_per_block
        out.append(
            (
                dst.base_addr + dst_blocks * size,
                src.base_addr + src_blocks * size,
                np.full(src_blocks.shape[0], size, dtype=np.int64),
            )
        )


def plan_reads(
    batch: ReadReadyBatch,
    src: SourceLayout,
    dst: DestinationLayout,
    destinations: Mapping[str, Destination],
    *,
    d_rank: int,
    d_tp: int,
) -> ReadPlan:
    """Plan this Decode rank's share of a READ_READY_BATCH.

    Main K/V is read only by contributor member 0 and split over the Decode TP
    ranks (rotated by the chunk's start); the indexer and LIC8 scale are split
    over the contributor members so every Decode rank ends with a full copy.
    Raises ``LayoutMismatch`` or ``PlanningError``; either fails the whole layer.
    """
    validate_layout(src, dst)
    layer = batch.layer_name
    member, ratio = batch.group_member_idx, max(1, batch.tp_ratio)
    read_main = member == 0 and bool(src.main)
    read_indexer = src.indexer is not None

    main_src: list[Sequence[int]] = []
    main_dst: list[Sequence[int]] = []
    idx_src: list[Sequence[int]] = []
    idx_dst: list[Sequence[int]] = []
    n_main = n_idx = 0
    idx_tensors = 1 + (src.scale is not None)
    facts: list[RequestOwnership] = []

    for req in batch.read_reqs:
        ext = req.ext_req_id
        dest = destinations.get(ext)
        if dest is None:
            raise PlanningError(layer, "no destination blocks are known for it", ext)
        p_main, p_idx = req.p_main_block_ids, req.p_indexer_block_ids
        if not p_main and not p_idx:
            raise PlanningError(layer, "the read request names no blocks", ext)
        owned_main = owned_idx = 0
        if read_main and p_main:
            n, s = len(p_main), req.main_start_block
            if s + n > len(dest.main_block_ids):
                raise PlanningError(
                    layer,
                    f"main blocks [{s}, {s + n}) do not fit the "
                    f"{len(dest.main_block_ids)} destination blocks",
                    ext,
                )
            lo, hi = owned_range(n, d_tp, d_rank, s)
            if hi > lo:
                main_src.append(p_main[lo:hi])
                main_dst.append(dest.main_block_ids[s + lo : s + hi])
                owned_main = hi - lo
                n_main += owned_main
        if read_indexer and p_idx:
            n, s = len(p_idx), req.indexer_start_block
            if s + n > len(dest.indexer_block_ids):
                raise PlanningError(
                    layer,
                    f"indexer blocks [{s}, {s + n}) do not fit the "
                    f"{len(dest.indexer_block_ids)} destination blocks",
                    ext,
                )
            lo, hi = owned_range(n, ratio, member, s) if ratio > 1 else (0, n)
            if hi > lo:
                idx_src.append(p_idx[lo:hi])
                idx_dst.append(dest.indexer_block_ids[s + lo : s + hi])
                owned_idx = hi - lo
                n_idx += owned_idx
        built = owned_main * len(src.main) + owned_idx * idx_tensors
        if (owned_main or owned_idx) and built == 0:
            raise PlanningError(layer, "this rank owns blocks but built no descriptor", ext)
        facts.append(RequestOwnership(ext, owned_main, owned_idx, built))

    out: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    if n_main:
        _descriptors(
            _gather(main_src, n_main), _gather(main_dst, n_main),
            list(zip(src.main, dst.main)), layer, "main", out,
        )
    if n_idx:
        pairs = [(src.indexer, dst.indexer)]
        if src.scale is not None:
            pairs.append((src.scale, dst.scale))
        _descriptors(
            _gather(idx_src, n_idx), _gather(idx_dst, n_idx), pairs, layer, "indexer", out,
        )
    if not out:
        return ReadPlan(_EMPTY, _EMPTY, _EMPTY, tuple(facts), 0)
    local = np.concatenate([o[0] for o in out])
    remote = np.concatenate([o[1] for o in out])
    lengths = np.concatenate([o[2] for o in out])
    local, remote, lengths = coalesce(local, remote, lengths)
    return ReadPlan(local, remote, lengths, tuple(facts), n_main + n_idx)
