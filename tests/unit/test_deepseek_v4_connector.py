"""DeepSeek-V4's caches through ``SfaRemoteD2HConnector`` (issue #40), block selection from
vLLM's own KV cache manager, real bytes over the ``inproc`` transport.

The tiny DeepSeek-V4's seven groups as vLLM 0.32 builds them for a real engine
(``test_mla_variants.dsv4_groups``): four window caches (window 128, 64 tokens a
block), one compressed group (256 tokens a block: the C4 indexer cache, the C4 and the
C128 compressed latents) and the compressor states (windows 8 and 128, blocks of 4 and
8). The caches are laid out as that engine's worker registered them (read from a real
engine started here): one block pool, a 47,808-byte page per block for every layer,
each raw buffer shared by one layer of each group (a block belongs to one group at a
time), each layer a view of its own shape (``[blocks, 64, 584]`` bytes for a window
cache, ``[blocks, 4, 2048]`` float32 for a compressor state, ...).

Each side's blocks are allocated by a ``KVCacheManager`` built on that config, as
vLLM's scheduler allocates them: Prefill a prompt's tokens (in one step, or in chunks,
its out-of-window blocks freed between them), Decode the prompt as tokens loaded from
outside (``num_external_computed_tokens``), its out-of-window positions vLLM's null
block. Prefill announces every group's completed blocks in that group's own block size,
after each step's forward (V4's kernels write its caches with no per-layer hook);
Decode reads each position it holds from the same position of Prefill's table.

What is proven: every block Decode holds for the request receives the whole page of
Prefill's block at the same position of the same group, and nothing else of Decode's
memory changes (vLLM's null block included), on prompts that end inside a block, on a
block boundary of every group, shorter than a window, and across chunks.
"""

from __future__ import annotations

import gc

import pytest

pytest.importorskip("vllm")
import test_vllm_connector as base
import torch
from test_mla_variants import dsv4_groups
from test_vllm_connector import (  # noqa: F401 (fixtures)
    SUFFIX_D,
    SUFFIX_P,
    URL,
    cached_reqs,
    memory_control,
    metaserver,
    request,
    scheduler_output,
    tp_group,
    vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.outputs import KVConnectorOutput

NB = 192  # blocks per side: a 300-token prompt takes 135 of Prefill's
PAGE = 47808  # bytes per block of every layer, as the engine's worker laid them out
GROUPS = dsv4_groups()
# Each cache layer's view of its page, as the engine's worker bound it.
VIEWS = {
    **{f"model.layers.{i}.attn.swa_cache": ((64, 584), torch.uint8) for i in range(4)},
    "model.layers.1.attn.indexer.k_cache": ((64, 132), torch.uint8),
    "model.layers.1.attn": ((64, 584), torch.uint8),
    "model.layers.2.attn": ((2, 584), torch.uint8),
    "model.layers.1.attn.indexer.compressor.state_cache": ((4, 512), torch.float32),
    "model.layers.1.attn.compressor.state_cache": ((4, 2048), torch.float32),
    "model.layers.2.attn.compressor.state_cache": ((8, 1024), torch.float32),
}
GROUP_OF = {n: i for i, g in enumerate(GROUPS) for n in g.layer_names}
# Raw buffer t holds layer t of every group that has one (vLLM's hybrid layout).
SHARING = [[g.layer_names[t] for g in GROUPS if t < len(g.layer_names)]
           for t in range(max(len(g.layer_names) for g in GROUPS))]
assert sorted(n for names in SHARING for n in names) == sorted(VIEWS)


def _config(scheduler: bool) -> KVCacheConfig:
    """The engine's config; the scheduler's view names each group by one layer's spec
    (vLLM's scheduler config), the worker's by the aggregate."""
    groups = [KVCacheGroupSpec(g.layer_names, next(iter(g.kv_cache_spec.kv_cache_specs
                                                        .values())))
              if scheduler and hasattr(g.kv_cache_spec, "kv_cache_specs") else g
              for g in GROUPS]
    return KVCacheConfig(num_blocks=NB, kv_cache_groups=groups, kv_cache_tensors=[
        KVCacheTensor(size=NB * PAGE, layers=names, layer_stride=NB * PAGE,
                      block_stride=PAGE) for names in SHARING])


def _manager() -> KVCacheManager:
    register_all_kvcache_specs(None)
    return KVCacheManager(_config(scheduler=True), max_model_len=1024,
                          scheduler_block_size=256, hash_block_size=256,
                          enable_caching=False)


def _caches(seed: int | None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The layers' views and, per layer, its raw ``[NB, PAGE]`` byte buffer (shared with
    one layer of each other group)."""
    gen = torch.Generator().manual_seed(seed or 0)
    views, raw_of = {}, {}
    for names in SHARING:
        raw = (torch.randint(0, 256, (NB, PAGE), generator=gen, dtype=torch.uint8)
               if seed is not None else torch.zeros(NB, PAGE, dtype=torch.uint8))
        for name in names:
            shape, dtype = VIEWS[name]
            elem = torch.empty((), dtype=dtype).element_size()
            typed = raw.view(-1).view(dtype)
            views[name] = torch.as_strided(typed, (NB, *shape),
                                           (PAGE // elem, shape[1], 1))
            raw_of[name] = raw
    return views, raw_of


def _engine_config(role: str):
    extra = {"transport": "inproc", "deadlines": {"layer_ack_s": 10.0, "meta_ack_s": 10.0}}
    cfg = vllm_config(role, extra)
    object.__setattr__(cfg.cache_config, "cache_dtype", "fp8_ds_mla")  # the model's own
    return cfg


@pytest.fixture
def engines(tp_group, memory_control, metaserver):  # noqa: F811
    conns = [base.connector(_engine_config(role), kind,
                            _config(kind == KVConnectorRole.SCHEDULER), **memory_control[1])
             for role in ("kv_consumer", "kv_producer")
             for kind in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)]
    d_sched, d_work, p_sched, p_work = conns
    (d_views, d_raw), (p_views, p_raw) = _caches(None), _caches(7)
    d_work.register_kv_caches(d_views)
    p_work.register_kv_caches(p_views)
    gc.collect()
    yield d_sched, d_work, p_sched, p_work, d_raw, p_raw
    for conn in conns:
        conn.shutdown()


def _ids(blocks) -> tuple[list[int], ...]:
    return tuple(list(g) for g in blocks.get_block_ids())


def _transfer(engines, rid: str, prompt: int, chunks: list[int]) -> tuple:
    """Decode admits the request (its blocks from its manager), Prefill computes it in
    ``chunks`` (its blocks from its own manager, step by step); returns both sides'
    final block tables and Prefill's sends."""
    d_sched, d_work, p_sched, p_work, _, _ = engines
    assert sum(chunks) == prompt
    d_mgr, p_mgr = _manager(), _manager()
    dreq = request(rid + SUFFIX_D, prompt, {"do_remote_prefill": True, "metaserver": URL})
    assert d_sched.get_num_new_matched_tokens(dreq, 0) == (prompt, True)
    new = d_mgr.allocate_slots(dreq, 0, num_external_computed_tokens=prompt,
                               delay_cache_blocks=True)
    assert new is not None
    d_sched.update_state_after_alloc(dreq, d_mgr.get_blocks(dreq.request_id), prompt)
    d_work.bind_connector_metadata(d_sched.build_connector_meta(scheduler_output()))
    d_sched.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=d_work.build_connector_worker_meta()))
    post = base.RecordingMetaserver.made[0].posts[-1][2]

    preq = request(rid + SUFFIX_P, prompt, post)
    p_sched.on_new_request(preq)
    assert preq.num_prompt_tokens == prompt  # no recurrent state: nothing left to Decode
    sends = []
    for step, count in enumerate(chunks):
        new = p_mgr.allocate_slots(preq, count)
        assert new is not None
        ids = _ids(new)
        if step == 0:
            p_sched.update_state_after_alloc(preq, p_mgr.get_blocks(preq.request_id), 0)
            out = scheduler_output([NewRequestData.from_request(preq, ids)],
                                   counts={preq.request_id: count})
        else:
            out = scheduler_output(cached=cached_reqs(
                [(preq.request_id, ids, preq.num_computed_tokens)]),
                counts={preq.request_id: count})
        plan = p_sched.build_connector_meta(out)
        sends.extend(plan.plan.sends)
        p_work.bind_connector_metadata(plan)
        before = p_work._role.layers_announced
        # Were vLLM to call the per-layer hook, nothing goes before the forward's end.
        p_work.save_kv_layer("model.layers.1.attn", None, None)
        assert p_work._role.layers_announced == before
        p_work.wait_for_save()
        preq.num_computed_tokens += count
    for i in range(len(VIEWS)):
        p_work.wait_for_layer_reuse(i)
    assert d_work.get_transfer_results(set()).finished_recving == {dreq.request_id}
    return d_mgr.get_block_ids(dreq.request_id), p_mgr.get_block_ids(preq.request_id), sends


def _check_bytes(d_ids, p_ids, d_raw, p_raw) -> int:
    """Every block Decode holds is Prefill's whole page at the same position of the same
    group; nothing else of Decode's memory changed. Returns the bytes Decode holds for
    the request."""
    held, written = 0, {}
    for name in VIEWS:
        g = GROUP_OF[name]
        pairs = [(d, p) for d, p in zip(d_ids[g], p_ids[g]) if d != 0]
        assert pairs, f"decode holds no block of {name}"
        assert all(p != 0 for _, p in pairs), f"{name}: prefill dropped a block decode holds"
        d_blocks, p_blocks = [d for d, _ in pairs], [p for _, p in pairs]
        torch.testing.assert_close(d_raw[name][d_blocks], p_raw[name][p_blocks],
                                   rtol=0, atol=0, msg=f"{name} (group {g})")
        written.setdefault(id(d_raw[name]), (d_raw[name], set()))[1].update(d_blocks)
        held += len(d_blocks) * PAGE
    for raw, blocks in written.values():
        rest = [b for b in range(NB) if b not in blocks]
        assert not raw[rest].any(), "a block decode does not hold changed"
    return held


@pytest.mark.parametrize(("prompt", "chunks"), [
    (300, [300]),  # inside a block of every group
    (256, [256]),  # on a block boundary of every group
    (77, [77]),  # shorter than the window: every window block held
    (300, [128, 128, 44]),  # in chunks: out-of-window blocks freed between them
    (520, [200, 320]),
])
def test_every_block_decode_holds_gets_prefills_bytes(engines, prompt, chunks) -> None:
    *_, d_raw, p_raw = engines
    d_ids, p_ids, sends = _transfer(engines, f"v4-{prompt}-{len(chunks)}", prompt, chunks)
    assert sends[-1].final and not any(s.final for s in sends[:-1])
    held = _check_bytes(d_ids, p_ids, d_raw, p_raw)
    # Decode holds the window's tail of each sliding group, every compressed block.
    assert [sum(b != 0 for b in ids) for ids in d_ids] == [
        *[-(-prompt // 64) - max(0, prompt - 127) // 64] * 4, -(-prompt // 256),
        -(-prompt // 4) - max(0, prompt - 7) // 4, -(-prompt // 8) - max(0, prompt - 127) // 8]
    stats = engines[1].get_kv_connector_stats().data
    assert stats["bytes_pulled"] == held


def test_each_group_is_announced_in_its_own_block_size(engines) -> None:
    """A 300-token prompt in chunks of 128, 128 and 44: each step announces each group's
    blocks completed in it, counted in that group's tokens per block."""
    *_, sends = _transfer(engines, "v4-sizes", 300, [128, 128, 44])
    spans = [[(start, start + len(ids)) for start, ids in s.groups] for s in sends]
    # Step 1 (tokens 0-127): window blocks 0-1, no compressed block, state blocks 0-31
    # and 0-15; step 2 (128-255): 2-3, block 0, 32-63, 16-31; step 3: the rest.
    assert spans[0] == [(0, 2)] * 4 + [(0, 0), (0, 32), (0, 16)]
    assert spans[1] == [(2, 4)] * 4 + [(0, 1), (32, 64), (16, 32)]
    assert spans[2] == [(4, 5)] * 4 + [(1, 2), (64, 75), (32, 38)]
