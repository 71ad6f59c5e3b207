"""Per-layer tensor layouts on both sides and their validation (spec 6).

A layer has up to two main tensors (vanilla vLLM MLA: one latent tensor; the
Ascend layout: K and V), an optional indexer and an optional LIC8 scale that
follows the indexer's block layout. One external block of a tensor occupies
``block_len * block_size_scale`` bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from rd2h.domain.errors import LayoutMismatch
from rd2h.domain.protocol import LayerMetadata

MAX_MAIN_TENSORS = 2


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

    @property
    def bytes_per_block(self) -> int:
        return self.block_len * self.block_size_scale


@dataclass(frozen=True)
class SourceLayout:
    """A Prefill layer's tensors: main first, then indexer, then LIC8 scale."""

    layer_name: str
    main: tuple[TensorComponent, ...]
    indexer: TensorComponent | None = None
    scale: TensorComponent | None = None

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
        sizes = meta.num_blocks or (None,) * count
        tensors = [
            TensorComponent(
                meta.base_addrs[i], meta.block_len[i], meta.block_size_scale[i],
                meta.tensor_group_idx[i], sizes[i],
            )
            for i in range(count)
        ]
        extra = tensors[mc:]
        if not meta.has_indexer:
            if extra:
                raise LayoutMismatch(
                    layer_name, "indexer",
                    f"{len(extra)} tensors beyond the main ones but has_indexer is false",
                )
            return cls(layer_name, tuple(tensors[:mc]))
        if not extra:
            raise LayoutMismatch(layer_name, "indexer", "has_indexer is true but no indexer tensor")
        if len(extra) > 2:
            raise LayoutMismatch(
                layer_name, "scale", f"{len(extra)} tensors after main (indexer + scale at most)"
            )
        scale = extra[1] if len(extra) == 2 else None
        return cls(layer_name, tuple(tensors[:mc]), extra[0], scale)


@dataclass(frozen=True)
class DestTensor:
    """One Decode destination tensor: where block 0 lies and how many blocks fit."""

    base_addr: int
    bytes_per_block: int
    num_blocks: int


@dataclass(frozen=True)
class DestinationLayout:
    """A Decode layer's destinations: shared main pool, rank-local indexer/scale."""

    layer_name: str
    main: tuple[DestTensor, ...]
    indexer: DestTensor | None = None
    scale: DestTensor | None = None


def per_block_bytes_from_rows(row_bytes: int, rows: int, num_blocks: int) -> int:
    """Bytes of one block of a tensor of ``rows`` rows of ``row_bytes`` over ``num_blocks``."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if rows % num_blocks:
        raise ValueError(f"{rows} rows do not split into {num_blocks} equal blocks")
    return row_bytes * (rows // num_blocks)


def _check_bytes(layer: str, component: str, src: TensorComponent, dst: DestTensor) -> None:
    if src.bytes_per_block <= 0:
        raise LayoutMismatch(layer, component, f"source block has {src.bytes_per_block} bytes")
    if src.bytes_per_block != dst.bytes_per_block:
        raise LayoutMismatch(
            layer, component,
            f"source block is {src.block_len} x {src.block_size_scale} = "
            f"{src.bytes_per_block} bytes, destination block is {dst.bytes_per_block} bytes",
        )


def validate_layout(src: SourceLayout, dst: DestinationLayout) -> None:
    """Raise ``LayoutMismatch`` naming the layer and the first mismatching component."""
    layer = dst.layer_name
    if len(src.main) != len(dst.main):
        raise LayoutMismatch(
            layer, "main",
            f"prefill advertises {len(src.main)} main tensors, decode expects {len(dst.main)}",
        )
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
