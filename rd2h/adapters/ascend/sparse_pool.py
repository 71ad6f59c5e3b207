"""Decode destinations in a SparseKVOffloadManager-style TP-shared host pool.

rd2h does not import vllm-ascend: the manager is used duck-typed. Attributes read:

- ``offload_layer_names``: the cache layer names whose main KV lives in the pool;
- ``host_kv_caches``: ``{layer_name: (k_host, v_host)}`` pinned host tensors of
  shape ``[num_blocks, ...]`` shared by every Decode TP rank (v may be None);
- ``host_base_addrs``: ``{layer_name: (k_addr, v_addr)}`` the addresses the
  transfer engine sees for those tensors (registered base addresses);
- ``block_bytes``: ``(k_bytes, v_bytes)`` per block;
- ``num_blocks``: blocks per host tensor;
- ``layer_id(layer_name) -> int``: the manager's layer index for a name.

The indexer (and LIC8 scale) stay rank-local: they come from this rank's own
vLLM caches (``indexer_caches``: ``{layer_name: tensor}``, optional
``scale_caches``), keyed by the *main* layer name they belong to.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rd2h.adapters.torch.tensors import main_views, region_of
from rd2h.domain.errors import LayoutMismatch
from rd2h.domain.planning.layout import DestinationLayout, DestTensor


class SparseKvPoolDestinations:
    main_sharing = "shared_pool"

    def __init__(
        self,
        manager: Any,
        *,
        indexer_caches: Mapping[str, Any] | None = None,
        scale_caches: Mapping[str, Any] | None = None,
        indexer_num_blocks: int | None = None,
    ) -> None:
        self._layouts: dict[str, DestinationLayout] = {}
        regions: dict[tuple[int, int], None] = {}
        num_blocks = int(manager.num_blocks)
        k_bytes, v_bytes = manager.block_bytes
        for name in manager.offload_layer_names:
            manager.layer_id(name)  # the manager must know every offloaded layer
            k_host, v_host = manager.host_kv_caches[name]
            k_addr, v_addr = manager.host_base_addrs[name]
            main = [DestTensor(int(k_addr), int(k_bytes), num_blocks)]
            regions[(int(k_addr), int(k_bytes) * num_blocks)] = None
            if v_host is not None:
                main.append(DestTensor(int(v_addr), int(v_bytes), num_blocks))
                regions[(int(v_addr), int(v_bytes) * num_blocks)] = None
            for t in (k_host, v_host):
                if t is not None and int(t.shape[0]) != num_blocks:
                    raise LayoutMismatch(name, "main", f"host tensor has {t.shape[0]} "
                                         f"blocks, manager says {num_blocks}")
            indexer = scale = None
            n_idx = indexer_num_blocks
            for kind, caches in (("indexer", indexer_caches), ("scale", scale_caches)):
                t = (caches or {}).get(name)
                if t is None:
                    continue
                n = n_idx if n_idx is not None else int(t.shape[0])
                (base, per_block, page), = main_views(f"{name}:{kind}", t, n)
                dest = DestTensor(base, per_block, n, None if page == per_block else page)
                regions[region_of(t)] = None
                if kind == "indexer":
                    indexer = dest
                else:
                    scale = dest
            self._layouts[name] = DestinationLayout(name, tuple(main), indexer, scale)
        self._regions = list(regions)
        self._keep = (manager, indexer_caches, scale_caches)

    def layouts(self) -> Mapping[str, DestinationLayout]:
        return self._layouts

    def regions(self) -> Sequence[tuple[int, int]]:
        return self._regions
