"""vLLM's per-layer KV cache tensors as rd2h layouts (no vLLM import needed).

A cache tensor holds ``num_blocks`` blocks along its first dimension (MLA: one
latent tensor, e.g. ``[num_blocks, 1, block_size, 576]``), or along its second
dimension behind a leading K/V axis (``[2, num_blocks, ...]``: two main tensors).
A recurrent-state layer (Mamba, gated delta net) is a list of views (conv state, SSM
state) into one page per block: one main tensor, the page (``state_page``).

Each tensor's page is what its own shape, strides and offset cover in a block: the
whole block in vLLM's default layouts, a part of it where vLLM packs a group's layers
side by side in each block (DeepSeek-V4: one 47,808-byte block holds a window cache at
offset 0 and others after it) or pads a state page. Only the page is moved and hashed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rd2h.adapters.torch.tensors import head_major, main_views, region_of, state_page
from rd2h.domain.errors import LayoutMismatch
from rd2h.domain.planning.layout import (
    DestinationLayout,
    DestTensor,
    HeadRange,
    SourceLayout,
    TensorComponent,
)
from rd2h.domain.planning.state_split import StateGeometry

# A state geometry, this rank's place and the state groups: ``(geometry, rank, tp,
# groups)``.
StateShard = tuple[StateGeometry, int, int, frozenset[int]]

__all__ = ["VllmCacheDestinations", "main_views", "region_of", "source_layouts"]


def _is_state(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def _views(name: str, value: Any, num_blocks: int) -> list[tuple[int, int, int]]:
    """``(base_addr, bytes_per_block, page)`` of each main tensor of a cache layer."""
    if _is_state(value):
        return [state_page(name, value, num_blocks)]
    return main_views(name, value, num_blocks)


def _region(value: Any) -> tuple[int, int]:
    return region_of(value[0] if _is_state(value) else value)


def _heads(tensor: Any, num_blocks: int, heads: HeadRange | None) -> HeadRange | None:
    """``heads`` when the tensor's blocks are head-major with that many heads (only then
    may a part of them fill a slice of another rank's block), else None (a state page
    is never split by heads)."""
    if heads is None or _is_state(tensor):
        return None
    return heads if head_major(tensor, num_blocks, heads.count) else None


def _state_position(name: str, value: Any, num_blocks: int, state: StateShard | None,
                    group: int) -> tuple[int, int] | None:
    """A state layer's ``(rank, tp)`` when its bytes lie in its page as the geometry says
    (the tensors one after another from the page's first byte), else None (a layer of
    another kind, no geometry). vLLM hands a state layer over as its list of views or as
    one view of the page's state bytes. A state page laid out otherwise is refused: rd2h
    would otherwise split it by a layout it does not have."""
    if state is None or group not in state[3]:
        return None
    geometry, rank, tp, _ = state
    sizes = geometry.tensor_bytes(tp)
    if not _is_state(value):  # one view of the state's bytes
        (_, _, page), = main_views(name, value, num_blocks)
        if page != sum(sizes):
            raise LayoutMismatch(name, "main", f"a {page}-byte state page; the "
                                 f"{geometry.kind} geometry at TP {tp} gives {sum(sizes)}")
        return rank, tp
    parts = list(value)
    if len(parts) != len(sizes):
        raise LayoutMismatch(name, "main", f"{len(parts)} state tensors; the "
                             f"{geometry.kind} geometry has {len(sizes)}")
    base = parts[0].data_ptr()
    at = 0
    got = []
    for t, size in zip(parts, sizes):
        nbytes = t.numel() // max(1, int(t.shape[0])) * t.element_size()  # one block's
        got.append((t.data_ptr() - base, nbytes))
        if t.data_ptr() - base != at or nbytes != size:
            raise LayoutMismatch(
                name, "main", f"state tensors at (offset, bytes) {got} of the page; the "
                f"{geometry.kind} geometry at TP {tp} gives sizes {sizes} one after another")
        at += size
    return rank, tp


def _moved(kv_caches: Mapping[str, Any], groups: Mapping[str, int] | None
           ) -> list[tuple[str, Any, int]]:
    """The cache layers rd2h moves with their KV cache group (``groups``: layer name ->
    group of the moved groups; None: every layer, group 0)."""
    if groups is None:
        return [(name, tensor, 0) for name, tensor in kv_caches.items()]
    return [(name, tensor, groups[name]) for name, tensor in kv_caches.items()
            if name in groups]


def source_layouts(
    kv_caches: Mapping[str, Any], num_blocks: int, heads: HeadRange | None = None,
    groups: Mapping[str, int] | None = None, state: StateShard | None = None,
) -> tuple[dict[str, SourceLayout], list[tuple[int, int]]]:
    """Prefill: one ``SourceLayout`` per cache layer, and the regions to expose.
    ``heads``: the KV heads this rank holds (stated per layer where blocks are
    head-major: the head-split extension); ``groups``: each moved layer's KV cache
    group (MF_META's ``tensor_group_idx``); ``state``: the state geometry and this
    rank's ``(rank, tp)``, stated per state layer (MF_META's ``state_shard``)."""
    layouts: dict[str, SourceLayout] = {}
    regions: dict[tuple[int, int], None] = {}
    for name, tensor, group in _moved(kv_caches, groups):
        views = _views(name, tensor, num_blocks)
        # Advertise the region size so Decode refuses block ids beyond the cache.
        layouts[name] = SourceLayout(
            name, tuple(TensorComponent(b, n, group_idx=group, num_blocks=num_blocks,
                                        page_bytes=None if p == n else p)
                        for b, n, p in views),
            heads=_heads(tensor, num_blocks, heads),
            state=_state_position(name, tensor, num_blocks, state, group),
        )
        regions[_region(tensor)] = None
    return layouts, list(regions)


class VllmCacheDestinations:
    """Decode destinations in vLLM's own registered caches: rank-local main KV, so
    every Decode rank pulls all of its main blocks (``main_sharing = rank_local``)."""

    main_sharing = "rank_local"

    def __init__(self, kv_caches: Mapping[str, Any], num_blocks: int,
                 heads: HeadRange | None = None, groups: Mapping[str, int] | None = None,
                 state: StateShard | None = None) -> None:
        """``groups``: each moved layer's KV cache group, whose block ids address it
        (None: one group, the request's main list)."""
        self._layouts: dict[str, DestinationLayout] = {}
        regions: dict[tuple[int, int], None] = {}
        for name, tensor, group in _moved(kv_caches, groups):
            views = _views(name, tensor, num_blocks)
            self._layouts[name] = DestinationLayout(
                name, tuple(DestTensor(b, n, num_blocks, None if p == n else p)
                            for b, n, p in views),
                heads=_heads(tensor, num_blocks, heads),
                group=None if groups is None else group,
                state=(position := _state_position(name, tensor, num_blocks, state, group)),
                geometry=None if position is None or state is None else state[0],
            )
            regions[_region(tensor)] = None
        self._regions = list(regions)
        self._keep = kv_caches  # the tensors must outlive the receiver

    def layouts(self) -> Mapping[str, DestinationLayout]:
        return self._layouts

    def regions(self) -> Sequence[tuple[int, int]]:
        return self._regions
