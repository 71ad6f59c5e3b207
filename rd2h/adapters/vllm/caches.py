"""vLLM's per-layer KV cache tensors as rd2h layouts (no vLLM import needed).

A cache tensor holds ``num_blocks`` blocks along its first dimension (MLA: one
latent tensor, e.g. ``[num_blocks, 1, block_size, 576]``), or along its second
dimension behind a leading K/V axis (``[2, num_blocks, ...]``: two main tensors).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rd2h.domain.errors import LayoutMismatch
from rd2h.domain.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent


def main_views(name: str, tensor: Any, num_blocks: int) -> list[tuple[int, int]]:
    """``(base_addr, bytes_per_block)`` of each main tensor inside ``tensor``."""
    shape, stride = tuple(tensor.shape), tuple(tensor.stride())
    elem = tensor.element_size()
    if not shape:
        raise LayoutMismatch(name, "main", "a KV cache tensor must have a block dimension")
    if shape[0] == num_blocks:
        return [(tensor.data_ptr(), stride[0] * elem)]
    if len(shape) >= 2 and shape[1] == num_blocks and shape[0] in (1, 2):
        return [(tensor.data_ptr() + i * stride[0] * elem, stride[1] * elem)
                for i in range(shape[0])]
    raise LayoutMismatch(
        name, "main", f"cannot find {num_blocks} blocks in a KV cache of shape {shape}"
    )


def region_of(tensor: Any) -> tuple[int, int]:
    """The tensor's whole storage span, to register with a transport."""
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def source_layouts(
    kv_caches: Mapping[str, Any], num_blocks: int
) -> tuple[dict[str, SourceLayout], list[tuple[int, int]]]:
    """Prefill: one ``SourceLayout`` per cache layer, and the regions to expose."""
    layouts: dict[str, SourceLayout] = {}
    regions: dict[tuple[int, int], None] = {}
    for name, tensor in kv_caches.items():
        views = main_views(name, tensor, num_blocks)
        # Advertise the region size so Decode refuses block ids beyond the cache.
        layouts[name] = SourceLayout(
            name, tuple(TensorComponent(b, n, num_blocks=num_blocks) for b, n in views)
        )
        regions[region_of(tensor)] = None
    return layouts, list(regions)


class VllmCacheDestinations:
    """Decode destinations in vLLM's own registered caches: rank-local main KV, so
    every Decode rank pulls all of its main blocks (``main_sharing = rank_local``)."""

    main_sharing = "rank_local"

    def __init__(self, kv_caches: Mapping[str, Any], num_blocks: int) -> None:
        self._layouts: dict[str, DestinationLayout] = {}
        regions: dict[tuple[int, int], None] = {}
        for name, tensor in kv_caches.items():
            views = main_views(name, tensor, num_blocks)
            self._layouts[name] = DestinationLayout(
                name, tuple(DestTensor(b, n, num_blocks) for b, n in views)
            )
            regions[region_of(tensor)] = None
        self._regions = list(regions)
        self._keep = kv_caches  # the tensors must outlive the receiver

    def layouts(self) -> Mapping[str, DestinationLayout]:
        return self._layouts

    def regions(self) -> Sequence[tuple[int, int]]:
        return self._regions
