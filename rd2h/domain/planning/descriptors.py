"""Read descriptors of one message from its owned blocks, as a per-layer template.

A tensor whose page is its whole block on both sides is read in runs of consecutive
blocks; one whose page is a part of its block (vLLM's packed layouts: other layers'
pages lie between) is read one page per block, never the bytes around it.

Every layer of a chunk names the same blocks; only the tensors' base addresses differ
from layer to layer (their block sizes and head slices are the same). So the block
arithmetic (runs of consecutive blocks, offsets, lengths) is done once per block plan
and layer shape (``DescriptorTemplate``), and each layer's descriptors are the
template's offsets plus that layer's base of each tensor: two array operations per
side instead of a dozen. The values are exactly those of computing each layer afresh.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from rd2h.domain.planning.layout import DestTensor, MainSlice, TensorComponent

_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.setflags(write=False)


class Blocks(Protocol):
    """Owned blocks of one component (``planning._Component``)."""

    src: np.ndarray
    dst: np.ndarray

    @property
    def runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


Group = tuple[Blocks, Sequence[tuple[TensorComponent, DestTensor]], str,
              Sequence[MainSlice] | None]


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.int64)
    a.setflags(write=False)
    return a


@dataclass(frozen=True)
class DescriptorTemplate:
    """Descriptors with every base address 0: ``local_off[i] + d_base[row[i]]`` is
    descriptor i's destination (``remote_off``, ``p_base``: its source)."""

    local_off: np.ndarray
    remote_off: np.ndarray
    lengths: np.ndarray
    row: np.ndarray
    tensors: int  # rows: the tensors that have descriptors, in order
    # Where one tensor's descriptors end and the next one's start, for the boundary
    # merge, as integers: (row before, local end of the descriptor before, row after,
    # local start of the one after, remote end before, remote start after).
    seams: tuple[tuple[int, int, int, int, int, int], ...] = ()
    total_bytes: int = 0

    @staticmethod
    def build(groups: Sequence[Group]) -> DescriptorTemplate:
        local, remote, lengths, rows, edges = [], [], [], [], []
        at = tensor = 0
        for comp, pairs, _, slices in groups:
            if comp.src.size == 0 or not pairs:
                continue
            for t, (src, dst) in enumerate(pairs):
                whole = src.page == src.bytes_per_block and dst.page == dst.bytes_per_block
                if slices is None and whole:
                    p_start, d_start, length = comp.runs
                else:  # slices or pages of blocks are not contiguous: one per block
                    p_start, d_start = comp.src, comp.dst
                    length = np.ones(p_start.shape[0], dtype=np.int64)
                m = p_start.shape[0]
                nbytes = src.page if slices is None else slices[t].nbytes
                local.append(d_start * dst.bytes_per_block)
                remote.append(p_start * src.bytes_per_block)
                lengths.append(length * nbytes)
                rows.append(np.full(m, tensor, dtype=np.intp))
                tensor += 1
                at += m
                edges.append(at)
        if not local:
            return DescriptorTemplate(_EMPTY, _EMPTY, _EMPTY, np.zeros(0, np.intp), 0)
        lo, ro, ln = (_frozen(np.concatenate(a)) for a in (local, remote, lengths))
        row = np.concatenate(rows)
        cuts = tuple(edges[:-1])
        seams = tuple((int(row[c - 1]), int(lo[c - 1] + ln[c - 1]), int(row[c]), int(lo[c]),
                       int(ro[c - 1] + ln[c - 1]), int(ro[c])) for c in cuts)
        return DescriptorTemplate(lo, ro, ln, row, tensor, seams, int(ln.sum()))

    def merges_seam(self, bases: Any) -> bool:
        """Whether, at these base addresses, a tensor boundary is contiguous on both sides
        (``layer`` then merges it)."""
        d_ints, p_ints = bases[2], bases[3]
        return any(end_l + d_ints[ra] == start_l + d_ints[rb]
                   and end_r + p_ints[ra] == start_r + p_ints[rb]
                   for ra, end_l, rb, start_l, end_r, start_r in self.seams)

    def layers(self, d: Sequence[np.ndarray], p: Sequence[np.ndarray]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The descriptors of several layers of this template, one after the other, from
        each layer's base addresses (``d[k]``, ``p[k]``); no seam of theirs merges
        (``merges_seam``)."""
        if not self.tensors:
            return _EMPTY.copy(), _EMPTY.copy(), _EMPTY.copy()
        row, n = self.row, len(d)
        local = (np.stack(d)[:, row] + self.local_off).ravel()
        remote = (np.stack(p)[:, row] + self.remote_off).ravel()
        return local, remote, np.tile(self.lengths, n)

    def layer(self, d: np.ndarray, p: np.ndarray, d_ints: Sequence[int],
              p_ints: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One layer's descriptors from its base addresses per row (``LayerPair.bases``:
        arrays for the offsets, integers for the boundary merge). A tensor boundary
        contiguous on both sides (adjacent tensors) still merges."""
        if not self.tensors:
            return _EMPTY.copy(), _EMPTY.copy(), _EMPTY.copy()
        row = self.row
        local = self.local_off + d[row]
        remote = self.remote_off + p[row]
        for ra, end_l, rb, start_l, end_r, start_r in self.seams:
            if (end_l + d_ints[ra] == start_l + d_ints[rb]
                    and end_r + p_ints[ra] == start_r + p_ints[rb]):
                return coalesce(local, remote, self.lengths.copy())
        return local, remote, self.lengths


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
