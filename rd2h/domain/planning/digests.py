"""End-to-end KV digests (``verify_kv``): which bytes each digest covers, on both sides.

Prefill states, per announced request, one list of digests per tensor of the layer, in
this order: the main tensors (over the request's main block ids), then the indexer and
the LIC8 scale (over its indexer block ids). A list is aligned with one of these:
- the tensor's block ids (one digest per block);
- the reading Decode rank's owned range of them (``owned_range``, the planner's own
  arithmetic): main over the Decode ranks when Prefill states a shared main pool (the
  handshake refuses a Decode that states otherwise), the indexer over the members;
- nothing: empty, for a tensor Decode never reads from this Prefill rank. Main K/V is
  read from contributor member 0 alone (every member holds all of it; a head split,
  where each member holds its own heads, is not checked). A state layer split across TP
  sizes (``state_split``) is checked run by run: each contributor states, per block,
  one digest per run its reader reads (``stated_split_digests``, ``split_checks``).
So each Prefill rank hashes only what its reader reads (``stated_digests``).
A digest is XXH3-64 of the block's page (the tensor's own bytes of the block, exactly
what a read moves: ``TensorComponent.page``), its top bit cleared (the wire's ints are below
2**63); the hashing itself is an adapter's (``rd2h.adapters.hashing``). Decode checks
the blocks it read, at their destination addresses, after the read (``block_checks``):
any difference fails the layer, and so does a block read without a stated digest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from rd2h.domain.errors import PlanningError
from rd2h.domain.planning.layout import DestTensor, MainSlice, SourceLayout, TensorComponent
from rd2h.domain.planning.topology import owned_range
from rd2h.domain.wire.protocol import ReadRequest

DIGEST_MASK = (1 << 63) - 1


def tensor_names(src: SourceLayout) -> tuple[str, ...]:
    """The layer's tensors in digest order."""
    main = ("main",) if len(src.main) == 1 else tuple(f"main[{i}]" for i in range(len(src.main)))
    return (main + (("indexer",) if src.indexer is not None else ())
            + (("scale",) if src.scale is not None else ()))


def source_spans(src: SourceLayout, req: ReadRequest) -> list[tuple[np.ndarray, int]]:
    """Per tensor in digest order: the addresses of the request's blocks and their size."""
    spans = []
    for tensor in src.main:
        spans.append(_addrs(tensor, req.p_main_block_ids))
    for tensor in (src.indexer, src.scale):
        if tensor is not None:
            spans.append(_addrs(tensor, req.p_indexer_block_ids))
    return spans


def _addrs(tensor: TensorComponent, ids: Sequence[int]) -> tuple[np.ndarray, int]:
    """The blocks' addresses and the bytes hashed of each: the tensor's page, the bytes
    a read moves (``TensorComponent.page``), no more."""
    return (np.asarray(ids, dtype=np.int64) * tensor.bytes_per_block + tensor.base_addr,
            tensor.page)


def stated_range(req: ReadRequest, main: bool, owner: tuple[int, int]) -> tuple[int, int]:
    """The positions ``[lo, hi)`` of ``req``'s main (or indexer) block ids that owner
    ``owner = (r, k)`` (r of k) reads: the planner's split, rotated by the start block."""
    r, k = owner
    ids, start = ((req.p_main_block_ids, req.main_start_block) if main
                  else (req.p_indexer_block_ids, req.indexer_start_block))
    return owned_range(len(ids), k, r, start) if k > 1 else (0, len(ids))


def stated_digests(src: SourceLayout, req: ReadRequest,
                   digest: Callable[[np.ndarray, np.ndarray], np.ndarray], *,
                   member: int = 0, ratio: int = 1, main_owner: tuple[int, int] = (0, 1)
                   ) -> tuple[tuple[int, ...], ...]:
    """Prefill's digests for ``req`` as contributor ``member`` of ``ratio``, hashing only
    what its reader reads: main on member 0 alone, over ``main_owner`` = (Decode rank,
    Decode TP) when the main pool is shared, else (0, 1): every block; the indexer and
    scale over this member's share. ``digest(addrs, sizes)`` hashes host memory."""
    main_lo, main_hi = stated_range(req, True, main_owner) if member == 0 else (0, 0)
    idx_lo, idx_hi = stated_range(req, False, (member, ratio))
    out = []
    for i, (addrs, size) in enumerate(source_spans(src, req)):
        lo, hi = (main_lo, main_hi) if i < len(src.main) else (idx_lo, idx_hi)
        part = addrs[lo:hi]
        out.append(tuple(digest(part, np.full(part.size, size, dtype=np.int64)).tolist())
                   if part.size else ())
    return tuple(out)


def stated_split_digests(src: SourceLayout, req: ReadRequest,
                         digest: Callable[[np.ndarray, np.ndarray], np.ndarray],
                         runs: Sequence[MainSlice]) -> tuple[tuple[int, ...], ...]:
    """A state layer split across TP sizes (``state_split``): for its one main tensor,
    per block of ``req``, one digest per run its reader reads (``runs``: the reader's
    ``state_slices``), block by block; every contributor states its own."""
    t = src.main[0]
    base = np.asarray(req.p_main_block_ids, dtype=np.int64) * t.bytes_per_block + t.base_addr
    offsets = np.fromiter((r.src_offset for r in runs), dtype=np.int64, count=len(runs))
    sizes = np.fromiter((r.nbytes for r in runs), dtype=np.int64, count=len(runs))
    addrs = (base[:, None] + offsets[None, :]).ravel()
    return (tuple(digest(addrs, np.tile(sizes, base.size)).tolist()) if addrs.size else (),)


def _positions(layer: str, ids: Sequence[int], s_ids: np.ndarray, name: str,
               ext_id: str) -> np.ndarray:
    """Where each block read (``s_ids``) sits in the stated list ``ids``; the planner
    reads listed ids only, so one that is not listed fails the layer."""
    listed = np.asarray(ids, dtype=np.int64)
    order = np.argsort(listed, kind="stable")
    at = np.searchsorted(listed, s_ids, sorter=order)
    pos = order[np.minimum(at, order.size - 1)]
    if not np.array_equal(listed[pos], s_ids):
        raise PlanningError(layer, f"a {name} block read is not in the request's block "
                            "list", ext_id)
    return pos


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def split_checks(layer: str, reqs: Sequence[ReadRequest],
                 owned: Sequence[tuple[np.ndarray, np.ndarray]], runs: Sequence[MainSlice],
                 dst: DestTensor) -> BlockChecks | None:
    """The checks of a state layer split across TP sizes: ``owned[r]`` = (source ids,
    destination ids) of the main blocks this rank read for request ``r``; each run of
    each block is checked at its destination against the digest Prefill stated for it
    (``stated_split_digests``). None when no request states digests."""
    n = len(runs)
    d_offsets = np.fromiter((r.dst_offset for r in runs), dtype=np.int64, count=n)
    run_sizes = np.fromiter((r.nbytes for r in runs), dtype=np.int64, count=n)
    addrs, sizes, expected, blocks = [], [], [], []
    spans: list[tuple[str, str, int]] = []
    stated = False
    for req, (s_ids, d_ids) in zip(reqs, owned):
        if req.digests is None:
            continue
        stated = True
        ids = req.p_main_block_ids
        if len(req.digests) != 1 or len(req.digests[0]) not in (0, len(ids) * n):
            raise PlanningError(layer, f"KV digests for {len(req.digests)} tensors do not "
                                f"match the state page's {n} runs of {len(ids)} blocks",
                                req.ext_req_id)
        if not s_ids.size:
            continue
        if not req.digests[0]:
            raise PlanningError(layer, "Prefill stated no KV digests for the state runs "
                                "this rank reads from it", req.ext_req_id)
        pos = _positions(layer, ids, s_ids, "state", req.ext_req_id)
        grid = np.asarray(req.digests[0], dtype=np.int64).reshape(len(ids), n)[pos]
        addrs.append(((d_ids * dst.bytes_per_block + dst.base_addr)[:, None]
                      + d_offsets[None, :]).ravel())
        sizes.append(np.tile(run_sizes, s_ids.size))
        expected.append(grid.ravel())
        blocks.append(np.repeat(s_ids, n))
        spans.append((req.ext_req_id, "main", int(s_ids.size) * n))
    if not stated:
        return None

    return BlockChecks(_cat(addrs), _cat(sizes), _cat(expected), _cat(blocks), tuple(spans))


@dataclass(frozen=True)
class BlockChecks:
    """After the read, the XXH3 digest (masked) of ``sizes[i]`` bytes at ``addrs[i]``
    must equal ``expected[i]``; ``blocks[i]`` is its source block, and ``spans`` the
    runs of checks per (request, tensor): ``(ext id, tensor name, count)`` in order."""

    addrs: np.ndarray
    sizes: np.ndarray
    expected: np.ndarray
    blocks: np.ndarray
    spans: tuple[tuple[str, str, int], ...]

    def describe(self, indices: Iterable[int]) -> list[tuple[str, str, int]]:
        """(request, tensor, source block) of the checks at ``indices`` (ascending)."""
        ends = np.cumsum([n for _, _, n in self.spans])
        out = []
        for i in indices:
            ext, name, _ = self.spans[int(np.searchsorted(ends, i, side="right"))]
            out.append((ext, name, int(self.blocks[i])))
        return out

    @property
    def what(self) -> tuple[tuple[str, str, int], ...]:
        """Every check's (request, tensor, source block): for tests and messages."""
        return tuple(self.describe(range(len(self.blocks))))


def block_checks(
    layer: str, reqs: Sequence[ReadRequest], src: SourceLayout,
    owned: Sequence[tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]],
    main_dst: Sequence[DestTensor], idx_dst: Sequence[DestTensor], *,
    main_owner: tuple[int, int] = (0, 1), idx_owner: tuple[int, int] = (0, 1),
) -> BlockChecks | None:
    """The checks of the blocks this rank read: ``owned[r]`` = (main, indexer) pairs of
    (source ids, destination ids) it read for request ``r``; ``main_owner`` and
    ``idx_owner`` = (r, k), this rank's split of main (over the Decode ranks, when the
    pool is shared) and of the indexer (over the members). None when no request states
    digests. Array work per (request, tensor), nothing per block in Python. A request
    whose digests fit neither its block lists nor this rank's range of them, or that
    states none for a tensor this rank read, fails the layer."""
    names = tensor_names(src)
    n_main = len(src.main)
    srcs = (*src.main, *(t for t in (src.indexer, src.scale) if t is not None))
    dsts = (*main_dst, *idx_dst)
    addrs: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    expected: list[np.ndarray] = []
    blocks: list[np.ndarray] = []
    spans: list[tuple[str, str, int]] = []
    stated = False
    for req, (main_pair, idx_pair) in zip(reqs, owned):
        if req.digests is None:
            continue
        stated = True
        if len(req.digests) != len(names):
            raise PlanningError(layer, f"KV digests for {len(req.digests)} tensors do not "
                                f"match the {len(names)} tensors and their blocks",
                                req.ext_req_id)
        ranges = (stated_range(req, True, main_owner), stated_range(req, False, idx_owner))
        for t, (name, digests) in enumerate(zip(names, req.digests)):
            main = t < n_main
            ids = req.p_main_block_ids if main else req.p_indexer_block_ids
            s_ids, d_ids = main_pair if main else idx_pair
            lo, hi = ranges[0] if main else ranges[1]
            if len(digests) == len(ids):
                lo, hi = 0, len(ids)
            elif len(digests) not in (0, hi - lo):
                raise PlanningError(layer, f"KV digests for {len(req.digests)} tensors do "
                                    f"not match the {len(names)} tensors and their blocks",
                                    req.ext_req_id)
            if not s_ids.size:
                continue
            if not digests:
                raise PlanningError(layer, f"Prefill stated no KV digests for the {name} "
                                    f"blocks this rank reads from it", req.ext_req_id)
            pos = _positions(layer, ids[lo:hi], s_ids, name, req.ext_req_id)
            s_t, d_t = srcs[t], dsts[t]
            addrs.append(d_ids * d_t.bytes_per_block + d_t.base_addr)
            sizes.append(np.full(s_ids.size, s_t.page, dtype=np.int64))
            expected.append(np.asarray(digests, dtype=np.int64)[pos])
            blocks.append(s_ids)
            spans.append((req.ext_req_id, name, int(s_ids.size)))
    if not stated:
        return None

    return BlockChecks(_cat(addrs), _cat(sizes), _cat(expected), _cat(blocks), tuple(spans))
