"""Read planning on Decode for one READ_READY_BATCH (spec 5), vectorised with numpy.

The planner turns a message, the two layouts and this rank's destination block
lists into one batch of read descriptors (three int64 arrays) covering every
request of the message, plus per-request ownership facts. Any rule violation
fails the whole layer with ``PlanningError``: the caller answers READ_FAILED.

Work per message is a short Python pass over the requests (look-ups, slices)
and array arithmetic over blocks: ownership ranges are computed for all
requests at once, contiguous runs are found on block ids (shared by the
tensors of a component) and addresses are computed only for run starts.

Here too: what the planner reads into (``Destination``, one request's destination
block lists), what it produces (``ReadPlan``) and its memo of the layer-independent
part (``PlanMemo``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain
from operator import attrgetter, getitem
from typing import Any, NamedTuple

import numpy as np

from rd2h.domain.errors import PlanningError
from rd2h.domain.planning.descriptors import DescriptorTemplate, Group, coalesce
from rd2h.domain.planning.digests import BlockChecks, block_checks, split_checks
from rd2h.domain.planning.kv_groups import NO_BLOCK
from rd2h.domain.planning.layer_pair import LayerPair, block_limit
from rd2h.domain.planning.layout import (
    DestinationLayout,
    DestTensor,
    SourceLayout,
    TensorComponent,
)
from rd2h.domain.planning.topology import owned_ranges
from rd2h.domain.wire.protocol import ReadReadyBatch, ReadRequest

__all__ = ["BlockPlan", "Destination", "PlanMemo", "ReadPlan", "RequestOwnership", "coalesce",
           "merge_plans", "plan_reads", "plan_run"]

_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.setflags(write=False)


# ====================================================================== what it reads into


def _as_ids(values: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.array(values, dtype=np.int64).reshape(-1)
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class Destination:
    """Decode's own destination block lists for one request (never leave Decode).

    Stored once as read-only int64 arrays: every layer's plan slices them. ``groups``:
    every KV cache group's list (vLLM), for layers whose ``DestinationLayout.group``
    names their group. ``NO_BLOCK`` (negative) marks a position with no block (outside
    a sliding window): nothing is read into it.
    """

    main_block_ids: np.ndarray
    indexer_block_ids: np.ndarray
    groups: tuple[np.ndarray, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "main_block_ids", _as_ids(self.main_block_ids))
        object.__setattr__(self, "indexer_block_ids", _as_ids(self.indexer_block_ids))
        object.__setattr__(self, "groups", tuple(map(_as_ids, self.groups)))

    def main_for(self, group: int | None) -> np.ndarray:
        """The list a layer's main tensors read into: its group's, else the main list."""
        if group is None or not self.groups:
            return self.main_block_ids
        if group >= len(self.groups):
            raise IndexError(f"no block ids for KV cache group {group}")
        return self.groups[group]

    def block_ids(self) -> set[int]:
        """Every real block of the request, over all lists (``NO_BLOCK`` left out)."""
        out: set[int] = set()
        for ids in (self.main_block_ids, self.indexer_block_ids, *self.groups):
            out.update(ids[ids != NO_BLOCK].tolist())
        return out


# ====================================================================== what it produces


class RequestOwnership(NamedTuple):
    """What this rank owns of one request in one message, and what it built for it
    (``descriptors`` counts one per owned block per tensor, before coalescing)."""

    ext_req_id: str
    main_blocks: int
    indexer_blocks: int
    descriptors: int

    @property
    def owns_nothing(self) -> bool:
        return self.main_blocks == 0 and self.indexer_blocks == 0


@dataclass(frozen=True)
class ReadPlan:
    """One batched read: ``lengths[i]`` bytes from ``remote_addrs[i]`` to ``local_addrs[i]``.

    ``requests`` gives the per-request ownership facts, in message order (built on
    first access from the per-request counts).
    """

    local_addrs: np.ndarray
    remote_addrs: np.ndarray
    lengths: np.ndarray
    ext_req_ids: tuple[str, ...]
    main_blocks: np.ndarray
    indexer_blocks: np.ndarray
    descriptors_built: np.ndarray
    blocks: int
    # ``verify_kv``: the digests to check after the read (None: none stated).
    checks: BlockChecks | None = None
    nbytes: int | None = None  # ``lengths``' sum, where the planner knows it already

    @cached_property
    def requests(self) -> tuple[RequestOwnership, ...]:
        return tuple(
            map(
                RequestOwnership,
                self.ext_req_ids,
                self.main_blocks.tolist(),
                self.indexer_blocks.tolist(),
                self.descriptors_built.tolist(),
            )
        )

    @property
    def num_descriptors(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def total_bytes(self) -> int:
        if self.nbytes is not None:
            return self.nbytes
        return int(self.lengths.sum()) if self.lengths.size else 0

    @property
    def owns_nothing(self) -> bool:
        return not (self.main_blocks.any() or self.indexer_blocks.any())


def merge_plans(plans: Sequence[ReadPlan]) -> ReadPlan:
    """One batched read for the plans of a layer run's layers (each planned and checked
    on its own): their descriptors one after the other, each request's owned blocks and
    built descriptors summed over the layers. Plans with digest checks are not merged
    (a layer run carries no digests)."""
    if len(plans) == 1:
        return plans[0]
    if any(p.checks is not None for p in plans):
        raise ValueError("plans with digest checks are not merged")
    ids = plans[0].ext_req_ids
    if all(p.ext_req_ids == ids for p in plans):  # a run's layers: the same requests
        order = dict.fromkeys(ids)
        main, index, built = (np.add.reduce([getattr(p, f) for p in plans]) for f in (
            "main_blocks", "indexer_blocks", "descriptors_built"))
    else:
        order = {}
        for plan in plans:
            for ext in plan.ext_req_ids:
                order.setdefault(ext, len(order))
        main, index, built = (np.zeros(len(order), dtype=np.int64) for _ in range(3))
        for plan in plans:
            at = np.fromiter(map(order.__getitem__, plan.ext_req_ids), dtype=np.int64,
                             count=len(plan.ext_req_ids))
            np.add.at(main, at, plan.main_blocks)
            np.add.at(index, at, plan.indexer_blocks)
            np.add.at(built, at, plan.descriptors_built)
    return ReadPlan(
        np.concatenate([p.local_addrs for p in plans]),
        np.concatenate([p.remote_addrs for p in plans]),
        np.concatenate([p.lengths for p in plans]),
        tuple(order), main, index, built, sum(p.blocks for p in plans), None,
        sum(p.total_bytes for p in plans))


# ====================================================================== its memo


class PlanMemo:
    """The last block plan (``rd2h.domain.planning.planning.BlockPlan``) per owner (a Prefill
    connection), reused when the next message of that owner names equal requests
    (ids, blocks, starts), the same contributor position and rank topology, and the
    very same ``Destination`` objects. The memo holds those objects, so an identity
    match can never be a recycled object. At most ``capacity`` owners are remembered
    (the oldest is forgotten first)."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._entries: dict[object, tuple[tuple[object, ...], tuple[object, ...], Any]] = {}
        self.hits = 0
        # (id(src), id(dst)) -> the ``LayerPair`` of a pair that passed
        # ``validate_layout``; it holds both objects, so their ids are not reused.
        self._layouts: dict[tuple[int, int], LayerPair] = {}
        self.layout_capacity = 8 * 1024

    def pair(self, src: SourceLayout, dst: DestinationLayout) -> LayerPair:
        """The ``LayerPair`` of two layouts (``validate_layout`` raises ``LayoutMismatch``),
        derived once per pair of layout objects (a peer's layouts are fixed by its
        MF_META, Decode's by its cache); a pair that failed is checked again each time."""
        key = (id(src), id(dst))
        hit = self._layouts.get(key)
        if hit is not None and hit.src is src and hit.dst is dst:
            return hit
        pair = LayerPair.of(src, dst)
        if len(self._layouts) >= self.layout_capacity:
            self._layouts.clear()  # many peers' MF_META came and went: start again
        self._layouts[key] = pair  # it holds both objects: their ids are not reused
        return pair

    def get(self, owner: object, key: tuple[object, ...],
            dests: tuple[object, ...]) -> Any:
        entry = self._entries.get(owner)
        if entry is None or entry[0] != key or len(entry[1]) != len(dests):
            return None
        if not all(a is b for a, b in zip(entry[1], dests)):
            return None
        self.hits += 1
        return entry[2]

    def put(self, owner: object, key: tuple[object, ...], dests: tuple[object, ...],
            plan: Any) -> None:
        self._entries.pop(owner, None)
        while len(self._entries) >= self.capacity:
            self._entries.pop(next(iter(self._entries)))
        self._entries[owner] = (key, dests, plan)

    def forget(self, owner: object) -> None:
        self._entries.pop(owner, None)
        self._layouts.clear()  # a peer's layouts went with it (the next ones are new)

    def __len__(self) -> int:
        return len(self._entries)


# ====================================================================== the planner


@dataclass(frozen=True)
class _Component:
    """Owned block ids of one component (main, or indexer+scale) across requests, and
    what every layer's plan derives from them (computed once per component)."""

    src: np.ndarray
    dst: np.ndarray
    counts: np.ndarray  # owned blocks per request

    @cached_property
    def src_hi(self) -> int:
        return int(self.src.max())

    @cached_property
    def dst_hi(self) -> int:
        return int(self.dst.max())

    @cached_property
    def dst_lo(self) -> int:
        return int(self.dst.min())

    @cached_property
    def runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Starts (src, dst) and lengths, in blocks, of runs consecutive on both sides."""
        src, dst = self.src, self.dst
        n = src.shape[0]
        brk = np.empty(n, dtype=bool)
        brk[0] = True
        step = brk[1:]
        np.not_equal(src[1:] - src[:-1], 1, out=step)
        step |= (dst[1:] - dst[:-1]) != 1
        if brk.all():  # nothing to merge (typical for a fragmented pool)
            return src, dst, np.ones(n, dtype=np.int64)
        first = np.flatnonzero(brk)
        length = np.diff(first, append=n)
        return src[first], dst[first], length


def _own(
    layer: str,
    what: str,
    reqs: Sequence[ReadRequest],
    src_lists: Sequence[Sequence[int]],
    lens: np.ndarray,
    dst_lists: Sequence[np.ndarray],
    starts: np.ndarray,
    k: int,
    r: int,
) -> _Component:
    """Owned blocks of every request, as flat source and destination id arrays."""
    n = len(reqs)
    room = np.fromiter(map(len, dst_lists), dtype=np.int64, count=n)
    # ``lens > room - starts``, not ``starts + lens > room``: a hostile start near
    # 2**63 must not wrap around and pass. (One reduction first: the exact search,
    # which also excuses empty lists, runs only when something may not fit.)
    over = lens > room - starts
    bad = np.flatnonzero(over & (lens > 0)) if over.any() else _EMPTY
    if bad.size:
        i = int(bad[0])
        raise PlanningError(
            layer,
            f"{what} blocks [{int(starts[i])}, {int(starts[i]) + int(lens[i])}) do not fit "
            f"the {int(room[i])} destination blocks",
            reqs[i].ext_req_id,
        )
    if k > 1:
        lo, hi = owned_ranges(lens, k, r, starts)
    else:
        lo, hi = np.zeros(n, dtype=np.int64), lens
    counts = hi - lo
    total = int(counts.sum())
    if total == 0:
        return _Component(_EMPTY, _EMPTY, counts)
    src = np.fromiter(
        chain.from_iterable(map(getitem, src_lists, map(slice, lo.tolist(), hi.tolist()))),
        dtype=np.int64, count=total,
    )
    dst = np.concatenate(
        list(map(getitem, dst_lists, map(slice, (starts + lo).tolist(), (starts + hi).tolist())))
    )
    held = dst != NO_BLOCK
    if not held.all():
        # Positions Decode holds no block for (vLLM's null block outside a sliding
        # window): nothing is read there, never into the shared null block.
        owner = np.repeat(np.arange(n, dtype=np.int64), counts)
        counts = np.bincount(owner[held], minlength=n).astype(np.int64)
        src, dst = src[held], dst[held]
        if not src.size:
            return _Component(_EMPTY, _EMPTY, counts)
    return _Component(src, dst, counts)


def _check_source(
    layer: str,
    what: str,
    comp: _Component,
    tensors: Sequence[TensorComponent],
    reqs: Sequence[ReadRequest],
) -> None:
    """Refuse reads outside Prefill's advertised regions (when it advertised their size)
    and source addresses beyond the 64-bit range, naming the first request at fault."""
    if comp.src.size == 0:
        return
    highest = comp.src_hi
    for tensor in tensors:
        limit, advertised = block_limit(tensor)
        if highest < limit:
            continue
        where = (f"the {tensor.num_blocks} blocks prefill advertised for its {what} tensor"
                 if advertised else "the 64-bit address space")
        at = int(np.argmax(comp.src >= limit))
        owner = int(np.searchsorted(np.cumsum(comp.counts), at, side="right"))
        raise PlanningError(
            layer,
            f"{what} source block {int(comp.src[at])} is beyond {where}",
            reqs[owner].ext_req_id,
        )


def _check_range(hi: int, lo: int, dst: DestTensor, layer: str, what: str) -> None:
    """``hi`` / ``lo``: the highest and lowest destination block of a component."""
    if hi >= dst.num_blocks:
        raise PlanningError(
            layer,
            f"{what} destination block {hi} is beyond the "
            f"{dst.num_blocks} blocks of the destination",
        )
    if lo < 0:
        raise PlanningError(layer, f"{what} destination block {lo} is negative")


@dataclass(frozen=True)
class BlockPlan:
    """The layer-independent part of a plan: the blocks this rank owns of each request
    of a message. Every layer of a chunk names the same requests and blocks, so a
    ``PlanMemo`` lets the next layer reuse it; only addresses differ per layer."""

    ext_ids: tuple[str, ...]
    main: _Component
    index: _Component
    # Descriptor templates by layer shape (tensor block sizes, head slices): see
    # ``rd2h.domain.planning.descriptors``; filled as layers of each shape are planned.
    templates: dict[object, Any] = field(default_factory=dict, compare=False)

    def built(self, main_tensors: int, idx_tensors: int) -> tuple[np.ndarray, int | None]:
        """Descriptors built per request before coalescing, and the first request that
        owns blocks yet gets none (None: no such request)."""
        key = ("built", main_tensors, idx_tensors)
        hit = self.templates.get(key)
        if hit is None:
            built = self.main.counts * main_tensors + self.index.counts * idx_tensors
            built.setflags(write=False)
            empty = np.flatnonzero((self.main.counts + self.index.counts > 0) & (built == 0))
            hit = self.templates[key] = (built, int(empty[0]) if empty.size else None)
        return hit  # type: ignore[return-value]

    def descriptors(self, pair: LayerPair,
                    layer: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """This layer's descriptors (runs of consecutive blocks become one descriptor) and
        the bytes they read. Destination ids are checked against the pair's limits as
        integers; the exact check, naming the tensor, runs only when one is crossed."""
        template, bases = self.template(pair, layer)
        local, remote, lengths = template.layer(*bases)
        return local, remote, lengths, template.total_bytes

    def template(self, pair: LayerPair, layer: str) -> tuple[DescriptorTemplate, Any]:
        """The descriptor template of this layer's shape and the layer's base addresses,
        after the destination range checks (``descriptors``)."""
        main, index = self.main, self.index
        has_main = bool(main.src.size) and bool(pair.main_pairs)
        has_index = bool(index.src.size) and bool(pair.index_pairs)
        for comp, pairs, what, room, used in (
                (main, pair.main_pairs, "main", pair.main_dst_blocks, has_main),
                (index, pair.index_pairs, "indexer", pair.index_dst_blocks, has_index)):
            if used and (comp.dst_hi >= room or comp.dst_lo < 0):
                for _, dst in pairs:
                    _check_range(comp.dst_hi, comp.dst_lo, dst, layer, what)
        template = self.templates.get(pair.shape)
        if template is None:
            groups: list[Group] = [(main, pair.main_pairs, "main", pair.slices),
                                   (index, pair.index_pairs, "indexer", None)]
            template = self.templates[pair.shape] = DescriptorTemplate.build(groups)
        return template, pair.bases(has_main, has_index)


def _block_plan(
    batch: ReadReadyBatch,
    dests: Sequence[Destination | None],
    *,
    has_main: bool,
    has_indexer: bool,
    d_rank: int,
    d_tp: int,
    main_shared: bool,
    head_split: bool = False,
    group: int | None = None,
) -> BlockPlan:
    layer = batch.layer_name
    member, ratio = batch.group_member_idx, max(1, batch.tp_ratio)
    reqs = batch.read_reqs
    n = len(reqs)
    ext_ids = tuple(map(attrgetter("ext_req_id"), reqs))
    main_lists = list(map(attrgetter("p_main_block_ids"), reqs))
    idx_lists = list(map(attrgetter("p_indexer_block_ids"), reqs))
    main_lens = np.fromiter(map(len, main_lists), dtype=np.int64, count=n)
    idx_lens = np.fromiter(map(len, idx_lists), dtype=np.int64, count=n)
    # The first request (in message order) that breaks a rule fails the layer.
    missing = dests.index(None) if None in dests else n
    blank = np.flatnonzero((main_lens == 0) & (idx_lens == 0))
    if missing < n or blank.size:
        if missing <= (int(blank[0]) if blank.size else n):
            raise PlanningError(layer, "no destination blocks are known for it", ext_ids[missing])
        raise PlanningError(layer, "the read request names no blocks", ext_ids[int(blank[0])])

    zeros = np.zeros(n, dtype=np.int64)
    main = _Component(_EMPTY, _EMPTY, zeros)
    index = _Component(_EMPTY, _EMPTY, zeros)
    # Main is read from member 0 alone when every member holds all of it (replicated,
    # e.g. MLA's latent); with a head split each member holds its own heads of it.
    if (member == 0 or head_split) and has_main and n:
        main = _own(
            layer, "main", reqs, main_lists, main_lens,
            [d.main_for(group) for d in dests],
            np.fromiter(map(attrgetter("main_start_block"), reqs), dtype=np.int64, count=n),
            # A shared main pool is split over the Decode ranks; a rank-local main
            # cache (vanilla vLLM) needs every main block on every rank.
            d_tp if main_shared else 1, d_rank if main_shared else 0,
        )
    if has_indexer and n:
        index = _own(
            layer, "indexer", reqs, idx_lists, idx_lens,
            list(map(attrgetter("indexer_block_ids"), dests)),
            np.fromiter(map(attrgetter("indexer_start_block"), reqs), dtype=np.int64, count=n),
            ratio, member,
        )
    return BlockPlan(ext_ids, main, index)


def plan_reads(
    batch: ReadReadyBatch,
    src: SourceLayout,
    dst: DestinationLayout,
    destinations: Mapping[str, Destination],
    *,
    d_rank: int,
    d_tp: int,
    main_shared: bool = True,
    memo: PlanMemo | None = None,
    owner: object = None,
) -> ReadPlan:
    """Plan this Decode rank's share of a READ_READY_BATCH.

    Main K/V is read only by contributor member 0 (every member of a group holds all
    of it), or, with a head split (``main_slices``), by every member into its heads'
    slice of each Decode block, and split over the Decode TP
    ranks (rotated by the chunk's start); the indexer and LIC8 scale are split
    over the contributor members so every Decode rank ends with a full copy.
    With ``main_shared=False`` (each Decode rank has its own main cache) this rank
    reads every main block instead of its share.
    With a ``memo``, the block ownership of the last message from ``owner`` is
    reused when this message names the same requests, blocks and destinations
    (every layer of a chunk does); the per-layer checks and addresses always run.
    Raises ``LayoutMismatch`` or ``PlanningError``; either fails the whole layer.
    """
    pair = memo.pair(src, dst) if memo is not None else LayerPair.of(src, dst)
    blocks = _blocks_of(batch, pair, src, dst, destinations, d_rank, d_tp, main_shared, memo,
                        owner)
    return _plan_layer(batch, blocks, pair, src, dst, d_rank, d_tp, main_shared)


def plan_run(
    batches: Sequence[ReadReadyBatch],
    layouts: Sequence[tuple[SourceLayout, DestinationLayout]],
    destinations: Mapping[str, Destination],
    *,
    d_rank: int,
    d_tp: int,
    main_shared: bool = True,
    memo: PlanMemo | None = None,
    owner: object = None,
) -> tuple[ReadPlan | None, list[Exception | None]]:
    """``plan_reads`` for the layers of a layer run (the same read entries, contributor
    position and destinations in every layer; ``layouts[i]`` is layer i's pair), as one
    plan: every layer is checked on its own, and what fails is returned in its place
    (``LayoutMismatch``, ``PlanningError``, or any other exception: a planner bug; None
    for a layer in the plan). The block plan is derived once per layer shape, and the
    descriptors of consecutive layers of one shape are built together (one array
    operation for all of them, from each layer's base addresses)."""
    errors: list[Exception | None] = []
    parts: list[ReadPlan] = []
    stack: list[Any] = []  # bases of consecutive layers with the same template and blocks
    blocks: BlockPlan | None = None
    shape: tuple[object, ...] | None = None
    current: tuple[DescriptorTemplate, np.ndarray] | None = None

    def flush() -> None:
        if not stack or current is None or blocks is None:
            return
        template, built = current
        n = len(stack)
        local, remote, lengths = template.layers([b[0] for b in stack], [b[1] for b in stack])
        parts.append(ReadPlan(local, remote, lengths, blocks.ext_ids, blocks.main.counts * n,
                              blocks.index.counts * n, built * n,
                              n * int(blocks.main.src.size + blocks.index.src.size), None,
                              n * template.total_bytes))
        stack.clear()

    digests = bool(batches) and any(r.digests is not None for r in batches[0].read_reqs)
    for batch, (src, dst) in zip(batches, layouts):
        try:
            pair = memo.pair(src, dst) if memo is not None else LayerPair.of(src, dst)
            kind = pair.kind
            if blocks is None or kind != shape:
                flush()
                blocks = _blocks_of(batch, pair, src, dst, destinations, d_rank, d_tp,
                                    main_shared, memo, owner)
                shape = kind
            if digests:
                flush()
                parts.append(_plan_layer(batch, blocks, pair, src, dst, d_rank, d_tp,
                                         main_shared))
                errors.append(None)
                continue
            # What the checks and the template give for this block plan and layer pair
            # (both fixed): derived once, kept with the block plan.
            hit = blocks.templates.get((_LAYER, id(pair)))
            if hit is None or hit[0] is not pair:
                built = _checked(batch, blocks, pair, src)
                template, bases = blocks.template(pair, batch.layer_name)
                hit = (pair, built, template, bases, template.merges_seam(bases))
                blocks.templates[(_LAYER, id(pair))] = hit
            _, built, template, bases, merges = hit
        except Exception as exc:  # the caller fails this layer alone
            errors.append(exc)
            continue
        errors.append(None)
        if current is None or current[0] is not template or current[1] is not built:
            flush()
            current = (template, built)
        if merges:  # adjacent tensors: this layer on its own
            flush()
            local, remote, lengths = template.layer(*bases)
            parts.append(ReadPlan(local, remote, lengths, blocks.ext_ids, blocks.main.counts,
                                  blocks.index.counts, built,
                                  int(blocks.main.src.size + blocks.index.src.size), None,
                                  template.total_bytes))
        else:
            stack.append((bases[0], bases[1]))
    flush()
    return (merge_plans(parts) if parts else None), errors


_LAYER = "layer"  # ``BlockPlan.templates`` key of a layer pair's checked template


def _blocks_of(batch: ReadReadyBatch, pair: LayerPair, src: SourceLayout,
               dst: DestinationLayout, destinations: Mapping[str, Destination], d_rank: int,
               d_tp: int, main_shared: bool, memo: PlanMemo | None, owner: object) -> BlockPlan:
    """The message's block plan: the memo's (``PlanMemo``) or derived now."""
    slices = pair.slices
    reqs = batch.read_reqs
    dests = tuple(map(destinations.get, map(attrgetter("ext_req_id"), reqs)))
    has_main, has_indexer = bool(src.main), src.indexer is not None
    key = (reqs, batch.group_member_idx, batch.tp_ratio, has_main, has_indexer, d_rank, d_tp,
           main_shared, slices is not None, dst.group)
    blocks = memo.get(owner, key, dests) if memo is not None else None
    if blocks is None:
        blocks = _block_plan(batch, dests, has_main=has_main, has_indexer=has_indexer,
                             d_rank=d_rank, d_tp=d_tp, main_shared=main_shared,
                             head_split=slices is not None, group=dst.group)
        if memo is not None:
            memo.put(owner, key, dests, blocks)
    return blocks


def _checked(batch: ReadReadyBatch, blocks: BlockPlan, pair: LayerPair,
             src: SourceLayout) -> np.ndarray:
    """The layer's source checks; the descriptors built per request."""
    layer, reqs = batch.layer_name, batch.read_reqs
    main, index = blocks.main, blocks.index
    # The pair's limits first, as integers; the exact check names the block at fault.
    if main.src.size and main.src_hi >= pair.main_src_limit:
        _check_source(layer, "main", main, src.main, reqs)
    if index.src.size and index.src_hi >= pair.index_src_limit:
        _check_source(
            layer, "indexer", index, [t for t in (src.indexer, src.scale) if t is not None],
            reqs)
    built, empty = blocks.built(len(pair.main_pairs), 1 + (src.scale is not None))
    if empty is not None:
        raise PlanningError(layer, "this rank owns blocks but built no descriptor",
                            reqs[empty].ext_req_id)
    return built


def _plan_layer(batch: ReadReadyBatch, blocks: BlockPlan, pair: LayerPair, src: SourceLayout,
                dst: DestinationLayout, d_rank: int, d_tp: int, main_shared: bool) -> ReadPlan:
    """One layer's checks and descriptors from its block plan."""
    slices = pair.slices
    layer = batch.layer_name
    reqs = batch.read_reqs
    main, index = blocks.main, blocks.index
    built = _checked(batch, blocks, pair, src)
    local, remote, lengths, nbytes = blocks.descriptors(pair, layer)
    checks = None
    if pair.state_split and any(r.digests is not None for r in reqs):
        cut_m = np.cumsum(main.counts)[:-1]
        checks = split_checks(layer, reqs, list(zip(np.split(main.src, cut_m),
                                                    np.split(main.dst, cut_m))),
                              slices, dst.main[0])
    if slices is None and any(r.digests is not None for r in reqs):  # head split: unchecked
        cut_m, cut_i = np.cumsum(main.counts)[:-1], np.cumsum(index.counts)[:-1]
        owned = [(m, i) for m, i in zip(zip(np.split(main.src, cut_m), np.split(main.dst, cut_m)),
                                        zip(np.split(index.src, cut_i),
                                            np.split(index.dst, cut_i)))]
        checks = block_checks(
            layer, reqs, src, owned, dst.main,
            [t for t in (dst.indexer, dst.scale) if t is not None],
            main_owner=(d_rank, d_tp) if main_shared else (0, 1),
            idx_owner=(batch.group_member_idx, max(1, batch.tp_ratio)))
    return ReadPlan(
        local, remote, lengths, blocks.ext_ids, main.counts, index.counts, built,
        int(main.src.size + index.src.size), checks, nbytes,
    )
