"""Chunked-prefill block ranges, request ids, cache groups and layer names.

Spec sections 2, 3.2 and 3.4.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from rd2h.domain.errors import ChunkError

ENGINE_SUFFIX_LEN = 9
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def external_request_id(internal_id: str) -> str:
    """Strip vLLM's 9-character engine suffix (ids of 9 characters or fewer stay)."""
    if len(internal_id) > ENGINE_SUFFIX_LEN:
        return internal_id[:-ENGINE_SUFFIX_LEN]
    return internal_id


def is_final_chunk(computed_tokens: int, total_tokens: int) -> bool:
    """The final chunk is reached when computed tokens cover the whole request."""
    return computed_tokens >= total_tokens


def chunk_block_range(
    *,
    block_size: int,
    computed_tokens: int,
    transferred_tokens: int,
    remote_cached_tokens: int,
    final: bool,
    allocated_blocks: int,
) -> tuple[int, int]:
    """Blocks ``[start, end)`` completed by this step that have not been announced yet.

    ``start = max(remote_cached, transferred) // B``; ``end = ceil(computed / B)`` on
    the final chunk (the partial last block goes with it), else ``computed // B``.
    """
    if block_size < 1:
        raise ChunkError(f"block size must be >= 1, got {block_size}")
    for name, value in (
        ("computed_tokens", computed_tokens),
        ("transferred_tokens", transferred_tokens),
        ("remote_cached_tokens", remote_cached_tokens),
        ("allocated_blocks", allocated_blocks),
    ):
        if value < 0:
            raise ChunkError(f"{name} must be >= 0, got {value}")
    transferred = max(remote_cached_tokens, transferred_tokens)
    start = transferred // block_size
    end = -(-computed_tokens // block_size) if final else computed_tokens // block_size
    if end > allocated_blocks:
        raise ChunkError(
            f"chunk ends at block {end} but only {allocated_blocks} blocks are allocated"
        )
    return start, max(start, end)


class LayerNameError(ChunkError):
    """A cache layer's name holds no layer index rd2h can place (refused at start)."""


def layer_index(layer_name: str) -> int:
    """A cache layer's model layer index: the integer after ``layers.`` in its name
    (``model.layers.5.attn`` -> 5, the spec's rule), else, as vLLM itself places a cache
    (``extract_layer_index``), the one integer among the name's dotted parts (Falcon-H1's
    Mamba mixers: ``model.4.mixer`` -> 4). Raises ``LayerNameError`` naming the cache
    when neither finds exactly one."""
    match = _LAYER_RE.search(layer_name)
    if match is not None:
        return int(match.group(1))
    ints = [int(part) for part in layer_name.split(".") if part.isdigit()]
    if len(ints) != 1:
        raise LayerNameError(
            f"cannot place the KV cache layer {layer_name!r}: its name holds "
            f"{'no' if not ints else len(ints)} layer index{'es' if len(ints) > 1 else ''} "
            "('layers.N', or one integer among its dotted parts, as vLLM places caches); "
            "rd2h cannot move this model's cache")
    return ints[0]


def wire_layer_ids(layer_names: Sequence[str]) -> dict[str, int]:
    """Each cache layer's ``layer_idx`` in announcements: its ``layer_index`` when no two
    names share one (the spec's rule); else, for a model with several caches in one of
    its layers (DeepSeek-V4: a window cache, a compressed cache, an indexer cache and a
    compressor state in layer 1), the name's position in (layer index, name) order. Decode
    finds a layer by the name each announcement carries; the index only pairs replies."""
    indexes = {name: layer_index(name) for name in layer_names}
    if len(set(indexes.values())) == len(indexes):
        return indexes
    ordered = sorted(indexes, key=lambda n: (indexes[n], n))
    return {name: i for i, name in enumerate(ordered)}


def is_indexer_layer(layer_name: str) -> bool:
    return "indexer" in layer_name.lower()


@dataclass(frozen=True)
class CacheGroups:
    """Which vLLM cache group carries main KV and which the indexer (spec 2)."""

    main: int
    indexer: int
    has_indexer_group: bool


def discover_cache_groups(group_layer_names: Sequence[Sequence[str]]) -> CacheGroups:
    """Find the main and indexer groups from each group's layer names.

    A group with a layer whose name contains "indexer" (any case) is the indexer
    group; the first group with a non-indexer layer is the main group; without an
    indexer group the indexer uses the main group's ids. Order is not assumed.
    """
    main: int | None = None
    indexer: int | None = None
    for idx, names in enumerate(group_layer_names):
        if indexer is None and any(is_indexer_layer(n) for n in names):
            indexer = idx
        if main is None and any(not is_indexer_layer(n) for n in names):
            main = idx
    if main is None:
        raise ValueError("no cache group holds a main (non-indexer) layer")
    return CacheGroups(
        main=main,
        indexer=main if indexer is None else indexer,
        has_indexer_group=indexer is not None,
    )
