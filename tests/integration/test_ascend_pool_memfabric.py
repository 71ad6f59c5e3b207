"""The Ascend Decode destination (a SparseKVOffloadManager-style TP-shared host pool)
behind the MemFabric adapter, through the connector's own composition root.

Both sides are built exactly as the vLLM connector builds them
(``build_prefill_worker`` / ``build_decode_worker`` with ``transport: memfabric``);
``memfabric_hybrid`` is the recording fake (``tests/fakes/memfabric.py``), one fake
process per rank, which moves real bytes by address. Control messages go over real
ZMQ sockets.

The pool is one shared-memory file mapped twice: the manager's host tensors
(``host_kv_caches``) are one mapping, the addresses the transfer engine sees
(``host_base_addrs``) the other; same bytes, different addresses. So the test can
tell which addresses rd2h registered and wrote through, and still check the bytes
through the host tensors. Two Decode ranks share the pool (``main_shared``): each
pulls a disjoint share of main KV; the indexer stays rank-local.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from fakes.memfabric import FakeMemFabricNetwork
from fakes.net import free_ports

from rd2h.adapters.ascend.sparse_pool import SparseKvPoolDestinations
from rd2h.adapters.memfabric import start_config_store
from rd2h.adapters.torch.exchange import InMemoryExchangeGroup
from rd2h.app.connector.facts import EngineFacts
from rd2h.app.connector.plans import DecodeEndpoint, DecodeLoad, PrefillSend, StepPlan
from rd2h.app.settings import Rd2hOptions
from rd2h.bootstrap.roles import build_decode_worker, build_prefill_worker
from rd2h.domain.planning.chunks import external_request_id
from rd2h.domain.planning.layout import SourceLayout, TensorComponent

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

LAYERS = 3
NAMES = [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
K_BYTES, V_BYTES, I_BYTES = 96, 32, 24  # per block: latent K, rope V, indexer
POOL_BLOCKS, P_BLOCKS, D_IDX_BLOCKS = 8, 10, 7
P_IDS = (5, 2, 9, 7, 0)  # the request's blocks on Prefill ...
D_MAIN = (3, 0, 6, 1, 7)  # ... in the shared pool ...
D_IDX = (2, 4, 1, 5, 6)  # ... and in each Decode rank's own indexer cache
RID = "req-00001-e0000001"  # vLLM's internal id (9-character engine suffix)
SENTINEL = 0xEE
DEADLINE_S = 20.0


def pattern(layer: int, comp: int, block: int, nbytes: int) -> np.ndarray:
    """Bytes Prefill computed for (layer, component, Prefill block)."""
    return ((np.arange(nbytes) * 7 + layer * 31 + comp * 101 + block * 13) % 251).astype(np.uint8)


class DoublyMappedPool:
    """One shared-memory file mapped twice in this process."""

    def __init__(self, size: int) -> None:
        fd = os.memfd_create("rd2h-test-pool")
        try:
            os.ftruncate(fd, size)
            self._host_map = mmap.mmap(fd, size)
            self._engine_map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.host = torch.frombuffer(self._host_map, dtype=torch.uint8)
        self.host.fill_(SENTINEL)
        self._anchor = ctypes.c_char.from_buffer(self._engine_map)
        self.engine_addr = ctypes.addressof(self._anchor)
        assert self.engine_addr != self.host.data_ptr()


@dataclass
class FakeOffloadManager:
    """The attributes ``SparseKvPoolDestinations`` reads from vllm-ascend's manager."""

    offload_layer_names: list[str]
    host_kv_caches: dict[str, tuple[torch.Tensor, torch.Tensor]]
    host_base_addrs: dict[str, tuple[int, int]]
    block_bytes: tuple[int, int]
    num_blocks: int

    def layer_id(self, layer_name: str) -> int:
        return self.offload_layer_names.index(layer_name)


def make_manager(pool: DoublyMappedPool) -> FakeOffloadManager:
    caches, addrs = {}, {}
    per_layer = POOL_BLOCKS * (K_BYTES + V_BYTES)
    for i, name in enumerate(NAMES):
        k_off, v_off = i * per_layer, i * per_layer + POOL_BLOCKS * K_BYTES
        k = pool.host[k_off : k_off + POOL_BLOCKS * K_BYTES].view(POOL_BLOCKS, K_BYTES)
        v = pool.host[v_off : v_off + POOL_BLOCKS * V_BYTES].view(POOL_BLOCKS, V_BYTES)
        caches[name] = (k, v)
        addrs[name] = (pool.engine_addr + k_off, pool.engine_addr + v_off)
    return FakeOffloadManager(list(NAMES), caches, addrs, (K_BYTES, V_BYTES), POOL_BLOCKS)


def prefill_caches() -> tuple[dict[str, SourceLayout], list[tuple[int, int]], list[Any]]:
    """One Prefill rank's caches (MLA: the same on every rank), filled with the pattern."""
    layouts, regions, keep = {}, [], []
    for i, name in enumerate(NAMES):
        comps = []
        for c, nbytes in enumerate((K_BYTES, V_BYTES, I_BYTES)):
            t = torch.stack([torch.from_numpy(pattern(i, c, b, nbytes)) for b in range(P_BLOCKS)])
            keep.append(t)
            regions.append((t.data_ptr(), t.numel()))
            comps.append(TensorComponent(t.data_ptr(), nbytes, num_blocks=P_BLOCKS))
        layouts[name] = SourceLayout(name, main=(comps[0], comps[1]), indexer=comps[2])
    return layouts, regions, keep


def options(**extra: Any) -> Rd2hOptions:
    return Rd2hOptions.parse({
        "transport": "memfabric", "memfabric_store_url": extra.pop("store"),
        "host": "127.0.0.1", "device_events": "cpu",
        "deadlines": {"request_s": DEADLINE_S, "layer_ack_s": DEADLINE_S,
                      "heartbeat_ivl_s": 0}, **extra,
    })


def facts(side: str, rank: int, kv_port: int) -> EngineFacts:
    return EngineFacts(side=side, kv_port=kv_port, global_dp_rank=0, tp_size=2,  # type: ignore[arg-type]
                       tp_rank=rank, engine_id="engine-d", block_size=16,
                       group_layer_names=(tuple(NAMES),), local_rank=rank)


@pytest.fixture
def rig() -> Iterator[dict[str, Any]]:
    net = FakeMemFabricNetwork()
    store = f"tcp://127.0.0.1:{free_ports(1)}"
    start_config_store(store, library=net.process())
    pool = DoublyMappedPool(LAYERS * POOL_BLOCKS * (K_BYTES + V_BYTES))
    workers: list[Any] = []
    yield {"net": net, "store": store, "pool": pool, "workers": workers}
    for w in workers:
        w.shutdown()


def test_two_decode_ranks_pull_into_the_shared_pool_over_memfabric(rig: dict[str, Any]) -> None:
    net, pool = rig["net"], rig["pool"]
    kv_port = free_ports(2)
    manager = make_manager(pool)
    libs, decoders, indexers = [], [], []
    group = InMemoryExchangeGroup(2)
    for d in range(2):
        idx = {name: torch.full((D_IDX_BLOCKS, I_BYTES), SENTINEL, dtype=torch.uint8)
               for name in NAMES}
        dest = SparseKvPoolDestinations(manager, indexer_caches=idx)
        lib = net.process()
        w = build_decode_worker(options(store=rig["store"], destinations="sparse_kv_pool"),
                                facts("decode", d, kv_port), dest, exchange=group.member(d),
                                overrides={"memfabric_library": lib})
        rig["workers"].append(w)
        libs.append(lib)
        decoders.append(w)
        indexers.append(idx)

    # What each Decode rank registered with MemFabric: the pool as the engine sees it
    # (host_base_addrs, never the host tensors' own addresses) and its own indexer.
    for d, lib in enumerate(libs):
        got = {c.args for c in lib.calls if c.name == "register_memory"}
        pool_regions = {(k, K_BYTES * POOL_BLOCKS) for k, _ in manager.host_base_addrs.values()}
        pool_regions |= {(v, V_BYTES * POOL_BLOCKS) for _, v in manager.host_base_addrs.values()}
        own = {(t.data_ptr(), t.numel()) for t in indexers[d].values()}
        assert got == pool_regions | own
        init = next(c for c in lib.calls if c.name == "initialize")
        assert init.args[2:4] == ("Decode", d)  # role, device (the rank's local rank)

    for w in decoders:
        w.bind_connector_metadata(StepPlan(loads=(DecodeLoad(RID, D_MAIN, D_IDX),)))
    layouts, regions, keep = prefill_caches()
    prefills = []
    for p in range(2):
        w = build_prefill_worker(options(store=rig["store"]), facts("prefill", p, kv_port),
                                 layouts, regions,
                                 overrides={"memfabric_library": net.process()})
        rig["workers"].append(w)
        prefills.append(w)
        w.bind_connector_metadata(StepPlan(sends=(PrefillSend(
            RID, external_request_id(RID), DecodeEndpoint("127.0.0.1", kv_port, 2, "engine-d"),
            P_IDS, P_IDS, 0, 0, final=True),)))
        for n, name in enumerate(NAMES, 1):
            w.save_kv_layer(name)  # as on_kv_cache_written: one announcement per layer
            assert w.layers_announced == n
        w.wait_for_save()  # vLLM's, after the forward

    results: dict[int, Any] = {}

    def step(d: int) -> None:  # the Decode ranks step together (TP exchange)
        finished: frozenset[str] = frozenset()
        failed: frozenset[str] = frozenset()
        end = time.monotonic() + DEADLINE_S
        while RID not in finished and time.monotonic() < end:
            res = decoders[d].get_transfer_results(())
            finished, failed = finished | res.finished_recving, failed | res.failed_recving
            time.sleep(0.02)
        results[d] = (finished, failed, decoders[d].stats)

    threads = [threading.Thread(target=step, args=(d,)) for d in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S + 5)
    for d in range(2):
        finished, failed, stats = results[d]
        assert RID in finished and not failed, (d, stats)
        assert stats.layers_failed == 0
    end = time.monotonic() + DEADLINE_S
    pending = set(range(2))
    while pending and time.monotonic() < end:  # every announcement answered on Prefill
        pending = {p for p in pending
                   if RID not in prefills[p].get_transfer_results([RID]).finished_sending}
        time.sleep(0.02)
    assert not pending and all(p.requests_failed == 0 for p in prefills)

    # Every main block landed once in the shared pool (read through the host tensors).
    for i, name in enumerate(NAMES):
        k, v = manager.host_kv_caches[name]
        for p_blk, d_blk in zip(P_IDS, D_MAIN):
            assert np.array_equal(k[d_blk].numpy(), pattern(i, 0, p_blk, K_BYTES))
            assert np.array_equal(v[d_blk].numpy(), pattern(i, 1, p_blk, V_BYTES))
        untouched = sorted(set(range(POOL_BLOCKS)) - set(D_MAIN))
        assert (k[untouched] == SENTINEL).all() and (v[untouched] == SENTINEL).all()
        for d in range(2):  # the indexer: every rank holds all of it
            for p_blk, d_blk in zip(P_IDS, D_IDX):
                assert np.array_equal(indexers[d][name][d_blk].numpy(),
                                      pattern(i, 2, p_blk, I_BYTES))

    # The two ranks split main KV: disjoint byte ranges that together cover it.
    pool_lo = pool.engine_addr
    pool_hi = pool_lo + LAYERS * POOL_BLOCKS * (K_BYTES + V_BYTES)
    shares = []
    for lib in libs:
        spans = set()
        for c in lib.calls:
            if c.name == "batch_transfer_sync_read":
                _, local, _, lengths, _ = c.args
                spans |= {(a, n) for a, n in zip(local, lengths) if pool_lo <= a < pool_hi}
        shares.append(spans)
    assert shares[0] and shares[1]
    bytes0 = {a + j for a, n in shares[0] for j in range(n)}
    bytes1 = {a + j for a, n in shares[1] for j in range(n)}
    assert not bytes0 & bytes1
    assert len(bytes0 | bytes1) == LAYERS * len(D_MAIN) * (K_BYTES + V_BYTES)
    del keep
