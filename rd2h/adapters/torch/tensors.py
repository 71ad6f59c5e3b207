"""Where a cache tensor's blocks and storage are, read from the tensor itself (duck-typed:
``shape``, ``stride()``, ``element_size()``, ``data_ptr()``, ``untyped_storage()``), for
vLLM's caches and the Ascend SparseKV pool alike. No torch import is needed."""

from __future__ import annotations

from typing import Any

from rd2h.domain.errors import LayoutMismatch


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
