"""Per-layer tensor layouts on both sides and their validation (spec 6).

A layer has up to two main tensors (vanilla vLLM MLA: one latent tensor; the
Ascend layout: K and V), an optional indexer and an optional LIC8 scale that
follows the indexer's block layout. One external block of a tensor occupies
``block_len * block_size_scale`` bytes.

Head-split extension (docs/guide/vllm.md "Head-split main KV"): when both sides state the KV
heads their main tensors hold (``HeadRange``) and a block is head-major (each head's
bytes contiguous inside it), a Prefill rank holding a part of Decode's heads fills
its slice of each Decode block: ``main_slices`` gives the byte offset per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rd2h.domain.errors import LayoutMismatch
from rd2h.domain.wire.protocol import LayerMetadata

MAX_MAIN_TENSORS = 2


@dataclass(frozen=True)
class HeadRange:
    """KV heads ``[first, first + count)`` of a model's ``total``, held by one rank."""

    first: int
    count: int
    total: int

    def __post_init__(self) -> None:
        if not (self.total >= 1 and self.first >= 0 and self.count >= 1
                and self.first + self.count <= self.total):
            raise ValueError(f"invalid head range {self.first}+{self.count} of {self.total}")

    def within(self, other: HeadRange) -> bool:
        return (self.total == other.total and other.first <= self.first
                and self.first + self.count <= other.first + other.count)

    def __str__(self) -> str:
        return f"[{self.first}, {self.first + self.count}) of {self.total}"


@dataclass(frozen=True)
class TensorComponent:
    """One source tensor of a Prefill layer.

    ``num_blocks`` is the size of the advertised region in blocks (None: not
    advertised, a legacy peer); Decode refuses to read a block at or beyond it.
    """

    base_addr: int
    block_len: int
    block_size_scale: int = 1
    group_idx: int = 0
    num_blocks: int | None = None
    # The bytes of a block that are this tensor's, from the block's start (None: the
    # whole block). Less than the block where vLLM packs several layers' pages into one
    # block (its block-outermost layouts: a block holds every layer of a group side by
    # side) or pads a page: only these bytes are read, written and hashed.
    page_bytes: int | None = None

    @property
    def bytes_per_block(self) -> int:
        """The distance between two blocks (block b starts at ``base + b * this``)."""
        return self.block_len * self.block_size_scale

    @property
    def page(self) -> int:
        """The bytes of each block that are moved: ``page_bytes``, else the whole block."""
        return self.bytes_per_block if self.page_bytes is None else self.page_bytes


@dataclass(frozen=True)
class SourceLayout:
    """A Prefill layer's tensors: main first, then indexer, then LIC8 scale."""

    layer_name: str
    main: tuple[TensorComponent, ...]
    indexer: TensorComponent | None = None
    scale: TensorComponent | None = None
    heads: HeadRange | None = None  # the KV heads of the main tensors (head-major blocks)
    # A recurrent-state layer's TP position ``(rank, tp)`` (the state-split extension:
    # a Decode rank of another TP size reads its parts, ``layer_pair``); None: not stated.
    state: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if len(self.main) > MAX_MAIN_TENSORS:
            raise LayoutMismatch(
                self.layer_name, "main", f"{len(self.main)} main tensors (at most 2 supported)"
            )
        if self.scale is not None and self.indexer is None:
            raise LayoutMismatch(self.layer_name, "scale", "a LIC8 scale needs an indexer")

    @property
    def tensors(self) -> tuple[TensorComponent, ...]:
        extra = tuple(t for t in (self.indexer, self.scale) if t is not None)
        return self.main + extra

    @property
    def storage_keys(self) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """Physical storage slot keys (spec 7.1): main bases; indexer (+scale) bases."""
        main_key = tuple(t.base_addr for t in self.main)
        if self.indexer is None:
            return main_key, None
        idx = (self.indexer.base_addr,)
        if self.scale is not None:
            idx += (self.scale.base_addr,)
        return main_key, idx

    def to_metadata(self) -> LayerMetadata:
        tensors = self.tensors
        sizes = tuple(t.num_blocks for t in tensors)
        return LayerMetadata(
            base_addrs=tuple(t.base_addr for t in tensors),
            block_len=tuple(t.block_len for t in tensors),
            block_size_scale=tuple(t.block_size_scale for t in tensors),
            tensor_group_idx=tuple(t.group_idx for t in tensors),
            main_tensor_count=len(self.main),
            has_indexer=self.indexer is not None,
            # all or nothing: a partly advertised layer stays in the legacy shape
            num_blocks=() if None in sizes else sizes,  # type: ignore[arg-type]
            main_heads=None if self.heads is None else (
                self.heads.first, self.heads.count, self.heads.total),
            # only when a page is not its whole block: the legacy shape otherwise
            page_bytes=tuple(t.page for t in tensors)
            if any(t.page != t.bytes_per_block for t in tensors) else (),
            state_shard=self.state,
        )

    @classmethod
    def from_metadata(cls, layer_name: str, meta: LayerMetadata) -> SourceLayout:
        """Split MF_META's flat tensor lists into components."""
        count = len(meta.base_addrs)
        mc = meta.main_tensor_count
        if mc > MAX_MAIN_TENSORS:
            raise LayoutMismatch(layer_name, "main", f"main_tensor_count {mc} (at most 2)")
        if count < mc:
            raise LayoutMismatch(
                layer_name, "main", f"main_tensor_count {mc} but only {count} base addresses"
            )
        if meta.num_blocks and len(meta.num_blocks) != count:
            raise LayoutMismatch(
                layer_name, "main",
                f"{len(meta.num_blocks)} region sizes for {count} base addresses",
            )
        if meta.page_bytes and len(meta.page_bytes) != count:
            raise LayoutMismatch(
                layer_name, "main",
                f"{len(meta.page_bytes)} page sizes for {count} base addresses",
            )
        sizes = meta.num_blocks or (None,) * count
        pages = meta.page_bytes or (None,) * count
        tensors = [
            TensorComponent(
                meta.base_addrs[i], meta.block_len[i], meta.block_size_scale[i],
                meta.tensor_group_idx[i], sizes[i], pages[i],
            )
            for i in range(count)
        ]
        for t in tensors:
            if t.page_bytes is not None and not 0 < t.page_bytes <= t.bytes_per_block:
                raise LayoutMismatch(layer_name, "main", f"a {t.page_bytes}-byte page in a "
                                     f"{t.bytes_per_block}-byte block")
        heads = None if meta.main_heads is None else HeadRange(*meta.main_heads)
        extra = tensors[mc:]
        if not meta.has_indexer:
            if extra:
                raise LayoutMismatch(
                    layer_name, "indexer",
                    f"{len(extra)} tensors beyond the main ones but has_indexer is false",
                )
            return cls(layer_name, tuple(tensors[:mc]), heads=heads, state=meta.state_shard)
        if not extra:
            raise LayoutMismatch(layer_name, "indexer", "has_indexer is true but no indexer tensor")
        if len(extra) > 2:
            raise LayoutMismatch(
                layer_name, "scale", f"{len(extra)} tensors after main (indexer + scale at most)"
            )
        scale = extra[1] if len(extra) == 2 else None
        return cls(layer_name, tuple(tensors[:mc]), extra[0], scale, heads, meta.state_shard)


@dataclass(frozen=True)
class DestTensor:
    """One Decode destination tensor: where block 0 lies, the distance between blocks,
    how many blocks fit, and the bytes of each block that are this tensor's page (None:
    the whole block; see ``TensorComponent.page_bytes``)."""

    base_addr: int
    bytes_per_block: int
    num_blocks: int
    page_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.page_bytes is not None and not 0 < self.page_bytes <= self.bytes_per_block:
            raise ValueError(f"a {self.page_bytes}-byte page in a "
                             f"{self.bytes_per_block}-byte block")

    @property
    def page(self) -> int:
        return self.bytes_per_block if self.page_bytes is None else self.page_bytes


@dataclass(frozen=True)
class DestinationLayout:
    """A Decode layer's destinations: shared main pool, rank-local indexer/scale."""

    layer_name: str
    main: tuple[DestTensor, ...]
    indexer: DestTensor | None = None
    scale: DestTensor | None = None
    heads: HeadRange | None = None  # the KV heads of the main tensors (head-major blocks)
    # The KV cache group whose block ids address the main tensors (None: the request's
    # main list): a layer of a second group reads into that group's own blocks.
    group: int | None = None
    # A recurrent-state layer: this rank's TP position ``(rank, tp)`` and the model's
    # state geometry (``state_split.StateGeometry``), so a Prefill rank of another TP
    # size that states its own position fills this rank's parts (None: equal TP only).
    state: tuple[int, int] | None = None
    geometry: Any = None


def per_block_bytes_from_rows(row_bytes: int, rows: int, num_blocks: int) -> int:
    """Bytes of one block of a tensor of ``rows`` rows of ``row_bytes`` over ``num_blocks``."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if rows % num_blocks:
        raise ValueError(f"{rows} rows do not split into {num_blocks} equal blocks")
    return row_bytes * (rows // num_blocks)


def _check_bytes(layer: str, component: str, src: TensorComponent, dst: DestTensor) -> None:
    """The page each block moves must be the same size on both sides (the blocks around
    it may differ: one side may pack other layers' pages beside it)."""
    if src.bytes_per_block <= 0:
        raise LayoutMismatch(layer, component, f"source block has {src.bytes_per_block} bytes")
    if src.page != dst.page:
        def what(page: int, block: int) -> str:
            return f"{block} bytes" if page == block else f"a {page}-byte page of {block}"
        raise LayoutMismatch(
            layer, component,
            f"source block is {src.block_len} x {src.block_size_scale} = "
            f"{what(src.page, src.bytes_per_block)}, destination block is "
            f"{what(dst.page, dst.bytes_per_block)}",
        )


@dataclass(frozen=True)
class MainSlice:
    """Head split: which bytes of a source block go where in a destination block."""

    src_offset: int
    dst_offset: int
    nbytes: int


def main_slices(src: SourceLayout, dst: DestinationLayout) -> tuple[MainSlice, ...] | None:
    """Head split: per main tensor, the part of each source block that fills a part of
    each destination block; None when both hold the same heads or either side does not
    state them (then blocks must match whole). The side holding fewer heads is read or
    written whole: a Prefill rank holding part of Decode's heads fills its slice (Prefill
    TP above Decode TP), a Decode rank holding part of Prefill's heads reads its slice
    (Decode TP above Prefill TP). Raises ``LayoutMismatch`` when neither range holds the
    other or the bytes per head differ."""
    sh, dh = src.heads, dst.heads
    if sh is None or dh is None or sh == dh:
        return None
    layer = dst.layer_name
    if not (sh.within(dh) or dh.within(sh)):
        raise LayoutMismatch(layer, "main", f"prefill holds KV heads {sh}, decode holds {dh}: "
                             "not a part of them")
    if len(src.main) != len(dst.main):
        raise LayoutMismatch(
            layer, "main",
            f"prefill advertises {len(src.main)} main tensors, decode expects {len(dst.main)}",
        )
    out = []
    for s, d in zip(src.main, dst.main):
        if d.page % dh.count or d.page <= 0:
            raise LayoutMismatch(layer, "main", f"a {d.page}-byte destination "
                                 f"block does not split into {dh.count} heads")
        per_head = d.page // dh.count
        if s.page != per_head * sh.count:
            raise LayoutMismatch(
                layer, "main",
                f"source block is {s.page} bytes for {sh.count} heads, "
                f"destination holds {per_head} bytes per head",
            )
        if sh.within(dh):
            out.append(MainSlice(0, (sh.first - dh.first) * per_head, s.page))
        else:
            out.append(MainSlice((dh.first - sh.first) * per_head, 0, d.page))
    return tuple(out)


def validate_layout(src: SourceLayout, dst: DestinationLayout, *,
                    state_split: bool = False) -> None:
    """Raise ``LayoutMismatch`` naming the layer and the first mismatching component
    (``state_split``: main is a state page split by TP, checked by its own rule)."""
    layer = dst.layer_name
    if len(src.main) != len(dst.main):
        raise LayoutMismatch(
            layer, "main",
            f"prefill advertises {len(src.main)} main tensors, decode expects {len(dst.main)}",
        )
    if not state_split and main_slices(src, dst) is None:
        for s, d in zip(src.main, dst.main):
            _check_bytes(layer, "main", s, d)
    for component in ("indexer", "scale"):
        s = getattr(src, component)
        d = getattr(dst, component)
        if (s is None) != (d is None):
            have = "has" if s is not None else "has no"
            want = "expects one" if d is not None else "has none"
            raise LayoutMismatch(layer, component, f"prefill {have} {component}, decode {want}")
        if s is not None:
            _check_bytes(layer, component, s, d)
