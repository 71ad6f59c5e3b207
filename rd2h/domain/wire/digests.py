"""End-to-end KV digests (``verify_kv``): which bytes each digest covers, on both sides.

Prefill states, per announced request, one digest per block of each of the layer's
tensors, in this order: the main tensors (over the request's main block ids), then the
indexer and the LIC8 scale (over its indexer block ids), each list aligned with its
block ids. A digest is XXH3-64 of the block's bytes, its top bit cleared (the wire's
ints are below 2**63); the hashing itself is an adapter's (``rd2h.adapters.hashing``).
Decode checks the blocks it read, at their destination addresses, after the read
(``block_checks``): any difference fails the layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rd2h.domain.errors import PlanningError
from rd2h.domain.planning.layout import DestTensor, SourceLayout, TensorComponent
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
    size = tensor.bytes_per_block
    return np.asarray(ids, dtype=np.int64) * size + tensor.base_addr, size


@dataclass(frozen=True)
class BlockChecks:
    """After the read, the XXH3 digest (masked) of ``sizes[i]`` bytes at ``addrs[i]``
    must equal ``expected[i]``; ``what[i]`` names it: (request, tensor, source block)."""

    addrs: np.ndarray
    sizes: np.ndarray
    expected: np.ndarray
    what: tuple[tuple[str, str, int], ...]


def block_checks(
    layer: str, reqs: Sequence[ReadRequest], src: SourceLayout,
    owned: Sequence[tuple[np.ndarray, np.ndarray]],
    main_dst: Sequence[DestTensor], idx_dst: Sequence[DestTensor],
) -> BlockChecks | None:
    """The checks of the blocks this rank read: ``owned[r]`` = (main, indexer) pairs of
    (source ids, destination ids) it read for request ``r``. None when no request states
    digests. A request whose digests do not match its block lists fails the layer."""
    names = tensor_names(src)
    addrs: list[int] = []
    sizes: list[int] = []
    expected: list[int] = []
    what: list[tuple[str, str, int]] = []
    stated = False
    for req, (main_ids, idx_ids) in zip(reqs, owned):
        if req.digests is None:
            continue
        stated = True
        lists = (*([req.p_main_block_ids] * len(src.main)),
                 *([req.p_indexer_block_ids] * (len(names) - len(src.main))))
        if len(req.digests) != len(names) or any(
                len(d) != len(ids) for d, ids in zip(req.digests, lists)):
            raise PlanningError(layer, f"KV digests for {len(req.digests)} tensors do not "
                                f"match the {len(names)} tensors and their blocks",
                                req.ext_req_id)
        tensors = (*zip(src.main, main_dst, names, req.digests, [main_ids] * len(src.main)),
                   *zip((t for t in (src.indexer, src.scale) if t is not None), idx_dst,
                        names[len(src.main):], req.digests[len(src.main):],
                        [idx_ids] * 2))
        for s_tensor, d_tensor, name, digests, (s_ids, d_ids) in tensors:
            where = {b: i for i, b in enumerate(lists[names.index(name)])}
            for s_id, d_id in zip(s_ids.tolist(), d_ids.tolist()):
                addrs.append(d_tensor.base_addr + d_id * d_tensor.bytes_per_block)
                sizes.append(s_tensor.bytes_per_block)
                expected.append(digests[where[s_id]])
                what.append((req.ext_req_id, name, s_id))
    if not stated:
        return None
    return BlockChecks(np.asarray(addrs, dtype=np.int64), np.asarray(sizes, dtype=np.int64),
                       np.asarray(expected, dtype=np.int64), tuple(what))
