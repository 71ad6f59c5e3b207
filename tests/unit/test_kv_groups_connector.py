"""Several KV cache groups through ``SfaRemoteD2HConnector`` (issue #28), with vLLM's
real config objects and real bytes over the ``inproc`` transport.

A Gemma-3-style engine: layers 0 and 2 in a full-attention group, layers 1 and 3 in a
sliding-window group, each group with its own block table. Prefill's and Decode's
tables differ per group, and Decode's sliding group starts with vLLM's null block
(block 0) for the positions outside its window. The test shows where each layer's
KV lands: every layer in its own group's Decode blocks, from its own group's Prefill
blocks, and nothing into the null block. Before the fix, every layer read the first
group's blocks (the sliding layers' KV landed in the full group's Decode blocks and
Decode's sliding blocks kept whatever they held: wrong tokens, HTTP 200).
"""

from __future__ import annotations

import gc

import pytest

pytest.importorskip("vllm")
import test_vllm_connector as base
import torch
from test_vllm_connector import (  # noqa: F401 (fixtures)
    SUFFIX_D,
    SUFFIX_P,
    URL,
    memory_control,
    metaserver,
    request,
    scheduler_output,
    tp_group,
    vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput

BS, NB, HEADS, HEAD = 4, 24, 2, 8
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
FULL, SLIDING = [NAMES[0], NAMES[2]], [NAMES[1], NAMES[3]]
WINDOW = 2 * BS


def two_groups() -> KVCacheConfig:
    full = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD,
                             dtype=torch.float32)
    sliding = SlidingWindowSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD,
                                dtype=torch.float32, sliding_window=WINDOW)
    page = full.page_size_bytes
    return KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=[KVCacheTensor(size=page * NB, layers=[n], layer_stride=page * NB,
                                        block_stride=page) for n in NAMES],
        kv_cache_groups=[KVCacheGroupSpec(FULL, full), KVCacheGroupSpec(SLIDING, sliding)],
    )


def _caches(seed: int | None) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout: ``[2, num_blocks, block_size, heads, head]`` per layer."""
    gen = torch.Generator().manual_seed(seed or 0)
    return {n: (torch.randn(2, NB, BS, HEADS, HEAD, generator=gen) if seed is not None
                else torch.zeros(2, NB, BS, HEADS, HEAD)) for n in NAMES}


def _blocks(*groups: tuple[int, ...]) -> KVCacheBlocks:
    out = []
    for ids in groups:
        row = []
        for i in ids:
            b = KVCacheBlock(i)
            b.is_null = i == 0
            row.append(b)
        out.append(row)
    return KVCacheBlocks(tuple(out))


@pytest.fixture
def engines(tp_group, memory_control, metaserver):  # noqa: F811
    extra = {"transport": "inproc", "deadlines": {"layer_ack_s": 10.0, "meta_ack_s": 10.0}}
    d_cfg, p_cfg = vllm_config("kv_consumer", extra), vllm_config("kv_producer", extra)
    conns = [base.connector(cfg, role, two_groups(), **memory_control[1])
             for cfg in (d_cfg, p_cfg)
             for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)]
    d_sched, d_work, p_sched, p_work = conns
    d_caches, p_caches = _caches(None), _caches(11)
    d_work.register_kv_caches(d_caches)
    p_work.register_kv_caches(p_caches)
    gc.collect()
    yield d_sched, p_sched, d_work, p_work, d_caches, p_caches
    for conn in conns:
        conn.shutdown()


def _transfer(engines, name: str, prompt: int, d_groups, p_groups):
    """One request through both connectors (Decode admits it with ``d_groups``, Prefill
    computes the whole prompt in one step with ``p_groups``, announcing every layer);
    returns Prefill's step plan once Decode answered every layer."""
    d_sched, p_sched, d_work, p_work, _, _ = engines
    d_rid, p_rid = name + SUFFIX_D, name + SUFFIX_P
    req = request(d_rid, prompt, {"do_remote_prefill": True, "metaserver": URL})
    assert d_sched.get_num_new_matched_tokens(req, 0) == (prompt, True)
    d_sched.update_state_after_alloc(req, _blocks(*d_groups), prompt)
    d_work.bind_connector_metadata(d_sched.build_connector_meta(scheduler_output()))
    d_sched.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=d_work.build_connector_worker_meta()))
    post = base.RecordingMetaserver.made[0].posts[-1][2]
    preq = request(p_rid, prompt, post)
    p_sched.update_state_after_alloc(preq, _blocks(*p_groups), 0)
    plan = p_sched.build_connector_meta(scheduler_output(
        [NewRequestData.from_request(preq, tuple(map(list, p_groups)))],
        counts={p_rid: prompt}))
    p_work.bind_connector_metadata(plan)
    for layer in NAMES:
        p_work.save_kv_layer(layer, None, None)
    for i in range(len(NAMES)):
        p_work.wait_for_layer_reuse(i)
    assert d_work.get_transfer_results(set()).finished_recving == {d_rid}
    return plan


def test_each_layer_lands_in_its_own_groups_blocks(engines) -> None:
    d_sched, _, d_work, _, d_caches, p_caches = engines
    prompt = 5 * BS - 1  # 5 blocks, the last partial
    d_full, d_slide = (3, 4, 5, 6, 7), (0, 0, 0, 12, 13)  # 3 blocks outside the window
    p_full, p_slide = (14, 15, 16, 17, 18), (19, 20, 21, 22, 23)
    assert d_sched.get_loaded_kv_cache_group_ids(None) == (0, 1)
    _transfer(engines, "g-1", prompt, (d_full, d_slide), (p_full, p_slide))

    for name in FULL:  # every block of the prompt, from Prefill's full-group blocks
        torch.testing.assert_close(d_caches[name][:, list(d_full)],
                                   p_caches[name][:, list(p_full)], rtol=0, atol=0)
    for name in SLIDING:  # the window's blocks only, from Prefill's sliding-group blocks
        torch.testing.assert_close(d_caches[name][:, [12, 13]], p_caches[name][:, [22, 23]],
                                   rtol=0, atol=0)
    untouched = {n: [b for b in range(NB) if b not in
                     (d_full if n in FULL else (12, 13))] for n in NAMES}
    for name, rest in untouched.items():  # the null block 0 and every other block
        assert not d_caches[name][:, rest].any(), name
    stats = d_work.get_kv_connector_stats().data
    page = 2 * BS * HEADS * HEAD * 4
    assert stats["bytes_pulled"] == (2 * 5 + 2 * 2) * page


def test_prefill_announces_no_block_it_no_longer_holds(engines) -> None:
    """A Prefill prefix hit gives its sliding group null blocks at the head: those
    positions are not announced (Decode holds none there either)."""
    *_, d_caches, p_caches = engines
    prompt = 6 * BS
    d_full, d_slide = (1, 2, 3, 4, 5, 6), (0, 0, 0, 0, 9, 10)
    p_full, p_slide = (11, 12, 13, 14, 15, 16), (0, 0, 19, 20, 21, 22)
    plan = _transfer(engines, "g-2", prompt, (d_full, d_slide), (p_full, p_slide))
    (send,) = plan.plan.sends
    assert send.groups == ((0, p_full), (2, (19, 20, 21, 22)))
    for name in SLIDING:
        torch.testing.assert_close(d_caches[name][:, [9, 10]], p_caches[name][:, [21, 22]],
                                   rtol=0, atol=0)
        assert not d_caches[name][:, 0].any()
