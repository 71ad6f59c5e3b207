"""MF_META's layer map (spec 4.1): one layer's source tensors as Prefill advertises
them, and the rules that decode a map entry. Extensions only add optional keys."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rd2h.domain.errors import ProtocolError
from rd2h.domain.wire.wire_values import MAX_WIRE_INT, as_int, as_seq, as_str, clip

LAYER_METADATA_KEYS = (
    "base_addrs",
    "block_len",
    "block_size_scale",
    "tensor_group_idx",
    "main_tensor_count",
    "has_indexer",
)
# Optional key (an extension: older peers neither send nor need it): blocks in each
# tensor's advertised region, so Decode can refuse reads beyond it.
NUM_BLOCKS_KEY = "num_blocks"
# Optional key (the head-split extension, docs/guide/vllm.md "Head-split main KV"): the KV heads
# this rank's main tensors hold, ``[first, count, total]``. A Decode rank holding more
# heads pulls each contributor's heads into their slice of its blocks; a peer without
# the extension ignores the key and refuses the smaller blocks as before.
MAIN_HEADS_KEY = "main_heads"
# Optional key (the page extension): per tensor, the bytes of each block that are the
# tensor's own, from the block's start, where fewer than the block (``block_len`` x
# ``block_size_scale``, still the distance between blocks): vLLM's block-outermost
# layouts pack a group's layers side by side in one block. Decode reads exactly these
# bytes; absent, a page is its whole block (and Decode, whose own page is smaller,
# refuses the layer).
PAGE_BYTES_KEY = "page_bytes"
# Optional key (the state-split extension, docs/guide/vllm.md "Recurrent state"): a
# recurrent-state layer's TP position ``[rank, tp]``, so a Decode rank of another TP
# size reads exactly its parts of this rank's state page. Absent: equal TP only (the
# page sizes then differ and Decode refuses the layer).
STATE_SHARD_KEY = "state_shard"
MAX_TP = 1 << 12
MAX_KV_HEADS = 1 << 16


@dataclass(frozen=True)
class LayerMetadata:
    """One layer's source tensors as Prefill advertises them (spec 4.1).

    Tensors are ordered main first, then indexer, then LIC8 scale. ``num_blocks``
    (one per tensor, or empty when not advertised) bounds the source block ids
    Decode may read; an empty tuple is the legacy shape and leaves the map unchanged.
    """

    base_addrs: tuple[int, ...]
    block_len: tuple[int, ...]
    block_size_scale: tuple[int, ...]
    tensor_group_idx: tuple[int, ...]
    main_tensor_count: int
    has_indexer: bool
    num_blocks: tuple[int, ...] = ()
    main_heads: tuple[int, int, int] | None = None  # (first, count, total)
    page_bytes: tuple[int, ...] = ()  # per tensor; empty: whole blocks
    state_shard: tuple[int, int] | None = None  # (rank, tp) of a state layer

    def to_map(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "base_addrs": list(self.base_addrs),
            "block_len": list(self.block_len),
            "block_size_scale": list(self.block_size_scale),
            "tensor_group_idx": list(self.tensor_group_idx),
            "main_tensor_count": self.main_tensor_count,
            "has_indexer": self.has_indexer,
        }
        if self.num_blocks:
            out[NUM_BLOCKS_KEY] = list(self.num_blocks)
        if self.main_heads is not None:
            out[MAIN_HEADS_KEY] = list(self.main_heads)
        if self.page_bytes:
            out[PAGE_BYTES_KEY] = list(self.page_bytes)
        if self.state_shard is not None:
            out[STATE_SHARD_KEY] = list(self.state_shard)
        return out


def decode_layer_metadata(name: Any, value: Any) -> LayerMetadata:
    """Validate one entry of MF_META's layer map."""
    layer = clip(repr(as_str(name, "MF_META layer name")), 80)
    if not isinstance(value, Mapping):
        raise ProtocolError(f"MF_META layer {layer} must be a map, got {type(value).__name__}")
    missing = [k for k in LAYER_METADATA_KEYS if k not in value]
    if missing:
        raise ProtocolError(f"MF_META layer {layer} lacks {', '.join(missing)}")
    lists = {}
    for key in ("base_addrs", "block_len", "block_size_scale", "tensor_group_idx"):
        items = as_seq(value[key], f"MF_META {layer} {key}")
        lists[key] = tuple(as_int(v, f"MF_META {layer} {key} item", minimum=0) for v in items)
    sizes = {len(v) for v in lists.values()}
    if len(sizes) != 1:
        raise ProtocolError(f"MF_META layer {layer}: per-tensor lists differ in length")
    count = len(lists["base_addrs"])
    num_blocks = _per_tensor(value, NUM_BLOCKS_KEY, layer, count, minimum=0)
    main_heads = _main_heads(value.get(MAIN_HEADS_KEY), layer) if MAIN_HEADS_KEY in value \
        else None
    page_bytes = _per_tensor(value, PAGE_BYTES_KEY, layer, count, minimum=1)
    state_shard = _state_shard(value[STATE_SHARD_KEY], layer) if STATE_SHARD_KEY in value \
        else None
    main_count = as_int(value["main_tensor_count"], f"MF_META {layer} main_tensor_count", minimum=0)
    has_indexer = value["has_indexer"]
    if not isinstance(has_indexer, bool):
        raise ProtocolError(f"MF_META {layer} has_indexer must be a bool")
    return LayerMetadata(
        base_addrs=lists["base_addrs"],
        block_len=lists["block_len"],
        block_size_scale=lists["block_size_scale"],
        tensor_group_idx=lists["tensor_group_idx"],
        main_tensor_count=main_count,
        has_indexer=has_indexer,
        num_blocks=num_blocks,
        main_heads=main_heads,
        page_bytes=page_bytes,
        state_shard=state_shard,
    )


def _per_tensor(value: Mapping[str, Any], key: str, layer: str, count: int, *,
                minimum: int) -> tuple[int, ...]:
    """An optional per-tensor list of ``key`` (empty when absent): one int in
    ``[minimum, MAX_WIRE_INT]`` per tensor."""
    if key not in value:
        return ()
    items = as_seq(value[key], f"MF_META {layer} {key}")
    out = tuple(as_int(v, f"MF_META {layer} {key} item", minimum=minimum,
                       maximum=MAX_WIRE_INT) for v in items)
    if len(out) != count:
        raise ProtocolError(
            f"MF_META layer {layer}: {key} has {len(out)} items for {count} tensors")
    return out


def _main_heads(value: Any, layer: str) -> tuple[int, int, int]:
    """``[first, count, total]``: a non-empty head range inside ``total`` heads."""
    what = f"MF_META {layer} {MAIN_HEADS_KEY}"
    items = as_seq(value, what)
    if len(items) != 3:
        raise ProtocolError(f"{what} must be [first, count, total], got {len(items)} items")
    total = as_int(items[2], f"{what} total", minimum=1, maximum=MAX_KV_HEADS)
    first = as_int(items[0], f"{what} first", minimum=0, maximum=total - 1)
    count = as_int(items[1], f"{what} count", minimum=1, maximum=total - first)
    return first, count, total


def _state_shard(value: Any, layer: str) -> tuple[int, int]:
    """``[rank, tp]``: a rank inside a TP size of at most ``MAX_TP``."""
    what = f"MF_META {layer} {STATE_SHARD_KEY}"
    items = as_seq(value, what)
    if len(items) != 2:
        raise ProtocolError(f"{what} must be [rank, tp], got {len(items)} items")
    tp = as_int(items[1], f"{what} tp", minimum=1, maximum=MAX_TP)
    return as_int(items[0], f"{what} rank", minimum=0, maximum=tp - 1), tp


def decode_layer_map(value: Any) -> dict[str, LayerMetadata]:
    if not isinstance(value, Mapping):
        raise ProtocolError(f"MF_META layer metadata must be a map, got {type(value).__name__}")
    return {name: decode_layer_metadata(name, meta) for name, meta in value.items()}
