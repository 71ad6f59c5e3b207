"""Where a cache tensor's blocks and storage are, read from the tensor itself (duck-typed:
``shape``, ``stride()``, ``element_size()``, ``data_ptr()``, ``untyped_storage()``), for
vLLM's caches and the Ascend SparseKV pool alike. No torch import is needed."""

from __future__ import annotations

from typing import Any

from rd2h.domain.errors import LayoutMismatch


def _page(name: str, shape: tuple[int, ...], stride: tuple[int, ...], elem: int,
          block_stride: int) -> int:
    """The bytes of one block that a view's inner dimensions (``shape``, ``stride``:
    those after the block dimension) cover, from its first byte: the layer's page. They
    must be the page's every byte (dense, in any order) and fit in the block."""
    count = 1
    span = elem
    for n, st in zip(shape, stride):
        count *= n
        if n > 1:
            if st <= 0:
                raise LayoutMismatch(name, "main", f"a KV cache view with stride {stride} "
                                                   "repeats or reverses its elements")
            span += (n - 1) * st * elem
    if count == 0:
        raise LayoutMismatch(name, "main", f"a KV cache view of {shape} holds no bytes")
    if span != count * elem:
        raise LayoutMismatch(
            name, "main", f"a KV cache view of shape {shape} and stride {stride} leaves "
            f"gaps in its page ({count * elem} bytes spread over {span}): rd2h moves a "
            "layer's page as one span and cannot describe this layout")
    if span > block_stride:
        raise LayoutMismatch(
            name, "main", f"a {span}-byte page runs past its {block_stride}-byte block "
            "(blocks overlap): rd2h cannot describe this layout")
    return span


def main_views(name: str, tensor: Any, num_blocks: int) -> list[tuple[int, int, int]]:
    """``(base_addr, bytes_per_block, page)`` of each main tensor inside ``tensor``: where
    block 0 of it starts, the distance between blocks and the bytes of each block that
    are this layer's, from the tensor's own shape, strides and offset. In vLLM's
    block-outermost (packed) layouts a block holds every layer of a group side by side:
    a layer's page is then smaller than its block and starts at its own offset in it."""
    shape, stride = tuple(tensor.shape), tuple(tensor.stride())
    elem = tensor.element_size()
    if not shape:
        raise LayoutMismatch(name, "main", "a KV cache tensor must have a block dimension")
    if shape[0] == num_blocks:
        block = stride[0] * elem
        return [(tensor.data_ptr(), block, _page(name, shape[1:], stride[1:], elem, block))]
    if len(shape) >= 2 and shape[1] == num_blocks and shape[0] in (1, 2):
        block = stride[1] * elem
        page = _page(name, shape[2:], stride[2:], elem, block)
        return [(tensor.data_ptr() + i * stride[0] * elem, block, page)
                for i in range(shape[0])]
    raise LayoutMismatch(
        name, "main", f"cannot find {num_blocks} blocks in a KV cache of shape {shape}"
    )


def state_page(name: str, tensors: Any, num_blocks: int) -> tuple[int, int, int]:
    """``(base_addr, bytes_per_block, page)`` of a recurrent-state layer (vLLM: a list of
    views, e.g. conv and SSM state, ``[num_blocks, ...]`` each, packed one after another
    into one page per block, padded to the attention page size): the first byte of the
    state, the distance between blocks, and the bytes from the first state byte to the
    last (the padding after them, or another layer's page in a packed block, is not
    moved)."""
    parts = list(tensors)
    if not parts:
        raise LayoutMismatch(name, "main", "a state layer with no tensors")
    blocks = set()
    for t in parts:
        shape, stride = tuple(t.shape), tuple(t.stride())
        if not shape or shape[0] != num_blocks:
            raise LayoutMismatch(name, "main",
                                 f"cannot find {num_blocks} blocks in a state of shape {shape}")
        blocks.add(stride[0] * t.element_size())
    if len(blocks) != 1:
        raise LayoutMismatch(name, "main", f"state tensors with different pages {sorted(blocks)}")
    block = blocks.pop()
    base = min(t.data_ptr() for t in parts)
    end = base
    for t in parts:
        shape, stride = tuple(t.shape), tuple(t.stride())
        span = _page(name, shape[1:], stride[1:], t.element_size(), block)
        if t.data_ptr() + span > base + block:
            raise LayoutMismatch(name, "main", f"a state tensor of shape {shape} "
                                               f"runs past its {block}-byte page")
        end = max(end, t.data_ptr() + span)
    return base, block, end - base


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
