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


def state_page(name: str, tensors: Any, num_blocks: int) -> tuple[int, int]:
    """``(base_addr, bytes_per_block)`` of a recurrent-state layer (vLLM: a list of views,
    e.g. conv and SSM state, ``[num_blocks, ...]`` each, packed one after another into
    one page per block). rd2h moves the whole page, as vLLM stores it (padding to the
    attention page size included): the page's first byte and its size."""
    parts = list(tensors)
    if not parts:
        raise LayoutMismatch(name, "main", "a state layer with no tensors")
    pages = set()
    for t in parts:
        shape, stride = tuple(t.shape), tuple(t.stride())
        if not shape or shape[0] != num_blocks:
            raise LayoutMismatch(name, "main",
                                 f"cannot find {num_blocks} blocks in a state of shape {shape}")
        pages.add(stride[0] * t.element_size())
    if len(pages) != 1:
        raise LayoutMismatch(name, "main", f"state tensors with different pages {sorted(pages)}")
    page = pages.pop()
    base = min(t.data_ptr() for t in parts)
    for t in parts:
        inner = 1
        for n in tuple(t.shape)[1:]:
            inner *= n
        if t.data_ptr() + inner * t.element_size() > base + page:
            raise LayoutMismatch(name, "main", f"a state tensor of shape {tuple(t.shape)} "
                                               f"runs past its {page}-byte page")
    return base, page


def head_major(tensor: Any, num_blocks: int, heads: int) -> bool:
    """Whether each block of ``tensor`` holds ``heads`` KV heads one after another (the
    dimension after the block one is the head one, and the heads fill the block), so a
    rank holding some of them fills one contiguous slice of a block holding more (vLLM's
    CPU cache: ``[num_blocks, heads, block_size, 2 * head_size]``)."""
    shape, stride = tuple(tensor.shape), tuple(tensor.stride())
    if shape and shape[0] == num_blocks:
        dim = 1
    elif len(shape) >= 2 and shape[1] == num_blocks and shape[0] in (1, 2):
        dim = 2
    else:
        return False
    return len(shape) > dim and shape[dim] == heads and stride[dim] * heads == stride[dim - 1]


def region_of(tensor: Any) -> tuple[int, int]:
    """The tensor's whole storage span, to register with a transport."""
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()
