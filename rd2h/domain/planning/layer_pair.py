"""What read planning needs of one pair of layouts (a Prefill layer's, Decode's), once.

A peer's layouts are fixed by its MF_META and Decode's by its cache, and every message
of that layer pairs the same two objects; so the layout check, the head split's slices,
the tensor pairs, the limits the source and destination block ids must stay under, and
the tensors' base addresses in descriptor order are worked out once per pair (the
``PlanMemo`` keeps them) instead of once per message. Planning compares a block plan's
highest and lowest ids with these limits as plain integers, and only where one is
crossed runs the exact checks that name the block and request at fault.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from rd2h.domain.errors import LayoutMismatch
from rd2h.domain.planning.layout import (
    DestinationLayout,
    DestTensor,
    MainSlice,
    SourceLayout,
    TensorComponent,
    main_slices,
    validate_layout,
)
from rd2h.domain.planning.state_split import StateSplitError, state_slices

_INT64_MAX = (1 << 63) - 1

Pairs = tuple[tuple[TensorComponent, DestTensor], ...]


class Bases(NamedTuple):
    """Per tensor that gets descriptors, in row order: Decode's and Prefill's base address
    (arrays, and the same as integers)."""

    local: np.ndarray
    remote: np.ndarray
    local_ints: tuple[int, ...]
    remote_ints: tuple[int, ...]


def block_limit(tensor: TensorComponent) -> tuple[int, bool]:
    """The first source block id of ``tensor`` that may not be read, and whether it is
    the end of the region Prefill advertised (else where ``(block + 1) * size + base``
    would leave the 64-bit range), in exact integer arithmetic."""
    room = (_INT64_MAX - tensor.base_addr) // max(1, tensor.bytes_per_block)
    if tensor.num_blocks is not None and tensor.num_blocks <= room:
        return tensor.num_blocks, True
    return room, False


def source_limit(tensors: Sequence[TensorComponent]) -> int:
    """``block_limit``'s smallest over ``tensors`` (``_INT64_MAX`` for none)."""
    return min((block_limit(t)[0] for t in tensors), default=_INT64_MAX)


def _state_split(src: SourceLayout, dst: DestinationLayout) -> tuple[MainSlice, ...] | None:
    """The runs of a state page this Decode rank reads from this Prefill rank when their
    TP sizes differ and both state their position (``state_split``); None otherwise
    (equal TP: the page moves whole; a side that does not state it: pages must match).
    Each side's page must be exactly its rank's state bytes."""
    geometry = dst.geometry
    if geometry is None or dst.state is None or src.state is None:
        return None
    if src.state[1] == dst.state[1]:
        return None
    layer = dst.layer_name
    if len(src.main) != 1 or len(dst.main) != 1:
        raise LayoutMismatch(layer, "main", "a state layer split across TP sizes must have "
                             f"one page (prefill {len(src.main)}, decode {len(dst.main)})")
    for side, pos, tensor in (("prefill", src.state, src.main[0]),
                              ("decode", dst.state, dst.main[0])):
        try:
            _, nbytes = geometry.local(pos[1], pos[0])
        except StateSplitError as exc:
            raise LayoutMismatch(layer, "main", f"{side}: {exc}") from None
        if tensor.page != nbytes:
            raise LayoutMismatch(layer, "main", f"{side} rank {pos[0]} of TP {pos[1]} states "
                                 f"a {tensor.page}-byte state page; its state is {nbytes} "
                                 f"bytes ({geometry.kind})")
    runs = state_slices(geometry, src.state, dst.state, layer)
    if not runs:
        raise LayoutMismatch(layer, "main", f"prefill rank {src.state[0]} of TP "
                             f"{src.state[1]} holds none of decode rank {dst.state[0]}'s "
                             "state")
    return runs


@dataclass(frozen=True)
class LayerPair:
    """The per-pair constants of planning (see the module docstring)."""

    src: SourceLayout
    dst: DestinationLayout
    slices: tuple[MainSlice, ...] | None
    main_pairs: Pairs
    index_pairs: Pairs
    main_src_limit: int  # source block ids of main must stay below this
    index_src_limit: int  # and of the indexer (and scale)
    main_dst_blocks: int  # destination ids of main must stay below this
    index_dst_blocks: int
    shape: tuple[object, ...]  # what a descriptor template depends on besides the blocks
    # (main has blocks, indexer has blocks) -> ``Bases``
    _bases: dict[tuple[bool, bool], Bases] = field(
        default_factory=dict, compare=False, repr=False)
    # What a block plan depends on besides the message: main, indexer, head split, group.
    kind: tuple[object, ...] = ()
    # ``slices`` are a state page's runs across TP sizes (``state_split``), not heads.
    state_split: bool = False

    @staticmethod
    def of(src: SourceLayout, dst: DestinationLayout) -> LayerPair:
        """Check the pair (``validate_layout``: raises ``LayoutMismatch``) and derive it."""
        split = _state_split(src, dst)
        validate_layout(src, dst, state_split=split is not None)
        if split is None:
            slices = main_slices(src, dst)
            main_pairs = tuple(zip(src.main, dst.main))
        else:  # one descriptor row per run of the state page
            slices = split
            main_pairs = ((src.main[0], dst.main[0]),) * len(split)
        index_pairs: Pairs = ()
        if src.indexer is not None and dst.indexer is not None:
            index_pairs = ((src.indexer, dst.indexer),)
            if src.scale is not None and dst.scale is not None:
                index_pairs += ((src.scale, dst.scale),)
        index_src = [t for t in (src.indexer, src.scale) if t is not None]
        shape = (tuple((s.bytes_per_block, d.bytes_per_block, s.page, d.page)
                       for s, d in main_pairs),
                 None if slices is None else tuple(slices),
                 tuple((s.bytes_per_block, d.bytes_per_block, s.page, d.page)
                       for s, d in index_pairs))
        return LayerPair(
            src, dst, slices, main_pairs, index_pairs,
            source_limit(src.main), source_limit(index_src),
            min((d.num_blocks for _, d in main_pairs), default=_INT64_MAX),
            min((d.num_blocks for _, d in index_pairs), default=_INT64_MAX),
            shape,
            kind=(bool(src.main), src.indexer is not None, slices is not None, dst.group),
            state_split=split is not None,
        )

    def bases(self, main: bool, index: bool) -> Bases:
        """Base addresses (Decode's, Prefill's) of the tensors that get descriptors, in
        the template's row order: main's tensors when ``main`` has blocks, then the
        indexer's (and scale's) when ``index`` has; a head split adds each slice's offset."""
        key = (main, index)
        hit = self._bases.get(key)
        if hit is None:
            d_bases: list[int] = []
            p_bases: list[int] = []
            if main:
                for t, (src, dst) in enumerate(self.main_pairs):
                    cut = None if self.slices is None else self.slices[t]
                    d_bases.append(dst.base_addr + (0 if cut is None else cut.dst_offset))
                    p_bases.append(src.base_addr + (0 if cut is None else cut.src_offset))
            if index:
                for src, dst in self.index_pairs:
                    d_bases.append(dst.base_addr)
                    p_bases.append(src.base_addr)
            d = np.array(d_bases, dtype=np.int64)
            p = np.array(p_bases, dtype=np.int64)
            d.setflags(write=False)
            p.setflags(write=False)
            hit = self._bases[key] = Bases(d, p, tuple(d_bases), tuple(p_bases))
        return hit
